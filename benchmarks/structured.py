"""python -m benchmarks.structured: what constrained decoding (response_format) costs per token.

  python -m benchmarks.structured [--model PATH] [--tokens 96] [--rounds 3] [--write]

Three measurements, side by side in one run:
  - serving: `python -m jaxvt.serve` (no prefix reuse) answers the same chat prompt with and
    without a JSON schema, greedy, the arms interleaved round by round; the unconstrained arm
    makes as many tokens as the constrained one made (end-of-generation biased away), so the
    two rates count the same tokens. Then 4 concurrent streams, all free against one of them
    constrained (a constrained row makes every program of its batch one step long).
  - the matcher: llguidance's schema compile and per-token mask on the model's vocabulary and
    on a 248,320-token one (the vocabulary extended with pairs of its own tokens), against
    outlines-core where it is installed.
  - the mask's way to the device: a packed int32 [b, vocab/32] bitmask moved and expanded there
    (jaxvt.sampling.apply_mask) against a float32 [b, vocab] bias moved and added.
`--write` writes the `structured` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import concurrent.futures
import json
import random
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import report
from benchmarks.cli import child_env, parser_of, run
from benchmarks.serve import Server
from jaxvt.gguf.default_model import default_model_path
from jaxvt.gguf.tokenizer import Tokenizer
from jaxvt.sampling import apply_mask, mask_words

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "year": {"type": "integer", "minimum": 1800, "maximum": 2100},
    "genres": {"type": "array", "items": {"enum": ["drama", "comedy", "action", "horror"]},
               "maxItems": 3},
    "cast": {"type": "array", "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30}, "role": {"type": "string", "maxLength": 30}},
                                       "required": ["name", "role"], "additionalProperties": False},
             "minItems": 3, "maxItems": 6}},
          "required": ["title", "year", "genres", "cast"], "additionalProperties": False}
DOC = {"title": "The Long Voyage", "year": 1962, "genres": ["drama", "action"],
       "cast": [{"name": "Ada Lovelace", "role": "captain"},
                {"name": "Alan Turing", "role": "navigator"},
                {"name": "Grace Hopper", "role": "engineer"}]}
PROMPT = "Describe a classic film as JSON: title, year, genres and its main cast."
BIG_VOCAB = 248320


def parser():
  ap = parser_of("structured", __doc__)
  ap.add_argument("--model", default=None, help="GGUF file (default: the embedded default model)")
  ap.add_argument("--tokens", type=int, default=96, help="max tokens of an answer")
  ap.add_argument("--rounds", type=int, default=3)
  ap.add_argument("--write", action="store_true")
  return ap


def _chat(s: Server, constrained: bool, max_tokens: int, bias: dict | None = None):
  import httpx
  body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens,
          "temperature": 0}
  if constrained:
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "film",
                                                                      "schema": SCHEMA}}
  if bias:
    body["logit_bias"] = bias
  t = time.perf_counter()
  r = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=900)
  r.raise_for_status()
  return r.json()["usage"]["completion_tokens"], time.perf_counter() - t


def serving(model: str | None, tokens: int, rounds: int, log: str) -> list[str]:
  args = [sys.executable, "-m", "jaxvt.serve", "--port={port}", "--max_context=1024",
          "--max-batch=4", "--prefix-cache-gb=0"] + ([f"--model={model}"] if model else [])
  s = Server(args, child_env(), log)
  try:
    eos = {str(i): -100 for i in Tokenizer.from_gguf(model or default_model_path()).stop_ids}
    n, _ = _chat(s, True, tokens)  # warm-up (and the constrained answer's length)
    _chat(s, False, n, eos)
    one = {"free": [], "schema": []}
    for _ in range(rounds):
      one["schema"].append(_chat(s, True, tokens))
      one["free"].append(_chat(s, False, n, eos))
    rate = {k: sum(a for a, _ in v) / sum(b for _, b in v) for k, v in one.items()}
    arms = {"free": [False] * 4, "one constrained": [True, False, False, False]}
    made, took = dict.fromkeys(arms, 0), dict.fromkeys(arms, 0.0)
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
      for r in range(rounds + 1):  # round 0 warms up; the arms alternate round by round
        for arm, jobs in arms.items():
          t = time.perf_counter()
          done = list(ex.map(lambda c: _chat(s, c, n, None if c else eos), jobs))
          if r:
            made[arm] += sum(a for a, _ in done)
            took[arm] += time.perf_counter() - t
    four = {arm: made[arm] / took[arm] for arm in arms}
  finally:
    s.stop()
  return [
      f"| 1 stream, free | {rate['free']:.1f} | |",
      f"| 1 stream, JSON schema | {rate['schema']:.1f} | {rate['schema'] / rate['free']:.2f} |",
      f"| 4 streams, all free | {four['free']:.1f} | |",
      f"| 4 streams, one with a JSON schema | {four['one constrained']:.1f} | "
      f"{four['one constrained'] / four['free']:.2f} |",
      "", f"Answers of {n} tokens (the constrained answer's length), {rounds} rounds."]


class _Wrapped:
  """llguidance's tokenizer interface over a list of token byte strings."""

  def __init__(self, tok: Tokenizer, tokens: list[bytes]):
    self.tokens, self._tok = tokens, tok
    self.eos_token_id, self.bos_token_id = tok.stop_ids[0], None
    self.special_token_ids = [i for i, t in enumerate(tokens) if t.startswith(b"\xff")]

  def __call__(self, text: bytes) -> list[int]:
    return self._tok.encode(text.decode("utf-8", "replace"), add_bos=False, parse_special=False)


def _vocab(tok: Tokenizer, n: int) -> list[bytes]:
  """`tok`'s tokens as bytes (specials marked 0xff), extended to `n` with pairs of its tokens."""
  out = [b"\xff" + t.encode() if tok.is_eog(i) or t.startswith("<|") else tok.token_bytes(i)
         for i, t in enumerate(tok.tokens)]
  normal = [t for t in out if t and not t.startswith(b"\xff")]
  rnd, seen = random.Random(0), set(out)
  while len(out) < n:
    t = rnd.choice(normal) + rnd.choice(normal)
    if t not in seen:
      seen.add(t)
      out.append(t)
  return out


def matchers(tok: Tokenizer) -> list[str]:
  import llguidance
  ids = tok.encode(json.dumps(DOC), add_bos=False, parse_special=False)
  rows = []
  for n in (tok.vocab_size, BIG_VOCAB):
    toks = _vocab(tok, n)
    t = time.perf_counter()
    ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Wrapped(tok, toks)))
    setup = time.perf_counter() - t
    t = time.perf_counter()
    m = llguidance.LLMatcher(ll, llguidance.LLMatcher.grammar_from_json_schema(SCHEMA))
    assert m.validate_tokens(ids) == len(ids), "the sample document must fit the schema"
    comp = time.perf_counter() - t
    masks = []
    for i in ids:
      t = time.perf_counter()
      m.compute_bitmask()
      masks.append(time.perf_counter() - t)
      m.consume_token(i)
    rows.append(f"| llguidance | {n:,} | {setup * 1e3:.0f} | {comp * 1e3:.1f} | "
                f"{np.median(masks) * 1e6:.0f} | {max(masks) * 1e6:.0f} |")
    try:
      import outlines_core as oc
    except ImportError:
      continue
    t = time.perf_counter()
    d: dict[bytes, list[int]] = {}
    for i, b in enumerate(toks):
      if not b.startswith(b"\xff"):
        d.setdefault(b, []).append(i)
    voc = oc.Vocabulary(tok.stop_ids[0], d)
    setup = time.perf_counter() - t
    t = time.perf_counter()
    g = oc.Guide(oc.Index(oc.json_schema.build_regex_from_schema(json.dumps(SCHEMA)), voc))
    comp = time.perf_counter() - t
    buf, masks = np.zeros(mask_words(n), np.int32), []
    for i in ids:
      t = time.perf_counter()
      g.write_mask_into(buf.ctypes.data, buf.size, 4)
      masks.append(time.perf_counter() - t)
      g.advance(i)
    rows.append(f"| outlines-core | {n:,} | {setup * 1e3:.0f} | {comp * 1e3:.1f} | "
                f"{np.median(masks) * 1e6:.0f} | {max(masks) * 1e6:.0f} |")
  return rows


def transfer(batch: int = 8, reps: int = 50) -> list[str]:
  """Moving a step's masks to the device and applying them: packed bits against a float bias."""
  rows = []
  for vocab in (49152, BIG_VOCAB):
    rng = np.random.default_rng(0)
    logits = jnp.asarray(rng.standard_normal((batch, vocab), np.float32))
    packed = rng.integers(-2**31, 2**31, (batch, mask_words(vocab)), dtype=np.int64).astype(
        np.int32)
    bias = np.where(rng.random((batch, vocab)) < 0.5, 0, -np.inf).astype(np.float32)
    by_bits = jax.jit(lambda x, m: jnp.argmax(apply_mask(x, m), -1))
    by_bias = jax.jit(lambda x, b: jnp.argmax(x + b, -1))
    times = {}
    for name, fn, arg in (("bits", by_bits, packed), ("bias", by_bias, bias)):
      fn(logits, jax.device_put(arg)).block_until_ready()
      t = time.perf_counter()
      for _ in range(reps):
        fn(logits, jax.device_put(arg)).block_until_ready()
      times[name] = (time.perf_counter() - t) / reps
    rows.append(f"| {vocab:,} | {batch} | {packed.nbytes:,} | {times['bits'] * 1e6:.0f} | "
                f"{bias.nbytes:,} | {times['bias'] * 1e6:.0f} |")
  return rows


def main(args) -> str:
  tok = Tokenizer.from_gguf(args.model or default_model_path())
  argv = " ".join(a for a in sys.argv[1:] if a != "--write")
  lines = ["## Constrained decoding (structured output)", "",
           f"Command: `python -m benchmarks.structured {argv}`  ",
           f"Machine: {report.machine()}  ", f"Date: {report.stamp()}", "",
           "Ratios are of arms run side by side in this one run.", "",
           "Serving the default model over HTTP, greedy (tokens/s; ratio against free):", "",
           "| arm | tok/s | ratio |", "|---|---|---|"]
  lines += serving(args.model, args.tokens, args.rounds, "/tmp/jaxvt-bench-structured.log")
  lines += ["", "The matcher (llguidance; outlines-core for comparison), one film schema, per "
            "token of a sample answer:", "",
            "| library | vocabulary | tokenizer setup ms | schema compile ms | mask median us "
            "| mask max us |", "|---|---|---|---|---|---|"]
  lines += matchers(tok)
  lines += ["", f"A step's masks to the device ({jax.default_backend()}), moved and applied to "
            "the logits, 8 rows:", "",
            "| vocabulary | rows | packed bytes | packed us | float bias bytes | float bias us |",
            "|---|---|---|---|---|---|"]
  lines += transfer()
  return report.publish("structured", lines, args.write)


def cli(argv: list[str] | None = None) -> int:
  return run(main, parser(), argv)


if __name__ == "__main__":
  sys.exit(cli())
