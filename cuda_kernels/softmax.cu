// Softmax in CUDA: forward and backward over the rows of a (rows, n) matrix.
//
// What it computes
//   forward    y = exp(x - max x) / sum(exp(x - max x))
//   backward   dx = y * (dy - sum(dy * y))
//
// Kernels, by row length (the launcher picks; every one reads x once and writes y once unless noted)
//   softmax_forward_warp_kernel       short rows (up to 32 values per lane): a group of 1 to 32 lanes per
//                                     row, the row in registers, so 128-element rows keep all 32 lanes
//                                     of a warp busy (8 rows a warp) instead of 4 of them
//   softmax_forward_shared_kernel     rows of up to 64 KB: one block per row; the row is copied into
//                                     shared memory with cp.async and read there twice (statistics,
//                                     then output)
//   softmax_forward_cluster_kernel    rows of up to 4 x 64 KB, Hopper (sm_90) and later: a thread-block
//                                     CLUSTER per row, each block staging a 64 KB slice in its shared
//                                     memory; the blocks swap their (max, sum) through distributed
//                                     shared memory, so the row is still read from HBM once
//   softmax_forward_cooperative_kernel  longer rows (or no clusters): each row split into 64 KB slices
//                                     over a COOPERATIVE grid (every block resident at once), each block
//                                     staging its slice and waiting for its row's other (max, sum)
//                                     pairs in global memory: read once
//   softmax_partials_kernel +         the same rows where that grid holds fewer than 3 rows at once (or
//   softmax_normalise_kernel          they are not in 16-byte packs), too few to fill the GPU: pass 1
//                                     writes each slice's (max, sum), pass 2 merges its row's and re-reads x
//   softmax_forward_online_kernel     long rows, enough of them: one block per row, an ONLINE (running
//                                     max, rescaled running sum) per thread, then x re-read for y
//   softmax_backward_kernel           one block per row: pass 1 sums dy*y, pass 2 re-reads (from L1/L2)
//
// The one idea that makes it fast
//   One reduction, not two. Each thread turns its values into a (max, sum of exp(x - max)) pair, and
//   pairs merge exactly: (m, s) + (m', s') = (M, s*exp(m - M) + s'*exp(m' - M)), M = max(m, m'). So the
//   row's max and sum cross the warp (shuffles), the block (one shared-memory step) and the cluster
//   (one exchange between SMs) together. The same merge lets the online kernel stream a row of any
//   length with one pass for the statistics, and the split kernels combine slices in any order.
//   A memory-bound kernel is as fast as the bytes it keeps in flight: a block-per-row kernel holds
//   its row somewhere while it reduces, and shared memory (227 KB an SM: 7 rows of 8192 floats) holds
//   more rows than registers do (4 rows, at 64 registers a thread), so more loads are in flight. On an
//   H100 at (8192, 8192) float32: 0.182 ms, 99 % of a device-to-device copy, where the row held in
//   registers reached 90 % and torch.softmax takes 0.290 ms. A row longer than one SM can hold is read
//   twice (online, split) unless a cluster of SMs or a cooperative grid holds it together; rows too few
//   for 132 SMs leave most of the GPU idle unless they are split. profiling/results/h100/sweep.png shows both ends.
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
#include "cooperative.cuh"

namespace kernel_ladder {

// Longer rows: one block per row (or per slice of a row), at most 512 threads (the online kernel's
// float64 exp needs the registers that 1024 threads would not leave), at least 8 packs per thread.
// (The short rows' lanes, the 64 KB slices and the split sizes are common.cuh's.)
constexpr int kSoftmaxMaxThreads = 512;
constexpr int kPacksPerThread = 8;

template <typename T, int kVec, int kLanes>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize)
softmax_forward_warp_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t rows, int64_t n) {
  using A = Acc<T>;
  constexpr int kPacks = kLaneRowValues<A> / kVec;
  const LaneGroupRow<kLanes> place;
  if (place.first_row_of_warp >= rows) return;
  const int64_t row = place.row;
  const bool row_exists = row < rows;
  const int lane = place.lane;
  const int n_packs = static_cast<int>(n / kVec);
  A values[kPacks][kVec];
  MaxSum<A> mine;
  load_row_packs<T, kVec, kPacks>(values, read_once_from<T, kVec>(x + row * n), lane, kLanes, n_packs, row_exists,
                                  A(-INFINITY), [&](A value) { mine.max = fmax(mine.max, value); });
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
  const MaxSum<A> total = warp_reduce<kLanes>(mine, Merge{});
  if (!row_exists) return;
  // exp(x - M) / sum = exp(x - m) * (exp(m - M) / sum): one multiply per value, no second exp. A row of
  // only -inf has M = -inf and sum 0: NaN, as torch.softmax gives.
  const A factor = exp_acc(mine.max - total.max) / total.sum;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = lane + k * kLanes;
    if (pack >= n_packs) continue;
    Pack<T, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.val[j] = from_acc<T>(values[k][j] * factor);
    store_pack_once<T, kVec>(y + row * n + pack * kVec, out);
  }
}

// y = exp(x - max) / sum for this thread's packs of a row or slice (t, t + blockDim.x, ...), given the
// row's statistics; load(pack) reads x's pack from wherever the kernel keeps it.
template <typename T, int kVec, typename Load>
__device__ __forceinline__ void write_probabilities(T* y_slice, int64_t n_packs, MaxSum<Acc<T>> total, Load load) {
  const Acc<T> inverse_sum = Acc<T>(1) / total.sum;
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load(pack);
    Pack<T, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.val[j] = from_acc<T>(exp_acc(to_acc(in.val[j]) - total.max) * inverse_sum);
    store_pack_once<T, kVec>(y_slice + pack * kVec, out);
  }
}

template <typename T>
__global__ void __launch_bounds__(kSoftmaxMaxThreads)
softmax_forward_shared_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n) {
  constexpr int kVec = kVecOf<T>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* row = reinterpret_cast<T*>(shared_bytes);
  const int n_packs = static_cast<int>(n / kVec);
  const MaxSum<Acc<T>> total = stage_and_reduce<T>(x + int64_t{blockIdx.x} * n, row, n_packs);
  write_probabilities<T, kVec>(y + int64_t{blockIdx.x} * n, n_packs, total,
                               [&](int64_t pack) { return load_pack<T, kVec>(row + pack * kVec); });
}

// One cluster per row (common.cuh's cluster_slice): each block stages its slice in shared memory and
// folds it into one (max, sum); the cluster merges the pairs through distributed shared memory
// (cluster_reduce), and each block writes its slice from the staged copy, so x is read once.
template <typename T>
__global__ void __launch_bounds__(kSoftmaxMaxThreads)
softmax_forward_cluster_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t n, int64_t slice_packs) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = Acc<T>;
  constexpr int kVec = kVecOf<T>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ MaxSum<A> slice_statistics;
  T* slice = reinterpret_cast<T*>(shared_bytes);
  const ClusterSlice mine = cluster_slice<kVec>(n, slice_packs);
  const MaxSum<A> total =
      cluster_reduce(&slice_statistics, stage_and_reduce<T>(x + mine.offset, slice, mine.n_packs), Merge{});
  write_probabilities<T, kVec>(y + mine.offset, mine.n_packs, total,
                               [&](int64_t pack) { return load_pack<T, kVec>(slice + pack * kVec); });
#else
  __trap();  // the launcher runs this kernel only where it was compiled for sm_90 or later
#endif
}

// Split rows, read once: the cooperative grid of layer_norm_long_rows.cuh's
// layer_norm_forward_cooperative_kernel, with (max, sum) pairs in place of Moments: each block stages its
// slice in shared memory, publishes the slice's pair, waits for its row's other slices (cooperative.cuh's
// arrive_and_wait), merges the row's pairs and writes its slice from the staged copy.
template <typename T>
__global__ void __launch_bounds__(kSoftmaxMaxThreads)
softmax_forward_cooperative_kernel(const T* __restrict__ x, T* __restrict__ y, MaxSum<Acc<T>>* __restrict__ partials,
                                   unsigned* __restrict__ arrivals, int64_t rows, int64_t n, int splits,
                                   int64_t slice_packs) {
  using A = Acc<T>;
  constexpr int kVec = kVecOf<T>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* slice = reinterpret_cast<T*>(shared_bytes);
  const CooperativeSlice mine = cooperative_slice<kVec>(n, splits, slice_packs);
  for (int64_t row = mine.first_row; row < rows; row += mine.row_step) {
    const int64_t offset = row * n + mine.first_column;
    const MaxSum<A> statistics = stage_and_reduce<T>(x + offset, slice, mine.n_packs);
    if (threadIdx.x == 0) partials[row * splits + mine.piece] = statistics;
    arrive_and_wait(arrivals + row, static_cast<unsigned>(splits));
    write_probabilities<T, kVec>(y + offset, mine.n_packs, merge_row_partials(partials + row * splits, splits, Merge{}),
                                 [&](int64_t pack) { return load_pack<T, kVec>(slice + pack * kVec); });
  }
}

// Split rows, pass 1: block b folds slice b % splits of row b / splits into one (max, sum), written
// to partials[b] for pass 2. Plain loads: the slice may still be in L2 when pass 2 re-reads it.
template <typename T, int kVec>
__global__ void __launch_bounds__(kSoftmaxMaxThreads)
softmax_partials_kernel(const T* __restrict__ x, MaxSum<Acc<T>>* __restrict__ partials, int64_t n, int splits,
                        int64_t slice_packs) {
  using A = Acc<T>;
  const int64_t first_pack = blockIdx.x % splits * slice_packs;
  const int64_t n_packs = min(slice_packs, n / kVec - first_pack);
  const T* x_slice = x + int64_t{blockIdx.x} / splits * n + first_pack * kVec;
  MaxSum<A> mine;
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    mine = merge(mine, max_sum_of_pack<T, kVec>(load_pack<T, kVec>(x_slice + pack * kVec)));
  }
  mine = block_reduce(mine, Merge{});
  if (threadIdx.x == 0) partials[blockIdx.x] = mine;
}

// Split rows, pass 2: every block merges its row's partials (a few dozen pairs) and writes its slice.
template <typename T, int kVec>
__global__ void __launch_bounds__(kSoftmaxMaxThreads)
softmax_normalise_kernel(const T* __restrict__ x, const MaxSum<Acc<T>>* __restrict__ partials, T* __restrict__ y,
                         int64_t n, int splits, int64_t slice_packs) {
  const int64_t row = blockIdx.x / splits;
  MaxSum<Acc<T>> total;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) total = merge(total, partials[row * splits + s]);
  total = block_reduce(total, Merge{});
  const int64_t first_pack = blockIdx.x % splits * slice_packs;
  const int64_t n_packs = min(slice_packs, n / kVec - first_pack);
  const int64_t offset = row * n + first_pack * kVec;
  write_probabilities<T, kVec>(y + offset, n_packs, total,
                               [&](int64_t pack) { return load_pack_once<T, kVec>(x + offset + pack * kVec); });
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

// Whether the cluster kernel runs here (common.cuh's compiled_for_clusters), else the split or
// online kernels take its rows.
template <typename T>
bool clusters_available() {
  static const bool available = compiled_for_clusters(softmax_forward_cluster_kernel<T>);
  return available;
}

template <typename T>
CooperativePlan softmax_cooperative_plan(int64_t rows, int64_t n) {
  return cooperative_plan<T>(softmax_forward_cooperative_kernel<T>, rows, n, kPacksPerThread);
}

// Rows longer than a cluster of kClusterRowBlocks holds (one block's shared memory without clusters) are
// read once by a cooperative grid where its plan applies (the launcher makes the same plan); else rows
// too few to fill the GPU are split for the two passes.
int64_t softmax_forward_splits(DType dtype, int64_t rows, int64_t n) {
  int64_t splits = 1;
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    const int64_t row_bytes = n * static_cast<int64_t>(sizeof(T));
    const bool clusters = clusters_available<T>();
    if (row_bytes > kSharedRowBytes * (clusters ? kClusterRowBlocks : 1)) {
      const CooperativePlan plan = softmax_cooperative_plan<T>(rows, n);
      if (plan.splits > 1) {
        splits = plan.splits;
        return;
      }
    }
    splits = row_splits(rows, row_bytes, kSharedRowBytes * (clusters ? kMaxClusterBlocks : 1));
  });
  return splits;
}

template <typename T>
void launch_softmax_cluster(const T* x, T* y, int64_t rows, int64_t n, cudaStream_t stream) {
  constexpr int kVec = kVecOf<T>;
  const auto blocks = static_cast<int>(ceil_div(n * static_cast<int64_t>(sizeof(T)), kSharedRowBytes));
  const int64_t slice_packs = ceil_div(n / kVec, blocks);
  launch_in_clusters(softmax_forward_cluster_kernel<T>, rows * blocks, blocks,
                     row_threads(slice_packs * kVec, kPacksPerThread * kVec), static_cast<int>(slice_packs * 16), stream,
                     x, y, n, slice_packs);
}

void launch_softmax_forward(DType dtype, const void* x, void* y, int64_t rows, int64_t n, int64_t splits,
                            void* partials, void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    using A = Acc<T>;
    const auto s = static_cast<cudaStream_t>(stream);
    const bool vectorise = n % kVecOf<T> == 0 && aligned_16(x) && aligned_16(y);
    const T* in = static_cast<const T*>(x);
    T* out = static_cast<T*>(y);
    const int64_t row_bytes = n * static_cast<int64_t>(sizeof(T));
    const bool short_row = n <= kWarpSize * kLaneRowValues<A>;
    if (vectorise && !short_row && row_bytes <= kSharedRowBytes) {
      const int threads = row_threads(n, kPacksPerThread * kVecOf<T>);
      const auto bytes = static_cast<int>(row_bytes);
      // Beyond 48 KB a kernel's dynamic shared memory must be asked for (per device, so every launch).
      cudaFuncSetAttribute(softmax_forward_shared_kernel<T>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
      softmax_forward_shared_kernel<T><<<static_cast<unsigned>(rows), threads, bytes, s>>>(in, out, n);
      return;
    }
    if (vectorise && splits > 1) {
      const CooperativePlan plan = softmax_cooperative_plan<T>(rows, n);
      if (plan.splits == splits) {  // partials holds rows * (splits + 1) pairs: the last rows count arrivals
        auto* statistics = static_cast<MaxSum<A>*>(partials);
        unsigned* arrivals = zeroed_row_counters(statistics, rows, splits, s);
        launch_cooperative(softmax_forward_cooperative_kernel<T>, plan.rows_at_once * splits, plan.threads,
                           static_cast<int>(plan.slice_packs * 16), s, in, out, statistics, arrivals, rows, n,
                           static_cast<int>(splits), plan.slice_packs);
        return;
      }
    }
    if (vectorise && !short_row && splits == 1 && row_bytes <= kMaxClusterBlocks * kSharedRowBytes &&
        clusters_available<T>()) {
      launch_softmax_cluster<T>(in, out, rows, n, s);
      return;
    }
    dispatch_vector_width<T>(vectorise, [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      if (short_row) {
        dispatch_lanes_per_row<A>(n, [&](auto lanes) {
          constexpr int kLanes = decltype(lanes)::value;
          softmax_forward_warp_kernel<T, kVec, kLanes>
              <<<LaneGroupRow<kLanes>::blocks(rows), kWarpsPerBlock * kWarpSize, 0, s>>>(in, out, rows, n);
        });
      } else if (splits > 1) {
        const int64_t slice_packs = ceil_div(n / kVec, splits);
        const auto blocks = static_cast<unsigned>(rows * splits);
        const int threads = static_cast<int>(std::min<int64_t>(kSoftmaxMaxThreads, row_threads(slice_packs * kVec, 4 * kVec)));
        auto* statistics = static_cast<MaxSum<A>*>(partials);
        softmax_partials_kernel<T, kVec><<<blocks, threads, 0, s>>>(in, statistics, n, static_cast<int>(splits), slice_packs);
        softmax_normalise_kernel<T, kVec><<<blocks, threads, 0, s>>>(in, statistics, out, n, static_cast<int>(splits),
                                                                     slice_packs);
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
