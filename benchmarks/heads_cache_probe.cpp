// Whether a w8a8 round's heads stay in cache across its verify call (`core/int8.cpp`: VPREFETCH_ROWS, issue 51). A round
// reads 2 MB int8 heads for its drafts (one row), then R rows through the 0.6B predictor's 20 layer matrices (79 MB,
// more than the 32 MB L3), then again the heads its walk visits: the VNNI tile of `int8.cpp` (R rows x 16 channels,
// vpdpbusd) through matrices and heads on huge pages, the matrices read with each software hint in turn (none; the
// kernel's prefetcht1 8 KiB ahead from 6 rows; prefetchnta at the line read or ahead), interleaved, one process; the
// thread's CPU time per call, medians. A head read from memory against one read from L3 (the same head twice): the
// walk's gain, were its heads kept.
//
//   g++ -O3 -march=native -o /tmp/heads_cache_probe benchmarks/heads_cache_probe.cpp
//   /tmp/heads_cache_probe ROWS [ROUNDS]      # ROWS: 1, 2, 4, 5 or 9
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
enum Hint { NONE, T1, NTA };


template <Hint H>
inline void prefetch(const int8_t* p) {
  if constexpr (H == T1) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_T1);
  if constexpr (H == NTA) _mm_prefetch(reinterpret_cast<const char*>(p), _MM_HINT_NTA);
}

// R rows x one block of 16 channels (one row: four chains of sums, as int8.cpp's tile), the hint `ahead` bytes on.
template <int R, Hint H>
__attribute__((noinline)) void tile(const uint8_t* a, int64_t kp, const int8_t* w, int64_t ahead, __m512i* sums) {
  constexpr int CHAINS = R == 1 ? 4 : 1;
  __m512i acc[R][CHAINS];
  for (auto& row : acc)
    for (auto& v : row) v = _mm512_setzero_si512();
  for (const int8_t* end = w + kp * COLS; w < end; w += COLS * 4 * CHAINS, a += 4 * R * CHAINS)
    for (int c = 0; c < CHAINS; ++c) {
      prefetch<H>(w + c * 64 + ahead);
      const __m512i wv = _mm512_loadu_si512(w + c * 64);
      for (int r = 0; r < R; ++r) {
        int32_t four;
        std::memcpy(&four, a + 4 * (c * R + r), 4);
        acc[r][c] = dpbusd(acc[r][c], _mm512_set1_epi32(four), wv);
      }
    }
  for (int r = 0; r < R; ++r) {
    sums[r] = acc[r][0];
    for (int c = 1; c < CHAINS; ++c) sums[r] = _mm512_add_epi32(sums[r], acc[r][c]);
  }
}

using Tile = void (*)(const uint8_t*, int64_t, const int8_t*, int64_t, __m512i*);

struct Matrix {
  int64_t n, k;
  int8_t* w;
};

Matrix random_matrix(int64_t n, int64_t k) {  // random bytes on huge pages (its own mapping, advised first)
  auto* base = static_cast<int8_t*>(mmap(nullptr, n * k + PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                                         -1, 0));
  auto* w = reinterpret_cast<int8_t*>((reinterpret_cast<uintptr_t>(base) + PAGE - 1) / PAGE * PAGE);
  madvise(w, n * k, MADV_HUGEPAGE);
  for (int64_t i = 0; i < n * k; ++i) w[i] = static_cast<int8_t>(rand() % 255 - 127);
  return {n, k, w};
}

int32_t sink = 0;

void multiply(const Matrix& m, Tile tile, int64_t ahead, const uint8_t* a) {
  __m512i sums[9];
  for (int64_t b = 0; b < m.n / COLS; ++b) {
    tile(a, m.k, m.w + b * m.k * COLS, ahead, sums);
    sink += _mm512_reduce_add_epi32(sums[0]);
  }
}

struct Variant {
  std::string name;
  Tile tile;
  int64_t ahead;
};

template <int R>
std::vector<Variant> variants() {
  std::vector<Variant> v = {{R >= 6 ? "prefetcht1 8 KiB ahead (int8.cpp from 6 rows)" : "none (int8.cpp below 6 rows)",
                             R >= 6 ? tile<R, T1> : tile<R, NONE>, R >= 6 ? 8192 : 0},
                            {"prefetchnta at the line read", tile<R, NTA>, 0}};
  for (int64_t ahead : {256, 1024, 8192})
    v.push_back({"prefetchnta " + std::to_string(ahead) + " B ahead", tile<R, NTA>, ahead});
  return v;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  const int rows = argc > 1 ? atoi(argv[1]) : 9, rounds = argc > 2 ? atoi(argv[2]) : 9;
  std::vector<Variant> vs;
  switch (rows) {
    case 1: vs = variants<1>(); break;
    case 2: vs = variants<2>(); break;
    case 4: vs = variants<4>(); break;
    case 5: vs = variants<5>(); break;
    case 9: vs = variants<9>(); break;
    default: fprintf(stderr, "rows: 1, 2, 4, 5 or 9\n"); return 1;
  }
  srand(0);
  std::vector<Matrix> stack, heads;
  const int64_t shapes[4][2] = {{4096, 1024}, {1024, 2048}, {6144, 1024}, {1024, 3072}};
  for (int layer = 0; layer < 5; ++layer)
    for (const auto& s : shapes) stack.push_back(random_matrix(s[0], s[1]));
  for (int h = 0; h < 15; ++h) heads.push_back(random_matrix(2048, 1024));
  std::vector<uint8_t> activations(3072 * 9);
  for (auto& v : activations) v = static_cast<uint8_t>(rand());
  const uint8_t* a = activations.data();
  std::vector<std::vector<double>> stack_ms(vs.size()), draft_ms(vs.size()), walk_ms(vs.size());
  std::vector<double> memory_ms, l3_ms;
  int first = 0;
  for (int round = 0; round < rounds; ++round)
    for (size_t j = 0; j < vs.size(); ++j) {
      const size_t i = round % 2 ? vs.size() - 1 - j : j;
      double stack_sum = 0, draft_sum = 0, walk_sum = 0;
      for (int call = 0; call < 6; ++call, first = (first + 2) % 15) {  // a frame's rounds: 3 drafts, the walk 2
        const double start = cpu_ms();
        for (int h = 0; h < 3; ++h) multiply(heads[(first + h) % 15], tile<1, NONE>, 0, a);
        const double drafted = cpu_ms();
        for (const auto& m : stack) multiply(m, vs[i].tile, vs[i].ahead, a);
        const double verified = cpu_ms();
        for (int h = 0; h < 2; ++h) multiply(heads[(first + h) % 15], tile<1, NONE>, 0, a);
        const double walked = cpu_ms();
        draft_sum += (drafted - start) / 3, stack_sum += verified - drafted, walk_sum += (walked - verified) / 2;
      }
      stack_ms[i].push_back(stack_sum / 6), draft_ms[i].push_back(draft_sum / 6), walk_ms[i].push_back(walk_sum / 6);
      for (const auto& m : stack) multiply(m, tile<1, NONE>, 0, a);  // 79 MB through the caches
      const double start = cpu_ms();
      multiply(heads[round % 15], tile<1, NONE>, 0, a);  // from memory
      const double once = cpu_ms();
      multiply(heads[round % 15], tile<1, NONE>, 0, a);  // again: from L3 (2 MB: more than L2)
      memory_ms.push_back(once - start), l3_ms.push_back(cpu_ms() - once);
    }
  printf("%d rows through the 0.6B predictor's matrices between a round's head reads; medians of %d interleaved rounds "
         "(sink %d)\n", rows, rounds, sink & 1);
  printf("a 2 MB head alone: from memory %.4f ms, from L3 %.4f ms\n", median(memory_ms), median(l3_ms));
  printf("%-48s %9s %12s %12s\n", "the matrices' hint", "stack ms", "draft head", "walk head");
  for (size_t i = 0; i < vs.size(); ++i)
    printf("%-48s %9.3f %12.4f %12.4f\n", vs[i].name.c_str(), median(stack_ms[i]), median(draft_ms[i]),
           median(walk_ms[i]));
}
