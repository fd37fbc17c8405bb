"""LangChain's OpenAI integration pointed at packserve, as an application would use it: chat,
tools bound and forced, structured output (JSON schema and function calling), embeddings.

The small default chat model may answer badly; these tests check the protocol (shapes, that a
forced call parses against its schema), not the model's judgement.
"""

from __future__ import annotations

import numpy as np
import pytest
from langchain_core.messages import AIMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI, OpenAIEmbeddings
from pydantic import BaseModel

from tests.factories import Running

pytestmark = pytest.mark.real

CHAT, EXTRACT, EMBEDDER = "smollm2-135m-instruct", "smollm2-extract", "all-minilm-l6-v2"


def _chat(server: Running, model: str = CHAT) -> ChatOpenAI:
    return ChatOpenAI(model=model, base_url=f"{server.url}/v1", api_key="unused",  # type: ignore[arg-type]
                      temperature=0, max_tokens=48, timeout=120, max_retries=0)  # type: ignore[call-arg]


@tool
def get_weather(city: str, unit: str = "celsius") -> str:
    """The current weather in a city."""
    return f"12 degrees {unit} in {city}"


class Person(BaseModel):
    name: str
    age: int


def test_chat_invoke_answers_with_text(default_server: Running) -> None:
    reply = _chat(default_server).invoke("Say hello.")
    assert isinstance(reply, AIMessage) and isinstance(reply.content, str) and reply.content
    assert reply.usage_metadata is not None and reply.usage_metadata["output_tokens"] > 0


def test_bind_tools_with_a_forced_tool_gives_a_call_that_parses(default_server: Running) -> None:
    bound = _chat(default_server).bind_tools([get_weather], tool_choice="get_weather")
    reply = bound.invoke("What is the weather in Paris?")
    assert isinstance(reply, AIMessage)
    (call,) = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"].get("city"), str)
    assert not reply.invalid_tool_calls
    # The tool runs on the model's arguments, as an agent loop would do next.
    assert "degrees" in get_weather.invoke(call["args"])


def test_structured_output_by_json_schema(default_server: Running) -> None:
    structured = _chat(default_server, EXTRACT).with_structured_output(Person,
                                                                       method="json_schema")
    person = structured.invoke("Extract the person: Ada Lovelace, 36 years old.")
    assert isinstance(person, Person)


def test_structured_output_by_function_calling(default_server: Running) -> None:
    structured = _chat(default_server, EXTRACT).with_structured_output(
        Person, method="function_calling")
    person = structured.invoke("Extract the person: Alan Turing, 41 years old.")
    assert isinstance(person, Person)


def test_embeddings_match_the_servers_own(default_server: Running) -> None:
    # LangChain counts tokens with tiktoken, whose files come from the internet: off.
    embedder = OpenAIEmbeddings(model=EMBEDDER, base_url=f"{default_server.url}/v1",
                                api_key="unused", check_embedding_ctx_length=False)  # type: ignore[arg-type]
    docs = embedder.embed_documents(["The cat sits on the mat.", "Quarterly revenue grew."])
    query = embedder.embed_query("A kitten rests on a rug.")
    assert len(docs) == 2 and len(query) == 384
    with default_server.client() as c:
        direct = c.post("/v1/embeddings", json={"model": EMBEDDER,
                                                "input": "A kitten rests on a rug."}).json()
    np.testing.assert_allclose(query, direct["data"][0]["embedding"], rtol=1e-5, atol=1e-6)
    sims = np.array(docs) @ np.array(query)
    assert sims[0] > sims[1]
