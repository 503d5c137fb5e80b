// Prefetching a host-tier layer into device memory while other layers compute (prefill): the
// contract of jaxvt_prefetch_fetch / jaxvt_prefetch_take / jaxvt_prefetch_join
// (prefetch_cpu.cc, prefetch_gpu.cu; Python side jaxvt/ffi/prefetch.py).
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

#include "formats.h"

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
  const uint64_t v = static_cast<uint64_t>(table[2 * target]) |
                     (static_cast<uint64_t>(table[2 * target + 1]) << 32);
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

}  // namespace prefetch
}  // namespace jaxvt

#endif  // JAXVT_FFI_CSRC_PREFETCH_H_
