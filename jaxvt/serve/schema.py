"""The request bodies of POST /v1/completions and /v1/chat/completions as pydantic models, in
OpenAI's shapes (the fields OpenAI documents for each endpoint that a local server can honour,
plus llama-server's and vLLM's `top_k`).

A field not declared here is refused ("unknown fields: a, b"); a declared field the server
understands but does not support (`n` > 1, `best_of` > 1, `echo`, `suffix`) is refused with a
message naming it. Numbers are checked by jaxvt.inputs, as the CLI and the Python API check
them, so a request gets the same one-line message a flag would. `parse` turns a JSON body into a
model or a `BodyError` (status and message) that the app answers with OpenAI's error JSON.

These are our own models rather than the `openai` package's request TypedDicts: the server does
not need the client installed, and those types change with every client release (a test checks
that every field the client can send is either declared here or named in NOT_DECLARED).

Accepted and ignored (meaningless for one local model): `user`, `metadata`, `service_tier`,
`store`, `stream_options.include_obfuscation`.
"""

from __future__ import annotations

import json
import math
from typing import Annotated, Any, Literal, Union

from pydantic import (BaseModel, BeforeValidator, ConfigDict, Field, ValidationError,
                      ValidationInfo, field_validator, model_validator)

from jaxvt import inputs
from jaxvt.errors import MESSAGE_LIMIT, JaxvtError, escape

MAX_STOPS = 4
MAX_TOP_LOGPROBS = 20  # chat's top_logprobs (OpenAI's limit)
MAX_COMPLETION_LOGPROBS = 5  # completions' logprobs (OpenAI's limit)
NAME = r"^[a-zA-Z0-9_-]{1,64}$"  # a function's or a JSON schema's name (OpenAI's rule)

# Fields of the openai client's request types that are not declared here (a request holding one
# gets 400 "unknown fields"): audio output, moderation, hosted web search, reasoning controls,
# predicted outputs and the deprecated function-calling fields have no meaning for this server.
NOT_DECLARED = frozenset({
    "audio", "modalities", "moderation", "web_search_options", "reasoning_effort", "verbosity",
    "prediction", "functions", "function_call", "prompt_cache_key", "prompt_cache_options",
    "prompt_cache_retention", "safety_identifier"})


class BodyError(Exception):
  """A request body refused: `status` and a one-line message naming the field (escaped: field
  names and values come from the client)."""

  def __init__(self, status: int, message: str, param: str | None = None):
    super().__init__(escape(message, MESSAGE_LIMIT))
    self.status = status
    self.param = None if param is None else escape(param, 64)  # OpenAI's error.param


class RuleError(ValueError):
  """A rule between fields broken (pydantic gives it no location): `param` is the field named."""

  def __init__(self, param: str, message: str):
    super().__init__(message)
    self.param = param


def _checked(fn):
  """A pydantic before-validator from a jaxvt.inputs check (its JaxvtError as a ValueError)."""
  def check(value):
    try:
      return fn(value)
    except JaxvtError as e:
      raise ValueError(str(e)) from None
  return BeforeValidator(check)


def _number(name, **bounds):
  return _checked(lambda v: inputs.number(name, v, **bounds))


def _whole(name, lo, hi):
  return _checked(lambda v: inputs.whole(name, v, lo, hi))


def _stops(value: Any) -> tuple[str, ...]:
  stop = () if value is None else (value,) if isinstance(value, str) else value
  if not isinstance(stop, (list, tuple)) or len(stop) > MAX_STOPS or not all(
      isinstance(s, str) and s for s in stop):
    raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOPS}")
  return tuple(stop)


class _Model(BaseModel):
  model_config = ConfigDict(extra="forbid", frozen=True)


class StreamOptions(_Model):
  include_usage: bool | None = None
  include_obfuscation: bool | None = None  # accepted; the server sends no obfuscation field


class JsonSchemaFormat(_Model):
  name: Annotated[str, Field(pattern=NAME)]
  description: str | None = None
  # "schema" would shadow BaseModel.schema: the attribute is schema_, the JSON key "schema"
  schema_: dict[str, Any] | None = Field(None, alias="schema")
  strict: bool | None = None


class TextFormat(_Model):
  type: Literal["text"]


class JsonObjectFormat(_Model):
  type: Literal["json_object"]


class JsonSchemaResponseFormat(_Model):
  type: Literal["json_schema"]
  json_schema: JsonSchemaFormat


ResponseFormat = Annotated[Union[TextFormat, JsonObjectFormat, JsonSchemaResponseFormat],
                           Field(discriminator="type")]


class FunctionDef(_Model):
  name: Annotated[str, Field(pattern=NAME)]
  description: str | None = None
  parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
  strict: bool | None = None


class Tool(_Model):
  type: Literal["function"]
  function: FunctionDef


class FunctionName(_Model):
  name: str


class NamedToolChoice(_Model):
  type: Literal["function"]
  function: FunctionName


ToolChoice = Union[Literal["none", "auto", "required"], NamedToolChoice]


class TextPart(BaseModel):
  model_config = ConfigDict(extra="allow", frozen=True)
  type: Literal["text"]
  text: str


def _content(value: Any) -> Any:
  """A message's content: a string, OpenAI's list of {"type": "text", "text": ...} parts, or
  None (an assistant message that holds tool calls only)."""
  if value is None or isinstance(value, str) or (isinstance(value, list) and all(
      isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
      for p in value)):
    return value
  raise ValueError("a message's content must be a string or a list of text parts")


class Message(BaseModel):
  """One chat message. Keys besides role and content (name, tool_calls, tool_call_id, ...) are
  kept and handed to the file's chat template as they came."""
  model_config = ConfigDict(extra="allow", frozen=True)
  role: str
  content: Annotated[str | list[TextPart] | None, BeforeValidator(_content)] = None

  @model_validator(mode="after")
  def _has_content(self):
    if self.content is None and not (self.role == "assistant" and
                                     getattr(self, "tool_calls", None)):
      raise ValueError("a message's content must be a string or a list of text parts")
    return self

  def for_template(self) -> dict:
    """The message as the chat template gets it: content as one string (text parts joined)."""
    out = self.model_dump()
    if isinstance(self.content, list):
      out["content"] = "".join(p.text for p in self.content)
    return out


def _messages(value: Any) -> Any:
  if not isinstance(value, list) or not value or not all(
      isinstance(m, dict) and isinstance(m.get("role"), str) for m in value):
    raise ValueError("messages must be a non-empty list of {role, content} objects")
  return value


class _Common(_Model):
  """The fields both endpoints take."""
  model: str | None = None  # any name: the loaded model answers, and the response names it
  max_tokens: Annotated[int | None, _checked(lambda v: v if v is None else inputs.max_tokens(v))
                        ] = None
  temperature: Annotated[float, _number("temperature", lo=0.0, hi=inputs.MAX_TEMPERATURE)] = 1.0
  top_p: Annotated[float, _number("top_p", lo=0.0, hi=1.0, lo_open=True)] = 1.0
  top_k: Annotated[int, _whole("top_k", 0, inputs.INT32_MAX)] = 0  # llama-server's, vLLM's
  seed: Annotated[int | None, _checked(lambda v: v if v is None else inputs.seed(v))] = None
  stop: Annotated[tuple[str, ...], BeforeValidator(_stops)] = ()
  n: Annotated[int, _whole("n", 1, 128)] = 1
  stream: bool = False
  stream_options: StreamOptions | None = None
  frequency_penalty: Annotated[float, _number("frequency_penalty", lo=-2.0, hi=2.0)] = 0.0
  presence_penalty: Annotated[float, _number("presence_penalty", lo=-2.0, hi=2.0)] = 0.0
  logit_bias: dict[int, float] = Field(default_factory=dict)  # token id -> bias in [-100, 100]
  user: str | None = None
  metadata: dict[str, Annotated[str, Field(max_length=512)]] | None = None
  service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
  store: bool | None = None

  @field_validator("temperature", mode="after")
  @classmethod
  def _temperature(cls, t: float) -> float:
    if 0.0 < t < inputs.MIN_TEMPERATURE:
      raise ValueError(f"temperature must be 0 (greedy) or at least {inputs.MIN_TEMPERATURE:g} "
                       f"(got {t:g})")
    return t

  @field_validator("n", mode="after")
  @classmethod
  def _one(cls, n: int) -> int:
    if n != 1:
      raise ValueError("n: only n=1 is supported")
    return n

  @field_validator("logit_bias", mode="before")
  @classmethod
  def _bias(cls, value: Any, info: ValidationInfo) -> dict[int, float]:
    """OpenAI's logit_bias: {"token id": bias in [-100, 100]}, ids below the vocabulary."""
    if value is None:
      return {}
    if not isinstance(value, dict):
      raise ValueError("logit_bias must be an object of token id -> bias")
    vocab = (info.context or {}).get("vocab", inputs.INT32_MAX)
    out = {}
    for k, v in value.items():
      if not (isinstance(k, str) and k.isdigit() and int(k) < vocab) or isinstance(
          v, bool) or not isinstance(v, (int, float)) or not -100 <= v <= 100:
        raise ValueError(f"logit_bias: {k!r}: {v!r} must map a token id below {vocab} to a "
                         "number in [-100, 100]")
      out[int(k)] = float(v)
    return out

  @field_validator("metadata", mode="after")
  @classmethod
  def _metadata(cls, md):
    if md is not None and (len(md) > 16 or any(len(k) > 64 for k in md)):
      raise ValueError("metadata holds at most 16 pairs, keys of at most 64 characters")
    return md

  @model_validator(mode="before")
  @classmethod
  def _max_completion_tokens(cls, data: Any) -> Any:
    """A declared field given as null takes its default, as OpenAI's do. max_completion_tokens
    is the newer name of max_tokens: either, or both if equal."""
    if isinstance(data, dict):
      data = {k: v for k, v in data.items()
              if v is not None or (k not in cls.model_fields and k != "max_completion_tokens")}
    if isinstance(data, dict) and data.get("max_completion_tokens") is not None:
      data = dict(data)
      mct = data.pop("max_completion_tokens")
      if data.get("max_tokens") is not None and data["max_tokens"] != mct:
        raise RuleError("max_completion_tokens", f"max_completion_tokens {mct!r} and max_tokens "
                        f"{data['max_tokens']!r} differ: give one of them")
      data["max_tokens"] = mct
    return data

  @property
  def include_usage(self) -> bool:
    return bool(self.stream_options and self.stream_options.include_usage)


def _prompt(value: Any, info: ValidationInfo) -> str | list[int]:
  if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool)
                                               for t in value):
    try:
      return inputs.token_ids(value, (info.context or {}).get("vocab", inputs.INT32_MAX),
                              "prompt")
    except JaxvtError as e:
      raise ValueError(str(e)) from None
  if isinstance(value, str) and value:
    return value
  raise ValueError("prompt must be a non-empty string or list of token ids")


class CompletionRequest(_Common):
  """POST /v1/completions."""
  prompt: str | list[int]
  logprobs: Annotated[int | None, _checked(
      lambda v: v if v is None else inputs.whole("logprobs", v, 0, MAX_COMPLETION_LOGPROBS))
                      ] = None
  echo: bool = False
  best_of: Annotated[int | None, _whole("best_of", 1, 128)] = None
  suffix: str | None = None

  _check_prompt = field_validator("prompt", mode="before")(_prompt)

  @model_validator(mode="after")
  def _supported(self):
    if self.echo:
      raise RuleError("echo", "echo: echoing the prompt is not supported")
    if self.best_of not in (None, 1):
      raise RuleError("best_of", "best_of: only best_of=1 is supported")
    if self.suffix:
      raise RuleError("suffix", "suffix: insertion (a suffix) is not supported")
    return self

  @property
  def alternatives(self) -> int | None:
    """Top alternatives to report per token; None: no logprobs at all."""
    return self.logprobs


class ChatRequest(_Common):
  """POST /v1/chat/completions."""
  messages: Annotated[list[Message], BeforeValidator(_messages)]
  logprobs: bool = False
  top_logprobs: Annotated[int | None, _checked(
      lambda v: v if v is None else inputs.whole("top_logprobs", v, 0, MAX_TOP_LOGPROBS))
                          ] = None
  response_format: ResponseFormat | None = None
  tools: Annotated[list[Tool], Field(min_length=1)] | None = None
  tool_choice: ToolChoice | None = None
  parallel_tool_calls: bool = True

  @model_validator(mode="after")
  def _consistent(self):
    if self.top_logprobs is not None and not self.logprobs:
      raise RuleError("top_logprobs", "top_logprobs needs logprobs: true")
    if self.tool_choice is not None and not self.tools and self.tool_choice != "none":
      raise RuleError("tool_choice", "tool_choice needs tools")
    if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {
        t.function.name for t in self.tools}:
      raise RuleError("tool_choice", f"tool_choice names {self.tool_choice.function.name!r}, "
                      "not one of the tools")
    return self

  @property
  def alternatives(self) -> int | None:
    """Top alternatives to report per token; None: no logprobs at all."""
    return (self.top_logprobs or 0) if self.logprobs else None

  def template_messages(self) -> list[dict]:
    return [m.for_template() for m in self.messages]


def _finite_float(text: str) -> float:
  x = float(text)
  if not math.isfinite(x):
    raise BodyError(400, "numbers must be finite")
  return x


def _no_constant(name: str):
  raise BodyError(400, f"numbers must be finite (got {name})")


def _message(e: ValidationError) -> tuple[str, str | None]:
  """One line naming the field (every unknown top-level field, else the first error's), and
  the top-level field it names (OpenAI's error.param)."""
  unknown = sorted(str(err["loc"][0]) for err in e.errors()
                   if err["type"] == "extra_forbidden" and len(err["loc"]) == 1)
  if unknown:
    return f"unknown fields: {', '.join(unknown)}", unknown[0]
  err = e.errors()[0]
  loc = ".".join(str(p) for p in err["loc"])
  param = str(err["loc"][0]) if err["loc"] else None
  if err["type"] == "value_error":  # our checks: their message names the field already
    msg = str(err["ctx"]["error"])
    param = getattr(err["ctx"]["error"], "param", param)
    return (msg if not loc or msg.startswith(loc.split(".")[0]) else f"{loc}: {msg}"), param
  return (f"{loc}: {err['msg']}" if loc else err["msg"]), param


def parse(raw: bytes, model: type[_Common], vocab: int | None = None):
  """A request body (JSON bytes) as `model`, or BodyError(400, one line naming the field)."""
  try:
    data = json.loads(raw, parse_float=_finite_float, parse_constant=_no_constant)
  except ValueError as e:
    raise BodyError(400, f"malformed JSON: {e}") from None
  if not isinstance(data, dict):
    raise BodyError(400, "the body must be a JSON object")
  try:
    return model.model_validate(data, context={"vocab": vocab} if vocab else None)
  except ValidationError as e:
    raise BodyError(400, *_message(e)) from None
