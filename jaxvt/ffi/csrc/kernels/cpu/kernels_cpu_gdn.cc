// The fused Gated DeltaNet decode step on the CPU (gdn.h has the math). Phase 1 (conv and the
// conv state's shift) in one loop; phase 2 one task per (row, value head), each summing in a
// fixed order (gdn_heads_impl.h, AVX2 where the CPU has it: the same bits), so the result does
// not depend on the thread count or on the other rows.
#include <cmath>
#include <cstdint>

#include "common/gdn.h"
#include "kernels/cpu/kernels_cpu.h"

namespace jaxvt::cpu {

namespace {
#include "kernels/cpu/gdn_heads_impl.h"
}  // namespace

void gdn_step(const gdn::Dims& d, const gdn::Args& a) {
  const gdn::Layer l = gdn::layer_of(d, a);
  for (int64_t r = 0; r < d.b; ++r)
    for (int64_t c = 0; c < d.conv_dim; ++c)
      a.conv_out[r * d.conv_dim + c] =
          gdn::conv_shift(d, a.mixed + r * d.conv_dim, l.conv_state + r * (d.K - 1) * d.conv_dim,
                          l.conv_w, c, a.valid[r] != 0);
  const bool wide = use_avx2();
  auto task = [&](int64_t t) {
#if defined(JAXVT_HAVE_AVX2_TU)
    if (wide) return avx2::gdn_heads_rows(d, a, l, t, t + 1);
#endif
    (void)wide;
    gdn_heads(d, a, l, t, t + 1);
  };
  parallel_for(d.b * d.nv, task);
}

}  // namespace jaxvt::cpu
