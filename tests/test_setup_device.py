"""scripts/setup.sh picks the build that fits the machine (scripts/detect-device.sh), read
through `setup.sh --plan`, which prints the plan and installs nothing. A fake `nvidia-smi` (a
script printing canned output) stands in for NVIDIA's driver; PATH holds only it and the system's
own folders, so the real machine's tools (an nvcc in /usr/local/bin) do not leak in."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def plan(tmp_path: Path, *, smi: str | None = None, nvcc: bool = True, df: str | None = None,
         env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`scripts/setup.sh --plan --dev` with `smi` as nvidia-smi's script body (None: none on
    PATH), a fake nvcc on PATH unless `nvcc` is False, and `df` as df's body (None: the
    system's)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    tools = {"nvidia-smi": smi, "nvcc": "echo nvcc 13.0" if nvcc else None, "df": df}
    for name, body in tools.items():
        if body is not None:
            (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
            (bin_dir / name).chmod(0o755)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PACKSERVE_")}
    clean.update({"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path),
                  "PACKSERVE_CUDA_HOME": str(tmp_path / "no-cuda"),
                  "PACKSERVE_WHEEL_CACHE": "/cache", **(env or {})})
    return subprocess.run(["bash", "scripts/setup.sh", "--plan", "--dev"], cwd=ROOT, env=clean,
                          capture_output=True, text=True, timeout=60, check=False)


def fields(run: subprocess.CompletedProcess[str]) -> dict[str, str]:
    assert run.returncode == 0, run.stderr
    return dict(line.split(": ", 1) for line in run.stdout.splitlines())


H200 = "echo 9.0"


def test_no_driver_means_the_cpu_build_and_no_cuda_download(tmp_path: Path) -> None:
    run = plan(tmp_path)
    got = fields(run)
    assert got["build"] == "cpu"
    assert got["reason"] == "no NVIDIA driver (no nvidia-smi on PATH)"
    assert "packserve setup: cpu build: no NVIDIA driver" in run.stderr
    assert "GGML_CUDA" not in got["llama-server"]
    assert got["llama.cpp source"] == "llama-cpp-python 0.3.36 sdist"
    assert "torch==2.13.0+cpu" in got["torch (--dev)"]
    assert "cu130" not in run.stdout and "nvcc" not in got


def test_a_driver_that_answers_means_the_cuda_build_for_its_card(tmp_path: Path) -> None:
    cpu = fields(plan(tmp_path / "cpu"))
    got = fields(plan(tmp_path, smi=H200))
    assert got["build"] == "cuda"
    assert got["reason"] == ("an NVIDIA driver answers (nvidia-smi: compute capability 9.0); "
                             "CUDA architecture 90")
    assert got["cuda_arch"] == "90"
    assert got["nvcc"] == str(tmp_path / "bin" / "nvcc")
    assert "-DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 " in got["llama-server"]
    # the same CPU flags besides, and a cache of its own
    assert got["llama-server"].startswith(cpu["llama-server"].split(" -DBUILD_SHARED_LIBS")[0])
    assert "-DGGML_CUDA" not in cpu["llama-server"]
    assert got["llama-server cache"] != cpu["llama-server cache"]
    assert got["torch (--dev)"] == "torch==2.13.0+cu130 from https://download.pytorch.org/whl/cu130"


def test_the_architecture_can_be_overridden_and_keys_its_own_cache(tmp_path: Path) -> None:
    sm90 = fields(plan(tmp_path / "a", smi=H200))
    got = fields(plan(tmp_path / "b", smi=H200, env={"PACKSERVE_CUDA_ARCH": "120"}))
    assert got["cuda_arch"] == "120"
    assert "-DCMAKE_CUDA_ARCHITECTURES=120" in got["llama-server"]
    assert got["reason"].endswith("CUDA architecture 120 from PACKSERVE_CUDA_ARCH")
    assert got["llama-server cache"] != sm90["llama-server cache"]


@pytest.mark.parametrize(("smi", "env", "build", "reason"), [
    (H200, {"PACKSERVE_DEVICE": "cpu"}, "cpu",
     "PACKSERVE_DEVICE=cpu, although an NVIDIA driver answers "
     "(nvidia-smi: compute capability 9.0)"),
    (None, {"PACKSERVE_DEVICE": "cuda", "PACKSERVE_CUDA_ARCH": "89"}, "cuda",
     "PACKSERVE_DEVICE=cuda; CUDA architecture 89 from PACKSERVE_CUDA_ARCH"),
    ("echo 'NVIDIA-SMI has failed' >&2; exit 9", {}, "cpu",
     "nvidia-smi is on PATH but reports no GPU (no driver loaded?)"),
    ("echo 8.6; echo 9.0", {}, "cuda",  # two cards: the first one's
     "an NVIDIA driver answers (nvidia-smi: compute capability 8.6); CUDA architecture 86"),
])
def test_the_choice_and_its_reason(tmp_path: Path, smi: str | None, env: dict[str, str],
                                   build: str, reason: str) -> None:
    got = fields(plan(tmp_path, smi=smi, env=env))
    assert (got["build"], got["reason"]) == (build, reason)


def test_the_cuda_build_without_nvcc_stops_saying_so(tmp_path: Path) -> None:
    run = plan(tmp_path, smi=H200, nvcc=False)
    assert run.returncode == 1
    assert run.stdout == ""
    assert "needs the CUDA toolkit's nvcc, found neither on PATH nor in " \
        f"{tmp_path / 'no-cuda'}/bin" in run.stderr
    assert "PACKSERVE_DEVICE=cpu" in run.stderr


def test_nvcc_is_found_in_the_toolkits_prefix(tmp_path: Path) -> None:
    cuda = tmp_path / "cuda" / "bin"
    cuda.mkdir(parents=True)
    (cuda / "nvcc").write_text("#!/bin/sh\n")
    (cuda / "nvcc").chmod(0o755)
    got = fields(plan(tmp_path, smi=H200, nvcc=False,
                      env={"PACKSERVE_CUDA_HOME": str(tmp_path / "cuda")}))
    assert got["nvcc"] == str(cuda / "nvcc")


@pytest.mark.parametrize(("env", "message"), [
    ({"PACKSERVE_DEVICE": "cuda"}, "set PACKSERVE_CUDA_ARCH"),
    ({"PACKSERVE_DEVICE": "rocm"}, "PACKSERVE_DEVICE=rocm: expected cuda or cpu"),
])
def test_what_cannot_be_planned_is_refused(tmp_path: Path, env: dict[str, str],
                                           message: str) -> None:
    run = plan(tmp_path, env=env)
    assert run.returncode == 1 and message in run.stderr


def df_reporting(free_mib: int) -> str:
    """A df whose every file system has `free_mib` MiB free, in POSIX's format (`df -Pm`)."""
    return ("echo 'Filesystem 1048576-blocks Used Available Capacity Mounted on'\n"
            f"echo '/dev/fake 100000 1000 {free_mib} 1% /'")


def test_a_disk_too_small_for_the_build_is_named_before_anything_is_installed(
        tmp_path: Path) -> None:
    """The build cache is empty (PACKSERVE_WHEEL_CACHE=/cache), so llama-server would be built
    under TMPDIR: with 100 MiB free there, setup says so, with the folder and the size; where
    TMPDIR shares the checkout's disk, the build's share is added to what .venv still needs."""
    run = plan(tmp_path, df=df_reporting(100), env={"TMPDIR": str(tmp_path)})
    got = fields(run)
    assert got["disk for the llama-server build"] == f"about 450 MiB (100 MiB free in {tmp_path})"
    if os.stat(ROOT).st_dev == os.stat(tmp_path).st_dev:
        warned = re.search(f"packserve setup: warning: 100 MiB free on the disk of {ROOT}, and "
                           "this setup's .venv and .venv-clients with the llama-server build "
                           r"takes about (\d+) MiB there", run.stderr)
        assert warned and int(warned[1]) >= 450, run.stderr
    else:
        assert (f"packserve setup: warning: 100 MiB free on the disk of {tmp_path}, and "
                "building llama-server takes about 450 MiB there") in run.stderr


def test_enough_disk_gives_no_warning(tmp_path: Path) -> None:
    run = plan(tmp_path, df=df_reporting(10**6), env={"TMPDIR": str(tmp_path)})
    assert fields(run)["disk for the llama-server build"] == \
        f"about 450 MiB ({10**6} MiB free in {tmp_path})"
    assert "warning" not in run.stderr
