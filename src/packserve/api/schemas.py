"""Request bodies, validated strictly: unknown fields, values of the wrong JSON type ("yes" for a
boolean, "3" for a number) and absurd values are a 400, not a guess, as OpenAI's API answers."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

MAX_INPUTS = 2048
MAX_DOCUMENTS = 1000
MAX_MESSAGES = 1000
MAX_TOKENS_CAP = 1_048_576

def _encodable(value: str) -> str:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"text is not valid Unicode ({exc.reason} at position {exc.start})"
                         ) from exc
    return value


# Every text field: JSON may carry lone surrogates (\ud800) that no tokenizer can take.
Text = Annotated[str, AfterValidator(_encodable)]
NonEmpty = Annotated[Text, Field(min_length=1)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: NonEmpty
    user: Text | None = None  # accepted for OpenAI compatibility; not stored


class EmbeddingRequest(_Body):
    input: NonEmpty | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_INPUTS)]
    encoding_format: Literal["float", "base64"] = "float"

    @property
    def texts(self) -> list[str]:
        return [self.input] if isinstance(self.input, str) else list(self.input)


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    text: Text


class RerankRequest(_Body):
    query: NonEmpty
    documents: Annotated[list[Text | RerankDocument], Field(min_length=1, max_length=MAX_DOCUMENTS)]
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = False

    @property
    def texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | list[TextPart]
    name: Text | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, object] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Generation(_Body):
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    temperature: float = Field(default=0.7, ge=0.0, le=2.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1, description="only one choice per request")
    stop: Text | Annotated[list[Text], Field(max_length=4)] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    response_format: ResponseFormat | None = None

    @field_validator("response_format")
    @classmethod
    def _schema_given(cls, v: ResponseFormat | None) -> ResponseFormat | None:
        if v is not None and v.type == "json_schema" and v.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object with a schema")
        return v


class CompletionRequest(_Generation):
    prompt: Text | Annotated[list[Text], Field(min_length=1, max_length=16)]
    max_tokens: int | None = Field(default=16, ge=1, le=MAX_TOKENS_CAP)

    @property
    def prompts(self) -> list[str]:
        return [self.prompt] if isinstance(self.prompt, str) else list(self.prompt)
