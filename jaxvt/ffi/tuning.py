"""The per-device tuning table: which kernel each product takes, and how host-tier weights move.

`TUNING[platform]` is one `Products` per device kind; `products_for(platform)` reads it. Every
number a kernel path or an offload schedule is tuned by lives here, once, so a new device kind is
one new row. The figures behind the GPU row are measured by `python -m benchmarks.products`,
`python -m benchmarks.profile` and the offload sweep (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses

from jaxvt.qweight import QMeta


# The most routed slots a call reads through the expert cache: its decision takes 1024 slots a
# call (jaxvt.ffi.expert_cache.MAX_CALL_SLOTS), the GPU's per-slot kernels with the cache 1023.
ROUTED_SLOTS_MAX = 1023


@dataclasses.dataclass(frozen=True)
class Products:
  """The per-product kernel rule: how x [n, cols] times one layer of a stack is computed, and
  what moves host-tier layers ahead of their use. Each count is the row (slot) count from which
  its path is taken; 0 never takes it. Products() (every field 0) takes the matvec kernels and
  the jnp steps everywhere; the CPU's row (CPU_PRODUCTS) adds only the fused DeltaNet step
  (docs/NUMERICS.md has the CPU's arithmetic contract).

  Dense matrices: "matvec" (ops.qmatmul: reads the layer in place once per 4 rows of x under
  integer products, per 16 in float32), "tiled" (grouped.qmatmul_tiled: once per 32 rows, tensor
  cores, bf16) or "staged" (ops.qdequant writes the layer as bf16, then XLA's GEMM); a layer
  whose bf16 copy is over stage_max_bytes is never staged (0: no limit). Routed experts:
  "matvec" (ops.moe_experts: each slot's expert streamed on its own) or "grouped"
  (grouped.moe_grouped: slots sorted by expert, tensor cores). The rules look at rows, never at
  the tier, so a weight gives the same bits from either tier and tokens do not depend on the
  offload budget.

  fused_route / gdn_fused / attn_fused: the MoE router's softmax-top-k, a DeltaNet layer's and an
  attention layer's decode step as one custom call each instead of a dozen or more small XLA
  kernels (float32, summed in another order than the jnp path). The router and attention stay
  off on the CPU, whose jnp and ggml paths are matched against llama.cpp; the DeltaNet step is
  on there: below gdn_chunked_rows tokens a prefill takes it token by token too
  (model.deltanet.gdn_steps), so a token's mixer gives the same bits in a prefill of any length,
  in decode and in any batch (jnp's conv, norms and gates came out an ulp apart with the shapes);
  on the CPU it decodes a hybrid file 1.6x faster than the jnp mixer and prefills at 0.98x
  (`python -m benchmarks.invariance --hybrid`).

  fused_norm: the residual add, RMSNorm and the shared expert's gate logit between two blocks
  as one custom call (jaxvt.ffi.norm.add_norm) instead of XLA's three to six small kernels, with
  a MoE's k routed outputs weighted and summed there (the per-slot experts kernels leave them
  apart); each row's sums in a fixed order of its own (so the batch-invariant row needs no other
  form for them). Off in every row: it removes 159 of a 35B-shaped step's 783 kernels on an
  H100 but not their time (1.01x at one decode row, 0.97x at 8; its call takes 3.6-6 us, about
  what XLA's kernels it replaces took together), and on the CPU the default model decoded one
  row at 0.96x with it (docs/BENCHMARKS.md `fused-norm`). On the CPU its kernel computes ggml's
  bits (a dense model's logits stay llama.cpp's, tests/test_add_norm.py).

  fused_swiglu: silu(g) * u formed by the down products as they hold their input rows
  (ops.qmatmul / ops.qmatmul_experts with up=; ggml's arithmetic only), instead of a step of its
  own between the gate/up and the down launches: the routed experts', the shared expert's and a
  dense FFN's. On the CPU the input rows are jaxvt_swiglu's, so a dense model's logits keep
  their bits (tests/test_swiglu_product.py); a MoE's routed experts then take ggml's swiglu
  instead of the jnp formula. On a GPU the kernel's expf and XLA's exp round some elements an
  ulp apart. Off in every row: on an H100 it removes 80 kernels a step and gains nothing (1.005x;
  each down launch now computes its row's exps before its weights can be used), on the CPU
  1.00x (docs/BENCHMARKS.md `fused-swiglu`).

  gdn_chunked_rows: from this many tokens a DeltaNet layer's prefill takes the chunked (WY)
  form of the gated delta rule; 0 never: every token takes the recurrence, as decode does, so
  a prefix-cache hit, a prefill in pieces and a cold prefill give the same bits (the CPU's: there
  the recurrence is also ~16x faster, 94 against 1555 ms for 512 tokens of 16 heads of
  128 x 128 on the shared 2-core machine; the fused step token by token took 81 against the jnp
  recurrence's 71 ms in the same comparison).

  prefetch_per_expert: from this many routed slots per expert (T*k >= this * E) a call copies
  each host-tier layer of the routed experts' stacks into a device ring ahead of its turn while
  the layers before it compute (jaxvt.offload.schedule; jaxvt.ffi.prefetch); at 4 slots per
  expert a uniform router picks ~98% of a layer's experts, so the whole layer's copy moves
  nearly only bytes the router picked. prefetch_rings: rings per stack whose host-tier layers
  include adjacent ones (they take the layers in turns, so the second's copy overlaps the
  first's compute).

  predict_after_host / predict_after_device: at one token (decode), layer l + 1's router applied
  to layer l's MoE input names most of the experts layer l + 1 will use; where l + 1 is a
  host-tier layer, that many of its likeliest experts are copied ahead (after a host-tier layer
  the bus is busy with its own experts). predict_sets: ring sets alternating by layer (1 or 2).
  predict_inline: the copy runs on XLA's stream as a kernel XLA captures in its command buffers,
  with predict_blocks blocks an expert (0: the extension's default). predict_scale > 0: the
  counts are for a layer with that many routed stacks in the host tier; one with k of them gets
  count * predict_scale / k (at most 8), copied by proportionally fewer blocks, decided per layer
  on the device. predict_with_cache: whether decode still predicts where the weights carry an
  expert cache (jaxvt.offload.expert_cache), which holds the experts recent tokens used.

  routed_per_expert: a call of at most this many routed slots per expert (T*k <= this * E, and
  at most ROUTED_SLOTS_MAX) takes the per-slot experts kernels whatever grouped_slots says, and
  no layer rings: it reads only the experts its tokens route to, through the expert cache where
  the weights carry one (filling it), as decode does. A short prefill (a chat's next turn after
  prompt reuse) then reads the few experts its tokens need, most of them cache hits, instead of
  nearly every expert of each host-tier layer. 0: off. Set by jaxvt.offload.cost.products_for
  from the platform's measured rates (cost.routed_crossover), not in the rows below; it looks at
  slots and experts only, never at the tier or the cache, so the bits do not depend on either.

  attn_steps: with attn_fused, a prefill's attention takes the fused decode step token by token
  too (model.layers.attention), as gdn_chunked_rows = 0 does for DeltaNet: a query's sums are
  then the decode step's, in a prefill of any length, after a prefix hit and in decode.
  attn_chunk: positions of one split of the fused step; 0 takes jaxvt.ffi.attn.chunk(kv_len),
  which grows with the program's kv bucket (longer splits past 2048 positions: its sums then
  depend on the longest row of the program); > 0 fixes it, so a row's sums depend on its own
  positions only (the combine reads only the splits that hold them).
  ordered_sums: the sums over a row's own values that XLA would compute between the kernels
  take forms whose order does not depend on the rows of the program (XLA picks a dot's
  algorithm, and vectorises a reduction, by the shapes: on the CPU about half of a row
  reduction's rows round otherwise alone than among 4096): RMSNorm's sum of squares and the
  shared expert's gate as matvec products with a one-row float32 matrix (the kernels' fixed
  order; RMSNorm's factor then 1 / sqrt in correctly rounded steps), the MoE's weighted sum of
  its k slots as k - 1 elementwise adds in slot order.
  """

  tiled_rows: int = 0
  stage_rows: int = 0
  stage_max_bytes: int = 0
  grouped_slots: int = 0
  fused_route: bool = False
  gdn_fused: bool = False
  attn_fused: bool = False
  fused_norm: bool = False
  fused_swiglu: bool = False
  gdn_chunked_rows: int = 0
  prefetch_per_expert: int = 0
  prefetch_rings: int = 1
  predict_after_host: int = 0
  predict_after_device: int = 0
  predict_sets: int = 2
  predict_inline: bool = False
  predict_blocks: int = 0
  predict_scale: int = 0
  predict_with_cache: bool = False
  routed_per_expert: float = 0.0
  attn_steps: bool = False
  attn_chunk: int = 0
  ordered_sums: bool = False

  def predicted_ids(self) -> int:
    """How many of the next layer's likeliest experts a decode fetch is given: the most any
    target layer can copy."""
    n = max(self.predict_after_host, self.predict_after_device)
    return min(8, n * max(1, self.predict_scale))

  def dense(self, n: int, meta: QMeta) -> str:
    """The path for x of n rows times a layer of the (non-expert) stack described by meta."""
    stage = self.stage_rows
    staged_bytes = 2 * meta.rows * meta.cols * max(meta.experts, 1)
    if stage and n >= stage and not (self.stage_max_bytes and staged_bytes > self.stage_max_bytes):
      return "staged"
    if self.tiled_rows and n >= self.tiled_rows:
      return "tiled"
    return "matvec"

  def routed(self, slots: int, experts: int) -> bool:
    """Whether a call of T*k = `slots` routed slots over `experts` experts a layer reads only its
    routed experts, per slot (routed_per_expert)."""
    return (self.routed_per_expert > 0 and experts > 0
            and 0 < slots <= min(ROUTED_SLOTS_MAX, self.routed_per_expert * experts))

  def experts(self, slots: int, experts: int = 0) -> str:
    """The path for the routed experts of T*k = `slots` slots over `experts` experts a layer (0:
    not known; the routed rule is then not applied)."""
    if self.routed(slots, experts):
      return "matvec"
    return "grouped" if self.grouped_slots and slots >= self.grouped_slots else "matvec"


# GPUs (the H200's measurements, docs/BENCHMARKS.md):
# - dense products staged from 16 rows (bf16 + XLA's GEMM beat the tile kernel 2x at 16 and 64
#   rows), never a layer whose bf16 copy is over 512 MiB (its workspace); such a layer takes the
#   tile kernel from 32 rows;
# - routed experts on the grouped kernel from 256 slots (per slot won in HBM at 128 and 512
#   slots, but from the host tier per-slot reads about S experts against E (1 - (1 - 1/E)^S)
#   distinct ones grouped), except the short calls jaxvt.offload.cost.products_for routes per
#   slot through the expert cache, which reads each distinct expert over the bus at most once;
# - host-tier expert layers copied ahead from 4 slots per expert, two rings where layers are
#   adjacent;
# - decode predicts the next host-tier layer's 2 likeliest experts (at 8 blocks each, inline),
#   scaled by the routed stacks a layer holds in the host tier (a layer holding only its down
#   stack: 6 experts at 4 blocks); not with an expert cache, which holds what recent tokens used
#   (at 7 GiB on the routing-realistic file prediction gained 16.5% without the cache and cost
#   23% with it).
GPU_PRODUCTS = Products(tiled_rows=32, stage_rows=16, stage_max_bytes=512 << 20,
                        grouped_slots=256, fused_route=True, gdn_fused=True, attn_fused=True,
                        gdn_chunked_rows=2,
                        prefetch_per_expert=4, prefetch_rings=2, predict_after_host=2,
                        predict_after_device=2, predict_inline=True, predict_blocks=8,
                        predict_scale=3)

# Positions of one split of the fused attention step in the batch-invariant row: the default
# row's split up to 2048 positions is 16; 64 keeps a 32768-position row at 512 splits.
INVARIANT_ATTN_CHUNK = 64

# GPUs, batch-invariant (--batch-invariant): every path a row can take gives decode's per-row
# arithmetic. Dense products take the matvec kernels at any rows (they read the layer once per
# 4 rows, 16 in float32, and a row's sums never depend on the others:
# tests/test_batch_invariance_gpu.py), routed experts the per-slot kernels, DeltaNet and
# attention the fused decode steps token by token, the attention step's splits a fixed size, and
# the sums between the kernels in an order of their own (ordered_sums). What moves host-tier
# weights is the default row's: it moves bytes, never changes them.
GPU_INVARIANT_PRODUCTS = dataclasses.replace(
    GPU_PRODUCTS, tiled_rows=0, stage_rows=0, stage_max_bytes=0, grouped_slots=0,
    gdn_chunked_rows=0, attn_steps=True, attn_chunk=INVARIANT_ATTN_CHUNK, ordered_sums=True)

# The CPU: the matvec kernels (its arithmetic contract) and the fused DeltaNet step.
CPU_PRODUCTS = Products(gdn_fused=True)

TUNING: dict[str, Products] = {"cpu": CPU_PRODUCTS, "cuda": GPU_PRODUCTS, "rocm": GPU_PRODUCTS}
# The rows of --batch-invariant: the CPU's own row already is (its default "ggml" numerics take
# one attention recipe for every row, docs/NUMERICS.md).
INVARIANT: dict[str, Products] = {"cpu": CPU_PRODUCTS, "cuda": GPU_INVARIANT_PRODUCTS,
                                  "rocm": GPU_INVARIANT_PRODUCTS}


def products_for(platform: str, batch_invariant: bool = False) -> Products:
  """The tuning row of a JAX platform name ("cpu", "cuda"/"gpu", "rocm"); the CPU's rule for a
  platform without a row (the matvec kernels are correct everywhere). `batch_invariant`: the
  platform's row in which a row's arithmetic never depends on the other rows of its program
  (INVARIANT)."""
  p = platform.lower()
  table = INVARIANT if batch_invariant else TUNING
  return table.get("cuda" if p == "gpu" else p, table["cpu"])
