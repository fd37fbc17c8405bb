"""Properties of the request validators (api.schemas) and of structured output's schema checks
(api.structured), over generated inputs.

Bodies go through `json.dumps`/`json.loads` first: the validators see what FastAPI hands them.
A valid request validates and gives back its texts as sent; anything outside the documented
limits, or of the wrong JSON type, is a ValidationError whose every error names the field; no
input raises anything else. A response_format's schema is accepted unchanged or refused with
InvalidRequest(param="response_format"), and the output check on an accepted schema passes or
raises ModelOutputInvalid, whatever the model wrote.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from packserve.api.schemas import (
    MAX_DOCUMENTS,
    MAX_INPUTS,
    MAX_MESSAGES,
    MAX_TOKENS_CAP,
    ChatRequest,
    CompletionRequest,
    EmbeddingRequest,
    RerankRequest,
)
from packserve.api.structured import MAX_SCHEMA_DEPTH, check_json, response_format
from packserve.errors import InvalidRequest, ModelOutputInvalid

FAST = settings(max_examples=60, deadline=None)

# ------------------------------------------------------------------------------------ strategies

# Text JSON can carry and a tokenizer can take: any code point but a lone surrogate.
texts = st.text(st.characters(exclude_categories=["Cs"]), max_size=40)
non_empty = st.text(st.characters(exclude_categories=["Cs"]), min_size=1, max_size=40)
# Text with a lone surrogate (JSON's "\ud800"), which no tokenizer can take.
broken = st.builds(lambda a, s, b: a + s + b, texts,
                   st.characters(categories=["Cs"]), texts)
scalars = (st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts)
json_values = st.recursive(
    scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(texts, inner,
                                                                         max_size=3),
    max_leaves=8)
not_strings = json_values.filter(lambda v: not isinstance(v, str))
not_ints = json_values.filter(lambda v: not isinstance(v, int) or isinstance(v, bool))
roles = st.sampled_from(["system", "developer", "user", "assistant"])


def wire(body: dict[str, Any]) -> dict[str, Any]:
    """`body` as FastAPI hands it to a validator: through JSON and back."""
    out: dict[str, Any] = json.loads(json.dumps(body))
    return out


def refused(model: type[BaseModel], body: dict[str, Any], field: str) -> ValidationError:
    """`body` is a ValidationError, every error of which is in `field`."""
    with pytest.raises(ValidationError) as info:
        model.model_validate(wire(body))
    fields = {err["loc"][0] for err in info.value.errors()}
    assert fields == {field}, info.value
    return info.value


def chat(**fields: object) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}


# ------------------------------------------------------------------------------ embedding inputs

@FAST
@given(one=non_empty, many=st.lists(non_empty, min_size=1, max_size=20),
       fmt=st.sampled_from(["float", "base64"]))
def test_valid_embedding_inputs_round_trip(one: str, many: list[str], fmt: str) -> None:
    assert EmbeddingRequest.model_validate(wire({"model": "m", "input": one})).texts == [one]
    req = EmbeddingRequest.model_validate(wire({"model": "m", "input": many,
                                                "encoding_format": fmt}))
    assert req.texts == many and req.encoding_format == fmt


def test_embedding_inputs_at_the_limit_and_over_it() -> None:
    at_limit = ["x"] * MAX_INPUTS
    assert EmbeddingRequest.model_validate(wire({"model": "m", "input": at_limit})).texts \
        == at_limit
    refused(EmbeddingRequest, {"model": "m", "input": [*at_limit, "x"]}, "input")


def _token_ids(v: object) -> bool:
    """OpenAI's token-id inputs: a non-empty list of ids (>= 0), or a non-empty list of those."""
    def ids(x: object) -> bool:
        return (isinstance(x, list) and bool(x)
                and all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in x))
    return ids(v) or (isinstance(v, list) and bool(v) and all(ids(x) for x in v))


@FAST
@given(bad=st.one_of(
    st.just(""), st.just([]), broken, st.lists(broken, min_size=1, max_size=3),
    st.lists(non_empty, max_size=3).flatmap(
        lambda ok: st.permutations([*ok, ""])),  # one empty text among good ones
    st.lists(not_strings, min_size=1, max_size=3).filter(lambda v: not _token_ids(v)),
    not_strings.filter(
        lambda v: not _token_ids(v) and (not isinstance(v, list) or not v
                                         or any(not isinstance(x, str) for x in v)))))
def test_bad_embedding_inputs_are_refused_naming_input(bad: object) -> None:
    refused(EmbeddingRequest, {"model": "m", "input": bad}, "input")


@FAST
@given(anything=json_values)
def test_any_embedding_input_validates_or_names_input(anything: object) -> None:
    try:
        req = EmbeddingRequest.model_validate(wire({"model": "m", "input": anything}))
    except ValidationError as exc:
        assert {err["loc"][0] for err in exc.errors()} == {"input"}, exc
    else:
        assert req.texts and all(isinstance(t, str) and t for t in req.texts)
        assert (req.token_ids is not None) == _token_ids(anything)


# ----------------------------------------------------------------------------- rerank documents

documents = st.lists(texts | st.builds(lambda t: {"text": t}, texts), min_size=1, max_size=20)


@FAST
@given(query=non_empty, docs=documents, top_n=st.none() | st.integers(1, 10**9),
       back=st.booleans())
def test_valid_rerank_requests_round_trip(query: str, docs: list[str | dict[str, str]],
                                          top_n: int | None, back: bool) -> None:
    req = RerankRequest.model_validate(wire({"model": "m", "query": query, "documents": docs,
                                             "top_n": top_n, "return_documents": back}))
    assert req.query == query and (req.top_n, req.return_documents) == (top_n, back)
    assert req.texts == [d if isinstance(d, str) else d["text"] for d in docs]


def test_rerank_documents_at_the_limit_and_over_it() -> None:
    at_limit = ["d"] * MAX_DOCUMENTS
    body = {"model": "m", "query": "q", "documents": at_limit}
    assert RerankRequest.model_validate(wire(body)).texts == at_limit
    refused(RerankRequest, {**body, "documents": [*at_limit, "d"]}, "documents")


@FAST
@given(bad=st.one_of(
    st.just([]), st.lists(broken, min_size=1, max_size=3), texts, st.dictionaries(texts, texts),
    st.lists(not_strings.filter(lambda v: not (isinstance(v, dict) and set(v) == {"text"}
                                               and isinstance(v["text"], str))),
             min_size=1, max_size=3),
    st.builds(lambda t, k: [{"text": t, k: t}], texts, texts.filter(lambda k: k != "text"))))
def test_bad_rerank_documents_are_refused_naming_documents(bad: object) -> None:
    refused(RerankRequest, {"model": "m", "query": "q", "documents": bad}, "documents")


@FAST
@given(top_n=st.integers(max_value=0) | not_ints.filter(lambda v: v is not None))
def test_bad_top_n_is_refused_naming_top_n(top_n: object) -> None:
    refused(RerankRequest, {"model": "m", "query": "q", "documents": ["d"], "top_n": top_n},
            "top_n")


# --------------------------------------------------------------------------------- chat messages

parts = st.lists(st.builds(lambda t: {"type": "text", "text": t}, texts), max_size=4)
messages = st.lists(
    st.fixed_dictionaries({"role": roles, "content": texts | parts},
                          optional={"name": texts}), min_size=1, max_size=8)


@FAST
@given(turns=messages)
def test_valid_chat_messages_round_trip(turns: list[dict[str, Any]]) -> None:
    req = ChatRequest.model_validate(wire({"model": "m", "messages": turns}))
    assert [m.role for m in req.messages] == [t["role"] for t in turns]
    for got, sent in zip(req.messages, turns, strict=True):
        content = sent["content"]
        assert got.text == (content if isinstance(content, str)
                            else "".join(p["text"] for p in content))
        assert got.name == sent.get("name")


def test_chat_messages_at_the_limit_and_over_it() -> None:
    turn = {"role": "user", "content": "x"}
    assert len(ChatRequest.model_validate(wire(chat(messages=[turn] * MAX_MESSAGES))).messages) \
        == MAX_MESSAGES
    refused(ChatRequest, chat(messages=[turn] * (MAX_MESSAGES + 1)), "messages")


@FAST
@given(bad=st.one_of(
    st.just([]), not_strings.filter(lambda v: not isinstance(v, list)),
    st.builds(lambda r, c: [{"role": r, "content": c}],
              texts.filter(lambda r: r not in ("system", "developer", "user", "assistant")),
              texts),
    st.builds(lambda r, c: [{"role": r, "content": c}], roles, broken),
    st.builds(lambda r, c: [{"role": r, "content": c}], roles,
              not_strings.filter(lambda v: not isinstance(v, list) or v)),
    st.builds(lambda r, t: [{"role": r, "content": [{"type": "image", "text": t}]}],
              roles, texts),
    st.builds(lambda r, k: [{"role": r, "content": "x", k: 1}], roles,
              texts.filter(lambda k: k not in ("role", "content", "name")))))
def test_bad_chat_messages_are_refused_naming_messages(bad: object) -> None:
    refused(ChatRequest, chat(messages=bad), "messages")


# -------------------------------------------------------------------------------- stop sequences

@FAST
@given(stop=st.none() | texts | st.lists(texts, max_size=4))
def test_valid_stop_sequences_round_trip(stop: str | list[str] | None) -> None:
    for model, body in ((ChatRequest, chat(stop=stop)),
                        (CompletionRequest, {"model": "m", "prompt": "p", "stop": stop})):
        req = model.model_validate(wire(body))
        assert isinstance(req, ChatRequest | CompletionRequest)
        assert req.stops == (() if stop is None else (stop,) if isinstance(stop, str)
                             else tuple(stop))


@FAST
@given(stop=st.one_of(st.lists(texts, min_size=5, max_size=8), broken,
                      st.lists(broken, min_size=1, max_size=4),
                      not_strings.filter(lambda v: v is not None and not isinstance(v, list)),
                      st.lists(not_strings, min_size=1, max_size=4)))
def test_bad_stop_sequences_are_refused_naming_stop(stop: object) -> None:
    refused(ChatRequest, chat(stop=stop), "stop")


# ------------------------------------------- generation parameters: limits and JSON types enforced

LIMITS: dict[str, tuple[st.SearchStrategy[object], st.SearchStrategy[object]]] = {
    # field: (inside its documented limits, outside them or of the wrong JSON type)
    "max_tokens": (st.integers(1, MAX_TOKENS_CAP),
                   st.integers(max_value=0) | st.integers(min_value=MAX_TOKENS_CAP + 1)
                   | st.floats() | st.booleans() | st.text()),
    "temperature": (st.floats(0.0, 2.0) | st.integers(0, 2),
                    st.floats().filter(lambda x: not 0.0 <= x <= 2.0) | st.booleans()
                    | st.text() | st.none()),
    "top_p": (st.floats(0.0, 1.0, exclude_min=True),
              st.floats().filter(lambda x: not 0.0 < x <= 1.0) | st.booleans() | st.text()
              | st.none()),
    "seed": (st.integers(0, 2**63 - 1),
             st.integers(max_value=-1) | st.integers(min_value=2**63) | st.floats()
             | st.booleans()),
    "stream": (st.booleans(), st.sampled_from(["yes", "true", 1, 0, "1", None]) | st.floats()),
    "n": (st.just(1), st.integers().filter(lambda n: n != 1) | st.just("1") | st.none()),
}


@pytest.mark.parametrize("field", sorted(LIMITS))
def test_generation_parameters_inside_limits_pass_and_outside_are_refused(field: str) -> None:
    inside, outside = LIMITS[field]

    @FAST
    @given(value=inside)
    def accepted(value: object) -> None:
        req = ChatRequest.model_validate(wire(chat(**{field: value})))
        assert getattr(req, field) == value

    @FAST
    @given(value=outside)
    def not_accepted(value: object) -> None:
        refused(ChatRequest, chat(**{field: value}), field)

    accepted()
    not_accepted()


# --------------------------------------------------------------- structured output: JSON schemas

def json_schemas(depth: int = 3) -> st.SearchStrategy[dict[str, Any]]:
    """Valid JSON schemas: types, objects, arrays, enums, combinators, local `$ref`s into
    `$defs`, and recursion through `properties` (what structured extraction asks for)."""
    leaf: st.SearchStrategy[dict[str, Any]] = st.one_of(
        st.sampled_from([{"type": t} for t in
                         ("string", "integer", "number", "boolean", "null")]),
        st.builds(lambda v: {"enum": v}, st.lists(scalars, min_size=1, max_size=4,
                                                  unique_by=json.dumps)),
        st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 50)),
        st.just({"$ref": "#/$defs/name"}),
        st.just({"type": "object", "properties": {"child": {"$ref": "#"}}}),
    )

    def grow(inner: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
        return st.one_of(
            st.builds(lambda props, req: {"type": "object", "properties": props,
                                          "required": sorted(set(req) & set(props))},
                      st.dictionaries(st.from_regex(r"[a-z]{1,8}", fullmatch=True), inner,
                                      max_size=4),
                      st.lists(st.from_regex(r"[a-z]{1,8}", fullmatch=True), max_size=3)),
            st.builds(lambda items: {"type": "array", "items": items}, inner),
            st.builds(lambda xs: {"anyOf": xs}, st.lists(inner, min_size=1, max_size=3)),
        )

    body = st.recursive(leaf, grow, max_leaves=depth * 4)
    return body.map(lambda s: {**s, "$defs": {"name": {"type": "string"}}})


def structured(schema: object) -> ChatRequest:
    return ChatRequest.model_validate(wire(chat(response_format={
        "type": "json_schema", "json_schema": {"name": "out", "schema": schema}})))


@FAST
@given(schema=json_schemas(), output=json_values)
def test_valid_schemas_are_accepted_unchanged(schema: dict[str, Any], output: object) -> None:
    got, any_object = response_format(structured(schema))
    assert got == schema and any_object is False
    checked(lambda: check_json(json.dumps(output), got, "m"))


# Schema keywords, and the values that have broken checkers before.
_KEYWORDS = ["type", "properties", "items", "anyOf", "allOf", "oneOf", "not", "if", "then",
             "else", "$ref", "$defs", "$id", "$anchor", "$dynamicRef", "$schema", "enum",
             "const", "required", "pattern", "minimum", "dependentSchemas", "prefixItems",
             "additionalProperties"]
_REFS = st.sampled_from(["#", "#/$defs/a", "#/$defs/b", "#/properties/a", "#/allOf/0",
                         "#/anyOf/0", "#a", "#/%zz", "#/$defs/a~2", "http://example.com/s",
                         "other.json#/x", "#meta", "", "#/items"])


def _schemaish(inner: st.SearchStrategy[object]) -> st.SearchStrategy[object]:
    return st.dictionaries(
        st.sampled_from(_KEYWORDS),
        st.one_of(inner, _REFS, st.dictionaries(st.sampled_from(["a", "b"]), inner, max_size=2),
                  st.lists(inner, max_size=2)),
        max_size=4)


schemaish = st.recursive(st.booleans() | _schemaish(json_values) | _REFS.map(
    lambda r: {"$ref": r}), _schemaish, max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(schema=schemaish.filter(lambda s: isinstance(s, dict)), output=json_values)
@example(schema={"$ref": "#"}, output={"a": 1})
@example(schema={"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}, output=1)
@example(schema={"anyOf": [{"type": "string"}, {"$ref": "#"}]}, output=1)
@example(schema={"properties": {"a": {"$id": "http://e.example/s", "$ref": "#/$defs/x"}},
                 "$defs": {"x": {}}}, output={"a": 1})
@example(schema={"$dynamicRef": "#meta"}, output=1)
@example(schema={"$dynamicRef": "http://example.com/s"}, output=1)
def test_any_schema_is_accepted_or_refused_and_the_output_check_never_breaks(
        schema: dict[str, Any], output: object) -> None:
    try:
        got, _ = response_format(structured(schema))
    except InvalidRequest as exc:
        assert exc.param == "response_format" and exc.status == 400
        return
    assert got == schema
    checked(lambda: check_json(json.dumps(output), got, "m"))


def checked(run: Callable[[], None]) -> None:
    """The output check passes or says the output is invalid; nothing else."""
    try:
        run()
    except ModelOutputInvalid as exc:
        assert exc.status == 502


def test_schemas_deeper_than_the_limit_are_refused() -> None:
    def nested(levels: int) -> dict[str, Any]:
        schema: dict[str, Any] = {"type": "string"}
        for _ in range(levels):
            schema = {"type": "object", "properties": {"a": schema}}
        return schema

    fits = nested((MAX_SCHEMA_DEPTH - 1) // 2)  # two JSON levels per schema level
    assert response_format(structured(fits))[0] == fits
    with pytest.raises(InvalidRequest, match=r"nested \d+ levels deep"):
        response_format(structured(nested(MAX_SCHEMA_DEPTH)))


def test_recursive_schemas_that_descend_are_accepted() -> None:
    node = {"type": "object", "required": ["kids"],
            "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}}}
    tree: dict[str, object] = {"$defs": {"node": node}, "$ref": "#/$defs/node"}
    assert response_format(structured(tree))[0] == tree
    check_json('{"kids": [{"kids": []}, {"kids": [{"kids": []}]}]}', tree, "m")
    with pytest.raises(ModelOutputInvalid):
        check_json('{"kids": [{"leaves": []}]}', tree, "m")
    # Output nested deeper than the checker (or the JSON parser) can follow is invalid output,
    # not a crash.
    for levels in (400, 5000):
        deep = '{"kids": [' * levels + '{"kids": []}' + "]}" * levels
        with pytest.raises(ModelOutputInvalid, match="nested too deeply"):
            check_json(deep, tree, "m")


def test_keywords_inside_values_are_not_references() -> None:
    """`enum`, `const` and `default` hold data: a "$ref" key there is not a reference."""
    schema = {"enum": [{"$ref": "http://example.com/s"}], "default": {"$ref": "#/nowhere"}}
    assert response_format(structured(schema))[0] == schema


@FAST
@given(fmt=st.sampled_from(["text", "json_object"]))
def test_text_and_json_object_formats(fmt: str) -> None:
    req = ChatRequest.model_validate(wire(chat(response_format={"type": fmt})))
    assert response_format(req) == (None, fmt == "json_object")


@FAST
@given(schema=not_strings.filter(lambda v: not isinstance(v, dict)))
def test_a_schema_that_is_not_an_object_is_refused_naming_response_format(schema: object
                                                                          ) -> None:
    refused(ChatRequest, chat(response_format={"type": "json_schema",
                                               "json_schema": {"schema": schema}}),
            "response_format")
    refused(ChatRequest, chat(response_format={"type": "json_schema"}), "response_format")
