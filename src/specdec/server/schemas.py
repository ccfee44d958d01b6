"""Request bodies of the OpenAI-compatible endpoints, with specdec's extension field.

Every float refuses NaN and infinity; every text is checked for lone surrogates (JSON may
carry "\\ud800", which no tokenizer can encode). Parameters that OpenAI defines but the
server does not implement are accepted only at their neutral values, so a client never gets
silently different behaviour.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

SEED_LIMIT = 2**63


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

    model_config = ConfigDict(extra="forbid")
    draft_tokens: int | None = Field(default=None, ge=1, description="K, tokens drafted per round")
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
    include_usage: bool = False


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    top_k: int | None = Field(default=None, ge=0)
    seed: int | None = Field(default=None, ge=0, lt=SEED_LIMIT)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int | None = None
    logprobs: Any = None
    best_of: int | None = None
    presence_penalty: float | None = Field(default=None, allow_inf_nan=False)
    frequency_penalty: float | None = Field(default=None, allow_inf_nan=False)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
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
        if self.logprobs not in (None, False, 0):
            return "logprobs", "logprobs are not supported"
        if getattr(self, "top_logprobs", None) not in (None, 0):
            return "top_logprobs", "top_logprobs are not supported"
        if getattr(self, "echo", False):
            return "echo", "echo is not supported"
        if getattr(self, "suffix", None):
            return "suffix", "suffix is not supported"
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0.0):
                return name, f"{name} is not supported (it would change the distribution)"
        if self.logit_bias:
            return "logit_bias", "logit_bias is not supported"
        if self.stop is not None and (isinstance(self.stop, list) and len(self.stop) > 4):
            return "stop", "at most 4 stop strings"
        return None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int]
    max_tokens: int | None = Field(default=16, ge=1)
    echo: bool = False
    suffix: str | None = None

    @field_validator("prompt", "suffix")
    @classmethod
    def _prompt_text(cls, v: Any) -> Any:
        return check_text(v)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
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


class ChatRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    top_logprobs: int | None = None
