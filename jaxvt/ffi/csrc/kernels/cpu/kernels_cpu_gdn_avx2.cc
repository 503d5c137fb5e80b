// gdn_heads_impl.h compiled for AVX2 (-mavx2 -mfma -mf16c -ffp-contract=off): the same
// operations on eight columns at a time, the same bits as the portable build. Called only after
// kernels_cpu.cc checked the CPU.
#include <cmath>
#include <cstdint>

#include "common/gdn.h"
#include "kernels/cpu/kernels_cpu.h"

namespace jaxvt::cpu::avx2 {
namespace {
#include "kernels/cpu/gdn_heads_impl.h"
}  // namespace

void gdn_heads_rows(const gdn::Dims& d, const gdn::Args& a, const gdn::Layer& l, int64_t t0,
                    int64_t t1) {
  gdn_heads(d, a, l, t0, t1);
}

}  // namespace jaxvt::cpu::avx2
