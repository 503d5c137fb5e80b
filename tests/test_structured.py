"""Constrained decoding without a server: the packed mask applied on the device against a numpy
reference, and schema-constrained walks over the default model's vocabulary (random logits,
argmax of the masked row, each token fed back) whose text parses and validates with jsonschema;
then the engine loop with a constrained and an unconstrained request in one batch."""

import json

import jax
import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxvt.gguf.default_model import default_model_path
from jaxvt.gguf.tokenizer import Tokenizer
from jaxvt.sampling import apply_mask, mask_words, pack_mask
from jaxvt.serve import structured
from test_serve_fixtures import smol  # noqa: F401  (a fixture)

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 130}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "ok": {"type": "boolean"}},
     "required": ["color", "ok"], "additionalProperties": False},
    {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string",
                                                                          "maxLength": 6},
                                               "minItems": 1, "maxItems": 3}},
     "required": ["tags"], "additionalProperties": False},
    {"type": "object", "properties": {"point": {
        "type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
        "required": ["x", "y"], "additionalProperties": False}},
     "required": ["point"], "additionalProperties": False},
]


@pytest.fixture(scope="module")
def tok():
  return Tokenizer.from_gguf(default_model_path())


def _reference(logits: np.ndarray, allowed: np.ndarray) -> np.ndarray:
  return np.where(allowed, logits, -np.inf)


@pytest.mark.parametrize("vocab", [1, 31, 32, 33, 320, 49152])
def test_apply_mask_matches_numpy(vocab):
  rng = np.random.default_rng(vocab)
  logits = rng.standard_normal((3, vocab)).astype(np.float32)
  allowed = rng.random((3, vocab)) < 0.3
  allowed[2] = True  # an unconstrained row
  packed = pack_mask(allowed)
  assert packed.shape == (3, mask_words(vocab)) and packed.dtype == np.int32
  assert (packed[2, :vocab // 32] == -1).all()
  got = np.asarray(jax.jit(apply_mask)(jnp.asarray(logits), jnp.asarray(packed)))
  np.testing.assert_array_equal(got, _reference(logits, allowed))


def _walk(tok, grammar: str, seed: int, limit: int = 400) -> str:
  """Random logits, the argmax among the allowed tokens, fed back until the grammar ends."""
  c = structured.Constraint(tok, grammar)
  rng = np.random.default_rng(seed)
  ids = []
  for _ in range(limit):
    m = c.mask()
    allowed = np.unpackbits(m.view(np.uint8), bitorder="little")[:tok.vocab_size].astype(bool)
    logits = np.where(allowed, rng.standard_normal(tok.vocab_size), -np.inf)
    t = int(np.argmax(logits))
    assert allowed[t]
    if t in tok.stop_ids:
      break
    ids.append(t)
    c.advance(t)
    if c.finished:
      break
  else:
    raise AssertionError("the walk did not end")
  return tok.decode(ids)


@pytest.mark.parametrize("i", range(len(SCHEMAS)))
def test_random_walks_validate(tok, i):
  grammar = structured.response_format_grammar(
      {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMAS[i]}})
  for seed in range(3):
    text = _walk(tok, grammar, seed)
    jsonschema.validate(json.loads(text), SCHEMAS[i])


def test_json_object_mode(tok):
  """Any object is allowed token by token, and ends there; a list or a bare value never starts."""
  grammar = structured.response_format_grammar({"type": "json_object"})
  c = structured.Constraint(tok, grammar)
  bits = lambda: np.unpackbits(c.mask().view(np.uint8), bitorder="little")
  for bad in ("[", "1", '"'):
    assert not bits()[tok.encode(bad, add_bos=False)[0]]
  for t in tok.encode(json.dumps({"a": [1, 2.5, {"b": None}], "c": "d"}), add_bos=False):
    assert bits()[t], t
    c.advance(t)
  assert all(bits()[e] for e in tok.stop_ids) or c.finished


def test_end_of_generation_only_when_complete(tok):
  c = structured.Constraint(tok, structured.json_grammar(SCHEMAS[1]))
  bits = lambda: np.unpackbits(c.mask().view(np.uint8), bitorder="little")
  assert not any(bits()[e] for e in tok.stop_ids)
  for t in tok.encode('{"color": "red", "ok": true', add_bos=False):
    assert bits()[t], t
    c.advance(t)
  assert not c.finished and not any(bits()[e] for e in tok.stop_ids)
  c.advance(tok.encode("}", add_bos=False)[0])
  assert c.finished


@pytest.mark.parametrize("fmt", [{"type": "json_schema", "json_schema": {"schema": {}}},
                                 {"type": "xml"},
                                 {"type": "json_schema", "json_schema": {"name": "x", "schema": {
                                     "type": "object", "properties": {"a": {"$ref": "#/no"}}}}}])
def test_bad_formats_are_refused(tok, fmt):
  with pytest.raises(structured.ConstraintError):
    structured.Constraint(tok, structured.response_format_grammar(fmt))


def test_loop_batch_constrained_and_free(smol):
  """A constrained request (sampled, two schemas) beside unconstrained greedy ones: each
  constrained answer validates and ends by itself ("stop"); each free one equals its solo run."""
  from jaxvt.serve.loop import EngineLoop
  from jaxvt.serve.scheduler import Request
  tok = smol.tokenizer
  prompt = smol.encode_prompt("Describe a person as JSON.")
  free_prompts = [smol.encode_prompt(p) for p in ("The capital of France is", "def fib(n):")]
  loop = EngineLoop(smol, max_batch=4, max_queue=8)
  try:
    solo = []
    for p in free_prompts:
      r = Request(prompt=p, max_tokens=12, eos_ids=frozenset(tok.stop_ids))
      loop.submit(r).wait(300)
      solo.append(r.tokens)
    reqs = [Request(prompt=prompt, max_tokens=120, eos_ids=frozenset(tok.stop_ids),
                    decoder=tok.stream_decoder(), temperature=0.7, seed=i,
                    constraint=structured.Constraint(tok, structured.json_grammar(s)))
            for i, s in enumerate(SCHEMAS[:2])]
    reqs += [Request(prompt=p, max_tokens=12, eos_ids=frozenset(tok.stop_ids))
             for p in free_prompts]
    events = [loop.submit(r) for r in reqs]
    assert all(ev.wait(300) for ev in events)
  finally:
    assert loop.close()
  for r, s in zip(reqs[:2], SCHEMAS):
    assert r.finish_reason == "stop", (r.finish_reason, r.text)
    jsonschema.validate(json.loads(r.text), s)
  assert [r.tokens for r in reqs[2:]] == solo
