// Softmax in CUDA: forward and backward over the rows of a (rows, n) matrix.
//
// What it computes
//   forward    y = exp(x - max x) / sum(exp(x - max x))
//   backward   dx = y * (dy - sum(dy * y))
//
// Kernels
//   softmax_forward_warp_kernel       short rows (up to 32 values per lane): one warp per row, 4 rows per
//                                     block, the row in registers; x read once, y written once
//   softmax_forward_shared_kernel     rows of up to 64 KB: one block per row; the row is copied into
//                                     shared memory with cp.async and read there twice (statistics,
//                                     then output); x read from memory once, y written once
//   softmax_forward_online_kernel     longer rows, any length: pass 1 keeps an ONLINE (running max,
//                                     rescaled running sum) per thread, pass 2 re-reads x and writes y
//   softmax_backward_kernel           one block per row: pass 1 sums dy*y, pass 2 re-reads (from L1/L2)
//
// The one idea that makes it fast
//   One reduction, not two. Each thread turns its values into a (max, sum of exp(x - max)) pair, and
//   pairs merge exactly: (m, s) + (m', s') = (M, s*exp(m - M) + s'*exp(m' - M)), M = max(m, m'). So the
//   row's max and sum cross the warp (shuffles) and the block (one shared-memory step) together. The
//   same merge lets the online kernel stream a row of any length with one pass for the statistics.
//   A memory-bound kernel is as fast as the bytes it keeps in flight: a block-per-row kernel holds
//   its row somewhere while it reduces, and shared memory (227 KB an SM: 7 rows of 8192 floats) holds
//   more rows than registers do (4 rows, at 64 registers a thread), so more loads are in flight. On an
//   H100 at (8192, 8192) float32: 0.182 ms, 99 % of a device-to-device copy, where the row held in
//   registers reached 90 % and torch.softmax takes 0.290 ms.
//
// Limits
//   Any n >= 1: rows of up to 64 KB in shared memory, longer ones (and rows that cannot be copied in
//   16-byte pieces) read x twice, the second time mostly from L2. rows < 2^31. 16-byte accesses need
//   n to be a multiple of the pack width (4 float, 8 half, 2 double) and 16-byte-aligned pointers,
//   else 1-element accesses. float16, bfloat16, float32 (computed in float32) and float64. A row of
//   only -inf gives NaN, as torch.softmax does.
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -v -c cuda_kernels/softmax.cu -o /tmp/softmax.o
//   python -m pytest tests -k "softmax and cuda"
#include <algorithm>

#include "common.cuh"

namespace kernel_ladder {

// Short rows: a warp per row, 128 bytes of the row per lane in registers (32 floats, 16 doubles).
template <typename A> constexpr int kWarpRowValues = 128 / static_cast<int>(sizeof(A));
constexpr int kRowsPerWarpBlock = 4;  // 4 warps, one row each, per 128-thread block
// Longer rows: one block per row, at most 512 threads (the online kernel's float64 exp needs the
// registers that 1024 threads would not leave), at least 8 packs per thread.
constexpr int kSoftmaxMaxThreads = 512;
constexpr int kPacksPerThread = 8;
constexpr int64_t kSharedRowBytes = 64 * 1024;  // the largest row the shared-memory kernel stages

template <typename T, int kVec>
__global__ void __launch_bounds__(kRowsPerWarpBlock * kWarpSize)
softmax_forward_warp_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n) {
  using A = Acc<T>;
  constexpr int kPacks = kWarpRowValues<A> / kVec;
  const int64_t row = int64_t{blockIdx.x} * kRowsPerWarpBlock + threadIdx.x / kWarpSize;
  if (row >= rows) return;  // a whole warp leaves: no shuffle waits for it
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int n_packs = static_cast<int>(n / kVec);
  const T* x_row = x + row * n;
  // Lane l owns packs l, l + 32, ...: the warp reads 32 adjacent packs at each step.
  A values[kPacks][kVec];
  MaxSum<A> mine;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = lane + k * kWarpSize;
    Pack<T, kVec> in;
    if (pack < n_packs) in = load_pack_once<T, kVec>(x_row + pack * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      values[k][j] = pack < n_packs ? to_acc(in.val[j]) : A(-INFINITY);
      mine.max = fmax(mine.max, values[k][j]);
    }
  }
  // A lane past the end of a short row holds only padding (max -inf): shift by 0 instead, so its
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
  const MaxSum<A> total = warp_reduce(mine, Merge{});
  // exp(x - M) / sum = exp(x - m) * (exp(m - M) / sum): one multiply per value, no second exp. A row of
  // only -inf has M = -inf and sum 0: NaN, as torch.softmax gives.
  const A factor = exp_acc(mine.max - total.max) / total.sum;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = lane + k * kWarpSize;
    if (pack >= n_packs) continue;
    Pack<T, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.val[j] = from_acc<T>(values[k][j] * factor);
    store_pack_once<T, kVec>(y + row * n + pack * kVec, out);
  }
}

// y = exp(x - max) / sum for this thread's packs of a row (t, t + blockDim.x, ...), given the row's
// statistics; load(pack) reads x's pack from wherever the kernel keeps it.
template <typename T, int kVec, typename Load>
__device__ __forceinline__ void write_probabilities(T* y_row, int64_t n_packs, MaxSum<Acc<T>> total, Load load) {
  const Acc<T> inverse_sum = Acc<T>(1) / total.sum;
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load(pack);
    Pack<T, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.val[j] = from_acc<T>(exp_acc(to_acc(in.val[j]) - total.max) * inverse_sum);
    store_pack_once<T, kVec>(y_row + pack * kVec, out);
  }
}

// The row is staged in shared memory, 16-byte packs. Each thread copies, and later reads, only its
// own packs (t, t + blockDim.x, ...), so its own cp.async wait is all the ordering it needs; the one
// barrier is the reduction's. Nothing is held in registers while the copies fly.
template <typename T>
__global__ void __launch_bounds__(kSoftmaxMaxThreads)
softmax_forward_shared_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  using A = Acc<T>;
  constexpr int kVec = kVecOf<T>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* row = reinterpret_cast<T*>(shared_bytes);
  const int n_packs = static_cast<int>(n / kVec);
  const T* x_row = x + int64_t{blockIdx.x} * n;
  for (int pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    copy_async_16(row + pack * kVec, x_row + pack * kVec, true);
  }
  copy_async_commit();
  copy_async_wait<0>();
  MaxSum<A> mine;
  for (int pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load_pack<T, kVec>(row + pack * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) mine.max = fmax(mine.max, to_acc(in.val[j]));
  }
  const A shift = mine.max == A(-INFINITY) ? A(0) : mine.max;  // as in the warp kernel
  for (int pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load_pack<T, kVec>(row + pack * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) mine.sum += exp_acc(to_acc(in.val[j]) - shift);
  }
  write_probabilities<T, kVec>(y + int64_t{blockIdx.x} * n, n_packs, block_reduce(mine, Merge{}),
                               [&](int64_t pack) { return load_pack<T, kVec>(row + pack * kVec); });
}

// Rows too long for shared memory, or not in 16-byte packs. Each thread folds its packs into a
// running (max, sum): when a pack raises the max, the sum so far is rescaled by exp(old - new), so one
// pass gives the statistics; the second pass re-reads x, mostly from L2.
template <typename T, int kVec>
__global__ void __launch_bounds__(kSoftmaxMaxThreads)
softmax_forward_online_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  using A = Acc<T>;
  const int64_t n_packs = n / kVec;
  const T* x_row = x + int64_t{blockIdx.x} * n;
  MaxSum<A> mine;
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    mine = merge(mine, max_sum_of_pack<T, kVec>(load_pack<T, kVec>(x_row + pack * kVec)));  // kept in L2 for pass 2
  }
  write_probabilities<T, kVec>(y + int64_t{blockIdx.x} * n, n_packs, block_reduce(mine, Merge{}),
                               [&](int64_t pack) { return load_pack_once<T, kVec>(x_row + pack * kVec); });
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
    const auto s = static_cast<cudaStream_t>(stream);
    const bool vectorise = n % kVecOf<T> == 0 && aligned_16(x) && aligned_16(y);
    const T* in = static_cast<const T*>(x);
    T* out = static_cast<T*>(y);
    const int64_t row_bytes = n * static_cast<int64_t>(sizeof(T));
    if (vectorise && n > kWarpSize * kWarpRowValues<Acc<T>> && row_bytes <= kSharedRowBytes) {
      const int threads = row_threads(n, kPacksPerThread * kVecOf<T>);
      const auto bytes = static_cast<int>(row_bytes);
      // Beyond 48 KB a kernel's dynamic shared memory must be asked for (per device, so every launch).
      cudaFuncSetAttribute(softmax_forward_shared_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      softmax_forward_shared_kernel<T><<<static_cast<unsigned>(rows), threads, bytes, s>>>(in, out, n);
      return;
    }
    dispatch_vector_width<T>(vectorise, [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      if (n <= kWarpSize * kWarpRowValues<Acc<T>>) {
        softmax_forward_warp_kernel<T, kVec>
            <<<static_cast<unsigned>(ceil_div(rows, kRowsPerWarpBlock)), kRowsPerWarpBlock * kWarpSize, 0, s>>>(in, out, rows, n);
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
