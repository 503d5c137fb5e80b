"""The bytes of a decode step, for benchmarks.profile's roofline table.

* `hlo_read_bytes(hlo_text, weights=None)`: for every instruction of a compiled program (its HLO
  text), the bytes the kernel it becomes reads from memory: the operands' bytes, except where
  the program reads only part of an operand: a fusion parameter that is only dynamic-sliced or
  gathered counts the slice; one that is only dynamic-update-sliced in place counts nothing; a
  jaxvt weight stack (data uint8 [n, stride] followed by its table uint32 [L, 2]) counts one
  layer's matrix, an experts call's stack the distinct experts its ids route to (k for one row;
  for T rows of k the expected number under uniform routing, never more than T * k or the
  experts) times one expert's matrix, the embedding's stack one row per id; a decode expert
  ring counts nothing (its experts are the stack's, counted once); the attention step's KV
  stacks count one layer's first kv_len positions, the DeltaNet step's state stacks one layer.
  A layer's matrix, an expert's or a row's bytes are those of the stack's widest layer (its
  stride), or with `weights` (the engine's QWeights) the mean over the matching stack's layers of
  each layer's own format: one instruction of a scanned body serves every layer, so a step's
  calls then add up to the stack's bytes exactly. Writes are not counted.
* `token_bytes(weights, cache, cfg, rows, position)`: the bytes a decode step of `rows` rows
  must read: every weight once (routed expert stacks: the expected number of distinct experts
  the rows route to, under uniform routing), the embedding rows of the tokens, and the rows' KV
  cache up to `position` and DeltaNet state. Split into the device tier and the host tier.
* `copy_gbps()`: the device memory bandwidth a plain copy measures (bytes read plus written over
  its time), the roofline's denominator.
"""

from __future__ import annotations

import re
import time

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt.gguf import formats
from jaxvt.qweight import FMT_MASK, HOST_BIT, QWeight

_ITEM = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
         "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b(pred|[suf]\d+|bf16|c64|c128|f8\w*)\[([\d,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*)$")
_COMP = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s*\(.*\{\s*$")
_COMMENT = re.compile(r"/\*.*?\*/")


def _dims(d: str) -> list[int]:
  return [int(v) for v in d.split(",") if v]


def shape_bytes(shape: str) -> int:
  """Bytes of an HLO shape (an array or a tuple of arrays)."""
  return sum(_ITEM.get(t, 1) * int(np.prod(_dims(d), dtype=np.int64))
             for t, d in _ARRAY.findall(shape))


def _balanced(s: str, i: int) -> int:
  """Index just past the bracket group opening at s[i] ('(' or '{')."""
  close = {"(": ")", "{": "}"}[s[i]]
  depth = 0
  for j in range(i, len(s)):
    depth += {s[i]: 1, close: -1}.get(s[j], 0)
    if depth == 0:
      return j + 1
  return len(s)


def _split_top(s: str) -> list[str]:
  out, depth, cur = [], 0, []
  for ch in s:
    if ch in "([{":
      depth += 1
    elif ch in ")]}":
      depth -= 1
    if ch == "," and depth == 0:
      out.append("".join(cur).strip())
      cur = []
    else:
      cur.append(ch)
  if "".join(cur).strip():
    out.append("".join(cur).strip())
  return out


def parse_instruction(line: str):
  """(name, result shape, opcode, [(operand shape, operand name)], attributes) or None."""
  m = _INSTR.match(line)
  if not m:
    return None
  name, rest = m.group(1), m.group(2)
  if rest.startswith("("):
    end = _balanced(rest, 0)
    shape, rest = rest[:end], rest[end:].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  op = re.match(r"([\w\-]+)\(", rest)
  if not op:
    return None
  end = _balanced(rest, op.end() - 1)
  operands = []
  for o in _split_top(_COMMENT.sub("", rest[op.end():end - 1])):  # XLA writes /*index=5*/ ...
    parts = o.rsplit(" ", 1)
    operands.append((parts[0], parts[-1].lstrip("%")) if len(parts) == 2 else ("", o.lstrip("%")))
  return name, shape, op.group(1), operands, rest[end:]


def _attr_int(attrs: str, key: str) -> int | None:
  m = re.search(rf"\b{key}\s*=\s*(-?\d+)", attrs)
  return int(m.group(1)) if m else None


def _computations(hlo: str) -> dict[str, list]:
  comps, cur = {}, None
  for line in hlo.splitlines():
    c = _COMP.match(line)
    if c and "=" not in line.split("(")[0]:
      cur = comps.setdefault(c.group(1), [])
      continue
    if line.strip() == "}":
      cur = None
      continue
    if cur is not None:
      ins = parse_instruction(line)
      if ins:
        cur.append(ins)
  for body in comps.values():  # operands printed without their shape: the definition's
    shapes = {name: shape for name, shape, _, _, _ in body}
    for i, (name, shape, op, operands, attrs) in enumerate(body):
      body[i] = (name, shape, op, [(s or shapes.get(n, ""), n) for s, n in operands], attrs)
  return comps


def _param_reads(body: list) -> dict[str, int | None]:
  """parameter name -> bytes the fused computation reads of it (None: all of it)."""
  users: dict[str, list] = {n: [] for n, _, op, _, _ in body if op == "parameter"}
  for _, shape, op, operands, _ in body:
    for k, (_, src) in enumerate(operands):
      if src in users:
        users[src].append((op, k, shape))
  out = {}
  for pname, us in users.items():
    read = 0
    for op, k, shape in us:
      if op in ("dynamic-slice", "gather", "slice") and k == 0:
        read += shape_bytes(shape)
      elif op == "dynamic-update-slice" and k == 0:
        pass  # updated in place: the target is not read
      else:
        read = None
        break
    out[pname] = read
  return out


def _fusion_reads(operands, body) -> int:
  names = [n for n, _, op, _, _ in body if op == "parameter"]
  nums = {}
  for n, _, op, opnds, _ in body:
    if op == "parameter":
      nums[n] = int(opnds[0][1]) if opnds and opnds[0][1].isdigit() else len(nums)
  reads = _param_reads(body)
  total = 0
  for n in names:
    i = nums[n]
    if i >= len(operands):
      continue
    r = reads.get(n)
    total += shape_bytes(operands[i][0]) if r is None else r
  return total


def _layout_shapes(attrs: str, n: int) -> list[str] | None:
  """A custom call's operand shapes as its operand_layout_constraints list them (None without
  them): what the operands are, whatever the call's operand list prints."""
  m = re.search(r"operand_layout_constraints=\{", attrs)
  if not m:
    return None
  inner = attrs[m.end():_balanced(attrs, m.end() - 1) - 1]
  shapes = _split_top(inner)
  return shapes if len(shapes) == n else None


def _unit_bytes(weights: dict | None, n: int, stride: int, attrs: str, kind: str) -> float:
  """Bytes of one unit a jaxvt call reads of a stack of `n` device layers of `stride` bytes: a
  layer's matrix ("layer"), one expert's matrix ("expert") or one row ("row"). From the QWeights
  of `weights` whose data and metadata match the call (the mean over their layers, each layer in
  its own format), else from the stride (the widest layer)."""
  rows, cols = _attr_int(attrs, "rows"), _attr_int(attrs, "cols")
  experts = _attr_int(attrs, "experts") or 0
  units = []
  stacks = jax.tree_util.tree_leaves(weights or {}, is_leaf=lambda x: isinstance(x, QWeight))
  for w in stacks:
    if not isinstance(w, QWeight):
      continue
    m = w.meta
    if (tuple(w.data.shape[-2:]) != (n, stride) or (cols is not None and m.cols != cols) or
        (rows is not None and m.rows != rows) or m.experts != experts):
      continue
    per_row = np.mean([formats.row_bytes(int(f) & FMT_MASK, m.cols)
                       for f in np.asarray(w.fmts).reshape(-1)])
    units.append(float(per_row) if kind == "row" else float(per_row) * m.rows)
  if units:
    return float(np.mean(units))
  if kind == "expert":
    return stride / max(experts, 1)
  if kind == "row":
    return stride / max(rows or 1, 1)
  return float(stride)


def _routed(ids: tuple[str, str] | None, experts: int) -> float:
  """The distinct experts a call's ids route to: k for one row [1, k], the expected number for
  T rows [T, k] (distinct_experts), at most the slots and the experts for other ids."""
  if ids is None:
    return float(experts)  # no ids: every expert (qdequant of a stack)
  dims = _dims(ids[1])
  slots = int(np.prod(dims, dtype=np.int64))
  if len(dims) == 2 and 0 < dims[1] <= experts:
    return min(distinct_experts(experts, dims[1], dims[0]), slots, experts)
  return float(min(slots, experts))


def _custom_reads(operands, attrs: str, weights: dict | None = None) -> int:
  target = re.search(r'custom_call_target="([^"]+)"', attrs)
  target = target.group(1) if target else ""
  shapes = _layout_shapes(attrs, len(operands)) or [s for s, _ in operands]
  if not target.startswith("jaxvt_"):
    return sum(shape_bytes(s) for s in shapes)
  experts = _attr_int(attrs, "experts") or 0
  kv_len = _attr_int(attrs, "kv_len")
  arrays = [(_ARRAY.findall(s) or [("", "")])[0] for s in shapes]
  ids = None
  if "qembed" in target:
    ids = arrays[0]  # ids first, then the stack
  else:  # ids: the first s32 array after the layer index (a scalar)
    seen_scalar = False
    for t, d in arrays:
      if t == "s32" and d == "":
        seen_scalar = True
      elif t == "s32" and seen_scalar:
        ids = (t, d)
        break
  total = 0.0
  for i, ((t, d), s) in enumerate(zip(arrays, shapes)):
    dims = _dims(d)
    nxt = arrays[i + 1] if i + 1 < len(arrays) else ("", "")
    if t == "u8" and len(dims) >= 2 and nxt[0] == "u32" and _dims(nxt[1])[-1:] == [2]:
      n, stride = dims[-2:]
      if experts:
        total += _routed(ids, experts) * _unit_bytes(weights, n, stride, attrs, "expert")
      elif "qembed" in target:
        count = int(np.prod(_dims(ids[1]), dtype=np.int64)) if ids else 0
        total += count * _unit_bytes(weights, n, stride, attrs, "row")
      else:
        total += _unit_bytes(weights, n, stride, attrs, "layer")
    elif experts and t == "u8" and len(dims) == 1 and i > 0:
      pass  # a decode expert ring: the routed experts it holds are counted with the stack
    elif "attn_step" in target and i in (6, 7) and len(dims) == 5 and kv_len:
      total += shape_bytes(s) // dims[0] * min(kv_len, dims[2]) // dims[2]
    elif "gdn_step" in target and i in (8, 9) and dims:
      total += shape_bytes(s) // dims[0]
    else:
      total += shape_bytes(s)
  return int(round(total))


def hlo_read_bytes(hlo: str, weights: dict | None = None) -> dict[str, int]:
  """Instruction name -> bytes its kernel reads (see the module's docstring), for every
  instruction of every non-fused computation of the compiled module's text; `weights` (the
  engine's weights, optional): the QWeights whose layers' formats give the jaxvt calls' bytes."""
  comps = _computations(hlo)
  called = set()
  for body in comps.values():
    for _, _, op, _, attrs in body:
      if op == "fusion":  # fused bodies run inside their fusion's kernel (calls and
        # command buffers, to_apply=, hold kernels of their own; reducers name no kernel)
        called.update(re.findall(r"calls=%?([\w.\-]+)", attrs))
  out = {}
  for cname, body in comps.items():
    if cname in called:
      continue
    for name, shape, op, operands, attrs in body:
      if op == "fusion":
        c = re.search(r"calls=%?([\w.\-]+)", attrs)
        fb = comps.get(c.group(1)) if c else None
        out[name] = _fusion_reads(operands, fb) if fb else sum(shape_bytes(s) for s, _ in operands)
      elif op == "custom-call":
        out[name] = _custom_reads(operands, attrs, weights)
      elif op in ("parameter", "constant", "get-tuple-element", "tuple", "bitcast", "while",
                  "conditional", "call"):
        continue
      else:
        out[name] = sum(shape_bytes(s) for s, _ in operands)
  return out


def normalized(name: str) -> str:
  """An instruction name as a kernel or trace name may spell it (XLA turns '.' and '-' to '_')."""
  return re.sub(r"[.\-]", "_", name)


# ---- the roofline's numerator and denominator ---------------------------------------------

def distinct_experts(n_experts: int, k: int, rows: int) -> float:
  """Expected number of distinct experts `rows` rows route to when each picks k of n_experts
  uniformly: n (1 - (1 - k/n)^rows); k for one row."""
  if rows == 1:
    return float(k)
  return n_experts * (1.0 - (1.0 - k / n_experts) ** rows)


def token_bytes(weights: dict, cache: dict, cfg, rows: int, position: int) -> dict[str, float]:
  """The bytes a decode step of `rows` rows at `position` must read: {"device", "host",
  "weights", "state"} (device and host split the weights by tier; the state is on the device)."""
  dev = host = 0.0
  for name, w in weights.items():
    if not isinstance(w, QWeight):
      dev += sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(w))
      continue
    m = w.meta
    fmts = np.asarray(w.fmts)
    share = 1.0
    if m.experts:
      share = distinct_experts(m.experts, cfg.n_experts_used, rows)
    elif name == "embed" and not cfg.tied_embeddings:
      share = rows / m.rows  # only the tokens' rows
    for f in fmts.reshape(-1):
      b = m.rows * formats.row_bytes(int(f) & FMT_MASK, m.cols) * share
      if int(f) & HOST_BIT:
        host += b
      else:
        dev += b
  state = 0.0
  for key, a in cache.items():
    per_row = int(np.prod(a.shape)) // a.shape[1] * a.dtype.itemsize
    if key in ("k", "v"):  # [layers, batch, max_len, heads, dim]: positions 0..position
      per_row = per_row * min(position + 1, a.shape[2]) // a.shape[2]
    state += per_row * rows
  return {"device": dev + state, "host": host, "weights": dev + host, "state": state}


def copy_gbps(gib: float = 1.0, reps: int = 20) -> float:
  """GB/s of a plain copy of `gib` GiB on the default device: (read + written bytes) / the
  shortest time of `reps` jitted elementwise copies (x + 1 on uint32; XLA cannot elide it). The
  best, not the median: what the memory can do, where the median of 10 swung from 1354 to
  2162 GB/s between two runs on one H100."""
  n = int(gib * 2**30) // 4
  x = jnp.arange(n, dtype=jnp.uint32)
  f = jax.jit(lambda a: a + jnp.uint32(1))
  f(x).block_until_ready()
  times = []
  for _ in range(reps):
    t0 = time.perf_counter()
    f(x).block_until_ready()
    times.append(time.perf_counter() - t0)
  del x
  return 2 * n * 4 / float(np.min(times)) / 1e9
