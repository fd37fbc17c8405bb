"""The memory probe's device detection: a CPU host never imports torch to learn it has no GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from packserve.backends.llama_server import runner_device_bytes
from packserve.core.memory import (
    DEVICE_TOTAL,
    NVIDIA_DRIVER_PATHS,
    PER_PROCESS,
    RSS,
    SystemProbe,
    family,
    in_child_pid_namespace,
    mapped_file_bytes,
    nvidia_driver,
    others_device_bytes,
)

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
        "print(sorted(m for m in ('torch', 'sentence_transformers', 'transformers', 'numpy')\n"
        "             if m in sys.modules))\n")
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


class FakeNvml:
    """NVML for one 80 GiB card: `procs` is its per-process list (None: NVML gives none)."""

    def __init__(self, procs: dict[int, int | None] | None) -> None:
        self.procs = procs
        self.other = 0  # another tenant's bytes outside the per-process list (device total)

    def memory(self, index: int) -> tuple[int, int]:
        listed = sum(v or 0 for v in (self.procs or {}).values())
        return 80 << 30, listed + self.other

    def processes(self, index: int) -> list[tuple[int, int | None]] | None:
        return None if self.procs is None else list(self.procs.items())


def probe(nvml: FakeNvml, namespaced: bool = False) -> SystemProbe:
    return SystemProbe(gpu=lambda: nvml, pid=100, namespaced=lambda: namespaced)


def test_per_process_figures_count_this_process_only() -> None:
    nvml = FakeNvml({100: 3 << 30, 200: 5 << 30})
    p = probe(nvml)
    assert p.total_bytes("cuda:0") == 80 << 30
    assert (p.used_bytes("cuda:0"), p.accounting("cuda:0")) == (3 << 30, PER_PROCESS)
    assert p.accounting("cpu") == RSS


def test_another_tenant_allocating_during_a_load_is_not_charged_to_it() -> None:
    nvml = FakeNvml({100: 1 << 30, 200: 5 << 30})
    p = probe(nvml)
    before = p.used_bytes("cuda:0")
    nvml.procs = {100: 3 << 30, 200: 9 << 30}  # the load took 2 GiB; the tenant 4 GiB more
    assert p.used_bytes("cuda:0") - before == 2 << 30


def test_a_process_with_no_context_yet_holds_nothing() -> None:
    assert probe(FakeNvml({200: 5 << 30})).used_bytes("cuda:0") == 0


@pytest.mark.parametrize(("procs", "namespaced"), [
    (None, False),                       # NVML gives no list (MIG)
    ({100: None, 200: 5 << 30}, False),  # no figure per process (some drivers)
    ({100: 1 << 30}, True),              # a container: NVML lists host pids
])
def test_without_per_process_figures_the_device_total_counts_and_says_so(
        procs: dict[int, int | None] | None, namespaced: bool) -> None:
    nvml = FakeNvml(procs)
    nvml.other = 7 << 30
    p = probe(nvml, namespaced)
    assert p.accounting("cuda:0") == DEVICE_TOTAL
    assert p.used_bytes("cuda:0") == nvml.memory(0)[1]


def test_a_runners_bytes_are_its_pids() -> None:
    nvml = FakeNvml({100: 1 << 30, 4242: 6 << 30})
    assert runner_device_bytes(4242, "cuda:0", gpu=lambda: nvml) == 6 << 30
    assert runner_device_bytes(4242, "cuda:0", gpu=lambda: FakeNvml(None)) == 0


def test_the_namespace_is_read_from_nspid(tmp_path: Path) -> None:
    for line, inside in (("NSpid:\t812\t7", True), ("NSpid:\t812", False)):
        (tmp_path / "status").write_text(f"Name:\tx\n{line}\n")
        assert in_child_pid_namespace(str(tmp_path / "status")) is inside


def test_other_processes_are_those_outside_this_one_and_its_runners(tmp_path: Path) -> None:
    for pid, ppid, comm in ((100, 1, "packserve"), (4242, 100, "llama-server"),
                            (4243, 4242, "a (weird) name"), (200, 1, "vllm")):
        (tmp_path / str(pid)).mkdir()
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({comm}) S {ppid} 1 1 0 -1\n")
    ours = family(100, tmp_path)
    assert ours == {100, 4242, 4243}
    nvml = FakeNvml({100: 1 << 30, 4242: 2 << 30, 200: 5 << 30})
    assert others_device_bytes(nvml, 0, ours) == 5 << 30
    p = SystemProbe(gpu=lambda: nvml, pid=100, namespaced=lambda: False,
                    family=lambda pid: family(pid, tmp_path))
    assert (p.others_bytes("cuda:0"), p.others_bytes("cpu")) == (5 << 30, None)
    assert others_device_bytes(FakeNvml(None), 0, ours) is None  # MIG: no list
    assert others_device_bytes(FakeNvml({100: None}), 0, ours) is None
    hidden = SystemProbe(gpu=lambda: nvml, pid=100, namespaced=lambda: True)
    assert hidden.others_bytes("cuda:0") is None  # a container: NVML's pids are the host's


def test_the_runners_pids_are_read_at_most_once_a_second() -> None:
    reads: list[int] = []
    now = [0.0]

    def ours(pid: int) -> frozenset[int]:
        reads.append(pid)
        return frozenset({pid})

    p = SystemProbe(gpu=lambda: FakeNvml({100: 1 << 30}), pid=100, namespaced=lambda: False,
                    family=ours, clock=lambda: now[0])
    for t in (0.0, 0.5, 0.99, 1.0, 1.5):
        now[0] = t
        assert p.others_bytes("cuda:0") == 0
    assert reads == [100, 100]  # at 0 and at 1


def test_a_process_nvml_lists_for_the_first_time_is_looked_up_at_once() -> None:
    """A runner started within the second is this server's at once: counted as another
    process's, it would leave the next load no room, and that load would wait for a change of
    memory that never comes."""
    listed: dict[int, int | None] = {100: 1 << 30}
    kids = {100}
    reads: list[float] = []
    now = [0.0]

    def ours(pid: int) -> frozenset[int]:
        reads.append(now[0])
        return frozenset(kids)

    p = SystemProbe(gpu=lambda: FakeNvml(listed), pid=100, namespaced=lambda: False,
                    family=ours, clock=lambda: now[0])
    assert p.others_bytes("cuda:0") == 0
    kids.add(4242)  # a runner starts and opens its context
    listed[4242] = 2 << 30
    now[0] = 0.2
    assert p.others_bytes("cuda:0") == 0  # not 2 GiB of "others"
    listed[200] = 5 << 30  # another tenant appears: looked up once, then known
    now[0] = 0.3
    assert p.others_bytes("cuda:0") == 5 << 30
    now[0] = 0.4
    assert p.others_bytes("cuda:0") == 5 << 30
    assert reads == [0.0, 0.2, 0.3]
