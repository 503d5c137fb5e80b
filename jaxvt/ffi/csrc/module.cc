// nanobind module jaxvt.ffi._jaxvt_ffi: the XLA FFI handler capsules by platform (from the op
// table, handlers/ops.inc), the host-tier allocator, the file reader and the CPU kernels'
// settings. The probes are the debug module's (debug/module.cc).
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

#include "common/formats.h"
#include "handlers/handlers.h"
#include "handlers/select.h"
#include "kernels/cpu/kernels_cpu.h"
#include "memory/memory.h"

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

// {platform: {target: capsule}}, expanded from the op table (handlers/ops.inc).
nb::dict Registrations() {
  nb::dict out, cpu;
#define JAXVT_OP(target, Stem, on_cpu, on_gpu, cmd, ...) \
  JAXVT_IF(on_cpu, cpu[#target] = Capsule(Jaxvt##Stem##Cpu);)
#include "handlers/ops.inc"
#undef JAXVT_OP
  out["cpu"] = cpu;
#if defined(JAXVT_WITH_GPU)
  nb::dict gpu;
#define JAXVT_OP(target, Stem, on_cpu, on_gpu, cmd, ...) \
  JAXVT_IF(on_gpu, gpu[#target] = Capsule(Jaxvt##Stem##Gpu);)
#include "handlers/ops.inc"
#undef JAXVT_OP
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

}  // namespace

NB_MODULE(_jaxvt_ffi, m) {
  m.doc() = "jaxvt's XLA FFI kernels (GGUF block formats) and host-tier allocator.";
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
}
