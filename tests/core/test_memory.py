"""The memory probe's device detection: a CPU host never imports torch to learn it has no GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from packserve.core.memory import NVIDIA_DRIVER_PATHS, cuda_available

NO_DRIVER = not any(Path(p).exists() for p in NVIDIA_DRIVER_PATHS)


def test_no_driver_means_no_cuda(tmp_path: Path) -> None:
    assert cuda_available((str(tmp_path / "nvidiactl"),)) is False


@pytest.mark.skipif(not NO_DRIVER, reason="this host has NVIDIA's driver")
def test_a_llama_only_scheduler_on_a_cpu_host_never_imports_torch(tmp_path: Path) -> None:
    # A fresh interpreter: this test process has imported torch long ago.
    code = (
        "import sys\n"
        "from packserve.config import load_config\n"
        "from packserve.server import build_scheduler\n"
        "config = load_config(None, only_models=['smollm2-135m-instruct'])\n"
        "config = config.model_copy(update={'server': config.server.model_copy(\n"
        f"    update={{'data_dir': {str(tmp_path)!r}}})}})\n"
        "assert config.models[0].device == 'auto'\n"
        "build_scheduler(config)\n"
        "print(sorted(m for m in ('torch', 'sentence_transformers', 'transformers')\n"
        "             if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stderr


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
