"""python -m benchmarks.routing: the statistics of a MoE model's expert choices in a real decode.

  python -m benchmarks.routing --model M [--model M2 ...] [--tokens 1024] [--temperature 1]
      [--seed 0] [--write]

Loads M as jaxvt.load does, prefills a short prompt and decodes `--tokens` tokens, sampling at
`--temperature`, through the product's own decode program (jaxvt.model_fns.decode_loop_fn) with
one change to its Exec: the backend's `route` also hands each layer's chosen experts to the host
(an ordered jax.debug.callback), so the trace is the one the decode computed. It prints, per MoE
layer, the statistics of jaxvt.synth_routing (defined in its docstring):

- reuse@1: the fraction of a token's experts that the token before it chose (next-token reuse;
  uniform memoryless routing gives k/E);
- reuse@8: the fraction of a token's experts that one of the 8 tokens before it chose;
- top10%: the share of the layer's selections taken by its ceil(E/10) most chosen experts;
- next: next-layer predictability: the fraction of layer l+1's experts that a co-occurrence
  predictor fitted on the first half of the decode names from layer l's, over the second half;

and the hit rate of a per-layer LRU cache (jaxvt.synth_routing.lru_hits) at the capacities of
the real traces' curve (REAL_LRU_CURVE, shares of a layer's experts), mean over layers, beside
the real hit rates. A decode of 1024 tokens or more lets a drifting working set show.

`--write` writes the `routing` section of docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

import jaxvt
from benchmarks import report
from benchmarks.cli import run
from jaxvt import JaxvtError, SamplingParams
from jaxvt.engine import Exec, decode_loop_fn, first_token_fn, prefill_fn, row_key
from jaxvt.synth_routing import REAL_LRU_CURVE, lru_name, measure

PROMPT = "The capital of France is"
COLUMNS = ("next_token_reuse", "reuse_within_8", "skew", "next_layer_predictability")


class Trace:
  """The experts each routed call chose, in call order (one call per layer and program step)."""

  def __init__(self):
    self.calls: list[np.ndarray] = []  # ids int [T, k] per call

  def __call__(self, ids) -> None:
    self.calls.append(np.array(ids))


@dataclasses.dataclass(frozen=True)
class _Recording:
  """A backend that routes as `inner` does and hands the chosen ids to `trace`."""
  inner: object
  trace: Trace

  def __getattr__(self, name):
    return getattr(self.inner, name)

  def route(self, logits, k, renormalise, ex):
    ids, wts = self.inner.route(logits, k, renormalise, ex)
    jax.debug.callback(self.trace, ids, ordered=True)
    return ids, wts


@dataclasses.dataclass(frozen=True, eq=False)
class RecordingExec(Exec):
  """An Exec whose backend records the routing into `trace`; equal only to itself, so no
  program compiled for another trace is reused."""
  trace: Trace | None = None

  def __eq__(self, other):
    return self is other

  __hash__ = object.__hash__

  @property
  def backend(self):
    return _Recording(super().backend, self.trace)


def decode_trace(eng, tokens: int, temperature: float, seed: int) -> tuple[np.ndarray, list[int]]:
  """Decodes `tokens` tokens after PROMPT with eng's weights; returns (ids int [tokens, L, k]:
  each decoded token's experts per MoE layer, the token ids fed)."""
  cfg = eng.cfg
  trace = Trace()
  fields = {f.name: getattr(eng.ex, f.name) for f in dataclasses.fields(Exec)}
  ex = RecordingExec(**fields, trace=trace)
  prompt = eng.encode_prompt(PROMPT)
  n = len(prompt)
  cache = eng.new_cache(1)
  kv = eng.kv_len(n + tokens)
  # one prefill program of exactly the prompt; its routing (the prompt's) is not the decode's
  logits, cache = prefill_fn(eng.weights, cache, jnp.asarray([prompt], jnp.int32),
                             jnp.arange(n, dtype=jnp.int32)[None], jnp.ones((1, n), bool),
                             jnp.asarray([n - 1], jnp.int32), cfg=cfg, ex=ex, kv_len=kv)
  jax.effects_barrier()
  start = len(trace.calls)
  params = SamplingParams(temperature=temperature)
  first, key = first_token_fn(logits[0], row_key(seed, params), params=params)
  out, cache, key, _ = decode_loop_fn(eng.weights, cache, first[None], jnp.int32(n), key, cfg=cfg,
                                      ex=ex, kv_len=kv, params=params, steps=tokens)
  jax.effects_barrier()
  fed = [int(first)] + [int(t) for t in np.asarray(out)[:-1, 0]]
  L, k = cfg.n_layers, cfg.n_experts_used
  calls = trace.calls[start:]
  if len(calls) != tokens * L or any(c.shape != (1, k) for c in calls):
    raise RuntimeError(f"recorded {len(calls)} routed decode calls, expected {tokens} x {L} of "
                       f"one token each")
  return np.stack(calls).reshape(tokens, L, k), fed


def table(stats: dict[str, np.ndarray]) -> list[str]:
  """Markdown rows: one per layer, then the mean."""
  L = len(stats["next_token_reuse"])
  rows = ["| layer | reuse@1 | reuse@8 | top10% | next |", "|---|---|---|---|---|"]

  def cell(name, l):
    v = stats[name]
    return f"{v[l]:.3f}" if l < len(v) else "-"

  for l in range(L):
    rows.append(f"| {l} | " + " | ".join(cell(c, l) for c in COLUMNS) + " |")
  rows.append("| mean | " + " | ".join(f"{np.mean(stats[c]):.3f}" if len(stats[c]) else "-"
                                      for c in COLUMNS) + " |")
  return rows


def lru_table(stats: dict[str, np.ndarray], n_experts: int) -> list[str]:
  """Markdown rows: the measured LRU hit rate (mean over layers, and the layers' range) at each
  capacity of REAL_LRU_CURVE, beside the real traces' rate."""
  rows = ["| LRU capacity (share of experts) | experts | real traces | this decode (mean) | "
          "layers (min-max) |", "|---|---|---|---|---|"]
  for share, real in REAL_LRU_CURVE:
    v = stats[lru_name(share)]
    rows.append(f"| {share:g} | {share * n_experts:.1f} | {real:.2f} | {np.mean(v):.3f} | "
                f"{np.min(v):.3f}-{np.max(v):.3f} |")
  return rows


def probe(path: str, tokens: int = 1024, temperature: float = 1.0,
          seed: int = 0) -> tuple[dict[str, np.ndarray], object, list[int]]:
  """(the statistics of a decode of the model at `path` (measure's per-layer values), its
  ModelConfig, the token ids fed)."""
  if not os.path.exists(path):
    raise JaxvtError(f"no such file: {path}; pass --model PATH of a MoE GGUF file")
  with jaxvt.load(path, max_context=tokens + 64) as eng:
    cfg = eng.cfg
    if not cfg.is_moe:
      raise JaxvtError(f"{os.path.basename(path)} is not a MoE model ({cfg.arch}); pass a MoE "
                       "GGUF file")
    ids, fed = decode_trace(eng, tokens, temperature, seed)
  return measure(ids, cfg.n_experts, [c for c, _ in REAL_LRU_CURVE]), cfg, fed


def main(args) -> str:
  out = []
  for path in args.model:
    stats, cfg, fed = probe(path, args.tokens, args.temperature, args.seed)
    k, E = cfg.n_experts_used, cfg.n_experts
    out += [f"### {os.path.basename(path)}: {cfg.arch}, {cfg.n_layers} MoE layers, top-{k} of "
            f"{E} experts (uniform memoryless: reuse@1 {k / E:.3f}); {len(set(fed))} distinct "
            f"of {len(fed)} tokens\n", *table(stats), "", *lru_table(stats, E), ""]
  body = "\n".join(out)
  if args.write:
    models = " ".join(f"--model {os.path.basename(p)}" for p in args.model)
    head = ["## Routing statistics of a decode\n",
            f"Command: `python -m benchmarks.routing {models} "
            f"--tokens {args.tokens} --temperature {args.temperature:g} --seed {args.seed}`  ",
            f"Machine: {report.machine()}  ", f"Date: {report.stamp()}\n"]
    report.write_section("routing", "\n".join(head) + "\n" + body)
  return body


def cli(argv: list[str] | None = None) -> int:
  """python -m benchmarks.routing's entry: the tables, or a one-line error (exit status 2)."""
  return run(main, parser(), argv)


def parser() -> argparse.ArgumentParser:
  ap = argparse.ArgumentParser(prog="python -m benchmarks.routing",
                               description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=1024, help="tokens to decode")
  ap.add_argument("--temperature", type=float, default=1.0, help="sampling temperature")
  ap.add_argument("--seed", type=int, default=0, help="sampling seed")
  ap.add_argument("--write", action="store_true", help="write docs/BENCHMARKS.md's section")
  ap.add_argument("--model", required=True, action="append",
                  help="a MoE GGUF file (repeat for several: one table each)")
  return ap


if __name__ == "__main__":
  sys.exit(cli())
