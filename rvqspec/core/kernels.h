// What the CPU kernels share (fused.cpp: the decoder layer's elementwise work; int8.cpp: w8a8's and w8a16's
// integer side; bf16.cpp: bfloat16's GEMM): the grain of their parallel loops, loads/stores that gcc vectorises, and
// a native stack's threads (`Team`).
#pragma once
#include <ATen/ATen.h>
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <functional>
#include <vector>

namespace rvqspec {

constexpr int64_t GRAIN_ELEMENTS = 1 << 15;  // rows per task: at least this many elements (small calls: 1 task)

inline int64_t grain(int64_t width) { return std::max<int64_t>(1, GRAIN_ELEMENTS / std::max<int64_t>(width, 1)); }

// Loads and stores in plain C (bit operations for bfloat16, round to nearest even), so that gcc vectorises
// the loops; c10's conversions carry a NaN branch that keeps them scalar.
template <typename T, typename A> inline A load(const T* p, int64_t i) { return static_cast<A>(p[i]); }
template <typename T, typename A> inline void store(T* p, int64_t i, A v) { p[i] = static_cast<T>(v); }
template <> inline float load<c10::BFloat16, float>(const c10::BFloat16* p, int64_t i) {
  uint32_t bits = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
}
template <> inline void store<c10::BFloat16, float>(c10::BFloat16* p, int64_t i, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);  // round to nearest even (finite values; NaN is not expected here)
  reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(bits >> 16);
}
// v rounded to the dtype T and back (the roundings of the plain path).
template <typename T, typename A> inline A round_to(A v) {
  T t;
  store<T, A>(&t, 0, v);
  return load<T, A>(&t, 0);
}

// A spin-wait's hint to the core (x86's PAUSE: the sibling hyperthread gets the core, the loop costs less power).
inline void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#endif
}

// A stack's threads (`with_team`): thread 0 runs the stack and hands each matrix's chunks of blocks to the team
// (`run`); the others wait for the next matrix between them (a fork-join region per matrix put the second thread to
// sleep between matrices under OMP_WAIT_POLICY=PASSIVE and cost its wake-up each time). Chunks are claimed, not
// assigned: thread 0 never waits for a thread that is not running (the speech decoder on the other core): it takes
// every chunk left and waits only for chunks others have started. Thread 0 claims from the front, the others from
// the back, so that on 2 threads each reads one contiguous stream (the hardware prefetcher's ramp once per matrix).
// Every wait spins for SPIN_US, then sleeps on a futex (std::atomic::wait): a thread sharing a core with the one it
// waits for must give that core up, and a thread that keeps spinning looks like a CPU hog to the scheduler, which
// then preempts it mid-chunk under load.
class Team {
 public:
  // chunk(i) for i in [0, count), on every thread of the team; returns once all are done.
  void run(int64_t count, const std::function<void(int64_t)>& chunk) {
    TORCH_CHECK(count < SIDE, "native stack: too many chunks in one matrix");
    const uint64_t generation = ((counter_.load() >> GENERATION) + 1) & 0xffffu;  // wraps with the field
    jobs_[generation & 1] = &chunk;
    counter_.store((generation << GENERATION) | static_cast<uint64_t>(count));  // front 0, back count
    counter_.notify_all();  // no system call where no thread sleeps on it
    for (int64_t i; (i = claim(generation, true)) >= 0;) chunk(i);
    wait_while(busy_, [&] { return busy_.load() != 0; });
  }

  // A worker's loop until stop().
  void work() {
    uint64_t seen = 0;
    for (;;) {
      wait_while(counter_, [&] { return counter_.load() >> GENERATION == seen && !stopped_.load(); });
      if (stopped_.load()) return;
      const uint64_t generation = counter_.load() >> GENERATION;
      busy_.fetch_add(1);
      // jobs_[generation & 1] is stable while this generation is current and we are busy
      for (int64_t i; (i = claim(generation, false)) >= 0;) (*jobs_[generation & 1])(i);
      if (busy_.fetch_sub(1) == 1) busy_.notify_all();
      seen = generation;
    }
  }

  void stop() {
    stopped_.store(true);
    counter_.fetch_add(uint64_t{1} << GENERATION);  // a change that sleeping workers wake up to
    counter_.notify_all();
  }

 private:
  // counter_: generation (16 bits) | front (24) | back (24): chunks [front, back) are unclaimed.
  static constexpr int GENERATION = 48, FRONT = 24;
  static constexpr int64_t SIDE = int64_t{1} << FRONT;
  static constexpr int64_t SPIN_US = 20;  // longer than most gaps between a layer's matrices at a few rows

  // The next chunk of `generation` from the front or the back, or -1 where none is left (or the generation is over).
  int64_t claim(uint64_t generation, bool front) {
    for (uint64_t now = counter_.load();;) {
      const int64_t first = (now >> FRONT) & (SIDE - 1), end = now & (SIDE - 1);
      if (now >> GENERATION != generation || first >= end) return -1;
      const uint64_t next = front ? now + (uint64_t{1} << FRONT) : now - 1;
      if (counter_.compare_exchange_weak(now, next)) return front ? first : end - 1;
    }
  }

  // Waits while waiting() holds: spins for SPIN_US, then sleeps until `word` changes.
  template <typename T, typename Waiting>
  static void wait_while(std::atomic<T>& word, const Waiting& waiting) {
    const auto start = std::chrono::steady_clock::now();
    for (int64_t looks = 1; waiting(); ++looks) {
      spin_pause();
      if (looks % 64 == 0 && std::chrono::steady_clock::now() - start > std::chrono::microseconds(SPIN_US)) {
        for (T now = word.load(); waiting(); now = word.load()) word.wait(now);
        return;
      }
    }
  }

  std::atomic<uint64_t> counter_{0};
  std::atomic<int> busy_{0};  // workers inside a generation
  std::atomic<bool> stopped_{false};
  const std::function<void(int64_t)>* jobs_[2] = {};  // by generation's parity: a late worker reads the one it saw
};

// Defined in snake.cpp: the 12 Hz speech decoder's SnakeBeta activation in one pass.
at::Tensor snake(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, double eps);

// Defined in int8.cpp, registered with the module in fused.cpp.
std::vector<at::Tensor> quantize_rows(const at::Tensor& x);
at::Tensor scale_rows(const at::Tensor& acc, const at::Tensor& scale, const at::Tensor& like);
bool has_int8_gemm();
at::Tensor huge_pages(const at::Tensor& t);
bool has_vnni_gemm();
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t out_features);
at::Tensor vnni_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& offsets,
                       int64_t out_features);
// with_team (int8.cpp) runs body on thread 0 of a parallel region of `threads` threads (a `Team`), the others taking
// chunks of each *_linear_on(team, ...) until body returns; body(nullptr) where there is no team (1 thread, no OpenMP,
// already inside a parallel region). *_linear_on(nullptr, ...) = *_linear (at::parallel_for). vnni_linear_on's
// `stream`: the weights are read once and not again soon (a layer stack), so a call of few rows keeps them out of the
// caches (int8.cpp: VPREFETCH_ROWS).
void with_team(int threads, const std::function<void(Team*)>& body);
at::Tensor vnni_linear_on(Team* team, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const at::Tensor& offsets, int64_t out_features, bool stream = false);
at::Tensor int8_linear_on(Team* team, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          int64_t out_features);
at::Tensor w8a16_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t out_features);
// Defined in bf16.cpp, registered in fused.cpp too.
bool has_bf16_gemm();
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features);
at::Tensor bf16_linear_on(Team* team, const at::Tensor& x, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias, int64_t out_features);

}  // namespace rvqspec
