"""Structured output for chat and responses: the requested `response_format` (`text.format`) is
checked before anything runs, and what the model produced is checked against it before it is
passed off as an answer."""

from __future__ import annotations

import json
from typing import Any

from packserve.api.schemas import ChatRequest, ResponsesRequest
from packserve.errors import InvalidRequest, ModelOutputInvalid

# A schema nested deeper than this (objects and arrays, counted in the JSON) is refused: the
# validator recurses once per level, several frames deep, and Python's stack is not endless.
MAX_SCHEMA_DEPTH = 64


def response_format(body: ChatRequest) -> tuple[dict[str, object] | None, bool]:
    """(the JSON schema to constrain the output to, or None; whether any JSON object will do).
    Raises InvalidRequest for a schema that is invalid, nested deeper than `MAX_SCHEMA_DEPTH`,
    or that the output check could not apply (see `_check_refs`)."""
    fmt = body.response_format
    if fmt is None:
        return None, False
    return _format(fmt.type, fmt.json_schema.schema_ if fmt.json_schema else None,
                   "response_format", "response_format.json_schema.schema")


def text_format(body: ResponsesRequest) -> tuple[dict[str, object] | None, bool]:
    """As `response_format`, for /v1/responses' `text.format`."""
    fmt = body.text.format if body.text else None
    if fmt is None:
        return None, False
    return _format(fmt.type, fmt.schema_, "text.format", "text.format.schema")


def _format(type_: str, schema: dict[str, object] | None, param: str, where: str
            ) -> tuple[dict[str, object] | None, bool]:
    if type_ == "text":
        return None, False
    if type_ == "json_object":
        return None, True
    assert schema is not None  # the body's own validator requires it
    return checked_schema(schema, param, where), False


def checked_schema(schema: dict[str, object], param: str, where: str) -> dict[str, object]:
    """`schema`, once it is known that the output check (`check_json`) can apply it: valid,
    nested at most `MAX_SCHEMA_DEPTH` deep, its references local (see `_check_refs`). Else
    InvalidRequest naming `param`; `where` is the schema's place in the request body."""
    from jsonschema import Draft202012Validator
    from jsonschema.exceptions import SchemaError

    depth = _depth(schema)
    if depth > MAX_SCHEMA_DEPTH:
        raise InvalidRequest(f"{where} is nested {depth} levels deep; at most "
                             f"{MAX_SCHEMA_DEPTH} are accepted", param=param)
    try:
        Draft202012Validator.check_schema(schema)
    except SchemaError as exc:
        raise InvalidRequest(f"{where} is not a valid JSON schema: {exc.message}",
                             param=param) from exc
    _check_refs(schema, param)
    return schema


def check_json(text: str, schema: dict[str, object] | None, model: str) -> None:
    """Never pass broken JSON off as an answer: it must parse and match the schema. Output
    nested deeper than Python's stack can follow is refused as such, never a crash."""
    try:
        value = json.loads(text)
        errors = [] if schema is None else sorted(_validator(schema).iter_errors(value), key=str)
    except RecursionError as exc:
        raise ModelOutputInvalid(f"model {model!r} produced JSON nested too deeply to "
                                 f"check") from exc
    except ValueError as exc:
        raise ModelOutputInvalid(f"model {model!r} stopped with output that is not JSON: "
                                 f"{exc}") from exc
    if errors:
        raise ModelOutputInvalid(f"model {model!r} produced JSON that does not match the "
                                 f"schema: {errors[0].message}")
    if schema is None and not isinstance(value, dict):
        raise ModelOutputInvalid(f"model {model!r} produced JSON that is not an object")


def _depth(value: object) -> int:
    """How deeply objects and arrays nest in a JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        children = (node.values() if isinstance(node, dict)
                    else node if isinstance(node, list) else None)
        if children is not None:
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in children)
    return deepest


# The applicators that apply a subschema to the very value being checked (not to a part of it):
# a `$ref` cycle through these alone would never end.
_IN_PLACE = ("allOf", "anyOf", "oneOf", "not", "if", "then", "else", "dependentSchemas")


def _check_refs(schema: dict[str, object], param: str) -> None:
    """What the output check (`check_json`) can apply, refused before anything runs, else it
    would fail after the model ran: only local `$ref`s, all resolvable, nothing ever fetched on
    a client's behalf; no `$id` below the root (it would move where `#...` refers to) and no
    `$dynamicRef`; no `$ref` that comes back to itself without descending into the value
    (`{"$ref": "#"}`). Recursion through `properties`, `items` and the like is fine."""
    from referencing import Registry, Resource
    from referencing.exceptions import Unresolvable
    from referencing.jsonschema import DRAFT202012

    resolver = Registry().with_resource(
        "urn:packserve:request", Resource.from_contents(schema, DRAFT202012)
    ).resolver("urn:packserve:request")
    targets: dict[int, object] = {}  # id of a subschema with a $ref -> what it refers to
    stack: list[object] = [schema]
    while stack:  # every subschema, by the dialect's own idea of where subschemas are
        node = stack.pop()
        if not isinstance(node, dict):
            continue
        stack.extend(DRAFT202012.subresources_of(node))
        if node is not schema and "$id" in node:
            raise InvalidRequest("schema $id is only accepted at the root (below it, it would "
                                 "change what '#...' references mean)", param=param)
        if "$dynamicRef" in node:
            raise InvalidRequest("schema $dynamicRef is not supported; use $ref", param=param)
        ref = node.get("$ref")
        if not isinstance(ref, str):
            continue
        if not ref.startswith("#"):
            raise InvalidRequest(f"schema $ref {ref!r} is not local; only '#/...' references "
                                 f"are allowed", param=param)
        try:
            targets[id(node)] = resolver.lookup(ref).contents
        except Unresolvable as exc:
            raise InvalidRequest(f"schema $ref {ref!r} does not resolve", param=param
                                 ) from exc
    _check_cycles(schema, targets, param)


def _check_cycles(schema: dict[str, object], targets: dict[int, object], param: str
                  ) -> None:
    """Refuse a `$ref` cycle that stays on the same value (depth-first over `_IN_PLACE` and
    `$ref` edges; `targets` maps each subschema with a `$ref` to its target)."""

    def in_place(node: object) -> list[object]:
        if not isinstance(node, dict):
            return []
        out = [targets[id(node)]] if id(node) in targets else []
        for key in _IN_PLACE:
            child = node.get(key)
            if isinstance(child, list):
                out.extend(child)
            elif isinstance(child, dict) and key == "dependentSchemas":
                out.extend(child.values())
            elif child is not None:
                out.append(child)
        return out

    done: set[int] = set()
    for start in [schema, *targets.values()]:
        if id(start) in done:
            continue
        path: set[int] = {id(start)}
        stack = [(start, iter(in_place(start)))]
        while stack:
            node, children = stack[-1]
            child = next(children, None)
            if child is None:
                stack.pop()
                path.discard(id(node))
                done.add(id(node))
                continue
            if id(child) in path:
                raise InvalidRequest("schema $ref refers back to itself without descending into "
                                     "the value (as {'$ref': '#'} does): checking the output "
                                     "against it would never end", param=param)
            if id(child) not in done:
                path.add(id(child))
                stack.append((child, iter(in_place(child))))


def _validator(schema: dict[str, object]) -> Any:
    from jsonschema import Draft202012Validator
    from referencing import Registry

    return Draft202012Validator(schema, registry=Registry())
