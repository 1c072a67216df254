// Softmax on the CPU: the C++ twin of softmax.cu, registered for the CPU dispatch key of the same ops.
//
// What it computes, over each row of a (rows, n) matrix
//   forward    y = exp(x - max x) / sum(exp(x - max x))
//   backward   dx = y * (dy - sum(dy * y))
//
// The one idea that makes it fast
//   The online softmax, at the grain of a chunk that sits in L1: a running maximum m and a running sum
//   s of exp(x - m), rescaled by exp(m_old - m_new) whenever a chunk raises the maximum. The first pass
//   also writes each chunk's exps (shifted by that chunk's running maximum) to y, and the second only
//   rescales them, one exp per element in all. Inside a chunk every loop is a branch-free `omp simd`
//   loop (max, then exps with the vectorisable exp of cpu_common.h), so the SIMD lanes fill; OpenMP
//   splits the rows across cores.
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
    // Pass 1: each chunk's exps, shifted by the maximum so far (m_c), are written to y as they are
    // summed; the running sum is rescaled whenever a chunk raises the maximum.
    T running_max = -std::numeric_limits<T>::infinity(), running_sum = 0;
    for (int64_t start = 0; start < n; start += kChunk) {
      const int64_t end = std::min(start + kChunk, n);
      const T chunk_max = simd_maximum(x_row, start, end, running_max);
      if (chunk_max == -std::numeric_limits<T>::infinity()) {  // all -inf so far: exps of 0, nothing to add
#pragma omp simd
        for (int64_t i = start; i < end; ++i) y_row[i] = T(0);
        continue;
      }
      T chunk_sum = 0;
#pragma omp simd reduction(+ : chunk_sum)
      for (int64_t i = start; i < end; ++i) {
        y_row[i] = exp_branch_free(x_row[i] - chunk_max);
        chunk_sum += y_row[i];
      }
      // The sum so far was of exp(x - running_max): rescale it to the new maximum.
      running_sum = running_sum * exp_branch_free(running_max - chunk_max) + chunk_sum;
      running_max = chunk_max;
    }
    // Pass 2: exp(x - m) = exp(x - m_c) * exp(m_c - m), so each chunk needs one more exp, not one an
    // element (the exp is most of the arithmetic). m_c is found again by the cheap max loop.
    const T inverse_sum = T(1) / running_sum;
    T prefix_max = -std::numeric_limits<T>::infinity();
    for (int64_t start = 0; start < n; start += kChunk) {
      const int64_t end = std::min(start + kChunk, n);
      prefix_max = simd_maximum(x_row, start, end, prefix_max);
      const T scale = exp_branch_free(prefix_max - running_max) * inverse_sum;
#pragma omp simd
      for (int64_t i = start; i < end; ++i) y_row[i] *= scale;
    }
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
