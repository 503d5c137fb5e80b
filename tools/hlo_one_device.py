"""One device is the 1 x 1 mesh: is its program as good as the decoder's own?

  python tools/hlo_one_device.py [--model PATH] [--offload-gb N] [--max-context N]

Loads a model on one device (the embedded default, or --model) and compiles, ahead of time, the
engine's prefill (at several prompt lengths) and decode programs, which run `decoder.forward`
inside a shard_map over the 1 x 1 mesh, next to `decoder.forward` jitted alone on the same
weights. For each it prints XLA's memory analysis (temporaries, arguments, outputs, aliased
bytes) and counts of the HLO ops that would show a cost of the mesh (copies, all-reduces,
custom calls, fusions, loops); it exits 1 when the mesh program needs more temporary or output
memory, or has more copies or any all-reduce. On a GPU it checks that program; on the CPU, the
CPU's.
"""

from __future__ import annotations

import argparse
import functools
import re
import sys

import jax
import jax.numpy as jnp

import jaxvt
from jaxvt import engine
from jaxvt.model import decoder

OPS = ("copy", "all-reduce", "custom-call", "fusion", "while")


@functools.partial(jax.jit, static_argnames=("cfg", "ex", "kv_len", "logits"),
                   donate_argnames=("cache",))
def alone(weights, cache, tokens, positions, valid, last, *, cfg, ex, kv_len, logits):
  """decoder.forward without a mesh: logits at `last` (prefill) or every position (decode)."""
  return decoder.forward(weights, cache, tokens, positions, cfg, ex, kv_len, valid=valid,
                         logits_at=last if logits == "last" else None)


def _stats(compiled) -> dict:
  ma = compiled.memory_analysis()
  text = compiled.as_text()
  out = {k: int(getattr(ma, f"{k}_size_in_bytes")) for k in ("temp", "argument", "output",
                                                               "alias")} if ma else {}
  out.update({o: len(re.findall(rf"= \S+ {o}\(", text)) for o in OPS})
  return out


def compare(eng) -> bool:
  """Prints both programs' numbers; True when the mesh program is not worse."""
  spec = jax.ShapeDtypeStruct
  i32 = lambda s: spec(s, jnp.int32)
  cache = jax.eval_shape(lambda: eng.new_cache(1))
  kw = dict(cfg=eng.cfg, ex=eng.ex)
  ok = True
  for T in (t for t in (1, 16, 512) if t <= eng.max_context):  # decode, two prefill buckets
    args = (eng.weights, cache, i32((1, T)), i32((1, T)))
    if T == 1:
      mesh = engine.decode_fn.lower(*args, kv_len=eng.kv_len(1), **kw)
      ref = alone.lower(*args, None, None, kv_len=eng.kv_len(1), logits="all", **kw)
      name = "decode"
    else:
      mesh = engine.prefill_fn.lower(*args, spec((1, T), bool), i32((1,)), kv_len=eng.kv_len(T),
                                     **kw)
      ref = alone.lower(*args, spec((1, T), bool), i32((1,)), kv_len=eng.kv_len(T),
                        logits="last", **kw)
      name = f"prefill {T}"
    a, b = _stats(mesh.compile()), _stats(ref.compile())
    print(f"{name}:\n  1x1 mesh {a}\n  alone    {b}")
    worse = [k for k in ("temp", "output", "copy") if a.get(k, 0) > b.get(k, 0)]
    if a["all-reduce"]:
      worse.append("all-reduce")
    if worse:
      print(f"  WORSE on the mesh: {', '.join(worse)}")
      ok = False
  return ok


def main(argv: list[str] | None = None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default=None)
  ap.add_argument("--offload-gb", type=float, default=0.0)
  ap.add_argument("--max-context", type=int, default=512)
  args = ap.parse_args(argv)
  with jaxvt.load(args.model, max_context=args.max_context, offload_gb=args.offload_gb) as eng:
    print(f"{eng.path}: {eng.cfg.arch}, {eng.cfg.n_layers} layers, on "
          f"{eng.ex.par.devices[0].device_kind}; offload {eng.plan.plan.host_bytes / 2**30:.2f} GiB")
    return 0 if compare(eng) else 1


if __name__ == "__main__":
  sys.exit(main())
