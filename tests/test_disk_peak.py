"""scripts/disk-peak.sh, which gave the disk figures in README and docs/development.md: a
command that writes a file, holds it, then deletes it shows at its peak at least the file's
size above the start, and its exit status passes through."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SIZE_MIB = 64


def test_a_file_held_then_deleted_is_the_peak_and_the_status_passes_through(
        tmp_path: Path) -> None:
    # The file is held for 2 s against samples every 0.1 s, and flushed to disk first (fsync),
    # so that df counts its blocks.
    body = (f"head -c {SIZE_MIB * 1024 * 1024} /dev/urandom > big && sync big && sleep 2 "
            "&& rm big && exit 3")
    run = subprocess.run(["bash", str(ROOT / "scripts/disk-peak.sh"), "--disk", str(tmp_path),
                          "bash", "-c", body], cwd=tmp_path, env={"DISK_PEAK_EVERY": "0.1",
                                                                  "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 3, run.stderr
    found = re.search(r"disk-peak: (-?\d+) MiB above the start at most on the disk of (\S+) ",
                      run.stderr)
    assert found, run.stderr
    assert int(found[1]) >= SIZE_MIB * 0.9, run.stderr
    assert found[2] == str(tmp_path)
    assert not (tmp_path / "big").exists()
