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


// Attention whose reductions depend on nothing but the query's own visible keys, in their order: queries q
// [B, H, T, D] over the cache views k_cache/v_cache [B, KV, S, D] under an additive mask ([T, S] shared or
// [B, 1, T, S] per row; -inf = not visible; None = all). Each query visits its visible keys in slot order, which is
// position order (the committed prefix, then its tree ancestors by depth: a verify call's scratch slots follow the
// committed ones and a node's ancestors precede it), skipping the masked ones rather than adding their zeros; its
// scores are dot products summed in 16 partial sums by index then pairwise, its softmax and weighted sum of
// values run over the visible keys in order. So a query gets the same bits in an AR step (its keys at slots 0..p) as
// in a verify call (at scratch slots), alone or beside any other queries or rows (SDPA's blocks depend on the call's
// shape and where the masked keys lie). Returns [B, H, T, D] as a view of [B, T, H, D] memory: the layout the output
// projection reads.
// A score: q . k in 16 partial sums by index (vectors of every class hold them in the same lanes), then pairwise.
template <typename T, typename A>
inline A dot_row(const A* q, const T* k, int64_t d) {
  A part[16] = {};
  int64_t i = 0;
  for (; i + 16 <= d; i += 16)
    for (int64_t j = 0; j < 16; ++j) part[j] += q[i + j] * load<T, A>(k, i + j);
  for (; i < d; ++i) part[i % 16] += q[i] * load<T, A>(k, i);
  for (int64_t j = 0; j < 8; ++j) part[j] += part[j + 8];
  for (int64_t j = 0; j < 4; ++j) part[j] += part[j + 4];
  for (int64_t j = 0; j < 2; ++j) part[j] += part[j + 2];
  return part[0] + part[1];
}

at::Tensor attention(const at::Tensor& q_, const at::Tensor& k_cache, const at::Tensor& v_cache,
                     const c10::optional<at::Tensor>& mask_) {
  auto q = q_.contiguous();
  const int64_t batch = q.size(0), heads = q.size(1), length = q.size(2), d = q.size(3);
  const int64_t kv_heads = k_cache.size(1), slots = k_cache.size(2), group = heads / kv_heads;
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.sizes() == v_cache.sizes() && k_cache.size(0) == batch &&
              k_cache.size(3) == d && heads % kv_heads == 0 && k_cache.stride(-1) == 1 && v_cache.stride(-1) == 1 &&
              k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type());
  const bool masked = mask_.has_value() && mask_->defined();
  at::Tensor mask = masked ? mask_->to(q.scalar_type()).contiguous() : at::Tensor();
  const bool per_row = masked && mask.dim() == 4;
  TORCH_CHECK(!masked || (mask.size(-1) == slots && mask.size(-2) == length &&
                          (mask.dim() == 2 || (per_row && mask.size(0) == batch && mask.size(1) == 1))),
              "attention mask: [T, S] or [B, 1, T, S] over the cache's slots");
  auto out = at::empty({batch, length, heads, d}, q.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "attention", [&] {
    using A = at::opmath_type<scalar_t>;
    const scalar_t *pq = q.data_ptr<scalar_t>(), *pk = k_cache.data_ptr<scalar_t>(), *pv = v_cache.data_ptr<scalar_t>();
    const scalar_t* pm = masked ? mask.data_ptr<scalar_t>() : nullptr;
    scalar_t* po = out.data_ptr<scalar_t>();
    const auto ks = k_cache.strides(), vs = v_cache.strides();
    const A scale = static_cast<A>(1.0 / std::sqrt(static_cast<double>(d)));
    at::parallel_for(0, batch * heads * length, grain(slots * d), [&](int64_t begin, int64_t end) {
      std::vector<A> query(d), acc(d), score(slots), weight(slots);
      std::vector<int64_t> visible(slots);
      for (int64_t job = begin; job < end; ++job) {
        const int64_t t = job % length, h = (job / length) % heads, b = job / (length * heads);
        const scalar_t* mrow = masked ? pm + ((per_row ? b : 0) * length + t) * slots : nullptr;
        const scalar_t *keys = pk + b * ks[0] + (h / group) * ks[1], *values = pv + b * vs[0] + (h / group) * vs[1];
        for (int64_t i = 0; i < d; ++i) query[i] = load<scalar_t, A>(pq, job * d + i);
        int64_t n = 0;
        A top = -std::numeric_limits<A>::infinity();
        for (int64_t s = 0; s < slots; ++s) {
          const A bias = masked ? load<scalar_t, A>(mrow, s) : A(0);
          if (bias == -std::numeric_limits<A>::infinity()) continue;
          visible[n] = s;
          score[n] = dot_row<scalar_t, A>(query.data(), keys + s * ks[2], d) * scale + bias;
          top = std::max(top, score[n++]);
        }
        for (int64_t j = 0; j < n; ++j) weight[j] = vexp(score[j] - top);  // one key per lane: vectorised
        A total = 0;
        for (int64_t j = 0; j < n; ++j) total += weight[j];
        std::fill(acc.begin(), acc.end(), A(0));
        int64_t j = 0;
        for (; j + 2 <= n; j += 2) {  // two keys per pass over the sums (each still adds its keys in order)
          const scalar_t *v0 = values + visible[j] * vs[2], *v1 = values + visible[j + 1] * vs[2];
          for (int64_t i = 0; i < d; ++i) {
            acc[i] += weight[j] * load<scalar_t, A>(v0, i);
            acc[i] += weight[j + 1] * load<scalar_t, A>(v1, i);
          }
        }
        for (; j < n; ++j) {
          const scalar_t* v = values + visible[j] * vs[2];
          for (int64_t i = 0; i < d; ++i) acc[i] += weight[j] * load<scalar_t, A>(v, i);
        }
        scalar_t* dst = po + ((b * length + t) * heads + h) * d;
        for (int64_t i = 0; i < d; ++i) store<scalar_t, A>(dst, i, acc[i] / total);
      }
    });
  });
  return out.permute({0, 2, 1, 3});
}

// A layer matrix on rvqspec's GEMMs, on `team` where there is one: w8a8 packed by pack_vnni (3 tensors; its weights
// streamed past the caches, which keep the heads that the round reads before and after the stack) or pack_int8 (2),
// or bfloat16 packed by pack_bf16 (1); n outputs.
at::Tensor int8_matmul(const at::Tensor& x, const std::vector<at::Tensor>& packed, int64_t n, Team* team) {
  if (packed.size() == 3) return vnni_linear_on(team, x, packed[0], packed[1], packed[2], n, /*stream=*/true);
  if (packed.size() == 2) return int8_linear_on(team, x, packed[0], packed[1], n);
  return bf16_linear_on(team, x, packed[0], c10::nullopt, n);
}

// int8_layers runs on a team for at most TEAM_ROWS rows (its elementwise kernels run on one thread there) and at least
// TEAM_BYTES of weights (a region's start and end, each waiting on the other threads, cost more than a tiny stack).
constexpr int64_t TEAM_ROWS = 64, TEAM_BYTES = 1 << 20;

// fused.layers' loop and final norm in one native call, for a w8a8 model whose layer matrices all run on rvqspec's
// int8 GEMMs (quantize.Int8Matmul.native), or a bfloat16 one on its bfloat16 GEMM (packing.Linear.native), that
// attends over a cache in order: the same kernels on the same tensors in the same order, without a trip back to
// Python between them (~10 per layer: issue 51).
// norms: each layer's attn_norm and mlp_norm weights, then the final norm's; qk_norms: each layer's q and k norm
// weights (None: none); packed, widths: each layer's qkv, o, gate+up and down matrices; kv: the cache's
// [layers, 2, B, KV, S, D] (a view); the rest as qkv_rope and attention take them.
// On more than one thread with few rows (decoding), the whole stack is one parallel region (`with_team`): thread 0
// runs it and the others take chunks of each matrix, waiting between matrices (issue 51: a region per matrix cost
// the second thread's wake-up each time; 2 threads were barely faster than 1 with int8, slower with bfloat16).
at::Tensor int8_layers(at::Tensor x, const std::vector<at::Tensor>& norms,
                       const std::vector<c10::optional<at::Tensor>>& qk_norms,
                       const std::vector<std::vector<at::Tensor>>& packed, const std::vector<int64_t>& widths,
                       const at::Tensor& cos, const at::Tensor& sin, const c10::optional<at::Tensor>& mask,
                       const at::Tensor& kv, const at::Tensor& slots, double eps, int64_t heads, int64_t kv_heads) {
  const int64_t layers = kv.size(0);
  const auto count = [](const auto& list) { return static_cast<int64_t>(list.size()); };
  TORCH_CHECK(x.dim() == 3 && kv.dim() == 6 && count(norms) == 2 * layers + 1 && count(qk_norms) == 2 * layers &&
              count(packed) == 4 * layers && count(widths) == 4 * layers,
              "int8_layers: one entry per layer (fused.int8_stack)");
  int64_t bytes = 0;
  for (const auto& p : packed) bytes += p[0].nbytes();
  const int threads = bytes >= TEAM_BYTES && x.size(0) * x.size(1) <= TEAM_ROWS ? at::get_num_threads() : 1;
  at::Tensor h;
  with_team(threads, [&](Team* team) {
    h = rms_norm(x, norms[0], eps);
    for (int64_t i = 0; i < layers; ++i) {
      const auto k = kv.select(0, i).select(0, 0), v = kv.select(0, i).select(0, 1);
      const auto* w = &packed[4 * i];
      const int64_t* n = &widths[4 * i];
      auto q = qkv_rope(int8_matmul(h, w[0], n[0], team), qk_norms[2 * i], qk_norms[2 * i + 1], cos, sin, eps, heads,
                        kv_heads, k, v, slots);
      auto y = attention(q, k, v, mask).transpose(1, 2).reshape({x.size(0), x.size(1), -1});
      auto mid = add_rms_norm(x, int8_matmul(y, w[1], n[1], team), norms[2 * i + 1], eps);
      auto out = add_rms_norm(mid[0], int8_matmul(silu_mul(int8_matmul(mid[1], w[2], n[2], team)), w[3], n[3], team),
                              norms[2 * i + 2], eps);
      x = out[0];
      h = out[1];
    }
  });
  return h;
}

}  // namespace

// Every kernel lets go of the GIL while it runs (arguments and result are converted with it held): the Engine's
// codec worker runs Python between its decoder's ops beside the frame loop's calls (runtime/threads.py).
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  const auto released = py::call_guard<py::gil_scoped_release>();
  m.def("snake", &rvqspec::snake, released);
  m.def("rms_norm", &rms_norm, released);
  m.def("add_rms_norm", &add_rms_norm, released);
  m.def("silu_mul", &silu_mul, released);
  m.def("qkv_rope", &qkv_rope, released);
  m.def("attention", &attention, released);
  m.def("quantize_rows", &rvqspec::quantize_rows, released);
  m.def("scale_rows", &rvqspec::scale_rows, released);
  m.def("has_int8_gemm", &rvqspec::has_int8_gemm);
  m.def("int8_linear", &rvqspec::int8_linear, released);
  m.def("has_vnni_gemm", &rvqspec::has_vnni_gemm);
  m.def("vnni_linear", &rvqspec::vnni_linear, released);
  m.def("huge_pages", &rvqspec::huge_pages, released);
  m.def("w8a16_linear", &rvqspec::w8a16_linear, released);
  m.def("has_bf16_gemm", &rvqspec::has_bf16_gemm);
  m.def("bf16_linear", &rvqspec::bf16_linear, released);
  m.def("int8_layers", &int8_layers, released);
}
