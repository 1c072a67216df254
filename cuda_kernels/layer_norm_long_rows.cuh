// LayerNorm's and RMSNorm's forward for rows longer than a block's registers hold (past 64 or 32 KB): a
// cluster of blocks per row on Hopper, each row split over many blocks when rows are too few to fill
// the GPU, and a looped block per row for the rest. layer_norm.cu includes this file, calls
// launch_norm_forward_long_rows, and tells the whole story (formulas, kernels, limits).
//
// Kernels
//   layer_norm_forward_cluster_kernel   rows of up to 16 x 64 KB, sm_90 and later: a thread-block
//                                       CLUSTER per row, each block staging a slice of up to 64 KB in
//                                       shared memory with cp.async; the blocks swap their slices'
//                                       (count, mean, M2) through distributed shared memory, so x is read
//                                       from HBM once
//   layer_norm_forward_cooperative_kernel  longer rows (or no clusters), in 16-byte packs: each row split
//                                       into 64 KB slices over a cooperative grid, every block resident,
//                                       each staging its slice in shared memory and waiting for its row's
//                                       other slices' (count, mean, M2) in global memory: x read once
//   layer_norm_partials_kernel +        the rest of the longer rows when they are too few for 4 blocks an
//   layer_norm_normalise_kernel         SM: each row split over many blocks; pass 1 writes each slice's
//                                       (count, mean, M2), pass 2 merges its row's and re-reads x
//   layer_norm_forward_looped_kernel    long rows, enough of them: one block per row, three passes over
//                                       the row (mean, variance, output), re-reads from L2 when it is there
//
// Statistics that merge: LayerNorm's slices meet as (count, mean, M2 = sum of squared deviations from the
// slice's own mean), merged with Chan's formula, never as a sum of squares minus a squared sum (which
// cancels catastrophically when the mean is large against the spread). RMSNorm's are the same triple
// with the mean pinned at 0, where the merge is exactly a sum of squares.
#pragma once

#include "common.cuh"
#include "cooperative.cuh"

namespace kernel_ladder {

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

// y for packs [0, n_packs) of a row's slice, the block's threads striding over them: pack p's values come
// from load(p) (the slice staged in shared memory, or x read again), and y_slice, weight and bias point at
// the slice's first column (bias: null for RMSNorm).
template <typename T, int kVec, bool kSubtractMean, typename Index, typename Load>
__device__ __forceinline__ void write_normalized_slice(T* y_slice, const T* weight, const T* bias, Index n_packs,
                                                       Load&& load, Acc<T> mean, Acc<T> rstd) {
  for (Index pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load(pack);
    Acc<T> values[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) values[j] = to_acc(in.val[j]);
    write_normalized_pack<T, kVec, kSubtractMean>(y_slice, weight, bias, pack, values, mean, rstd);
  }
}

// Long rows: blocks of at most 512 threads, at least 8 packs a thread in a cluster's slice.
constexpr int kLongRowThreads = 512;
constexpr int kPacksPerThread = 8;

// A slice's statistics: how many values, their mean, and M2, the sum of their squared deviations from
// that mean (RMSNorm: mean 0, M2 the sum of squares). The default is the identity of the merge.
template <typename A>
struct Moments {
  A count = 0, mean = 0, m2 = 0;
};

// Chan's merge: delta = mean_b - mean_a, mean = mean_a + delta * count_b / count,
// M2 = M2_a + M2_b + delta^2 * count_a * count_b / count. The operands are taken in one fixed order
// (larger count first, then smaller mean), so a + b and b + a round alike: every lane of a butterfly
// reduction (common.cuh's warp_reduce) ends with the same bits, as with a plain sum.
template <typename A>
__device__ __forceinline__ Moments<A> operator+(Moments<A> a, Moments<A> b) {
  if (a.count < b.count || (a.count == b.count && a.mean > b.mean)) {
    const Moments<A> swap = a;
    a = b;
    b = swap;
  }
  if (b.count == A(0)) return a;
  const A count = a.count + b.count, delta = b.mean - a.mean, b_share = b.count * (A(1) / count);
  return {count, a.mean + delta * b_share, a.m2 + b.m2 + delta * delta * a.count * b_share};
}

// The Moments of one 16-byte pack (RMSNorm: its sum of squares).
template <typename T, int kVec, bool kSubtractMean>
__device__ __forceinline__ Moments<Acc<T>> moments_of_pack(const Pack<T, kVec>& pack) {
  using A = Acc<T>;
  A mean = 0;
  if constexpr (kSubtractMean) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) mean += to_acc(pack.val[j]);
    mean /= A(kVec);
  }
  A m2 = 0;
#pragma unroll
  for (int j = 0; j < kVec; ++j) m2 += (to_acc(pack.val[j]) - mean) * (to_acc(pack.val[j]) - mean);
  return {A(kVec), mean, m2};
}

// The Moments of n_packs packs of kVec values at `values` (a slice staged in shared memory, or a whole
// row in global memory), the block's threads striding over the packs: the mean, then the squares of
// the centred values (two exact passes; RMSNorm skips the first, and its m2 is the sum of squares).
template <typename T, int kVec, bool kSubtractMean>
__device__ __forceinline__ Moments<Acc<T>> block_moments(const T* values, int64_t n_packs) {
  using A = Acc<T>;
  const A count = A(n_packs) * A(kVec);
  A mean = 0;
  if constexpr (kSubtractMean) {
    A sum = 0;
    for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
      const Pack<T, kVec> in = load_pack<T, kVec>(values + pack * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum += to_acc(in.val[j]);
    }
    sum = block_sum(sum);
    mean = n_packs > 0 ? sum / count : A(0);
  }
  A m2 = 0;
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load_pack<T, kVec>(values + pack * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) m2 += (to_acc(in.val[j]) - mean) * (to_acc(in.val[j]) - mean);
  }
  return {count, mean, block_sum(m2)};
}

// One cluster per row (common.cuh's cluster_slice): each block stages its slice in shared memory and
// folds it into one Moments; the cluster merges them through distributed shared memory
// (cluster_reduce), and each block writes its slice of y from the staged copy, so x is read once.
template <typename T, bool kSubtractMean>
__global__ void __launch_bounds__(kLongRowThreads)
layer_norm_forward_cluster_kernel(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
                                  T* __restrict__ y, Acc<T>* __restrict__ mean_out, Acc<T>* __restrict__ rstd_out,
                                  int64_t n, int64_t slice_packs, Acc<T> eps) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = Acc<T>;
  constexpr int kVec = kVecOf<T>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  __shared__ Moments<A> slice_statistics;
  T* slice = reinterpret_cast<T*>(shared_bytes);
  const ClusterSlice mine = cluster_slice<kVec>(n, slice_packs);
  stage_slice<T>(x + mine.offset, slice, mine.n_packs);
  const Moments<A> total =
      cluster_reduce(&slice_statistics, block_moments<T, kVec, kSubtractMean>(slice, mine.n_packs), Add{});
  const A mean = kSubtractMean ? total.mean : A(0), rstd = rsqrt(total.m2 / A(n) + eps);
  if (mine.rank == 0 && threadIdx.x == 0) {
    if constexpr (kSubtractMean) mean_out[mine.row] = mean;
    rstd_out[mine.row] = rstd;
  }
  const int64_t first_column = mine.first_pack * kVec;
  write_normalized_slice<T, kVec, kSubtractMean>(
      y + mine.offset, weight + first_column, kSubtractMean ? bias + first_column : bias, mine.n_packs,
      [&](int pack) { return load_pack<T, kVec>(slice + pack * kVec); }, mean, rstd);
#else
  __trap();  // the launcher runs this kernel only where it was compiled for sm_90 or later
#endif
}

// Split rows, read once: a cooperative grid of rows_at_once x splits blocks, every one resident, so a
// block may wait for the others of its row (cooperative.cuh's arrive_and_wait). Block b owns slice b % splits
// of rows b / splits, then that plus rows_at_once, and so on: it stages the slice in shared memory,
// publishes its Moments to partials[row * splits + slice], waits for the row's other slices, merges
// them (the same order in every block of the row, as layer_norm_normalise_kernel does) and writes its
// slice of y from the staged copy. x crosses DRAM once, where the two passes below read it twice.
template <typename T, bool kSubtractMean>
__global__ void __launch_bounds__(kLongRowThreads)
layer_norm_forward_cooperative_kernel(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
                                      T* __restrict__ y, Acc<T>* __restrict__ mean_out, Acc<T>* __restrict__ rstd_out,
                                      Moments<Acc<T>>* __restrict__ partials, unsigned* __restrict__ arrivals,
                                      int64_t rows, int64_t n, int splits, int64_t slice_packs, Acc<T> eps) {
  using A = Acc<T>;
  constexpr int kVec = kVecOf<T>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* slice = reinterpret_cast<T*>(shared_bytes);
  const CooperativeSlice mine = cooperative_slice<kVec>(n, splits, slice_packs);
  const int64_t first_column = mine.first_column;
  const int n_packs = mine.n_packs;
  for (int64_t row = mine.first_row; row < rows; row += mine.row_step) {
    const int64_t offset = row * n + first_column;
    // Each thread stages, reduces and writes the same packs, so the next row may overwrite them freely.
    stage_slice<T>(x + offset, slice, n_packs);
    const Moments<A> statistics = block_moments<T, kVec, kSubtractMean>(slice, n_packs);
    if (threadIdx.x == 0) partials[row * splits + mine.piece] = statistics;
    arrive_and_wait(arrivals + row, static_cast<unsigned>(splits));
    const Moments<A> total = merge_row_partials(partials + row * splits, splits, Add{});
    const A mean = kSubtractMean ? total.mean : A(0), rstd = rsqrt(total.m2 / A(n) + eps);
    if (mine.piece == 0 && threadIdx.x == 0) {
      if constexpr (kSubtractMean) mean_out[row] = mean;
      rstd_out[row] = rstd;
    }
    write_normalized_slice<T, kVec, kSubtractMean>(
        y + offset, weight + first_column, kSubtractMean ? bias + first_column : bias, n_packs,
        [&](int pack) { return load_pack<T, kVec>(slice + pack * kVec); }, mean, rstd);
  }
}

// Split rows, pass 1: block b folds slice b % splits of row b / splits into one Moments, pack by pack,
// written to partials[b] for pass 2. Plain loads: the slice may still be in L2 when pass 2 re-reads it.
template <typename T, int kVec, bool kSubtractMean>
__global__ void __launch_bounds__(kLongRowThreads)
layer_norm_partials_kernel(const T* __restrict__ x, Moments<Acc<T>>* __restrict__ partials, int64_t n, int splits,
                           int64_t slice_packs) {
  const int64_t first_pack = blockIdx.x % splits * slice_packs;
  const int64_t n_packs = min(slice_packs, n / kVec - first_pack);
  const T* x_slice = x + int64_t{blockIdx.x} / splits * n + first_pack * kVec;
  Moments<Acc<T>> mine;
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    mine = mine + moments_of_pack<T, kVec, kSubtractMean>(load_pack<T, kVec>(x_slice + pack * kVec));
  }
  mine = block_reduce(mine, Add{});
  if (threadIdx.x == 0) partials[blockIdx.x] = mine;
}

// Split rows, pass 2: every block merges its row's partials (a few dozen, in the same order in every
// block of the row, so all get the same bits) and writes its slice of y; the row's first block saves
// mean and rstd.
template <typename T, int kVec, bool kSubtractMean>
__global__ void __launch_bounds__(kLongRowThreads)
layer_norm_normalise_kernel(const T* __restrict__ x, const Moments<Acc<T>>* __restrict__ partials,
                            const T* __restrict__ weight, const T* __restrict__ bias, T* __restrict__ y,
                            Acc<T>* __restrict__ mean_out, Acc<T>* __restrict__ rstd_out, int64_t n, int splits,
                            int64_t slice_packs, Acc<T> eps) {
  using A = Acc<T>;
  const int64_t row = blockIdx.x / splits;
  Moments<A> total;
  for (int s = threadIdx.x; s < splits; s += blockDim.x) total = total + partials[row * splits + s];
  total = block_reduce(total, Add{});
  const A mean = kSubtractMean ? total.mean : A(0), rstd = rsqrt(total.m2 / A(n) + eps);
  if (blockIdx.x % splits == 0 && threadIdx.x == 0) {
    if constexpr (kSubtractMean) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  const int64_t first_pack = blockIdx.x % splits * slice_packs;
  const int64_t n_packs = min(slice_packs, n / kVec - first_pack);
  const int64_t offset = row * n + first_pack * kVec, first_column = first_pack * kVec;
  write_normalized_slice<T, kVec, kSubtractMean>(
      y + offset, weight + first_column, kSubtractMean ? bias + first_column : bias, n_packs,
      [&](int64_t pack) { return load_pack_once<T, kVec>(x + offset + pack * kVec); }, mean, rstd);
}

// Long rows, enough of them (or not in 16-byte packs): layer_norm.cu's register kernel's math, with the
// row read once per pass. Plain (caching) loads: the next pass wants the row still in L2.
template <typename T, int kVec, bool kSubtractMean>
__global__ void __launch_bounds__(kMaxThreads)
layer_norm_forward_looped_kernel(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
                                 T* __restrict__ y, Acc<T>* __restrict__ mean_out, Acc<T>* __restrict__ rstd_out,
                                 int64_t n, Acc<T> eps) {
  using A = Acc<T>;
  const T* x_row = x + static_cast<int64_t>(blockIdx.x) * n;
  const int64_t n_packs = n / kVec;
  const Moments<A> moments = block_moments<T, kVec, kSubtractMean>(x_row, n_packs);
  const A mean = moments.mean;  // RMSNorm's: 0, no pass for it
  const A rstd = rsqrt(moments.m2 / A(n) + eps);
  if (threadIdx.x == 0) {
    if constexpr (kSubtractMean) mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
  write_normalized_slice<T, kVec, kSubtractMean>(
      y + static_cast<int64_t>(blockIdx.x) * n, weight, bias, n_packs,
      [&](int64_t pack) { return load_pack<T, kVec>(x_row + pack * kVec); }, mean, rstd);
}

// --- launcher ------------------------------------------------------------------------------------

// Whether the cluster kernel runs here (common.cuh's compiled_for_clusters), else the split or looped
// kernels take its rows.
template <typename T>
bool norm_clusters_available() {
  static const bool available = compiled_for_clusters(layer_norm_forward_cluster_kernel<T, true>);
  return available;
}

template <typename T, bool kSubtractMean>
CooperativePlan cooperative_forward_plan(int64_t rows, int64_t n) {
  return cooperative_plan<T>(layer_norm_forward_cooperative_kernel<T, kSubtractMean>, rows, n, kPacksPerThread);
}

// Rows longer than the registers hold: a cluster per row when the row is in 16-byte packs, not split
// (layer_norm_forward_splits said 1) and at most 16 x 64 KB; else split (splits > 1, with `partials`
// for rows * (splits + 1) Moments): read once by a cooperative grid when its plan has these splits
// (the last rows Moments' words then count each row's arrivals), in two passes otherwise; or looped.
// `vectorise`: the launcher's answer to whether the row is in 16-byte packs (n and every pointer).
template <typename T, bool kSubtractMean>
void launch_norm_forward_long_rows(const T* x, const T* weight, const T* bias, T* y, Acc<T>* mean, Acc<T>* rstd,
                                   int64_t rows, int64_t n, Acc<T> eps, int64_t splits, void* partials,
                                   bool vectorise, cudaStream_t stream) {
  using A = Acc<T>;
  const int64_t row_bytes = n * static_cast<int64_t>(sizeof(T));
  if (vectorise && splits == 1 && row_bytes <= kMaxClusterBlocks * kSharedRowBytes && norm_clusters_available<T>()) {
    constexpr int kVec = kVecOf<T>;
    const auto blocks = static_cast<int>(ceil_div(row_bytes, kSharedRowBytes));
    const int64_t slice_packs = ceil_div(n / kVec, blocks);
    launch_in_clusters(layer_norm_forward_cluster_kernel<T, kSubtractMean>, rows * blocks, blocks,
                       row_threads(slice_packs * kVec, kPacksPerThread * kVec), static_cast<int>(slice_packs * 16),
                       stream, x, weight, bias, y, mean, rstd, n, slice_packs, eps);
    return;
  }
  if (vectorise && splits > 1) {
    const CooperativePlan plan = cooperative_forward_plan<T, kSubtractMean>(rows, n);
    if (plan.splits == splits) {
      auto* statistics = static_cast<Moments<A>*>(partials);
      unsigned* arrivals = zeroed_row_counters(statistics, rows, splits, stream);
      launch_cooperative(layer_norm_forward_cooperative_kernel<T, kSubtractMean>, plan.rows_at_once * splits,
                         plan.threads, static_cast<int>(plan.slice_packs * 16), stream, x, weight, bias, y, mean, rstd,
                         statistics, arrivals, rows, n, static_cast<int>(splits), plan.slice_packs, eps);
      return;
    }
  }
  dispatch_vector_width<T>(vectorise, [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    if (splits > 1) {
      const int64_t slice_packs = ceil_div(n / kVec, splits);
      const auto blocks = static_cast<unsigned>(rows * splits);
      const int threads = static_cast<int>(std::min<int64_t>(kLongRowThreads, row_threads(slice_packs * kVec, 4 * kVec)));
      auto* statistics = static_cast<Moments<A>*>(partials);
      layer_norm_partials_kernel<T, kVec, kSubtractMean>
          <<<blocks, threads, 0, stream>>>(x, statistics, n, static_cast<int>(splits), slice_packs);
      layer_norm_normalise_kernel<T, kVec, kSubtractMean><<<blocks, threads, 0, stream>>>(
          x, statistics, weight, bias, y, mean, rstd, n, static_cast<int>(splits), slice_packs, eps);
    } else {
      layer_norm_forward_looped_kernel<T, kVec, kSubtractMean>
          <<<static_cast<unsigned>(rows), kMaxThreads, 0, stream>>>(x, weight, bias, y, mean, rstd, n, eps);
    }
  });
}

}  // namespace kernel_ladder
