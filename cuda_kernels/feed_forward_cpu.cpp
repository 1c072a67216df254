// The feed-forward block around its matmuls, on the CPU: the C++ twin of feed_forward.cu, registered for
// the CPU dispatch key of the same ops (the matmuls themselves are ATen's, MKL or oneDNN, in ops.cpp).
//
// What it computes
//   gelu_forward    a = gelu_tanh(h) = h s,                         s = 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u))
//   gelu_backward   dh = da * (s + 2 h s (1 - s) du/dh), written over da, and the column sums of dh
//   column_sum      the column sums of a matrix (a linear layer's bias gradient from dy)
//                   u = sqrt(2/pi) (h + 0.044715 h^3)
//
// The one idea that makes it fast
//   Every loop is a branch-free `omp simd` loop (exp is cpu_common.h's vectorisable one), so a core
//   computes 8 floats per AVX2 instruction. The column sums split the columns, not the rows, across
//   cores: a thread owns a chunk of columns, whose running sums stay in L1 while it walks down every row,
//   adding each row's chunk in one vector loop. No thread shares a sum, so no atomics, no private
//   copies to merge, and the same bits on every run whatever the thread count. The GELU backward is
//   the same walk, with dh computed, stored and summed in the one loop: da and h are read once.
//
// Limits
//   float32 (accumulating in float32, as the CUDA kernels do) and float64; any size. The column sums
//   keep at most ceil(n / 256) cores busy.
//
// Check
//   python -m pytest tests -k "feed_forward and cuda and cpu"
//   g++ -std=c++17 -O3 -march=native -fopenmp -fno-math-errno -fno-trapping-math -ffp-contract=off \
//       -fopt-info-vec -I$(python -c "import torch.utils.cpp_extension as c; print(c.include_paths()[0])") \
//       -c cuda_kernels/feed_forward_cpu.cpp -o /tmp/feed_forward_cpu.o   (every loop "vectorized")
#include <omp.h>

#include <algorithm>

#include "cpu_common.h"

namespace kernel_ladder {
namespace {

// A thread's chunk of columns is a run of every row it reads. Runs should be long: the hardware
// prefetcher follows a stream only so far, and each new row is a new page for the TLB. On one EPYC core,
// the GELU backward of (8192, 3072) float32 took 105 ms in 128-column chunks, 50 ms in 1024-column ones
// (a plain loop over the whole matrix: 44 ms). So: an
// equal share of the columns per thread, but at least 256 and at most 2048 (8 KB of float32 running sums,
// which stay in L1).
constexpr int64_t kMinColumnChunk = 256, kMaxColumnChunk = 2048;

template <typename T>
inline T gelu_argument(T h) { return T(0.79788456080286535588) * (h + T(0.044715) * h * h * h); }

template <typename T>
inline T gelu_argument_slope(T h) { return T(0.79788456080286535588) * (T(1) + T(3 * 0.044715) * h * h); }

// 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)). The exp saturates to +inf for u below about -44 (float32),
// giving 0, the limit.
template <typename T>
inline T half_one_plus_tanh(T u) { return T(1) / (T(1) + exp_branch_free(T(-2) * u)); }

template <typename T>
inline T gelu_slope(T h) {
  const T s = half_one_plus_tanh(gelu_argument(h));
  return s + T(2) * h * s * (T(1) - s) * gelu_argument_slope(h);
}

template <typename T>
void gelu_forward(const T* __restrict pre_activation, T* __restrict activation, int64_t numel) {
#pragma omp parallel for simd schedule(static) if (parallel : numel >= kMinParallelElements)
  for (int64_t i = 0; i < numel; ++i) activation[i] = pre_activation[i] * half_one_plus_tanh(gelu_argument(pre_activation[i]));
}

// sums (n,) = the column sums of a (rows, n) matrix whose rows `add_row(row, begin, end)` produces:
// it adds the row's columns [begin, end) to sums[begin, end). Each thread owns whole chunks of columns.
template <typename T, typename AddRow>
void sum_columns(T* __restrict sums, int64_t rows, int64_t n, AddRow add_row) {
  const int64_t share = (n + omp_get_max_threads() - 1) / omp_get_max_threads();
  const int64_t width = std::clamp((share + 63) / 64 * 64, kMinColumnChunk, kMaxColumnChunk);  // whole cache lines
  const int64_t chunks = (n + width - 1) / width;
#pragma omp parallel for schedule(static) if (rows * n >= kMinParallelElements)
  for (int64_t chunk = 0; chunk < chunks; ++chunk) {
    const int64_t begin = chunk * width, end = std::min(begin + width, n);
    std::fill(sums + begin, sums + end, T(0));
    for (int64_t row = 0; row < rows; ++row) add_row(row, begin, end);
  }
}

template <typename T>
void column_sum(const T* __restrict matrix, T* __restrict sums, int64_t rows, int64_t n) {
  sum_columns(sums, rows, n, [&](int64_t row, int64_t begin, int64_t end) {
    const T* __restrict values = matrix + row * n;
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) sums[i] += values[i];
  });
}

template <typename T>
void gelu_backward(T* __restrict grad, const T* __restrict pre_activation, T* __restrict grad_bias, int64_t rows,
                   int64_t n) {
  sum_columns(grad_bias, rows, n, [&](int64_t row, int64_t begin, int64_t end) {
    T* __restrict grad_row = grad + row * n;
    const T* __restrict pre_activation_row = pre_activation + row * n;
#pragma omp simd
    for (int64_t i = begin; i < end; ++i) {
      const T grad_hidden = grad_row[i] * gelu_slope(pre_activation_row[i]);
      grad_row[i] = grad_hidden;
      grad_bias[i] += grad_hidden;
    }
  });
}

}  // namespace

void gelu_forward_cpu(DType dtype, const void* pre_activation, void* activation, int64_t numel) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    gelu_forward<T>(static_cast<const T*>(pre_activation), static_cast<T*>(activation), numel);
  });
}

void column_sum_cpu(DType dtype, const void* matrix, void* sums, int64_t rows, int64_t n) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    column_sum<T>(static_cast<const T*>(matrix), static_cast<T*>(sums), rows, n);
  });
}

void gelu_backward_cpu(DType dtype, void* grad, const void* pre_activation, void* grad_bias, int64_t rows, int64_t n) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    gelu_backward<T>(static_cast<T*>(grad), static_cast<const T*>(pre_activation), static_cast<T*>(grad_bias), rows, n);
  });
}

}  // namespace kernel_ladder
