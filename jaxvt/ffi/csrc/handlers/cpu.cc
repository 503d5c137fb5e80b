// XLA FFI handlers for platform "cpu" of the op table's MAIN ops (ops.inc: operands, results and
// attributes). Buffers are host memory here, so the handler reads the layer index, fmts and table
// itself and calls the CPU kernels (kernels_cpu.h).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "common/act.h"
#include "common/attn.h"
#include "common/expert_cache.h"
#include "common/formats.h"
#include "common/gdn.h"
#include "common/prefetch.h"
#include "common/route.h"
#include "handlers/context.h"
#include "handlers/handlers.h"
#include "handlers/steps.h"
#include "kernels/cpu/kernels_cpu.h"
#include "kernels/cpu/kernels_cpu_ggml.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jaxvt {
namespace {

struct Layer {
  const uint8_t* base;
  int fmt;
};

ffi::ErrorOr<Layer> GetLayer(const ffi::AnyBuffer& data, const ffi::Buffer<ffi::U32>& table,
                             const ffi::Buffer<ffi::S32>& fmts, const ffi::Buffer<ffi::S32>& layer,
                             int64_t cols) {
  auto dd = data.dimensions();
  const int64_t stride = dd.size() == 2 ? dd[1] : 0;
  const int64_t n_layers = static_cast<int64_t>(fmts.element_count());
  if (n_layers <= 0 || static_cast<int64_t>(table.element_count()) != 2 * n_layers)
    return ffi::Unexpected(ffi::Error::InvalidArgument("jaxvt: table must be uint32 [L, 2], fmts int32 [L]"));
  LayerRef r = resolve_layer(static_cast<const uint8_t*>(data.untyped_data()), stride,
                             table.typed_data(), fmts.typed_data(), n_layers, layer.typed_data()[0]);
  if (!fmt_supported(r.fmt) || cols % kblock_elems(r.fmt) != 0)
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        "jaxvt: layer format " + std::to_string(r.fmt) + " with " + std::to_string(cols) +
        " columns is not supported by the CPU kernels"));
  return Layer{r.base, r.fmt};
}

// Partial sums of each activation row (what the factored dot products need).
struct XSums {
  std::vector<float> s16, s32;
  std::vector<const float*> p16, p32;
  XSums(const float* x, int64_t n, int64_t cols) : s16(n * cols / 16), s32(n * cols / 32), p16(n), p32(n) {
    for (int64_t i = 0; i < n; ++i) {
      p16[i] = s16.data() + i * (cols / 16);
      p32[i] = s32.data() + i * (cols / 32);
      cpu::x_sums(x + i * cols, cols, s16.data() + i * (cols / 16), s32.data() + i * (cols / 32));
    }
  }
};

// Splits `rows` output rows of `groups` independent products into tasks of at least 16 rows,
// about 4 per thread in all; small products run as one task (no thread hand-off).
int64_t RowsPerTask(int64_t rows, int64_t groups, int64_t bytes_per_group, int64_t batch) {
  if (bytes_per_group * groups * std::max<int64_t>(batch, 1) < (48 << 10)) return rows;
  const int64_t want = 4 * cpu::num_threads();
  int64_t per = (rows * groups + want - 1) / want;
  per = (per + 15) / 16 * 16;
  return std::clamp<int64_t>(per, 16, rows);
}

ffi::Error QMatmulCpu(NoStream, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                      ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                      ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y, int64_t rows,
                      int64_t cols) {
  auto lr = GetLayer(data, table, fmts, layer, cols);
  if (lr.has_error()) return lr.error();
  const Layer L = lr.value();
  const int64_t n = static_cast<int64_t>(x.element_count()) / cols;
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  XSums xs(xp, n, cols);
  std::vector<const float*> xr(n);
  std::vector<float*> yr(n);
  for (int64_t i = 0; i < n; ++i) {
    xr[i] = xp + i * cols;
    yr[i] = yp + i * rows;
  }
  cpu::Batch bt{n, xr.data(), xs.p16.data(), xs.p32.data(), yr.data()};
  const int64_t per = RowsPerTask(rows, 1, rows * row_bytes(L.fmt, cols), n);
  auto task = [&](int64_t t) {
    cpu::gemv_rows(L.fmt, L.base, cols, bt, t * per, std::min(rows, (t + 1) * per));
  };
  cpu::parallel_for((rows + per - 1) / per, task);
  return ffi::Error::Success();
}

// ggml mode (act.h): the activation rows converted to the layer format's vec-dot type into the
// scratch result `act` ([n, >= act_row_bytes] uint8), in parallel over rows for large batches.
std::vector<const uint8_t*> QuantizeRows(const float* x, int64_t n, int64_t cols, int fmt,
                                         ffi::ResultBuffer<ffi::U8>& act) {
  const int vt = vec_type(fmt);
  auto ad = act->dimensions();
  const int64_t stride = ad.size() == 2 ? ad[1] : 0;
  uint8_t* base = act->typed_data();
  std::vector<const uint8_t*> rows(n);
  for (int64_t i = 0; i < n; ++i) rows[i] = base + i * stride;
  auto task = [&](int64_t i) { quantize_act(vt, x + i * cols, 0, cols, base + i * stride); };
  if (n * cols < (1 << 16)) {
    for (int64_t i = 0; i < n; ++i) task(i);
  } else {
    cpu::parallel_for(n, task);
  }
  return rows;
}

ffi::Error CheckScratch(ffi::ResultBuffer<ffi::U8>& act, int64_t n, int64_t cols, int fmt) {
  auto ad = act->dimensions();
  if (ad.size() != 2 || ad[0] < n || ad[1] < act_row_bytes(vec_type(fmt), cols))
    return ffi::Error::InvalidArgument("jaxvt: the activation scratch is too small");
  return ffi::Error::Success();
}

// x: n rows of cols.
ffi::Error MatmulQ8(const float* x, int64_t n, const ffi::AnyBuffer& data,
                    const ffi::Buffer<ffi::U32>& table, const ffi::Buffer<ffi::S32>& fmts,
                    const ffi::Buffer<ffi::S32>& layer, ffi::ResultBuffer<ffi::F32>& y,
                    ffi::ResultBuffer<ffi::U8>& act, int64_t rows, int64_t cols) {
  auto lr = GetLayer(data, table, fmts, layer, cols);
  if (lr.has_error()) return lr.error();
  const Layer L = lr.value();
  if (auto e = CheckScratch(act, n, cols, L.fmt); !e.success()) return e;
  std::vector<const uint8_t*> ar = QuantizeRows(x, n, cols, L.fmt, act);
  float* yp = y->typed_data();
  std::vector<float*> yr(n);
  for (int64_t i = 0; i < n; ++i) yr[i] = yp + i * rows;
  cpu::QBatch bt{n, ar.data(), yr.data()};
  const int64_t per = RowsPerTask(rows, 1, rows * row_bytes(L.fmt, cols), n);
  auto task = [&](int64_t t) {
    cpu::gemv_q8_rows(L.fmt, L.base, cols, bt, t * per, std::min(rows, (t + 1) * per));
  };
  cpu::parallel_for((rows + per - 1) / per, task);
  return ffi::Error::Success();
}

ffi::Error QMatmulQ8Cpu(NoStream, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                        ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                        ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> y,
                        ffi::ResultBuffer<ffi::U8> act, int64_t rows, int64_t cols) {
  return MatmulQ8(x.typed_data(), static_cast<int64_t>(x.element_count()) / cols, data, table,
                  fmts, layer, y, act, rows, cols);
}

// swiglu(g, u) (jaxvt_swiglu's arithmetic) as a product's input rows; n rows of cols each.
ffi::ErrorOr<std::vector<float>> SwigluRows(const ffi::Buffer<ffi::F32>& g,
                                            const ffi::Buffer<ffi::F32>& u, int64_t cols) {
  if (g.element_count() != u.element_count() || g.element_count() % cols != 0)
    return ffi::Unexpected(
        ffi::Error::InvalidArgument("jaxvt swiglu product: g and u must both be [..., cols]"));
  const int64_t n = static_cast<int64_t>(g.element_count()) / cols;
  std::vector<float> h(g.element_count());
  if (n > 0) cpu::ggml::swiglu(g.typed_data(), u.typed_data(), n, cols, h.data());
  return h;
}

ffi::Error SwigluQMatmulQ8Cpu(NoStream, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u,
                              ffi::AnyBuffer data, ffi::Buffer<ffi::U32> table,
                              ffi::Buffer<ffi::S32> fmts, ffi::Buffer<ffi::S32> layer,
                              ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::U8> act,
                              int64_t rows, int64_t cols) {
  auto h = SwigluRows(g, u, cols);
  if (h.has_error()) return h.error();
  return MatmulQ8(h.value().data(), static_cast<int64_t>(h.value().size()) / cols, data, table,
                  fmts, layer, y, act, rows, cols);
}

// Groups the slots of ids [S] by expert (first-appearance order; ids above range clamped into
// it). A negative id routes its slot nowhere: its output row is zeroed here and nothing is read
// for it (a sharded MoE marks the slots of other devices' experts so).
struct ExpertGroups {
  std::vector<int32_t> expert_of_group;
  std::vector<std::vector<int32_t>> slots;
  ExpertGroups(const int32_t* idp, int64_t S, int64_t experts, float* y, int64_t rows) {
    const int32_t emax = static_cast<int32_t>(std::max<int64_t>(experts, 1) - 1);
    std::vector<int32_t> group_of_expert(emax + 1, -1);
    for (int64_t s = 0; s < S; ++s) {
      if (idp[s] < 0) {
        std::fill(y + s * rows, y + (s + 1) * rows, 0.f);
        continue;
      }
      const int32_t e = std::min<int32_t>(idp[s], emax);
      if (group_of_expert[e] < 0) {
        group_of_expert[e] = static_cast<int32_t>(expert_of_group.size());
        expert_of_group.push_back(e);
        slots.emplace_back();
      }
      slots[group_of_expert[e]].push_back(static_cast<int32_t>(s));
    }
  }
};

// The expert cache's operands of a call (expert_cache.h): the decisions, the stack's cache
// table, a slot's bytes. `where` nullptr: no cache.
struct CacheArgs {
  const int32_t* where = nullptr;
  const uint32_t* ctab = nullptr;
  int64_t n_layers = 0;
  int64_t cslot = 0;
};

// Where each group's expert of layer `layer` is read: base + e * mat_bytes, from the expert
// cache's slot (a hit; a fill first copies the expert's bytes there, so it reads the slot too), or
// from a decode expert ring (prefetch.h) that holds it, complete, for that layer (ops run in
// order here, so a fetch's copy is done). first_slot[g]: a slot of the call routed to group g.
std::vector<const uint8_t*> ExpertBases(const std::optional<ffi::Buffer<ffi::U8>>& ring,
                                        const ffi::Buffer<ffi::S32>& layer,
                                        const std::vector<int32_t>& experts,
                                        const std::vector<int32_t>& first_slot,
                                        const uint8_t* base, int64_t mat_bytes,
                                        const CacheArgs& cache) {
  std::vector<const uint8_t*> out(experts.size());
  const int32_t l = layer.typed_data()[0];
  const auto* h =
      ring.has_value() && static_cast<int64_t>(ring->element_count()) >= prefetch::kXHeader
          ? reinterpret_cast<const prefetch::XHeader*>(ring->typed_data())
          : nullptr;
  uint8_t* part = cache.where ? xcache::entry<uint8_t>(cache.ctab, cache.n_layers, l) : nullptr;
  for (size_t g = 0; g < experts.size(); ++g) {
    out[g] = base + static_cast<int64_t>(experts[g]) * mat_bytes;
    const int j = h ? prefetch::expert_slot(h, l, experts[g]) : -1;
    if (j >= 0 && h->tag[j] == h->seq)
      out[g] = ring->typed_data() + prefetch::kXHeader + j * h->slot;
    const int32_t wj = part ? cache.where[first_slot[g]] : -1;
    if (wj >= 0) {
      out[g] = part + wj * cache.cslot;
    } else if (wj <= -2) {
      uint8_t* dst = part + (-wj - 2) * cache.cslot;
      std::memcpy(dst, out[g], static_cast<size_t>(mat_bytes));
      out[g] = dst;
    }
  }
  return out;
}

// Each distinct routed expert of `ids` is read once, for all the slots routed to it: the slots
// grouped by expert (ExpertGroups), `assign(pos, s, xi)` fills position pos of the caller's batch
// arrays for slot s (activation row xi: the slot's token, or the slot itself when x holds one row
// per slot), `batch(start, n)` makes the batch of positions [start, start + n), and
// `gemv(base, batch, r0, r1)` runs rows [r0, r1) of one expert; the tasks run in parallel.
template <typename B, typename Assign, typename MakeBatch, typename Gemv>
ffi::Error RunExperts(const Layer& L, const ffi::Buffer<ffi::S32>& ids,
                      const std::optional<ffi::Buffer<ffi::U8>>& ring,
                      const ffi::Buffer<ffi::S32>& layer, int64_t nx, float* yp, int64_t rows,
                      int64_t cols, int64_t experts, const CacheArgs& cache, Assign assign,
                      MakeBatch batch, Gemv gemv) {
  const int64_t S = static_cast<int64_t>(ids.element_count());
  auto id_dims = ids.dimensions();
  const int64_t k = id_dims.size() >= 1 ? id_dims.back() : 1;
  const bool per_slot = nx == S;
  const int64_t mat_bytes = rows * row_bytes(L.fmt, cols);
  ExpertGroups eg(ids.typed_data(), S, experts, yp, rows);
  const int64_t G = static_cast<int64_t>(eg.expert_of_group.size());
  std::vector<B> batches(G);
  int64_t pos = 0;
  for (int64_t g = 0; g < G; ++g) {
    const int64_t start = pos;
    for (int32_t s : eg.slots[g]) assign(pos++, s, per_slot ? s : s / k);
    batches[g] = batch(start, pos - start);
  }
  const int64_t per = RowsPerTask(rows, G, mat_bytes, S / std::max<int64_t>(G, 1));
  const int64_t tpg = (rows + per - 1) / per;
  if (cache.where && mat_bytes > cache.cslot &&
      xcache::entry<uint8_t>(cache.ctab, cache.n_layers, layer.typed_data()[0]) != nullptr)
    return ffi::Error::InvalidArgument("jaxvt: an expert does not fit the expert cache's slot");
  std::vector<int32_t> first(G);
  for (int64_t g = 0; g < G; ++g) first[g] = eg.slots[g][0];
  const auto bases =
      ExpertBases(ring, layer, eg.expert_of_group, first, L.base, mat_bytes, cache);
  auto task = [&](int64_t t) {
    const int64_t g = t / tpg, c = t % tpg;
    gemv(bases[g], batches[g], c * per, std::min(rows, (c + 1) * per));
  };
  cpu::parallel_for(G * tpg, task);
  return ffi::Error::Success();
}

// x: nx rows of cols (one per token, or one per slot).
ffi::Error ExpertsQ8(const float* x, int64_t nx, const ffi::AnyBuffer& data,
                     const ffi::Buffer<ffi::U32>& table, const ffi::Buffer<ffi::S32>& fmts,
                     const ffi::Buffer<ffi::S32>& layer, const ffi::Buffer<ffi::S32>& ids,
                     const std::optional<ffi::Buffer<ffi::U8>>& ring, const CacheArgs& cache,
                     ffi::ResultBuffer<ffi::F32>& y, ffi::ResultBuffer<ffi::U8>& act,
                     int64_t rows, int64_t cols, int64_t experts) {
  auto lr = GetLayer(data, table, fmts, layer, cols);
  if (lr.has_error()) return lr.error();
  const Layer L = lr.value();
  if (auto e = CheckScratch(act, nx, cols, L.fmt); !e.success()) return e;
  std::vector<const uint8_t*> xa = QuantizeRows(x, nx, cols, L.fmt, act);
  float* yp = y->typed_data();
  std::vector<const uint8_t*> ar(ids.element_count());
  std::vector<float*> yr(ids.element_count());
  return RunExperts<cpu::QBatch>(
      L, ids, ring, layer, nx, yp, rows, cols, experts, cache,
      [&](int64_t p, int32_t s, int64_t xi) {
        ar[p] = xa[xi];
        yr[p] = yp + s * rows;
      },
      [&](int64_t start, int64_t n) {
        return cpu::QBatch{n, ar.data() + start, yr.data() + start};
      },
      [&](const uint8_t* base, const cpu::QBatch& b, int64_t r0, int64_t r1) {
        cpu::gemv_q8_rows(L.fmt, base, cols, b, r0, r1);
      });
}

// x: [T, cols] (one row per token) or [T, k, cols] (one per routed slot); ids [T, k].
ffi::Error ExpertsF32(const ffi::Buffer<ffi::F32>& x, const ffi::AnyBuffer& data,
                      const ffi::Buffer<ffi::U32>& table, const ffi::Buffer<ffi::S32>& fmts,
                      const ffi::Buffer<ffi::S32>& layer, const ffi::Buffer<ffi::S32>& ids,
                      const std::optional<ffi::Buffer<ffi::U8>>& ring, const CacheArgs& cache,
                      ffi::ResultBuffer<ffi::F32>& y, int64_t rows, int64_t cols,
                      int64_t experts) {
  auto lr = GetLayer(data, table, fmts, layer, cols);
  if (lr.has_error()) return lr.error();
  const Layer L = lr.value();
  const int64_t nx = static_cast<int64_t>(x.element_count()) / cols;  // T or S
  const float* xp = x.typed_data();
  float* yp = y->typed_data();
  XSums xs(xp, nx, cols);
  const size_t S = ids.element_count();
  std::vector<const float*> xr(S), s16(S), s32(S);
  std::vector<float*> yr(S);
  return RunExperts<cpu::Batch>(
      L, ids, ring, layer, nx, yp, rows, cols, experts, cache,
      [&](int64_t p, int32_t s, int64_t xi) {
        xr[p] = xp + xi * cols;
        s16[p] = xs.p16[xi];
        s32[p] = xs.p32[xi];
        yr[p] = yp + s * rows;
      },
      [&](int64_t start, int64_t n) {
        return cpu::Batch{n, xr.data() + start, s16.data() + start, s32.data() + start,
                          yr.data() + start};
      },
      [&](const uint8_t* base, const cpu::Batch& b, int64_t r0, int64_t r1) {
        cpu::gemv_rows(L.fmt, base, cols, b, r0, r1);
      });
}

ffi::Error QMatmulExpertsCpu(NoStream, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                             ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                             std::optional<ffi::Buffer<ffi::U8>> ring,
                             ffi::ResultBuffer<ffi::F32> y, int64_t rows, int64_t cols,
                             int64_t experts) {
  return ExpertsF32(x, data, table, fmts, layer, ids, ring, CacheArgs{}, y, rows, cols, experts);
}

ffi::Error QMatmulExpertsQ8Cpu(NoStream, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                               ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                               ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                               std::optional<ffi::Buffer<ffi::U8>> ring,
                               ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::U8> act,
                               int64_t rows, int64_t cols, int64_t experts) {
  return ExpertsQ8(x.typed_data(), static_cast<int64_t>(x.element_count()) / cols, data, table,
                   fmts, layer, ids, ring, CacheArgs{}, y, act, rows, cols, experts);
}

ffi::Error SwigluExpertsQ8Cpu(NoStream, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u,
                              ffi::AnyBuffer data, ffi::Buffer<ffi::U32> table,
                              ffi::Buffer<ffi::S32> fmts, ffi::Buffer<ffi::S32> layer,
                              ffi::Buffer<ffi::S32> ids, std::optional<ffi::Buffer<ffi::U8>> ring,
                              ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::U8> act,
                              int64_t rows, int64_t cols, int64_t experts) {
  auto h = SwigluRows(g, u, cols);
  if (h.has_error()) return h.error();
  return ExpertsQ8(h.value().data(), static_cast<int64_t>(h.value().size()) / cols, data, table,
                   fmts, layer, ids, ring, CacheArgs{}, y, act, rows, cols, experts);
}

CacheArgs CacheOf(const ffi::Buffer<ffi::S32>& ids, const ffi::Buffer<ffi::S32>& where,
                  const ffi::Buffer<ffi::U32>& ctab, int64_t cslot) {
  if (where.element_count() != ids.element_count()) return CacheArgs{};
  return CacheArgs{where.typed_data(), ctab.typed_data(),
                   static_cast<int64_t>(ctab.element_count()) / 2, cslot};
}

ffi::Error QMatmulExpertsCachedCpu(NoStream, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                                   ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                                   ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                                   ffi::Buffer<ffi::S32> where, ffi::Buffer<ffi::U32> ctab,
                                   std::optional<ffi::Buffer<ffi::U8>> ring,
                                   ffi::ResultBuffer<ffi::F32> y, int64_t rows, int64_t cols,
                                   int64_t experts, int64_t cslot) {
  return ExpertsF32(x, data, table, fmts, layer, ids, ring, CacheOf(ids, where, ctab, cslot), y,
                    rows, cols, experts);
}

ffi::Error QMatmulExpertsCachedQ8Cpu(NoStream, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer data,
                                     ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                                     ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> ids,
                                     ffi::Buffer<ffi::S32> where, ffi::Buffer<ffi::U32> ctab,
                                     std::optional<ffi::Buffer<ffi::U8>> ring,
                                     ffi::ResultBuffer<ffi::F32> y,
                                     ffi::ResultBuffer<ffi::U8> act, int64_t rows, int64_t cols,
                                     int64_t experts, int64_t cslot) {
  return ExpertsQ8(x.typed_data(), static_cast<int64_t>(x.element_count()) / cols, data, table,
                   fmts, layer, ids, ring, CacheOf(ids, where, ctab, cslot), y, act, rows, cols,
                   experts);
}

ffi::Error SwigluExpertsCachedQ8Cpu(NoStream, ffi::Buffer<ffi::F32> g, ffi::Buffer<ffi::F32> u,
                                    ffi::AnyBuffer data, ffi::Buffer<ffi::U32> table,
                                    ffi::Buffer<ffi::S32> fmts, ffi::Buffer<ffi::S32> layer,
                                    ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> where,
                                    ffi::Buffer<ffi::U32> ctab,
                                    std::optional<ffi::Buffer<ffi::U8>> ring,
                                    ffi::ResultBuffer<ffi::F32> y, ffi::ResultBuffer<ffi::U8> act,
                                    int64_t rows, int64_t cols, int64_t experts, int64_t cslot) {
  auto h = SwigluRows(g, u, cols);
  if (h.has_error()) return h.error();
  return ExpertsQ8(h.value().data(), static_cast<int64_t>(h.value().size()) / cols, data, table,
                   fmts, layer, ids, ring, CacheOf(ids, where, ctab, cslot), y, act, rows, cols,
                   experts);
}

// The expert cache's decision (expert_cache.h: xcache::assign_layer).
ffi::Error ExpertCacheAssignCpu(NoStream, ffi::Buffer<ffi::S32> ids, ffi::Buffer<ffi::S32> layer,
                                ffi::Buffer<ffi::U32> stab, ffi::ResultBuffer<ffi::S32> where) {
  const int64_t n = static_cast<int64_t>(ids.element_count());
  int32_t* wp = where->typed_data();
  auto* h = xcache::entry<xcache::Header>(stab.typed_data(),
                                          static_cast<int64_t>(stab.element_count()) / 2,
                                          layer.typed_data()[0]);
  if (h == nullptr) {
    std::fill(wp, wp + n, -1);
    return ffi::Error::Success();
  }
  if (const char* bad = xcache::check_header(h))
    return ffi::Error::InvalidArgument(std::string("jaxvt expert_cache_assign: ") + bad);
  if (n > xcache::kMaxCallSlots)
    return ffi::Error::InvalidArgument("jaxvt expert_cache_assign: at most 1024 routed slots");
  std::vector<int32_t> scratch(n + 3 * static_cast<int64_t>(h->slots));
  xcache::assign_layer(h, ids.typed_data(), n, wp, scratch.data());
  return ffi::Error::Success();
}

ffi::Error QEmbedCpu(NoStream, ffi::Buffer<ffi::S32> ids, ffi::AnyBuffer data,
                     ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                     ffi::Buffer<ffi::S32> layer, ffi::ResultBuffer<ffi::F32> out, int64_t rows,
                     int64_t cols) {
  auto lr = GetLayer(data, table, fmts, layer, cols);
  if (lr.has_error()) return lr.error();
  const Layer L = lr.value();
  const int64_t n = static_cast<int64_t>(ids.element_count());
  const int32_t* idp = ids.typed_data();
  float* op = out->typed_data();
  auto task = [&](int64_t i) {
    const int64_t r = std::clamp<int64_t>(idp[i], 0, rows - 1);
    cpu::dequant_rows_f32(L.fmt, L.base, cols, r, r + 1, op + i * cols);
  };
  if (n * cols < (1 << 16)) {
    for (int64_t i = 0; i < n; ++i) task(i);
  } else {
    cpu::parallel_for(n, task);
  }
  return ffi::Error::Success();
}

ffi::Error QDequantCpu(NoStream, ffi::AnyBuffer data, ffi::Buffer<ffi::U32> table,
                       ffi::Buffer<ffi::S32> fmts, ffi::Buffer<ffi::S32> layer,
                       ffi::ResultBuffer<ffi::BF16> out, int64_t rows, int64_t cols,
                       int64_t experts) {
  auto lr = GetLayer(data, table, fmts, layer, cols);
  if (lr.has_error()) return lr.error();
  const Layer L = lr.value();
  const int64_t total = rows * std::max<int64_t>(experts, 1);
  uint16_t* op = reinterpret_cast<uint16_t*>(out->untyped_data());
  const int64_t per = RowsPerTask(total, 1, total * row_bytes(L.fmt, cols), 1);
  auto task = [&](int64_t t) {
    const int64_t r0 = t * per, r1 = std::min(total, r0 + per);
    cpu::dequant_rows_bf16(L.fmt, L.base, cols, r0, r1, op + r0 * cols);
  };
  cpu::parallel_for((total + per - 1) / per, task);
  return ffi::Error::Success();
}

// The grouped-experts contract (kernels_gpu_grouped.cu): x bf16 [T or S, cols]; order int32 [S]
// lists the slots sorted by expert, offsets int32 [E' + 1] (E' = max(experts, 1)) where each
// expert's run starts; y[order[p]] = W_e x_slot for p in expert e's run, with bf16-rounded weights
// and float32 sums (cpu::gemm_bf16_rows); positions from offsets[E'] on are routed nowhere (zero
// rows, nothing read).
ffi::Error QMatmulGroupedCpu(NoStream, ffi::Buffer<ffi::BF16> x, ffi::AnyBuffer data,
                             ffi::Buffer<ffi::U32> table, ffi::Buffer<ffi::S32> fmts,
                             ffi::Buffer<ffi::S32> layer, ffi::Buffer<ffi::S32> order,
                             ffi::Buffer<ffi::S32> offsets, ffi::ResultBuffer<ffi::F32> y,
                             int64_t rows, int64_t cols, int64_t experts) {
  auto lr = GetLayer(data, table, fmts, layer, cols);
  if (lr.has_error()) return lr.error();
  const Layer L = lr.value();
  const int64_t S = static_cast<int64_t>(order.element_count());
  const int64_t nx = static_cast<int64_t>(x.element_count()) / cols;
  const int64_t G = std::max<int64_t>(experts, 1);
  const int32_t* op = order.typed_data();
  const int32_t* off = offsets.typed_data();
  if (static_cast<int64_t>(offsets.element_count()) != G + 1 || nx < 1 || S % nx)
    return ffi::Error::InvalidArgument("jaxvt qmatmul_grouped: offsets must be [experts + 1] and "
                                       "x one row per token or per slot");
  for (int64_t g = 0; g <= G; ++g)
    if (off[g] < (g ? off[g - 1] : 0) || off[g] > S)
      return ffi::Error::InvalidArgument("jaxvt qmatmul_grouped: offsets must rise within [0, S]");
  for (int64_t p = 0; p < S; ++p)
    if (op[p] < 0 || op[p] >= S)
      return ffi::Error::InvalidArgument("jaxvt qmatmul_grouped: order must index the slots");
  const int64_t x_div = S / nx;
  const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.untyped_data());
  std::vector<float> xf(nx * cols);
  for (int64_t i = 0; i < nx * cols; ++i) xf[i] = bf16_to_float(xb[i]);
  float* yp = y->typed_data();
  for (int64_t p = off[G]; p < S; ++p) std::fill(yp + op[p] * rows, yp + (op[p] + 1) * rows, 0.f);
  std::vector<const float*> xr(S);
  std::vector<float*> yr(S);
  for (int64_t p = 0; p < S; ++p) {
    xr[p] = xf.data() + op[p] / x_div * cols;
    yr[p] = yp + op[p] * rows;
  }
  const int64_t mat_bytes = rows * row_bytes(L.fmt, cols);
  const int64_t per = RowsPerTask(rows, G, mat_bytes, S / G + 1);
  const int64_t tpg = (rows + per - 1) / per;
  auto task = [&](int64_t t) {
    const int64_t g = t / tpg, c = t % tpg;
    if (off[g + 1] == off[g]) return;
    cpu::gemm_bf16_rows(L.fmt, L.base + g * mat_bytes, cols, off[g + 1] - off[g],
                        xr.data() + off[g], yr.data() + off[g], c * per,
                        std::min(rows, (c + 1) * per));
  };
  cpu::parallel_for(G * tpg, task);
  return ffi::Error::Success();
}

// The fused steps (steps.h) on the host: a copy is a memcpy, a kernel runs at once.
struct CpuSteps {
  using Stream = NoStream;
  static constexpr auto route = &cpu::moe_route;
  static constexpr auto norm = &cpu::add_norm;
  static constexpr auto gdn = &cpu::gdn_step;
  static constexpr auto attn = &cpu::attn_step;
  template <typename Kernel, typename... A>
  static ffi::Error run(Stream, const char*, Kernel kernel, const A&... a) {
    kernel(a...);
    return ffi::Error::Success();
  }
  static ffi::Error copy(Stream, void* dst, const void* src, size_t nbytes, const char*) {
    std::memcpy(dst, src, nbytes);
    return ffi::Error::Success();
  }
};
constexpr auto MoeRouteCpu = steps::MoeRoute<CpuSteps>;
constexpr auto AddNormCpu = steps::AddNorm<CpuSteps>;
constexpr auto GdnStepCpu = steps::GdnStep<CpuSteps>;
constexpr auto AttnStepCpu = steps::AttnStep<CpuSteps>;

}  // namespace
}  // namespace jaxvt

#define JAXVT_HANDLER_FILE_MAIN
#include "handlers/define.h"  // JaxvtStemCpu for the table's MAIN ops
