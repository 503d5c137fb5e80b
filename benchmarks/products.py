"""python -m benchmarks.tier --products: the crossovers of tuning.Products, in one run.

For each dense matrix shape of Qwen3.6-35B-A3B (rows x cols: 2048x512, 512x2048, 8192x2048,
2048x4096, 4096x2048) in Q4_K and Q6_K, with the layers in the device tier and in the host tier,
it times one layer's product with x of 1 ... 512 rows three ways, each as the model runs it
(the rule's backend matmul on the layer's view, as layers.linear calls it, under a rule of
jaxvt.engine.exec_for whose products force the path): "matvec" (ops.qmatmul, the weights read in
place once per 16 rows), "tiled" (grouped.qmatmul_tiled: once per 32 rows, tensor cores) and
"staged" (ops.qdequant to bf16, then XLA's GEMM). The routed experts (256 experts, top 8,
gate/up 512 x 2048 with x per token, down 2048 x 512 with x per slot) are timed the same way for
1 ... 512 tokens: "matvec" (ops.qmatmul_experts), "grouped" (grouped.qmatmul_grouped) and "staged"
(every expert of the layer dequantized to bf16, then jax.lax.ragged_dot over the sorted slots).

Times are ms per layer: the best of a few runs of one jitted lax.scan over L copies of the layer
at distinct addresses (L sized so the copies exceed the GPU's L2), divided by L. The last table
says from which row count each path first wins and stays fastest, the numbers tuning.Products'
constants (TILED_ROWS, STAGE_ROWS, GROUPED_SLOTS) are meant to be set from.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks import kernels as kb
from benchmarks import report
from jaxvt import engine, ffi
from jaxvt.ffi import grouped, ops, tuning
from jaxvt.ffi.tuning import Products
from jaxvt.offload.host_tier import HostTier
from jaxvt.qweight import QWeight

MIB = 1 << 20
SHAPES = [(2048, 512), (512, 2048), (8192, 2048), (2048, 4096), (4096, 2048)]
FORMATS = (12, 14)
ROWS = (1, 4, 8, 16, 32, 64, 128, 512)
DENSE = {"matvec": Products(), "tiled": Products(tiled_rows=1),
         "staged": Products(stage_rows=1)}
TIERS = ("device", "host")
EXPERTS, TOP_K = 256, 8
EXPERT_MATS = [(12, 512, 2048, False), (14, 2048, 512, True)]  # (format, rows, cols, x per slot)


def _add(lines: list[str], found: list[dict], tier_name: str, name: str,
         times: dict[str, list[float]]) -> None:
  """Appends one matrix's table row to `lines` (each row count's ms of the three paths in
  `times`, in its order; printed as soon as measured) and to `found` where its paths start to
  win: the second path against the first (in place), the third (staged) against both."""
  cells = [" / ".join(f"{t[i]:.3f}" for t in times.values()) for i in range(len(ROWS))]
  line = f"| {tier_name} | {name} | " + " | ".join(cells) + " |"
  print(line, flush=True)
  lines.append(line)
  first, second, third = times
  found.append({"tier": tier_name, "name": name, second: _wins(times, second, (first,)),
                third: _wins(times, third, (first, second))})


def _ms(product, n_layers: int, x: jax.Array, reps: int = 3) -> float:
  return kb.best_scan_time(product, n_layers, x, reps)[0] / n_layers * 1e3


def _wins(times: dict[str, list[float]], path: str, than: tuple[str, ...]) -> int | None:
  """The smallest row count from which `path` is faster than every path in `than` at every
  larger row count measured; None if it never is."""
  first = None
  for i in range(len(ROWS) - 1, -1, -1):
    if all(times[path][i] < times[o][i] for o in than):
      first = ROWS[i]
    else:
      break
  return first


def dense(rng, device, total_mib: int, tiers: tuple[str, ...]) -> tuple[list[str], list[dict]]:
  lines = ["### Dense products by rows (ms per layer: matvec / tiled / staged)\n",
           "| tier | matrix | " + " | ".join(f"{n} rows" for n in ROWS) + " |",
           "|---|---|" + "---|" * len(ROWS)]
  found = []
  for tier_name in tiers:
    for fmt in FORMATS:
      for rows, cols in SHAPES:
        raw = kb.random_matrix(rng, fmt, rows, cols)
        n_layers = max(4, min(128, -(-total_mib * MIB // raw.size)))
        with HostTier() as tier:
          w = kb.stack(raw, fmt, rows, cols, n_layers, tier if tier_name == "host" else None,
                       device)
          times = {p: [] for p in DENSE}
          for n in ROWS:
            x = jax.device_put(jnp.ones((n, cols), jnp.float32) * 1e-3, device)
            for p, rule in DENSE.items():
              ex = dataclasses.replace(engine.exec_for(device.platform, True, None),
                                       numerics="f32", products=rule)
              times[p].append(_ms(lambda x, l, ex=ex: ex.backend.matmul(x, *w.layer_view(l), ex),
                                  n_layers, x))
          del w
        _add(lines, found, tier_name, f"{kb.FORMATS[fmt].name} {rows}x{cols}", times)
  return lines, found


def _staged_experts(x, w: QWeight, l, ids):
  """Every expert of the layer as bf16 (qdequant), the slots sorted by expert, ragged_dot."""
  order, offsets = grouped.group_slots(ids, w.meta.experts)
  xs = x.reshape(-1, w.meta.cols) if x.ndim == 3 else x
  xs = xs[order // (ids.size // xs.shape[0])].astype(jnp.bfloat16)
  sizes = jnp.diff(offsets)
  wt = jnp.swapaxes(ops.qdequant(w, l), 1, 2)  # [E, cols, rows]
  y = jax.lax.ragged_dot(xs, wt, sizes, preferred_element_type=jnp.float32)
  return jnp.zeros_like(y).at[order].set(y).reshape(*ids.shape, -1)


def experts(rng, device, tiers: tuple[str, ...]) -> tuple[list[str], list[dict]]:
  lines = [f"### Routed experts by tokens (top {TOP_K} of {EXPERTS}; ms per layer: matvec / "
           "grouped / staged)\n",
           "| tier | matrix | " + " | ".join(f"{n} tok" for n in ROWS) + " |",
           "|---|---|" + "---|" * len(ROWS)]
  found = []
  paths = {"matvec": lambda x, w, l, i: ops.qmatmul_experts(x, w, l, i, "f32"),
           "grouped": lambda x, w, l, i: grouped.qmatmul_grouped(x, w, l, i),
           "staged": _staged_experts}
  for tier_name in tiers:
    for fmt, rows, cols, per_slot in EXPERT_MATS:
      raw = kb.random_matrix(rng, fmt, EXPERTS * rows, cols)
      n_layers = 4
      with HostTier() as tier:
        w = kb.stack(raw, fmt, rows, cols, n_layers, tier if tier_name == "host" else None,
                     device, experts=EXPERTS)
        times = {p: [] for p in paths}
        for n in ROWS:
          ids = jax.device_put(np.stack([np.stack([rng.permutation(EXPERTS)[:TOP_K]
                                                   for _ in range(n)]) for _ in range(n_layers)])
                               .astype(np.int32), device)
          x = jax.device_put(jnp.ones((n, TOP_K, cols) if per_slot else (n, cols), jnp.float32)
                             * 1e-3, device)
          for p, fn in paths.items():
            times[p].append(_ms(lambda x, l, fn=fn: fn(x, w, l, ids[l]), n_layers, x))
        del w
      slot = " (x per slot)" if per_slot else ""
      _add(lines, found, tier_name, f"{kb.FORMATS[fmt].name} {rows}x{cols}{slot}", times)
  return lines, found


def _from(n: int | None, unit: str) -> str:
  return "never" if n is None else f"{n} {unit}"


def main(args) -> str:
  ext = ffi.extension()
  gpu = bool(ext.gpu_platform()) and ext.gpu_device_count() > 0
  device = jax.devices("gpu" if gpu else "cpu")[0]
  rng = np.random.default_rng(0)
  tiers = TIERS
  which = args.products
  out = ["## Products by rows: in place, tiled, staged (" + device.device_kind + ")\n",
         f"Command: `python -m benchmarks.tier --products {which}`  ",
         f"Machine: {report.machine()}  ", f"Date: {report.stamp()}\n",
         "ms per layer, the best of 3 passes of a jitted layer scan over copies at distinct "
         "addresses; each product as layers.linear / the experts ops run it (benchmarks.products)."
         "\n"]
  summary = ["### Where each path starts to win (and stays fastest up to 512)\n",
             f"Tokens of the routed experts are {TOP_K} slots each (GROUPED_SLOTS counts slots).\n",
             "| tier | matrix | tiled / grouped from | staged from |", "|---|---|---|---|"]
  if which in ("all", "dense"):
    lines, found = dense(rng, device, 32 if not gpu else 64, tiers)
    out += lines + [""]
    summary += [f"| {f['tier']} | {f['name']} | {_from(f['tiled'], 'rows')} | "
                f"{_from(f['staged'], 'rows')} |" for f in found]
  if which in ("all", "experts"):
    lines, found = experts(rng, device, tiers)
    out += lines + [""]
    summary += [f"| {f['tier']} | {f['name']} | {_from(f['grouped'], 'tokens')} | "
                f"{_from(f['staged'], 'tokens')} |" for f in found]
  out += summary + ["", "Products now: " + repr(tuning.GPU_PRODUCTS)]
  return report.publish(f"products-{device.platform}" + ("" if which == "all" else f"-{which}"),
                        out)
