// LayerNorm and RMSNorm on the CPU: the C++ twin of layer_norm.cu, registered for the CPU dispatch key of
// the same ops.
//
// What it computes ("rstd" is the reciprocal standard deviation)
//   forward    mean = sum(x)/n,  rstd = 1/sqrt(sum((x - mean)^2)/n + eps),  y = (x - mean)*rstd*w + b
//   backward   xhat = (x - mean)*rstd,  g = w*dy,  dx = rstd*(g - mean(g) - xhat*mean(g*xhat))
//              dw = sum over rows of dy*xhat,  db = sum over rows of dy
//   RMSNorm is the same with mean = 0 and no bias (so no mean(g) term and no db): the template
//   parameter kSubtractMean switches both off at compile time.
//
// The one idea that makes it fast
//   The GPU kernels' plan, with threads for blocks and SIMD lanes for warps. OpenMP gives each core a
//   contiguous range of rows; within a row every loop is a branch-free `omp simd` loop (the reductions
//   are declared, so the compiler may keep 8 partial sums in one AVX2 register). A row of a few
//   thousand values stays in L1/L2 between the passes over it. The cross-row sums dw, db go into one
//   private row per thread, summed column by column at the end: no atomics, and the same bits on every
//   run with the same thread count.
//
// Limits
//   float32 (accumulating in float32, as the CUDA kernels do) and float64; any n >= 1. The backward
//   allocates 2 * min(threads, rows) * n scratch values (RMSNorm: 1 *, no db).
//
// Check
//   python -m pytest tests -k "layer_norm and cuda and cpu"
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "cpu_common.h"

namespace kernel_ladder {
namespace {

template <typename T, bool kSubtractMean>
void layer_norm_forward(const T* __restrict x, const T* __restrict weight, const T* __restrict bias, T* __restrict y,
                        T* __restrict mean, T* __restrict rstd, int64_t rows, int64_t n, T eps) {
#pragma omp parallel for schedule(static) if (rows * n >= kMinParallelElements)
  for (int64_t row = 0; row < rows; ++row) {
    const T* __restrict x_row = x + row * n;
    T* __restrict y_row = y + row * n;
    T row_mean = 0;
    if constexpr (kSubtractMean) {
      T sum = 0;
#pragma omp simd reduction(+ : sum)
      for (int64_t i = 0; i < n; ++i) sum += x_row[i];
      row_mean = sum / T(n);
      mean[row] = row_mean;
    }
    // Two passes (mean, then the centred squares) rather than sum(x^2) - n*mean^2, which cancels.
    T squares = 0;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < n; ++i) squares += (x_row[i] - row_mean) * (x_row[i] - row_mean);
    const T row_rstd = T(1) / std::sqrt(squares / T(n) + eps);
    rstd[row] = row_rstd;
    if constexpr (kSubtractMean) {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) y_row[i] = (x_row[i] - row_mean) * row_rstd * weight[i] + bias[i];
    } else {
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) y_row[i] = x_row[i] * row_rstd * weight[i];
    }
  }
}

template <typename T, bool kSubtractMean>
void layer_norm_backward(const T* __restrict grad_out, const T* __restrict x, const T* __restrict weight,
                         const T* __restrict mean, const T* __restrict rstd, T* __restrict grad_x,
                         T* __restrict grad_weight, T* __restrict grad_bias, int64_t rows, int64_t n) {
  // One private (dw, db) row pair per thread (RMSNorm: dw alone); more threads than rows would only add zeros.
  constexpr int kSums = kSubtractMean ? 2 : 1;
  const int team = static_cast<int>(std::min<int64_t>(omp_get_max_threads(), rows));
  std::vector<T> partials(static_cast<size_t>(kSums * team * n), T(0));
#pragma omp parallel num_threads(team) if (rows * n >= kMinParallelElements)
  {
    T* __restrict thread_dw = partials.data() + kSums * n * omp_get_thread_num();
    T* __restrict thread_db = thread_dw + n;  // LayerNorm only
#pragma omp for schedule(static)
    for (int64_t row = 0; row < rows; ++row) {
      const T* __restrict dy_row = grad_out + row * n;
      const T* __restrict x_row = x + row * n;
      T* __restrict dx_row = grad_x + row * n;
      const T row_mean = kSubtractMean ? mean[row] : T(0), row_rstd = rstd[row];
      T sum_g = 0, sum_g_xhat = 0;
#pragma omp simd reduction(+ : sum_g, sum_g_xhat)
      for (int64_t i = 0; i < n; ++i) {
        const T g = weight[i] * dy_row[i];
        sum_g += g;
        sum_g_xhat += g * (x_row[i] - row_mean) * row_rstd;
      }
      const T mean_g = kSubtractMean ? sum_g / T(n) : T(0), mean_g_xhat = sum_g_xhat / T(n);
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) {
        const T xhat = (x_row[i] - row_mean) * row_rstd;
        dx_row[i] = row_rstd * (weight[i] * dy_row[i] - mean_g - xhat * mean_g_xhat);
        thread_dw[i] += dy_row[i] * xhat;
        if constexpr (kSubtractMean) thread_db[i] += dy_row[i];
      }
    }
    // The implicit barrier of `omp for` above: every thread's partial rows are complete.
#pragma omp for schedule(static)
    for (int64_t i = 0; i < n; ++i) {
      T dw = 0, db = 0;
      for (int t = 0; t < team; ++t) {  // a fixed order: deterministic
        dw += partials[kSums * n * t + i];
        if constexpr (kSubtractMean) db += partials[kSums * n * t + n + i];
      }
      grad_weight[i] = dw;
      if constexpr (kSubtractMean) grad_bias[i] = db;
    }
  }
}

}  // namespace

void layer_norm_forward_cpu(DType dtype, const void* x, const void* weight, const void* bias, void* y, void* mean,
                            void* rstd, int64_t rows, int64_t n, double eps) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    layer_norm_forward<T, true>(static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const T*>(bias),
                                static_cast<T*>(y), static_cast<T*>(mean), static_cast<T*>(rstd), rows, n,
                                static_cast<T>(eps));
  });
}

void layer_norm_backward_cpu(DType dtype, const void* grad_out, const void* x, const void* weight, const void* mean,
                             const void* rstd, void* grad_x, void* grad_weight, void* grad_bias, int64_t rows,
                             int64_t n) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    layer_norm_backward<T, true>(static_cast<const T*>(grad_out), static_cast<const T*>(x),
                                 static_cast<const T*>(weight), static_cast<const T*>(mean),
                                 static_cast<const T*>(rstd), static_cast<T*>(grad_x), static_cast<T*>(grad_weight),
                                 static_cast<T*>(grad_bias), rows, n);
  });
}

void rms_norm_forward_cpu(DType dtype, const void* x, const void* weight, void* y, void* rstd, int64_t rows, int64_t n,
                          double eps) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    layer_norm_forward<T, false>(static_cast<const T*>(x), static_cast<const T*>(weight), nullptr, static_cast<T*>(y),
                                 nullptr, static_cast<T*>(rstd), rows, n, static_cast<T>(eps));
  });
}

void rms_norm_backward_cpu(DType dtype, const void* grad_out, const void* x, const void* weight, const void* rstd,
                           void* grad_x, void* grad_weight, int64_t rows, int64_t n) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    layer_norm_backward<T, false>(static_cast<const T*>(grad_out), static_cast<const T*>(x),
                                  static_cast<const T*>(weight), nullptr, static_cast<const T*>(rstd),
                                  static_cast<T*>(grad_x), static_cast<T*>(grad_weight), nullptr, rows, n);
  });
}

}  // namespace kernel_ladder
