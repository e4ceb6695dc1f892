// Worker threads and instruction-set selection of the CPU backend (common/cpu_runtime.h).
#include "common/cpu_runtime.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <mutex>
#include <thread>
#include <vector>

#include "fusible/common.h"

#if defined(__linux__)
#include <pthread.h>
#include <sched.h>
#endif

namespace fusible {
namespace {

// ---- instruction set ----------------------------------------------------------------------------

CpuIsa detect_isa() {
#if FUS_CPU_X86
  __builtin_cpu_init();
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                    __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2") &&
                    __builtin_cpu_supports("popcnt");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vl");
  if (avx512) return CpuIsa::kAvx512;
  if (avx2) return CpuIsa::kAvx2;
#endif
  return CpuIsa::kBaseline;
}

CpuIsa env_isa_cap() {
  const char* e = std::getenv("FUSIBLE_CPU_ISA");
  if (e == nullptr) return CpuIsa::kAvx512;
  if (std::strcmp(e, "baseline") == 0) return CpuIsa::kBaseline;
  if (std::strcmp(e, "avx2") == 0) return CpuIsa::kAvx2;
  return CpuIsa::kAvx512;
}

std::atomic<int> g_isa_cap{static_cast<int>(CpuIsa::kAvx512)};

// ---- threads ------------------------------------------------------------------------------------

int default_threads() {
  if (const char* e = std::getenv("FUSIBLE_NUM_THREADS")) {
    const int n = std::atoi(e);
    if (n > 0) return n;
  }
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) {
    const int n = CPU_COUNT(&set);
    if (n > 0) return n;
  }
#endif
  const unsigned n = std::thread::hardware_concurrency();
  return n > 0 ? static_cast<int>(n) : 1;
}

std::atomic<int> g_threads{0};  // 0: default_threads()

thread_local bool t_in_task = false;  // this thread is running a task of a parallel_for

void run_serial(int64_t n, void (*fn)(void*, int64_t), void* ctx) {
  for (int64_t t = 0; t < n; ++t) fn(ctx, t);
}

// Persistent workers. One job at a time (run_mutex_); a worker joins a job only while it is open
// (joined_ < wanted_), and the caller closes it and waits for the joined workers before
// returning, so no worker ever touches a finished job.
class Pool {
 public:
  void run(int64_t n, void (*fn)(void*, int64_t), void* ctx, int threads) {
    std::unique_lock<std::mutex> job(run_mutex_, std::try_to_lock);
    if (!job.owns_lock()) return run_serial(n, fn, ctx);  // another thread's job is running
    int helpers = static_cast<int>(std::min<int64_t>(threads - 1, n - 1));
    {
      std::lock_guard<std::mutex> lk(m_);
      try {
        while (static_cast<int>(workers_.size()) < helpers)
          workers_.emplace_back([this] { worker(); });
      } catch (const std::exception&) {  // no more threads: run with those there are
        helpers = static_cast<int>(workers_.size());
      }
      fn_ = fn;
      ctx_ = ctx;
      n_ = n;
      next_.store(0, std::memory_order_relaxed);
      wanted_ = helpers;
      joined_ = 0;
      error_ = nullptr;
      ++generation_;
    }
    wake_.notify_all();
    work(fn, ctx, n);
    std::exception_ptr error;
    {
      std::unique_lock<std::mutex> lk(m_);
      wanted_ = 0;  // close the job: late wake-ups do not join
      done_.wait(lk, [this] { return active_ == 0; });
      error = error_;
      error_ = nullptr;
    }
    if (error) std::rethrow_exception(error);
  }

 private:
  void work(void (*fn)(void*, int64_t), void* ctx, int64_t n) {
    t_in_task = true;
    for (;;) {
      const int64_t t = next_.fetch_add(1, std::memory_order_relaxed);
      if (t >= n) break;
      try {
        fn(ctx, t);
      } catch (...) {
        std::lock_guard<std::mutex> lk(m_);
        if (!error_) error_ = std::current_exception();
      }
    }
    t_in_task = false;
  }

  void worker() {
    uint64_t seen = 0;
    std::unique_lock<std::mutex> lk(m_);
    for (;;) {
      wake_.wait(lk, [&] { return generation_ != seen; });
      seen = generation_;
      if (joined_ >= wanted_) continue;
      ++joined_;
      ++active_;
      void (*fn)(void*, int64_t) = fn_;
      void* ctx = ctx_;
      const int64_t n = n_;
      lk.unlock();
      work(fn, ctx, n);
      lk.lock();
      if (--active_ == 0) done_.notify_all();
    }
  }

  std::mutex run_mutex_;
  std::mutex m_;
  std::condition_variable wake_, done_;
  std::vector<std::thread> workers_;
  uint64_t generation_ = 0;
  void (*fn_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  int64_t n_ = 0;
  std::atomic<int64_t> next_{0};
  int wanted_ = 0, joined_ = 0, active_ = 0;
  std::exception_ptr error_;
};

// The pool is never destroyed (its workers may still be waiting at exit). A forked child has none
// of the parent's threads: it starts a new pool of its own.
std::atomic<Pool*> g_pool{nullptr};
std::mutex g_pool_mutex;

#if defined(__linux__)
void after_fork_in_child() { g_pool.store(nullptr); }
#endif

Pool& pool() {
  Pool* p = g_pool.load(std::memory_order_acquire);
  if (p != nullptr) return *p;
  std::lock_guard<std::mutex> lk(g_pool_mutex);
  p = g_pool.load(std::memory_order_acquire);
  if (p == nullptr) {
#if defined(__linux__)
    static const bool registered = (pthread_atfork(nullptr, nullptr, after_fork_in_child), true);
    (void)registered;
#endif
    p = new Pool;
    g_pool.store(p, std::memory_order_release);
  }
  return *p;
}

}  // namespace

CpuIsa cpu_isa_detected() {
  static const CpuIsa isa = detect_isa();
  return isa;
}

CpuIsa cpu_isa() {
  static const CpuIsa env_cap = env_isa_cap();
  const int cap = std::min(g_isa_cap.load(std::memory_order_relaxed), static_cast<int>(env_cap));
  return static_cast<CpuIsa>(std::min(cap, static_cast<int>(cpu_isa_detected())));
}

void set_cpu_isa_cap(CpuIsa cap) { g_isa_cap.store(static_cast<int>(cap)); }

const char* cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kBaseline: return "baseline";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "unknown";
}

int cpu_threads() {
  const int n = g_threads.load(std::memory_order_relaxed);
  if (n > 0) return n;
  static const int d = default_threads();
  return d;
}

void set_cpu_threads(int n) { g_threads.store(n > 0 ? n : 0, std::memory_order_relaxed); }

namespace {
std::atomic<bool> g_force_split{false};
}  // namespace

bool cpu_force_split() { return g_force_split.load(std::memory_order_relaxed); }
void set_cpu_force_split(bool on) { g_force_split.store(on, std::memory_order_relaxed); }

namespace detail {

void run_tasks(int64_t n, void (*fn)(void*, int64_t), void* ctx, int max_threads) {
  const int threads = std::min(cpu_threads(), max_threads);
  if (n == 1 || threads <= 1 || t_in_task) return run_serial(n, fn, ctx);
  pool().run(n, fn, ctx, threads);
}

}  // namespace detail
}  // namespace fusible

extern "C" {

void fus_cpu_set_num_threads(int n) { fusible::set_cpu_threads(n); }

int fus_cpu_num_threads(void) { return fusible::cpu_threads(); }

}  // extern "C"
