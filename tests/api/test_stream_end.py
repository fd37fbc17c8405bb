"""Ending a relayed stream whose source died (api.stream_end), on plain bytes: chat's shape, and
/v1/responses' typed events however the relayed bytes were cut into chunks."""

from __future__ import annotations

import json

from packserve.api.stream_end import StreamEnd

CREATED = (b'event: response.created\ndata: {"type": "response.created", "sequence_number": 0, '
           b'"response": {"id": "resp_1", "object": "response", "status": "in_progress", '
           b'"model": "m", "output": []}}\n\n')
DELTA = (b'event: response.output_text.delta\ndata: {"type": "response.output_text.delta", '
         b'"sequence_number": 1, "delta": "Hel"}\n\n')


def _events(raw: bytes) -> list[dict[str, object]]:
    return [json.loads(line[6:]) for line in raw.split(b"\n") if line.startswith(b"data: {")]


def test_a_chat_stream_ends_with_an_error_event_and_done() -> None:
    end = StreamEnd("/v1/chat/completions")
    end.seen(b'data: {"choices": []}\n\ndata: {"cho')  # cut mid-event
    out = end.ending("gone", "engine_crashed")
    assert out.startswith(b"\n\ndata: ") and out.endswith(b"data: [DONE]\n\n")
    assert _events(out)[0] == {"error": {"message": "gone", "type": "model_unavailable",
                                         "param": None, "code": "engine_crashed"}}


def test_a_responses_stream_ends_typed_whatever_the_chunks() -> None:
    stream = CREATED + DELTA
    for cut in (1, 40, len(CREATED) - 1, len(CREATED), len(CREATED) + 30, len(stream)):
        end = StreamEnd("/v1/responses")
        end.seen(stream[:cut])
        end.seen(stream[cut:])
        error, failed = _events(end.ending("gone", "replica_lost"))
        assert error == {"type": "error", "sequence_number": 2, "code": "replica_lost",
                         "message": "gone", "param": None}
        assert failed["type"] == "response.failed" and failed["sequence_number"] == 3
        assert failed["response"] == {"id": "resp_1", "object": "response", "status": "failed",
                                      "model": "m", "output": [],
                                      "error": {"code": "replica_lost", "message": "gone"}}


def test_a_responses_stream_cut_before_its_first_event_still_ends_typed() -> None:
    end = StreamEnd("/v1/responses")
    end.seen(CREATED[:30])
    error, failed = _events(end.ending("gone", "engine_crashed"))
    assert error["sequence_number"] == 0 and failed["sequence_number"] == 1
    assert failed["response"] == {"status": "failed",
                                  "error": {"code": "engine_crashed", "message": "gone"}}
