// LayerNorm and RMSNorm in CUDA: forward and backward over the rows of a (rows, n) matrix.
//
// What it computes ("rstd" is the reciprocal standard deviation)
//   forward    mean = sum(x)/n,  rstd = 1/sqrt(sum((x - mean)^2)/n + eps),  y = (x - mean)*rstd*w + b
//   backward   xhat = (x - mean)*rstd,  g = w*dy
//              dx = rstd*(g - mean(g) - xhat*mean(g*xhat))    a reduction along each row
//              dw = sum over rows of dy*xhat,  db = sum over rows of dy    reductions across rows
//   RMSNorm    the same with mean = 0 and no bias: rstd = 1/sqrt(sum(x^2)/n + eps), y = x*rstd*w,
//              dx = rstd*(g - xhat*mean(g*xhat)), dw as above. Every kernel takes a template parameter
//              kSubtractMean; its `false` instance drops the mean reduction, the bias and db at compile time.
//
// Kernels, in the order they run (the backward's in layer_norm_backward.cu)
//   layer_norm_forward_kernel           one block per row; the row sits in registers (four 16-byte
//                                       packs per thread): read once, mean, then variance of the centred values
//                                       (exact two-pass, no second read), normalise, write once
//   layer_norm_forward_looped_kernel    rows too long for registers: the same exact two-pass math, but
//                                       each pass (mean, variance, output) re-reads the row, from L2
//                                       when it is still there
//   layer_norm_backward_kernel          a persistent grid: each block walks rows blockIdx.x, + gridDim.x,
//                                       ... holding x, dy in registers; writes dx, and keeps its running
//                                       dw, db in registers, written once as its row of a partial buffer
//   layer_norm_backward_looped_kernel   the same for long rows: two passes over each row, and the
//                                       block's dw, db accumulated in its partial row in global memory
//   layer_norm_weight_grads_kernel      sums the partial rows' columns into dw and db (deterministic)
//
// The one idea that makes it fast
//   Every element crosses DRAM the fewest times the math allows: x read once and y written once
//   forward; x, dy read once and dx written once backward. Reductions happen in registers (warp
//   shuffles) and one small shared-memory pass. Each thread owns the same columns in every row, so the
//   cross-row sums dw, db need neither atomics nor a second pass over x and dy.
//
// Limits
//   Any n >= 1. Rows of up to 16384 half-precision values (8192 float32, 4096 float64) are held in
//   registers forward, 8192 (4096 float64) backward. Longer rows loop: the forward reads them three times, the backward twice (the
//   re-reads come from L2 while the rows in flight fit there). 16-byte loads need n to be a multiple of
//   the pack width (4 float, 8 half, 2 double) and 16-byte-aligned pointers, else 1-element loads.
//   One block per row forward: fewer rows than SMs leave SMs idle. rows < 2^31.
//   float16, bfloat16, float32 (statistics and sums in float32) and float64.
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -v -c cuda_kernels/layer_norm.cu -o /tmp/layer_norm.o
//   python -m pytest tests -k "(layer_norm or rms_norm) and cuda"
#include <algorithm>

#include "common.cuh"

namespace kernel_ladder {

// Row values per thread in registers. The forward holds one array: four 16-byte packs of the input a
// thread (16 floats, 32 halves, 8 doubles), in blocks of at most 512 threads (up to 128 registers
// each). Four packs is what the H100 liked for both widths, measured at (8192, 8192): with 64 bytes a
// thread, float32 reached 93.7 % of copy bandwidth and bfloat16 91.4 %; with 128 bytes (twice the
// values, half the threads) bfloat16 rose to 94.4 % and float32 fell to 87.5 %. What matters is the
// number of loads each thread keeps in flight and how many blocks share an SM while others wait in
// their two block reductions (barriers), so the budget is counted in packs, not in values. (The
// backward's budget is in layer_norm_backward.cu.)
constexpr int kForwardMaxThreads = 512;
template <typename T> constexpr int kForwardValues = 64 / static_cast<int>(sizeof(T));

// --- forward -------------------------------------------------------------------------------------

// y for one pack of the row from its values in registers; weight and bias are shared by every row and
// stay in L1/L2, so they use ordinary loads, while y is written once (streaming store).
template <typename T, int kVec, bool kSubtractMean>
__device__ __forceinline__ void write_normalized_pack(T* y_row, const T* weight, const T* bias, int64_t pack,
                                                      const Acc<T> (&values)[kVec], Acc<T> mean, Acc<T> rstd) {
  const Pack<T, kVec> w = load_pack<T, kVec>(weight + pack * kVec);
  Pack<T, kVec> b{};
  if constexpr (kSubtractMean) b = load_pack<T, kVec>(bias + pack * kVec);
  Pack<T, kVec> out;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const Acc<T> scaled = (values[j] - mean) * rstd * to_acc(w.val[j]);
    out.val[j] = from_acc<T>(kSubtractMean ? scaled + to_acc(b.val[j]) : scaled);
  }
  store_pack_once<T, kVec>(y_row + pack * kVec, out);
}

template <typename T, int kVec, bool kSubtractMean>
__global__ void __launch_bounds__(kForwardMaxThreads)
layer_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
                          T* __restrict__ y, Acc<T>* __restrict__ mean_out, Acc<T>* __restrict__ rstd_out,
                          int64_t n, Acc<T> eps) {
  using A = Acc<T>;
  constexpr int kPacks = kForwardValues<T> / kVec;
  const T* x_row = x + static_cast<int64_t>(blockIdx.x) * n;
  const int n_packs = static_cast<int>(n / kVec);  // a row held in registers has at most 16384 values
  // Thread t owns packs t, t + blockDim.x, ...: at each step a warp reads 32 adjacent packs (coalesced).
  // Indices into `values` are compile-time constants after unrolling, so the array stays in registers.
  A values[kPacks][kVec];
  A sum = 0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = threadIdx.x + k * blockDim.x;
    Pack<T, kVec> in;
    if (pack < n_packs) in = load_pack_once<T, kVec>(x_row + pack * kVec);  // x is read exactly once
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      values[k][j] = pack < n_packs ? to_acc(in.val[j]) : A(0);
      sum += values[k][j];
    }
  }
  // (RMSNorm: mean 0, and no block reduction for it; its sum is dead code the compiler drops.)
  A mean = 0;
  if constexpr (kSubtractMean) mean = block_sum(sum) / A(n);
  // Variance of the centred values from registers: as exact as two passes, for the price of one read.
  A squares = 0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = threadIdx.x + k * blockDim.x;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const A centred = pack < n_packs ? values[k][j] - mean : A(0);
      squares += centred * centred;
    }
  }
  const A rstd = rsqrt(block_sum(squares) / A(n) + eps);
  if (threadIdx.x == 0) {
    if constexpr (kSubtractMean) mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = threadIdx.x + k * blockDim.x;
    if (pack < n_packs) write_normalized_pack<T, kVec, kSubtractMean>(y + static_cast<int64_t>(blockIdx.x) * n, weight, bias, pack, values[k], mean, rstd);
  }
}

// Rows longer than the registers hold: the register kernel's math, with the row read once per pass.
// Plain (caching) loads: the next pass wants the row still in L2.
template <typename T, int kVec, bool kSubtractMean>
__global__ void __launch_bounds__(kMaxThreads)
layer_norm_forward_looped_kernel(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
                                 T* __restrict__ y, Acc<T>* __restrict__ mean_out, Acc<T>* __restrict__ rstd_out,
                                 int64_t n, Acc<T> eps) {
  using A = Acc<T>;
  const T* x_row = x + static_cast<int64_t>(blockIdx.x) * n;
  const int64_t n_packs = n / kVec;
  A mean = 0;  // RMSNorm's: no pass for it
  if constexpr (kSubtractMean) {
    A sum = 0;
    for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
      const Pack<T, kVec> in = load_pack<T, kVec>(x_row + pack * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum += to_acc(in.val[j]);
    }
    mean = block_sum(sum) / A(n);
  }
  A squares = 0;
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load_pack<T, kVec>(x_row + pack * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) squares += (to_acc(in.val[j]) - mean) * (to_acc(in.val[j]) - mean);
  }
  const A rstd = rsqrt(block_sum(squares) / A(n) + eps);
  if (threadIdx.x == 0) {
    if constexpr (kSubtractMean) mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load_pack<T, kVec>(x_row + pack * kVec);
    A values[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) values[j] = to_acc(in.val[j]);
    write_normalized_pack<T, kVec, kSubtractMean>(y + static_cast<int64_t>(blockIdx.x) * n, weight, bias, pack, values, mean, rstd);
  }
}

// --- launchers -----------------------------------------------------------------------------------
// The register kernel and its looped twin take the same arguments, so a launcher picks a kernel pointer
// and a block size, then launches once. LayerNorm's launcher and RMSNorm's are one template; RMSNorm
// passes null for the mean and the bias, which its kernels never touch.

template <typename T, int kVec, bool kSubtractMean>
auto forward_kernel_for(int64_t n, int* threads) {
  const bool in_registers = n <= int64_t{kForwardMaxThreads} * kForwardValues<T>;
  *threads = in_registers ? row_threads(n, kForwardValues<T>) : kMaxThreads;
  return in_registers ? layer_norm_forward_kernel<T, kVec, kSubtractMean>
                      : layer_norm_forward_looped_kernel<T, kVec, kSubtractMean>;
}

template <bool kSubtractMean>
void launch_forward(DType dtype, const void* x, const void* weight, const void* bias, void* y, void* mean, void* rstd,
                    int64_t rows, int64_t n, double eps, void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    using A = Acc<T>;
    const bool vectorise = n % kVecOf<T> == 0 && aligned_16(x) && aligned_16(weight) &&
                           (!kSubtractMean || aligned_16(bias)) && aligned_16(y);
    dispatch_vector_width<T>(vectorise, [&](auto vec) {
      int threads = 0;
      const auto kernel = forward_kernel_for<T, decltype(vec)::value, kSubtractMean>(n, &threads);
      // One block per row: a row's reductions never leave its block.
      kernel<<<static_cast<unsigned>(rows), threads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const T*>(bias), static_cast<T*>(y),
          static_cast<A*>(mean), static_cast<A*>(rstd), n, static_cast<A>(eps));
    });
  });
}

void launch_layer_norm_forward(DType dtype, const void* x, const void* weight, const void* bias, void* y,
                               void* mean, void* rstd, int64_t rows, int64_t n, double eps, void* stream) {
  launch_forward<true>(dtype, x, weight, bias, y, mean, rstd, rows, n, eps, stream);
}

void launch_rms_norm_forward(DType dtype, const void* x, const void* weight, void* y, void* rstd, int64_t rows,
                             int64_t n, double eps, void* stream) {
  launch_forward<false>(dtype, x, weight, nullptr, y, nullptr, rstd, rows, n, eps, stream);
}

}  // namespace kernel_ladder
