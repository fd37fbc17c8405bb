"""`scripts/gpu-check.sh --prepared` rehearsed on the CPU box, against stand-ins for what the GPU
machine has that this one lacks: its python3 is a venv (here the suite's own, so the check's
venv is nested in a venv, as on the card), `nvidia-smi`, NVML (`pynvml` answering for one card)
and a CUDA build of `llama-server` (a script listing CUDA0 that runs the CPU build). The run goes
to its report in $OUT, inside the seconds it was given; and the budget's skip order.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import importlib
import io
import json
import lzma
import os
import re
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[1]
GPU = ROOT / "scripts" / "gpu"
CPU_SERVER = Path(sys.prefix) / "bin" / "llama-server"

NVML_STANDIN = '''"""NVML's stand-in for the rehearsal: one card of 80 GiB, 1 GiB used."""
class NVMLError(Exception):
    pass
class _Memory:
    total = 80 << 30
    used = 1 << 30
    free = total - used
def nvmlInit(): pass
def nvmlShutdown(): pass
def nvmlDeviceGetCount(): return 1
def nvmlDeviceGetHandleByIndex(index): return index
def nvmlDeviceGetMemoryInfo(handle): return _Memory()
def nvmlDeviceGetName(handle): return "NVIDIA H200 (stand-in)"
def nvmlDeviceGetComputeRunningProcesses(handle): return []
def nvmlDeviceGetGraphicsRunningProcesses(handle): return []
def nvmlSystemGetDriverVersion(): return "580.159.03"
def nvmlSystemGetCudaDriverVersion(): return 13000
def nvmlDeviceGetCudaComputeCapability(handle): return (9, 0)
'''

# what the CUDA build answers to --list-devices; otherwise the CPU build, its layers kept there
LLAMA_STANDIN = '''#!/bin/sh
case " $* " in
  *" --list-devices "*) echo "Available devices:"
    echo "  CUDA0: NVIDIA H200 (stand-in) (143771 MiB, 143000 MiB free)"; exit 0 ;;
esac
for a in "$@"; do
  shift
  case "$a" in CUDA0) set -- "$@" none ;; *) set -- "$@" "$a" ;; esac
done
exec {cpu} "$@"
'''

NVIDIA_SMI_STANDIN = '''#!/bin/sh
echo "NVIDIA H200 (stand-in), 9.0, 580.159.03, 143771 MiB"
'''


def module(name: str) -> ModuleType:
    if str(GPU) not in sys.path:
        sys.path.insert(0, str(GPU))
    return importlib.import_module(name)


def wheel(folder: Path, name: str, version: str, files: dict[str, bytes],
          meta: str = "", entry_points: str = "") -> Path:
    """A pure-Python wheel by hand: a zip of `files` with its METADATA (plus `meta` lines),
    WHEEL, entry points and RECORD."""
    dist = f"{name}-{version}"
    files = {**files,
             f"{dist}.dist-info/METADATA": (f"Metadata-Version: 2.1\nName: {name}\n"
                                            f"Version: {version}\n{meta}").encode(),
             f"{dist}.dist-info/WHEEL": (b"Wheel-Version: 1.0\nGenerator: rehearsal\n"
                                         b"Root-Is-Purelib: true\nTag: py3-none-any\n")}
    if entry_points:
        files[f"{dist}.dist-info/entry_points.txt"] = entry_points.encode()
    record = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(data)}")
    record.append(f"{dist}.dist-info/RECORD,,")
    files[f"{dist}.dist-info/RECORD"] = ("\n".join(record) + "\n").encode()
    out = folder / f"{dist}-py3-none-any.whl"
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as zf:
        for path, data in files.items():
            zf.writestr(path, data)
    return out


def packserve_wheel(folder: Path) -> Path:
    """packserve's wheel from src/: the rehearsal is about the GPU machine, and setuptools'
    build belongs to --prepare."""
    version = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text("utf-8"),
                        re.M)
    assert version
    files = {str(path.relative_to(ROOT / "src")): path.read_bytes()
             for path in sorted((ROOT / "src" / "packserve").rglob("*"))
             if path.is_file() and "__pycache__" not in path.parts}
    return wheel(folder, "packserve", version[1], files,
                 entry_points="[console_scripts]\npackserve = packserve.cli:main\n")


def prepared_folder(folder: Path) -> Path:
    """What --prepare makes, for this interpreter: the wheels (the suite's venv has every pin,
    so only packserve's own is needed), the stand-in llama-server xz-compressed, a source tar."""
    (folder / "wheels").mkdir(parents=True)
    (folder / "gpu").mkdir()
    for path in GPU.glob("*.py"):
        (folder / "gpu" / path.name).write_bytes(path.read_bytes())
    (folder / "gpu-check.sh").write_bytes((ROOT / "scripts" / "gpu-check.sh").read_bytes())
    script = (ROOT / "scripts" / "gpu-check.sh").read_text("utf-8")
    ship = re.search(r"^ship=\((.*)\)$", script, re.M)
    assert ship
    reqs = (ROOT / "requirements.txt").read_text("utf-8").splitlines()
    pins = [line for name in ship[1].split() for line in reqs
            if line.lower().startswith(f"{name.lower()}==")]
    # and one the parent lacks, needing numpy as gguf does: numpy is never shipped, and a venv
    # made --system-site-packages from the parent venv would not see the parent's
    wheel(folder / "wheels", "rehearsal_dep", "1.0",
          {"rehearsal_dep.py": b"import numpy\n"}, meta="Requires-Dist: numpy>=1.17\n")
    pins.append("rehearsal-dep==1.0")
    (folder / "wheels" / "requirements.txt").write_text("\n".join(pins) + "\n", "utf-8")
    packserve_wheel(folder / "wheels")
    (folder / "llama-server.xz").write_bytes(
        lzma.compress(LLAMA_STANDIN.format(cpu=CPU_SERVER).encode()))
    with tarfile.open(folder / "src.tar.xz", "w:xz") as tar:
        data = b"the rehearsal ships no tests\n"
        info = tarfile.TarInfo("README")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    return folder


def stand_ins(folder: Path) -> dict[str, str]:
    """nvidia-smi on PATH and NVML on PYTHONPATH, for the environment of the run."""
    (folder / "bin").mkdir(parents=True)
    smi = folder / "bin" / "nvidia-smi"
    smi.write_text(NVIDIA_SMI_STANDIN, "utf-8")
    smi.chmod(0o755)
    (folder / "py").mkdir()
    (folder / "py" / "pynvml.py").write_text(NVML_STANDIN, "utf-8")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PACKSERVE_", "PYTHON", "VIRTUAL_ENV"))}
    env.update({"PATH": f"{folder / 'bin'}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                "PYTHONPATH": str(folder / "py"), "PYTHON": sys.executable})
    return env


def ours_running(marker: str) -> list[str]:
    found = []
    for cmd in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmd.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if marker in text:
            found.append(text)
    return found


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the suite's python is no venv")
@pytest.mark.skipif(not CPU_SERVER.exists(), reason=f"no llama-server at {CPU_SERVER}")
def test_prepared_runs_to_its_report_in_out_from_a_venv_nested_in_a_venv(tmp_path: Path) -> None:
    folder = prepared_folder(tmp_path / "prepared")
    env = stand_ins(tmp_path / "standins")
    out = tmp_path / "out"
    out.mkdir()
    seconds = 120  # room for every selected step by the skip order (`allot`)
    env.update({"OUT": str(out), "PACKSERVE_GPU_CHECK_SECONDS": str(seconds),
                "PACKSERVE_GPU_CHECK_ARGS": "--llama-shape tiny --only environment,model:llama,"
                "serve,footprint:llama,cuda_contexts,warm_vs_cold:llama,stop_server,"
                "chats_llama_server"})
    t0 = time.monotonic()
    run = subprocess.run(["bash", str(folder / "gpu-check.sh"), "--prepared", str(folder)],
                         env=env, capture_output=True, text=True, timeout=seconds + 15,
                         check=False)
    took = time.monotonic() - t0
    assert sorted(p.name for p in out.iterdir()) == ["logs.tar.xz", "report.json", "report.txt"]
    report = json.loads((out / "report.json").read_text("utf-8"))
    steps = report["steps"]
    why = json.dumps({k: v.get("error") for k, v in steps.items()}, indent=1) + run.stderr[-3000:]
    # the nested venv saw its parent's packages, and packserve from the shipped wheel
    env_step = steps["environment"]
    assert env_step["ok"], why
    assert env_step["result"]["prefix"] == str(folder / "venv")
    assert sys.prefix + "/lib/" in " ".join(env_step["result"]["site_dirs"])
    assert env_step["result"]["packserve"].startswith(str(folder / "venv"))
    assert env_step["result"]["gpu"]["name"] == "NVIDIA H200 (stand-in)"
    for name in ("model:llama", "serve", "footprint:llama", "warm_vs_cold:llama", "stop_server",
                 "chats_llama_server"):
        assert steps[name]["ok"], (name, steps[name], why)
    # the runner on "cuda:0" went warm by sleeping and its wake answered: the same process
    warm = steps["warm_vs_cold:llama"]["result"]
    assert (warm["state_after_offload"], warm["same_process"]) == ("warm", True), warm
    # on a card every step not passed is a failure, the ones not selected too
    assert run.returncode == 1
    assert "model:bert" in report["failed"] and "pytest_gpu" in report["failed"]
    assert took < seconds + 5
    with tarfile.open(out / "logs.tar.xz") as tar:
        names = set(tar.getnames())
    assert {"env-steps.txt", "venv.log", "wheels.log", "llama-server.log",
            "packserve-serve.log", "llama-server-direct.log"} <= names
    assert "footprint:llama" in (out / "report.txt").read_text("utf-8")
    with tarfile.open(out / "logs.tar.xz") as tar:
        log = tar.extractfile("wheels.log")
        assert log is not None
        # installed from the shipped wheels, its numpy the parent's
        assert b"Successfully installed rehearsal_dep-1.0" in log.read().replace(b"-dep", b"_dep")
    assert ours_running(str(folder)) == []  # no server or runner outlives the check


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the suite's python is no venv")
@pytest.mark.skipif(not CPU_SERVER.exists(), reason=f"no llama-server at {CPU_SERVER}")
def test_sigterm_ends_the_servers_and_still_leaves_the_report(tmp_path: Path) -> None:
    """SIGTERM to gpu-check.sh while packserve serves (a runner loaded): check.py stops its
    servers and their runners, writes its report saying so, and the logs are packed."""
    folder = prepared_folder(tmp_path / "prepared")
    env = stand_ins(tmp_path / "standins")
    out = tmp_path / "out"
    env.update({"OUT": str(out), "PACKSERVE_GPU_CHECK_SECONDS": "75",
                "PACKSERVE_GPU_CHECK_ARGS": "--llama-shape tiny --only environment,model:llama,"
                "serve,footprint:llama,chats_packserve,stop_server"})
    proc = subprocess.Popen(["bash", str(folder / "gpu-check.sh"), "--prepared", str(folder)],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        loaded = False
        while not loaded and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
            with contextlib.suppress(OSError, ValueError):
                steps = json.loads((out / "report.json").read_text("utf-8"))["steps"]
                loaded = bool((steps.get("footprint:llama") or {}).get("ok"))
        assert loaded, proc.stderr.read().decode() if proc.stderr else ""
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=45)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 143, err
    report = json.loads((out / "report.json").read_text("utf-8"))
    assert report["stopped"].startswith("by SIGTERM")
    assert (out / "report.txt").exists() and (out / "logs.tar.xz").exists()
    assert ours_running(str(folder)) == []  # packserve, its worker and the runner are gone


NVCC_STANDIN = '''#!/bin/sh
case "$1" in --version) echo "Cuda compilation tools, release 13.0 (stand-in)"; exit 0 ;; esac
while [ $# -gt 0 ]; do [ "$1" = -o ] && out=$2; shift; done
printf '#!/bin/sh\\nexit 0\\n' > "$out" && chmod +x "$out"
'''

# configure records its arguments; --build "builds" the stand-in llama-server
CMAKE_STANDIN = '''#!/bin/sh
case "$1" in
  --version) echo "cmake version 3.28 (stand-in)" ;;
  --build) mkdir -p "$2/bin" && cp {server} "$2/bin/llama-server" && echo "[2/2] llama-server" ;;
  *) while [ $# -gt 0 ]; do [ "$1" = -B ] && mkdir -p "$2" && b=$2; shift; done
     echo "$CPATH $CMAKE_LIBRARY_PATH" > "$b/configured" ;;
esac
'''


@pytest.mark.skipif(sys.prefix == sys.base_prefix, reason="the suite's python is no venv")
@pytest.mark.skipif(not CPU_SERVER.exists(), reason=f"no llama-server at {CPU_SERVER}")
def test_a_no_compile_folder_is_built_on_the_card_and_its_binary_comes_back_in_parts(
        tmp_path: Path) -> None:
    """The build path's plumbing, with stand-ins for nvcc and CMake (the compile itself needs
    a card's machine): the probe, the build under its time, the binary in parts under $OUT,
    installed from the build; the environment's steps in the report."""
    folder = prepared_folder(tmp_path / "prepared")
    server = folder / "llama-server.xz"
    standin = lzma.decompress(server.read_bytes())
    server.unlink()
    (folder / "llama-build").mkdir()
    (folder / "llama-build" / "cmake-flags").write_text("-DGGML_CUDA=ON -G Ninja\n", "utf-8")
    with tarfile.open(folder / "llama.cpp.tar.xz", "w:xz") as tar:
        info = tarfile.TarInfo("CMakeLists.txt")
        tar.addfile(info, io.BytesIO(b""))
    env = stand_ins(tmp_path / "standins")
    bin_dir = tmp_path / "standins" / "bin"
    (tmp_path / "server").write_bytes(standin)
    for name, text in (("nvcc", NVCC_STANDIN),
                       ("cmake", CMAKE_STANDIN.format(server=tmp_path / "server"))):
        (bin_dir / name).write_text(text, "utf-8")
        (bin_dir / name).chmod(0o755)
    cuda = tmp_path / "cuda"  # a toolkit with cuBLAS and the libcuda stub: no overlay needed
    for part in ("include/cublas_v2.h", "lib64/libcublas.so", "lib64/stubs/libcuda.so"):
        (cuda / part).parent.mkdir(parents=True, exist_ok=True)
        (cuda / part).write_bytes(b"")
    out = tmp_path / "out"
    env.update({"OUT": str(out), "PACKSERVE_CUDA_HOME": str(cuda),
                "PACKSERVE_GPU_CHECK_SECONDS": "200", "PACKSERVE_GPU_CHECK_MIN_SECONDS": "40",
                "PACKSERVE_GPU_CHECK_ARGS": "--llama-shape tiny --only environment"})
    run = subprocess.run(["bash", str(folder / "gpu-check.sh"), "--prepared", str(folder)],
                         env=env, capture_output=True, text=True, timeout=90, check=False)
    report = json.loads((out / "report.json").read_text("utf-8"))
    assert report["steps"]["environment"]["ok"], run.stderr
    assert run.returncode == 1  # the steps not selected count as failed on a card
    box = report["box_steps"]
    assert [n for n, s in box.items() if s["ok"]] == [
        "box:venv", "box:wheels", "box:build-probe", "box:build", "box:ship-binary",
        "box:llama-server", "box:source"]
    parts = sorted(out.glob("llama-server.xz.part*"))
    assert [p.name for p in parts] == ["llama-server.xz.part0"]
    assert lzma.decompress(b"".join(p.read_bytes() for p in parts)) == standin
    assert (folder / "llama-build" / "build" / "configured").exists()
    assert "box:build" in (out / "report.txt").read_text("utf-8")


def test_a_failed_environment_step_is_fatal_and_still_leaves_a_report(tmp_path: Path) -> None:
    folder = prepared_folder(tmp_path / "prepared")
    (folder / "wheels" / "requirements.txt").write_text("no-such-package==1.0\n", "utf-8")
    env = stand_ins(tmp_path / "standins")
    out = tmp_path / "out"
    env["OUT"] = str(out)
    run = subprocess.run(["bash", str(folder / "gpu-check.sh"), "--prepared", str(folder)],
                         env=env, capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 1
    assert "wheels failed" in run.stderr
    report = json.loads((out / "report.json").read_text("utf-8"))
    assert report["failed"] == ["box:wheels"]
    assert report["steps"]["box:venv"]["ok"]
    with tarfile.open(out / "logs.tar.xz") as tar:
        log = tar.extractfile("wheels.log")
        assert log is not None and b"no-such-package" in log.read()


def step(name: str, needs: float, rank: int) -> object:
    return module("check").Step(name, lambda: None, needs, 10 * needs, rank)


@pytest.mark.parametrize(("left", "rank", "later", "expect"), [
    (100.0, 0, [], 50.0),  # alone: its cap (10 x needs)
    (30.0, 0, [], 30.0),  # what is left, under its cap
    (4.0, 0, [], None),  # less than it needs
    (60.0, 3, [(40.0, 0)], 20.0),  # keeps a later, more important step's 40 s
    (44.0, 3, [(40.0, 0)], None),  # skipped: it would eat into them
    (50.0, 3, [(40.0, 3), (40.0, 4)], 50.0),  # equal or lower ranks keep nothing
    (50.0, 0, [(40.0, 0)], 50.0),  # rank 0 goes first, whatever follows
])
def test_each_step_keeps_the_needs_of_later_steps_of_a_lower_rank(
        left: float, rank: int, later: list[tuple[float, int]], expect: float | None) -> None:
    check = module("check")
    this = check.Step("this", lambda: None, 5.0, 50.0, rank)
    rest = [step(f"later{i}", needs, r) for i, (needs, r) in enumerate(later)]
    assert check.allot(left, this, rest) == expect


def test_the_steps_on_the_card_fit_one_device_command() -> None:
    """What the default budget (570 s, less the environment's ~60 s and 35 s kept for the
    cleanup) must hold: every rank-0 and rank-1 step's needs, with room to spare."""
    check = module("check")
    steps = check.Check.steps(check.Check.__new__(check.Check))
    kept = sum(s.needs for s in steps if s.rank <= 1)
    assert kept < 570 - 60 - 35 - 200
    assert [s.name for s in steps if s.fatal] == ["environment"]
