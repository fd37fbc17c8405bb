"""The tiny models load on the CPU: the GGUF in a llama-server (one chat answer through its
template), the BERT in sentence-transformers (one embedding). `scripts/gpu-check.sh --dry-run`
runs it, and tests/test_gpu_check.py.

    python load_check.py --gguf FILE --bert FOLDER --llama-server BIN
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from check import call, free_port, wait_healthy


def gguf_answers(gguf: Path, llama_server: str) -> dict[str, object]:
    """Start `llama_server` on the CPU with `gguf`, ask one chat, stop it."""
    port = free_port()
    with tempfile.TemporaryFile() as log:
        proc = subprocess.Popen([llama_server, "--model", str(gguf), "--host", "127.0.0.1",
                                 "--port", str(port), "--device", "none", "--ctx-size", "512",
                                 "--jinja", "--no-webui", "--offline", "--threads", "2"],
                                stdout=subprocess.DEVNULL, stderr=log)
        try:
            start = time.monotonic()
            try:
                ready = wait_healthy(port, proc, 30, "/health")
            except (RuntimeError, TimeoutError) as exc:
                proc.kill()
                proc.wait(10)
                log.seek(0)
                err = log.read().decode(errors="replace")[-1500:]
                raise RuntimeError(f"llama-server did not load {gguf}: {exc}\n{err}") from exc
            status, body = call(port, "POST", "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "hello world"}],
                                 "max_tokens": 8, "temperature": 0.0, "ignore_eos": True})
            if status != 200:
                raise RuntimeError(f"llama-server answered HTTP {status}: {body}")
            usage = body["usage"]
            return {"load_s": round(ready, 3), "completion_tokens": usage["completion_tokens"],
                    "prompt_tokens": usage["prompt_tokens"],
                    "seconds": round(time.monotonic() - start, 3)}
        finally:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def bert_embeds(folder: Path) -> dict[str, object]:
    """Load `folder` with sentence-transformers on the CPU and embed one sentence."""
    from sentence_transformers import SentenceTransformer

    start = time.monotonic()
    model = SentenceTransformer(str(folder), device="cpu")
    vector = model.encode(["hello world"])[0]
    return {"dimensions": int(vector.shape[0]), "seconds": round(time.monotonic() - start, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path)
    parser.add_argument("--bert", type=Path)
    parser.add_argument("--llama-server", default="llama-server")
    args = parser.parse_args(argv)
    out: dict[str, object] = {}
    if args.gguf:
        out["gguf"] = gguf_answers(args.gguf, args.llama_server)
    if args.bert:
        out["bert"] = bert_embeds(args.bert)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
