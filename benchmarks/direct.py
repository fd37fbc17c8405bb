"""The "direct" side of `python -m benchmarks overhead`: the same models, called in-process, in a
separate process from the server. Run as `python -m benchmarks.direct`; it reads one JSON
command per line on stdin and writes one JSON answer per line on stdout.

Commands:
  {"op": "load_embed", "path": DIR, "max_batch": 64}
  {"op": "load_llama", "path": GGUF, "n_ctx": 2048}
  {"op": "embed", "batches": [[str, ...], ...]}             -> {"seconds", "items"}
  {"op": "chat", "requests": [body, ...], "concurrency": k}  -> {"seconds", "tokens"}
  {"op": "quit"}
The model is loaded the way packserve's backends load it (sentence-transformers on CPU with
local files only; llama.cpp with the same n_ctx and use_mmap=True), so that only the serving
path differs.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any


def main() -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # libraries that print must not corrupt the protocol
    embedder: Any = None
    llm: Any = None
    lock = threading.Lock()
    for line in sys.stdin:
        cmd = json.loads(line)
        op = cmd["op"]
        answer: dict[str, Any] = {"ok": True}
        if op == "quit":
            break
        if op == "load_embed":
            from sentence_transformers import SentenceTransformer

            embedder = SentenceTransformer(cmd["path"], device="cpu", local_files_only=True)
            max_batch = int(cmd.get("max_batch", 64))
        elif op == "load_llama":
            from llama_cpp import Llama

            llm = Llama(model_path=cmd["path"], n_ctx=int(cmd["n_ctx"]), n_gpu_layers=0,
                        use_mmap=True, verbose=False)
        elif op == "embed":
            t0 = time.perf_counter()
            items = 0
            for batch in cmd["batches"]:
                embedder.encode(batch, batch_size=max_batch, convert_to_numpy=True,
                                show_progress_bar=False)
                items += len(batch)
            answer.update(seconds=time.perf_counter() - t0, items=items)
        elif op == "chat":

            def one(body: dict[str, Any], llm: Any = llm) -> int:
                with lock:  # one llama.cpp context decodes one sequence at a time
                    r = llm.create_chat_completion(
                        messages=body["messages"], max_tokens=body["max_tokens"],
                        temperature=body["temperature"], seed=body.get("seed"))
                return int(r["usage"]["completion_tokens"])

            t0 = time.perf_counter()
            with ThreadPoolExecutor(int(cmd.get("concurrency", 1))) as pool:
                tokens = sum(pool.map(one, cmd["requests"]))
            answer.update(seconds=time.perf_counter() - t0, tokens=tokens)
        else:
            answer = {"ok": False, "error": f"unknown op {op!r}"}
        out.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
