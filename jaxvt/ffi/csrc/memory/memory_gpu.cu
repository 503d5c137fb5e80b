// Pinned host-tier allocation, managed memory and the loader's copies, for CUDA and HIP (vendor.h).
#include <sys/mman.h>

#include <cstring>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/vendor.h"
#include "kernels/gpu/kernels_gpu.h"
#include "memory/memory.h"
#include "memory/memory_gpu.h"

namespace jaxvt::gpu_mem {

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
// prefetch_register: per layer of a table, (host-tier address or 0, format | host bit)
std::unordered_map<uintptr_t, std::vector<std::pair<uint64_t, int32_t>>> g_tables;

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

void prefetch_register(uintptr_t table, std::vector<uint64_t> addrs) {
  // addrs: per layer the address, then per layer the format (| host bit) in the low 32 bits
  std::vector<std::pair<uint64_t, int32_t>> v(addrs.size() / 2);
  for (size_t i = 0; i < v.size(); ++i)
    v[i] = {addrs[i], static_cast<int32_t>(addrs[v.size() + i] & 0xFFFFFFFFu)};
  std::lock_guard<std::mutex> g(g_mu);
  g_tables[table] = std::move(v);
}

void prefetch_unregister(uintptr_t table) {
  std::lock_guard<std::mutex> g(g_mu);
  g_tables.erase(table);
}

bool prefetch_layer(uintptr_t table, int64_t l, uint64_t* addr, int32_t* fmt) {
  std::lock_guard<std::mutex> g(g_mu);
  const auto t = g_tables.find(table);
  *addr = 0;
  *fmt = 0;
  if (t == g_tables.end()) return false;
  if (l >= 0 && l < static_cast<int64_t>(t->second.size())) {
    *addr = t->second[l].first;
    *fmt = t->second[l].second;
  }
  return true;
}

}  // namespace jaxvt::gpu_mem
