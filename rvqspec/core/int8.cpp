// The integer side of int8 weights (core/quantize.py): w8a8's per-token activations, the GEMMs of CPUs without
// int8 dot-product instructions (AVX2, AVX-512 without VNNI), where oneDNN sums byte products in saturating 16-bit
// lanes (not exact) and torch's weight-only kernel is slower than float32 (issue 45's table), and w8a8's GEMM of
// the AVX-512 VNNI CPUs for decoding's few rows (vnni_linear, below), where oneDNN's costs ~1.8x per call (issue 51).
//
// int8_linear (w8a8): activation bytes are widened to int16 once per call, weight bytes on load, and
// _mm256_madd_epi16 sums pairs of int16 products into int32: every product and sum is an exact integer (|sum| <=
// 127 x 127 x K < 2^31 for K < 133,000), so a row's int32 sums are the ones VNNI and AMX compute, and the float
// steps after them (float(sum) x weight scale, then x token scale, then the dtype) are oneDNN's and scale_rows'
// in the same order: the same w8a8 model gives the same bits on every x86 class (tests/test_int8.py). (GGML's Q8_0
// dot moves x's sign onto the weight and multiplies unsigned by signed bytes (_mm256_maddubs_epi16); that costs
// a sign op per row and weight vector where the widening costs one per weight vector: slower from two rows on.)
// w8a16_linear: float32 activations times weight bytes widened to float in registers, fused multiply-adds in a
// fixed order, then x the weight scale (as torch's _weight_int8pack_mm): it reads a quarter of float32's bytes.
//
// Both read weights packed once (`pack_int8` in quantize.py): [ceil(N/4), ceil(K/16), 4, 16] bytes, so that a
// block of 4 output channels streams contiguously; K and N are zero-padded. Tiles of up to 3 rows x 4 channels (or, one
// row on Zen, 1 row x two blocks: `row_pair`) keep their sums in registers; every row's sums run in the same order
// whatever the tile or the call's other rows, so a row has the same bits in a one-row call as inside a verify call of
// any size.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <atomic>
#include <chrono>
#include <cmath>
#include <exception>
#include <functional>
#include <limits>
#include <type_traits>
#ifdef __linux__
#include <sys/mman.h>
#endif
#ifdef _OPENMP
#include <omp.h>
#endif

#include "kernels.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define RVQSPEC_INT8_GEMM 1
#endif
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define RVQSPEC_VNNI_GEMM 1
#endif

namespace rvqspec {

namespace {

// w8a8's per-token int8 of one row of d values: s = max(max|x|, 1e-12) / 127 and q = round_half_even(x / s),
// written as q + offset (offset 128: oneDNN's unsigned bytes; 0: the AVX2 GEMM's int16), in float32 as the plain
// ops compute it (quantize.quantize_tokens: the same bits). Both loops vectorise: max is exact in any order;
// |x / s| <= 127 (1 + 2^-23) since |x| <= max|x|, so it rounds into [-127, 127] and a clamp would be a no-op (left
// out: with it gcc's loop ran 5x slower); adding and taking away 1.5 * 2^23 rounds half to even as nearbyint does
// (|v| < 2^22; gcc keeps the pair without -ffast-math). A row holding NaN or inf (x * 0 summed is NaN then) gets
// scale NaN and q = 0, so its output is NaN, as in the plain ops. Returns s.
template <typename T, typename Q>
inline float quantize_row(const T* x, int64_t d, Q* q, int32_t offset) {
  constexpr float ROUND = 12582912.f;  // 1.5 * 2^23
  float top = 0, finite = 0;
#pragma omp simd reduction(max : top) reduction(+ : finite)
  for (int64_t i = 0; i < d; ++i) {
    const float v = load<T, float>(x, i);
    top = std::max(top, std::fabs(v));
    finite += v * 0.f;
  }
  if (std::isnan(finite)) {
    std::fill(q, q + d, static_cast<Q>(offset));
    return std::numeric_limits<float>::quiet_NaN();
  }
  const float s = std::max(top, 1e-12f) / 127.f;
#pragma omp simd
  for (int64_t i = 0; i < d; ++i) {
    const float v = load<T, float>(x, i) / s;
    q[i] = static_cast<Q>(static_cast<int32_t>((v + ROUND) - ROUND) + offset);
  }
  return s;
}

#ifdef RVQSPEC_INT8_GEMM
constexpr int64_t COLS = 4, DEPTH = 16;  // the packed block: channels x values per step
// A tile's rows: w8a8's 12 vectors of sums + 3 rows + a weight vector fill the 16 registers (w8a16's 12 + the two
// halves of a weight vector, its rows read from L1); each widened weight vector then feeds 3 rows, and a 9-row verify
// call passes 3 times over a block, not 5. Against 2-row tiles (capped avx2 on Zen 4, 1 thread, CPU time): 9-33 rows
// 0.75-0.88x (w8a8), 0.81-0.86x (w8a16).
constexpr int64_t ROWS = 3;
// Each step of a tile reads one 64-byte line of weights; asking for the line 2 KiB ahead keeps enough reads in flight
// for one core to stream from memory on Intel: 7.6 -> 10.6 GB/s at one row (Xeon, AVX2 caps, interleaved runs). On AMD
// Zen (gcc's -march=native names it) the hardware prefetcher follows one row's stream alone and the software one
// slowed it: one row through the 0.6B predictor's matrices 1.15-1.2x slower (Zen 4 under the AVX2 caps, 1 thread, CPU
// time; the VNNI tile's finding too), so there a one-row tile asks for the line it reads (0: no prefetch in effect).
// More rows than a tile's: the tiles pass over a block several times and ask for the next block's line at the same
// place (a block ahead): 1.1-1.2x faster at 4-33 rows than no prefetch on that Zen 4.
constexpr int64_t PREFETCH_BYTES = 2048;
#if defined(__znver1__) || defined(__znver2__) || defined(__znver3__) || defined(__znver4__) || defined(__znver5__)
constexpr int64_t ONE_ROW_PREFETCH_BYTES = 0;
#else
constexpr int64_t ONE_ROW_PREFETCH_BYTES = PREFETCH_BYTES;
#endif

// Four vectors of sums -> their four totals, always in this order.
inline __m128i total4(__m256i a, __m256i b, __m256i c, __m256i d) {
  const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(a, b), _mm256_hadd_epi32(c, d));
  return _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}
inline __m128 total4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 s = _mm256_hadd_ps(_mm256_hadd_ps(a, b), _mm256_hadd_ps(c, d));
  return _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
}

// gcc 12's partial redundancy elimination copies the tiles' sums through the stack at every step (12 stores per step at
// 3 rows; 1.1-1.2x slower): the tiles and their loop are compiled without it.
#pragma GCC push_options
#pragma GCC optimize("no-tree-pre")

// A tile: R <= 3 rows of activations (row stride kp) x one packed block -> sums [R][COLS] as floats times the weight
// scales. w8a8: int16 activations, exact int32 sums (vpmaddwd: two products per lane). The sums are named variables,
// not an array (gcc kept an array of vectors in memory).
template <int R>
inline void tile(const int16_t* a, int64_t kp, const int8_t* w, const float* wscale, int64_t ahead, float (*out)[COLS]) {
  const __m256i zero = _mm256_setzero_si256();
  __m256i s00 = zero, s01 = zero, s02 = zero, s03 = zero, s10 = zero, s11 = zero, s12 = zero, s13 = zero, s20 = zero,
          s21 = zero, s22 = zero, s23 = zero;
  for (const int16_t* end = a + kp; a < end; a += DEPTH, w += COLS * DEPTH) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + ahead, _MM_HINT_T0);
    const auto row = [&](int r) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a + r * kp)); };
    const __m256i x0 = row(0), x1 = R > 1 ? row(1) : zero, x2 = R > 2 ? row(2) : zero;
    const auto step = [&](int c, __m256i& y0, __m256i& y1, __m256i& y2) {
      const __m256i wc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * DEPTH)));
      y0 = _mm256_add_epi32(_mm256_madd_epi16(x0, wc), y0);
      if constexpr (R > 1) y1 = _mm256_add_epi32(_mm256_madd_epi16(x1, wc), y1);
      if constexpr (R > 2) y2 = _mm256_add_epi32(_mm256_madd_epi16(x2, wc), y2);
    };
    step(0, s00, s10, s20);
    step(1, s01, s11, s21);
    step(2, s02, s12, s22);
    step(3, s03, s13, s23);
  }
  const __m128 ws = _mm_loadu_ps(wscale);
  const auto finish = [&](int r, __m256i a0, __m256i a1, __m256i a2, __m256i a3) {
    _mm_storeu_ps(out[r], _mm_mul_ps(_mm_cvtepi32_ps(total4(a0, a1, a2, a3)), ws));
  };
  finish(0, s00, s01, s02, s03);
  if constexpr (R > 1) finish(1, s10, s11, s12, s13);
  if constexpr (R > 2) finish(2, s20, s21, s22, s23);
}

// w8a16: float32 activations, fused multiply-adds in a fixed order.
template <int R>
inline void tile(const float* a, int64_t kp, const int8_t* w, const float* wscale, int64_t ahead, float (*out)[COLS]) {
  __m256 acc[R][COLS];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < COLS; ++c) acc[r][c] = _mm256_setzero_ps();
  for (int64_t k = 0; k < kp; k += DEPTH, w += COLS * DEPTH) {
    _mm_prefetch(reinterpret_cast<const char*>(w) + ahead, _MM_HINT_T0);
    __m256 lo[R], hi[R];
    for (int r = 0; r < R; ++r) {
      lo[r] = _mm256_loadu_ps(a + r * kp + k);
      hi[r] = _mm256_loadu_ps(a + r * kp + k + 8);
    }
    for (int c = 0; c < COLS; ++c) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * DEPTH));
      const __m256 wlo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(bytes));
      const __m256 whi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(bytes, 8)));
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(hi[r], whi, _mm256_fmadd_ps(lo[r], wlo, acc[r][c]));
    }
  }
  const __m128 ws = _mm_loadu_ps(wscale);
  for (int r = 0; r < R; ++r)
    _mm_storeu_ps(out[r], _mm_mul_ps(total4(acc[r][0], acc[r][1], acc[r][2], acc[r][3]), ws));
}

// One row of int16 activations x two blocks read side by side -> out[2][COLS], the sums tile<1> gives each block (exact
// integers, then the same float steps): two streams of weights in flight on one core, where one stream left the
// core's reads short of what a second core's copy needs of it (docs/cpu-fast-path.md; one row through the 0.6B
// predictor's stack 1.03-1.04x faster on 1 thread, in a team's chunks too: Zen 4 under the AVX2 caps, CPU time,
// interleaved).
inline void row_pair(const int16_t* a, int64_t kp, const int8_t* w0, const int8_t* w1, const float* wscale0,
                     const float* wscale1, float (*out)[COLS]) {
  const __m256i zero = _mm256_setzero_si256();
  __m256i s00 = zero, s01 = zero, s02 = zero, s03 = zero, s10 = zero, s11 = zero, s12 = zero, s13 = zero;
  for (const int16_t* end = a + kp; a < end; a += DEPTH, w0 += COLS * DEPTH, w1 += COLS * DEPTH) {
    const __m256i x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a));
    const auto step = [&](const int8_t* w, int c, __m256i& y) {
      const __m256i wc = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w + c * DEPTH)));
      y = _mm256_add_epi32(_mm256_madd_epi16(x, wc), y);
    };
    step(w0, 0, s00), step(w1, 0, s10), step(w0, 1, s01), step(w1, 1, s11);
    step(w0, 2, s02), step(w1, 2, s12), step(w0, 3, s03), step(w1, 3, s13);
  }
  _mm_storeu_ps(out[0], _mm_mul_ps(_mm_cvtepi32_ps(total4(s00, s01, s02, s03)), _mm_loadu_ps(wscale0)));
  _mm_storeu_ps(out[1], _mm_mul_ps(_mm_cvtepi32_ps(total4(s10, s11, s12, s13)), _mm_loadu_ps(wscale1)));
}

// Every tile of a call's rows over one block (channels from `col`), `finish(row, channel, value)` for each output kept.
template <typename A, typename Finish>
__attribute__((noinline)) void block_rows(const A* a, int64_t rows, int64_t kp, const int8_t* w, const float* wscale,
                                          int64_t col, int64_t n, const Finish& finish) {
  const int64_t ahead = rows > ROWS ? kp * COLS : rows > 1 ? PREFETCH_BYTES : ONE_ROW_PREFETCH_BYTES;
  float out[ROWS][COLS];
  for (int64_t r = 0; r < rows; r += ROWS) {
    const int64_t count = std::min(ROWS, rows - r);
    if (count == ROWS) tile<ROWS>(a + r * kp, kp, w, wscale, ahead, out);
    else if (count == 2) tile<2>(a + r * kp, kp, w, wscale, ahead, out);
    else tile<1>(a + r * kp, kp, w, wscale, ahead, out);
    for (int64_t i = 0; i < count; ++i)
      for (int64_t c = 0; c < COLS && col + c < n; ++c) finish(r + i, col + c, out[i][c]);
  }
}

// One row over the pairs of blocks [begin, end) of `blocks`: block u beside block u + offset (row_pair; offset: half
// the blocks, so that the two streams lie far apart: 8 blocks apart, within a team's chunk, they ran 0.86x as fast as
// one stream), block u alone where it has no partner (an odd count's middle block).
template <typename Finish>
__attribute__((noinline)) void row_over_pairs(const int16_t* a, int64_t kp, const int8_t* pw, const float* wscale,
                                              int64_t begin, int64_t end, int64_t offset, int64_t blocks, int64_t n,
                                              const Finish& finish) {
  const int64_t block_bytes = kp * COLS;
  float out[2][COLS];
  for (int64_t u = begin; u < end; ++u) {
    const int64_t second = u + offset;
    if (second >= blocks) {
      block_rows(a, 1, kp, pw + u * block_bytes, wscale + u * COLS, u * COLS, n, finish);
      continue;
    }
    row_pair(a, kp, pw + u * block_bytes, pw + second * block_bytes, wscale + u * COLS, wscale + second * COLS, out);
    for (int64_t c = 0; c < COLS; ++c) finish(0, u * COLS + c, out[0][c]);  // the first of a pair is never the last
    for (int64_t c = 0; c < COLS && second * COLS + c < n; ++c) finish(0, second * COLS + c, out[1][c]);
  }
}
#pragma GCC pop_options

constexpr int64_t CHUNK = 16;  // blocks per chunk that a stack's threads claim (`Team`)

// The GEMM's loop: blocks of COLS channels split across threads, torch's or a stack's `team` (each block's weights
// stay in L1 while every tile of rows passes over them; the activations' type picks the tile).
template <typename A, typename Finish>
void gemm(const A* a, int64_t rows, int64_t kp, const at::Tensor& packed, const float* wscale, int64_t n,
          const Finish& finish, Team* team = nullptr) {
  const int8_t* pw = packed.data_ptr<int8_t>();
  const int64_t blocks = packed.size(0), block_bytes = kp * COLS;
  if constexpr (std::is_same_v<A, int16_t>) {
    // one row on Zen, where it was measured (elsewhere the one-row tile asks for its lines ahead instead): pairs of
    // blocks half the matrix apart, split as blocks are
    if (rows == 1 && ONE_ROW_PREFETCH_BYTES == 0) {
      const int64_t units = (blocks + 1) / 2, per_chunk = CHUNK / 2;
      const auto pairs = [&](int64_t begin, int64_t end) {
        row_over_pairs(a, kp, pw, wscale, begin, end, units, blocks, n, finish);
      };
      if (team == nullptr) return at::parallel_for(0, units, 32, pairs);
      return team->run((units + per_chunk - 1) / per_chunk,
                       [&](int64_t i) { pairs(i * per_chunk, std::min(units, (i + 1) * per_chunk)); });
    }
  }
  const auto span = [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      block_rows(a, rows, kp, pw + b * block_bytes, wscale + b * COLS, b * COLS, n, finish);
  };
  if (team == nullptr) return at::parallel_for(0, blocks, std::max<int64_t>(1, 64 / std::max<int64_t>(rows, 1)), span);
  team->run((blocks + CHUNK - 1) / CHUNK, [&](int64_t i) { span(i * CHUNK, std::min(blocks, (i + 1) * CHUNK)); });
}

#ifdef RVQSPEC_VNNI_GEMM
// The AVX-512 VNNI GEMM of w8a8 (vnni_linear): activations as unsigned bytes q + 128, vpdpbusd sums 4 byte products
// into each of 16 int32 lanes (no saturation: VPDPBUSD, not VPDPBUSDS), one lane per output channel; subtracting 128 x
// the channel's weight sum gives sum(q w), the exact integer sum (int32 wraps and unwraps: the total fits). Weights
// packed once (`pack_vnni` in quantize.py): [ceil(N/16), ceil(K/16) * 4, 16, 4] bytes, a block of 16 channels
// streaming contiguously, 4 input values per channel and step. The float steps after the sums are the AVX2 kernel's
// and oneDNN's: float(sum) x weight scale, then x token scale, then the dtype: the same bits on every class.
constexpr int64_t VCOLS = 16, VDEPTH = 16, VROWS = 12;  // a block's channels; K's padding; a tile's most rows
// Tiles of VPREFETCH_ROWS rows or more: each step asks for the weights' line 8 KiB ahead into L2. Such a tile spends
// ~R cycles on a line (vpdpbusd's pace) and the hardware prefetcher alone left its loads waiting on memory; fewer
// rows stream fast enough for the hardware prefetcher, and a software prefetch only slowed them. Through the 0.6B
// predictor's matrices, weights on huge pages (`huge_pages`), against 4 KiB ahead at every tile on 4 KiB pages (the
// kernel before; Zen 4, 1 thread, CPU time, medians of interleaved runs: benchmarks/vnni_tile_probe.cpp): 2 rows
// 0.65x, 4 rows 0.73x, 5 rows 0.76x without a prefetch; 6-9 rows 0.64-0.81x and 12 rows 0.83x 8 KiB ahead (2 KiB ahead
// 1.2-1.4x; prefetcht0 or prefetchnta worse than t1 from 6 rows); at 9 rows 3.3 ms, 96% of the tile's compute floor
// (its time with the weights in L1). The activations as vpdpbusd's broadcast memory operand (m32{1to16}, the weights
// then the unsigned operand) would save the broadcasts but took 2.1-2.8x the time at 9 rows on Zen 4.
constexpr int64_t VPREFETCH_BYTES = 8192, VPREFETCH_ROWS = 6;
// Tiles of fewer than VPREFETCH_ROWS rows read at memory's pace, and a call's stream of weights (79 MB through the 0.6B
// predictor's matrices) would fill the 32 MB L3 (a victim cache on Zen: what leaves L2 goes there), evicting what comes
// next: the heads that the round's drafts just read and its walk reads again. In a layer stack (`stream`: int8_layers)
// each step of such a tile marks its line non-temporal (prefetchnta at the line itself), so it stays out of L2 and L3:
// a 2 MB head read after 1-5 rows through those matrices 0.6-0.7x the time, the stack no slower (Zen 4, 1 thread, CPU
// time, medians of interleaved runs: benchmarks/heads_cache_probe.cpp). At 9 rows the hardware prefetcher, no longer
// held back by the memory's pace, brings most lines into L2 ahead of the hint: the heads 0.85-0.9x, the stack
// 1.08-1.14x slower, so tiles that prefetch keep their hint.
constexpr int64_t VCHUNK = 4;  // blocks per chunk that a stack's threads claim (`Team`)

inline int32_t four_bytes(const uint8_t* p) {
  int32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// acc + the sums of 4 byte products a (unsigned) x b (signed) per lane. In asm: gcc 12 copied every accumulator of
// _mm512_dpbusd_epi32 between registers (2 extra moves per vpdpbusd, and spills past 8 rows).
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %[b], %[a], %[acc]" : [acc] "+v"(acc) : [a] "v"(a), [b] "v"(b));
  return acc;
}

// R rows x one block of 16 channels -> R vectors of int32 sums (with the 128 offset). The tile's activations are
// interleaved ([kp / 4][R][4] bytes: `interleave`), so one pointer walks them and each row's next 4 bytes are one
// broadcast; up to 12 rows make one pass over the block's weights (R accumulators + 1 weight + 1 broadcast of 32
// vector registers), so a verify call of up to 12 rows reads the weights once, and more rows re-read them from L1/L2.
// One row: four chains of sums (integer: their order does not matter), so that the loads, not vpdpbusd's latency,
// set the pace; no software prefetch ahead there (a matrix is one contiguous stream, which the hardware prefetcher
// follows; asking for the line 2 KiB ahead made one row through the 0.6B predictor's matrices 1.15-1.48x slower, Zen
// 4), nor below VPREFETCH_ROWS rows; there STREAM marks each line non-temporal as it is read (see VPREFETCH_ROWS).
template <int R, bool STREAM = false>
inline void vnni_tile(const uint8_t* a, int64_t kp, const int8_t* w, __m512i* sums) {
  constexpr int CHAINS = R == 1 ? 4 : 1;
  __m512i acc[R][CHAINS];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < CHAINS; ++c) acc[r][c] = _mm512_setzero_si512();
  const int8_t* end = w + kp * VCOLS;
  const auto step = [&](const int8_t* w, const uint8_t* a) {
    for (int c = 0; c < CHAINS; ++c) {
      if constexpr (STREAM && R < VPREFETCH_ROWS)
        _mm_prefetch(reinterpret_cast<const char*>(w + c * VCOLS * 4), _MM_HINT_NTA);
      const __m512i wv = _mm512_loadu_si512(w + c * VCOLS * 4);
      for (int r = 0; r < R; ++r)
        acc[r][c] = dpbusd(acc[r][c], _mm512_set1_epi32(four_bytes(a + 4 * (c * R + r))), wv);
    }
  };
  if constexpr (R == 1) {  // one row: gcc unrolls the loop, as before
    for (; w < end; w += VCOLS * 4 * CHAINS, a += 4 * CHAINS) step(w, a);
  } else {  // many rows: not unrolled (gcc then spilled the accumulators)
#pragma GCC unroll 1
    for (; w < end; w += VCOLS * 4, a += 4 * R) {
      if constexpr (R >= VPREFETCH_ROWS) _mm_prefetch(reinterpret_cast<const char*>(w) + VPREFETCH_BYTES, _MM_HINT_T1);
      step(w, a);
    }
  }
  for (int r = 0; r < R; ++r) {
    __m512i s = acc[r][0];
    for (int c = 1; c < CHAINS; ++c) s = _mm512_add_epi32(s, acc[r][c]);
    sums[r] = s;
  }
}

// A call's row tiles: as few as VROWS allows, of even sizes (17 rows: 9 + 8); tile t is rows [first(t), first(t + 1)).
struct RowTiles {
  int64_t rows, count;
  int64_t first(int64_t t) const { return rows * t / count; }
};

inline RowTiles row_tiles(int64_t rows) { return {rows, (rows + VROWS - 1) / VROWS}; }

// Rows [rows, kp] of bytes -> each tile's rows as [kp / 4][R][4] at the tile's first row's offset (vnni_tile's order).
void interleave(const uint8_t* rows, int64_t kp, const RowTiles& tiles, uint8_t* out) {
  for (int64_t t = 0; t < tiles.count; ++t) {
    const int64_t r0 = tiles.first(t), count = tiles.first(t + 1) - r0;
    uint8_t* o = out + r0 * kp;
    for (int64_t r = 0; r < count; ++r)
      for (int64_t k = 0; k < kp; k += 4) std::memcpy(o + (k * count + 4 * r), rows + (r0 + r) * kp + k, 4);
  }
}

// 16 outputs of a block stored in the dtype: float32 as they are, bfloat16 rounded to nearest even by integer
// steps (store<BFloat16>'s, in 16 lanes: the same bits); other dtypes one at a time. cols < 16 (the last block of a
// width that is not a multiple of 16): one at a time.
template <typename T>
inline void store16(T* o, __m512 v, int64_t cols) {
  if constexpr (std::is_same_v<T, float>) {
    if (cols == VCOLS) return _mm512_storeu_ps(o, v);
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (cols == VCOLS) {
      const __m512i bits = _mm512_castps_si512(v), one = _mm512_set1_epi32(1);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), one);
      const __m512i rounded = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), odd));
      return _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), _mm512_cvtepi32_epi16(_mm512_srli_epi32(rounded, 16)));
    }
  }
  alignas(64) float values[VCOLS];
  _mm512_store_ps(values, v);
  for (int64_t c = 0; c < cols; ++c) store<T, float>(o, c, values[c]);
}

// One tile of `count` rows (1..VROWS) with its interleaved activations; `stream`: weights read once (a layer stack),
// kept out of the caches by the tiles below VPREFETCH_ROWS rows.
inline void vnni_tile(int64_t count, const uint8_t* a, int64_t kp, const int8_t* w, __m512i* sums, bool stream) {
  static_assert(VPREFETCH_ROWS == 6, "the tiles that stream are the cases 1 to 5");
  switch (count) {
    case 1: return stream ? vnni_tile<1, true>(a, kp, w, sums) : vnni_tile<1>(a, kp, w, sums);
    case 2: return stream ? vnni_tile<2, true>(a, kp, w, sums) : vnni_tile<2>(a, kp, w, sums);
    case 3: return stream ? vnni_tile<3, true>(a, kp, w, sums) : vnni_tile<3>(a, kp, w, sums);
    case 4: return stream ? vnni_tile<4, true>(a, kp, w, sums) : vnni_tile<4>(a, kp, w, sums);
    case 5: return stream ? vnni_tile<5, true>(a, kp, w, sums) : vnni_tile<5>(a, kp, w, sums);
    case 6: return vnni_tile<6>(a, kp, w, sums);
    case 7: return vnni_tile<7>(a, kp, w, sums);
    case 8: return vnni_tile<8>(a, kp, w, sums);
    case 9: return vnni_tile<9>(a, kp, w, sums);
    case 10: return vnni_tile<10>(a, kp, w, sums);
    case 11: return vnni_tile<11>(a, kp, w, sums);
    default: return vnni_tile<VROWS>(a, kp, w, sums);
  }
}
#endif

// The output's shape: x's [..., K] with N for K.
std::vector<int64_t> out_sizes(const at::Tensor& x, int64_t n) {
  auto sizes = x.sizes().vec();
  sizes.back() = n;
  return sizes;
}

void check_packed(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n) {
  const int64_t k = x.size(-1);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == COLS &&
              packed.size(3) == DEPTH && packed.is_contiguous(), "int8 weights not packed by quantize.pack_int8");
  TORCH_CHECK(packed.size(1) * DEPTH >= k && packed.size(1) * DEPTH < k + DEPTH && packed.size(0) * COLS >= n &&
              packed.size(0) * COLS < n + COLS, "packed int8 weights of another shape than the call's");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && scale.is_contiguous() && scale.numel() == packed.size(0) * COLS,
              "weight scales: float32, one per packed channel");
  TORCH_CHECK(k < 133000, "int8 GEMM: input width ", k, " could overflow int32 sums");
}
#endif

}  // namespace

// t's copy in memory advised for transparent huge pages (Linux, 2 MiB): a packed weight of 2 MiB or more then costs
// fewer TLB misses as a call streams it; smaller or elsewhere, a plain copy. Its own mapping, advised before its pages
// are first touched (the allocator's memory may have been touched before: small pages for good).
at::Tensor huge_pages(const at::Tensor& t) {
  constexpr size_t PAGE = size_t{1} << 21;
  const size_t bytes = t.nbytes(), size = bytes + PAGE;
#ifdef __linux__
  void* base = bytes >= PAGE ? mmap(nullptr, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
                             : MAP_FAILED;
  if (base != MAP_FAILED) {
    const auto address = reinterpret_cast<uintptr_t>(base);
    void* start = reinterpret_cast<void*>((address + PAGE - 1) / PAGE * PAGE);
    madvise(start, bytes / PAGE * PAGE, MADV_HUGEPAGE);  // the whole huge pages: the tail's small pages cost no more
    auto out = at::from_blob(start, t.sizes(), [base, size](void*) { munmap(base, size); }, t.options());
    return out.copy_(t);
  }
#endif
  return t.clone(at::MemoryFormat::Contiguous);
}

std::vector<at::Tensor> quantize_rows(const at::Tensor& x_) {
  auto x = x_.contiguous();
  const int64_t d = x.size(-1), rows = x.numel() / d;
  auto q = at::empty({rows, d}, x.options().dtype(at::kByte));
  auto scale = at::empty({rows, 1}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "quantize_rows", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    uint8_t* pq = q.data_ptr<uint8_t>();
    float* ps = scale.data_ptr<float>();
    at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) ps[r] = quantize_row<scalar_t, uint8_t>(px + r * d, d, pq + r * d, 128);
    });
  });
  return {q, scale};
}

// w8a8's way back after oneDNN: out = acc * scale (per row, float32), rounded to the dtype of `like`.
at::Tensor scale_rows(const at::Tensor& acc_, const at::Tensor& scale_, const at::Tensor& like) {
  auto acc = acc_.contiguous(), scale = scale_.contiguous();
  TORCH_CHECK(acc.scalar_type() == at::kFloat && scale.scalar_type() == at::kFloat && acc.dim() == 2);
  const int64_t rows = acc.size(0), n = acc.size(1);
  auto out = at::empty({rows, n}, acc.options().dtype(like.scalar_type()));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "scale_rows", [&] {
    const float *pa = acc.data_ptr<float>(), *ps = scale.data_ptr<float>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r)
        for (int64_t i = 0; i < n; ++i) store<scalar_t, float>(po, r * n + i, pa[r * n + i] * ps[r]);
    });
  });
  return out;
}

bool has_int8_gemm() {
#ifdef RVQSPEC_INT8_GEMM
  return true;
#else
  return false;
#endif
}

// x [..., K] (any float dtype) -> [..., n] in x's dtype: w8a8 with the packed weights and their scales.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t n) {
  return int8_linear_on(nullptr, x, packed, scale, n);
}

// The same on a stack's team (`with_team`; nullptr: at::parallel_for): chunks of CHUNK blocks.
at::Tensor int8_linear_on(Team* team, const at::Tensor& x_, const at::Tensor& packed, const at::Tensor& scale,
                          int64_t n) {
#ifdef RVQSPEC_INT8_GEMM
  auto x = x_.contiguous();
  check_packed(x, packed, scale, n);
  const int64_t k = x.size(-1), rows = x.numel() / k, kp = packed.size(1) * DEPTH;
  // The rows' int16 and their scales: buffers of the calling thread's, kept between calls, as vnni_linear_on's (an
  // allocation and a zero fill per matrix ran on thread 0 while a stack's other threads waited; thread_local: the
  // others read them through these pointers, never by name).
  thread_local std::vector<int16_t> widened;
  thread_local std::vector<float> scales;
  widened.resize(std::max<size_t>(widened.size(), rows * kp));
  scales.resize(std::max<size_t>(scales.size(), rows));
  int16_t* pa = widened.data();
  float* token_scale = scales.data();
  auto out = at::empty(out_sizes(x, n), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "int8_linear", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(k), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        token_scale[r] = quantize_row<scalar_t, int16_t>(px + r * k, k, pa + r * kp, 0);
        std::fill(pa + r * kp + k, pa + (r + 1) * kp, int16_t{0});  // times the zero-padded weights
      }
    });
    scalar_t* po = out.data_ptr<scalar_t>();
    gemm(pa, rows, kp, packed, scale.data_ptr<float>(), n, [&](int64_t r, int64_t c, float v) {
      store<scalar_t, float>(po, r * n + c, v * token_scale[r]);
    }, team);
  });
  return out;
#else
  TORCH_CHECK(false, "rvqspec's int8 GEMM needs AVX2 and FMA, which this build lacks");
#endif
}

bool has_vnni_gemm() {
#ifdef RVQSPEC_VNNI_GEMM
  return true;
#else
  return false;
#endif
}

// x [..., K] (any float dtype) -> [..., n] in x's dtype: w8a8 through the VNNI GEMM, weights packed by pack_vnni (with
// their scales and 128 x their sums per channel, int32).
at::Tensor vnni_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                       const at::Tensor& offsets, int64_t n) {
  return vnni_linear_on(nullptr, x, packed, scale, offsets, n);
}

// The same on a stack's team (`with_team`; nullptr: at::parallel_for): chunks of VCHUNK blocks.
at::Tensor vnni_linear_on(Team* team, const at::Tensor& x_, const at::Tensor& packed, const at::Tensor& scale,
                          const at::Tensor& offsets, int64_t n, bool stream) {
#ifdef RVQSPEC_VNNI_GEMM
  auto x = x_.contiguous();
  const int64_t k = x.size(-1), rows = x.numel() / k, kp = packed.size(1) * 4, blocks = packed.size(0);
  TORCH_CHECK(packed.scalar_type() == at::kChar && packed.dim() == 4 && packed.size(2) == VCOLS &&
              packed.size(3) == 4 && packed.is_contiguous() && kp % VDEPTH == 0,
              "int8 weights not packed by quantize.pack_vnni");
  TORCH_CHECK(kp >= k && kp < k + VDEPTH && blocks * VCOLS >= n && blocks * VCOLS < n + VCOLS,
              "packed int8 weights of another shape than the call's");
  TORCH_CHECK(scale.scalar_type() == at::kFloat && offsets.scalar_type() == at::kInt && scale.is_contiguous() &&
              offsets.is_contiguous() && scale.numel() == blocks * VCOLS && offsets.numel() == blocks * VCOLS,
              "weight scales (float32) and offsets (int32): one per packed channel");
  TORCH_CHECK(k < 133000, "int8 GEMM: input width ", k, " could overflow int32 sums");
  // The rows' bytes, then interleaved per tile, and their scales: a buffer of the calling thread's, kept between
  // calls (an allocation per matrix cost ~1 us, 20 per predictor call).
  // (thread_local: a team's other threads read them through these pointers, never by name.)
  thread_local std::vector<uint8_t> bytes;
  thread_local std::vector<float> scales;
  bytes.resize(std::max<size_t>(bytes.size(), 2 * rows * kp));
  scales.resize(std::max<size_t>(scales.size(), rows));
  float* token_scale = scales.data();
  auto out = at::empty(out_sizes(x, n), x.options());
  const RowTiles tiles = row_tiles(rows);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "vnni_linear", [&] {
    const scalar_t* px = x.data_ptr<scalar_t>();
    uint8_t *pq = bytes.data(), *pa = pq + rows * kp;
    for (int64_t r = 0; r < rows; ++r) {
      token_scale[r] = quantize_row<scalar_t, uint8_t>(px + r * k, k, pq + r * kp, 128);
      std::memset(pq + r * kp + k, 128, kp - k);  // times zero weights
    }
    interleave(pq, kp, tiles, pa);
    scalar_t* po = out.data_ptr<scalar_t>();
    const int8_t* pw = packed.data_ptr<int8_t>();
    const float* ps = scale.data_ptr<float>();
    const int32_t* poff = offsets.data_ptr<int32_t>();
    const auto span = [&](int64_t begin, int64_t end) {
      __m512i sums[VROWS];
      for (int64_t b = begin; b < end; ++b) {
        const int8_t* w = pw + b * kp * VCOLS;
        const __m512i offset = _mm512_loadu_si512(poff + b * VCOLS);
        const __m512 ws = _mm512_loadu_ps(ps + b * VCOLS);
        const int64_t cols = std::min(VCOLS, n - b * VCOLS);
        for (int64_t t = 0; t < tiles.count; ++t) {
          const int64_t r = tiles.first(t), count = tiles.first(t + 1) - r;
          vnni_tile(count, pa + r * kp, kp, w, sums, stream);
          for (int64_t i = 0; i < count; ++i) {
            const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(sums[i], offset)), ws);
            store16(po + (r + i) * n + b * VCOLS, _mm512_mul_ps(v, _mm512_set1_ps(token_scale[r + i])), cols);
          }
        }
      }
    };
    if (team == nullptr)
      return at::parallel_for(0, blocks, std::max<int64_t>(1, 16 / std::max<int64_t>(rows, 1)), span);
    team->run((blocks + VCHUNK - 1) / VCHUNK,
              [&](int64_t i) { span(i * VCHUNK, std::min(blocks, (i + 1) * VCHUNK)); });
  });
  return out;
#else
  TORCH_CHECK(false, "rvqspec's VNNI int8 GEMM needs AVX-512 VNNI, which this build lacks");
#endif
}

void with_team(int threads, const std::function<void(Team*)>& body) {
#ifdef _OPENMP
  if (threads < 2 || at::in_parallel_region()) return body(nullptr);
  Team team;
  std::exception_ptr error;
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      try {
        body(&team);
      } catch (...) {
        error = std::current_exception();
      }
      team.stop();
    } else {
      team.work();
    }
  }
  if (error) std::rethrow_exception(error);
#else
  body(nullptr);
#endif
}

// x [M, K] float32 -> [M, n] float32: w8a16 with the packed weights and their scales.
at::Tensor w8a16_linear(const at::Tensor& x_, const at::Tensor& packed, const at::Tensor& scale, int64_t n) {
#ifdef RVQSPEC_INT8_GEMM
  TORCH_CHECK(x_.scalar_type() == at::kFloat, "w8a16_linear takes float32 activations");
  auto x = x_.contiguous();
  check_packed(x, packed, scale, n);
  const int64_t k = x.size(-1), rows = x.numel() / k, kp = packed.size(1) * DEPTH;
  auto a = kp == k ? x.reshape({rows, k}) : at::constant_pad_nd(x.reshape({rows, k}), {0, kp - k});
  auto out = at::empty({rows, n}, x.options());
  float* po = out.data_ptr<float>();
  gemm(a.data_ptr<float>(), rows, kp, packed, scale.data_ptr<float>(), n,
       [&](int64_t r, int64_t c, float v) { po[r * n + c] = v; });
  return out;
#else
  TORCH_CHECK(false, "rvqspec's int8 GEMM needs AVX2 and FMA, which this build lacks");
#endif
}

}  // namespace rvqspec
