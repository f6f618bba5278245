// Fused elementwise kernels of the decoder layer for CPU inference (built by rvqspec/core/fused.py).
//
// Each kernel replaces several small ATen ops (norms with their casts, RoPE's chunk/cat, SiLU x up, the
// residual add and the K/V cache writes) by one pass over the rows. The arithmetic runs in float32 (double
// for double); the roundings that upstream's RMSNorm makes in the input dtype (normalised value cast back,
// then scaled by the weight) are kept, so that bfloat16 results stay within an ulp or two of the plain path.
// ATen and torch's pybind11 casters rather than all of torch/extension.h: 15 s of compiling instead of 25 here.
// (torch's op registry with ATen's headers alone compiles in 8 s, but each call through torch.ops costs ~2 us
// more than through pybind11, ~20 calls per forward.)
#include <ATen/ATen.h>
#include <torch/csrc/utils/pybind.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels.h"

namespace {

using namespace rvqspec;

// exp(x) with Cephes' range reduction and polynomial (~1 ulp in float); plain C so that gcc vectorises it.
inline float vexp(float x) {
  x = x < -87.3f ? -87.3f : (x > 88.3f ? 88.3f : x);
  float n = (x * 1.44269504088896341f + 12582912.f) - 12582912.f;  // round to nearest
  float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  int32_t e = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &e, sizeof scale);
  return p * scale;
}
inline double vexp(double x) { return std::exp(x); }

// out[i] = round(round(x[i] * inv) * w[i]) as upstream's RMSNorm, which normalises in float32 whatever the
// dtype (float64 too); inv = 1 / rms(x).
// The sum of squares runs in SUM_LANES partial sums chosen by index, then added in order: the same bits for a row
// wherever its buffer lies. (An `omp simd` reduction let gcc peel iterations to align the buffer, so a row's norm
// depended on its heap address, and a verify call's rows could differ from their AR steps in the last bit.)
constexpr int64_t SUM_LANES = 16;

template <typename T, typename A>
inline void norm_row(const A* x, const T* w, A* out, int64_t d, double eps) {
  float part[SUM_LANES] = {};
  int64_t i = 0;
  for (; i + SUM_LANES <= d; i += SUM_LANES)
    for (int64_t j = 0; j < SUM_LANES; ++j) part[j] += static_cast<float>(x[i + j]) * static_cast<float>(x[i + j]);
  for (; i < d; ++i) part[i % SUM_LANES] += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  float sum = 0;
  for (int64_t j = 0; j < SUM_LANES; ++j) sum += part[j];
  const float inv = 1.f / std::sqrt(sum / static_cast<float>(d) + static_cast<float>(eps));
  for (int64_t i = 0; i < d; ++i)
    out[i] = round_to<T, A>(round_to<T, A>(static_cast<A>(static_cast<float>(x[i]) * inv)) * load<T, A>(w, i));
}

at::Tensor rms_norm(const at::Tensor& x_, const at::Tensor& w_, double eps) {
  auto x = x_.contiguous(), w = w_.contiguous();
  auto out = at::empty_like(x);
  const int64_t d = x.size(-1), rows = x.numel() / d;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t *px = x.data_ptr<scalar_t>(), *pw = w.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
      std::vector<A> row(d), res(d);
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < d; ++i) row[i] = load<scalar_t, A>(px, r * d + i);
        norm_row<scalar_t, A>(row.data(), pw, res.data(), d, eps);
        for (int64_t i = 0; i < d; ++i) store<scalar_t, A>(po, r * d + i, res[i]);
      }
    });
  });
  return out;
}

// The residual step: s = x + delta (rounded to the dtype, as the plain add), and rms_norm(s).
std::vector<at::Tensor> add_rms_norm(const at::Tensor& x_, const at::Tensor& delta_, const at::Tensor& w_, double eps) {
  auto x = x_.contiguous(), delta = delta_.contiguous(), w = w_.contiguous();
  auto sum = at::empty_like(x), out = at::empty_like(x);
  const int64_t d = x.size(-1), rows = x.numel() / d;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_rms_norm", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t *px = x.data_ptr<scalar_t>(), *pd = delta.data_ptr<scalar_t>(), *pw = w.data_ptr<scalar_t>();
    scalar_t *ps = sum.data_ptr<scalar_t>(), *po = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(d), [&](int64_t begin, int64_t end) {
      std::vector<A> row(d), res(d);
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = 0; i < d; ++i) {
          row[i] = round_to<scalar_t, A>(load<scalar_t, A>(px, r * d + i) + load<scalar_t, A>(pd, r * d + i));
          store<scalar_t, A>(ps, r * d + i, row[i]);
        }
        norm_row<scalar_t, A>(row.data(), pw, res.data(), d, eps);
        for (int64_t i = 0; i < d; ++i) store<scalar_t, A>(po, r * d + i, res[i]);
      }
    });
  });
  return {sum, out};
}

// silu(gate) * up of gate_up = [gate | up] (last dim 2I) -> [..., I]; silu rounded to the dtype as the plain op.
at::Tensor silu_mul(const at::Tensor& gu_) {
  auto gu = gu_.contiguous();
  const int64_t two = gu.size(-1), n = two / 2, rows = gu.numel() / two;
  auto sizes = gu.sizes().vec();
  sizes.back() = n;
  auto out = at::empty(sizes, gu.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gu.scalar_type(), "silu_mul", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t* pg = gu.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, rows, grain(two), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) {
        const scalar_t *g = pg + r * two, *u = g + n;
        scalar_t* o = po + r * n;
        for (int64_t i = 0; i < n; ++i) {
          const A x = load<scalar_t, A>(g, i);
          const A silu = round_to<scalar_t, A>(x / (A(1) + vexp(-x)));
          store<scalar_t, A>(o, i, silu * load<scalar_t, A>(u, i));
        }
      }
    });
  });
  return out;
}

// The attention's input side, from the fused projection qkv [B, T, (H + 2 KV) * D]: q/k RMSNorm (skipped when
// the weight is None), RoPE (cos/sin [Bc, T, D], Bc = 1 or B), K and V written into the cache views
// k_cache/v_cache [B, KV, S, D] at `slots` ([T] for every row, or [B, T] per row). Returns q [B, H, T, D].
at::Tensor qkv_rope(const at::Tensor& qkv_, const c10::optional<at::Tensor>& q_w, const c10::optional<at::Tensor>& k_w,
                    const at::Tensor& cos_, const at::Tensor& sin_, double eps, int64_t heads, int64_t kv_heads,
                    at::Tensor k_cache, at::Tensor v_cache, const at::Tensor& slots_) {
  auto qkv = qkv_.contiguous(), cos = cos_.contiguous(), sin = sin_.contiguous();
  auto slots = slots_.to(at::kLong).contiguous();
  const int64_t batch = qkv.size(0), length = qkv.size(1), d = k_cache.size(-1), half = d / 2;
  const int64_t all = heads + 2 * kv_heads, cos_batch = cos.size(0);
  TORCH_CHECK(qkv.size(2) == all * d && d % 2 == 0 && k_cache.stride(-1) == 1 && v_cache.stride(-1) == 1);
  TORCH_CHECK(cos.size(1) == length && cos.size(2) == d && (cos_batch == 1 || cos_batch == batch));
  auto q = at::empty({batch, heads, length, d}, qkv.options());
  const bool norm_q = q_w.has_value() && q_w->defined(), norm_k = k_w.has_value() && k_w->defined();
  at::Tensor qw = norm_q ? q_w->contiguous() : at::Tensor(), kw = norm_k ? k_w->contiguous() : at::Tensor();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qkv.scalar_type(), "qkv_rope", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t *px = qkv.data_ptr<scalar_t>(), *pc = cos.data_ptr<scalar_t>(), *ps = sin.data_ptr<scalar_t>();
    const scalar_t *pqw = norm_q ? qw.data_ptr<scalar_t>() : nullptr, *pkw = norm_k ? kw.data_ptr<scalar_t>() : nullptr;
    scalar_t *pq = q.data_ptr<scalar_t>(), *pk = k_cache.data_ptr<scalar_t>(), *pv = v_cache.data_ptr<scalar_t>();
    const int64_t* pslot = slots.data_ptr<int64_t>();
    const bool per_row = slots.dim() == 2;  // [B, T]: each row's own slots (the talker's rows); [T]: shared
    const auto ks = k_cache.strides(), vs = v_cache.strides();
    at::parallel_for(0, batch * length * all, grain(d), [&](int64_t begin, int64_t end) {
      std::vector<A> row(d), normed(d);
      for (int64_t job = begin; job < end; ++job) {
        const int64_t h = job % all, t = (job / all) % length, b = job / (all * length);
        const int64_t slot = pslot[per_row ? b * length + t : t];
        const scalar_t* x = px + job * d;
        if (h >= heads + kv_heads) {  // V: copied as it is
          scalar_t* dst = pv + b * vs[0] + (h - heads - kv_heads) * vs[1] + slot * vs[2];
          std::memcpy(dst, x, d * sizeof(scalar_t));
          continue;
        }
        const bool is_q = h < heads;
        const scalar_t* w = is_q ? pqw : pkw;
        for (int64_t i = 0; i < d; ++i) row[i] = load<scalar_t, A>(x, i);
        if (w != nullptr) {
          norm_row<scalar_t, A>(row.data(), w, normed.data(), d, eps);
        } else {
          std::copy(row.begin(), row.end(), normed.begin());
        }
        const scalar_t *c = pc + ((cos_batch == 1 ? 0 : b) * length + t) * d, *s = ps + (c - pc);
        scalar_t* dst = is_q ? pq + ((b * heads + h) * length + t) * d
                             : pk + b * ks[0] + (h - heads) * ks[1] + slot * ks[2];
        for (int64_t i = 0; i < half; ++i) {
          store<scalar_t, A>(dst, i, normed[i] * load<scalar_t, A>(c, i) - normed[i + half] * load<scalar_t, A>(s, i));
          store<scalar_t, A>(dst, i + half, normed[i + half] * load<scalar_t, A>(c, i + half) +
                                               normed[i] * load<scalar_t, A>(s, i + half));
        }
      }
    });
  });
  return q;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm);
  m.def("add_rms_norm", &add_rms_norm);
  m.def("silu_mul", &silu_mul);
  m.def("qkv_rope", &qkv_rope);
  m.def("quantize_rows", &rvqspec::quantize_rows);
  m.def("scale_rows", &rvqspec::scale_rows);
  m.def("has_int8_gemm", &rvqspec::has_int8_gemm);
  m.def("int8_linear", &rvqspec::int8_linear);
  m.def("has_vnni_gemm", &rvqspec::has_vnni_gemm);
  m.def("vnni_linear", &rvqspec::vnni_linear);
  m.def("w8a16_linear", &rvqspec::w8a16_linear);
}
