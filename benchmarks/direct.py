"""The direct side of `python -m benchmarks overhead` for MiniLM: the model called in-process
(sentence-transformers), in a separate process from the server. Run as `python -m
benchmarks.direct`; it reads one JSON command per line on stdin and writes one JSON answer per
line on stdout.

Commands:
  {"op": "load_embed", "path": DIR, "max_batch": 64}
  {"op": "embed", "batches": [[str, ...], ...]}             -> {"seconds", "items"}
  {"op": "quit"}
The model is loaded the way packserve's torch engine loads it (sentence-transformers on CPU
with local files only), so that only the serving path differs. The chat model's direct side is
no Python process: it is llama.cpp's own `llama-server` on the same GGUF, driven over HTTP by
the benchmark (`benchmarks.overhead`).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any


def main() -> int:
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # libraries that print must not corrupt the protocol
    embedder: Any = None
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
        elif op == "embed":
            t0 = time.perf_counter()
            items = 0
            for batch in cmd["batches"]:
                embedder.encode(batch, batch_size=max_batch, convert_to_numpy=True,
                                show_progress_bar=False)
                items += len(batch)
            answer.update(seconds=time.perf_counter() - t0, items=items)
        else:
            answer = {"ok": False, "error": f"unknown op {op!r}"}
        out.write(json.dumps(answer) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
