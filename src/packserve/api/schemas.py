"""Request bodies, validated strictly: unknown fields, values of the wrong JSON type ("yes" for a
boolean, "3" for a number) and absurd values are a 400, not a guess, as OpenAI's API answers."""

from __future__ import annotations

from typing import Annotated, Literal, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from packserve.core.backend import EXTENSIONS
from packserve.units import parse_duration

MAX_INPUTS = 2048
MAX_DOCUMENTS = 1000
MAX_MESSAGES = 1000
MAX_TOKENS_CAP = 1_048_576
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs, as OpenAI allows
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs, as OpenAI allows

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
    # Ollama's: how long the model stays loaded once idle after this request ("5m", 300, 0:
    # at once, -1: never); the last request's wins. Admin keys only where keys are configured.
    keep_alive: Annotated[float, BeforeValidator(parse_duration), WithJsonSchema(
        {"anyOf": [{"type": "number"}, {"type": "string"}]})] | None = None


TokenId = Annotated[int, Field(ge=0)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]  # ids of the model's own vocabulary
Inputs = str | list[str] | list[int] | list[list[int]]


def _token_rows(value: Inputs) -> list[list[int]] | None:
    """Inputs given as token ids (OpenAI's `list[int]`, one input, and `list[list[int]]`), as
    rows; None when they are text."""
    if isinstance(value, str) or isinstance(value[0], str):
        return None
    rows = value if isinstance(value[0], list) else [value]
    return [list(row) for row in rows]


def _texts(value: Inputs) -> list[str]:
    return [value] if isinstance(value, str) else list(cast("list[str]", value))


class EmbeddingRequest(_Body):
    input: (NonEmpty | Annotated[list[NonEmpty], Field(min_length=1, max_length=MAX_INPUTS)]
            | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_INPUTS)])
    encoding_format: Literal["float", "base64"] = "float"

    @property
    def token_ids(self) -> list[list[int]] | None:
        """The inputs as rows of token ids, or None when they are texts."""
        return _token_rows(self.input)

    @property
    def texts(self) -> list[str]:
        """The inputs as texts; for token-id inputs, a placeholder per input (max_inputs counts
        them)."""
        ids = self.token_ids
        if ids is not None:
            return [f"<{len(row)} token ids>" for row in ids]
        return _texts(self.input)


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


# ---------------------------------------------------------------- function tools (chat)

MAX_TOOLS = 128  # as OpenAI allows
ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: ToolName
    description: Text | None = None
    parameters: dict[str, object] | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # the output always matches `parameters` here


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionDef


class FunctionName(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: ToolName


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["function"]
    function: FunctionName


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: ToolName
    arguments: Text  # JSON text, as the model produced it


class AssistantToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    id: Annotated[Text, Field(min_length=1, max_length=256)]
    type: Literal["function"]
    function: FunctionCall


class _Turn(BaseModel):
    """What every chat message has. Each role is its own model (`ChatMessage` picks one by
    `role`), so the OpenAPI document says exactly what each role takes."""

    model_config = ConfigDict(extra="forbid", strict=True)
    name: Text | None = None

    @property
    def text(self) -> str:
        content: Text | list[TextPart] | None = getattr(self, "content", None)
        if content is None or isinstance(content, str):
            return content or ""
        return "".join(p.text for p in content)

    @property
    def calls(self) -> list[AssistantToolCall]:
        """The tool calls an assistant message made (none for other roles)."""
        return []

    @property
    def answers(self) -> str | None:
        """The id of the call a tool message answers (None for other roles)."""
        return None


class PromptMessage(_Turn):
    role: Literal["system", "developer", "user"]
    content: Text | list[TextPart]


class AssistantMessage(_Turn):
    role: Literal["assistant"]
    content: Text | list[TextPart] | None = None  # may be null when it made tool calls
    tool_calls: Annotated[list[AssistantToolCall], Field(min_length=1, max_length=MAX_TOOLS)
                          ] | None = None
    # What an answer's message carries and clients send back whole (`message.model_dump()`):
    # accepted and ignored (null or empty, as packserve's own answers have them).
    refusal: Text | None = None
    annotations: Annotated[list[dict[str, object]], Field(max_length=0)] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _says_something(self) -> AssistantMessage:
        if self.content is None and self.tool_calls is None:
            raise ValueError("an assistant message needs content or tool_calls")
        return self

    @property
    def calls(self) -> list[AssistantToolCall]:
        return self.tool_calls or []


class ToolMessage(_Turn):
    role: Literal["tool"]
    content: Text | list[TextPart]
    tool_call_id: Annotated[Text, Field(min_length=1, max_length=256)]

    @property
    def answers(self) -> str | None:
        return self.tool_call_id


ChatMessage = Annotated[PromptMessage | AssistantMessage | ToolMessage,
                        Field(discriminator="role")]


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
    # vLLM's: usage (the tokens so far) in every chunk that carries text, not only at the end
    continuous_usage_stats: bool = False


MAX_METADATA = 16  # key-value pairs, keys of at most 64 characters, values of at most 512


class _Ignored(BaseModel):
    """Fields that OpenAI's clients send and that change nothing here: packserve stores nothing,
    has one service tier, and runs tool calls one at a time. Accepted (when well-typed) and
    ignored, so that a client that sends them is not refused."""

    store: bool | None = None
    metadata: Annotated[dict[Annotated[Text, Field(max_length=64)],
                             Annotated[Text, Field(max_length=512)]],
                        Field(max_length=MAX_METADATA)] | None = None
    parallel_tool_calls: bool | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority", "fast",
                          "ultrafast"] | None = None


MAX_LOGIT_BIAS = 1024  # entries, as OpenAI allows


def _token_keys(value: dict[str, float] | None) -> dict[str, float] | None:
    for key in value or {}:
        if not key.isascii() or not key.isdigit():
            raise ValueError(f"logit_bias keys are token ids written as strings; {key!r} is not")
    return value


class _Generation(_Body):
    max_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    temperature: float = Field(default=0.7, ge=0.0, le=2.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1, description="only one choice per request")
    stop: Text | Annotated[list[Text], Field(max_length=4)] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Sampling beyond OpenAI's: absent, each keeps the engine's default (llama.cpp's: top_k 40,
    # min_p 0.05, no penalties).
    top_k: int | None = Field(default=None, ge=-1, description="-1 or 0: every token")
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0, le=10.0)
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100.0, le=100.0)]],
                          Field(max_length=MAX_LOGIT_BIAS), AfterValidator(_token_keys)
                          ] | None = None
    # vLLM's: generate past the end-of-generation tokens (to max_tokens), or not before
    # min_tokens tokens; stop strings still apply.
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0, le=MAX_TOKENS_CAP)

    @model_validator(mode="after")
    def _min_below_max(self) -> _Generation:
        cap = getattr(self, "max_completion_tokens", None) or self.max_tokens
        if self.min_tokens and cap is not None and self.min_tokens > cap:
            raise ValueError(f"min_tokens ({self.min_tokens}) is above max_tokens ({cap})")
        return self

    @property
    def extensions(self) -> tuple[str, ...]:
        """The fields of EXTENSIONS this request sets to other than their default."""
        defaults = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "ignore_eos": False,
                    "min_tokens": 0}
        return tuple(name for name in EXTENSIONS
                     if getattr(self, name) != defaults.get(name))

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)

    @property
    def stops(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatRequest(_Generation, _Ignored):
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_completion_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    response_format: ResponseFormat | None = None
    tools: Annotated[list[ToolDef], Field(min_length=1, max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _logprobs_asked(cls, v: int | None, info: ValidationInfo) -> int | None:
        if v is not None and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return v

    @field_validator("response_format")
    @classmethod
    def _schema_given(cls, v: ResponseFormat | None) -> ResponseFormat | None:
        if v is not None and v.type == "json_schema" and v.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object with a schema")
        return v


class CompletionRequest(_Generation):
    prompt: (Text | Annotated[list[Text], Field(min_length=1, max_length=16)]
             | TokenIds | Annotated[list[TokenIds], Field(min_length=1, max_length=16)])
    # 0 is refused in api.request, after `echo` (OpenAI's way to score a prompt is both)
    max_tokens: int | None = Field(default=16, ge=0, le=MAX_TOKENS_CAP)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_COMPLETION_LOGPROBS)
    echo: bool = False  # OpenAI's; true is refused with a 400 (api.request.ECHO_REFUSED)

    @property
    def token_ids(self) -> list[list[int]] | None:
        """The prompts as rows of token ids, or None when they are texts."""
        return _token_rows(self.prompt)

    @property
    def prompts(self) -> list[str]:
        """The prompts as texts (token-id prompts: empty, their text is the engine's)."""
        ids = self.token_ids
        return _texts(self.prompt) if ids is None else ["" for _ in ids]


# ------------------------------------------------------------------------------ /v1/responses

class InputText(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["input_text"]
    text: Text


class OutputText(BaseModel):
    """An assistant's earlier text, as a response's `output` carries it (a client that keeps
    the conversation itself sends it back); its annotations and logprobs are ignored."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["output_text"]
    text: Text
    annotations: Annotated[list[dict[str, object]], Field(max_length=MAX_MESSAGES)] = []
    logprobs: Annotated[list[dict[str, object]], Field(max_length=MAX_TOKENS_CAP)] | None = None


class InputMessage(BaseModel):
    """One message of `input`: the plain form (`role`, `content`) or the item form the SDK and
    a response's `output` carry (`type: "message"`, and an output message's `id` and
    `status`, which are ignored)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["message"] | None = None
    role: Literal["system", "developer", "user", "assistant"]
    content: Text | Annotated[list[InputText | OutputText], Field(max_length=MAX_MESSAGES)]
    id: Text | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @property
    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class TextFormat(BaseModel):
    """`text.format`: plain text, any JSON object, or JSON matching `schema`."""

    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)
    type: Literal["text", "json_object", "json_schema"]
    name: Text | None = None
    description: Text | None = None
    schema_: dict[str, object] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and (self.schema_ is None or self.name is None):
            raise ValueError("type json_schema needs a name and a schema")
        return self


class TextConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    format: TextFormat | None = None


class ResponsesRequest(_Body, _Ignored):
    """`/v1/responses`, the text subset. `previous_response_id` and `tools` are typed here so
    that the route can refuse them by name (packserve keeps no responses; tools are not served
    on this route yet)."""

    input: NonEmpty | Annotated[list[InputMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    instructions: Text | None = None
    max_output_tokens: int | None = Field(default=None, ge=1, le=MAX_TOKENS_CAP)
    temperature: float = Field(default=0.7, ge=0.0, le=2.0)
    top_p: float = Field(default=0.95, gt=0.0, le=1.0)
    stream: bool = False
    text: TextConfig | None = None
    previous_response_id: Text | None = None
    tools: Annotated[list[dict[str, object]], Field(max_length=128)] | None = None

    @property
    def messages(self) -> list[tuple[str, str]]:
        """(role, text) of each message: the instructions first, as a system message."""
        turns = [] if self.instructions is None else [("system", self.instructions)]
        if isinstance(self.input, str):
            return [*turns, ("user", self.input)]
        return [*turns, *((m.role, m.text) for m in self.input)]
