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
//   declared under -ffast-math. So exp is written out in cpu_common.h, branch-free: 2^k times a polynomial.
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
#include "cpu_common.h"

namespace kernel_ladder {
namespace {

template <typename T>
inline T sigmoid(T z) { return T(1) / (T(1) + exp_branch_free(-z)); }

template <typename T>
void swish_forward(const T* __restrict x, T* __restrict y, int64_t numel, T beta) {
#pragma omp parallel for simd schedule(static) if (parallel : numel >= kMinParallelElements)
  for (int64_t i = 0; i < numel; ++i) y[i] = x[i] * sigmoid(beta * x[i]);
}

template <typename T>
void swish_backward(const T* __restrict grad_out, const T* __restrict x, T* __restrict grad_x, int64_t numel, T beta) {
#pragma omp parallel for simd schedule(static) if (parallel : numel >= kMinParallelElements)
  for (int64_t i = 0; i < numel; ++i) {
    // Recomputed, as the op's schema (x, not s) requires: the GPU's trade, where a saved s costs a write
    // and a read of HBM. Here the second exp costs about what the forward's did (levels/swish.py).
    const T s = sigmoid(beta * x[i]);
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
