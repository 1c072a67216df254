// Softmax on the CPU: the C++ twin of softmax.cu, registered for the CPU dispatch key of the same ops.
//
// What it computes, over each row of a (rows, n) matrix
//   forward    y = exp(x - max x) / sum(exp(x - max x))
//   backward   dx = y * (dy - sum(dy * y))
//
// The one idea that makes it fast
//   The online softmax, at the grain of a chunk that sits in L1: a running maximum m and a running sum
//   s of exp(x - m), rescaled by exp(m_old - m_new) whenever a chunk raises the maximum. Statistics take
//   one pass over the row and the output a second, however long the row. Inside a chunk every loop is a
//   branch-free `omp simd` loop (max, then sum of exps with the vectorisable exp of cpu_common.h), so
//   the SIMD lanes fill; OpenMP splits the rows across cores.
//
// Limits
//   float32 (accumulating in float32, as the CUDA kernels do) and float64; any n >= 1.
//
// Check
//   python -m pytest tests -k "softmax and cuda and cpu"
#include <limits>

#include "cpu_common.h"

namespace kernel_ladder {
namespace {

// 2 KiB of float32: small enough to stay in L1 between its max loop and its exp loop.
constexpr int64_t kChunk = 512;

template <typename T>
void softmax_forward(const T* __restrict x, T* __restrict y, int64_t rows, int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= kMinParallelElements)
  for (int64_t row = 0; row < rows; ++row) {
    const T* __restrict x_row = x + row * n;
    T* __restrict y_row = y + row * n;
    T running_max = -std::numeric_limits<T>::infinity(), running_sum = 0;
    for (int64_t start = 0; start < n; start += kChunk) {
      const int64_t end = std::min(start + kChunk, n);
      T chunk_max = running_max;
#pragma omp simd reduction(max : chunk_max)
      for (int64_t i = start; i < end; ++i) chunk_max = std::max(chunk_max, x_row[i]);
      if (chunk_max == -std::numeric_limits<T>::infinity()) continue;  // all -inf so far: nothing to add
      T chunk_sum = 0;
#pragma omp simd reduction(+ : chunk_sum)
      for (int64_t i = start; i < end; ++i) chunk_sum += exp_branch_free(x_row[i] - chunk_max);
      // The sum so far was of exp(x - running_max): rescale it to the new maximum.
      running_sum = running_sum * exp_branch_free(running_max - chunk_max) + chunk_sum;
      running_max = chunk_max;
    }
    const T inverse_sum = T(1) / running_sum;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) y_row[i] = exp_branch_free(x_row[i] - running_max) * inverse_sum;
  }
}

template <typename T>
void softmax_backward(const T* __restrict grad_out, const T* __restrict y, T* __restrict grad_x, int64_t rows,
                      int64_t n) {
#pragma omp parallel for schedule(static) if (rows * n >= kMinParallelElements)
  for (int64_t row = 0; row < rows; ++row) {
    const T* __restrict dy_row = grad_out + row * n;
    const T* __restrict y_row = y + row * n;
    T* __restrict dx_row = grad_x + row * n;
    T dot = 0;
#pragma omp simd reduction(+ : dot)
    for (int64_t i = 0; i < n; ++i) dot += dy_row[i] * y_row[i];
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) dx_row[i] = y_row[i] * (dy_row[i] - dot);
  }
}

}  // namespace

void softmax_forward_cpu(DType dtype, const void* x, void* y, int64_t rows, int64_t n) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    softmax_forward<T>(static_cast<const T*>(x), static_cast<T*>(y), rows, n);
  });
}

void softmax_backward_cpu(DType dtype, const void* grad_out, const void* y, void* grad_x, int64_t rows, int64_t n) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    softmax_backward<T>(static_cast<const T*>(grad_out), static_cast<const T*>(y), static_cast<T*>(grad_x), rows, n);
  });
}

}  // namespace kernel_ladder
