// LayerNorm's and RMSNorm's backward for rows longer than one block's registers hold, on Hopper (sm_90
// and later), and the row-in-registers pieces it shares with layer_norm_backward.cu's register kernel.
// layer_norm_backward.cu includes this file, calls launch_backward_cluster, and tells the whole story.
//
// Kernel
//   layer_norm_backward_cluster_kernel  rows of up to 16 blocks' registers (131,072 values; 65,536
//                                       float64) in 16-byte packs: a persistent grid of thread-block
//                                       CLUSTERS, each walking rows c, c + clusters, ...; block `rank`
//                                       holds slice `rank` of every row in registers, so x and dy are read
//                                       once and its running dw, db never leave registers; the blocks swap
//                                       their slices' row sums through distributed shared memory
#pragma once

#include "common.cuh"

namespace kernel_ladder {

// Row values per thread in registers: the backward holds four arrays (xhat, g, running dw, db: 8 floats,
// 4 doubles) in 1024-thread blocks of 64 registers a thread.
template <typename A> constexpr int kBackwardValues = 32 / static_cast<int>(sizeof(A));

// g = w * dy, rounded on its own. nvcc would otherwise fuse the product into later additions (an FMA
// keeps it unrounded), and the g in g - mean(g) would differ from the g that was summed: with n = 1
// the exact answer dx = 0 would come out as rounding noise. __fmul_rn is never fused.
__device__ __forceinline__ float product_rounded(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double product_rounded(double a, double b) { return __dmul_rn(a, b); }

// The two row sums of the backward, reduced together: one trip through shared memory, not two.
template <typename A>
struct RowSums {
  A g, g_xhat;
};

template <typename A>
__device__ __forceinline__ RowSums<A> operator+(RowSums<A> a, RowSums<A> b) { return {a.g + b.g, a.g_xhat + b.g_xhat}; }

// A thread's running dw (and db) for its packs t, t + blockDim.x, ... of a block's columns, as its part
// of the block's row of each partial buffer: written once, read by the column reduction.
template <bool kSubtractMean, typename A, int kPacks, int kVec>
__device__ __forceinline__ void store_partial_row(const A (&dw)[kPacks][kVec], const A (&db)[kPacks][kVec], A* dw_row,
                                                  A* db_row, int n_packs) {
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = threadIdx.x + k * blockDim.x;
    if (pack >= n_packs) continue;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      dw_row[pack * kVec + j] = dw[k][j];
      if constexpr (kSubtractMean) db_row[pack * kVec + j] = db[k][j];
    }
  }
}

// --- a row in registers -------------------------------------------------------------------------
// What one thread holds of a row (or of its block's slice of one): its packs t, t + blockDim.x, ... of
// xhat and g, and its running dw, db for the same columns. These are its columns in every row, so dw and
// db stay in registers across all the rows its block walks.
template <typename T, int kVec>
struct HeldBackwardPacks {
  using A = Acc<T>;
  static constexpr int kPacks = kBackwardValues<A> / kVec;
  A xhat[kPacks][kVec], g[kPacks][kVec];
  A dw[kPacks][kVec] = {};
  A db[kPacks][kVec] = {};  // RMSNorm never writes it, and the compiler drops it

  // Reads this thread's packs of dy and x (touched once: streaming loads) and of w (shared by every row:
  // cached), each pointer at the first of the n_packs packs held; returns its (sum g, sum g*xhat).
  // kAllLoadsFirst: every pack's loads are issued before any arithmetic. Otherwise each pack is loaded,
  // then used: nvcc keeps a later pack's loads behind its `pack < n_packs` test, below the earlier
  // pack's arithmetic, so a thread has one pack in flight. That is enough while other blocks on the SM
  // have loads in flight, and measured faster there (fewer registers); a block that fills its SM alone
  // waits with nothing else in flight (backward_kernel_for says where each is used).
  template <bool kAllLoadsFirst = false>
  __device__ __forceinline__ RowSums<A> load(const T* dy_row, const T* x_row, const T* weight, int n_packs, A mean,
                                             A rstd) {
    // A pack past the row's end stays zero: g = 0 adds nothing to the sums, dw or db, so the arithmetic
    // needs no test of its own.
    Pack<T, kVec> dy[kPacks] = {}, in[kPacks] = {}, w[kPacks] = {};
    RowSums<A> sums{};
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int pack = threadIdx.x + k * blockDim.x;
      if (pack >= n_packs) continue;
      dy[k] = load_pack_once<T, kVec>(dy_row + pack * kVec);
      in[k] = load_pack_once<T, kVec>(x_row + pack * kVec);
      w[k] = load_pack<T, kVec>(weight + pack * kVec);
      if constexpr (!kAllLoadsFirst) hold(k, dy[k], in[k], w[k], mean, rstd, sums);
    }
    if constexpr (kAllLoadsFirst) {
#pragma unroll
      for (int k = 0; k < kPacks; ++k) hold(k, dy[k], in[k], w[k], mean, rstd, sums);
    }
    return sums;
  }

  // Pack k's xhat and g, its share of the running dw and db, and its terms added to the two row sums
  // (in the same order whichever way the packs were loaded: both ways give the same bits).
  __device__ __forceinline__ void hold(int k, const Pack<T, kVec>& dy, const Pack<T, kVec>& in, const Pack<T, kVec>& w,
                                       A mean, A rstd, RowSums<A>& sums) {
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const A dy_j = to_acc(dy.val[j]);
      xhat[k][j] = (to_acc(in.val[j]) - mean) * rstd;
      g[k][j] = product_rounded(to_acc(w.val[j]), dy_j);
      dw[k][j] += dy_j * xhat[k][j];
      db[k][j] += dy_j;
      sums = sums + RowSums<A>{g[k][j], g[k][j] * xhat[k][j]};
    }
  }

  // dx = rstd * (g - mean(g) - xhat * mean(g*xhat)) from the held packs, written once (streaming stores).
  __device__ __forceinline__ void store_dx(T* dx_row, int n_packs, A rstd, A mean_g, A mean_g_xhat) const {
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int pack = threadIdx.x + k * blockDim.x;
      if (pack >= n_packs) continue;
      Pack<T, kVec> out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) out.val[j] = from_acc<T>(rstd * (g[k][j] - mean_g - xhat[k][j] * mean_g_xhat));
      store_pack_once<T, kVec>(dx_row + pack * kVec, out);
    }
  }

  // The running dw (and db) as the block's row of each partial buffer (store_partial_row).
  template <bool kSubtractMean>
  __device__ __forceinline__ void store_partials(A* dw_row, A* db_row, int n_packs) const {
    store_partial_row<kSubtractMean>(dw, db, dw_row, db_row, n_packs);
  }
};

// Rows longer than one block's registers hold, up to 16 blocks' (131,072 values; 65,536 float64), on
// sm_90 and later: the same persistent walk by a CLUSTER of blocks. Block `rank` of cluster c holds slice
// `rank` of rows c, c + clusters, ... (common.cuh's cluster_slice), so its threads' columns, and their
// running dw, db, are the same in every row; the blocks swap their slices' row sums through distributed
// shared memory (cluster_reduce). x and dy are read once, dx written once, and each block's dw, db leave
// as its slice of partial row c: one partial row per cluster.
template <typename T, bool kSubtractMean>
__global__ void __launch_bounds__(kMaxThreads)
layer_norm_backward_cluster_kernel(const T* __restrict__ grad_out, const T* __restrict__ x,
                                   const T* __restrict__ weight, const Acc<T>* __restrict__ mean,
                                   const Acc<T>* __restrict__ rstd, T* __restrict__ grad_x,
                                   Acc<T>* __restrict__ partial_dw, Acc<T>* __restrict__ partial_db, int64_t rows,
                                   int64_t n, int64_t slice_packs) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using A = Acc<T>;
  constexpr int kVec = kVecOf<T>;
  __shared__ RowSums<A> slice_sums;
  const ClusterSlice mine = cluster_slice<kVec>(n, slice_packs);  // mine.row: the cluster's index, its first row
  const int64_t clusters = static_cast<int64_t>(cooperative_groups::this_grid().num_clusters());
  const int64_t first_column = mine.first_pack * kVec;
  HeldBackwardPacks<T, kVec> held;
  for (int64_t row = mine.row; row < rows; row += clusters) {
    const A row_mean = kSubtractMean ? mean[row] : A(0), row_rstd = rstd[row];
    const int64_t slice = row * n + first_column;
    const RowSums<A> block_sums =
        block_reduce(held.load(grad_out + slice, x + slice, weight + first_column, mine.n_packs, row_mean, row_rstd),
                     Add{});
    const RowSums<A> sums = cluster_reduce(&slice_sums, block_sums, Add{});
    const A mean_g = kSubtractMean ? sums.g / A(n) : A(0), mean_g_xhat = sums.g_xhat / A(n);
    held.store_dx(grad_x + slice, mine.n_packs, row_rstd, mean_g, mean_g_xhat);
  }
  const int64_t partial_slice = mine.row * n + first_column;
  held.template store_partials<kSubtractMean>(partial_dw + partial_slice, partial_db + partial_slice, mine.n_packs);
#else
  __trap();  // the launcher runs this kernel only where it was compiled for sm_90 or later
#endif
}

// --- launcher ------------------------------------------------------------------------------------

// The cluster kernel for rows of n: as few blocks as hold the row in their registers, each with a slice
// of slice_packs packs, kBackwardValues values a thread (blocks == 0: the row needs more than 16 blocks).
struct BackwardClusterShape {
  int blocks = 0;
  int64_t slice_packs = 0;
  int threads = 0;
};

template <typename T>
BackwardClusterShape backward_cluster_shape(int64_t n) {
  using A = Acc<T>;
  BackwardClusterShape shape;
  const int64_t blocks = ceil_div(n, int64_t{kMaxThreads} * kBackwardValues<A>);
  if (blocks > kMaxClusterBlocks) return shape;
  shape.blocks = static_cast<int>(blocks);
  shape.slice_packs = ceil_div(n / kVecOf<T>, blocks);
  shape.threads = row_threads(shape.slice_packs * kVecOf<T>, kBackwardValues<A>);
  return shape;
}

// Whether the cluster kernel runs here (common.cuh's compiled_for_clusters).
template <typename T>
bool backward_clusters_available() {
  static const bool available = compiled_for_clusters(layer_norm_backward_cluster_kernel<T, true>);
  return available;
}

// How many clusters the GPU holds at once for rows of n, or 0 where the cluster kernel can't take them
// (n not in 16-byte packs, rows longer than 16 blocks hold, no sm_90 image).
template <typename T, bool kSubtractMean>
int backward_resident_clusters(int64_t n) {
  const BackwardClusterShape shape = backward_cluster_shape<T>(n);
  if (n % kVecOf<T> != 0 || shape.blocks == 0 || !backward_clusters_available<T>()) return 0;
  return resident_clusters(layer_norm_backward_cluster_kernel<T, kSubtractMean>, shape.blocks, shape.threads, 0);
}

// Launches the cluster kernel: `clusters` clusters (backward_plan's partial_rows), one partial row each.
template <typename T, bool kSubtractMean>
void launch_backward_cluster(const T* grad_out, const T* x, const T* weight, const Acc<T>* mean, const Acc<T>* rstd,
                             T* grad_x, Acc<T>* partial_dw, Acc<T>* partial_db, int64_t rows, int64_t n,
                             int64_t clusters, cudaStream_t stream) {
  const BackwardClusterShape shape = backward_cluster_shape<T>(n);
  launch_in_clusters(layer_norm_backward_cluster_kernel<T, kSubtractMean>, clusters * shape.blocks, shape.blocks,
                     shape.threads, 0, stream, grad_out, x, weight, mean, rstd, grad_x, partial_dw, partial_db, rows,
                     n, shape.slice_packs);
}

}  // namespace kernel_ladder
