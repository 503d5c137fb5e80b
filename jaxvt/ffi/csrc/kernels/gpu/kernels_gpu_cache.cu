// The expert cache's decision on the device (common/expert_cache.h; CUDA, and HIP via hipcc -x
// hip): one block computes what xcache::assign_layer computes on the host, phase by phase in
// shared memory, so a decode step's launch costs a few microseconds instead of a serial scan.
#include <cstdint>

#include "common/expert_cache.h"
#include "kernels/gpu/kernels_gpu.h"

namespace jaxvt::gpu {
namespace {

using xcache::kMaxCallSlots;
using xcache::kMaxSlots;

constexpr int kAssignThreads = 512;

__global__ void __launch_bounds__(kAssignThreads) expert_cache_assign_kernel(
    const int32_t* ids, int64_t n, const int32_t* layer, const uint32_t* stab, int64_t n_layers,
    int32_t* where) {
  __shared__ int32_t es[kMaxCallSlots], first[kMaxCallSlots], hit[kMaxCallSlots],
      rank[kMaxCallSlots];
  __shared__ int32_t used[kMaxSlots], taken[kMaxSlots], order[kMaxSlots];
  __shared__ uint32_t score[kMaxSlots];
  __shared__ int32_t free_n;
  xcache::Header* h = xcache::entry<xcache::Header>(stab, n_layers, *layer);
  if (h == nullptr || n > kMaxCallSlots || xcache::check_header(h) != nullptr) {
    for (int64_t s = threadIdx.x; s < n; s += blockDim.x) where[s] = -1;
    return;
  }
  const int32_t E = h->experts, S = h->slots;
  int32_t* dir = xcache::dir_of(h);
  int32_t* owner = xcache::owner_of(h);
  uint32_t* gscore = xcache::score_of(h);
  for (int32_t j = threadIdx.x; j < S; j += blockDim.x) {
    used[j] = taken[j] = 0;
    score[j] = gscore[j];
  }
  for (int64_t s = threadIdx.x; s < n; s += blockDim.x) {
    const int32_t e = xcache::expert_of(ids[s], E);
    es[s] = e;
    hit[s] = e >= 0 ? dir[e] : -1;
  }
  __syncthreads();
  for (int64_t s = threadIdx.x; s < n; s += blockDim.x) {
    int32_t f = static_cast<int32_t>(s);
    if (es[s] >= 0)
      for (int64_t t = 0; t < s; ++t)
        if (es[t] == es[s]) {
          f = static_cast<int32_t>(t);
          break;
        }
    first[s] = f;
    if (hit[s] >= 0) used[hit[s]] = 1;  // (every writer writes 1)
  }
  __syncthreads();
  // misses ranked in order of first occurrence; the counters (fills: the distinct misses that
  // get a slot)
  if (threadIdx.x == 0) {
    int32_t r = 0;
    uint32_t hits = 0, misses = 0;
    for (int64_t s = 0; s < n; ++s) {
      rank[s] = -1;
      if (es[s] < 0) continue;
      if (hit[s] >= 0) {
        ++hits;
      } else {
        ++misses;
        if (first[s] == s) rank[s] = r++;
      }
    }
    int32_t f = 0;
    for (int32_t j = 0; j < S; ++j) f += !used[j];
    free_n = f;
    xcache::add64(h->hits_lo, h->hits_hi, hits);
    xcache::add64(h->misses_lo, h->misses_hi, misses);
    xcache::add64(h->fills_lo, h->fills_hi, static_cast<uint32_t>(r < f ? r : f));
  }
  // the slots not hit, by (score, index): each finds its own place
  for (int32_t j = threadIdx.x; j < S; j += blockDim.x) {
    if (used[j]) continue;
    int32_t p = 0;
    const uint32_t v = score[j];
    for (int32_t i = 0; i < S; ++i)
      p += !used[i] && (score[i] < v || (score[i] == v && i < j));
    order[p] = j;
  }
  __syncthreads();
  for (int64_t s = threadIdx.x; s < n; s += blockDim.x) {  // fills: the directory
    const int32_t r = rank[s];
    if (r < 0 || r >= free_n) continue;
    const int32_t j = order[r];
    const int32_t old = owner[j];
    if (old >= 0) dir[old] = -1;  // (a missed expert owns no slot: no other writer of dir[old])
    owner[j] = es[s];
    dir[es[s]] = j;
    taken[j] = 1;
  }
  __syncthreads();
  for (int64_t s = threadIdx.x; s < n; s += blockDim.x) {
    const int32_t f = first[s];
    int32_t w = -1;
    if (es[s] >= 0) {
      if (hit[f] >= 0) w = hit[f];
      else if (rank[f] >= 0 && rank[f] < free_n) w = -(order[rank[f]] + 2);
    }
    where[s] = w;
  }
  const uint32_t clock = h->clock + 1;
  const bool lfru = h->policy == xcache::kLfru;
  for (int32_t j = threadIdx.x; j < S; j += blockDim.x) {
    if (lfru) {
      uint32_t v = score[j] - (score[j] >> 3);
      if (used[j]) v += xcache::kUse;
      if (taken[j]) v = xcache::kUse;
      gscore[j] = v;
    } else if (used[j] || taken[j]) {
      gscore[j] = clock;
    }
  }
  __syncthreads();  // every thread has read the clock
  if (threadIdx.x == 0) h->clock = clock;
}

}  // namespace

gpuError_t launch_expert_cache_assign(gpuStream_t s, const int32_t* ids, int64_t n,
                                      const int32_t* layer, const uint32_t* stab,
                                      int64_t n_layers, int32_t* where) {
  if (n <= 0) return gpuSuccess;
  if (n > kMaxCallSlots) return gpuErrorInvalidValue;
  expert_cache_assign_kernel<<<1, kAssignThreads, 0, s>>>(ids, n, layer, stab, n_layers, where);
  return gpuGetLastError();
}

}  // namespace jaxvt::gpu
