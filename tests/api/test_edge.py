"""What both edges do to a relayed request (api.edge), without a worker or a pool: the headers
sent on, the error answers, reading a body's model, and a key's hold on its limits."""

from __future__ import annotations

import json
import logging

import pytest
from starlette.applications import Starlette
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.testclient import TestClient

from packserve import auth
from packserve.api import edge
from packserve.errors import RateLimited


def test_relayed_headers_drop_the_hop_and_carry_one_request_id() -> None:
    raw = [(b"Host", b"here:8000"), (b"Connection", b"keep-alive"), (b"Content-Length", b"9"),
           (b"X-Request-ID", b"client-chosen"), (b"Authorization", b"Bearer k"),
           (b"Transfer-Encoding", b"chunked"), (b"accept", b"*/*")]
    assert edge.relayed_headers(raw, "req-1") == [
        (b"Host", b"here:8000"), (b"Authorization", b"Bearer k"), (b"accept", b"*/*"),
        (b"x-request-id", b"req-1")]
    dropped = edge.relayed_headers(raw, "req-1", drop=frozenset({b"authorization"}))
    assert (b"Authorization", b"Bearer k") not in dropped
    assert edge.HOP < edge.HOP_RESPONSE and {b"date", b"server"} <= edge.HOP_RESPONSE - edge.HOP


def test_an_error_answer_is_openais_shape_with_retry_after_in_whole_seconds() -> None:
    r = edge.error_response(503, "gone", "model_unavailable", "replica_lost", retry_after=0.2)
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert json.loads(bytes(r.body)) == {"error": {"message": "gone", "type": "model_unavailable",
                                            "param": None, "code": "replica_lost"}}
    no_wait = edge.error_response(404, "no", "invalid_request_error", "model_not_found",
                             param="model")
    assert "retry-after" not in no_wait.headers
    assert json.loads(bytes(no_wait.body))["error"]["param"] == "model"


def test_a_packserve_error_answers_with_its_status_type_code_and_headers() -> None:
    r = edge.error_of(RateLimited("key 'k' is over its limit", retry_after_s=3))
    assert r.status_code == 429 and r.headers["retry-after"] == "3"
    assert json.loads(bytes(r.body))["error"] == {"message": "key 'k' is over its limit",
                                           "type": "rate_limit_error", "param": None,
                                           "code": "rate_limit_exceeded"}


def test_the_handlers_answer_starlettes_refusals_and_the_unexpected() -> None:
    async def too_large(_: Request) -> Response:
        raise StarletteHTTPException(413, "body over 10 bytes")

    async def broken(_: Request) -> Response:
        raise RuntimeError("boom")

    app = Starlette(routes=[Route("/big", too_large), Route("/broken", broken)],
                    exception_handlers={StarletteHTTPException: edge.http_error,
                                        Exception: edge.unexpected(logging.getLogger("t"), "edge")})
    with TestClient(app, raise_server_exceptions=False) as c:
        big = c.get("/big")
        assert big.status_code == 413 and big.json()["error"] == {
            "message": "body over 10 bytes", "type": "invalid_request_error", "param": None,
            "code": "request_too_large"}
        assert c.post("/big").json()["error"]["code"] == "405"
        failed = c.get("/broken")
        assert failed.status_code == 500
        assert failed.json()["error"]["message"] == "internal error: RuntimeError: boom"


@pytest.mark.parametrize(("body", "sniffed"), [
    (b'{"model": "m", "stream": true}', edge.Sniffed("m", True)),
    (b'{"model": "m", "stream": "yes"}', edge.Sniffed("m", False)),
    (b'{"model": "m"}', edge.Sniffed("m", False)),
    (b'{"model": 3, "stream": true}', edge.Sniffed(None)),
    (b'{"mod', edge.Sniffed(None)),
    (b'["model"]', edge.Sniffed(None)),
    (b'', edge.Sniffed(None)),
    (b' {"model": "m"}', edge.Sniffed(None)),  # parsed only when it is plainly an object
    (b'{"model": ' + b"[" * 100_000, edge.Sniffed(None)),  # deeper than the parser goes: no 500
])
def test_sniff_reads_the_model_and_the_stream_flag(body: bytes, sniffed: edge.Sniffed) -> None:
    assert edge.sniff(body) == sniffed


def test_usage_tokens_reads_the_last_total() -> None:
    assert edge.usage_tokens(b'{"usage": {"prompt_tokens": 3, "total_tokens": 12}}') == 12
    assert edge.usage_tokens(b'{"total_tokens": 1}' + b" " * 2000 + b'{"total_tokens":  7}') == 7
    assert edge.usage_tokens(b'{"total_tokens": 5}' + b" " * 2000) == 5  # not in the tail
    assert edge.usage_tokens(b'{"choices": []}') == 0


def _key(concurrent_requests: int, tokens_per_minute: int) -> auth.Key:
    return auth.Key(name="team", digest=b"", models=("*",), admin=False,
                    concurrent_requests=concurrent_requests, tokens_per_minute=tokens_per_minute)


def test_a_hold_admits_counts_and_releases_once() -> None:
    now = [0.0]
    limits = auth.KeyLimits(lambda: now[0])
    key = _key(concurrent_requests=1, tokens_per_minute=60)
    hold = edge.KeyHold.admit(limits, key)
    with pytest.raises(RateLimited):  # one at once
        edge.KeyHold.admit(limits, key)
    hold.count(b'data: {"choices": []}\n\n')
    hold.count(b'data: {"usage": {"total_tokens": 60}}\n\n')
    hold.release()
    hold.release()  # a second release gives nothing back twice
    with pytest.raises(RateLimited, match="tokens_per_minute"):  # its 60 tokens were charged
        edge.KeyHold.admit(limits, key)
    now[0] = 2.0
    edge.KeyHold.admit(limits, key).release()


def test_a_request_without_a_key_holds_nothing() -> None:
    hold = edge.KeyHold.admit(auth.KeyLimits(), None)
    hold.count(b'{"total_tokens": 4}')
    hold.release()
    assert hold.tokens == 4 and not hold.released
