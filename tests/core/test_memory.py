"""The memory probe's device detection: a CPU host never imports torch to learn it has no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from packserve.core.memory import NVIDIA_DRIVER_PATHS, mapped_file_bytes, nvidia_driver

NO_DRIVER = not any(Path(p).exists() for p in NVIDIA_DRIVER_PATHS)


def test_no_driver_means_no_cuda(tmp_path: Path) -> None:
    assert nvidia_driver((str(tmp_path / "nvidiactl"),)) is False


@pytest.mark.skipif(not NO_DRIVER, reason="this host has NVIDIA's driver")
def test_an_idle_llama_only_server_on_a_cpu_host_imports_no_engine_nor_numpy(
        tmp_path: Path) -> None:
    code = (
        "import sys\n"
        "from packserve.config import load_config\n"
        "from packserve.server import build_scheduler\n"
        "config = load_config(None, only_models=['smollm2-135m-instruct'])\n"
        "config = config.model_copy(update={'server': config.server.model_copy(\n"
        f"    update={{'data_dir': {str(tmp_path)!r}}})}})\n"
        "assert config.models[0].device == 'auto'\n"
        "from packserve.api.app import create_app\n"
        "from packserve.server import build_telemetry\n"
        "scheduler = build_scheduler(config)\n"
        "create_app(scheduler, build_telemetry(config, scheduler))\n"
        "print(sorted(m for m in ('torch', 'sentence_transformers', 'transformers', 'numpy',\n"
        "                         'llama_cpp') if m in sys.modules))\n")
    # In fresh interpreters (this test process has imported torch long ago): a first start
    # reads the GGUF's facts (the gguf library brings numpy), a restart finds them cached.
    first, restart = (subprocess.run([sys.executable, "-c", code], capture_output=True,
                                     text=True, timeout=120, check=True) for _ in range(2))
    assert first.stdout.strip() == "['numpy']", first.stderr
    assert restart.stdout.strip() == "[]", restart.stderr


def test_settle_freezes_the_live_objects_once_per_new_library() -> None:
    # In a fresh interpreter: freezing is process-wide.
    code = (
        "import gc\n"
        "from packserve.core.memory import SystemProbe\n"
        "probe = SystemProbe()\n"
        "import json, decimal  # a 'library' imported before the first load\n"
        "probe.settle()\n"
        "frozen = gc.get_freeze_count()\n"
        "probe.settle()  # nothing new imported: nothing more frozen\n"
        "assert gc.get_freeze_count() == frozen > 0, frozen\n")
    subprocess.run([sys.executable, "-c", code], timeout=60, check=True)


MAPS = """\
7f0350200000-7f03558a9000 r--p 00000000 fe:00 5488650    /models/minilm/model.safetensors
7f0350100000-7f0350200000 r--p 00000000 fe:00 5488651    /models/minilm/1_Pooling/x (deleted)
7f0340000000-7f0341000000 r--p 00000000 fe:00 5488652    /models/minilm-other/model.safetensors
7f0360000000-7f0364000000 rw-p 00000000 00:00 0
7f0364000000-7f0365000000 rw-s 00000000 00:01 1234       /dev/zero (deleted)
7f0365000000-7f0366000000 rw-s 00000000 00:19 99         /dev/shm/ray_object_store
7f035f901000-7f035f93d000 r--p 00000000 fe:00 5374785    /lib/libsafetensors.so
7ffd1c5e3000-7ffd1c604000 rw-p 00000000 00:00 0                          [stack]
"""


def test_mapped_file_bytes_sums_the_mappings_of_a_models_files(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(MAPS)
    # Its weights and a deleted file under its directory; not a sibling directory whose name
    # starts alike, shared memory, libraries or anonymous memory.
    assert mapped_file_bytes(Path("/models/minilm"), str(maps)) == (
        0x7f03558a9000 - 0x7f0350200000) + (0x7f0350200000 - 0x7f0350100000)
    assert mapped_file_bytes(Path("/models/minilm/model.safetensors"), str(maps)) == (
        0x7f03558a9000 - 0x7f0350200000)
    assert mapped_file_bytes(Path("/models/none"), str(maps)) == 0


def test_a_symlinked_weights_file_counts_as_its_target(tmp_path: Path) -> None:
    """A Hugging Face cache's snapshot holds symlinks into its blobs: the process maps the
    blob, whose name is outside the model's directory, so it is found by device and inode."""
    blob = tmp_path / "blobs" / "0a1b2c"
    blob.parent.mkdir()
    blob.write_bytes(b"weights")
    snapshot = tmp_path / "snapshots" / "main"
    snapshot.mkdir(parents=True)
    (snapshot / "model.safetensors").symlink_to(blob)
    st = blob.stat()
    device = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}"
    maps = tmp_path / "maps"
    maps.write_text(f"7f0350200000-7f0350300000 r--p 00000000 {device} {st.st_ino}    {blob}\n"
                    + MAPS)
    assert mapped_file_bytes(snapshot, str(maps)) == 0x100000
    assert mapped_file_bytes(snapshot / "model.safetensors", str(maps)) == 0x100000
