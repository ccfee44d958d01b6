"""Request bodies of the OpenAI-compatible endpoints, with specdec's extension field.

Every float refuses NaN and infinity; every text is checked for lone surrogates (JSON may
carry "\\ud800", which no tokenizer can encode). Parameters that OpenAI defines but the
server does not implement are accepted only at their neutral values, so a client never gets
silently different behaviour.

Every model validates strictly: a boolean or a string is never a number (`max_tokens: true`,
`"draft_tokens": "4"`), a number is never a boolean (`stream: 1`), and a float field takes
integers (`temperature: 1`) but an integer field takes no floats. Every integer has an upper
bound, so no value is too large to mean what it says.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator
from pydantic_core import PydanticCustomError

SEED_LIMIT = 2**63
COUNT_LIMIT = 2**31 - 1  # the most tokens a request may name (the server's own limit is lower)
TOP_K_LIMIT = 1_000_000  # beyond any vocabulary: a top_k of at least the vocabulary's size keeps every token

# A finite JSON number within OpenAI's range for a logit bias.
_Bias = Annotated[float, Strict(), Field(ge=-100.0, le=100.0, allow_inf_nan=False)]

# OpenAI parameters that are not fields here, with the values that mean "off". Any other
# value is refused (400, naming the parameter) rather than silently ignored.
_NEUTRAL: dict[str, tuple[tuple[Any, ...], str]] = {
    # chat requests take tools (ChatRequest's fields); a completion cannot
    "tools": ((None, []), "tools are not supported on /v1/completions: use /v1/chat/completions"),
    "tool_choice": ((None, "none", "auto"), "tool_choice is not supported on /v1/completions: use "
                                            "/v1/chat/completions"),
    "functions": ((None, []), "functions (function calling) are not supported: leave functions out or send []"),
    "function_call": ((None, "none", "auto"), "function_call is not supported (there are no functions): "
                                              "leave it out or send \"none\""),
    "modalities": ((None, ["text"]), "modalities other than [\"text\"] are not supported"),
    "audio": ((None,), "audio is not supported"),
    "prediction": ((None,), "prediction (predicted outputs) is not supported"),
    "web_search_options": ((None,), "web_search_options is not supported"),
    "reasoning_effort": ((None,), "reasoning_effort is not supported"),
    "verbosity": ((None, "medium"), "verbosity is not supported"),
}


def _json_key(value: Any) -> Any:
    """A value as JSON sees it, for comparing: true is not 1, but 1.0 is 1."""
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return (type(value).__name__, value)
    if isinstance(value, int | float):
        return ("number", value)
    if isinstance(value, list):
        return ("list", [_json_key(v) for v in value])
    if isinstance(value, dict):
        return ("dict", {k: _json_key(v) for k, v in value.items()})
    return ("other", id(value))


def neutral(value: Any, allowed: tuple[Any, ...]) -> bool:
    """Whether `value` is one of `allowed`, comparing as JSON values."""
    try:
        key = _json_key(value)
    except RecursionError:  # nested deeper than any neutral value
        return False
    return any(key == _json_key(a) for a in allowed)


def at_most(value: int | None, limit: int = COUNT_LIMIT) -> int | None:
    if value is not None and value > limit:
        raise PydanticCustomError("less_than_equal", "Input should be less than or equal to {le}", {"le": limit})
    return value


class InvalidText(ValueError):
    pass


def check_text(value: Any) -> Any:
    """Reject any string, at any depth, that UTF-8 cannot encode (a lone surrogate)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as e:
            char = f"U+{ord(value[e.start]):04X}"
            raise InvalidText(f"contains a lone surrogate ({char}), which is not valid text") from None
    elif isinstance(value, list):
        for item in value:
            check_text(item)
    elif isinstance(value, dict):
        for item in value.values():
            check_text(item)
    return value


class SpecdecOptions(BaseModel):
    """Speculation settings of one request, within the limits the operator set."""

    model_config = ConfigDict(extra="forbid", strict=True)
    draft_tokens: int | None = Field(default=None, ge=1, le=COUNT_LIMIT, description="K, tokens drafted per round")
    draft: str | None = Field(default=None, description="'default' (the loaded prophets), 'none' (plain decoding), "
                                                        "or some of the loaded prophets joined by '+'")
    policy: str | None = Field(default=None, description="draft-length policy: auto, fixed, adaptive, confidence "
                                                         "or optimal (default: the server's)")
    rounds: bool = Field(default=True, description="per-round details in each streamed chunk")

    @field_validator("draft", "policy")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return check_text(v)


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


class SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: str | None = None
    # None (or absent): the one default of every entry point (specdec.defaults), as OpenAI allows null
    temperature: float | None = Field(default=None, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0, le=TOP_K_LIMIT)
    seed: int | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = Field(default=None, ge=1, le=128)
    best_of: int | None = Field(default=None, ge=1, le=20)
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0, allow_inf_nan=False)
    logit_bias: dict[str, _Bias] | None = None
    user: str | None = None
    # None (or absent): "rejection". "coupled": every draw keyed by (seed, position), so a seeded
    # answer is seeded plain coupled sampling's whatever the prophet, K or batch (specdec.sampling)
    sampling: Literal["rejection", "coupled"] | None = None
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {"name", "schema", "strict"}}:
    # the answer follows it (specdec.grammar), exact under the constraint
    response_format: dict[str, Any] | None = None
    specdec: SpecdecOptions | None = None

    @field_validator("model", "stop", "user")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return check_text(v)

    def unsupported(self) -> tuple[str, str] | None:
        """(param, message) for the first parameter set to something the server does not do."""
        if self.n not in (None, 1):
            return "n", "n > 1 is not supported: send one request per completion"
        if self.best_of not in (None, 1):
            return "best_of", "best_of > 1 is not supported"
        if not neutral(getattr(self, "logprobs", None), (None, False, 0)):
            return "logprobs", "logprobs are not supported"
        if not neutral(getattr(self, "top_logprobs", None), (None, 0)):
            return "top_logprobs", "top_logprobs are not supported"
        if not neutral(getattr(self, "echo", None), (None, False)):
            return "echo", "echo is not supported"
        if not neutral(getattr(self, "suffix", None), (None, "")):
            return "suffix", "suffix is not supported"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                return name, f"{name} is not supported (it would change the distribution)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stop is not None and (isinstance(self.stop, list) and len(self.stop) > 4):
            return "stop", "at most 4 stop strings"
        extra = self.model_extra or {}
        for name, (allowed, message) in _NEUTRAL.items():
            if name in extra and not neutral(extra[name], allowed):
                return name, message
        return None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=None, ge=1)  # None: specdec.defaults.MAX_NEW_TOKENS
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = Field(default=None, ge=0, le=5)

    @field_validator("prompt", "suffix")
    @classmethod
    def _prompt_text(cls, v: Any) -> Any:
        return check_text(v)

    @field_validator("max_tokens")
    @classmethod
    def _bounded(cls, v: int | None) -> int | None:
        return at_most(v)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None

    @field_validator("content", "name")
    @classmethod
    def _text(cls, v: Any) -> Any:
        return check_text(v)

    def text(self) -> str:
        """The content as one string; only text parts are supported."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        parts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError("only text content parts are supported")
            parts.append(part["text"])
        return "".join(parts)

    def unsupported(self) -> tuple[str, str] | None:
        """(field, message) for a part of the message that the prompt cannot carry."""
        extra = self.model_extra or {}
        if not neutral(extra.get("tool_calls"), (None, [])) and self.role != "assistant":
            return "tool_calls", "only an assistant message carries tool_calls"
        if not neutral(extra.get("function_call"), (None,)):
            return "function_call", "function_call is not supported (there are no functions)"
        return None


class ChatRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    logprobs: bool | None = None
    # functions the answer may call (specdec.tools): {"type": "function", "function": {"name",
    # "description", "parameters"}}; tool_choice "auto" (default), "required", "none" or a named one
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None  # an answer makes at most one call either way

    @field_validator("tools", "tool_choice")
    @classmethod
    def _tools_text(cls, v: Any) -> Any:
        return check_text(v)

    @field_validator("max_tokens", "max_completion_tokens")
    @classmethod
    def _bounded(cls, v: int | None) -> int | None:
        return at_most(v)

    def unsupported(self) -> tuple[str, str] | None:
        for i, message in enumerate(self.messages):
            if (bad := message.unsupported()) is not None:
                return f"messages.{i}.{bad[0]}", bad[1]
        return super().unsupported()
