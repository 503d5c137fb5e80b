// CPU kernels: portable fused dequantize-and-dot, dequantization, run-time ISA dispatch and the
// thread pool that splits output rows across cores. See kernels_cpu.h for the numerics.
#include "kernels/cpu/kernels_cpu.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <mutex>
#include <thread>
#include <vector>

#include "common/formats.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define JV_X86 1
#endif

namespace jaxvt::cpu {

void x_sums(const float* x, int64_t cols, float* s16, float* s32) {
  for (int64_t i = 0; i < cols / 16; ++i) {
    float s = 0.f;
    for (int j = 0; j < 16; ++j) s += x[16 * i + j];
    s16[i] = s;
  }
  for (int64_t i = 0; i < cols / 32; ++i) s32[i] = s16[2 * i] + s16[2 * i + 1];
}

namespace {

// ---- portable path: dequantize a unit of 32 weights, then dot it with each batch row ----------

template <int F>
void gemv_rows_generic(const uint8_t* w, int64_t cols, const Batch& bt, int64_t r0, int64_t r1) {
  const int64_t nkb = cols / kblock_elems(F), kbb = kblock_bytes(F), upk = units_per_kblock(F);
  const int64_t rb = nkb * kbb;
  float wu[32];
  constexpr int kMaxB = 8;
  for (int64_t b0 = 0; b0 < bt.n; b0 += kMaxB) {
    const int nb = static_cast<int>(std::min<int64_t>(kMaxB, bt.n - b0));
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = w + r * rb;
      float acc[kMaxB] = {};
      for (int64_t kb = 0; kb < nkb; ++kb) {
        for (int u = 0; u < upk; ++u) {
          unit_weights<F>(row + kb * kbb, u, wu);
          const int64_t k0 = (kb * upk + u) * kUnit;
          for (int b = 0; b < nb; ++b) {
            const float* xb = bt.x[b0 + b] + k0;
            float s = 0.f;
            for (int i = 0; i < 32; ++i) s += wu[i] * xb[i];
            acc[b] += s;
          }
        }
      }
      for (int b = 0; b < nb; ++b) bt.y[b0 + b][r] = acc[b];
    }
  }
}

template <int F, class Out, class Conv>
void dequant_rows_t(const uint8_t* w, int64_t cols, int64_t r0, int64_t r1, Out* out, Conv conv) {
  const int64_t nkb = cols / kblock_elems(F), kbb = kblock_bytes(F), upk = units_per_kblock(F);
  const int64_t rb = nkb * kbb;
  float wu[32];
  for (int64_t r = r0; r < r1; ++r) {
    Out* o = out + (r - r0) * cols;
    for (int64_t kb = 0; kb < nkb; ++kb)
      for (int u = 0; u < upk; ++u) {
        unit_weights<F>(w + r * rb + kb * kbb, u, wu);
        for (int i = 0; i < 32; ++i) o[(kb * upk + u) * kUnit + i] = conv(wu[i]);
      }
  }
}

// Calls fn.template operator()<F>() for the run-time format f; false if unsupported.
template <class Fn>
bool dispatch_fmt(int f, Fn&& fn) {
  switch (f) {
    case kF32: fn.template operator()<kF32>(); return true;
    case kF16: fn.template operator()<kF16>(); return true;
    case kBF16: fn.template operator()<kBF16>(); return true;
    case kQ4_0: fn.template operator()<kQ4_0>(); return true;
    case kQ4_1: fn.template operator()<kQ4_1>(); return true;
    case kQ8_0: fn.template operator()<kQ8_0>(); return true;
    case kQ4_K: fn.template operator()<kQ4_K>(); return true;
    case kQ5_K: fn.template operator()<kQ5_K>(); return true;
    case kQ6_K: fn.template operator()<kQ6_K>(); return true;
    default: return false;
  }
}

std::atomic<bool> g_force_generic{false};

bool cpu_has_avx2() {
#if defined(JV_X86) && defined(JAXVT_HAVE_AVX2_TU)
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok && !g_force_generic.load(std::memory_order_relaxed);
#else
  return false;
#endif
}

}  // namespace

bool gemv_rows(int fmt, const uint8_t* w, int64_t cols, const Batch& bt, int64_t r0, int64_t r1) {
#if defined(JAXVT_HAVE_AVX2_TU)
  if (cpu_has_avx2()) return avx2::gemv_rows(fmt, w, cols, bt, r0, r1);
#endif
  return dispatch_fmt(fmt, [&]<int F>() { gemv_rows_generic<F>(w, cols, bt, r0, r1); });
}

bool dequant_rows_f32(int fmt, const uint8_t* w, int64_t cols, int64_t r0, int64_t r1, float* out) {
  return dispatch_fmt(fmt, [&]<int F>() {
    dequant_rows_t<F>(w, cols, r0, r1, out, [](float v) { return v; });
  });
}

bool dequant_rows_bf16(int fmt, const uint8_t* w, int64_t cols, int64_t r0, int64_t r1,
                       uint16_t* out) {
  return dispatch_fmt(fmt, [&]<int F>() {
    dequant_rows_t<F>(w, cols, r0, r1, out, [](float v) { return float_to_bf16(v); });
  });
}

bool gemm_bf16_rows(int fmt, const uint8_t* w, int64_t cols, int64_t n, const float* const* x,
                    float* const* y, int64_t r0, int64_t r1) {
  std::vector<float> row(cols);
  for (int64_t r = r0; r < r1; ++r) {
    if (!dequant_rows_f32(fmt, w, cols, r, r + 1, row.data())) return false;
    for (float& v : row) v = bf16_to_float(float_to_bf16(v));
    for (int64_t b = 0; b < n; ++b) {
      const float* xb = x[b];
      float acc = 0.f;
      for (int64_t k = 0; k < cols; ++k) acc += row[k] * xb[k];
      y[b][r] = acc;
    }
  }
  return true;
}

const char* isa() { return cpu_has_avx2() ? "avx2" : "generic"; }

bool use_avx2() { return cpu_has_avx2(); }

void force_generic(bool on) { g_force_generic.store(on); }

// ---- thread pool -------------------------------------------------------------------------------
//
// Persistent workers spin for a while after each job (GEMVs arrive every few microseconds while a
// model decodes, far faster than a sleeping thread wakes), then sleep on a condition variable.
// A job is published as a 64-bit ticket (generation << 32 | next task); workers and the caller
// claim tasks by CAS on it, so a worker that wakes late finds nothing left and the caller never
// waits for a thread that has not started. After the last task the caller retires the ticket
// (kRetired) and waits until no worker is between "announce" and "leave", so the job's fields are
// never rewritten while someone may still read them.

namespace {

constexpr uint32_t kRetired = 0xFFFFFFFFu;

inline void cpu_relax() {
#if defined(JV_X86)
  _mm_pause();
#endif
}

int affinity_cpus() {
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

int env_int(const char* name, int dflt) {
  const char* v = std::getenv(name);
  if (!v || !*v) return dflt;
  char* end = nullptr;
  long n = std::strtol(v, &end, 10);
  return (end && *end == 0) ? static_cast<int>(n) : dflt;
}

class Pool {
 public:
  explicit Pool(int threads) {
    spin_us_ = std::max(0, env_int("JAXVT_CPU_SPIN_US", 500));
    for (int i = 0; i + 1 < threads; ++i) workers_.emplace_back([this] { Worker(); });
  }
  ~Pool() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_.store(true);
    }
    cv_.notify_all();
    for (auto& t : workers_) t.join();
  }
  int threads() const { return static_cast<int>(workers_.size()) + 1; }

  // False if another caller holds the pool (the caller then runs the work itself).
  bool Run(int64_t n, TaskFn fn, void* ctx) {
    std::unique_lock<std::mutex> busy(run_mu_, std::try_to_lock);
    if (!busy.owns_lock()) return false;
    fn_ = fn;
    ctx_ = ctx;
    n_ = static_cast<uint32_t>(n);
    done_.store(0, std::memory_order_relaxed);
    const uint64_t gen = (ticket_.load(std::memory_order_relaxed) >> 32) + 1;
    ticket_.store(gen << 32, std::memory_order_seq_cst);
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard<std::mutex> g(mu_);
      cv_.notify_all();
    }
    Drain(gen);
    while (done_.load(std::memory_order_acquire) < n_) cpu_relax();
    ticket_.store((gen << 32) | kRetired, std::memory_order_seq_cst);
    while (active_.load(std::memory_order_seq_cst) > 0) cpu_relax();
    return true;
  }

 private:
  // Claims and runs tasks of generation gen until none is left.
  void Drain(uint64_t gen) {
    uint64_t t = ticket_.load(std::memory_order_acquire);
    for (;;) {
      const uint32_t next = static_cast<uint32_t>(t);
      if ((t >> 32) != gen || next == kRetired || next >= n_) return;
      if (ticket_.compare_exchange_weak(t, t + 1, std::memory_order_acq_rel)) {
        fn_(ctx_, next);
        done_.fetch_add(1, std::memory_order_release);
        t = ticket_.load(std::memory_order_acquire);
      }
    }
  }

  void Worker() {
    uint64_t seen = 0;
    auto last_work = std::chrono::steady_clock::now();
    for (;;) {
      if (stop_.load(std::memory_order_relaxed)) return;
      uint64_t t = ticket_.load(std::memory_order_acquire);
      if ((t >> 32) != seen && static_cast<uint32_t>(t) != kRetired) {
        active_.fetch_add(1, std::memory_order_seq_cst);
        t = ticket_.load(std::memory_order_seq_cst);
        if ((t >> 32) != seen && static_cast<uint32_t>(t) != kRetired) {
          seen = t >> 32;
          Drain(seen);
        }
        active_.fetch_sub(1, std::memory_order_seq_cst);
        last_work = std::chrono::steady_clock::now();
        continue;
      }
      for (int i = 0; i < 64; ++i) cpu_relax();
      auto now = std::chrono::steady_clock::now();
      if (now - last_work < std::chrono::microseconds(spin_us_)) continue;
      std::unique_lock<std::mutex> lk(mu_);
      sleepers_.fetch_add(1, std::memory_order_seq_cst);
      cv_.wait(lk, [&] {
        uint64_t v = ticket_.load(std::memory_order_seq_cst);
        return stop_.load() || ((v >> 32) != seen && static_cast<uint32_t>(v) != kRetired);
      });
      sleepers_.fetch_sub(1, std::memory_order_seq_cst);
      last_work = std::chrono::steady_clock::now();
    }
  }

  std::vector<std::thread> workers_;
  std::mutex run_mu_, mu_;
  std::condition_variable cv_;
  std::atomic<uint64_t> ticket_{kRetired};
  std::atomic<uint32_t> done_{0};
  std::atomic<int> active_{0}, sleepers_{0};
  std::atomic<bool> stop_{false};
  TaskFn fn_ = nullptr;
  void* ctx_ = nullptr;
  uint32_t n_ = 0;
  int spin_us_ = 500;
};

std::mutex g_pool_mu;
Pool* g_pool = nullptr;  // intentionally never destroyed at exit (threads may still spin)
int g_threads = 0;

Pool* pool() {
  std::lock_guard<std::mutex> g(g_pool_mu);
  if (!g_pool) {
    if (g_threads <= 0) g_threads = env_int("JAXVT_CPU_THREADS", 0);
    if (g_threads <= 0) g_threads = affinity_cpus();
    g_pool = new Pool(g_threads);
  }
  return g_pool;
}

}  // namespace

void parallel_for(int64_t n, TaskFn fn, void* ctx) {
  if (n <= 0) return;
  Pool* p = n > 1 ? pool() : nullptr;
  if (p && p->threads() > 1 && p->Run(n, fn, ctx)) return;
  for (int64_t i = 0; i < n; ++i) fn(ctx, i);
}

int num_threads() { return pool()->threads(); }

void set_num_threads(int n) {
  std::lock_guard<std::mutex> g(g_pool_mu);
  delete g_pool;  // joins the old workers; callers must not be inside parallel_for
  g_pool = nullptr;
  g_threads = n;
}

}  // namespace jaxvt::cpu
