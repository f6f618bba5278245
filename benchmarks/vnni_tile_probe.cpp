// The VNNI tile (`core/int8.cpp`: vnni_tile) of R rows alone, through the 0.6B predictor's 20 layer matrices (79 MB
// of packed int8), in variants that `int8.cpp`'s comments and docs/cpu-fast-path.md cite (issue 51): the software
// prefetch (none; prefetcht1/t0/nta, 2-16 KiB ahead), the activations as vpdpbusd's broadcast memory operand
// (m32{1to16}), two blocks of 16 channels per tile, and the weights on small pages or on transparent huge pages, all
// in one process, interleaved; and with `hot` every block the same 16 KiB (the weights in L1: the tile's compute
// floor). Times are the thread's CPU time (on a shared machine wall time mostly measures the wait for a core); medians.
// Only the integer sums are computed (no bits to check here: tests/test_int8.py checks the kernel's).
//
//   g++ -O3 -march=native -o /tmp/vnni_tile_probe benchmarks/vnni_tile_probe.cpp
//   /tmp/vnni_tile_probe ROWS [ROUNDS] [hot]      # ROWS: 2, 4, 5, 6, 9 or 12
#include <immintrin.h>
#include <sys/mman.h>
#include <time.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "probe.h"

namespace {

constexpr int64_t COLS = 16, PAGE = int64_t{1} << 21;
enum Operand { BROADCAST, EMBEDDED };  // set1 then vpdpbusd reg, reg / vpdpbusd m32{1to16}, weights unsigned
enum Hint { T1, T0, NTA, NONE };


inline __m512i dpbusd_embedded(__m512i acc, __m512i w, const uint8_t* x) {
  asm("vpdpbusd %[x]%{1to16%}, %[w], %[acc]"
      : [acc] "+v"(acc)
      : [w] "v"(w), [x] "m"(*reinterpret_cast<const int32_t*>(x)));
  return acc;
}

template <Hint H>
inline void prefetch(const int8_t* p) {
  if constexpr (H == T1) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  if constexpr (H == T0) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T0);
  if constexpr (H == NTA) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_NTA);
}

// R rows x `blocks` (1 or 2) adjacent blocks of 16 channels; one broadcast feeds every block's vpdpbusd.
template <int R, Operand O, Hint H, int BLOCKS>
__attribute__((noinline)) void tile(const uint8_t* a, int64_t kp, const int8_t* w, int64_t ahead, __m512i* sums) {
  __m512i acc[BLOCKS][R];
  for (auto& block : acc)
    for (auto& v : block) v = _mm512_setzero_si512();
  const int8_t* end = w + kp * COLS;
#pragma GCC unroll 1
  for (; w < end; w += COLS * 4, a += 4 * R) {
    __m512i wv[BLOCKS];
    for (int b = 0; b < BLOCKS; ++b) {
      prefetch<H>(w + b * kp * COLS + ahead);
      wv[b] = _mm512_loadu_si512(w + b * kp * COLS);
    }
    for (int r = 0; r < R; ++r) {
      int32_t four;
      std::memcpy(&four, a + 4 * r, 4);
      for (int b = 0; b < BLOCKS; ++b)
        acc[b][r] = O == BROADCAST ? dpbusd(acc[b][r], _mm512_set1_epi32(four), wv[b])
                                   : dpbusd_embedded(acc[b][r], wv[b], a + 4 * r);
    }
  }
  for (int r = 0; r < R; ++r) sums[r] = BLOCKS == 1 ? acc[0][r] : _mm512_add_epi32(acc[0][r], acc[BLOCKS - 1][r]);
}

struct Matrix {
  int64_t n, k;
  int8_t* w;
};

// The 20 matrices (out, in) with random bytes, on huge pages (their own mapping, advised first) or small ones.
std::vector<Matrix> matrices(bool huge) {
  const int64_t shapes[4][2] = {{4096, 1024}, {1024, 2048}, {6144, 1024}, {1024, 3072}};
  std::vector<Matrix> out;
  srand(0);
  for (int layer = 0; layer < 5; ++layer)
    for (const auto& s : shapes) {
      const int64_t bytes = s[0] * s[1];
      auto* base = static_cast<int8_t*>(mmap(nullptr, bytes + PAGE, PROT_READ | PROT_WRITE,
                                             MAP_PRIVATE | MAP_ANONYMOUS, -1, 0));
      auto* w = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(base) + PAGE - 1) / PAGE * PAGE);
      madvise(w, bytes, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
      for (int64_t i = 0; i < bytes; ++i) w[i] = static_cast<int8_t>(rand() % 255 - 127);
      out.push_back({s[0], s[1], w});
    }
  return out;
}

struct Variant {
  std::string name;
  void (*tile)(const uint8_t*, int64_t, const int8_t*, int64_t, __m512i*);
  int64_t ahead;
  int blocks;
  bool huge;
};

template <int R>
std::vector<Variant> variants() {
  std::vector<Variant> v = {
      {"t1 4 KiB (before)", tile<R, BROADCAST, T1, 1>, 4096, 1, false},
      {"none", tile<R, BROADCAST, NONE, 1>, 0, 1, false},
      {"t1 2 KiB", tile<R, BROADCAST, T1, 1>, 2048, 1, false},
      {"t1 8 KiB", tile<R, BROADCAST, T1, 1>, 8192, 1, false},
      {"t1 16 KiB", tile<R, BROADCAST, T1, 1>, 16384, 1, false},
      {"t0 8 KiB", tile<R, BROADCAST, T0, 1>, 8192, 1, false},
      {"nta 8 KiB", tile<R, BROADCAST, NTA, 1>, 8192, 1, false},
      {"embedded broadcast, t1 4 KiB", tile<R, EMBEDDED, T1, 1>, 4096, 1, false},
      {"2 blocks a tile, t1 4 KiB", tile<R, BROADCAST, T1, 2>, 4096, 2, false}};
  const size_t small = v.size();
  for (size_t i = 0; i < small; ++i) {
    v.push_back(v[i]);
    v.back().name += ", huge pages";
    v.back().huge = true;
  }
  return v;
}

}  // namespace

int main(int argc, char** argv) {
  const int rows = argc > 1 ? atoi(argv[1]) : 9, rounds = argc > 2 ? atoi(argv[2]) : 21;
  const bool hot = argc > 3 && std::string(argv[3]) == "hot";
  std::vector<Variant> vs;
  switch (rows) {
    case 2: vs = variants<2>(); break;
    case 4: vs = variants<4>(); break;
    case 5: vs = variants<5>(); break;
    case 6: vs = variants<6>(); break;
    case 9: vs = variants<9>(); break;
    case 12: vs = variants<12>(); break;
    default: fprintf(stderr, "rows: 2, 4, 5, 6, 9 or 12\n"); return 1;
  }
  const std::vector<Matrix> small = matrices(false), huge = matrices(true);
  std::vector<uint8_t> activations(3072 * 12);
  for (auto& v : activations) v = static_cast<uint8_t>(rand());
  int64_t weights = 0;
  for (const auto& m : small) weights += m.n * m.k;
  std::vector<std::vector<double>> ms(vs.size());
  int32_t sink = 0;
  for (int round = 0; round < rounds; ++round)
    for (size_t j = 0; j < vs.size(); ++j) {
      const Variant& v = vs[round % 2 ? vs.size() - 1 - j : j];
      const double start = cpu_ms();
      __m512i sums[12] = {};
      for (const auto& m : v.huge ? huge : small)
        for (int64_t b = 0; b < m.n / COLS; b += v.blocks) {
          v.tile(activations.data(), m.k, hot ? m.w : m.w + b * m.k * COLS, v.ahead, sums);
          sink += _mm512_reduce_add_epi32(sums[0]);
        }
      ms[&v - vs.data()].push_back(cpu_ms() - start);
    }
  printf("%d rows through the 0.6B predictor's 20 matrices%s, medians of %d interleaved rounds (sink %d)\n", rows,
         hot ? " (every block the same 16 KiB: in L1)" : "", rounds, sink & 1);
  double first = 0;
  for (size_t i = 0; i < vs.size(); ++i) {
    std::sort(ms[i].begin(), ms[i].end());
    const double median = ms[i][ms[i].size() / 2];
    first = i == 0 ? median : first;
    printf("%-42s %7.3f ms %6.2fx %6.0f GOP/s\n", vs[i].name.c_str(), median, median / first,
           2.0 * weights * rows / median / 1e6);
  }
}
