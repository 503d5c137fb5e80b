// The prefetch ops (prefetch.h) for platform "cpu": XLA:CPU runs a program's ops one after
// another on the host, so a fetch (of a layer, or of decode's predicted experts) copies at once
// and take never waits; the results are what the GPU's asynchronous copy gives.
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>

#include "common/prefetch.h"
#include "handlers/context.h"
#include "handlers/handlers.h"
#include "handlers/prefetch_ffi.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxvt {
namespace {

prefetch::Header* header(ffi::ResultBuffer<ffi::U8>& ring) {
  return reinterpret_cast<prefetch::Header*>(ring->typed_data() + ring->element_count() -
                                             prefetch::kHeader);
}

// XLA aliases the ring to the result; were it not to, the result starts as a copy of the operand.
void alias(const ffi::Buffer<ffi::U8>& ring, ffi::ResultBuffer<ffi::U8>& out) {
  if (out->typed_data() != ring.typed_data())
    std::memcpy(out->typed_data(), ring.typed_data(), ring.element_count());
}

ffi::Error PrefetchFetchCpu(NoStream, ffi::Buffer<ffi::U8> ring, ffi::Buffer<ffi::U32> table,
                            ffi::Buffer<ffi::S32> fmts, ffi::Buffer<ffi::S32> target,
                            ffi::AnyBuffer after, ffi::ResultBuffer<ffi::U8> out, int64_t rows,
                            int64_t cols, int64_t experts, int64_t first,
                            ffi::Span<const int32_t> schedule) {
  (void)after;  // the CPU runs ops in order; first / schedule: the GPU's reckoning on the host
  (void)first;
  (void)schedule;
  if (auto e = prefetch::check_fetch(ring, table, fmts, rows, cols, experts); e.failure()) return e;
  const int64_t n = static_cast<int64_t>(ring.element_count());
  const int64_t L = static_cast<int64_t>(fmts.element_count());
  alias(ring, out);
  const int32_t t = target.typed_data()[0];
  if (t < 0) return ffi::Error::Success();  // nothing asked: the ring keeps what it holds
  const prefetch::Source s = prefetch::source(table.typed_data(), fmts.typed_data(), L, t, rows,
                                              cols, experts, n - prefetch::kHeader);
  prefetch::Header* h = header(out);
  if (s.nbytes > 0) std::memcpy(out->typed_data(), s.src, static_cast<size_t>(s.nbytes));
  h->intent = h->tag = s.nbytes > 0 ? static_cast<uint32_t>(t + 1) : 0u;
  h->count = 0;
  return ffi::Error::Success();
}

ffi::Error PrefetchTakeCpu(NoStream, ffi::Buffer<ffi::U8> ring, ffi::Buffer<ffi::U32> table,
                           ffi::Buffer<ffi::S32> fmts, ffi::Buffer<ffi::S32> layer,
                           ffi::ResultBuffer<ffi::U8> out, ffi::ResultBuffer<ffi::U32> table2) {
  if (auto e = prefetch::check_take(ring, table, fmts); e.failure()) return e;
  const int64_t L = static_cast<int64_t>(fmts.element_count());
  alias(ring, out);
  std::memcpy(table2->typed_data(), table.typed_data(), table.size_bytes());
  int32_t l = layer.typed_data()[0];
  l = l < 0 ? 0 : (l >= L ? static_cast<int32_t>(L - 1) : l);  // as the kernels clamp it
  const prefetch::Header* h = header(out);
  const uint32_t want = static_cast<uint32_t>(l + 1);
  if (h->intent == want && h->tag == want && (fmts.typed_data()[l] & kHostBit)) {
    const uint64_t a = reinterpret_cast<uintptr_t>(out->typed_data());
    table2->typed_data()[2 * l] = static_cast<uint32_t>(a & 0xFFFFFFFFu);
    table2->typed_data()[2 * l + 1] = static_cast<uint32_t>(a >> 32);
  }
  return ffi::Error::Success();
}

ffi::Error PrefetchJoinCpu(NoStream, ffi::AnyBuffer x, ffi::Buffer<ffi::U8> ring,
                           ffi::Result<ffi::AnyBuffer> out) {
  (void)ring;
  if (out->untyped_data() != x.untyped_data())
    std::memcpy(out->untyped_data(), x.untyped_data(), x.size_bytes());
  return ffi::Error::Success();
}

// The decode expert ring's fetch (prefetch.h): the predicted experts copied at once.
ffi::Error PrefetchExpertsCpu(NoStream, ffi::Buffer<ffi::S32> target, ffi::Buffer<ffi::S32> ids,
                              ffi::AnyBuffer after, ffi::RemainingArgs args,
                              ffi::RemainingRets rets, ffi::Span<const int64_t> rows,
                              ffi::Span<const int64_t> cols, ffi::Span<const int64_t> slot,
                              int64_t experts, int64_t n_host, int64_t n_device, int64_t when,
                              int64_t blocks, int64_t scale) {
  (void)after;
  (void)blocks;  // the GPU's copy grid
  static std::atomic<uint32_t> counter{0};  // numbers the copies (any nonzero, distinct value)
  prefetch::XOperand ops[prefetch::kXStacks];
  int64_t n = 0;
  if (const char* e = prefetch::x_operands(args, rets, rows, cols, slot, ops, &n))
    return ffi::Error::InvalidArgument(std::string("prefetch_experts: ") + e);
  const int32_t t = target.typed_data()[0];
  const int64_t n_ids = static_cast<int64_t>(ids.element_count());
  uint32_t calls = ++counter;
  if (calls == 0) calls = ++counter;
  const int k = prefetch::host_stacks_at(ops, n, t);
  for (int64_t i = 0; i < n; ++i) {
    const prefetch::XOperand& o = ops[i];
    if (o.out != o.in) std::memcpy(o.out, o.in, static_cast<size_t>(o.bytes));
    uint8_t* r = o.out;
    auto* h = reinterpret_cast<prefetch::XHeader*>(r);
    int m = prefetch::expert_count(o.fmts, o.n_layers, t, n_host, n_device, when, scale, k);
    if (m < 0) continue;  // not this call's kind of target: the ring as it is
    if (m > n_ids) m = static_cast<int>(n_ids);
    h->seq = calls;
    h->layer = m > 0 ? t : -1;
    h->n = m;
    h->slot = o.slot;
    for (int j = 0; j < prefetch::kXSlotsMax; ++j) {
      const int32_t e = j < m ? ids.typed_data()[j] : -2;
      const prefetch::Source s = prefetch::expert_source(o.table, o.fmts, o.n_layers, t, e,
                                                         o.rows, o.cols, experts, o.slot);
      h->ids[j] = s.nbytes > 0 ? e : -2;
      h->tag[j] = s.nbytes > 0 ? calls : 0u;
      if (s.nbytes > 0)
        std::memcpy(r + prefetch::kXHeader + j * o.slot, s.src, static_cast<size_t>(s.nbytes));
    }
  }
  return ffi::Error::Success();
}

// One copy on a CPU: the inline form is the same call.
constexpr auto PrefetchExpertsInlineCpu = PrefetchExpertsCpu;

}  // namespace
}  // namespace jaxvt

#define JAXVT_HANDLER_FILE_PREFETCH
#include "handlers/define.h"  // JaxvtStemCpu for the table's PREFETCH ops
