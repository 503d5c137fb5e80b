// The device expert cache: recently used routed experts of host-tier MoE layers kept in spare
// device memory (Python side: jaxvt/ffi/expert_cache.py, jaxvt/offload/expert_cache.py).
//
// Each cached layer has `slots` slots. A slot holds one expert of that layer: its bytes in each
// of the layer's host-tier routed stacks (a stack's partition for the layer is `slots` slots of
// `cslot` bytes, at the address its cache table gives for the layer). The directory of a layer
// (which expert each slot holds, which slot each expert is in, each slot's eviction score) lives
// in a state block in device memory too, so everything a decode step decides stays on the device
// and XLA's command buffers replay it.
//
// assign(ids, layer, stab) -> where (jaxvt_expert_cache_assign), once per MoE layer and call,
//   before the experts' products: for each routed slot s of the call,
//     where[s] = j >= 0     its expert is in slot j (a hit: read it from there);
//     where[s] = -(j + 2)   a miss, given slot j: read it where it lives and write the bytes read
//                           into slot j as well (the fill; the next call finds it there);
//     where[s] = -1         not cached (not a cached layer, routed nowhere, or no slot left).
//   stab uint32 [L, 2]: per layer the address of its state block (0: the layer is not cached).
// The experts kernels given `where` and a stack's cache table (ctab uint32 [L, 2], 0 where that
// stack's layer is not cached) read hits from the cache and write fills as they read them, with
// the same bytes, so the same bits: the cache changes where bytes are read, never the results.
//
// The decision (assign_layer below; the GPU kernel computes the same, in parallel; the numpy
// reference in jaxvt/ffi/expert_cache.py is the test's):
//   e_s = ids[s] clamped into [0, E) as the experts kernels clamp it (negative: none);
//   hits: e_s with dir[e_s] >= 0; the slots they use are not evicted by this call;
//   misses, each distinct expert once in order of first occurrence, take the other slots in
//   order of (score, slot index) ascending, while there are any;
//   scores: LRU: a slot used or filled gets the layer's clock (incremented once a call);
//   LFRU: every slot's score decays by 1/8 a call, a slot used gets +256, a slot filled 256:
//   frequency over a recency-weighted window (a hit 8 calls ago counts about a third of a new one).
// Counters (per layer, 64-bit): routed slots that hit and that missed, one per (token, slot), and
// the experts filled, one per distinct expert a call copies into a slot: the experts kernels read
// a filled expert over the bus once a call however many of its slots (a batch's rows, a short
// prompt's tokens) route to it, so fills count the bus reads of the cached layers' misses.
#ifndef JAXVT_FFI_CSRC_COMMON_EXPERT_CACHE_H_
#define JAXVT_FFI_CSRC_COMMON_EXPERT_CACHE_H_

#include <cstdint>

#include "common/formats.h"

namespace jaxvt {
namespace xcache {

enum Policy : uint32_t { kLru = 0, kLfru = 1 };

constexpr int kMaxCallSlots = 1024;  // routed slots of one call (a decode step's batch x k)
constexpr int kMaxSlots = 1024;      // slots of one layer
constexpr uint32_t kUse = 256;       // LFRU: a use's weight

// The state block of one cached layer: this header (uint32 words), then int32 dir[experts],
// int32 owner[slots], uint32 score[slots].
struct Header {
  uint32_t clock;
  uint32_t policy;
  int32_t slots;
  int32_t experts;
  uint32_t hits_lo, hits_hi, misses_lo, misses_hi;
  uint32_t fills_lo, fills_hi;
};
constexpr int64_t kHeaderWords = sizeof(Header) / 4;
static_assert(kHeaderWords == 10, "the state block's header is 10 words");

JV_HD int64_t layer_words(int64_t experts, int64_t slots) {
  return kHeaderWords + experts + 2 * slots;
}
JV_HD int32_t* dir_of(Header* h) { return reinterpret_cast<int32_t*>(h + 1); }
JV_HD int32_t* owner_of(Header* h) { return dir_of(h) + h->experts; }
JV_HD uint32_t* score_of(Header* h) {
  return reinterpret_cast<uint32_t*>(owner_of(h) + h->slots);
}
JV_HD void add64(uint32_t& lo, uint32_t& hi, uint32_t n) {
  const uint32_t before = lo;
  lo += n;
  hi += lo < before;
}

// The expert of a routed id as the experts kernels read it (-1: routed nowhere).
JV_HD int32_t expert_of(int32_t v, int32_t experts) {
  return v < 0 ? -1 : (v >= experts ? experts - 1 : v);
}

// A layer's entry of a uint32 [L, 2] address table as a pointer (nullptr: none, or out of range).
template <typename T>
JV_HD T* entry(const uint32_t* table, int64_t n_layers, int32_t layer) {
  if (table == nullptr || layer < 0 || layer >= n_layers) return nullptr;
  return reinterpret_cast<T*>(static_cast<uintptr_t>(table_entry(table, layer)));
}

// The decision for one call on the host (the CPU's handler): where[n] as described above.
// `scratch` holds at least n + 3 * slots int32.
inline void assign_layer(Header* h, const int32_t* ids, int64_t n, int32_t* where,
                         int32_t* scratch) {
  const int32_t E = h->experts, S = h->slots;
  int32_t* dir = dir_of(h);
  int32_t* owner = owner_of(h);
  uint32_t* score = score_of(h);
  int32_t* first = scratch;           // [n] the first slot of the call routed to e_s
  int32_t* used = scratch + n;        // [S] hit by this call
  int32_t* taken = used + S;          // [S] filled by this call
  int32_t* order = taken + S;         // [S] the slots not hit, by (score, index)
  const uint32_t clock = h->clock + 1;
  uint32_t hits = 0, misses = 0, fills = 0;
  for (int32_t j = 0; j < S; ++j) used[j] = taken[j] = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int32_t e = expert_of(ids[s], E);
    first[s] = static_cast<int32_t>(s);
    if (e < 0) continue;
    for (int64_t t = 0; t < s; ++t)
      if (expert_of(ids[t], E) == e) {
        first[s] = static_cast<int32_t>(t);
        break;
      }
    if (dir[e] >= 0) {
      used[dir[e]] = 1;
      ++hits;
    } else {
      ++misses;
    }
  }
  int32_t free_n = 0;
  for (int32_t j = 0; j < S; ++j)
    if (!used[j]) order[free_n++] = j;
  for (int32_t a = 1; a < free_n; ++a) {  // insertion sort by (score, index): stable on index
    const int32_t j = order[a];
    int32_t b = a;
    for (; b > 0 && score[order[b - 1]] > score[j]; --b) order[b] = order[b - 1];
    order[b] = j;
  }
  int32_t next = 0;
  for (int64_t s = 0; s < n; ++s) {
    const int32_t e = expert_of(ids[s], E);
    if (e < 0) {
      where[s] = -1;
      continue;
    }
    if (first[s] != s) {  // the first occurrence decided (dir may since hold e's new slot)
      where[s] = where[first[s]];
      continue;
    }
    const int32_t hit = dir[e];
    if (hit >= 0) {
      where[s] = hit;
    } else if (next < free_n) {
      const int32_t j = order[next++];
      if (owner[j] >= 0) dir[owner[j]] = -1;
      owner[j] = e;
      dir[e] = j;
      taken[j] = 1;
      where[s] = -(j + 2);
      ++fills;
    } else {
      where[s] = -1;
    }
  }
  for (int32_t j = 0; j < S; ++j) {
    if (h->policy == kLfru) {
      uint32_t v = score[j] - (score[j] >> 3);
      if (used[j]) v += kUse;
      if (taken[j]) v = kUse;
      score[j] = v;
    } else if (used[j] || taken[j]) {
      score[j] = clock;
    }
  }
  h->clock = clock;
  add64(h->hits_lo, h->hits_hi, hits);
  add64(h->misses_lo, h->misses_hi, misses);
  add64(h->fills_lo, h->fills_hi, fills);
}

// The state block's header checked (nullptr: it fits, else the problem).
JV_HD const char* check_header(const Header* h) {
  if (h->slots < 1 || h->slots > kMaxSlots || h->experts < 1 || h->slots > h->experts)
    return "an expert cache layer needs 1 <= slots <= min(experts, 1024)";
  if (h->policy != kLru && h->policy != kLfru) return "unknown expert cache policy";
  return nullptr;
}

}  // namespace xcache
}  // namespace jaxvt

#endif  // JAXVT_FFI_CSRC_COMMON_EXPERT_CACHE_H_
