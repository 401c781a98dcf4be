"""What the server's API speaks: its request bodies (each field OpenAI's name, type and range;
unknown fields refused), its limits, and its errors in OpenAI's shape, {"error": {"message",
"type", "param", "code"}}, so that clients written for OpenAI's API report them as they
would report OpenAI's own."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, field_validator

from tformer.decoding.sampling import ExtraSampling
from tformer.serving.sequence import SEED_LIMIT

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20
    max_prompt_tokens: int = 4096
    """For models without a fixed window; a KV-cache model's context is its own limit."""
    max_tokens: int = 2048
    max_lines: int = 256
    """Lines in one translation request."""
    retry_after_s: int = 1


class ApiError(Exception):
    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type = status, message, type
        self.param, self.code, self.headers = param, code, headers

    def response(self) -> JSONResponse:
        body = {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}
        return JSONResponse(body, status_code=self.status, headers=self.headers)


# --- request bodies ---------------------------------------------------------------------


def holds_lone_surrogate(value: Any) -> bool:
    """Whether a JSON value holds a string with a lone surrogate ("\\ud800" is valid JSON but
    no text: UTF-8 cannot encode it, and neither can a tokenizer)."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return True
        return False
    if isinstance(value, (list, tuple)):
        return any(holds_lone_surrogate(v) for v in value)
    if isinstance(value, dict):
        return any(holds_lone_surrogate(k) or holds_lone_surrogate(v) for k, v in value.items())
    return False


class Strict(BaseModel):
    """Every request body: unknown fields refused, and text that is not text (a lone
    surrogate) a 400 naming the field, on every route."""

    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _no_lone_surrogates(cls, value: Any) -> Any:
        if holds_lone_surrogate(value):
            raise ValueError("holds a lone surrogate (such as \\ud800), which is not text; "
                             "send UTF-8 text")
        return value


class StreamOptions(Strict):
    include_usage: bool = False


Prompt = str | list[str] | list[int] | list[list[int]]
"""One text, several, one list of token ids, or several."""


class SamplingFields(Strict):
    """What completions and chat completions share: how to draw, how many, where to stop.

    frequency_penalty and presence_penalty are OpenAI's: a token's logit is lowered by
    frequency_penalty for each time it was drawn before in this completion, and by
    presence_penalty once if it was; logit_bias adds to the logits of the token ids given.
    `user` is accepted and ignored.

    Beyond OpenAI's, as vLLM and llama.cpp's server take them (decoding/sampling.py's
    ExtraSampling): min_p, repetition_penalty (over the prompt and the text, CTRL's
    multiplicative rule), min_tokens (no end of text before them; at most max_tokens),
    ignore_eos (only max_tokens, a stop string or a constraint ends the text)."""

    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    n: int = Field(1, ge=1, le=16)
    stop: str | list[str] | None = None
    seed: int | None = None
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0, le=100.0)
    min_tokens: int = Field(0, ge=0)
    ignore_eos: bool = False
    priority: int = 0
    """vLLM's: where the server has no room for every request, lower values go first."""

    @field_validator("seed")
    @classmethod
    def _seed(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value < SEED_LIMIT:
            raise ValueError(f"must be between 0 and {SEED_LIMIT - 1}")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value: str | list[str] | None) -> str | list[str] | None:
        stops = [value] if isinstance(value, str) else value or []
        if len(stops) > 4 or any(not s for s in stops):
            raise ValueError("stop holds up to 4 non-empty strings")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (value or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys are token ids; {key!r} is not one")
            if not -100 <= bias <= 100:
                raise ValueError(f"token {key}: a bias is between -100 and 100, not {bias}")
        if value is not None and len(value) > 1024:
            raise ValueError("at most 1024 tokens may be biased")
        return value

    def extra_sampling(self) -> ExtraSampling:
        """The fields beyond OpenAI's, as one settings object for the engine."""
        return ExtraSampling(min_p=self.min_p, repetition_penalty=self.repetition_penalty,
                             min_tokens=self.min_tokens, ignore_eos=self.ignore_eos)

    def bias_for(self, vocab_size: int) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs, each id in the vocabulary."""
        pairs = tuple((int(k), v) for k, v in (self.logit_bias or {}).items())
        bad = next((t for t, _ in pairs if t >= vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"logit_bias: token id {bad} is outside the vocabulary (0 to "
                           f"{vocab_size - 1})", param="logit_bias")
        return pairs


class StructuredOutputs(Strict):
    """vLLM's `structured_outputs` request field (its `guided_*` fields of old)."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool | None = None
    """Accepted: JSON here is always written without white space between tokens."""


class CompletionRequest(SamplingFields):
    """OpenAI's completions request. Accepted for its clients with no effect: `user`, and
    `best_of` when it equals n (one draw per choice is all this server makes)."""

    model: str | None = None
    prompt: Prompt
    max_tokens: int = Field(16, ge=0)
    """0 with echo and logprobs: score the prompt only."""
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    best_of: int | None = Field(None, ge=1)
    suffix: None = None
    """OpenAI's insertion; only null (what clients send by default) is taken."""
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    """What the text follows (serving/structured.py)."""

    @field_validator("prompt")
    @classmethod
    def _some_prompt(cls, value: Prompt) -> Prompt:
        if isinstance(value, list):
            if not value:
                raise ValueError("an empty list holds no prompt")
            if isinstance(value[0], list | str) and len(value) > 64:
                raise ValueError("a list of prompts holds 1 to 64 of them")
            if isinstance(value[0], list) and not all(value):
                raise ValueError("a list of token ids may not be empty")
        return value


class ChatMessage(Strict):
    """A message as OpenAI's clients send it; serving/tools.py reads its content parts,
    checks its role and renders its tool calls."""

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    """An assistant's calls, sent back on the next turn."""
    tool_call_id: str | None = None
    """A tool message's: the call it answers."""
    refusal: str | None = None
    """An assistant's refusal, as clients send a reply back; not rendered."""


class ChatRequest(SamplingFields):
    """OpenAI's chat completions request.

    Accepted for OpenAI's clients with no effect: `user`, `store`, `metadata`,
    `service_tier`. `tools`, `tool_choice` and `parallel_tool_calls` as serving/tools.py
    reads them; `response_format` and vLLM's `structured_outputs` as
    serving/structured.py does."""

    model: str | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """Either; None: as many as the model's window leaves."""
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None

    def budget(self) -> int | None:
        if (self.max_tokens is not None and self.max_completion_tokens is not None
                and self.max_tokens != self.max_completion_tokens):
            raise ApiError(400, f"max_tokens {self.max_tokens} and max_completion_tokens "
                           f"{self.max_completion_tokens} differ; give one",
                           param="max_completion_tokens")
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(Strict):
    model: str | None = None
    prompt: str
    add_special_tokens: bool = True
    """As vLLM's: bos before the text, where the model reads texts after bos."""


class DetokenizeRequest(Strict):
    model: str | None = None
    tokens: list[int]


class TranslationRequest(Strict):
    model: str | None = None
    input: list[str]
    beam: int = Field(4, ge=1, le=16)
    alpha: float = Field(0.6, ge=0.0, le=10.0)
    max_len_a: float = Field(1.5, ge=0.0, le=10.0)
    max_len_b: int = Field(10, ge=0, le=1024)
    n_best: int = Field(1, ge=1)
    scores: bool = False


