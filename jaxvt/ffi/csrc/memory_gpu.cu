// Pinned host-tier allocation and the raw bandwidth probes, for CUDA and HIP (vendor.h).
#include <sys/mman.h>

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "kernels_gpu.h"
#include "memory.h"
#include "vendor.h"

namespace jaxvt::gpu_mem {
namespace {

bool ok(gpuError_t e, const char* what, std::string* err) {
  if (e == gpuSuccess) return true;
  if (err) *err = std::string(what) + ": " + gpuGetErrorString(e);
  (void)gpuGetLastError();  // clear the error state
  return false;
}

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

int device_count() {
  int n = 0;
  if (gpuGetDeviceCount(&n) != gpuSuccess) {
    (void)gpuGetLastError();
    return 0;
  }
  return n;
}

int sm_count() { return gpu::sm_count(); }

namespace {

// Registered (kHugePages) allocations: host address -> the mapping to unmap after unregistering.
struct Mapping {
  void* base;
  size_t len;
};
std::mutex g_mu;
std::unordered_map<uintptr_t, Mapping> g_registered;
// Live host_alloc allocations: device address -> bytes, and host address -> device address.
std::map<uintptr_t, size_t> g_live;
std::unordered_map<uintptr_t, uintptr_t> g_live_host;

constexpr size_t kHuge = size_t{2} << 20;

bool huge_alloc(size_t nbytes, void** out, Mapping* m, std::string* err) {
  if (nbytes > SIZE_MAX - 2 * kHuge) {
    if (err) *err = "size out of range";
    return false;
  }
  const size_t len = (nbytes + kHuge - 1) / kHuge * kHuge;
  // Over-map by one huge page so the buffer can start on a 2 MiB boundary.
  void* raw = mmap(nullptr, len + kHuge, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) {
    if (err) *err = std::string("mmap: ") + std::strerror(errno);
    return false;
  }
  const uintptr_t r = reinterpret_cast<uintptr_t>(raw);
  const uintptr_t a = (r + kHuge - 1) & ~(uintptr_t{kHuge} - 1);
  if (a > r) munmap(raw, a - r);
  if (r + len + kHuge > a + len) munmap(reinterpret_cast<void*>(a + len), r + len + kHuge - a - len);
  void* p = reinterpret_cast<void*>(a);
  (void)madvise(p, len, MADV_HUGEPAGE);  // a hint: without transparent huge pages, 4 KiB pages
  std::memset(p, 0, len);                // fault the pages in now, as huge pages where granted
  if (!ok(gpuHostRegister(p, len, gpuHostRegisterMapped | gpuHostRegisterPortable),
          "registering host memory", err)) {
    munmap(p, len);
    return false;
  }
  *out = p;
  *m = Mapping{p, len};
  return true;
}

}  // namespace

bool host_alloc(size_t nbytes, bool coherent, int kind, uintptr_t* host, uintptr_t* device,
                std::string* err) {
  void* h = nullptr;
  Mapping m{nullptr, 0};
  if (kind == kHugePages) {
    if (!huge_alloc(nbytes, &h, &m, err)) return false;
  } else {
    const unsigned flags = gpuHostAllocMapped | gpuHostAllocPortable |
                           (coherent ? gpuHostAllocCoherent : gpuHostAllocNonCoherent) |
                           (kind == kWriteCombined ? gpuHostAllocWriteCombined : 0u);
    if (!ok(gpuHostAlloc(&h, nbytes, flags), "pinned host allocation", err)) return false;
  }
  void* d = nullptr;
  if (!ok(gpuHostGetDevicePointer(&d, h, 0), "device pointer of pinned memory", err)) {
    if (m.base) {
      (void)gpuHostUnregister(h);
      munmap(m.base, m.len);
    } else {
      (void)gpuFreeHost(h);
    }
    return false;
  }
  *host = reinterpret_cast<uintptr_t>(h);
  *device = reinterpret_cast<uintptr_t>(d);
  std::lock_guard<std::mutex> g(g_mu);
  if (m.base) g_registered[*host] = m;
  g_live[*device] = nbytes;
  g_live_host[*host] = *device;
  return true;
}

bool host_range_live(uintptr_t device_addr, size_t nbytes) {
  std::lock_guard<std::mutex> g(g_mu);
  auto it = g_live.upper_bound(device_addr);
  if (it == g_live.begin()) return false;
  --it;
  return device_addr - it->first <= it->second && nbytes <= it->second - (device_addr - it->first);
}

void host_free(uintptr_t host) {
  if (!host) return;
  Mapping m{nullptr, 0};
  {
    std::lock_guard<std::mutex> g(g_mu);
    auto it = g_registered.find(host);
    if (it != g_registered.end()) {
      m = it->second;
      g_registered.erase(it);
    }
    auto lh = g_live_host.find(host);
    if (lh != g_live_host.end()) {
      g_live.erase(lh->second);
      g_live_host.erase(lh);
    }
  }
  if (m.base) {
    (void)gpuHostUnregister(m.base);
    munmap(m.base, m.len);
  } else {
    (void)gpuFreeHost(reinterpret_cast<void*>(host));
  }
}

bool managed_alloc(size_t nbytes, uintptr_t* ptr, std::string* err) {
  int dev = 0, concurrent = 0;
  if (!ok(gpuGetDevice(&dev), "device", err)) return false;
  (void)gpuDeviceGetAttribute(&concurrent, gpuDevAttrConcurrentManagedAccess, dev);
  if (!concurrent) {
    if (err) err->clear();
    return false;
  }
  size_t free_b = 0, total_b = 0;
  if (!ok(gpuMemGetInfo(&free_b, &total_b), "memory info", err)) return false;
  if (nbytes > free_b / 2) {  // never ask for more managed memory than the card can hold
    if (err) *err = "managed allocation larger than half the free device memory";
    return false;
  }
  void* p = nullptr;
  if (!ok(gpuMallocManaged(&p, nbytes, gpuMemAttachGlobal), "managed allocation", err)) return false;
  *ptr = reinterpret_cast<uintptr_t>(p);
  return true;
}

void managed_free(uintptr_t ptr) {
  if (ptr) (void)gpuFree(reinterpret_cast<void*>(ptr));
}

bool copy_h2d(uintptr_t dst, uintptr_t src, size_t nbytes, int device, std::string* err) {
  if (!ok(gpuSetDevice(device), "set device", err)) return false;
  gpuStream_t s = nullptr;
  if (!ok(gpuStreamCreate(&s), "stream", err)) return false;
  const bool good = ok(gpuMemcpyAsync(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src),
                                      nbytes, gpuMemcpyHostToDevice, s), "copy", err) &&
                    ok(gpuStreamSynchronize(s), "copy", err);
  (void)gpuStreamDestroy(s);
  return good;
}

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
                         int copies, int iters, int64_t grid_cap, bool device_tier, int kind,
                         std::string* err) {
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
  gpu::set_grid_cap(grid_cap);
  auto launch = [&](int i) {
    gpu::WeightArgs w{static_cast<const uint8_t*>(dd), static_cast<int64_t>(mat),
                      static_cast<const uint32_t*>(dt), static_cast<const int32_t*>(df), copies,
                      static_cast<const int32_t*>(dl) + (i % copies)};
    return gpu::launch_qmatmul(t.s, w, static_cast<const float*>(dx), batch,
                               static_cast<float*>(dy), rows, cols);
  };
  for (int i = 0; good && i < copies; ++i) good = ok(launch(i), "qmatmul", err);
  good = good && ok(gpuEventRecord(t.a, t.s), "event", err);
  for (int i = 0; good && i < iters; ++i) good = ok(launch(i), "qmatmul", err);
  good = good && ok(gpuEventRecord(t.b, t.s), "event", err) && ok(gpuEventSynchronize(t.b), "sync", err);
  gpu::set_grid_cap(0);
  if (good) gbs = static_cast<double>(mat) * iters / 1e6 / t.ms();
  for (void* p : {dt, df, dl, dx, dy, dd})
    if (p) (void)gpuFree(p);
  host_free(h);
  return gbs;
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
