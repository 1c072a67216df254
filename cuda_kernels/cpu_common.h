// What the C++ CPU twins share: the float/double switch, when OpenMP is worth a thread team, and a
// maximum and an exp the compiler can vectorise.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>

#include "kernels.h"

namespace kernel_ladder {

// Waking a thread team costs a few microseconds: below this many elements one thread finishes first.
// On a combined `parallel for simd` write the clause as `if (parallel : n >= kMinParallelElements)`:
// a bare `if` applies to the simd part too (OpenMP 5.0), and a small loop then runs one element at a
// time, 5x slower, at exactly the decode sizes where per-call time matters most.
constexpr int64_t kMinParallelElements = 1 << 15;

// max(start_max, x[start..end)), a branch-free SIMD reduction. Written with a ternary on values, not
// std::max: std::max returns a reference, and gcc then keeps the running maximum in memory and runs the
// loop one element at a time (vmaxss), which made softmax's CPU forward 2.5x slower than it is now. NaN
// elements are skipped, as std::max(maximum, x) would skip them.
template <typename T>
T simd_maximum(const T* __restrict x, int64_t start, int64_t end, T start_max) {
  T maximum = start_max;
#pragma omp simd reduction(max : maximum)
  for (int64_t i = start; i < end; ++i) maximum = x[i] > maximum ? x[i] : maximum;
  return maximum;
}

// Calls fn(T{}) with T = float or double; fn is a generic lambda that reads T back with decltype.
// The binding has already rejected every other dtype for CPU tensors.
template <typename Fn>
void dispatch_cpu_dtype(DType dtype, Fn&& fn) {
  if (dtype == DType::Float64) {
    fn(double{});
  } else {
    fn(float{});
  }
}

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
  // Below kMin, exp(x) is under the smallest normal number: the result is flushed to 0 (so a masked
  // -inf score gets probability exactly 0). At kMax, k = 128 (1024) fills the exponent field with
  // ones: exactly +inf, as an overflowing exp should be.
  const bool underflows = x < C::kMin;
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
  return underflows ? T(0) : polynomial * two_to_k;
}

}  // namespace kernel_ladder
