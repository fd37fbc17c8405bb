"""The frameworks people call an "OpenAI-compatible server" with, pointed at packserve with the
settings docs/clients.md gives: each recipe is what an application would write. Runs in
.venv-clients (scripts/setup.sh --dev), whose pins differ from packserve's:

    .venv-clients/bin/python scripts/client_recipes.py http://127.0.0.1:8000 [RECIPE...]

Prints `ok RECIPE` for each that worked and exits 1 if any failed (tests/api/test_client_tools.py
runs it against the default catalog). Nothing here reaches the internet.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable

# litellm reads its model price list from the internet at import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

CHAT = "smollm2-135m-instruct"
EXTRACT = "smollm2-extract"  # the catalog's chat model for JSON output
EMBED = "all-minilm-l6-v2"
RERANK = "minilm-rerank"
KEY = os.environ.get("PACKSERVE_API_KEY", "unused")  # any string without keys configured
DOCS = ["Paris is the capital of France.", "The cat sat on the mat.", "Berlin is in Germany."]

Recipe = Callable[[str], None]
RECIPES: dict[str, Recipe] = {}


def recipe(fn: Recipe) -> Recipe:
    RECIPES[fn.__name__] = fn
    return fn


@recipe
def litellm_chat(url: str) -> None:
    import litellm

    # `openai/` + the catalog's name: litellm's OpenAI-compatible route, at packserve's /v1.
    out = litellm.completion(model=f"openai/{CHAT}", api_base=f"{url}/v1", api_key=KEY,
                             messages=[{"role": "user", "content": "Say hello."}],
                             max_tokens=12, temperature=0)
    assert out.choices[0].message.content, out
    pieces = litellm.completion(model=f"openai/{CHAT}", api_base=f"{url}/v1", api_key=KEY,
                                messages=[{"role": "user", "content": "Say hello."}],
                                max_tokens=12, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in pieces)


@recipe
def litellm_embedding(url: str) -> None:
    import litellm

    out = litellm.embedding(model=f"openai/{EMBED}", api_base=f"{url}/v1", api_key=KEY,
                            input=["one sentence", "another"])
    assert len(out.data) == 2 and len(out.data[0]["embedding"]) == 384


@recipe
def litellm_rerank(url: str) -> None:
    import litellm

    # Cohere's adapter parses packserve's shape, documents included.
    out = litellm.rerank(model=f"cohere/{RERANK}", api_base=url, api_key=KEY,
                         query="capital of France", documents=DOCS, top_n=2,
                         return_documents=True)
    assert out.results[0]["index"] == 0 and len(out.results) == 2, out
    # Infinity's adapter expects Infinity's own shape (`document` a string), so it is called
    # without documents: packserve answers in Cohere's shape (`document: {"text": ...}`).
    out = litellm.rerank(model=f"infinity/{RERANK}", api_base=url, api_key=KEY,
                         query="capital of France", documents=DOCS, return_documents=False)
    assert {r["index"] for r in out.results} == {0, 1, 2}, out


@recipe
def instructor_structured(url: str) -> None:
    import instructor
    from openai import OpenAI
    from pydantic import BaseModel

    class City(BaseModel):
        name: str
        country: str

    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
        client = instructor.from_openai(OpenAI(base_url=f"{url}/v1", api_key=KEY), mode=mode)
        city = client.chat.completions.create(
            model=EXTRACT, response_model=City, max_retries=0, max_tokens=64, temperature=0,
            messages=[{"role": "user", "content": "Paris is the capital of France. Extract "
                                                  "the city and its country."}])
        assert isinstance(city, City) and city.name, city


@recipe
def llama_index(url: str) -> None:
    from llama_index.core.llms import ChatMessage
    from llama_index.embeddings.openai_like import OpenAILikeEmbedding
    from llama_index.llms.openai_like import OpenAILike

    llm = OpenAILike(model=CHAT, api_base=f"{url}/v1", api_key=KEY, is_chat_model=True,
                     context_window=2048, max_tokens=16, temperature=0)
    assert llm.chat([ChatMessage(role="user", content="Say hello.")]).message.content
    assert "".join(r.delta or "" for r in llm.stream_complete("Say hello."))
    embedder = OpenAILikeEmbedding(model_name=EMBED, api_base=f"{url}/v1", api_key=KEY)
    assert len(embedder.get_text_embedding("one sentence")) == 384


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    url, names = argv[0].rstrip("/"), argv[1:] or list(RECIPES)
    failed = 0
    for name in names:
        try:
            RECIPES[name](url)
        except Exception:
            failed += 1
            print(f"FAILED {name}", flush=True)
            traceback.print_exc()
        else:
            print(f"ok {name}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
