// Swish on the CPU: the C++ twin of swish.cu, registered for the CPU dispatch key of the same ops.
//
// What it computes
//   swish_forward    y  = x * s,                           s = sigmoid(beta * x)
//   swish_backward   dx = dy * s * (1 + beta * x * (1 - s))  (s recomputed)
//
// The one idea that makes it fast
//   One pass over memory, split across cores by OpenMP and across SIMD lanes (8 floats per AVX2
//   register) by the compiler. The lanes only fill if the loop body has no branch and no call the
//   compiler cannot vectorise, and std::exp is such a call: glibc's vector exp (libmvec) is only
//   declared under -ffast-math. So exp is written out below, branch-free: 2^k times a polynomial.
//   Three kernels of level 1 (beta*x, sigmoid, multiply) become one pass at memory speed.
//
// Limits
//   float32 and float64 (float16/bfloat16 on the CPU are rejected by the binding); any numel.
//
// Check
//   python -m pytest tests -k "swish and cuda and cpu"
//   g++ -std=c++17 -O3 -march=native -fopenmp -fno-trapping-math -ffp-contract=off -fopt-info-vec \
//       -c cuda_kernels/swish_cpu.cpp -o /tmp/swish_cpu.o
//   (both loops should report "loop vectorized using 32 byte vectors" on AVX2)
#include <algorithm>
#include <array>
#include <cstring>

#include "cpu_common.h"

namespace kernel_ladder {
namespace {

// exp(x) = 2^k * exp(r), k = round(x / ln2), |r| <= ln2/2. 2^k goes straight into the exponent bits;
// exp(r) is its Taylor polynomial, short because r is small. Every step is a plain arithmetic or
// integer operation (no floor, no float-to-int64 conversion, which AVX2 lacks), so `#pragma omp simd`
// turns the whole function into vector instructions. One flag is needed: -fno-trapping-math (the
// loader passes it), without which gcc keeps the clamp below as a branch instead of a vector min/max.
// (std::fma would also stop the vectoriser, so Horner's steps are a multiply and an add.)
template <typename T> struct ExpConstants;
template <> struct ExpConstants<float> {
  using Bits = int32_t;
  static constexpr int kMantissaBits = 23, kExponentBias = 127, kDegree = 7;  // error term r^8/8! ~ 5e-9
  static constexpr float kMin = -87.0f, kMax = 89.0f;                          // k from -126 to 128
  static constexpr float kRoundingShift = 12582912.0f;                         // 1.5 * 2^23
  static constexpr float kLn2High = 0.693145751953125f, kLn2Low = 1.42860682030941723212e-6f;  // ln2, split
};
template <> struct ExpConstants<double> {
  using Bits = int64_t;
  static constexpr int kMantissaBits = 52, kExponentBias = 1023, kDegree = 13;  // r^14/14! ~ 4e-18
  static constexpr double kMin = -708.0, kMax = 710.0;                          // k from -1022 to 1024
  static constexpr double kRoundingShift = 6755399441055744.0;                  // 1.5 * 2^52
  static constexpr double kLn2High = 6.93147180369123816490e-01, kLn2Low = 1.90821492927058770002e-10;
};

template <typename T>
inline typename ExpConstants<T>::Bits bits_of(T value) {
  typename ExpConstants<T>::Bits bits;
  std::memcpy(&bits, &value, sizeof(T));
  return bits;
}

// 1/0!, 1/1!, ..., 1/kDegree!: the Taylor coefficients of exp, computed by the compiler.
template <typename T>
constexpr std::array<T, ExpConstants<T>::kDegree + 1> inverse_factorials() {
  std::array<T, ExpConstants<T>::kDegree + 1> c{};
  double value = 1.0;
  for (int i = 0; i <= ExpConstants<T>::kDegree; ++i) {
    value /= (i == 0 ? 1.0 : i);
    c[i] = static_cast<T>(value);
  }
  return c;
}

template <typename T>
inline T exp_branch_free(T x) {
  using C = ExpConstants<T>;
  static constexpr auto kCoefficients = inverse_factorials<T>();
  // Below kMin, exp(x) is under the smallest normal number and 1 + exp(x) rounds to 1 anyway. At kMax,
  // k = 128 (1024) fills the exponent field with ones: exactly +inf, as an overflowing exp should be.
  x = std::min(std::max(x, C::kMin), C::kMax);
  // Adding 1.5 * 2^mantissa_bits makes the adder round x/ln2 to an integer k and leaves k in the low
  // bits of the sum. (Needs IEEE arithmetic: -ffast-math would fold the "+ shift - shift" away.)
  const T shifted = x * T(1.44269504088896340736) + C::kRoundingShift;
  const T k = shifted - C::kRoundingShift;
  const T r = (x - k * C::kLn2High) - k * C::kLn2Low;  // two-part ln2 keeps r exact to the last bit
  T polynomial = kCoefficients[C::kDegree];
  for (int i = C::kDegree - 1; i >= 0; --i) polynomial = polynomial * r + kCoefficients[i];  // Horner
  const typename C::Bits k_bits = bits_of(shifted) - bits_of(C::kRoundingShift);
  const typename C::Bits exponent = (k_bits + C::kExponentBias) << C::kMantissaBits;
  T two_to_k;
  std::memcpy(&two_to_k, &exponent, sizeof(T));
  return polynomial * two_to_k;
}

template <typename T>
inline T sigmoid(T z) { return T(1) / (T(1) + exp_branch_free(-z)); }

template <typename T>
void swish_forward(const T* __restrict x, T* __restrict y, int64_t numel, T beta) {
#pragma omp parallel for simd schedule(static) if (numel >= kMinParallelElements)
  for (int64_t i = 0; i < numel; ++i) y[i] = x[i] * sigmoid(beta * x[i]);
}

template <typename T>
void swish_backward(const T* __restrict grad_out, const T* __restrict x, T* __restrict grad_x, int64_t numel, T beta) {
#pragma omp parallel for simd schedule(static) if (numel >= kMinParallelElements)
  for (int64_t i = 0; i < numel; ++i) {
    const T s = sigmoid(beta * x[i]);  // recomputed: cheaper than storing s forward and reading it back
    grad_x[i] = grad_out[i] * s * (T(1) + beta * x[i] * (T(1) - s));
  }
}

}  // namespace

void swish_forward_cpu(DType dtype, const void* x, void* y, int64_t numel, double beta) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    swish_forward<T>(static_cast<const T*>(x), static_cast<T*>(y), numel, static_cast<T>(beta));
  });
}

void swish_backward_cpu(DType dtype, const void* grad_out, const void* x, void* grad_x, int64_t numel, double beta) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    swish_backward<T>(static_cast<const T*>(grad_out), static_cast<const T*>(x), static_cast<T*>(grad_x), numel,
                      static_cast<T>(beta));
  });
}

}  // namespace kernel_ladder
