"""Structured output by constrained decoding: a request's `response_format` (JSON mode, a JSON
schema) or a tool call it must make compiles, with llguidance, into a matcher over the model's
own vocabulary. Before each token the matcher gives the tokens that keep the output a prefix of
something the grammar accepts, as a packed bitmask (int32 [ceil(vocab / 32)], bit t % 32 of word
t // 32 set where token t is allowed); the engine moves the masks of a batch's rows to the device
and expands them there (jaxvt.sampling.apply_mask, before sampling: a disallowed token's logit
becomes -inf).
The end-of-generation tokens are allowed only where the grammar accepts; once the grammar can
take nothing more, the request ends ("stop").

Why llguidance (docs/SERVE.md has the measured comparison): no runtime dependency (no torch),
takes any vocabulary as a list of byte strings, compiles a schema lazily in about a millisecond
whatever the vocabulary's size, and covers JSON schema and Lark grammars.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import llguidance
import numpy as np

from jaxvt.gguf.tokenizer import CONTROL, UNKNOWN
from jaxvt.sampling import mask_words

# JSON written as json.dumps writes it (", " and ": ", no other whitespace): a model cannot pad
# an answer with whitespace until max_tokens, and the text reads as the usual compact JSON.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
MAX_SCHEMA_CHARS = 1 << 16


class ConstraintError(ValueError):
  """A grammar or schema the request gave that cannot be compiled (a 400)."""


class _Vocab:
  """llguidance's view of a jaxvt Tokenizer: every token's bytes (control tokens marked with
  the 0xff prefix llguidance reserves for special tokens, so no text matches them), the
  end-of-generation ids, and the tokenizer itself for the text llguidance needs tokenized."""

  def __init__(self, tok):
    self._tok = tok
    self.tokens = [b"\xff" + tok.tokens[i].encode() if tok.token_types[i] in (CONTROL, UNKNOWN)
                   else tok.token_bytes(i, True) for i in range(tok.vocab_size)]
    self.eos_token_id = tok.stop_ids[0]
    self.bos_token_id = tok.bos_id
    self.special_token_ids = [i for i, t in enumerate(tok.token_types) if t in (CONTROL, UNKNOWN)]

  def __call__(self, text: bytes) -> list[int]:
    return self._tok.encode(text.decode("utf-8", "replace"), add_bos=False, parse_special=False)


_lock = threading.Lock()
_vocabs: dict[int, tuple[Any, llguidance.LLTokenizer]] = {}


def vocabulary(tok) -> llguidance.LLTokenizer:
  """llguidance's tokenizer for `tok`, built once (a fraction of a second for 49k tokens, a few
  seconds for 248k) and kept while `tok` lives."""
  with _lock:
    held = _vocabs.get(id(tok))
    if held is None or held[0] is not tok:
      ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab(tok)),
                                  n_vocab=tok.vocab_size, eos_token=list(tok.stop_ids))
      held = _vocabs[id(tok)] = (tok, ll)
    return held[1]


def json_grammar(schema: dict | None) -> str:
  """The grammar of JSON text valid under `schema` (None: any JSON object, OpenAI's JSON
  mode)."""
  if schema is None:
    schema = {"type": "object"}
  if not isinstance(schema, dict):
    raise ConstraintError("json_schema.schema must be a JSON object")
  text = json.dumps(schema)
  if len(text) > MAX_SCHEMA_CHARS:
    raise ConstraintError(f"the schema has {len(text)} characters, more than {MAX_SCHEMA_CHARS}")
  return llguidance.LLMatcher.grammar_from_json_schema(text, defaults=JSON_OPTIONS)


def lark_grammar(lark: str) -> str:
  return llguidance.LLMatcher.grammar_from_lark(lark)


def response_format_grammar(response_format: dict | None) -> str | None:
  """The grammar of OpenAI's `response_format`: {"type": "text"} (None: no constraint),
  {"type": "json_object"} or {"type": "json_schema", "json_schema": {"name", "schema",
  "strict"}}. ConstraintError for anything else."""
  if response_format is None:
    return None
  kind = response_format.get("type")
  if kind == "text":
    return None
  if kind == "json_object":
    return json_grammar(None)
  if kind == "json_schema":
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
      raise ConstraintError("response_format.json_schema must be an object with a name")
    return json_grammar(spec.get("schema", {}))
  raise ConstraintError(f"response_format.type {kind!r} must be text, json_object or "
                        "json_schema")


class Constraint:
  """One request's matcher: `mask()` before each token, `advance(token)` after it."""

  def __init__(self, tok, grammar: str):
    ll = vocabulary(tok)
    bad = llguidance.LLMatcher.validate_grammar(grammar, ll)
    if bad:
      raise ConstraintError(f"the schema cannot be used: {bad.splitlines()[0][:300]}")
    self.matcher = llguidance.LLMatcher(ll, grammar, log_level=0)
    if self.matcher.is_error():
      raise ConstraintError(f"the schema cannot be used: {self.matcher.get_error()[:300]}")
    self.vocab = tok.vocab_size

  def mask(self) -> np.ndarray:
    """int32 [ceil(vocab / 32)]: the allowed tokens' bits (end-of-generation ones only where
    the output is complete)."""
    return np.frombuffer(self.matcher.compute_bitmask(), np.int32)[:mask_words(self.vocab)]

  def advance(self, token: int) -> bool:
    """Consumes the sampled `token`; False where the matcher refuses it (only a token the mask
    did not allow can be refused: non-finite logits, say)."""
    return self.matcher.consume_token(int(token))

  @property
  def finished(self) -> bool:
    """The grammar can take no more tokens: the answer is complete."""
    return self.matcher.is_stopped()
