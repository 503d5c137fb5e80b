// nanobind module jaxvt.ffi._jaxvt_debug: measurement entry points for benchmarks, tests and the
// planner's probe (jaxvt.offload.probe), apart from the product's module (module.cc). Each
// measures on buffers of its own (host memory, pinned host memory, device memory); none changes
// how the product's ops run.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "common/formats.h"
#include "kernels/cpu/kernels_cpu.h"
#include "memory/memory.h"
#if defined(JAXVT_WITH_GPU)
#include "debug/probes.h"
#endif

namespace nb = nanobind;

namespace {

constexpr size_t kPage = 4096;

bool UseGpu() {
#if defined(JAXVT_WITH_GPU)
  return jaxvt::gpu_mem::device_count() > 0;
#else
  return false;
#endif
}

// ---- measurement primitives (GB/s = 1e9 bytes/s) -----------------------------------------------

double Seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

struct HostBuf {
  void* p;
  explicit HostBuf(size_t n) : p(std::aligned_alloc(kPage, (n + kPage - 1) / kPage * kPage)) {
    if (!p) throw std::runtime_error("out of host memory");
    std::memset(p, 1, n);
  }
  ~HostBuf() { std::free(p); }
};

double CpuCopy(size_t nbytes, int iters) {
  HostBuf a(nbytes), b(nbytes);
  std::memcpy(b.p, a.p, nbytes);
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) std::memcpy(b.p, a.p, nbytes);
  return static_cast<double>(nbytes) * iters / 1e9 / Seconds(std::chrono::steady_clock::now() - t0);
}

double CpuRead(size_t nbytes, int iters) {
  HostBuf a(nbytes);
  const uint64_t* p = static_cast<const uint64_t*>(a.p);
  const size_t n = nbytes / 8;
  volatile uint64_t sink = 0;
  auto t0 = std::chrono::steady_clock::now();
  for (int it = 0; it < iters; ++it) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 4 <= n; i += 4) {
      s0 ^= p[i];
      s1 ^= p[i + 1];
      s2 ^= p[i + 2];
      s3 ^= p[i + 3];
    }
    for (; i < n; ++i) s0 ^= p[i];
    sink = sink + (s0 ^ s1 ^ s2 ^ s3);
  }
  return static_cast<double>(n) * 8 * iters / 1e9 / Seconds(std::chrono::steady_clock::now() - t0);
}

double MeasureDmaH2D(size_t nbytes, int iters, int kind) {
  if (iters < 1) iters = 1;
#if defined(JAXVT_WITH_GPU)
  if (UseGpu()) {
    std::string err;
    double v = jaxvt::gpu_mem::measure_dma_h2d(nbytes, iters, kind, &err);
    if (v < 0) throw std::runtime_error(err);
    return v;
  }
#endif
  return CpuCopy(nbytes, iters);
}

double MeasureZeroCopyRead(size_t nbytes, int iters, bool coherent, int64_t blocks, int kind,
                           bool bulk) {
  if (iters < 1) iters = 1;
#if defined(JAXVT_WITH_GPU)
  if (UseGpu()) {
    std::string err;
    double v = jaxvt::gpu_mem::measure_zero_copy_read(nbytes, iters, coherent, blocks, kind, bulk,
                                                      &err);
    if (v < 0) throw std::runtime_error(err);
    return v;
  }
#endif
  (void)coherent, (void)blocks, (void)kind, (void)bulk;
  return CpuRead(nbytes, iters);
}

std::optional<std::pair<double, double>> MeasureManaged(size_t nbytes) {
#if defined(JAXVT_WITH_GPU)
  if (UseGpu()) {
    double first = 0, repeat = 0;
    std::string err;
    if (jaxvt::gpu_mem::measure_managed(nbytes, &first, &repeat, &err))
      return std::make_pair(first, repeat);
    if (!err.empty()) throw std::runtime_error(err);
  }
#endif
  (void)nbytes;
  return std::nullopt;
}

// A matvec probe's row bytes, after checking its format and shape.
[[maybe_unused]] int64_t MatrixRowBytes(int fmt, int64_t rows, int64_t cols, int64_t batch) {
  if (!jaxvt::fmt_supported(fmt) || cols % jaxvt::kblock_elems(fmt) || batch < 1 || rows < 1)
    throw std::invalid_argument("unsupported format or shape");
  return cols / jaxvt::kblock_elems(fmt) * jaxvt::kblock_bytes(fmt);
}

// GPU-only probe of the matvec kernel (probes.h); GB/s of weight bytes read.
double MeasureHostGemv(int fmt, int64_t rows, int64_t cols, int64_t batch, int copies, int iters,
                       int64_t grid_cap, bool device_tier, int kind, int64_t waves, bool ggml,
                       int64_t bulk, int l2, bool l2_only) {
#if defined(JAXVT_WITH_GPU)
  if (UseGpu()) {
    std::string err;
    const int64_t rb = MatrixRowBytes(fmt, rows, cols, batch);
    double v = jaxvt::gpu_mem::measure_host_gemv(fmt, rows, cols, rb, batch, copies, iters,
                                                 grid_cap, waves, device_tier, kind, ggml, bulk,
                                                 l2, l2_only, &err);
    if (v < 0) throw std::runtime_error(err);
    return v;
  }
#endif
  (void)fmt, (void)rows, (void)cols, (void)batch, (void)copies, (void)iters, (void)grid_cap;
  (void)device_tier, (void)kind, (void)waves, (void)ggml, (void)bulk, (void)l2, (void)l2_only;
  throw std::runtime_error("measure_host_gemv needs a GPU build and a GPU");
}

// GPU-only: the matvec kernel's output for weights and x in numpy arrays (probes.h).
void MatvecOutputs(int fmt, int64_t rows, int64_t cols, int64_t batch, uintptr_t w, uintptr_t x,
                   uintptr_t y, bool device_tier, bool ggml, int64_t bulk, int64_t grid_cap) {
#if defined(JAXVT_WITH_GPU)
  if (UseGpu()) {
    std::string err;
    const int64_t rb = MatrixRowBytes(fmt, rows, cols, batch);
    if (!jaxvt::gpu_mem::matvec_outputs(fmt, rows, cols, rb, batch, w, x, y, device_tier, ggml,
                                        bulk, grid_cap, &err))
      throw std::runtime_error(err);
    return;
  }
#endif
  (void)fmt, (void)rows, (void)cols, (void)batch, (void)w, (void)x, (void)y, (void)device_tier;
  (void)ggml, (void)bulk, (void)grid_cap;
  throw std::runtime_error("matvec_outputs needs a GPU build and a GPU");
}

// Times the CPU GEMV kernel alone (no XLA): weights at `addr` (rows x cols of format fmt), batch
// rows of x = 1/cols; returns seconds per call.
double BenchCpuGemv(int fmt, uintptr_t addr, int64_t rows, int64_t cols, int64_t batch, int iters) {
  if (!jaxvt::fmt_supported(fmt) || cols % jaxvt::kblock_elems(fmt) || batch < 1 || rows < 1)
    throw std::invalid_argument("unsupported format or shape");
  std::vector<float> x(batch * cols, 1.0f / static_cast<float>(cols)), y(batch * rows);
  std::vector<float> s16(batch * cols / 16), s32(batch * cols / 32);
  std::vector<const float*> xr(batch), p16(batch), p32(batch);
  std::vector<float*> yr(batch);
  for (int64_t b = 0; b < batch; ++b) {
    xr[b] = x.data() + b * cols;
    p16[b] = s16.data() + b * cols / 16;
    p32[b] = s32.data() + b * cols / 32;
    yr[b] = y.data() + b * rows;
    jaxvt::cpu::x_sums(xr[b], cols, s16.data() + b * cols / 16, s32.data() + b * cols / 32);
  }
  jaxvt::cpu::Batch bt{batch, xr.data(), p16.data(), p32.data(), yr.data()};
  const auto* w = reinterpret_cast<const uint8_t*>(addr);
  const int64_t per = std::max<int64_t>(16, (rows + 4 * jaxvt::cpu::num_threads() - 1) /
                                                (4 * jaxvt::cpu::num_threads()));
  auto run = [&] {
    auto task = [&](int64_t t) {
      jaxvt::cpu::gemv_rows(fmt, w, cols, bt, t * per, std::min(rows, (t + 1) * per));
    };
    jaxvt::cpu::parallel_for((rows + per - 1) / per, task);
  };
  run();
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) run();
  return Seconds(std::chrono::steady_clock::now() - t0) / std::max(iters, 1);
}

}  // namespace

NB_MODULE(_jaxvt_debug, m) {
  m.doc() = "jaxvt's measurement probes (link and kernel rates), apart from the product's ops.";
  m.def("measure_dma_h2d", &MeasureDmaH2D, nb::arg("nbytes"), nb::arg("iters"), nb::arg("kind") = 0,
        "GB/s of pinned host -> device copies (memcpy GB/s on CPU).");
  m.def("measure_zero_copy_read", &MeasureZeroCopyRead, nb::arg("nbytes"), nb::arg("iters"),
        nb::arg("coherent") = false, nb::arg("blocks") = 0, nb::arg("kind") = 0,
        nb::arg("bulk") = false,
        "GB/s of a kernel streaming mapped pinned host memory (plain read GB/s on CPU); blocks:"
        " its grid (0: four per multiprocessor); kind: the memory's HostKind; bulk: read with"
        " the bulk-copy engine (CUDA sm_90+; raises elsewhere).");
  m.def("measure_host_gemv", &MeasureHostGemv, nb::arg("fmt"), nb::arg("rows"), nb::arg("cols"),
        nb::arg("batch") = 1, nb::arg("copies") = 8, nb::arg("iters") = 20, nb::arg("grid_cap") = 0,
        nb::arg("device_tier") = false, nb::arg("kind") = 0, nb::arg("waves") = 1,
        nb::arg("ggml") = false, nb::arg("bulk") = -1, nb::arg("l2") = -1,
        nb::arg("l2_only") = false,
        "GPU probe: GB/s of the matvec kernel alone (events), host or device tier, by grid: at "
        "most grid_cap blocks (0: the kernel's own), or `waves` waves of resident blocks; ggml: "
        "ggml's arithmetic (else float32); bulk: bulk-copy stage bytes (-1 the default, 0 the "
        "per-warp windows); l2 >= 0: each launch after an L2 prefetch of the matrix l2 launches "
        "ahead (0 its own); l2_only: the prefetch launches alone.");
  m.def("matvec_outputs", &MatvecOutputs, nb::arg("fmt"), nb::arg("rows"), nb::arg("cols"),
        nb::arg("batch"), nb::arg("w"), nb::arg("x"), nb::arg("y"), nb::arg("device_tier") = true,
        nb::arg("ggml") = true, nb::arg("bulk") = -1, nb::arg("grid_cap") = 0,
        "GPU probe: the matvec kernel's output y (address of float32 [batch, rows]) for weights "
        "w (address of the rows' blocks) and x (address of float32 [batch, cols]); bulk: "
        "bulk-copy stage bytes (-1 the default, 0 the per-warp windows).");
  m.def("measure_managed", &MeasureManaged, nb::arg("nbytes"),
        "(first, repeat) device-read GB/s of host-written managed memory, or None.");
  m.def("bench_cpu_gemv", &BenchCpuGemv, nb::arg("fmt"), nb::arg("addr"), nb::arg("rows"),
        nb::arg("cols"), nb::arg("batch"), nb::arg("iters"),
        "Seconds per call of the CPU GEMV kernel alone on the matrix at addr.");
}
