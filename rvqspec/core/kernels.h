// What the CPU kernels share (fused.cpp: the decoder layer's elementwise work; int8.cpp: w8a8's and w8a16's
// integer side): the grain of their parallel loops and loads/stores that gcc vectorises.
#pragma once
#include <ATen/ATen.h>
#include <algorithm>
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

// Defined in snake.cpp: the 12 Hz speech decoder's SnakeBeta activation in one pass.
at::Tensor snake(const at::Tensor& x, const at::Tensor& alpha, const at::Tensor& beta, double eps);

// Defined in int8.cpp, registered with the module in fused.cpp.
std::vector<at::Tensor> quantize_rows(const at::Tensor& x);
at::Tensor scale_rows(const at::Tensor& acc, const at::Tensor& scale, const at::Tensor& like);
bool has_int8_gemm();
bool has_vnni_gemm();
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t out_features);
at::Tensor vnni_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, const at::Tensor& offsets,
                       int64_t out_features);
// A stack's threads (int8.cpp): with_team runs body on thread 0 of a parallel region of `threads` threads, the
// others taking chunks of each vnni_linear_on(team, ...) until body returns; body(nullptr) where there is no team
// (1 thread, no OpenMP or no VNNI GEMM, already inside a parallel region). vnni_linear_on(nullptr, ...) = vnni_linear.
class Team;
void with_team(int threads, const std::function<void(Team*)>& body);
at::Tensor vnni_linear_on(Team* team, const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale,
                          const at::Tensor& offsets, int64_t out_features);
at::Tensor w8a16_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& scale, int64_t out_features);
// Defined in bf16.cpp, registered in fused.cpp too.
bool has_bf16_gemm();
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& packed, const c10::optional<at::Tensor>& bias,
                       int64_t out_features);

}  // namespace rvqspec
