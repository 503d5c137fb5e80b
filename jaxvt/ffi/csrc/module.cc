// nanobind module jaxvt.ffi._jaxvt_ffi: the XLA FFI handler capsules by platform, the host-tier
// allocator, and the raw measurement primitives the bandwidth probe calls.
#include <nanobind/nanobind.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/pair.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <utility>
#include <vector>

#include "formats.h"
#include "handlers.h"
#include "kernels_cpu.h"
#include "memory.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule Capsule(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "an XLA FFI handler must take an XLA_FFI_CallFrame*");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

#if defined(JAXVT_WITH_GPU)
constexpr const char* kGpuPlatform = JAXVT_GPU_PLATFORM;
#else
constexpr const char* kGpuPlatform = "";
#endif

nb::dict Registrations() {
  nb::dict out, cpu;
  cpu["jaxvt_qmatmul"] = Capsule(JaxvtQMatmulCpu);
  cpu["jaxvt_qmatmul_experts"] = Capsule(JaxvtQMatmulExpertsCpu);
  cpu["jaxvt_qembed"] = Capsule(JaxvtQEmbedCpu);
  cpu["jaxvt_qdequant"] = Capsule(JaxvtQDequantCpu);
  cpu["jaxvt_qmatmul_q8"] = Capsule(JaxvtQMatmulQ8Cpu);
  cpu["jaxvt_qmatmul_experts_q8"] = Capsule(JaxvtQMatmulExpertsQ8Cpu);
  cpu["jaxvt_rms_norm"] = Capsule(JaxvtRmsNormCpu);
  cpu["jaxvt_swiglu"] = Capsule(JaxvtSwigluCpu);
  cpu["jaxvt_rope"] = Capsule(JaxvtRopeCpu);
  cpu["jaxvt_attention"] = Capsule(JaxvtAttentionCpu);
  cpu["jaxvt_qmatmul_grouped"] = Capsule(JaxvtQMatmulGroupedCpu);
  cpu["jaxvt_moe_route"] = Capsule(JaxvtMoeRouteCpu);
  cpu["jaxvt_gdn_step"] = Capsule(JaxvtGdnStepCpu);
  cpu["jaxvt_attn_step"] = Capsule(JaxvtAttnStepCpu);
  cpu["jaxvt_prefetch_fetch"] = Capsule(JaxvtPrefetchFetchCpu);
  cpu["jaxvt_prefetch_take"] = Capsule(JaxvtPrefetchTakeCpu);
  cpu["jaxvt_prefetch_join"] = Capsule(JaxvtPrefetchJoinCpu);
  cpu["jaxvt_prefetch_experts"] = Capsule(JaxvtPrefetchExpertsCpu);
  cpu["jaxvt_prefetch_experts_inline"] = Capsule(JaxvtPrefetchExpertsCpu);  // one copy on a CPU
  out["cpu"] = cpu;
#if defined(JAXVT_WITH_GPU)
  nb::dict gpu;
  gpu["jaxvt_qmatmul"] = Capsule(JaxvtQMatmulGpu);
  gpu["jaxvt_qmatmul_experts"] = Capsule(JaxvtQMatmulExpertsGpu);
  gpu["jaxvt_qembed"] = Capsule(JaxvtQEmbedGpu);
  gpu["jaxvt_qdequant"] = Capsule(JaxvtQDequantGpu);
  gpu["jaxvt_qmatmul_multi"] = Capsule(JaxvtQMatmulMultiGpu);
  gpu["jaxvt_qmatmul_experts2"] = Capsule(JaxvtQMatmulExperts2Gpu);
  gpu["jaxvt_qmatmul_q8"] = Capsule(JaxvtQMatmulQ8Gpu);
  gpu["jaxvt_qmatmul_experts_q8"] = Capsule(JaxvtQMatmulExpertsQ8Gpu);
  gpu["jaxvt_qmatmul_grouped"] = Capsule(JaxvtQMatmulGroupedGpu);
  gpu["jaxvt_moe_route"] = Capsule(JaxvtMoeRouteGpu);
  gpu["jaxvt_gdn_step"] = Capsule(JaxvtGdnStepGpu);
  gpu["jaxvt_attn_step"] = Capsule(JaxvtAttnStepGpu);
  gpu["jaxvt_prefetch_fetch"] = Capsule(JaxvtPrefetchFetchGpu);
  gpu["jaxvt_prefetch_take"] = Capsule(JaxvtPrefetchTakeGpu);
  gpu["jaxvt_prefetch_join"] = Capsule(JaxvtPrefetchJoinGpu);
  gpu["jaxvt_prefetch_experts"] = Capsule(JaxvtPrefetchExpertsGpu);
  gpu["jaxvt_prefetch_experts_inline"] = Capsule(JaxvtPrefetchExpertsInlineGpu);
  out[kGpuPlatform] = gpu;
#endif
  return out;
}

int GpuDeviceCount() {
#if defined(JAXVT_WITH_GPU)
  return jaxvt::gpu_mem::device_count();
#else
  return 0;
#endif
}

bool UseGpu() { return GpuDeviceCount() > 0; }

constexpr size_t kPage = 4096;

// ---- host tier ---------------------------------------------------------------------------------

// kind: jaxvt::gpu_mem::HostKind. On the CPU backend kHugePages asks for transparent huge pages
// (2 MiB-aligned memory, MADV_HUGEPAGE) and the other kinds are plain page-aligned memory.
std::pair<uintptr_t, uintptr_t> HostAlloc(size_t nbytes, bool coherent, bool gpu, int kind) {
  if (nbytes == 0) throw std::invalid_argument("host tier allocation of 0 bytes");
  if (kind < 0 || kind > 2) throw std::invalid_argument("host tier kind must be 0, 1 or 2");
  if (gpu) {
#if defined(JAXVT_WITH_GPU)
    uintptr_t h = 0, d = 0;
    std::string err;
    if (!jaxvt::gpu_mem::host_alloc(nbytes, coherent, kind, &h, &d, &err))
      throw std::runtime_error(err);
    return {h, d};
#else
    throw std::runtime_error("this build of jaxvt has no GPU support (rebuild with JAXVT_GPU=CUDA or HIP)");
#endif
  }
  const size_t align = kind == jaxvt::gpu_mem::kHugePages ? size_t{2} << 20 : kPage;
  if (nbytes > (SIZE_MAX - align)) throw std::runtime_error("size out of range");
  const size_t len = (nbytes + align - 1) / align * align;
  void* p = std::aligned_alloc(align, len);
  if (!p) throw std::runtime_error("out of host memory (aligned_alloc failed)");
  if (kind == jaxvt::gpu_mem::kHugePages) (void)madvise(p, len, MADV_HUGEPAGE);  // a hint
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  return {a, a};
}

void HostFree(uintptr_t host, bool gpu) {
  if (!host) return;
  if (gpu) {
#if defined(JAXVT_WITH_GPU)
    jaxvt::gpu_mem::host_free(host);
#endif
    return;
  }
  std::free(reinterpret_cast<void*>(host));
}

std::optional<uintptr_t> ManagedAlloc(size_t nbytes) {
#if defined(JAXVT_WITH_GPU)
  if (!UseGpu()) return std::nullopt;
  uintptr_t p = 0;
  std::string err;
  if (jaxvt::gpu_mem::managed_alloc(nbytes, &p, &err)) return p;
  if (!err.empty()) throw std::runtime_error(err);
#endif
  (void)nbytes;
  return std::nullopt;
}

void ManagedFree(uintptr_t p) {
#if defined(JAXVT_WITH_GPU)
  jaxvt::gpu_mem::managed_free(p);
#else
  (void)p;
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

// dst: a device array's buffer (gpu: on GPU `device`; else host memory, the CPU backend's),
// src: host memory (a host-tier buffer: pinned on a GPU). Waits for the copy; the GIL is
// released meanwhile.
void CopyToDevice(uintptr_t dst, uintptr_t src, size_t nbytes, bool gpu, int device) {
  if (nbytes == 0) return;
  if (gpu && !UseGpu())
    throw std::runtime_error("this build of jaxvt sees no GPU (rebuild with JAXVT_GPU=CUDA or HIP)");
  nb::gil_scoped_release release;
#if defined(JAXVT_WITH_GPU)
  if (gpu) {
    std::string err;
    if (!jaxvt::gpu_mem::copy_h2d(dst, src, nbytes, device, &err)) throw std::runtime_error(err);
    return;
  }
#endif
  (void)device;
  std::memcpy(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), nbytes);
}

// The host-tier addresses of a QWeight table's layers for prefetch (memory.h prefetch_register);
// nothing to do without a GPU (the CPU's fetch reads the table itself).
void PrefetchRegister(uintptr_t table, std::vector<uint64_t> addrs) {
#if defined(JAXVT_WITH_GPU)
  jaxvt::gpu_mem::prefetch_register(table, std::move(addrs));
#else
  (void)table;
  (void)addrs;
#endif
}

void PrefetchUnregister(uintptr_t table) {
#if defined(JAXVT_WITH_GPU)
  jaxvt::gpu_mem::prefetch_unregister(table);
#else
  (void)table;
#endif
}

// ---- reading a file on native threads -----------------------------------------------------------

using Range = std::tuple<int64_t, uintptr_t, int64_t>;  // (file offset, destination, bytes)

// Reads every range of file descriptor fd into memory, in pieces of at most `piece` bytes on
// `threads` threads, with the GIL released throughout (one release for all of it, where Python
// threads reading the same pieces each wait for the GIL between reads). Returns -1 when every
// byte was read, else the file offset at which the file ended early; raises on a read error.
int64_t ReadRanges(int fd, const std::vector<Range>& ranges, int threads, int64_t piece) {
  if (piece < 1) throw std::invalid_argument("read_ranges: piece must be positive");
  std::vector<Range> jobs;
  for (const auto& [off, dst, n] : ranges) {
    if (off < 0 || n < 0) throw std::invalid_argument("read_ranges: negative offset or size");
    for (int64_t i = 0; i < n; i += piece)
      jobs.emplace_back(off + i, dst + static_cast<uintptr_t>(i), std::min(piece, n - i));
  }
  std::atomic<size_t> next{0};
  std::atomic<int64_t> short_at{-1};
  std::atomic<int> error{0};
  auto work = [&] {
    for (size_t j; (j = next.fetch_add(1)) < jobs.size() && !error && short_at < 0;) {
      auto [off, dst, n] = jobs[j];
      char* p = reinterpret_cast<char*>(dst);
      while (n > 0) {
        const ssize_t got = pread(fd, p, static_cast<size_t>(n), off);
        if (got < 0 && errno == EINTR) continue;
        if (got < 0) { error = errno; return; }
        if (got == 0) { short_at = off; return; }
        p += got, off += got, n -= got;
      }
    }
  };
  {
    nb::gil_scoped_release release;
    const int n = std::max(1, std::min<int>(threads, static_cast<int>(jobs.size())));
    std::vector<std::thread> pool;
    for (int t = 1; t < n; ++t) pool.emplace_back(work);
    work();
    for (auto& t : pool) t.join();
  }
  if (error) throw std::runtime_error(std::string("read error: ") + std::strerror(error));
  return short_at;
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

// GPU-only probes of the host-tier matvec kernel (memory.h); GB/s of weight bytes read.
double MeasureHostGemv(int fmt, int64_t rows, int64_t cols, int64_t batch, int copies, int iters,
                       int64_t grid_cap, bool device_tier, int kind) {
#if defined(JAXVT_WITH_GPU)
  if (UseGpu()) {
    if (!jaxvt::fmt_supported(fmt) || cols % jaxvt::kblock_elems(fmt) || batch < 1 || rows < 1)
      throw std::invalid_argument("unsupported format or shape");
    std::string err;
    const int64_t rb = cols / jaxvt::kblock_elems(fmt) * jaxvt::kblock_bytes(fmt);
    double v = jaxvt::gpu_mem::measure_host_gemv(fmt, rows, cols, rb, batch, copies, iters,
                                                 grid_cap, device_tier, kind, &err);
    if (v < 0) throw std::runtime_error(err);
    return v;
  }
#endif
  (void)fmt, (void)rows, (void)cols, (void)batch, (void)copies, (void)iters, (void)grid_cap;
  (void)device_tier, (void)kind;
  throw std::runtime_error("measure_host_gemv needs a GPU build and a GPU");
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

NB_MODULE(_jaxvt_ffi, m) {
  m.doc() = "jaxvt's XLA FFI kernels (GGUF block formats), host-tier allocator and probes.";
  m.def("registrations", &Registrations,
        "{platform: {target name: handler capsule}} for jax.ffi.register_ffi_target.");
  m.def("formats", [] {
          nb::list out;
          for (const jaxvt::FormatInfo& f : jaxvt::kFormats)
            out.append(nb::make_tuple(f.type_id, f.name, f.block_elems, f.block_bytes,
                                      jaxvt::kblock_elems(f.type_id),
                                      jaxvt::kblock_bytes(f.type_id)));
          return out;
        },
        "formats.h's table: (type id, name, block elems, block bytes, k-block elems, k-block "
        "bytes) per format the kernels run.");
  m.def("host_bit", [] { return jaxvt::kHostBit; }, "fmts bit of a host-tier layer (formats.h).");
  m.def("gpu_platform", [] { return std::string(kGpuPlatform); },
        "'CUDA' or 'ROCM' when built with a GPU toolchain, else ''.");
  m.def("gpu_sm_count", [] {
#if defined(JAXVT_WITH_GPU)
    if (UseGpu()) return jaxvt::gpu_mem::sm_count();
#endif
    return 0;
  }, "Multiprocessors of the current GPU (0 without one).");
  m.def("gpu_device_count", &GpuDeviceCount, "GPUs the runtime sees (0 without GPU support).");
  m.def("host_alloc", &HostAlloc, nb::arg("nbytes"), nb::arg("coherent") = false,
        nb::arg("gpu") = false, nb::arg("kind") = 0,
        "(host address, device address) of nbytes of host-tier memory: pinned and device-mapped "
        "with gpu=True, page-aligned plain memory otherwise. kind: 0 pinned, 1 write-combined, "
        "2 huge pages (memory.h). Raises on failure.");
  m.def("host_free", &HostFree, nb::arg("host"), nb::arg("gpu") = false);
  m.def("managed_alloc", &ManagedAlloc, nb::arg("nbytes"),
        "Managed-memory address, or None where the backend has none (CPU builds, no device, "
        "no concurrent managed access).");
  m.def("managed_free", &ManagedFree, nb::arg("ptr"));
  m.def("copy_to_device", &CopyToDevice, nb::arg("dst"), nb::arg("src"), nb::arg("nbytes"),
        nb::arg("gpu") = false, nb::arg("device") = 0,
        "Copies nbytes of host memory at src into the buffer at dst (gpu: device memory of GPU "
        "`device`; else host memory, a memcpy) and waits for it; the GIL is released meanwhile.");
  m.def("prefetch_register", &PrefetchRegister, nb::arg("table"), nb::arg("addrs"),
        "For prefetch's DMA: the device address of a QWeight table, then its L layers' addresses "
        "and L formats (host bit included).");
  m.def("prefetch_unregister", &PrefetchUnregister, nb::arg("table"));
  m.def("read_ranges", &ReadRanges, nb::arg("fd"), nb::arg("ranges"), nb::arg("threads"),
        nb::arg("piece") = int64_t{64} << 20,
        "Reads each (file offset, destination address, bytes) of fd in pieces on native "
        "threads, the GIL released; -1 when all was read, else where the file ended early.");
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
        nb::arg("device_tier") = false, nb::arg("kind") = 0,
        "GPU probe: GB/s of the matvec kernel alone (events), host or device tier, by grid cap.");
  m.def("set_experts_slot_max", [](int64_t slots) -> int64_t {
#if defined(JAXVT_WITH_GPU)
    if (UseGpu()) return jaxvt::gpu::set_experts_slot_max(slots);
#endif
    (void)slots;
    return 0;
  }, nb::arg("slots"),
        "GPU probe: routed-expert calls of at most `slots` slots take the per-slot kernel (< 0: "
        "the default); returns the previous value (0 without a GPU).");
  m.def("set_grid_waves", [](int64_t waves) -> int64_t {
#if defined(JAXVT_WITH_GPU)
    if (UseGpu()) return jaxvt::gpu::set_grid_waves(waves);
#endif
    (void)waves;
    return 0;
  }, nb::arg("waves"),
        "GPU probe: the matvec and per-slot experts launches' grids in waves of resident blocks "
        "(< 1: 1, the default); returns the previous value (0 without a GPU).");
  m.def("measure_managed", &MeasureManaged, nb::arg("nbytes"),
        "(first, repeat) device-read GB/s of host-written managed memory, or None.");
  m.def("cpu_threads", &jaxvt::cpu::num_threads, "Threads the CPU kernels use (caller included).");
  m.def("set_cpu_threads", &jaxvt::cpu::set_num_threads, nb::arg("n"),
        "Set the CPU kernels' thread count (n <= 0: the CPUs this process may use). Not while a "
        "kernel runs.");
  m.def("cpu_isa", [] { return std::string(jaxvt::cpu::isa()); },
        "'avx2' or 'generic': the CPU GEMV path chosen at run time.");
  m.def("set_cpu_isa", [](const std::string& isa) {
          if (isa != "auto" && isa != "generic") throw std::invalid_argument("isa must be 'auto' or 'generic'");
          jaxvt::cpu::force_generic(isa == "generic");
        }, nb::arg("isa"), "'generic' forces the portable CPU path (for tests); 'auto' undoes it.");
  m.def("bench_cpu_gemv", &BenchCpuGemv, nb::arg("fmt"), nb::arg("addr"), nb::arg("rows"),
        nb::arg("cols"), nb::arg("batch"), nb::arg("iters"),
        "Seconds per call of the CPU GEMV kernel alone on the matrix at addr.");
}
