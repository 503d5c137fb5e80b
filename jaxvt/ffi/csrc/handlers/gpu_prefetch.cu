// The prefetch ops (prefetch.h) for platform "CUDA" / "ROCM".
//
// fetch: the handler works out on the host which layer the call asks for: fetch calls come in
// the program's order, the first (attribute `first` >= 0) before the layers run and then one per
// layer, so call c of a ring asks for schedule[c - 1] (prefetch.schedule); -1 enqueues nothing.
// Where the host tier registered the table (memory.h prefetch_layer) and the layer's bytes are a
// live host_alloc range, the copy is a DMA on a stream of jaxvt's own (one per device, the device's
// highest priority): a one-thread kernel on XLA's stream first checks the host's reckoning
// against the device (the traced target and the table's address must agree) and writes the
// ring's intent (target + 1, or 0 when they disagree: the ring is then never read), an event
// forks jaxvt's stream after everything XLA's stream had (the ring's last readers), the DMA
// copies the layer, and a one-thread kernel after it sets the tag. Otherwise (a table nobody
// registered) the same stream runs a copy kernel that reads the target and the table on the
// device: a quarter of the multiprocessors' worth of blocks with several 16-byte loads in flight
// per thread, its last block to finish setting the tag (after a fence); the call's request goes
// through the header (req[c % kRequests], c this process's count of fetch calls), so the kernel
// reads no buffer of XLA's that may be reused by the time it runs. XLA's stream does not wait.
// take: a one-block kernel on XLA's stream copies the table; when the ring's intent is `layer`,
// one thread waits (sleeping between reads) for the tag, then points the layer's entry at the
// ring. Only a copy that fetch started can be waited for, and that copy's blocks are on the
// device or scheduled before any later work of XLA's stream (which is held here), so the wait
// ends; a bound of a few seconds keeps the host-tier address instead.
// join(x, ring) -> x: XLA's stream waits for an event recorded after the last copy.
// experts (decode, prefetch.h XHeader): a one-block kernel on XLA's stream writes the call's
// request (its slot in the header's request ring: the host counts calls, so a late copy never
// reads a later request) and each ring's new header; an event forks jaxvt's stream, whose copy
// kernel (a grid of blocks per slot and stack; those beyond the request's count exit) copies
// each predicted expert into its slot, the slot's last block setting the slot's tag. The
// per-slot experts kernels wait for a tag themselves (kernels_gpu_experts.cu ring_expert).
// experts_inline: the same two kernels, both on XLA's stream (the request in slot 0, the copy's
// number counted on the device from the header's), so nothing is left on the host and XLA may
// capture the call in its command buffers; under XLA's concurrent command-buffer scheduling
// the copy then runs beside the kernels that touch no ring, and a later experts kernel reading
// the ring follows it in the graph (its tags are set by then).
// take and experts_inline carry the command-buffer trait (XLA may capture them in a CUDA graph
// with the kernels around them: kernels on XLA's stream whose arguments are buffers, no host
// state); fetch and join and experts do not: they enqueue work on a second stream, and keep
// count on the host.
#include <cstdint>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/prefetch.h"
#include "common/vendor.h"
#include "handlers/handlers.h"
#include "handlers/prefetch_ffi.h"
#include "kernels/gpu/kernels_gpu.h"
#include "memory/memory.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxvt {
namespace {

constexpr int kCopyThreads = 256;
constexpr int kInFlight = 4;  // 16-byte loads per thread issued before their stores
constexpr int kInlineBlocks = 8;  // blocks a slot of the inline expert fetch (H200: 4-8 best)
constexpr int64_t kSpinLimit = int64_t{1} << 22;  // gpuSleep()s before take gives up (seconds)

// The grid's share of copying nbytes from src to dst (16-byte aligned): thread t of the grid's
// blocks along x takes the 16-byte words t, t + stride, ..., kInFlight loads in flight before
// their stores; block 0 also copies the bytes after the last whole 16 (all of them if src is
// unaligned).
// Block `part` of `parts` copying its share (the grid's x: blockIdx.x of gridDim.x).
__device__ __forceinline__ void copy_bytes(uint8_t* dst8, const uint8_t* src8, int64_t nbytes,
                                           int part, int parts) {
  const bool aligned = (reinterpret_cast<uintptr_t>(src8) & 15) == 0;
  const int64_t n16 = aligned ? nbytes / 16 : 0;
  const uint4* src = reinterpret_cast<const uint4*>(src8);
  uint4* dst = reinterpret_cast<uint4*>(dst8);
  const int64_t stride = static_cast<int64_t>(parts) * blockDim.x;
  for (int64_t base = static_cast<int64_t>(part) * blockDim.x + threadIdx.x; base < n16;
       base += stride * kInFlight) {
    uint4 v[kInFlight];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j)
      if (base + j * stride < n16) v[j] = src[base + j * stride];
#pragma unroll
    for (int j = 0; j < kInFlight; ++j)
      if (base + j * stride < n16) dst[base + j * stride] = v[j];
  }
  if (part == 0)
    for (int64_t i = n16 * 16 + threadIdx.x; i < nbytes; i += blockDim.x) dst8[i] = src8[i];
}

__global__ void intent_kernel(prefetch::Header* h, const uint32_t* table, const int32_t* fmts,
                              int64_t n_layers, const int32_t* target, int64_t rows, int64_t cols,
                              int64_t experts, int64_t capacity, int slot) {
  const int32_t t = *target;
  if (t < 0) {  // nothing asked: the ring keeps its copy, finished or under way
    h->req[slot] = 0;
    return;
  }
  const prefetch::Source s = prefetch::source(table, fmts, n_layers, t, rows, cols, experts,
                                              capacity);
  const uint32_t r = s.nbytes > 0 ? static_cast<uint32_t>(t + 1) : 0u;
  h->req[slot] = r;
  h->intent = r;
  h->tag = 0;
  h->count = 0;
}

// DMA mode: the host's reckoning (target, its address, its bytes) checked against the device.
__global__ void dma_intent_kernel(prefetch::Header* h, const uint32_t* table, const int32_t* fmts,
                                  int64_t n_layers, const int32_t* target, int32_t host_target,
                                  uint64_t host_src, int64_t host_nbytes, int64_t rows,
                                  int64_t cols, int64_t experts, int64_t capacity) {
  const prefetch::Source s = prefetch::source(table, fmts, n_layers, host_target, rows, cols,
                                              experts, capacity);
  const bool agree = *target == host_target && s.nbytes == host_nbytes &&
                     reinterpret_cast<uintptr_t>(s.src) == host_src;
  h->intent = agree ? static_cast<uint32_t>(host_target + 1) : 0u;
  h->tag = 0;
  h->count = 0;
}

__global__ void tag_kernel(prefetch::Header* h, uint32_t tag) {
  __threadfence();
  atomicExch(&h->tag, tag);
}

__global__ void __launch_bounds__(kCopyThreads)
copy_kernel(uint8_t* ring, prefetch::Header* h, const uint32_t* table, const int32_t* fmts,
            int64_t n_layers, int64_t rows, int64_t cols, int64_t experts, int64_t capacity,
            int slot) {
  const uint32_t intent = *reinterpret_cast<volatile uint32_t*>(&h->req[slot]);
  if (intent == 0) return;
  const prefetch::Source s = prefetch::source(table, fmts, n_layers,
                                              static_cast<int32_t>(intent - 1), rows, cols,
                                              experts, capacity);
  copy_bytes(ring, s.src, s.nbytes, blockIdx.x, gridDim.x);
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&h->count, 1u) == gridDim.x - 1) {
      __threadfence();
      atomicExch(&h->tag, intent);
    }
  }
}

__global__ void take_kernel(const prefetch::Header* h, const uint32_t* table, const int32_t* fmts,
                            int64_t n_layers, const int32_t* layer, uint32_t* table2,
                            uint64_t ring) {
  for (int64_t i = threadIdx.x; i < 2 * n_layers; i += blockDim.x) table2[i] = table[i];
  __syncthreads();
  if (threadIdx.x != 0) return;
  int32_t l = *layer;
  l = l < 0 ? 0 : (l >= n_layers ? static_cast<int32_t>(n_layers - 1) : l);
  const uint32_t want = static_cast<uint32_t>(l + 1);
  const volatile prefetch::Header* vh = h;
  if (vh->intent != want || !(fmts[l] & kHostBit)) return;
  for (int64_t i = 0; vh->tag != want; ++i) {
    if (i == kSpinLimit) return;  // the copy did not complete: read the host tier in place
    gpuSleep();
  }
  __threadfence();
  table2[2 * l] = static_cast<uint32_t>(ring & 0xFFFFFFFFu);
  table2[2 * l + 1] = static_cast<uint32_t>(ring >> 32);
}


// ---- decode: the predicted experts of the next host-tier layer (prefetch.h, XHeader) ----

using prefetch::kXStacks;
struct XStack {
  uint8_t* ring;
  const uint32_t* table;
  const int32_t* fmts;
  int64_t n_layers, rows, cols, slot;
};
struct XStacks {
  XStack s[kXStacks];
  int n;
};

// One thread per stack, on XLA's stream: the call's request and the ring's new header. `per`:
// the copy grid's blocks a slot.
__global__ void xintent_kernel(XStacks st, const int32_t* target, const int32_t* ids,
                               int64_t n_ids, int64_t experts, int64_t n_host, int64_t n_device,
                               int64_t when, int64_t scale, int per, uint32_t seq, int rslot) {
  const int i = threadIdx.x;
  if (i >= st.n) return;
  const XStack& x = st.s[i];
  prefetch::XHeader* h = reinterpret_cast<prefetch::XHeader*>(x.ring);
  const int32_t t = *target;
  const int k = prefetch::host_stacks_at(st.s, st.n, t);
  int n = prefetch::expert_count(x.fmts, x.n_layers, t, n_host, n_device, when, scale, k);
  if (n > n_ids) n = static_cast<int>(n_ids);
  const int base = prefetch::expert_count(x.fmts, x.n_layers, t, n_host, n_device, when);
  prefetch::XRequest& r = h->req[rslot];
  r.blocks = static_cast<uint32_t>(prefetch::copy_blocks(per, base, n));
  if (seq == 0) seq = h->seq + 1u == 0u ? 1u : h->seq + 1u;  // counted on the device (graphs)
  r.seq = seq;
  if (n < 0) {  // not this call's kind of target: the ring (and any copy into it) as it is
    r.layer = -1;
    r.n = 0;
    return;
  }
  r.layer = n > 0 ? t : -1;
  r.n = n;
  for (int j = 0; j < prefetch::kXSlotsMax; ++j) {
    const int32_t e = j < n ? ids[j] : -2;
    // an expert that cannot be copied is never looked for (-2 matches no routed id)
    const bool ok = prefetch::expert_source(x.table, x.fmts, x.n_layers, t, e, x.rows, x.cols,
                                            experts, x.slot).nbytes > 0;
    r.ids[j] = ok ? e : -2;
    r.count[j] = 0;
    h->ids[j] = r.ids[j];
    h->tag[j] = 0;
  }
  h->seq = seq;
  h->layer = r.layer;
  h->n = n;
  h->slot = x.slot;
}

// On jaxvt's stream (on XLA's for the inline fetch): block (b, j, i) copies its share of slot j
// of stack i (b < the request's blocks; the others have no work); the slot's last block sets the
// slot's tag (after a fence).
__global__ void __launch_bounds__(kCopyThreads)
xcopy_kernel(XStacks st, int64_t experts, int rslot) {
  const int j = blockIdx.y, i = blockIdx.z;
  if (i >= st.n) return;
  const XStack& x = st.s[i];
  prefetch::XHeader* h = reinterpret_cast<prefetch::XHeader*>(x.ring);
  prefetch::XRequest& r = h->req[rslot];
  const volatile prefetch::XRequest* vr = &r;
  const int32_t e = vr->ids[j];
  const uint32_t parts = vr->blocks;
  if (j >= vr->n || e < 0 || blockIdx.x >= parts) return;
  const prefetch::Source s = prefetch::expert_source(x.table, x.fmts, x.n_layers, vr->layer, e,
                                                     x.rows, x.cols, experts, x.slot);
  copy_bytes(x.ring + prefetch::kXHeader + j * x.slot, s.src, s.nbytes, blockIdx.x,
             static_cast<int>(parts));
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    if (atomicAdd(&r.count[j], 1u) == parts - 1) {
      __threadfence();
      atomicExch(&h->tag[j], vr->seq);
    }
  }
}

// jaxvt's stream of each device, the event that forks it from XLA's stream, and the event that
// joins it back (recorded after every copy).
struct Side {
  gpuStream_t stream = nullptr;
  gpuEvent_t fork = nullptr, done = nullptr;
  int blocks = 0;
  bool used = false;
};
// The host state of fetch, join and experts (none carries the command-buffer trait: their host
// code runs at every call). It is per process, not XLA FFI per-instruction state, on purpose: a
// join waits for the copies of every fetch on its device (one side stream a device), and a ring's
// calls are counted by the ring's address, which aliasing keeps through the program, also where
// XLA runs a fetch as several instructions (an unrolled loop) that would each count apart.
uint64_t g_calls = 0;  // fetch calls so far (all devices): request slots go round
std::unordered_map<uintptr_t, int64_t> g_count;  // a ring's fetch calls since its first
std::mutex g_mu;
Side g_side[64];

gpuError_t side_for(int dev, Side** out) {
  if (dev < 0 || dev >= 64) return gpuErrorInvalidValue;
  Side& s = g_side[dev];
  if (!s.stream) {
    int least = 0, greatest = 0;
    if (gpuError_t e = gpuDeviceGetStreamPriorityRange(&least, &greatest)) return e;
    if (gpuError_t e = gpuStreamCreateWithPriority(&s.stream, gpuStreamNonBlocking, greatest))
      return e;
    if (gpuError_t e = gpuEventCreateWithFlags(&s.fork, gpuEventDisableTiming)) return e;
    if (gpuError_t e = gpuEventCreateWithFlags(&s.done, gpuEventDisableTiming)) return e;
    // a quarter of the multiprocessors: enough loads in flight for the bus, little taken from
    // the layers computing beside the copy
    s.blocks = gpu::sm_count() / 4 > 0 ? gpu::sm_count() / 4 : 1;
  }
  *out = &s;
  return gpuSuccess;
}

ffi::Error Status(gpuError_t e, const char* op) {
  if (e == gpuSuccess) return ffi::Error::Success();
  return ffi::Error::Internal(std::string("jaxvt ") + op + ": " + gpuGetErrorString(e));
}

prefetch::Header* header(ffi::ResultBuffer<ffi::U8>& ring) {
  return reinterpret_cast<prefetch::Header*>(ring->typed_data() + ring->element_count() -
                                             prefetch::kHeader);
}

gpuError_t alias(gpuStream_t st, const ffi::Buffer<ffi::U8>& ring, ffi::ResultBuffer<ffi::U8>& out) {
  if (out->typed_data() == ring.typed_data()) return gpuSuccess;
  return gpuMemcpyAsync(out->typed_data(), ring.typed_data(), ring.element_count(),
                        gpuMemcpyDeviceToDevice, st);
}

ffi::Error PrefetchFetchGpu(gpuStream_t st, ffi::Buffer<ffi::U8> ring,
                            ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                            ffi::Buffer<ffi::S32> target, ffi::AnyBuffer after,
                            ffi::ResultBuffer<ffi::U8> out, int64_t rows, int64_t cols,
                            int64_t experts, int64_t first, ffi::Span<const int32_t> schedule) {
  (void)after;
  if (auto e = prefetch::check_fetch(ring, table, fmts, rows, cols, experts); e.failure()) return e;
  const int64_t n = static_cast<int64_t>(ring.element_count());
  const int64_t L = static_cast<int64_t>(fmts.element_count());
  if (static_cast<int64_t>(schedule.size()) != L)
    return ffi::Error::InvalidArgument("prefetch_fetch: the schedule must have a layer's entry each");
  if (gpuError_t e = alias(st, ring, out)) return Status(e, "prefetch_fetch");
  prefetch::Header* h = header(out);
  const int64_t cap = n - prefetch::kHeader;
  const uintptr_t key = reinterpret_cast<uintptr_t>(out->typed_data());
  int dev = 0;
  if (gpuError_t e = gpuGetDevice(&dev)) return Status(e, "prefetch_fetch");
  std::lock_guard<std::mutex> lock(g_mu);
  Side* s = nullptr;
  if (gpuError_t e = side_for(dev, &s)) return Status(e, "prefetch_fetch (stream)");
  // The layer this call asks for, as the host reckons it (registered tables only: otherwise the
  // copy kernel reads the target on the device).
  int64_t want = first;
  if (first >= 0) {
    g_count[key] = 0;
  } else {
    const int64_t c = g_count[key]++;
    want = c < L ? schedule[c] : -1;
  }
  uint64_t src = 0;
  int64_t nbytes = 0;
  uint64_t addr = 0;
  int32_t fmt = 0;
  const uintptr_t table_addr = reinterpret_cast<uintptr_t>(table.typed_data());
  if (gpu_mem::prefetch_layer(table_addr, want, &addr, &fmt)) {
    if (want < 0) return ffi::Error::Success();  // nothing asked: no work at all
    if (fmt & kHostBit) {
      src = addr;
      nbytes = row_bytes(fmt & kFmtMask, cols) * rows * (experts > 0 ? experts : 1);
    }
  }
  if (src && nbytes > 0 && nbytes <= cap && gpu_mem::host_range_live(src, nbytes)) {
    dma_intent_kernel<<<1, 1, 0, st>>>(h, table.typed_data(), fmts.typed_data(), L,
                                       target.typed_data(), static_cast<int32_t>(want), src,
                                       nbytes, rows, cols, experts, cap);
    if (gpuError_t e = gpuGetLastError()) return Status(e, "prefetch_fetch");
    if (gpuError_t e = gpuEventRecord(s->fork, st)) return Status(e, "prefetch_fetch");
    if (gpuError_t e = gpuStreamWaitEvent(s->stream, s->fork, 0)) return Status(e, "prefetch_fetch");
    if (gpuError_t e = gpuMemcpyAsync(out->typed_data(), reinterpret_cast<const void*>(src),
                                      static_cast<size_t>(nbytes), gpuMemcpyDefault, s->stream))
      return Status(e, "prefetch_fetch (copy)");
    tag_kernel<<<1, 1, 0, s->stream>>>(h, static_cast<uint32_t>(want + 1));
  } else {  // a table nobody registered: the copy kernel reads the device's own view
    const int slot = static_cast<int>(g_calls++ % prefetch::kRequests);
    intent_kernel<<<1, 1, 0, st>>>(h, table.typed_data(), fmts.typed_data(), L,
                                   target.typed_data(), rows, cols, experts, cap, slot);
    if (gpuError_t e = gpuGetLastError()) return Status(e, "prefetch_fetch");
    if (gpuError_t e = gpuEventRecord(s->fork, st)) return Status(e, "prefetch_fetch");
    if (gpuError_t e = gpuStreamWaitEvent(s->stream, s->fork, 0)) return Status(e, "prefetch_fetch");
    copy_kernel<<<s->blocks, kCopyThreads, 0, s->stream>>>(out->typed_data(), h,
                                                           table.typed_data(), fmts.typed_data(),
                                                           L, rows, cols, experts, cap, slot);
  }
  if (gpuError_t e = gpuGetLastError()) return Status(e, "prefetch_fetch (copy)");
  s->used = true;
  return Status(gpuEventRecord(s->done, s->stream), "prefetch_fetch");
}

ffi::Error PrefetchTakeGpu(gpuStream_t st, ffi::Buffer<ffi::U8> ring,
                           ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                           ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::U8> out,
                           ffi::ResultBuffer<ffi::U32> table2) {
  if (auto e = prefetch::check_take(ring, table, fmts); e.failure()) return e;
  const int64_t L = static_cast<int64_t>(fmts.element_count());
  if (gpuError_t e = alias(st, ring, out)) return Status(e, "prefetch_take");
  take_kernel<<<1, 64, 0, st>>>(header(out), table.typed_data(), fmts.typed_data(), L,
                                layer.typed_data(), table2->typed_data(),
                                static_cast<uint64_t>(reinterpret_cast<uintptr_t>(out->typed_data())));
  return Status(gpuGetLastError(), "prefetch_take");
}

ffi::Error PrefetchJoinGpu(gpuStream_t st, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> ring,
                           ffi::Result<ffi::AnyBuffer> out) {
  (void)ring;
  if (out->untyped_data() != x.untyped_data())
    if (gpuError_t e = gpuMemcpyAsync(out->untyped_data(), x.untyped_data(), x.size_bytes(),
                                      gpuMemcpyDeviceToDevice, st))
      return Status(e, "prefetch_join");
  int dev = 0;
  if (gpuError_t e = gpuGetDevice(&dev)) return Status(e, "prefetch_join");
  std::lock_guard<std::mutex> lock(g_mu);
  if (dev < 0 || dev >= 64 || !g_side[dev].used) return ffi::Error::Success();
  return Status(gpuStreamWaitEvent(st, g_side[dev].done, 0), "prefetch_join");
}


uint64_t g_xcalls = 0;  // expert fetch calls so far (all devices)

// target, ids, after, then (ring, table, fmts) per stack; the rings come back aliased.
// kInline: the copy runs on XLA's stream (jaxvt_prefetch_experts_inline, capturable: no host
// state, the copy's number counted on the device), `blocks` blocks a slot (0: kInlineBlocks).
template <bool kInline>
ffi::Error XFetchGpu(gpuStream_t st, ffi::Buffer<ffi::S32> target, ffi::Buffer<ffi::S32> ids,
                     ffi::AnyBuffer after, ffi::RemainingArgs args, ffi::RemainingRets rets,
                     ffi::Span<const int64_t> rows, ffi::Span<const int64_t> cols,
                     ffi::Span<const int64_t> slot, int64_t experts, int64_t n_host,
                     int64_t n_device, int64_t when, int64_t blocks, int64_t scale) {
  (void)after;
  prefetch::XOperand ops[prefetch::kXStacks];
  int64_t n = 0;
  if (const char* e = prefetch::x_operands(args, rets, rows, cols, slot, ops, &n))
    return ffi::Error::InvalidArgument(std::string("prefetch_experts: ") + e);
  XStacks xs{};
  xs.n = static_cast<int>(n);
  for (int64_t i = 0; i < n; ++i) {
    const prefetch::XOperand& o = ops[i];
    if (o.out != o.in)
      if (gpuError_t e = gpuMemcpyAsync(o.out, o.in, o.bytes, gpuMemcpyDeviceToDevice, st))
        return Status(e, "prefetch_experts");
    xs.s[i] = XStack{o.out, o.table, o.fmts, o.n_layers, o.rows, o.cols, o.slot};
  }
  if (kInline) {  // one request slot: the copy follows its request on the same stream
    const int per = static_cast<int>(blocks > 0 ? (blocks > 1024 ? 1024 : blocks) : kInlineBlocks);
    xintent_kernel<<<1, 32, 0, st>>>(xs, target.typed_data(), ids.typed_data(),
                                     static_cast<int64_t>(ids.element_count()), experts, n_host,
                                     n_device, when, scale, per, 0u, 0);
    if (gpuError_t e = gpuGetLastError()) return Status(e, "prefetch_experts");
    xcopy_kernel<<<dim3(per, prefetch::kXSlotsMax, xs.n), kCopyThreads, 0, st>>>(xs, experts, 0);
    return Status(gpuGetLastError(), "prefetch_experts (copy)");
  }
  int dev = 0;
  if (gpuError_t e = gpuGetDevice(&dev)) return Status(e, "prefetch_experts");
  std::lock_guard<std::mutex> lock(g_mu);
  Side* s = nullptr;
  if (gpuError_t e = side_for(dev, &s)) return Status(e, "prefetch_experts (stream)");
  const uint64_t c = g_xcalls++;
  const uint32_t seq = static_cast<uint32_t>(c % 0xFFFFFFFFull) + 1u;
  const int rslot = static_cast<int>(c % prefetch::kXRequests);
  // A slot of a stack gets a share of four blocks a multiprocessor sized for two slots a stack:
  // each thread then has about one round of loads of its expert in flight. Reads of mapped host
  // memory are latency-bound: with a quarter of the multiprocessors' blocks spread over every
  // slot the copy of two experts a stack ran at 21.6 GB/s on the H200 (the profile in
  // docs/BENCHMARKS.md), too slow to finish while the next layer's other work runs. The blocks
  // of slots beyond the request's count, and beyond its blocks a slot, exit at once.
  int per = blocks > 0 ? static_cast<int>(blocks > 1024 ? 1024 : blocks)
                       : 4 * gpu::sm_count() / (2 * xs.n);
  if (per < 1) per = 1;
  xintent_kernel<<<1, 32, 0, st>>>(xs, target.typed_data(), ids.typed_data(),
                                   static_cast<int64_t>(ids.element_count()), experts, n_host,
                                   n_device, when, scale, per, seq, rslot);
  if (gpuError_t e = gpuGetLastError()) return Status(e, "prefetch_experts");
  if (gpuError_t e = gpuEventRecord(s->fork, st)) return Status(e, "prefetch_experts");
  if (gpuError_t e = gpuStreamWaitEvent(s->stream, s->fork, 0))
    return Status(e, "prefetch_experts");
  xcopy_kernel<<<dim3(per, prefetch::kXSlotsMax, xs.n), kCopyThreads, 0, s->stream>>>(
      xs, experts, rslot);
  if (gpuError_t e = gpuGetLastError()) return Status(e, "prefetch_experts (copy)");
  s->used = true;
  return Status(gpuEventRecord(s->done, s->stream), "prefetch_experts");
}

constexpr auto PrefetchExpertsGpu = XFetchGpu<false>;
// The copy on XLA's stream: capturable in XLA's command buffers, where the concurrent scheduling
// mode runs it beside the kernels that do not touch the rings.
constexpr auto PrefetchExpertsInlineGpu = XFetchGpu<true>;

}  // namespace

}  // namespace jaxvt

#define JAXVT_HANDLER_GPU
#define JAXVT_HANDLER_FILE_PREFETCH
#include "handlers/define.h"  // JaxvtStemGpu for the table's PREFETCH ops
