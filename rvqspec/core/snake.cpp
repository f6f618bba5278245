// SnakeBeta, the activation of the 12 Hz speech decoder's convolution stack (qwen-tts: x + sin(exp(alpha) x)^2 /
// (exp(beta) + eps), alpha and beta per channel), in one pass over [B, C, T] (built by rvqspec/core/fused.py,
// used by rvqspec/integrations/qwen_tts_audio.py). Upstream's forward is five ATen passes, each rounding to the
// dtype in between; here the arithmetic is float32 and rounds once: bfloat16 lands closer to the float32 decoder,
// float32 within a few ulp of upstream (sin's polynomial).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <cmath>
#include <vector>

#include "kernels.h"

namespace {

using namespace rvqspec;

// sin(y)^2 (period pi): y less its nearest multiple of pi (a three-part pi: exact to |y| ~ 1e4), then SLEEF's
// sinf_u35 polynomial on [-pi/2, pi/2] (3.5 ulp); plain C so that gcc vectorises it.
inline float sin_squared(float y) {
  const float q = (y * 0.318309886183790671538f + 12582912.f) - 12582912.f;  // round to nearest
  float d = y - q * 3.1414794921875f;
  d = d - q * 0.00011315941810607910156f;
  d = d - q * 1.9841872589410058936e-09f;
  const float s = d * d;
  float u = 2.6083159809786593541503e-06f;
  u = u * s - 0.0001981069071916863322258f;
  u = u * s + 0.00833307858556509017944336f;
  u = u * s - 0.166666597127914428710938f;
  const float sine = s * (u * d) + d;
  return sine * sine;
}

template <typename T>
void snake_rows(const T* x, int64_t batch_stride, int64_t channel_stride, T* out, const float* frequency,
                const float* scale, int64_t channels, int64_t steps, int64_t begin, int64_t end) {
  for (int64_t row = begin; row < end; ++row) {
    const int64_t c = row % channels;
    const float a = frequency[c], b = scale[c];
    const T* in = x + row / channels * batch_stride + c * channel_stride;
    T* dst = out + row * steps;
#pragma omp simd
    for (int64_t t = 0; t < steps; ++t) {
      const float v = load<T, float>(in, t);
      store<T, float>(dst, t, v + b * sin_squared(a * v));
    }
  }
}

}  // namespace

namespace rvqspec {

at::Tensor snake(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, double eps) {
  TORCH_CHECK(x.dim() == 3 && alpha.numel() == x.size(1) && beta.numel() == x.size(1),
              "snake: x [B, C, T] with alpha and beta of C values");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16, "snake: float32 or bfloat16");
  const int64_t channels = x.size(1), steps = x.size(2);
  const at::Tensor input = x.stride(2) == 1 ? x : x.contiguous();  // rows at any stride (a trimmed convolution's)
  const at::Tensor a = alpha.to(at::kFloat).contiguous(), b = beta.to(at::kFloat).contiguous();
  std::vector<float> frequency(channels), scale(channels);
  for (int64_t c = 0; c < channels; ++c) {
    frequency[c] = std::exp(a.data_ptr<float>()[c]);
    scale[c] = 1.f / (std::exp(b.data_ptr<float>()[c]) + static_cast<float>(eps));
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "snake", [&] {
    const scalar_t* px = input.data_ptr<scalar_t>();
    scalar_t* po = out.data_ptr<scalar_t>();
    at::parallel_for(0, x.size(0) * channels, grain(steps), [&](int64_t begin, int64_t end) {
      snake_rows<scalar_t>(px, input.stride(0), input.stride(1), po, frequency.data(), scale.data(), channels, steps,
                           begin, end);
    });
  });
  return out;
}

}  // namespace rvqspec
