// Host-only runtime of the CPU backend: the worker threads its kernels share, and the instruction
// set their vectorised loops are compiled for. Never included by .cu files.
//
// Threads. parallel_for(n, f) runs f(0) ... f(n - 1) on up to cpu_threads() threads (the caller
// and persistent workers, created once) and returns when all have run. Every kernel splits its
// work into tasks that write disjoint outputs and compute each output with the same operations in
// the same order whichever thread runs it, so results never depend on the thread count or the
// schedule; order-independent reductions (max) combine per-task partial results, and fixed-order
// sums (dbias, dgamma) are split by columns only. A call from inside a task, or while another
// thread's call is running, runs its tasks serially on the calling thread.
//
// Instruction sets. The library is compiled for the baseline of the target (x86-64: SSE2); the hot
// loops are also compiled for AVX2+FMA and for AVX-512 through function target attributes (no
// global -m flags, so nothing else changes), and cpu_isa() picks the best the processor runs. The
// vectorised code performs exactly the scalar operations (separate IEEE multiplies and adds, the
// explicit f_fma of fp32_ops.h, integer bit manipulation), so every ISA gives the same bits; the
// tests run each one available (set_cpu_isa_cap) against the scalar reference.
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace fusible {

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__))
#define FUS_CPU_X86 1
#define FUS_TARGET_AVX2 __attribute__((target("avx2,fma,bmi,bmi2,popcnt")))
#define FUS_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,fma,bmi,bmi2,popcnt")))
#else
#define FUS_CPU_X86 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define FUS_ALWAYS_INLINE inline __attribute__((always_inline))
#else
#define FUS_ALWAYS_INLINE inline
#endif

// On a lambda whose body with_cpu_isa compiles once per instruction set.
#if defined(__GNUC__) || defined(__clang__)
#define FUS_INLINE_LAMBDA __attribute__((always_inline))
#else
#define FUS_INLINE_LAMBDA
#endif

enum class CpuIsa : int { kBaseline = 0, kAvx2 = 1, kAvx512 = 2 };

// The instruction set the kernels use: the best this processor supports, capped by the
// environment variable FUSIBLE_CPU_ISA ("baseline", "avx2", "avx512") and by set_cpu_isa_cap.
CpuIsa cpu_isa();
CpuIsa cpu_isa_detected();
void set_cpu_isa_cap(CpuIsa cap);  // CpuIsa::kAvx512: no cap
const char* cpu_isa_name(CpuIsa isa);

// Threads a CPU kernel may use: set_cpu_threads(n) (fus_cpu_set_num_threads), else the
// environment variable FUSIBLE_NUM_THREADS, else the processors this process may run on.
int cpu_threads();
void set_cpu_threads(int n);  // n <= 0: back to the default

// Tests: split every kernel's work into tasks as if it were large (the thresholds below which a
// kernel runs as one task are off), so small problems exercise the parallel paths too.
bool cpu_force_split();
void set_cpu_force_split(bool on);

namespace detail {
template <typename F>
void invoke_baseline(F& f) {
  f();
}
#if FUS_CPU_X86
template <typename F>
FUS_TARGET_AVX2 void invoke_avx2(F& f) {
  f();
}
template <typename F>
FUS_TARGET_AVX512 void invoke_avx512(F& f) {
  f();
}
#endif
void run_tasks(int64_t n, void (*fn)(void*, int64_t), void* ctx, int max_threads);
}  // namespace detail

// Runs f() compiled for the instruction set cpu_isa() (f: a lambda marked FUS_INLINE_LAMBDA, so
// that its body, and the inline functions it calls, are compiled into each variant).
template <typename F>
void with_cpu_isa(F&& f) {
#if FUS_CPU_X86
  switch (cpu_isa()) {
    case CpuIsa::kAvx512: return detail::invoke_avx512(f);
    case CpuIsa::kAvx2: return detail::invoke_avx2(f);
    case CpuIsa::kBaseline: break;
  }
#endif
  detail::invoke_baseline(f);
}

// f(t) for every t in [0, n), on up to min(cpu_threads(), max_threads) threads.
template <typename F>
void parallel_for(int64_t n, F&& f, int max_threads = 1 << 30) {
  if (n <= 0) return;
  using Fn = std::remove_reference_t<F>;
  detail::run_tasks(
      n, [](void* ctx, int64_t t) { (*static_cast<Fn*>(ctx))(t); },
      const_cast<void*>(static_cast<const void*>(&f)), max_threads);
}

// f(begin, end) over [0, n) cut into ceil(n / chunk) consecutive ranges; chunk is chosen so there
// are about 4 ranges a thread, but none shorter than min_chunk (a task has to be worth a wake-up).
template <typename F>
void parallel_ranges(int64_t n, int64_t min_chunk, F&& f) {
  if (n <= 0) return;
  const int threads = cpu_threads();
  int64_t chunk = (n + 4 * threads - 1) / (4 * threads);
  if (chunk < min_chunk) chunk = min_chunk;
  if (chunk < 1) chunk = 1;
  const int64_t tasks = (n + chunk - 1) / chunk;
  parallel_for(tasks, [&](int64_t t) {
    const int64_t b = t * chunk;
    f(b, b + chunk < n ? b + chunk : n);
  });
}

// Tasks of about 64K elements: the min_chunk of a parallel_ranges over units of elems_per_unit
// elements (1 with cpu_force_split).
inline int64_t cpu_min_units(int64_t elems_per_unit) {
  if (cpu_force_split()) return 1;
  const int64_t e = elems_per_unit > 1 ? elems_per_unit : 1;
  const int64_t u = (int64_t{1} << 16) / e;
  return u > 1 ? u : 1;
}

// Per-task partial maxima (ordered bits, common/numerics.h abs_bits) of a parallel run over n
// units in ranges of at least min_chunk: for_ranges(n, tm, f) calls f(begin, end) for each range,
// which stores its maximum in tm.at(begin); tm.max() combines them.
struct TaskMax {
  std::vector<uint32_t> v;
  int64_t chunk;
  TaskMax(int64_t n, int64_t min_chunk) {
    const int threads = cpu_threads();
    const int64_t per = (n + 4 * threads - 1) / (4 * threads);
    chunk = per > min_chunk ? per : min_chunk;
    if (chunk < 1) chunk = 1;
    v.assign(static_cast<size_t>((n + chunk - 1) / chunk), 0u);
  }
  uint32_t& at(int64_t begin) { return v[static_cast<size_t>(begin / chunk)]; }
  uint32_t max() const {
    uint32_t m = 0;
    for (uint32_t x : v) m = x > m ? x : m;
    return m;
  }
};

template <typename F>
void for_ranges(int64_t n, const TaskMax& tm, F&& f) {
  const int64_t chunk = tm.chunk;
  parallel_for(static_cast<int64_t>(tm.v.size()), [&](int64_t t) {
    const int64_t b = t * chunk;
    f(b, b + chunk < n ? b + chunk : n);
  });
}

}  // namespace fusible
