// Prefetching a host-tier layer into device memory while other layers compute (prefill): the
// contract of jaxvt_prefetch_fetch / jaxvt_prefetch_take / jaxvt_prefetch_join
// (handlers/cpu_prefetch.cc, handlers/gpu_prefetch.cu; Python side jaxvt/ffi/prefetch.py).
//
// A ring is one uint8 buffer of the program (XLA allocates it, so XLA's memory analysis and the
// planner count it): the bytes of one layer of a QWeight stack (room for its largest layer,
// rounded up to 256 bytes), then a header of kHeader bytes (Header below).
//
// fetch(ring, table, fmts, target, after) -> ring (aliased). target < 0: nothing (the ring keeps
//   its copy, finished or under way); a host-tier layer of the stack: its bytes are copied into
//   the ring, on a GPU by a kernel on a stream of jaxvt's own (high priority) after everything
//   XLA's stream had before it (so after the ring's last readers), and XLA's stream goes on at
//   once; any other target: the ring is marked empty. `after` is any operand the program must
//   have computed first (the last product that read the ring); it is not read.
// take(ring, table, fmts, layer) -> (ring (aliased), table2): table2 is `table` with layer
//   `layer`'s address replaced by the ring's when the ring's intent is that layer (XLA's stream
//   first waits, on the device, until the copy is complete); a kernel given table2 (and the same
//   fmts) then reads the layer from device memory, with the same bytes, so the same bits. Any
//   other layer, or a copy that does not complete within seconds, leaves table2 == table: the
//   layer is read in place from the host tier, never wrong.
// join(x, ring) -> x (aliased): XLA's stream waits for every copy jaxvt's stream was given, so
//   no copy outlives the program's buffers; x is what the program goes on to use, so the join
//   is in its dataflow (nothing here is a side-effecting custom call).
//
// The ring's layer index and the table stay on the device (the index is a scan's traced layer),
// so the copy is a kernel reading the table there, not a DMA the host would have to address.
#ifndef JAXVT_FFI_CSRC_PREFETCH_H_
#define JAXVT_FFI_CSRC_PREFETCH_H_

#include <cstdint>

#include "common/formats.h"

namespace jaxvt {
namespace prefetch {

constexpr int64_t kHeader = 1024;
constexpr int kRequests = 252;

// intent: layer + 1 of the copy last asked for (0: none); tag: layer + 1 once that copy is
// complete; count: blocks of the copy done. req: what each fetch call asked of its copy kernel
// (GPU: call c of the process writes req[c % kRequests] on XLA's stream, its copy kernel reads it
// on jaxvt's; 0: nothing to copy), so the copy kernel reads no buffer of XLA's that may be reused
// by the time it runs, and a call that asks nothing cannot disturb a copy under way.
struct Header {
  uint32_t intent;
  uint32_t tag;
  uint32_t count;
  uint32_t pad;
  uint32_t req[kRequests];
};
static_assert(sizeof(Header) == kHeader, "the ring's header is kHeader bytes");

// Where a fetch of `target` copies from, and how many bytes; nbytes 0 when `target` is out of
// range, not a host-tier layer, or larger than the ring's `capacity` (its bytes less the header).
struct Source {
  const uint8_t* src;
  int64_t nbytes;
};

JV_HD Source source(const uint32_t* table, const int32_t* fmts, int64_t n_layers,
                           int32_t target, int64_t rows, int64_t cols, int64_t experts,
                           int64_t capacity) {
  Source s{nullptr, 0};
  if (target < 0 || target >= n_layers || !(fmts[target] & kHostBit)) return s;
  const int f = fmts[target] & kFmtMask;
  const uint64_t v = table_entry(table, target);
  const int64_t n = row_bytes(f, cols) * rows * (experts > 0 ? experts : 1);
  if (n <= 0 || n > capacity) return s;
  s.src = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(v));
  s.nbytes = n;
  return s;
}

// The ring's operands checked against one another; nullptr when they fit, else the problem.
inline const char* check(int64_t ring_bytes, int64_t table_elems, int64_t n_layers, int64_t rows,
                         int64_t cols, int64_t experts) {
  if (ring_bytes <= kHeader || ring_bytes % 256 != 0)
    return "the ring must be a multiple of 256 bytes, header (1024) included";
  if (n_layers < 1 || table_elems != 2 * n_layers) return "table must be [L, 2] for fmts [L]";
  if (rows < 1 || cols < 1 || experts < 0) return "rows and cols must be positive, experts >= 0";
  return nullptr;
}


// ---------------------------------------------------------------------------------------------
// Decode: the experts a layer's router will most likely pick, copied ahead (jaxvt_prefetch_experts;
// Python side prefetch.fetch_experts). At a single token the router of layer l + 1 applied to
// layer l's input names most of the experts layer l + 1 then uses, so while layers compute on
// XLA's stream the likely experts of the next host-tier layer cross the bus on jaxvt's stream, and
// the per-slot experts kernels read those from device memory (the same bytes, so the same bits).
//
// An expert ring is one uint8 buffer of the program: a header of kXHeader bytes (XHeader), then
// kXSlotsMax slots of `slot` bytes each (room for one expert of the stack in its largest format,
// rounded up to 256 bytes).
//
// fetch(target, ids, after, (ring, table, fmts) per stack) -> rings (aliased): when `target` is a
//   host-tier layer of a stack, the first n of `ids` (int32, the predicted experts, most likely
//   first) of that layer are copied into the stack's ring, n = n_host when layer target - 1 of
//   the stack is host-tier too (the bus is busy then: few), else n_device, scaled by the
//   target's host-tier stacks where `scale` > 0 (host_stacks_at); the copy runs after
//   everything XLA's stream had before it (the rings' last readers), on a GPU on jaxvt's stream
//   while XLA's goes on. Otherwise the ring is marked empty, or left as it is (expert_count's
//   `when`: a model with two rings a stack asks twice a layer, each call for one kind of target).
// fetch_inline (jaxvt_prefetch_experts_inline): the same, the copy on XLA's stream (capturable;
//   the copy's number counted on the device).
// A per-slot experts kernel given the stack's ring (WeightArgs::ring) reads expert e of layer l
//   from slot j when the header's layer is l and ids[j] == e, once tag[j] == seq (on a GPU it
//   waits for that, bounded; past the bound it reads the host tier in place, never wrong).
constexpr int64_t kXHeader = 4096;
constexpr int kXSlotsMax = 8;
constexpr int kXRequests = 32;
// The fewest blocks a slot's copy is cut to when more experts share a call's grid (copy_blocks):
// on the H200 six down experts copied at 4 blocks each decoded fastest (docs/BENCHMARKS.md), ahead
// of 2 and 8.
constexpr int kXMinBlocks = 4;

// What one fetch call asked of its copy (written on XLA's stream, read on jaxvt's; call c uses
// req[c % kXRequests], so a late copy never reads a later call's request).
struct XRequest {
  uint32_t seq;
  int32_t layer;
  int32_t n;
  uint32_t blocks;  // blocks copying each slot (copy_blocks): the rest of the grid has no work
  int32_t ids[kXSlotsMax];
  uint32_t count[kXSlotsMax];  // blocks of the copy of slot j done
};

struct XHeader {
  uint32_t seq;    // the current copy's number (never 0 once a copy was asked)
  int32_t layer;   // its layer; -1: the ring holds nothing
  int32_t n;       // experts in it
  uint32_t pad;
  int64_t slot;    // bytes per slot
  int64_t pad2;
  int32_t ids[kXSlotsMax];
  uint32_t tag[kXSlotsMax];  // seq once slot j is complete
  XRequest req[kXRequests];
};
static_assert(sizeof(XHeader) <= kXHeader, "the expert ring's header fits in kXHeader bytes");

// The bytes of expert e of host-tier layer l (nbytes 0 when l or e is out of range, the layer is
// not host-tier, or an expert does not fit a slot).
JV_HD Source expert_source(const uint32_t* table, const int32_t* fmts, int64_t n_layers,
                                  int32_t l, int32_t e, int64_t rows, int64_t cols,
                                  int64_t experts, int64_t slot) {
  Source s{nullptr, 0};
  if (l < 0 || l >= n_layers || e < 0 || e >= experts || !(fmts[l] & kHostBit)) return s;
  const int64_t n = row_bytes(fmts[l] & kFmtMask, cols) * rows;
  if (n <= 0 || n > slot) return s;
  const uint64_t v = table_entry(table, l);
  s.src = reinterpret_cast<const uint8_t*>(static_cast<uintptr_t>(v)) + e * n;
  s.nbytes = n;
  return s;
}

// How many predicted experts a fetch of `target` copies for a stack: 0 (the ring is emptied), or
// -1 (the ring is left as it is). `when`: 0 any target; 1 only a target after a host-tier layer
// (whose own experts fill the bus until its down product: that fetch comes after it); 2 only a
// target after a device-tier layer (the bus idle: that fetch comes right after the router). A
// target that is not a host-tier layer empties the ring under `when` 0 and leaves it otherwise.
// `scale` and `stacks`: see host_stacks_at (scale 0: the count as given).
JV_HD int expert_count(const int32_t* fmts, int64_t n_layers, int32_t target, int64_t n_host,
                       int64_t n_device, int64_t when, int64_t scale = 0, int stacks = 0) {
  if (target < 0 || target >= n_layers || !(fmts[target] & kHostBit)) return when ? -1 : 0;
  const bool after_host = target > 0 && (fmts[target - 1] & kHostBit);
  if ((when == 1 && !after_host) || (when == 2 && after_host)) return -1;
  int64_t n = after_host ? n_host : n_device;
  if (scale > 0 && stacks > 0) n = n * scale / stacks;
  return static_cast<int>(n < 0 ? 0 : (n > kXSlotsMax ? kXSlotsMax : n));
}

// The host-tier stacks of a call's `n` stacks (s[i].fmts, s[i].n_layers) at layer `target`.
// expert_count's `scale` > 0 gives n_host / n_device for a target with `scale` host-tier stacks,
// and a target with `stacks` of them gets n * scale / stacks (at most kXSlotsMax): each target's
// copy then moves about the same bytes, so a layer holding only its down stack in the host tier
// gets three times the experts of one holding all three (the planner takes down stacks first:
// offload.plan.DEFAULT_ORDER).
template <typename S>
JV_HD int host_stacks_at(const S* s, int64_t n, int32_t target) {
  int k = 0;
  for (int64_t i = 0; i < n; ++i)
    if (target >= 0 && target < s[i].n_layers && (s[i].fmts[target] & kHostBit)) ++k;
  return k;
}

// Blocks copying each slot when a call's grid has `per` blocks a slot for `base` experts and the
// target gets n >= base of them: the blocks of a stack's copy kept about the same, at least
// kXMinBlocks (or per, if fewer).
JV_HD int copy_blocks(int per, int base, int n) {
  const int lo = per < kXMinBlocks ? per : kXMinBlocks;
  const int b = n > base && base > 0 ? per * base / n : per;
  return b < lo ? lo : b;
}

// The slot of the ring holding expert e of layer l, or -1 (whether or not its copy is complete).
JV_HD int expert_slot(const XHeader* h, int32_t l, int32_t e) {
  if (h->layer != l || h->seq == 0) return -1;
  for (int j = 0; j < h->n && j < kXSlotsMax; ++j)
    if (h->ids[j] == e) return j;
  return -1;
}

// The expert ring's operands checked; nullptr when they fit, else the problem.
inline const char* check_experts(int64_t ring_bytes, int64_t slot, int64_t table_elems,
                                 int64_t n_layers) {
  if (slot < 256 || slot % 256 != 0)
    return "an expert slot must be a positive multiple of 256 bytes";
  if (ring_bytes != kXHeader + kXSlotsMax * slot)
    return "an expert ring must be 4096 bytes and 8 slots";
  if (n_layers < 1 || table_elems != 2 * n_layers) return "table must be [L, 2] for fmts [L]";
  return nullptr;
}

}  // namespace prefetch
}  // namespace jaxvt

#endif  // JAXVT_FFI_CSRC_PREFETCH_H_
