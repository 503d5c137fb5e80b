// The prefetch ops' operands as both platforms' handlers check and read them
// (handlers/cpu_prefetch.cc, handlers/gpu_prefetch.cu); for jaxvt_prefetch_experts: target, ids,
// after, then (ring, table, fmts) per stack, the rings coming back aliased. Host code only.
#ifndef JAXVT_FFI_CSRC_PREFETCH_FFI_H_
#define JAXVT_FFI_CSRC_PREFETCH_FFI_H_

#include <cstdint>
#include <string>

#include "common/prefetch.h"
#include "xla/ffi/api/ffi.h"

namespace jaxvt {
namespace prefetch {

constexpr int kXStacks = 4;

// One stack's operands: the ring (its operand and the aliased result) and the stack's table.
struct XOperand {
  const uint8_t* in;
  uint8_t* out;
  int64_t bytes;
  const uint32_t* table;
  const int32_t* fmts;
  int64_t n_layers, rows, cols, slot;
};

// A fetch's ring, table and fmts checked against its attributes (check, prefetch.h).
inline xla::ffi::Error check_fetch(const xla::ffi::Buffer<xla::ffi::U8>& ring,
                                   const xla::ffi::Buffer<xla::ffi::U32>& table,
                                   const xla::ffi::Buffer<xla::ffi::S32>& fmts, int64_t rows,
                                   int64_t cols, int64_t experts) {
  if (const char* e = check(static_cast<int64_t>(ring.element_count()),
                            static_cast<int64_t>(table.element_count()),
                            static_cast<int64_t>(fmts.element_count()), rows, cols, experts))
    return xla::ffi::Error::InvalidArgument(std::string("prefetch_fetch: ") + e);
  return xla::ffi::Error::Success();
}

// A take's ring, table and fmts checked against one another.
inline xla::ffi::Error check_take(const xla::ffi::Buffer<xla::ffi::U8>& ring,
                                  const xla::ffi::Buffer<xla::ffi::U32>& table,
                                  const xla::ffi::Buffer<xla::ffi::S32>& fmts) {
  if (table.element_count() != 2 * fmts.element_count() ||
      static_cast<int64_t>(ring.element_count()) <= kHeader)
    return xla::ffi::Error::InvalidArgument("prefetch_take: table must be [L, 2] for fmts [L]");
  return xla::ffi::Error::Success();
}

// Fills ops[0 .. *n) from the call's remaining operands and attributes; nullptr when they fit,
// else the problem.
inline const char* x_operands(xla::ffi::RemainingArgs& args, xla::ffi::RemainingRets& rets,
                              xla::ffi::Span<const int64_t> rows,
                              xla::ffi::Span<const int64_t> cols,
                              xla::ffi::Span<const int64_t> slot, XOperand* ops, int64_t* n) {
  namespace ffi = xla::ffi;
  *n = static_cast<int64_t>(rets.size());
  if (*n < 1 || *n > kXStacks || static_cast<int64_t>(args.size()) != 3 * *n ||
      static_cast<int64_t>(rows.size()) != *n || static_cast<int64_t>(cols.size()) != *n ||
      static_cast<int64_t>(slot.size()) != *n)
    return "1-4 stacks, (ring, table, fmts) each";
  for (int64_t i = 0; i < *n; ++i) {
    auto ring = args.get<ffi::Buffer<ffi::U8>>(3 * i);
    auto table = args.get<ffi::Buffer<ffi::U32>>(3 * i + 1);
    auto fmts = args.get<ffi::Buffer<ffi::S32>>(3 * i + 2);
    auto out = rets.get<ffi::Buffer<ffi::U8>>(i);
    if (!ring.has_value() || !table.has_value() || !fmts.has_value() || !out.has_value())
      return "bad operand types";
    const int64_t L = static_cast<int64_t>(fmts->element_count());
    const int64_t bytes = static_cast<int64_t>(ring->element_count());
    if (const char* e = check_experts(bytes, slot[i],
                                      static_cast<int64_t>(table->element_count()), L))
      return e;
    ops[i] = XOperand{ring->typed_data(), (*out)->typed_data(), bytes, table->typed_data(),
                      fmts->typed_data(), L, rows[i], cols[i], slot[i]};
  }
  return nullptr;
}

}  // namespace prefetch
}  // namespace jaxvt

#endif  // JAXVT_FFI_CSRC_PREFETCH_FFI_H_
