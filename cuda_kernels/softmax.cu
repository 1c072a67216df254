// Softmax in CUDA: forward and backward over the rows of a (rows, n) matrix.
//
// What it computes
//   forward    y = exp(x - max x) / sum(exp(x - max x))
//   backward   dx = y * (dy - sum(dy * y))
//
// Kernels
//   softmax_forward_registers_kernel<kWarpPerRow>  the row sits in registers (32 floats per thread):
//                                     one warp per row for short rows (4 rows per block), one block per
//                                     row up to 16384 floats; x read once, y written once
//   softmax_forward_online_kernel     longer rows, any length: pass 1 keeps an ONLINE (running max,
//                                     rescaled running sum) per thread, pass 2 re-reads x and writes y
//   softmax_backward_kernel           one block per row: pass 1 sums dy*y, pass 2 re-reads (from L1/L2)
//
// The one idea that makes it fast
//   One reduction, not two. Each thread turns its values into a (max, sum of exp(x - max)) pair, and
//   pairs merge exactly: (m, s) + (m', s') = (M, s*exp(m - M) + s'*exp(m' - M)), M = max(m, m'). So the
//   row's max and sum cross the warp (shuffles) and the block (one shared-memory step) together, and a
//   thread's stored exp(x - m) needs only a final multiply by exp(m - M) / sum. The same merge lets
//   the online kernel stream a row of any length with one pass for the statistics.
//
// Limits
//   Any n >= 1: rows of up to 16384 floats (8192 doubles) in registers, longer ones read x twice.
//   rows < 2^31. 16-byte loads need n to be a multiple of the pack width (4 float, 8 half, 2 double)
//   and 16-byte-aligned pointers, else 1-element loads. float16, bfloat16, float32 (computed in
//   float32) and float64. A row of only -inf gives NaN, as torch.softmax does.
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -v -c cuda_kernels/softmax.cu -o /tmp/softmax.o
//   python -m pytest tests -k "softmax and cuda"
#include <algorithm>

#include "common.cuh"

namespace kernel_ladder {

// Row values per thread in registers: 128 bytes (32 floats, 16 doubles) in blocks of at most 512
// threads, which may use 128 registers each. Small blocks, as in LayerNorm's forward: a row of 8192
// floats takes 256 threads, so 8 rows share an SM, and while some blocks wait in their reduction the
// others keep loads in flight. The online kernel uses 512 threads too (float64 exp needs the registers).
constexpr int kSoftmaxMaxThreads = 512;
template <typename A> constexpr int kSoftmaxValues = 128 / static_cast<int>(sizeof(A));
constexpr int kRowsPerWarpBlock = 4;  // short rows: 4 warps, one row each, per 128-thread block

// A row's statistics: the largest value seen and the sum of exp(value - max). The defaults are the
// identity of `merge` (block_reduce pads with T{}).
template <typename A>
struct MaxSum {
  A max = -INFINITY;
  A sum = 0;
};

template <typename A>
__device__ __forceinline__ MaxSum<A> merge(MaxSum<A> a, MaxSum<A> b) {
  const A max = a.max > b.max ? a.max : b.max;
  if (max == A(-INFINITY)) return a;  // both empty: exp(-inf - -inf) would be NaN
  return {max, a.sum * exp_acc(a.max - max) + b.sum * exp_acc(b.max - max)};
}

struct Merge {
  template <typename A> __device__ __forceinline__ MaxSum<A> operator()(MaxSum<A> a, MaxSum<A> b) const { return merge(a, b); }
};

template <typename T, int kVec, bool kWarpPerRow>
__global__ void __launch_bounds__(kSoftmaxMaxThreads)
softmax_forward_registers_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n) {
  using A = Acc<T>;
  constexpr int kPacks = kSoftmaxValues<A> / kVec;
  const int64_t row = kWarpPerRow ? int64_t{blockIdx.x} * kRowsPerWarpBlock + threadIdx.x / kWarpSize : blockIdx.x;
  if (kWarpPerRow && row >= rows) return;  // a whole warp leaves: no shuffle waits for it
  const int thread_in_row = kWarpPerRow ? threadIdx.x % kWarpSize : threadIdx.x;
  const int row_threads = kWarpPerRow ? kWarpSize : blockDim.x;
  const int n_packs = static_cast<int>(n / kVec);
  const T* x_row = x + row * n;
  // Thread t owns packs t, t + row_threads, ...: a warp reads 32 adjacent packs at each step.
  A values[kPacks][kVec];
  MaxSum<A> mine;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = thread_in_row + k * row_threads;
    Pack<T, kVec> in;
    if (pack < n_packs) in = load_pack_once<T, kVec>(x_row + pack * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      values[k][j] = pack < n_packs ? to_acc(in.val[j]) : A(-INFINITY);
      mine.max = fmax(mine.max, values[k][j]);
    }
  }
  // A thread past the end of a short row holds only padding (max -inf): shift by 0 instead, so its
  // exp(-inf - 0) = 0 rather than exp(-inf + inf) = NaN, which would poison the row's sum.
  const A shift = mine.max == A(-INFINITY) ? A(0) : mine.max;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      values[k][j] = exp_acc(values[k][j] - shift);  // exp(-inf) = 0 for padding
      mine.sum += values[k][j];
    }
  }
  const MaxSum<A> total = kWarpPerRow ? warp_reduce(mine, Merge{}) : block_reduce(mine, Merge{});
  // exp(x - M) / sum = exp(x - m) * (exp(m - M) / sum): one multiply per value, no second exp. A row of
  // only -inf has M = -inf and sum 0: NaN, as torch.softmax gives.
  const A factor = exp_acc(mine.max - total.max) / total.sum;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = thread_in_row + k * row_threads;
    if (pack >= n_packs) continue;
    Pack<T, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.val[j] = from_acc<T>(values[k][j] * factor);
    store_pack_once<T, kVec>(y + row * n + pack * kVec, out);
  }
}

// Rows too long for registers. Each thread folds its packs into a running (max, sum): when a pack
// raises the max, the sum so far is rescaled by exp(old - new), so one pass gives the statistics.
template <typename T, int kVec>
__global__ void __launch_bounds__(kSoftmaxMaxThreads)
softmax_forward_online_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  using A = Acc<T>;
  const int64_t n_packs = n / kVec;
  const T* x_row = x + int64_t{blockIdx.x} * n;
  MaxSum<A> mine;
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load_pack<T, kVec>(x_row + pack * kVec);  // kept in L2 for pass 2
    MaxSum<A> packed;
#pragma unroll
    for (int j = 0; j < kVec; ++j) packed.max = fmax(packed.max, to_acc(in.val[j]));
    if (packed.max == A(-INFINITY)) continue;
#pragma unroll
    for (int j = 0; j < kVec; ++j) packed.sum += exp_acc(to_acc(in.val[j]) - packed.max);
    mine = merge(mine, packed);
  }
  const MaxSum<A> total = block_reduce(mine, Merge{});
  const A inverse_sum = A(1) / total.sum;
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load_pack_once<T, kVec>(x_row + pack * kVec);
    Pack<T, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.val[j] = from_acc<T>(exp_acc(to_acc(in.val[j]) - total.max) * inverse_sum);
    store_pack_once<T, kVec>(y + int64_t{blockIdx.x} * n + pack * kVec, out);
  }
}

// dx = y * (dy - sum(dy * y)). Pass 2 re-reads the row, which the block has just pulled into L1/L2.
template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxThreads)
softmax_backward_kernel(const T* __restrict__ grad_out, const T* __restrict__ y, T* __restrict__ grad_x, int64_t n) {
  using A = Acc<T>;
  const int64_t n_packs = n / kVec;
  const int64_t offset = int64_t{blockIdx.x} * n;
  A dot = 0;
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> dy = load_pack<T, kVec>(grad_out + offset + pack * kVec);
    const Pack<T, kVec> out = load_pack<T, kVec>(y + offset + pack * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) dot += to_acc(dy.val[j]) * to_acc(out.val[j]);
  }
  dot = block_sum(dot);
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> dy = load_pack_once<T, kVec>(grad_out + offset + pack * kVec);
    const Pack<T, kVec> out = load_pack_once<T, kVec>(y + offset + pack * kVec);
    Pack<T, kVec> dx;
#pragma unroll
    for (int j = 0; j < kVec; ++j) dx.val[j] = from_acc<T>(to_acc(out.val[j]) * (to_acc(dy.val[j]) - dot));
    store_pack_once<T, kVec>(grad_x + offset + pack * kVec, dx);
  }
}

// --- launchers -----------------------------------------------------------------------------------

void launch_softmax_forward(DType dtype, const void* x, void* y, int64_t rows, int64_t n, void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    constexpr int kValues = kSoftmaxValues<Acc<T>>;
    const auto s = static_cast<cudaStream_t>(stream);
    const bool vectorise = n % kVecOf<T> == 0 && aligned_16(x) && aligned_16(y);
    dispatch_vector_width<T>(vectorise, [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      const T* in = static_cast<const T*>(x);
      T* out = static_cast<T*>(y);
      if (n <= kWarpSize * kValues) {
        softmax_forward_registers_kernel<T, kVec, true>
            <<<static_cast<unsigned>(ceil_div(rows, kRowsPerWarpBlock)), kRowsPerWarpBlock * kWarpSize, 0, s>>>(in, out, rows, n);
      } else if (n <= int64_t{kSoftmaxMaxThreads} * kValues) {
        softmax_forward_registers_kernel<T, kVec, false>
            <<<static_cast<unsigned>(rows), row_threads(n, kValues), 0, s>>>(in, out, rows, n);
      } else {
        softmax_forward_online_kernel<T, kVec><<<static_cast<unsigned>(rows), kSoftmaxMaxThreads, 0, s>>>(in, out, n);
      }
    });
  });
}

void launch_softmax_backward(DType dtype, const void* grad_out, const void* y, void* grad_x, int64_t rows, int64_t n,
                             void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    const bool vectorise = n % kVecOf<T> == 0 && aligned_16(grad_out) && aligned_16(y) && aligned_16(grad_x);
    dispatch_vector_width<T>(vectorise, [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      // Four packs per thread per pass when the row allows, up to a full block.
      const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, row_threads(n, 4 * kVec)));
      softmax_backward_kernel<T, kVec><<<static_cast<unsigned>(rows), threads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(grad_out), static_cast<const T*>(y), static_cast<T*>(grad_x), n);
    });
  });
}

}  // namespace kernel_ladder
