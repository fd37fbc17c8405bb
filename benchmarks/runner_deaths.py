"""Runner deaths as a client sees them (issue 40's goal scenario), against a real `packserve
serve` serving smollm2-135m-instruct and smollm2-extract (one GGUF, one runner), a fresh server
and data dir each round.

    .venv/bin/python -m benchmarks.runner_deaths [--rounds N | --quick] [--out FILE]

Each round:

1. a short chat warms SmolLM2 up; a long streamed chat starts, and after its 3rd event the
   runner (the `llama-server` descendant of the server whose command line names SmolLM2's GGUF:
   front -> worker -> runner) gets SIGKILL. Measured from the kill: whether the stream ends
   with an error event and when; when `/v1/residency` stops saying `hot` with no request sent
   (polled every 20 ms); when a non-streamed chat (max_tokens 4), first sent once the state
   left `hot` and sent again every 50 ms on anything but a 200, first answers 200;
2. 2 s after that answer, SIGKILL to the new runner: the seconds until a chat answers 200 again
   (sent at once; the crash rule's back-off is waited out inside the request), with
   `/v1/residency` polled alongside for the state and `restart_in_s` it shows;
3. SIGKILL to the third runner right after that answer: the status, `Retry-After` and message
   of the next chat (the crash rule quarantines on the third death within crash_window_s);
4. `packserve_engine_crashes_total` from `/metrics` per model and signal, and what `packserve
   logs smollm2-135m-instruct --url URL` prints; the crash events from the server's log.

Prints a table (every round and the median) and writes JSON to --out. Reports; asserts nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from rich.table import Table

from benchmarks.common import (
    CHAT_MODEL,
    EXTRACT_MODEL,
    Goal,
    Options,
    Server,
    console,
    logged_events,
    machine,
    machine_line,
    median,
    model_path,
    packserve_argv,
    run_server,
    write_config,
)

SCENARIO = "runner-deaths"
MODELS = (CHAT_MODEL, EXTRACT_MODEL)
CHAT = "/v1/chat/completions"
SHORT = {"model": CHAT_MODEL, "max_tokens": 4,
         "messages": [{"role": "user", "content": "Say hello."}]}
LONG = {"model": CHAT_MODEL, "max_tokens": 512, "stream": True, "ignore_eos": True,
        "messages": [{"role": "user", "content": "Write a long story about a lighthouse keeper "
                      "and a storm, with many details."}]}
RESIDENCY_POLL_S = 0.02
CHAT_POLL_S = 0.05
GIVE_UP_S = 120.0  # a step that has not happened by then is reported as not happened


# ----------------------------------------------------------------------- processes


def _ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat[stat.rfind(")") + 2:].split()[1])


def _cmdline(pid: int) -> list[str]:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def _descendants(root: int) -> list[int]:
    """Every live descendant of `root`, from the parent links of all of /proc."""
    children: dict[int, list[int]] = {}
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and (parent := _ppid(int(entry.name))) is not None:
            children.setdefault(parent, []).append(int(entry.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def find_runner(front: int, gguf: Path, *, not_pids: frozenset[int] = frozenset(),
                within_s: float = 10.0) -> tuple[int, list[str]]:
    """The pid of the llama-server descendant of `front` whose command line names `gguf` (none
    of `not_pids`), and its ancestry up to `front` (each as `pid:role`)."""
    deadline = time.monotonic() + within_s
    while True:
        for pid in _descendants(front):
            cmd = _cmdline(pid)
            if pid in not_pids or not cmd or not cmd[0].endswith("llama-server"):
                continue
            if any(a == str(gguf) or a.endswith("/" + gguf.name) for a in cmd):
                chain: list[str] = []
                p: int | None = pid
                while p is not None and p != front:
                    c = _cmdline(p)
                    role = ("runner" if c and c[0].endswith("llama-server") else
                            "worker" if "packserve.worker" in " ".join(c) else
                            (c[0].rsplit("/", 1)[-1] if c else "?"))
                    chain.append(f"{p}:{role}")
                    p = _ppid(p)
                chain.append(f"{front}:front")
                return pid, chain
        if time.monotonic() > deadline:
            raise RuntimeError(f"no llama-server runner of {gguf.name} under pid {front}")
        time.sleep(0.02)


def kill(pid: int) -> float:
    os.kill(pid, signal.SIGKILL)
    return time.monotonic()


# ----------------------------------------------------------------------- requests


def row(c: httpx.Client, name: str = CHAT_MODEL) -> dict[str, Any]:
    rows: list[dict[str, Any]] = c.get("/v1/residency").json()["models"]
    return next(r for r in rows if r["name"] == name)


def _brief(r: dict[str, Any]) -> dict[str, Any]:
    return {k: r.get(k) for k in ("state", "error", "restart_in_s", "last_crash")}


def wait_not_hot(c: httpx.Client, t_kill: float) -> dict[str, Any]:
    """Poll `/v1/residency` every 20 ms until the chat model's state is not `hot`."""
    polls = 0
    while time.monotonic() - t_kill < GIVE_UP_S:
        r = row(c)
        polls += 1
        if r["state"] != "hot":
            return {"after_kill_s": round(time.monotonic() - t_kill, 3), "polls": polls,
                    "row": _brief(r)}
        time.sleep(RESIDENCY_POLL_S)
    return {"after_kill_s": None, "polls": polls, "row": None}


def chat_until_200(c: httpx.Client, t_kill: float) -> dict[str, Any]:
    """A short non-streamed chat, sent again every 50 ms until one answers 200 (no Retry-After
    honoured); statuses counted ("transport" for a connection that failed)."""
    seen: Counter[str] = Counter()
    first_other: dict[str, str] = {}
    while time.monotonic() - t_kill < GIVE_UP_S:
        try:
            r = c.post(CHAT, json=SHORT)
            status = str(r.status_code)
            if status != "200":
                first_other.setdefault(status, _message(r))
        except httpx.TransportError as exc:
            status = "transport"
            first_other.setdefault(status, f"{type(exc).__name__}: {exc}")
        seen[status] += 1
        if status == "200":
            return {"after_kill_s": round(time.monotonic() - t_kill, 3), "statuses": dict(seen),
                    "first_non_200": first_other}
        time.sleep(CHAT_POLL_S)
    return {"after_kill_s": None, "statuses": dict(seen), "first_non_200": first_other}


def _message(r: httpx.Response) -> str:
    with contextlib.suppress(ValueError, AttributeError, TypeError):
        return str(r.json()["error"]["message"])
    return r.text[:300]


@dataclass
class Stream:
    """What the long streamed chat saw, the kill included (times are time.monotonic())."""

    status: int | None = None
    events_before_kill: int = 0
    killed_pid: int | None = None
    killed_at: float | None = None
    events_after_kill: int = 0
    error_message: str | None = None
    error_at: float | None = None
    done: bool = False
    ended_at: float | None = None
    exception: str | None = None
    killed: threading.Event = field(default_factory=threading.Event)


def stream_and_kill(url: str, runner: int, s: Stream) -> None:
    """Stream the long chat; SIGKILL `runner` right after its 3rd event; read to its end."""
    try:
        with httpx.Client(base_url=url, timeout=60) as c, c.stream("POST", CHAT,
                                                                    json=LONG) as r:
            s.status = r.status_code
            for line in r.iter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if s.killed_at is None:
                    s.events_before_kill += 1
                    if s.events_before_kill == 3:
                        s.killed_pid, s.killed_at = runner, kill(runner)
                        s.killed.set()
                    continue
                if data == "[DONE]":
                    s.done = True
                    continue
                payload: Any = None
                with contextlib.suppress(ValueError):
                    payload = json.loads(data)
                if isinstance(payload, dict) and "error" in payload:
                    s.error_at = s.error_at or time.monotonic()
                    s.error_message = str(payload["error"].get("message"))
                else:
                    s.events_after_kill += 1
    except httpx.HTTPError as exc:
        s.exception = f"{type(exc).__name__}: {exc}"
    finally:
        s.ended_at = time.monotonic()
        s.killed.set()


def crash_counters(c: httpx.Client) -> dict[str, dict[str, float]]:
    """`packserve_engine_crashes_total` from /metrics: {model: {signal: count}}."""
    out: dict[str, dict[str, float]] = {}
    for line in c.get("/metrics").text.splitlines():
        if line.startswith("packserve_engine_crashes_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line[:line.index("}")]))
            out.setdefault(labels.get("model", ""), {})[labels.get("signal", "")] = \
                float(line.rsplit(" ", 1)[1])
    return out


def logs_cli(url: str) -> dict[str, Any]:
    argv = [sys.executable, "-m", "packserve.cli", "logs", CHAT_MODEL, "--url", url]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    lines = done.stdout.splitlines()
    body = [line for line in lines if not line.startswith("# ")]
    return {"rc": done.returncode, "lines": len(lines), "log_lines": len(body),
            "prints_log": done.returncode == 0 and len(body) > 0,
            "header": [line for line in lines if line.startswith("# ")],
            "last_lines": body[-3:], "stderr": done.stderr.strip()[-500:]}


# ----------------------------------------------------------------------- one round


def one_round(n: int, keep: Path | None = None) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="packserve-runner-deaths-") as tmp:
        folder = Path(tmp)
        opts = Options(out=folder, quick=True, data_dir=folder / "data", peers_dir=folder)
        config = write_config(folder / "packserve.toml", opts, log_level="info")
        gguf = model_path(CHAT_MODEL, opts)
        log = folder / "server.log"
        argv = packserve_argv("--config", str(config), "--models", ",".join(MODELS))
        with run_server(argv, log=log) as server, server.client(timeout=60) as c:
            result = _scenario(server, c, gguf)
            result["crashes"] = crash_counters(c)
            result["logs_cli"] = logs_cli(server.url)
            runners = folder / "data" / "logs" / "runners"
            result["kept_logs"] = sorted(str(p.relative_to(runners)) for p in
                                         runners.rglob("*") if p.is_file()) \
                if runners.is_dir() else []
        events = list(logged_events(log))
        result["crash_events"] = [
            {k: e.get(k) for k in ("model", "pid", "signal", "doing", "action", "retry_in_s",
                                   "deaths")}
            for e in events if e.get("kind") == "crash"]
        result["loads"] = _loads(events, [result[step]["killed_wall"] for step in
                                          ("first", "second", "third")])
        result["load_after"] = {str(x["after_kill"]): x["seconds"] for x in result["loads"]}
        result["load_ended_after"] = {str(x["after_kill"]): x["ended_after_kill_s"]
                                      for x in result["loads"]}
        result["round"] = n
        if keep is not None:  # the server's log and the runners' kept logs, for a reader
            shutil.copytree(folder, keep / f"round-{n}",
                            ignore=shutil.ignore_patterns("models", "*.gguf"))
        return result


def _loads(events: list[dict[str, Any]], kills: list[float]) -> list[dict[str, Any]]:
    """The server's load events: their seconds, and when each ended after which kill (0: the
    warm-up's, before any kill)."""
    out = []
    for e in events:
        if e.get("kind") != "load":
            continue
        ts = float(e["ts"])
        after = sum(1 for k in kills if k <= ts)
        out.append({"seconds": round(float(e.get("seconds") or 0.0), 3),
                    "reason": e.get("reason"),
                    "tier_from": e.get("tier_from"), "after_kill": after,
                    "ended_after_kill_s": round(ts - kills[after - 1], 3) if after else None})
    return out


def _wall(t: float) -> float:
    """The wall-clock time of monotonic `t` (the server's events carry wall-clock times)."""
    return time.time() - (time.monotonic() - t)


def _scenario(server: Server, c: httpx.Client, gguf: Path) -> dict[str, Any]:
    out: dict[str, Any] = {}
    warm = c.post(CHAT, json=SHORT)
    assert warm.status_code == 200, (warm.status_code, warm.text)
    pid1, chain = find_runner(server.pid, gguf)
    out["process_chain"] = chain  # runner, worker, front

    # 1. the kill in the middle of a stream
    s = Stream()
    thread = threading.Thread(target=stream_and_kill, args=(server.url, pid1, s), daemon=True)
    thread.start()
    s.killed.wait(GIVE_UP_S)
    if s.killed_at is None:
        raise RuntimeError(f"the stream ended before its 3rd event: {s}")
    t1 = s.killed_at
    left = wait_not_hot(c, t1)
    first = chat_until_200(c, t1)
    answered_1 = time.monotonic()
    thread.join(GIVE_UP_S)
    out["first"] = {
        "pid": pid1, "stream_status": s.status, "events_before_kill": s.events_before_kill,
        "stream_error_event": s.error_message is not None, "stream_error": s.error_message,
        "stream_error_after_kill_s": None if s.error_at is None else round(s.error_at - t1, 3),
        "stream_ended_after_kill_s": None if s.ended_at is None else round(s.ended_at - t1, 3),
        "stream_events_after_kill": s.events_after_kill, "stream_done": s.done,
        "stream_exception": s.exception, "left_hot": left, "chat": first,
        "killed_wall": _wall(t1)}

    # 2. 2 s after that answer, the second kill: the back-off is waited out
    time.sleep(max(0.0, answered_1 + 2.0 - time.monotonic()))
    pid2, _ = find_runner(server.pid, gguf, not_pids=frozenset({pid1}))
    t2 = kill(pid2)
    second: dict[str, Any] = {}

    def send() -> None:  # beside the residency polls below
        with httpx.Client(base_url=server.url, timeout=60) as own:
            second.update(chat_until_200(own, t2))

    sender = threading.Thread(target=send, daemon=True)
    sender.start()
    left2 = wait_not_hot(c, t2)
    sender.join(GIVE_UP_S + 5)
    out["second"] = {"pid": pid2, "after_answer_s": round(t2 - answered_1, 3),
                     "left_hot": left2, "chat": second, "killed_wall": _wall(t2)}

    # 3. the third kill right after that answer: quarantined
    pid3, _ = find_runner(server.pid, gguf, not_pids=frozenset({pid1, pid2}))
    t3 = kill(pid3)
    r = c.post(CHAT, json=SHORT)
    out["third"] = {"pid": pid3, "status": r.status_code, "killed_wall": _wall(t3),
                    "after_kill_s": round(time.monotonic() - t3, 3),
                    "retry_after": r.headers.get("retry-after"),
                    "reason": _message(r) if r.status_code != 200 else None,
                    "row": _brief(row(c)), "extract_row": _brief(row(c, EXTRACT_MODEL))}
    return out


# ----------------------------------------------------------------------- summary

FIGURES: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("1st kill: stream error event", "bool", ("first", "stream_error_event")),
    ("1st kill: error event after kill, s", "s", ("first", "stream_error_after_kill_s")),
    ("1st kill: stream ended after kill, s", "s", ("first", "stream_ended_after_kill_s")),
    ("1st kill: left hot (no request), s", "s", ("first", "left_hot", "after_kill_s")),
    ("1st kill: state after hot", "str", ("first", "left_hot", "row", "state")),
    ("1st kill: chat 200 after kill, s", "s", ("first", "chat", "after_kill_s")),
    ("1st kill: chats sent until 200", "n", ("first", "chat", "statuses")),
    ("1st kill: its load took, s", "s", ("load_after", "1")),
    ("2nd kill: after the 200, s", "s", ("second", "after_answer_s")),
    ("2nd kill: left hot, s", "s", ("second", "left_hot", "after_kill_s")),
    ("2nd kill: restart_in_s shown", "s", ("second", "left_hot", "row", "restart_in_s")),
    ("2nd kill: chat 200 after kill, s", "s", ("second", "chat", "after_kill_s")),
    ("2nd kill: chats sent until 200", "n", ("second", "chat", "statuses")),
    ("2nd kill: its load took, s", "s", ("load_after", "2")),
    ("2nd kill: its load ended after kill, s", "s", ("load_ended_after", "2")),
    ("3rd kill: next chat status", "str", ("third", "status")),
    ("3rd kill: Retry-After", "str", ("third", "retry_after")),
    ("3rd kill: answered after kill, s", "s", ("third", "after_kill_s")),
    ("3rd kill: state", "str", ("third", "row", "state")),
    (f"crashes_total {CHAT_MODEL}", "str", ("crashes", CHAT_MODEL)),
    (f"crashes_total {EXTRACT_MODEL}", "str", ("crashes", EXTRACT_MODEL)),
    ("packserve logs: log lines printed", "n", ("logs_cli", "log_lines")),
    ("crash events (actions)", "str", ("crash_events",)),
)


def _get(data: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(data, dict):
            return None
        data = data.get(key)
    return data


def _cell(kind: str, value: Any) -> Any:
    if kind == "n" and isinstance(value, dict):
        return sum(value.values())
    if kind == "str" and isinstance(value, dict):
        return ",".join(f"{k}={v:g}" for k, v in value.items())
    if kind == "str" and isinstance(value, list):
        return ",".join(str(e.get("action")) for e in value)
    return value


def summarize(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    """Each figure per round (as the table shows it) and the median of the numeric ones."""
    table: dict[str, Any] = {}
    for label, kind, path in FIGURES:
        values = [_cell(kind, _get(r, path)) for r in rounds]
        numbers = [float(v) for v in values if isinstance(v, int | float)
                   and not isinstance(v, bool)]
        med: Any = None
        if kind in ("s", "n") and numbers:
            med = round(median(numbers), 3)
        elif kind == "bool":
            med = f"{sum(bool(v) for v in values)}/{len(values)}"
        table[label] = {"rounds": values, "median": med}
    return table


def goals(rounds: list[dict[str, Any]]) -> list[Goal]:
    def med(*path: str) -> float | None:
        values = [v for r in rounds if isinstance(v := _get(r, path), int | float)]
        return median(values) if len(values) == len(rounds) else None

    def share(ok: list[bool]) -> float:
        return sum(ok) / len(ok)

    not_all = "a round did not get there within 120 s"
    return [
        Goal("stream ended with an error event (share of rounds)",
             share([bool(_get(r, ("first", "stream_error_event"))) for r in rounds]), 1, ">="),
        Goal("left hot with no request, median s", med("first", "left_hot", "after_kill_s"),
             1.0, "<=", "" if med("first", "left_hot", "after_kill_s") is not None else not_all),
        Goal("chat 200 after a first death, median s", med("first", "chat", "after_kill_s"),
             3.0, "<=", "" if med("first", "chat", "after_kill_s") is not None else not_all),
        Goal("chat 200 after a second death 2 s later, median s",
             med("second", "chat", "after_kill_s"), 10.0, "<=",
             "" if med("second", "chat", "after_kill_s") is not None else not_all),
        Goal("third death: 503 with Retry-After (share of rounds)",
             share([_get(r, ("third", "status")) == 503 and _get(r, ("third", "retry_after"))
                    is not None for r in rounds]), 1, ">="),
        Goal("3 SIGKILL deaths counted per model name (share of rounds)",
             share([all(_get(r, ("crashes", m)) == {"SIGKILL": 3.0} for m in MODELS)
                    for r in rounds]), 1, ">="),
        Goal("packserve logs prints the runner's log (share of rounds)",
             share([bool(_get(r, ("logs_cli", "prints_log"))) for r in rounds]), 1, ">="),
    ]


def render(summary: dict[str, Any], n: int) -> Table:
    table = Table(title=f"bench {SCENARIO}: SIGKILL to SmolLM2's runner, {n} round(s)")
    table.add_column("figure", no_wrap=True)
    for i in range(n):
        table.add_column(f"round {i + 1}", justify="right")
    table.add_column("median", justify="right")
    for label, cells in summary.items():
        table.add_row(label, *("-" if v is None else str(v)
                               for v in [*cells["rounds"], cells["median"]]))
    return table


# ----------------------------------------------------------------------- command line


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.runner_deaths",
                                     description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--out", default=f"benchmarks/results/{SCENARIO}.json",
                        help="the JSON results file")
    parser.add_argument("--rounds", type=int, default=3, help="rounds, a fresh server each")
    parser.add_argument("--quick", action="store_true", help="one round")
    parser.add_argument("--keep", help="copy each round's server log and runner logs under "
                        "this folder (round-N/)")
    args = parser.parse_args(argv)
    n = 1 if args.quick else args.rounds
    rest = sys.argv[1:] if argv is None else list(argv)
    command = ".venv/bin/python -m benchmarks.runner_deaths " + shlex.join(rest)
    rounds: list[dict[str, Any]] = []
    errors: list[str] = []
    for i in range(1, n + 1):
        console.print(f"[bold]{SCENARIO}[/]: round {i}/{n}")
        try:
            rounds.append(one_round(i, Path(args.keep) if args.keep else None))
        except Exception as exc:  # a round that broke is reported, not lost with the others
            errors.append(f"round {i}: {type(exc).__name__}: {exc}")
            console.print(f"[red]{errors[-1]}[/]")
    summary = summarize(rounds) if rounds else {}
    if rounds:
        console.print(render(summary, len(rounds)))
    gs = goals(rounds) if rounds else []
    for g in gs:
        value = "n/a" if g.value is None else f"{g.value:.2f}"
        verdict = {True: "met", False: "MISSED", None: "not measured"}[g.met]
        console.print(f"  {g.name}: {value} (goal {g.op} {g.target}) {verdict}")
    m = machine()
    data = {"scenario": SCENARIO, "command": command,
            "date": datetime.now(UTC).isoformat(timespec="seconds"), "machine": m,
            "machine_line": machine_line(m), "quick": args.quick,
            "goals": [{**asdict(g), "met": g.met} for g in gs],
            "results": {"rounds": rounds, "summary": summary, "errors": errors}, "notes": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1, default=str) + "\n", "utf-8")
    console.print(f"[green]{SCENARIO}[/]: {out}")
    return 1 if errors or not rounds else 0


if __name__ == "__main__":
    sys.exit(main())
