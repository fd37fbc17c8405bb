"""Structured output for chat: the requested `response_format` is checked before anything runs,
and what the model produced is checked against it before it is passed off as an answer."""

from __future__ import annotations

import json
from typing import Any

from packserve.api.schemas import ChatRequest
from packserve.errors import InvalidRequest, ModelOutputInvalid


def response_format(body: ChatRequest) -> tuple[dict[str, object] | None, bool]:
    """(the JSON schema to constrain the output to, or None; whether any JSON object will do).
    Raises InvalidRequest for a schema that is invalid or has a non-local `$ref`."""
    fmt = body.response_format
    if fmt is None or fmt.type == "text":
        return None, False
    if fmt.type == "json_object":
        return None, True
    assert fmt.json_schema is not None
    schema = fmt.json_schema.schema_
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequest(f"response_format.json_schema.schema is not a valid JSON schema: "
                             f"{exc.message}", param="response_format") from exc
    _check_refs(schema)
    return schema, False


def check_json(text: str, schema: dict[str, object] | None, model: str) -> None:
    """Never pass broken JSON off as an answer: it must parse and match the schema."""
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise ModelOutputInvalid(f"model {model!r} stopped with output that is not JSON: "
                                 f"{exc}") from exc
    if schema is not None:
        errors = sorted(_validator(schema).iter_errors(value), key=str)
        if errors:
            raise ModelOutputInvalid(f"model {model!r} produced JSON that does not match the "
                                     f"schema: {errors[0].message}")
    elif not isinstance(value, dict):
        raise ModelOutputInvalid(f"model {model!r} produced JSON that is not an object")


def _refs(node: object) -> list[str]:
    if isinstance(node, dict):
        own = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return own + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for v in node for r in _refs(v)]
    return []


def _check_refs(schema: dict[str, object]) -> None:
    """Only local `$ref`s, all resolvable: nothing is ever fetched on a client's behalf."""
    from referencing import Registry, Resource
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import DRAFT202012

    resolver = Registry().with_resource(
        "urn:packserve:request", Resource.from_contents(schema, DRAFT202012)
    ).resolver("urn:packserve:request")
    for ref in _refs(schema):
        if not ref.startswith("#"):
            raise InvalidRequest(f"schema $ref {ref!r} is not local; only '#/...' references "
                                 f"are allowed", param="response_format")
        try:
            resolver.lookup(ref)
        except Unresolvable as exc:
            raise InvalidRequest(f"schema $ref {ref!r} does not resolve", param="response_format"
                                 ) from exc


def _validator(schema: dict[str, object]) -> Any:
    from jsonschema import Draft202012Validator
    from referencing import Registry

    return Draft202012Validator(schema, registry=Registry())
