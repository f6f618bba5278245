// The deployed sampler's draw in one call (rvqspec/core/draw.py): per row of logits [n, V] (float32, or bfloat16
// widened here) and its Exp(1) noise [n, V], the temperature, top-k (ties at the k-th kept) and softmax of
// `Sampler.process`, then argmax(p / noise), the draw `Sampler.sample_noise` makes with ~7 torch ops. Scalar and in
// a fixed order, with an exp of its own and no contraction (built with -ffp-contract=off, for no particular CPU): the
// same bits on every CPU class. Against torch's softmax (its own exp, vectorised sums) p differs in the last bits, so
// a draw can differ at a near-tie.
// The noise may come as the float64 uniforms u it is made of (`sampling.fill_noise`): a row's Exp(1) value is then
// made here for its kept tokens only (~50 of V), as torch's exponential_ makes it from u (float(-log1p(-u))).
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

// exp(x) for x <= 0 rounded to float: a double polynomial after x = k ln2 + r, |r| <= ln2 / 2 (error ~1e-16, far
// below float's half ulp), so the result is float's nearest value but for ~1e-9 of the inputs, on any CPU.
float exp_nonpositive(float x) {
  if (!(x > -104.f)) return x != x ? x : 0.f;  // below float's least subnormal (NaN passes)
  const double shifter = 6755399441055744.0;  // 1.5 * 2^52: adding it rounds to an integer (no libm call)
  const double k = (static_cast<double>(x) * 1.44269504088896338700 + shifter) - shifter;
  const double ln2_hi = 0.693147180369123816490, ln2_lo = 1.90821492927058770002e-10;
  const double r = (static_cast<double>(x) - k * ln2_hi) - k * ln2_lo;
  double p = 1.0 / 479001600.0;  // Taylor to r^12: the next term is < 1e-17 at |r| <= 0.35
  const double coefficients[] = {1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0, 1.0 / 5040.0,
                                 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};
  for (const double c : coefficients) p = p * r + c;
  const uint64_t bits = static_cast<uint64_t>(static_cast<int64_t>(k) + 1023) << 52;  // 2^k, k in [-151, 0]
  double scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return static_cast<float>(p * scale);  // exact in double (a normal one), one rounding to float
}

// The k-th largest of scores (1 <= k), repeats counted as torch.topk counts them (-inf where fewer than k values
// pass it). Values above the threshold gather in a buffer of 2k; a full one keeps its k largest, whose least is the
// new threshold: most values fall below it and cost one comparison.
float kth_largest(const std::vector<float>& scores, int64_t k, std::vector<float>& buffer) {
  const auto larger = std::greater<float>();
  float threshold = -std::numeric_limits<float>::infinity();
  buffer.clear();
  for (const float s : scores) {
    if (!(s > threshold)) continue;
    buffer.push_back(s);
    if (static_cast<int64_t>(buffer.size()) == 2 * k) {
      std::nth_element(buffer.begin(), buffer.begin() + k - 1, buffer.end(), larger);
      buffer.resize(k);
      threshold = buffer[k - 1];
    }
  }
  if (static_cast<int64_t>(buffer.size()) < k) return -std::numeric_limits<float>::infinity();
  std::nth_element(buffer.begin(), buffer.begin() + k - 1, buffer.end(), larger);
  return buffer[k - 1];
}

struct Buffers {  // a call's, reused by its rows
  std::vector<float> scores, weights, candidates;
  std::vector<int64_t> kept;
};

// The largest of x[0..v): eight lanes, so that it runs at the loads' pace (a max is exact: any order gives its bits).
float largest(const float* x, int64_t v) {
  float lane[8];
  std::fill(lane, lane + 8, -std::numeric_limits<float>::infinity());
  int64_t i = 0;
  for (; i + 8 <= v; i += 8)
    for (int j = 0; j < 8; ++j) lane[j] = std::max(lane[j], x[i + j]);
  for (; i < v; ++i) lane[0] = std::max(lane[0], x[i]);
  return *std::max_element(lane, lane + 8);
}

// torch's Exp(1) value from its uniform u in [0, 1) (exponential_ on a CPU: -1 / lambda * log1p(-u) in double, then
// float): the same bits as the noise exponential_ draws from the same generator.
float exponential(double u) { return static_cast<float>(-1.0 * std::log1p(-u)); }

// A row's noise: Exp(1) values (float) or the uniforms they come from (double, made into Exp(1) values on reading).
template <typename T>
float noise_at(const T* noise, int64_t i) {
  if constexpr (std::is_same_v<T, double>) return exponential(noise[i]);
  else return noise[i];
}

// Whether noise[0..v) holds a zero (Exp(1) draws one rarely, from u = 0): p / noise is then NaN or inf there.
template <typename T>
bool has_zero(const T* noise, int64_t v) {
  int zero = 0;
  for (int64_t i = 0; i < v; ++i) zero |= noise[i] == 0;
  return zero;
}

// argmax over i of weights[i] * inverse / noise[i], torch.argmax's way: the first on ties, the first NaN wins.
template <typename T>
int64_t argmax_all(const float* weights, const T* noise, int64_t v, float inverse) {
  int64_t best = 0;
  float best_value = weights[0] * inverse / noise_at(noise, 0);
  if (best_value != best_value) return 0;
  for (int64_t i = 1; i < v; ++i) {
    const float value = weights[i] * inverse / noise_at(noise, i);
    if (value != value) return i;
    if (value > best_value) best = i, best_value = value;
  }
  return best;
}

// One row: argmax over i of p_i / noise_i (as torch.argmax), p = softmax of the kept scores (exp(s - max) *
// (1 / their sum), 0 elsewhere). Only a kept token can win (p > 0 for the largest, 0 elsewhere) unless a noise value
// is 0 (0 / 0 = NaN wins): then every token is visited.
template <typename L, typename T>
int64_t draw_row(const L* logits, const T* noise, int64_t v, float temperature, int64_t top_k, Buffers& buffers) {
  std::vector<float>& scores = buffers.scores;  // float32 logits (a bfloat16 one widened: exact), / temperature
  if (temperature == 1.f) std::copy(logits, logits + v, scores.begin());
  else for (int64_t i = 0; i < v; ++i) scores[i] = static_cast<float>(logits[i]) / temperature;
  const float top = largest(scores.data(), v);
  const float kth = top_k > 0 && top_k < v ? kth_largest(scores, top_k, buffers.candidates)
                                           : -std::numeric_limits<float>::infinity();
  std::vector<int64_t>& kept = buffers.kept;
  std::vector<float>& weights = buffers.weights;
  kept.clear();
  std::fill(weights.begin(), weights.end(), 0.f);
  float sum = 0.f;
  for (int64_t i = 0; i < v; ++i) {
    if (scores[i] < kth) continue;
    kept.push_back(i);
    weights[i] = exp_nonpositive(scores[i] - top);
    sum += weights[i];
  }
  const float inverse = 1.f / sum;
  if (has_zero(noise, v)) return argmax_all(weights.data(), noise, v, inverse);
  int64_t best = kept[0];
  float best_value = -1.f;
  for (const int64_t i : kept) {
    const float value = weights[i] * inverse / noise_at(noise, i);
    if (value != value) return i;
    if (value > best_value) best = i, best_value = value;
  }
  return best;
}

// Every row of logits (L) with its noise row (T).
template <typename L, typename T>
void draw_rows(const at::Tensor& logits, const at::Tensor& noise, float temperature, int64_t top_k, at::Tensor& out) {
  const int64_t v = logits.size(1);
  Buffers buffers{std::vector<float>(v), std::vector<float>(v), {}, {}};
  for (int64_t b = 0; b < logits.size(0); ++b)
    out.data_ptr<int64_t>()[b] = draw_row(logits.data_ptr<L>() + b * logits.stride(0),
                                          noise.data_ptr<T>() + b * noise.stride(0), v, temperature, top_k, buffers);
}

at::Tensor draws(const at::Tensor& logits, const at::Tensor& noise, double temperature, int64_t top_k) {
  TORCH_CHECK(logits.dim() == 2 && logits.sizes() == noise.sizes(), "draws: logits and noise [n, V]");
  TORCH_CHECK(logits.stride(1) == 1 && noise.stride(1) == 1 && logits.size(1) > 0, "draws: rows of unit stride");
  const bool wide = logits.scalar_type() == at::kFloat, uniforms = noise.scalar_type() == at::kDouble;
  TORCH_CHECK((wide || logits.scalar_type() == at::kBFloat16) && (uniforms || noise.scalar_type() == at::kFloat),
              "draws: float32 or bfloat16 logits, float32 Exp(1) noise or its float64 uniforms");
  at::Tensor out = at::empty({logits.size(0)}, logits.options().dtype(at::kLong));
  const float t = static_cast<float>(temperature);
  if (wide) uniforms ? draw_rows<float, double>(logits, noise, t, top_k, out)
                     : draw_rows<float, float>(logits, noise, t, top_k, out);
  else uniforms ? draw_rows<at::BFloat16, double>(logits, noise, t, top_k, out)
                : draw_rows<at::BFloat16, float>(logits, noise, t, top_k, out);
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("draws", &draws, py::call_guard<py::gil_scoped_release>());
}
