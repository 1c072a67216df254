// The fused LM head + cross-entropy on the CPU: the C++ twin of linear_cross_entropy.cu, registered for
// the CPU dispatch key of the same ops (the matmuls themselves are ATen's, MKL or oneDNN, in the binding).
//
// What it computes
//   cross_entropy_rows       each row's loss term logsumexp(row) - row[target], and with write_gradient
//                            the row overwritten by (softmax(row) - onehot(target)) * scale
//   mean_loss                the loss terms summed in row order, times 1 / n_valid
//   scale_by_device_scalar   out = x * factor[0]: the backward's grad_hidden and grad_weight
//
// The one idea that makes it fast
//   softmax_cpu.cpp's online softmax at the grain of a chunk that sits in L1: a running maximum m and a
//   running sum of exp(x - m), rescaled by exp(m_old - m_new) whenever a chunk raises the maximum, every
//   loop a branch-free `omp simd` loop with the vectorisable exp of cpu_common.h; OpenMP splits the rows
//   across cores. One difference: softmax_cpu.cpp keeps pass 1's exps in y and only rescales them in
//   pass 2, but here y is x, and x must survive pass 1 (its maximum is not known until the end), so
//   pass 2 computes each exp again.
//
// Limits
//   float32 (accumulating in float32, as the CUDA kernels do) and float64; any n >= 1.
//
// Check
//   python -m pytest tests -k "linear_cross_entropy and cuda and cpu"
#include <cmath>
#include <limits>
#include <utility>

#include "cpu_common.h"

namespace kernel_ladder {
namespace {

// 2 KiB of float32: small enough to stay in L1 between its max loop and its exp loop.
constexpr int64_t kChunk = 512;

// The row's maximum and sum of exp(x - maximum), one L1-sized chunk at a time.
template <typename T>
std::pair<T, T> row_max_and_sum(const T* __restrict row, int64_t n) {
  T running_max = -std::numeric_limits<T>::infinity(), running_sum = 0;
  for (int64_t start = 0; start < n; start += kChunk) {
    const int64_t end = std::min(start + kChunk, n);
    const T chunk_max = simd_maximum(row, start, end, running_max);
    if (chunk_max == -std::numeric_limits<T>::infinity()) continue;  // all -inf so far: nothing to add
    T chunk_sum = 0;
#pragma omp simd reduction(+ : chunk_sum)
    for (int64_t i = start; i < end; ++i) chunk_sum += exp_branch_free(row[i] - chunk_max);
    // The sum so far was of exp(x - running_max): rescale it to the new maximum.
    running_sum = running_sum * exp_branch_free(running_max - chunk_max) + chunk_sum;
    running_max = chunk_max;
  }
  return {running_max, running_sum};
}

// The mean's 1/n, 0 when no target is valid (a loss of 0, not 0/0).
template <typename T>
T inverse_count(const int64_t* n_valid) {
  return *n_valid > 0 ? T(1) / T(*n_valid) : T(0);
}

template <typename T>
void cross_entropy_rows(T* logits, const int64_t* targets, T* row_losses, int64_t rows, int64_t n, int64_t row_stride,
                        int64_t ignore_index, T scale, bool write_gradient) {
#pragma omp parallel for schedule(static) if (rows * n >= kMinParallelElements)
  for (int64_t r = 0; r < rows; ++r) {
    T* __restrict row = logits + r * row_stride;
    const int64_t target = targets[r];
    if (target == ignore_index) {
      row_losses[r] = T(0);
      if (write_gradient) std::fill(row, row + n, T(0));
      continue;
    }
    const std::pair<T, T> statistics = row_max_and_sum(row, n);
    const T maximum = statistics.first, sum = statistics.second;
    // A target outside the row fails the call after this (the binding's range check): read nothing for it.
    const bool in_row = target >= 0 && target < n;
    row_losses[r] = std::log(sum) + maximum - (in_row ? row[target] : T(0));
    if (!write_gradient) continue;
    // (exp(x - max) / sum - [i == target]) * scale; one multiply by probability_scale, no division.
    const T probability_scale = scale / sum;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) row[i] = exp_branch_free(row[i] - maximum) * probability_scale;
    if (in_row) row[target] -= scale;
  }
}

template <typename T>
void scale_by_device_scalar(const T* __restrict x, T factor, T* __restrict out, int64_t numel) {
#pragma omp parallel for simd schedule(static) if (parallel : numel >= kMinParallelElements)
  for (int64_t i = 0; i < numel; ++i) out[i] = x[i] * factor;
}

}  // namespace

void cross_entropy_rows_cpu(DType dtype, void* logits, const int64_t* targets, void* row_losses, int64_t rows, int64_t n,
                            int64_t row_stride, int64_t ignore_index, const int64_t* n_valid, bool write_gradient) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    cross_entropy_rows<T>(static_cast<T*>(logits), targets, static_cast<T*>(row_losses), rows, n, row_stride, ignore_index,
                          inverse_count<T>(n_valid), write_gradient);
  });
}

// A few thousand terms added in row order: the same bits on every run, whatever the thread count.
void mean_loss_cpu(DType dtype, const void* row_losses, void* loss, int64_t rows, const int64_t* n_valid) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    const T* terms = static_cast<const T*>(row_losses);
    T sum = 0;
    for (int64_t r = 0; r < rows; ++r) sum += terms[r];
    *static_cast<T*>(loss) = sum * inverse_count<T>(n_valid);
  });
}

void scale_by_device_scalar_cpu(DType dtype, const void* x, const void* factor, void* out, int64_t numel) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    scale_by_device_scalar<T>(static_cast<const T*>(x), *static_cast<const T*>(factor), static_cast<T*>(out), numel);
  });
}

}  // namespace kernel_ladder
