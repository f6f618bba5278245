// bfloat16 matmuls of decoding's few rows on CPUs with AVX-512 BF16 (core/packing.py): bf16_linear.
//
// oneDNN's bfloat16 GEMM on a Zen 4 reads the predictor's weights at about half the copy bandwidth for one row and
// costs 1.2-1.4x more at a verify call's 9-17 rows; padding keeps a row's bits the same alone and inside a call
// (benchmarks/bf16_rows.py). Here every output channel is one chain of vdpbf16ps over K (pairs of products summed
// into a float32 lane), in the same order whatever the call's rows, tile or thread: a row has the same bits in a
// one-row call, in a verify call of any size and in any batch, with no padding.
//
// Weights packed once (`pack_bf16` in packing.py): [ceil(N/16), ceil(K/2), 16, 2] bfloat16, a block of 16 channels
// streaming contiguously, two input values per channel and step (the pairs vdpbf16ps multiplies); K and N zero-padded.
// A tile of R rows x C blocks keeps its R x C sums in registers (up to 6 rows x 4 blocks, or 12 rows x 2 blocks: a
// call of up to 12 rows reads each weight byte from memory once, more rows go in balanced chunks of at most 12, the
// later chunks reading a group's weights from L2); one row reads 4 blocks side by side (4 chains in flight, so the
// loads, not the instruction's latency, set the pace).
//
// Prefetching: from about 6 rows on, a call does as much vdpbf16ps work as it reads bytes (a Zen 4 runs one 512-bit
// vdpbf16ps a cycle), and the two overlap only when the weights arrive in L2 ahead of the tile: the tile prefetches
// the blocks its next pass will read (PREFETCHT1, into L2) at its own pace. A prefetch into L1 holds one of the few
// L1 miss buffers for a whole DRAM round trip and costs more than it gives; a tile of up to 4 rows leaves the
// stream to the hardware prefetcher, which keeps one row at the copy bandwidth.
//
// Threads: a call's groups of 4 blocks (64 channels) are split between torch's threads (at::parallel_for) or, inside
// a native stack (fused.cpp), claimed by the stack's `Team` (kernels.h): one parallel region per stack, not a fork and
// join per matrix (at 2 threads those cost more than the second core gave: a predictor AR call 11.2 ms against 7.6 at
// 1 thread, bench-batch.md). Either way each channel's sum runs on one thread in one order: the same bits.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "kernels.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#include <immintrin.h>
#define RVQSPEC_BF16_GEMM 1
#endif

namespace rvqspec {

namespace {

#ifdef RVQSPEC_BF16_GEMM
constexpr int64_t BCOLS = 16, GROUP = 4;  // a block's channels; blocks per group (a thread's unit of work)
constexpr int64_t WIDE_ROWS = 6, BROWS = 12;  // the most rows of a tile of 4 blocks, and of 2 blocks
constexpr int64_t STREAM_ROWS = 4;  // a 4-block tile of at most this many rows leaves prefetching to the hardware

// R rows of x (as pairs: row stride k2 int32) x C blocks (block stride `stride` bf16 pairs of 16 channels) -> the
// float32 sums out[r * GROUP + c] (16 lanes each), each one chain over K. `ahead` > 0: each step also prefetches into
// L2 the line `ahead` blocks further on of each of its blocks (the next pass's weights).
template <int R, int C>
inline void tile(const int32_t* x, int64_t k2, const uint32_t* w, int64_t stride, int64_t ahead, __m512* out) {
  __m512 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm512_setzero_ps();
  for (int64_t k = 0; k < k2; ++k, w += BCOLS) {
    __m512i wv[C];
    for (int c = 0; c < C; ++c) {
      if (ahead) _mm_prefetch(reinterpret_cast<const char*>(w + (c + ahead) * stride), _MM_HINT_T1);
      wv[c] = _mm512_loadu_si512(w + c * stride);
    }
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(x[r * k2 + k]);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, (__m512bh)wv[c]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) out[r * GROUP + c] = acc[r][c];
}

// tile<rows, C> for rows in [R, MAX] (R x C sums stay within the 32 vector registers).
template <int C, int MAX, int R = 1>
inline void tile_rows(int64_t rows, const int32_t* x, int64_t k2, const uint32_t* w, int64_t stride, int64_t ahead,
                      __m512* out) {
  if constexpr (R < MAX) {
    if (rows != R) return tile_rows<C, MAX, R + 1>(rows, x, k2, w, stride, ahead, out);
  }
  tile<R, C>(x, k2, w, stride, ahead, out);
}

// Up to BROWS rows x a group's `blocks` blocks: up to WIDE_ROWS rows x 4 blocks in one pass, more rows x 2 blocks
// (then 1) per pass. `prefetch`: the passes prefetch the next pass's blocks into L2 (the next group's after the
// last). The order of each sum is the same either way.
inline void group_tile(int64_t rows, int64_t blocks, const int32_t* x, int64_t k2, const uint32_t* w, int64_t stride,
                       bool prefetch, __m512* out) {
  if (blocks == GROUP && rows <= WIDE_ROWS) {
    const int64_t ahead = prefetch && rows > STREAM_ROWS ? GROUP : 0;
    return tile_rows<GROUP, WIDE_ROWS>(rows, x, k2, w, stride, ahead, out);
  }
  const int64_t ahead = prefetch ? 2 : 0;
  for (int64_t b = 0; b < blocks; b += 2) {
    blocks - b >= 2 ? tile_rows<2, BROWS>(rows, x, k2, w + b * stride, stride, ahead, out + b)
                    : tile_rows<1, BROWS>(rows, x, k2, w + b * stride, stride, ahead, out + b);
  }
}
#endif

}  // namespace

bool has_bf16_gemm() {
#ifdef RVQSPEC_BF16_GEMM
  return true;
#else
  return false;
#endif
}

// x [..., K] bfloat16 -> [..., n] bfloat16: x times the weight packed by pack_bf16 (+ bias), summed in float32 and
// rounded once.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t n) {
  return bf16_linear_on(nullptr, x, packed, bias, n);
}

// The same on a stack's team (`with_team`; nullptr: at::parallel_for): a chunk is a group.
at::Tensor bf16_linear_on(Team* team, const at::Tensor& x_, const at::Tensor& packed,
                          const c10::optional<at::Tensor>& bias_, int64_t n) {
#ifdef RVQSPEC_BF16_GEMM
  TORCH_CHECK(x_.scalar_type() == at::kBFloat16, "bf16_linear takes bfloat16 activations");
  const int64_t k = x_.size(-1), rows = x_.numel() / std::max<int64_t>(k, 1), blocks = packed.size(0),
                k2 = packed.size(1);
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 4 && packed.size(2) == BCOLS &&
              packed.size(3) == 2 && packed.is_contiguous(), "bfloat16 weights not packed by packing.pack_bf16");
  TORCH_CHECK(2 * k2 >= k && 2 * k2 < k + 2 && blocks * BCOLS >= n && blocks * BCOLS < n + BCOLS,
              "packed bfloat16 weights of another shape than the call's");
  auto x = x_.reshape({rows, k});
  x = 2 * k2 == k ? x.contiguous() : at::constant_pad_nd(x, {0, 1});  // an odd K: one zero pair member
  auto out = at::empty({rows, n}, x.options());
  at::Tensor bias;  // float32, padded to whole blocks; none without one (two ops fewer per call)
  if (bias_.has_value()) {
    TORCH_CHECK(bias_->numel() == n, "bias of ", bias_->numel(), " values for ", n, " outputs");
    bias = at::zeros({blocks * BCOLS}, x.options().dtype(at::kFloat));
    bias.narrow(0, 0, n).copy_(bias_->reshape({n}));
  }
  const float* pb = bias.defined() ? bias.data_ptr<float>() : nullptr;
  const int32_t* px = reinterpret_cast<const int32_t*>(x.data_ptr<at::BFloat16>());
  const uint32_t* pw = reinterpret_cast<const uint32_t*>(packed.data_ptr<at::BFloat16>());
  uint16_t* po = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t stride = k2 * BCOLS, groups = (blocks + GROUP - 1) / GROUP, chunks = (rows + BROWS - 1) / BROWS;
  const auto span = [&](int64_t begin, int64_t end) {
    __m512 sums[BROWS * GROUP];
    for (int64_t g = begin; g < end; ++g) {
      const int64_t first = g * GROUP, count = std::min(GROUP, blocks - first);
      const uint32_t* w = pw + first * stride;
      for (int64_t j = 0; j < chunks; ++j) {  // balanced chunks of rows: the first reads the weights from memory
        const int64_t r = rows * j / chunks, chunk = rows * (j + 1) / chunks - r;
        group_tile(chunk, count, px + r * k2, k2, w, stride, j == 0, sums);
        for (int64_t i = 0; i < chunk; ++i)
          for (int64_t c = 0; c < count; ++c) {
            const int64_t col = (first + c) * BCOLS, cols = std::min(BCOLS, n - col);
            const __m512 acc = sums[i * GROUP + c];
            const __m512 sum = pb ? _mm512_add_ps(acc, _mm512_loadu_ps(pb + col)) : acc;
            const __m256i v = (__m256i)_mm512_cvtneps_pbh(sum);  // round to nearest even
            _mm256_mask_storeu_epi16(po + (r + i) * n + col, (__mmask16)((1u << cols) - 1), v);
          }
      }
    }
  };
  if (team == nullptr) at::parallel_for(0, groups, 1, span);
  else team->run(groups, [&](int64_t g) { span(g, g + 1); });
  auto sizes = x_.sizes().vec();
  sizes.back() = n;
  return out.reshape(sizes);
#else
  TORCH_CHECK(false, "rvqspec's bfloat16 GEMM needs AVX-512 BF16, which this build lacks");
#endif
}

}  // namespace rvqspec
