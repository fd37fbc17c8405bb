"""The runner module (backends.runner) on children that are shell scripts, not engines: a child
that serves, then exits on its own, is reported once, at once, with its status and its log's
last lines; one stopped by its backend is not reported; one that never serves is killed at the
start deadline; one that fails to start says why; the logs of a load are kept, the newest few."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from packserve.backends.runner import KEEP_LOGS, Child, RunnerHost
from packserve.core.backend import EngineDied, EngineExit

pytestmark = pytest.mark.process


def _host(tmp_path: Path, start_timeout_s: float = 30.0) -> RunnerHost:
    host = RunnerHost(tmp_path / "logs", start_timeout_s=start_timeout_s)
    host.start()
    return host


def _script(tmp_path: Path, body: str) -> Callable[[Path], Sequence[str]]:
    """A child that runs `body` with $1 the path of its socket (created here as a plain file to
    say it serves)."""
    exe = tmp_path / "child.sh"
    exe.write_text(f"#!/bin/sh\n{body}\n")
    exe.chmod(0o755)
    return lambda sock: [str(exe), str(sock)]


def _serving(child: Child) -> Callable[[], bool]:
    return lambda: child.socket.exists()


def _reports() -> tuple[list[EngineExit], threading.Event, Callable[[EngineExit], None]]:
    seen: list[EngineExit] = []
    done = threading.Event()

    def report(exit: EngineExit) -> None:
        seen.append(exit)
        done.set()

    return seen, done, report


def test_a_child_that_exits_on_its_own_is_reported_once_with_its_log(tmp_path: Path) -> None:
    child = Child(_host(tmp_path), "m.gguf", tmp_path / "logs" / "m")
    child.start(_script(tmp_path, 'touch "$1"\necho "loaded" >&2\nexec sleep 600'),
                _serving(child))
    seen, done, report = _reports()
    child.watch(report)
    assert child.alive() and child.pid is not None and child.rss_bytes() > 0
    pid = child.pid
    os.kill(pid, signal.SIGUSR1)  # its default action: terminate
    assert done.wait(10)
    (exit,) = seen
    assert (exit.pid, exit.signal, exit.status) == (pid, "SIGUSR1", None)
    assert exit.oom_kill is not True  # False, or None where no cgroup v2 file can be read
    assert exit.cause == "SIGUSR1" and exit.log == str(child.log)
    assert "loaded" in exit.log_tail and Path(exit.log).read_text().startswith("packserve: ")
    assert not child.alive() and child.exited(0) == exit and child.rss_bytes() == 0
    child.watch(report)  # armed again after its death: reported at once, to the new report
    child.stop()
    assert len(seen) == 2 and Path(exit.log).is_file()  # stopped: its log stays


def test_a_child_stopped_by_its_backend_is_not_reported(tmp_path: Path) -> None:
    child = Child(_host(tmp_path), "m.gguf", tmp_path / "logs" / "m")
    child.start(_script(tmp_path, 'touch "$1"\nexec sleep 600'), _serving(child))
    seen, _done, report = _reports()
    child.watch(report)
    pid = child.pid
    assert pid is not None
    child.stop()
    assert child.exited(1) is None and not child.alive() and seen == []
    assert not Path(f"/proc/{pid}").exists()  # reaped


def test_a_child_that_exits_while_starting_says_why(tmp_path: Path) -> None:
    child = Child(_host(tmp_path), "m.gguf", tmp_path / "logs" / "m")
    with pytest.raises(EngineDied, match=r"exited while loading \(exit status 1\): .*unknown "
                                          r"model architecture") as caught:
        child.start(_script(tmp_path, 'echo "unknown model architecture: llamx" >&2\nexit 1'),
                    _serving(child))
    assert caught.value.exit.status == 1 and not caught.value.exit.hung
    assert not child.alive()


def test_a_child_that_never_serves_is_killed_at_the_start_deadline(tmp_path: Path) -> None:
    child = Child(_host(tmp_path, start_timeout_s=0.5), "m.gguf", tmp_path / "logs" / "m")
    with pytest.raises(EngineDied, match=r"not serving after 0\.5 s") as caught:
        child.start(_script(tmp_path, 'echo "thinking" >&2\nexec sleep 600'), _serving(child))
    exit = caught.value.exit
    assert exit.hung and exit.cause == "hung" and "thinking" in exit.log_tail
    assert not Path(f"/proc/{exit.pid}").exists()


def test_a_loads_newest_logs_are_kept(tmp_path: Path) -> None:
    host = _host(tmp_path)
    folder = host.log_folder("m", "llama-server|m.gguf|cpu|ctx=512")
    assert folder.parent == tmp_path / "logs" and folder.name.startswith("m-")
    for _ in range(KEEP_LOGS + 2):
        child = Child(host, "m.gguf", folder)
        child.start(_script(tmp_path, 'touch "$1"\nexec sleep 600'), _serving(child))
        child.stop()
    assert len(list(folder.glob("*.log"))) == KEEP_LOGS
