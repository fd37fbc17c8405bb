"""PSS of packserve at git revision REV against this checkout, side by side: both serve the default
catalog at the same time, every model loaded by one request; PSS is summed over each server's
processes (front and worker here; one process before the split). docs/reliability.md quotes it.

    .venv/bin/python -m benchmarks.compare_pss 43f7ddb      # the last single-process revision
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx


def free_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = int(s.getsockname()[1])
    s.close()
    return p


def pss(pid: int) -> int:
    total = 0
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            total += int(line.split()[1]) * 1024
    return total


def tree(pid: int) -> list[int]:
    out = [pid]
    for p in os.listdir("/proc"):
        if p.isdigit():
            try:
                st = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
                if int(st[1]) == pid:
                    out += tree(int(p))
            except OSError:
                pass
    return out


REQ = [
    ("/v1/embeddings", {"model": "all-minilm-l6-v2", "input": "hello"}),
    ("/v1/rerank", {"model": "minilm-rerank", "query": "a", "documents": ["a", "b"]}),
    (
        "/v1/chat/completions",
        {
            "model": "smollm2-135m-instruct",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        },
    ),
    (
        "/v1/chat/completions",
        {
            "model": "smollm2-extract",
            "max_tokens": 4,
            "messages": [{"role": "user", "content": "hi"}],
        },
    ),
    ("/v1/completions", {"model": "gemma-3-270m", "max_tokens": 4, "prompt": "Monday,"}),
]


def run(src: str, label: str, data: str, work: str) -> subprocess.Popen[bytes]:
    port = free_port()
    env = {**os.environ, "PYTHONPATH": src}
    cfg = f"{work}/{label}.toml"
    text = (
        Path(f"{src}/packserve/default_catalog.toml")
        .read_text()
        .replace("[server]", f'[server]\ndata_dir = "{data}"', 1)
    )
    Path(cfg).write_text(text)
    p = subprocess.Popen(
        [sys.executable, "-m", "packserve.cli", "serve", "--config", cfg, "--port", str(port)],
        env=env,
        stdout=Path(f"{work}/{label}.log").open("w"),  # noqa: SIM115 - the server's, for its life
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    for _ in range(600):
        try:
            if httpx.get(url + "/readyz", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    for path, body in REQ:
        r = httpx.post(url + path, json=body, timeout=300)
        r.raise_for_status()
    return p


def main() -> int:
    rev = sys.argv[1] if len(sys.argv) > 1 else "43f7ddb"
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    work = tempfile.mkdtemp(prefix="packserve-pss-")
    subprocess.run(["git", "-C", here, "worktree", "add", "-f", "-q", f"{work}/old", rev],
                   check=True)
    data = os.path.expanduser("~/.cache/packserve")
    procs: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for label, src in ((rev, f"{work}/old/src"), ("this checkout", f"{here}/src")):
            procs[label] = run(src, label.replace(" ", "-"), data, work)
        time.sleep(2)
        res: dict[str, dict[str, float]] = {}
        for label, p in procs.items():
            pids = tree(p.pid)
            res[label] = {f"pid {pid}": round(pss(pid) / 2**20, 1) for pid in pids}
            res[label]["total MiB"] = round(sum(pss(pid) for pid in pids) / 2**20, 1)
        first, second = (res[k]["total MiB"] for k in res)
        print(json.dumps({**res, "this checkout / rev": round(second / first, 3)}, indent=1))
    finally:
        for p in procs.values():
            p.terminate()
        for p in procs.values():
            p.wait(60)
        subprocess.run(["git", "-C", here, "worktree", "remove", "--force", f"{work}/old"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
