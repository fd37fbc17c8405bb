"""Save a GGUF model's tokenizer as Hugging Face tokenizer files, for load generators that count
tokens on the client with no Hub to download from (guidellm's and aiperf's `--tokenizer DIR`).

    .venv/bin/python scripts/client_tokenizer.py OUT_DIR [MODEL] [--config FILE] [--data-dir DIR]

MODEL is a catalog entry served from a GGUF file (default: smollm2-135m-instruct); the catalog is
packserve's default one unless --config names another, and a model packserve assembles on its
first start (Gemma) is found in --data-dir (default: the config's data_dir). Needs
`transformers` (scripts/setup.sh --dev), which reads the tokenizer out of the GGUF file itself
(docs/clients.md).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from packserve.config import load_config
from packserve.sources import resolve_source


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("model", nargs="?", default="smollm2-135m-instruct")
    parser.add_argument("--config", type=Path)
    parser.add_argument("--data-dir", type=Path)
    args = parser.parse_args(argv)
    config = load_config(args.config)
    data = args.data_dir or config.data_path
    spec = next((m for m in config.models if m.name == args.model), None)
    if spec is None:
        parser.error(f"no model {args.model!r} in the catalog: "
                     f"{', '.join(m.name for m in config.models)}")
    path = resolve_source(spec.source, base_dir=Path(config.base_dir), models_dir=data / "models",
                          roots=None)
    if path.suffix != ".gguf":
        parser.error(f"{args.model} is served from {path}, not a GGUF file: point the load "
                     f"generator's --tokenizer at that folder itself")
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tokenizer.save_pretrained(str(args.out))
    print(f"{args.model}: tokenizer of {path.name} saved in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
