"""The device expert cache's operands and its decision op (csrc/common/expert_cache.h).

Decode reads each token's routed experts of a host-tier layer over the bus. Real routing repeats
itself from token to token, so spare device memory keeps the experts used last (LRU) or most
often lately (LFRU), and the experts kernels read those from HBM:

  where = assign(ids, layer, tables.stab)   # per routed slot: hit slot j, fill slot j, or -1
  ops.moe_experts(..., cache=tables.operands(where))   # hits read the cache, fills write it

The cache is transparent: a hit reads the bytes a fill copied from the host tier, so the
products have the same bits with it and without it, at any size and under either policy. Its
memory (each cached layer's slots in every host-tier routed stack, and each layer's directory)
is allocated by jaxvt.offload.expert_cache, which gives the programs its addresses as small
tables (CacheTables), as QWeight's table gives host-tier layers'. `assign_ref` is the numpy
reference of the decision that the CPU and GPU kernels compute.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxvt import ffi as _ffi
from jaxvt.qweight import STAGES, CacheTables  # noqa: F401 (re-exported)

_ffi.register()

HEADER_WORDS = 10  # expert_cache.h Header
POLICIES = ("lru", "lfru")  # Header.policy 0, 1
MAX_CALL_SLOTS = 1024  # routed slots of one call (expert_cache.h kMaxCallSlots)
MAX_SLOTS = 1024  # slots of one layer (kMaxSlots)
USE = 256  # LFRU: a use's weight (kUse)


def layer_words(experts: int, slots: int) -> int:
  """int32 words of one cached layer's state block: the header, dir [E], owner [S], score [S]."""
  return HEADER_WORDS + experts + 2 * slots


def new_layer_state(experts: int, slots: int, policy: str) -> np.ndarray:
  """An empty layer's state block (int32 words): no expert in any slot."""
  if policy not in POLICIES:
    raise ValueError(f"expert cache policy {policy!r} is not one of {', '.join(POLICIES)}")
  if not 1 <= slots <= min(experts, MAX_SLOTS):
    raise ValueError(f"{slots} slots for {experts} experts: 1 <= slots <= min(experts, 1024)")
  s = np.zeros(layer_words(experts, slots), np.int32)
  s[:4] = (0, POLICIES.index(policy), slots, experts)
  s[HEADER_WORDS:HEADER_WORDS + experts + slots] = -1  # dir and owner
  return s


def assign(ids: jax.Array, layer, stab: jax.Array) -> jax.Array:
  """ids int32 [..., k] (a call's routed experts), the layer (int32 scalar, may be traced),
  stab -> where int32 [..., k]: j >= 0 a hit in slot j, -(j + 2) a miss filled into slot j,
  -1 not cached. Updates the layer's directory on the device (expert_cache.h)."""
  ids = jnp.asarray(ids).astype(jnp.int32)
  if ids.size > MAX_CALL_SLOTS:
    raise ValueError(f"expert cache: {ids.size} routed slots in one call, at most "
                     f"{MAX_CALL_SLOTS}")
  call = jax.ffi.ffi_call("jaxvt_expert_cache_assign",
                          jax.ShapeDtypeStruct((ids.size,), jnp.int32))
  layer = jnp.asarray(layer).astype(jnp.int32).reshape(())
  return call(ids.reshape(-1), layer, stab).reshape(ids.shape)


@dataclasses.dataclass
class LayerState:
  """The numpy reference's view of one layer's state block."""
  experts: int
  slots: int
  policy: str
  clock: int = 0
  hits: int = 0
  misses: int = 0
  fills: int = 0
  dir: np.ndarray = None
  owner: np.ndarray = None
  score: np.ndarray = None

  def __post_init__(self):
    if self.dir is None:
      self.dir = np.full(self.experts, -1, np.int64)
      self.owner = np.full(self.slots, -1, np.int64)
      self.score = np.zeros(self.slots, np.int64)

  @classmethod
  def from_words(cls, words: np.ndarray) -> "LayerState":
    w = np.asarray(words).astype(np.int64)
    u = np.asarray(words).view(np.uint32).astype(np.int64)
    e, s = int(w[3]), int(w[2])
    d = HEADER_WORDS
    return cls(e, s, POLICIES[int(w[1])], int(u[0]), int(u[4] + (u[5] << 32)),
               int(u[6] + (u[7] << 32)), int(u[8] + (u[9] << 32)), w[d:d + e].copy(),
               w[d + e:d + e + s].copy(), u[d + e + s:d + e + 2 * s].copy())


def assign_ref(st: LayerState, ids) -> np.ndarray:
  """The decision in numpy (expert_cache.h's contract), updating `st`: where for `ids`."""
  ids = np.asarray(ids).reshape(-1)
  e_of = [-1 if v < 0 else min(int(v), st.experts - 1) for v in ids]
  hit_slots = {int(st.dir[e]) for e in e_of if e >= 0 and st.dir[e] >= 0}
  st.hits += sum(1 for e in e_of if e >= 0 and st.dir[e] >= 0)
  st.misses += sum(1 for e in e_of if e >= 0 and st.dir[e] < 0)
  missing = list(dict.fromkeys(e for e in e_of if e >= 0 and st.dir[e] < 0))  # first seen first
  free = sorted((j for j in range(st.slots) if j not in hit_slots),
                key=lambda j: (int(st.score[j]), j))
  decided = {e: int(st.dir[e]) for e in e_of if e >= 0 and st.dir[e] >= 0}
  filled = set()
  for e, j in zip(missing, free):
    if st.owner[j] >= 0:
      st.dir[st.owner[j]] = -1
    st.owner[j], st.dir[e] = e, j
    decided[e] = -(j + 2)
    filled.add(j)
    st.fills += 1
  st.clock += 1
  for j in range(st.slots):
    if st.policy == "lfru":
      v = int(st.score[j]) - (int(st.score[j]) >> 3)
      st.score[j] = USE if j in filled else v + (USE if j in hit_slots else 0)
    elif j in hit_slots or j in filled:
      st.score[j] = st.clock
  return np.array([decided.get(e, -1) if e >= 0 else -1 for e in e_of], np.int32)
