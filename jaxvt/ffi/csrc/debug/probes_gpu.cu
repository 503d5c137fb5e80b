// The debug module's GPU probes (debug/probes.h): link and kernel rates on the current device,
// each on buffers of its own.
#include <cstring>
#include <string>
#include <vector>

#include "common/vendor.h"
#include "debug/probes.h"
#include "kernels/gpu/kernels_gpu.h"
#include "memory/memory.h"
#include "memory/memory_gpu.h"

namespace jaxvt::gpu_mem {
namespace {

// Events, a stream and a sink word for timing; released on scope exit.
struct Timer {
  gpuStream_t s = nullptr;
  gpuEvent_t a = nullptr, b = nullptr;
  unsigned* sink = nullptr;
  bool ready = false;
  explicit Timer(std::string* err) {
    ready = ok(gpuStreamCreate(&s), "stream", err) && ok(gpuEventCreate(&a), "event", err) &&
            ok(gpuEventCreate(&b), "event", err) &&
            ok(gpuMalloc(reinterpret_cast<void**>(&sink), sizeof(unsigned)), "malloc", err);
  }
  ~Timer() {
    if (sink) (void)gpuFree(sink);
    if (a) (void)gpuEventDestroy(a);
    if (b) (void)gpuEventDestroy(b);
    if (s) (void)gpuStreamDestroy(s);
  }
  double ms() {
    float v = 0.f;
    (void)gpuEventElapsedTime(&v, a, b);
    return v;
  }
};

}  // namespace

double measure_dma_h2d(size_t nbytes, int iters, int kind, std::string* err) {
  Timer t(err);
  if (!t.ready) return -1;
  uintptr_t h = 0, hd = 0;
  if (!host_alloc(nbytes, true, kind, &h, &hd, err)) return -1;
  std::memset(reinterpret_cast<void*>(h), 1, nbytes);
  void* d = nullptr;
  double gbs = -1;
  if (ok(gpuMalloc(&d, nbytes), "device allocation", err)) {
    const void* src = reinterpret_cast<const void*>(h);
    bool good = ok(gpuMemcpyAsync(d, src, nbytes, gpuMemcpyHostToDevice, t.s), "copy", err) &&
                ok(gpuEventRecord(t.a, t.s), "event", err);
    for (int i = 0; good && i < iters; ++i)
      good = ok(gpuMemcpyAsync(d, src, nbytes, gpuMemcpyHostToDevice, t.s), "copy", err);
    good = good && ok(gpuEventRecord(t.b, t.s), "event", err) && ok(gpuEventSynchronize(t.b), "sync", err);
    if (good) gbs = static_cast<double>(nbytes) * iters / 1e6 / t.ms();
    (void)gpuFree(d);
  }
  host_free(h);
  return gbs;
}

double measure_zero_copy_read(size_t nbytes, int iters, bool coherent, int64_t blocks, int kind,
                              bool bulk, std::string* err) {
  Timer t(err);
  if (!t.ready) return -1;
  uintptr_t h = 0, hd = 0;
  if (!host_alloc(nbytes, coherent, kind, &h, &hd, err)) return -1;
  std::memset(reinterpret_cast<void*>(h), 1, nbytes);
  const int64_t n16 = static_cast<int64_t>(nbytes / 16);
  const void* p = reinterpret_cast<const void*>(hd);
  double gbs = -1;
  bool good = ok(gpu::launch_stream_read(t.s, p, n16, t.sink, blocks, bulk), "read kernel", err) &&
              ok(gpuEventRecord(t.a, t.s), "event", err);
  for (int i = 0; good && i < iters; ++i)
    good = ok(gpu::launch_stream_read(t.s, p, n16, t.sink, blocks, bulk), "read kernel", err);
  good = good && ok(gpuEventRecord(t.b, t.s), "event", err) && ok(gpuEventSynchronize(t.b), "sync", err);
  if (good) gbs = static_cast<double>(n16) * 16 * iters / 1e6 / t.ms();
  host_free(h);
  return gbs;
}

double measure_host_gemv(int fmt, int64_t rows, int64_t cols, int64_t row_bytes, int64_t batch,
                         int copies, int iters, int64_t grid_cap, int64_t waves, bool device_tier,
                         int kind, bool ggml, int64_t bulk, int l2, bool l2_only,
                         std::string* err) {
  gpu::Tuning tuning;
  tuning.grid_cap = grid_cap;
  tuning.bulk = bulk;
  tuning.waves = waves < 1 ? 1 : waves;
  Timer t(err);
  if (!t.ready || copies < 1) return -1;
  const size_t mat = static_cast<size_t>(rows * row_bytes);
  uintptr_t h = 0, hd = 0;
  void* dd = nullptr;  // device-tier copies
  if (!host_alloc(mat * copies, false, kind, &h, &hd, err)) return -1;
  std::memset(reinterpret_cast<void*>(h), 0x11, mat * copies);  // small valid scales, no NaN
  if (device_tier && !(ok(gpuMalloc(&dd, mat * copies), "device allocation", err) &&
                       ok(gpuMemcpyAsync(dd, reinterpret_cast<void*>(h), mat * copies,
                                         gpuMemcpyHostToDevice, t.s), "copy", err))) {
    if (dd) (void)gpuFree(dd);
    host_free(h);
    return -1;
  }
  std::vector<uint32_t> table(2 * copies);
  std::vector<int32_t> fmts(copies), layers(copies);
  for (int i = 0; i < copies; ++i) {
    const uint64_t a = device_tier ? static_cast<uint64_t>(i) : hd + mat * i;  // slot | address
    table[2 * i] = static_cast<uint32_t>(a);
    table[2 * i + 1] = static_cast<uint32_t>(a >> 32);
    fmts[i] = fmt | (device_tier ? 0 : (1 << 16));
    layers[i] = i;
  }
  void *dt = nullptr, *df = nullptr, *dl = nullptr, *dx = nullptr, *dy = nullptr;
  double gbs = -1;
  bool good = ok(gpuMalloc(&dt, table.size() * 4), "malloc", err) &&
              ok(gpuMalloc(&df, copies * 4), "malloc", err) &&
              ok(gpuMalloc(&dl, copies * 4), "malloc", err) &&
              ok(gpuMalloc(&dx, batch * cols * 4), "malloc", err) &&
              ok(gpuMalloc(&dy, batch * rows * 4), "malloc", err) &&
              ok(gpuMemcpyAsync(dt, table.data(), table.size() * 4, gpuMemcpyHostToDevice, t.s), "copy", err) &&
              ok(gpuMemcpyAsync(df, fmts.data(), copies * 4, gpuMemcpyHostToDevice, t.s), "copy", err) &&
              ok(gpuMemcpyAsync(dl, layers.data(), copies * 4, gpuMemcpyHostToDevice, t.s), "copy", err) &&
              ok(gpuMemsetAsync(dx, 0, batch * cols * 4, t.s), "memset", err);
  auto launch = [&](int i) {
    gpu::WeightArgs w{static_cast<const uint8_t*>(dd), static_cast<int64_t>(mat),
                      static_cast<const uint32_t*>(dt), static_cast<const int32_t*>(df), copies,
                      static_cast<const int32_t*>(dl) + (i % copies)};
    if (l2 >= 0) {
      gpu::WeightArgs ahead = w;
      ahead.layer = static_cast<const int32_t*>(dl) + ((i + l2) % copies);
      const gpuError_t e = gpu::launch_l2_prefetch(t.s, ahead, rows, cols);
      if (e != gpuSuccess || l2_only) return e;
    }
    return gpu::launch_qmatmul(t.s, w, static_cast<const float*>(dx), batch,
                               static_cast<float*>(dy), rows, cols, ggml, tuning);
  };
  for (int i = 0; good && i < copies; ++i) good = ok(launch(i), "qmatmul", err);
  good = good && ok(gpuEventRecord(t.a, t.s), "event", err);
  for (int i = 0; good && i < iters; ++i) good = ok(launch(i), "qmatmul", err);
  good = good && ok(gpuEventRecord(t.b, t.s), "event", err) && ok(gpuEventSynchronize(t.b), "sync", err);
  if (good) gbs = static_cast<double>(mat) * iters / 1e6 / t.ms();
  for (void* p : {dt, df, dl, dx, dy, dd})
    if (p) (void)gpuFree(p);
  host_free(h);
  return gbs;
}

bool matvec_outputs(int fmt, int64_t rows, int64_t cols, int64_t row_bytes, int64_t batch,
                    uintptr_t w, uintptr_t x, uintptr_t y, bool device_tier, bool ggml,
                    int64_t bulk, int64_t grid_cap, std::string* err) {
  gpu::Tuning tuning;
  tuning.grid_cap = grid_cap;
  tuning.bulk = bulk;
  Timer t(err);
  if (!t.ready) return false;
  const size_t mat = static_cast<size_t>(rows * row_bytes);
  uintptr_t h = 0, hd = 0;
  if (!host_alloc(mat + 64, false, 0, &h, &hd, err)) return false;
  std::memcpy(reinterpret_cast<void*>(h), reinterpret_cast<const void*>(w), mat);
  void *dd = nullptr, *dt = nullptr, *df = nullptr, *dl = nullptr, *dx = nullptr, *dy = nullptr;
  const uint64_t a = device_tier ? 0 : hd;  // slot 0 | the host address
  const uint32_t table[2] = {static_cast<uint32_t>(a), static_cast<uint32_t>(a >> 32)};
  const int32_t fm = fmt | (device_tier ? 0 : (1 << 16)), layer = 0;
  bool good = ok(gpuMalloc(&dd, mat + 64), "malloc", err) &&
              ok(gpuMalloc(&dt, sizeof table), "malloc", err) &&
              ok(gpuMalloc(&df, 4), "malloc", err) && ok(gpuMalloc(&dl, 4), "malloc", err) &&
              ok(gpuMalloc(&dx, batch * cols * 4), "malloc", err) &&
              ok(gpuMalloc(&dy, batch * rows * 4), "malloc", err) &&
              ok(gpuMemcpyAsync(dd, reinterpret_cast<void*>(h), mat, gpuMemcpyHostToDevice, t.s), "copy", err) &&
              ok(gpuMemcpyAsync(dt, table, sizeof table, gpuMemcpyHostToDevice, t.s), "copy", err) &&
              ok(gpuMemcpyAsync(df, &fm, 4, gpuMemcpyHostToDevice, t.s), "copy", err) &&
              ok(gpuMemcpyAsync(dl, &layer, 4, gpuMemcpyHostToDevice, t.s), "copy", err) &&
              ok(gpuMemcpyAsync(dx, reinterpret_cast<const void*>(x), batch * cols * 4,
                                gpuMemcpyHostToDevice, t.s), "copy", err);
  if (good) {
    gpu::WeightArgs wa{static_cast<const uint8_t*>(dd), static_cast<int64_t>(mat + 64),
                       static_cast<const uint32_t*>(dt), static_cast<const int32_t*>(df), 1,
                       static_cast<const int32_t*>(dl)};
    good = ok(gpu::launch_qmatmul(t.s, wa, static_cast<const float*>(dx), batch,
                                  static_cast<float*>(dy), rows, cols, ggml, tuning), "qmatmul", err) &&
           ok(gpuMemcpyAsync(reinterpret_cast<void*>(y), dy, batch * rows * 4,
                             gpuMemcpyDefault, t.s), "copy", err) &&
           ok(gpuStreamSynchronize(t.s), "sync", err);
  }
  for (void* p : {dd, dt, df, dl, dx, dy})
    if (p) (void)gpuFree(p);
  host_free(h);
  return good;
}

bool measure_managed(size_t nbytes, double* first, double* repeat, std::string* err) {
  uintptr_t m = 0;
  if (!managed_alloc(nbytes, &m, err)) return false;
  Timer t(err);
  bool good = t.ready;
  if (good) {
    std::memset(reinterpret_cast<void*>(m), 1, nbytes);  // host touch: pages start on the host
    const int64_t n16 = static_cast<int64_t>(nbytes / 16);
    const void* p = reinterpret_cast<const void*>(m);
    double v[2] = {0, 0};
    for (int i = 0; good && i < 2; ++i) {
      good = ok(gpuEventRecord(t.a, t.s), "event", err) &&
             ok(gpu::launch_stream_read(t.s, p, n16, t.sink), "read kernel", err) &&
             ok(gpuEventRecord(t.b, t.s), "event", err) && ok(gpuEventSynchronize(t.b), "sync", err);
      if (good) v[i] = static_cast<double>(n16) * 16 / 1e6 / t.ms();
    }
    *first = v[0];
    *repeat = v[1];
  }
  managed_free(m);
  return good;
}

}  // namespace jaxvt::gpu_mem
