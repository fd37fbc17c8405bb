"""schemathesis against packserve's own OpenAPI document, through the real HTTP app (uvicorn on a
free port, fake engines), in every generation mode (valid and invalid requests).

What must hold for every generated request: no 5xx but the documented 503 and 507 (and the 502
of a JSON `response_format` the fake engine cannot meet: it echoes), every error in OpenAI's
shape, every body the document calls invalid refused with a 4xx, the answer the one the document
gives (schemathesis's conformance checks), and the server answering normal requests afterwards.
The document's `model` enums (api.openapi) let valid requests reach the handlers: each model
route must answer at least one 200, or the fuzzer only knocked on the door.

The fake engines ignore their `@@sleep=`/`@@signal=` directives here (`FakeControl(directives=
False)`): a generated string must never stop the test process. The fuzzer works from a copy of
the document with `max_tokens` and list sizes capped, the server caps bodies at 64 KiB and each
model's inputs, input tokens and `max_tokens` (its per-model limits), so that the long run fits
in minutes; the negative check still holds requests to the real document.

The suite runs `PACKSERVE_FUZZ_EXAMPLES` (default 20) generated cases per operation, plus
schemathesis's examples and coverage cases (about 1,100 requests). The long run
(docs/reliability.md, "Fuzzing the API"):

    PACKSERVE_FUZZ_EXAMPLES=900 .venv/bin/python -m pytest tests/api/test_fuzz.py -s -q \
        -p no:cacheprovider --hypothesis-seed=20261130
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, settings
from jsonschema import Draft202012Validator
from schemathesis.core import NotSet
from schemathesis.specs.openapi import checks

from packserve.api.app import create_app
from packserve.api.openapi import describe
from packserve.backends.fake import FakeBackend, FakeControl
from packserve.config import Config
from packserve.core.backend import Backend, LoadSpec
from packserve.server import build_scheduler, build_telemetry
from packserve.types import Task
from tests.factories import Running, chat_body, config_from, cpu_device, fake_model, serve

EXAMPLES = int(os.environ.get("PACKSERVE_FUZZ_EXAMPLES", "20"))
# The fuzzing config: what the server will run for one request (per-model limits; over them, a
# 400), and what the fuzzer generates (its copy of the document, `capped`).
LIMITS = ("max_inputs = 16", "max_input_tokens = 4096", "max_output_tokens = 32")
MAX_TOKENS = 32
MAX_ITEMS = 8

EMBED, CHAT = "fuzz-embed", "fuzz-chat"
HUGE, DOOMED = "fuzz-huge", "fuzz-doomed"  # can never fit (507); every load fails (503)

TOML = ('[server]\nmax_request_bytes = "64KiB"\nfailure_cooldown_s = 1\n'
        + cpu_device("1GiB", "16MiB")
        + fake_model(EMBED, *LIMITS, tasks='["embed", "rerank"]')
        + fake_model(CHAT, *LIMITS, tasks='["chat", "complete"]', source="fake:48MiB")
        + fake_model(HUGE, *LIMITS, source="fake:4GiB")
        + fake_model(DOOMED, *LIMITS, tasks='["chat"]', source="fake:40MiB"))

# The documented 5xx answers: 503 (failed load, busy memory, draining) and 507 (never fits);
# also 502 when a model's output does not satisfy a JSON `response_format`, which the fake
# engine (it echoes, it does not constrain its output) does every time.
ALLOWED_5XX = {503, 507}
# schemathesis's own checks that the answer is the documented one: status, media type and body
# (so every error body is the document's `Error`, OpenAI's shape), and 405 + `Allow` for a
# method the document does not list for the path.
CONFORMANCE = [checks.status_code_conformance, checks.content_type_conformance,
               checks.response_schema_conformance, checks.unsupported_method,
               checks.allow_header_conformance]
# What every request got, by operation and status: the last test reads it.
TALLY: Counter[tuple[str, int]] = Counter()


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Running]:
    quiet = FakeControl(directives=False)
    doomed = FakeControl(directives=False, fail_next=1 << 62)

    def factory(spec: LoadSpec) -> Backend:
        backend = FakeBackend(spec)
        backend.control = doomed if spec.path.name == "fake:40MiB" else quiet
        return backend

    with serve(config_from(tmp_path_factory.mktemp("fuzz"), TOML), factory=factory) as running:
        yield running


@pytest.fixture(scope="module")
def document(fuzzed: Running) -> dict[str, Any]:
    """The OpenAPI document the server serves."""
    r = httpx.get(f"{fuzzed.url}/openapi.json", timeout=30)
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


@pytest.fixture(scope="module")
def session() -> Iterator[requests.Session]:
    with requests.Session() as s:
        yield s


def built_document() -> dict[str, Any]:
    """The document a server of TOML serves, from the same `create_app`, without serving it.

    schemathesis needs it at import time: its fixture-based loader (`from_fixture`) reads
    `Node._nodeid`, which pytest 9 no longer has. `test_the_fuzzed_document_is_the_served_one`
    checks that the two agree."""

    async def build(config: Config) -> dict[str, Any]:
        scheduler = build_scheduler(config, sinks=())
        return create_app(scheduler, build_telemetry(config, scheduler)).openapi()

    with tempfile.TemporaryDirectory() as tmp:
        return asyncio.run(build(config_from(Path(tmp), TOML)))


def capped(doc: dict[str, Any]) -> dict[str, Any]:
    """A copy of `doc` whose `max_tokens` and lists are small: the fuzzer's valid requests stay
    cheap. Only generation reads it; responses are judged against the real document."""

    def cap(node: Any, key: str = "") -> Any:
        if isinstance(node, list):
            return [cap(v) for v in node]
        if not isinstance(node, dict):
            return node
        out = {k: cap(v, k) for k, v in node.items()}
        if "maxItems" in out:
            out["maxItems"] = min(out["maxItems"], MAX_ITEMS)
        if key in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            for option in out.get("anyOf", [out]):
                if option.get("type") == "integer":
                    option["maximum"] = MAX_TOKENS
        return out

    result: dict[str, Any] = cap(doc)
    return result


DOCUMENT = built_document()
schema = schemathesis.openapi.from_dict(capped(DOCUMENT))


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, database=None,
          suppress_health_check=list(HealthCheck))
def test_api(case: schemathesis.Case[Any], fuzzed: Running, session: requests.Session) -> None:
    """Every generated request: a documented answer (schemathesis's conformance checks), no
    5xx but the documented ones, errors in OpenAI's shape, invalid bodies refused."""
    response = case.call(base_url=fuzzed.url, session=session, timeout=60)
    status = response.status_code
    TALLY[(f"{case.method} {case.path}", status)] += 1
    where = f"{case.method} {case.formatted_path} -> {status}: {response.text[:500]}"
    if status == 502:  # the fake engine echoes, so it never meets a JSON response_format
        assert asks_for_json(case.body), where
        assert response.json()["error"]["type"] == "invalid_model_output", where
    else:
        assert status < 500 or status in ALLOWED_5XX, where
    if status >= 400 and not (case.path == "/readyz" and status == 503):
        assert_openai_error(response.json(), where)  # /readyz's 503 names the pins instead
    body_schema = request_schema(DOCUMENT, case.method, case.path)
    if (body_schema is not None and case.media_type == "application/json"
            and not isinstance(case.body, NotSet)):
        errors = list(body_schema.iter_errors(case.body))
        if errors:
            assert 400 <= status < 500, f"{where}\naccepted a body the document refuses: " \
                                        f"{errors[0].message}"
    case.validate_response(response, checks=CONFORMANCE)


def asks_for_json(body: object) -> bool:
    """Whether a chat request (`response_format`) or a response (`text.format`) asks for JSON
    output (structured output)."""
    if not isinstance(body, dict):
        return False
    text = body.get("text")
    fmt = body.get("response_format") or (text.get("format") if isinstance(text, dict) else None)
    return isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema")


def assert_openai_error(body: object, where: str) -> None:
    """{"error": {"message", "type", "param", "code"}}, each of its documented type."""
    assert isinstance(body, dict) and set(body) == {"error"}, where
    err = body["error"]
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, where
    assert isinstance(err["message"], str) and err["message"], where
    assert isinstance(err["type"], str) and err["type"], where
    assert err["param"] is None or isinstance(err["param"], str), where
    assert err["code"] is None or isinstance(err["code"], str | int), where


_VALIDATORS: dict[tuple[str, str], Draft202012Validator | None] = {}


def request_schema(doc: dict[str, Any], method: str, path: str) -> Draft202012Validator | None:
    """A validator for the JSON body of `method path` in the real (uncapped) document."""
    key = (method.lower(), path)
    if key not in _VALIDATORS:
        op = doc["paths"].get(path, {}).get(key[0], {})
        body = (op.get("requestBody", {}).get("content", {}).get("application/json", {})
                .get("schema"))
        _VALIDATORS[key] = None if body is None else Draft202012Validator(
            {**body, "components": doc["components"]})
    return _VALIDATORS[key]


MODEL_ROUTES = ("/v1/embeddings", "/v1/rerank", "/rerank", "/v2/rerank", "/v1/chat/completions",
                "/v1/completions", "/v1/responses")


def test_the_fuzzer_reached_every_model_route_and_the_server_still_serves(
        fuzzed: Running) -> None:
    """Runs after `test_api` (file order): the server is healthy, and the document's model
    names let valid requests through (a 200 on every model route that was fuzzed)."""
    if TALLY:
        print(summary())
        for route in MODEL_ROUTES:
            if any(op == f"POST {route}" for op, _ in TALLY):
                assert TALLY[(f"POST {route}", 200)] > 0, f"no request to {route} was answered"
    with fuzzed.client(timeout=60) as c:
        assert c.get("/healthz").status_code == 200
        r = c.post("/v1/embeddings", json={"model": EMBED, "input": ["still here"]})
        assert r.status_code == 200, r.text
        r = c.post("/v1/chat/completions", json=chat_body("still here", model=CHAT))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == "still here"


def summary() -> str:
    """Requests per documented operation and status; the methods the document does not
    list for a path (schemathesis tries them) on one line."""
    documented = {f"{m.upper()} {path}" for path, item in DOCUMENT["paths"].items()
                  for m in item}
    by_op: dict[str, Counter[int]] = {}
    others: Counter[int] = Counter()
    for (op, status), n in TALLY.items():
        if op in documented:
            by_op.setdefault(op, Counter())[status] += n
        else:
            others[status] += n
    lines = [f"fuzzed {sum(TALLY.values())} requests (operation: count, by status)"]
    for op, statuses in sorted(by_op.items()):
        lines.append(f"  {op}: {statuses.total()} {dict(sorted(statuses.items()))}")
    if others:
        lines.append(f"  undocumented methods: {others.total()} {dict(sorted(others.items()))}")
    return "\n" + "\n".join(lines)


def test_the_fuzzed_document_is_the_served_one(document: dict[str, Any]) -> None:
    assert document == DOCUMENT


def test_the_document_names_the_models_of_each_task(document: dict[str, Any]) -> None:
    """Each request body's `model` is an enum of the models that can do its route's task."""
    schemas = document["components"]["schemas"]
    enums = {name: schemas[name]["properties"]["model"]["enum"]
             for name in ("EmbeddingRequest", "RerankRequest", "ChatRequest",
                          "CompletionRequest")}
    assert enums == {"EmbeddingRequest": [EMBED, HUGE], "RerankRequest": [EMBED],
                     "ChatRequest": [CHAT, DOOMED], "CompletionRequest": [CHAT]}
    chat = document["paths"]["/v1/chat/completions"]["post"]["responses"]
    assert "422" not in chat and set(chat) >= {"200", "400", "404", "413", "429", "503", "507"}
    assert chat["400"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/Error"}
    seed = schemas["ChatRequest"]["properties"]["seed"]["anyOf"][0]
    assert seed["maximum"] == 2**63 - 1  # exact, not rounded through a float
    load = document["paths"]["/v1/residency/{name}/load"]["post"]["parameters"][0]
    assert load["schema"]["enum"] == [EMBED, CHAT, HUGE, DOOMED]



def test_with_keys_the_document_lists_401_and_403_where_they_answer() -> None:
    doc = describe(DOCUMENT, [(EMBED, [Task.EMBED])], keys=True, views="admin")
    responses = {(method, path): set(op["responses"]) for path, item in doc["paths"].items()
                 for method, op in item.items()}
    assert "401" in responses[("post", "/v1/embeddings")]
    assert "403" not in responses[("post", "/v1/embeddings")]
    assert {"401", "403"} <= responses[("post", "/v1/residency/{name}/load")]
    assert {"401", "403"} <= responses[("get", "/v1/residency")]  # an operator view, admin
    assert not {"401", "403"} & responses[("get", "/healthz")]
    open_views = describe(DOCUMENT, [(EMBED, [Task.EMBED])], keys=True, views="open")
    assert "401" not in open_views["paths"]["/v1/residency"]["get"]["responses"]
    # A task no listed model can do keeps a plain string: any name is a 404 there.
    chat_model = doc["components"]["schemas"]["ChatRequest"]["properties"]["model"]
    assert "enum" not in chat_model and chat_model["type"] == "string"


def test_a_mistyped_union_field_is_named_as_the_client_wrote_it(fuzzed: Running) -> None:
    """Not as pydantic names union members (`function-after[<function ... at 0x...>]`)."""
    with fuzzed.client(timeout=60) as c:
        r = c.post("/v1/embeddings", json={"model": EMBED, "input": [[]]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "input", err
    assert "input.0: " in err["message"] and "function" not in err["message"], err


def test_a_wrong_method_says_which_are_allowed(fuzzed: Running) -> None:
    with fuzzed.client(timeout=60) as c:
        r = c.delete("/v1/embeddings")
    assert r.status_code == 405 and r.headers["allow"] == "POST", r.headers
