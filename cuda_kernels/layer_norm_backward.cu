// LayerNorm's and RMSNorm's backward in CUDA: dx along each row, dw (and db) across rows. The formulas,
// the forward kernels and the story of both are in layer_norm.cu.
//
// Kernels, in the order they run
//   layer_norm_backward_kernel          a persistent grid: each block walks rows blockIdx.x, + gridDim.x,
//                                       ... holding x, dy in registers; writes dx, and keeps its running
//                                       dw, db in registers, written once as its row of a partial buffer
//   layer_norm_backward_cluster_kernel  the same for many rows too long for the cooperative grid below
//                                       (past ~4 MB), up to 16 blocks' registers, on sm_90+: a
//                                       thread-block CLUSTER in place of each block: every block of it holds
//                                       one column slice of each row, the slices' row sums meet in
//                                       distributed shared memory, one partial row per cluster
//                                       (layer_norm_backward_cluster.cuh)
//   layer_norm_backward_looped_kernel   long rows the clusters can't take (older GPUs, rows not in 16-byte
//                                       packs or longer than 16 blocks hold): two passes over each row, and
//                                       the block's dw, db accumulated in its partial row in global memory
//   layer_norm_backward_cooperative_kernel  rows longer than a block's registers, in 16-byte packs: a
//                                       COOPERATIVE grid of column slices (every block resident at once),
//                                       x and dy staged in shared memory and read once; the slices' row
//                                       sums meet in global memory, one partial dw, db row per block
//   layer_norm_weight_grads_kernel      sums the partial rows' columns into dw and db (deterministic)
//   Few long rows (fewer than the persistent grid has blocks), the grid cut by columns instead:
//   layer_norm_backward_slice_sums_kernel   block s walks every row's slice s: (sum g, sum g*xhat) per slice
//   layer_norm_backward_row_sums_kernel     adds up each row's slice sums, in a fixed order
//   layer_norm_backward_slice_dx_kernel     block s re-reads its slice of every row (from L2 while the few
//                                           rows fit), writes dx, and, owning those columns in every row,
//                                           writes their dw and db itself: no partial rows, no atomics
//   Each takes kSubtractMean: RMSNorm's instance (false) has no mean, no mean(g) term and no db.
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -v -c cuda_kernels/layer_norm_backward.cu -o /tmp/layer_norm_backward.o
//   python -m pytest tests -k "(layer_norm or rms_norm) and cuda"
#include <algorithm>
#include <type_traits>

#include "common.cuh"
#include "layer_norm_backward_cluster.cuh"
#include "layer_norm_backward_cooperative.cuh"

namespace kernel_ladder {

// --- backward ------------------------------------------------------------------------------------

// Rows of up to 8192 values (4096 float64): one block's registers hold the row (HeldBackwardPacks).
template <typename T, int kVec, bool kSubtractMean, bool kAllLoadsFirst>
__global__ void __launch_bounds__(kMaxThreads)
layer_norm_backward_kernel(const T* __restrict__ grad_out, const T* __restrict__ x, const T* __restrict__ weight,
                           const Acc<T>* __restrict__ mean, const Acc<T>* __restrict__ rstd, T* __restrict__ grad_x,
                           Acc<T>* __restrict__ partial_dw, Acc<T>* __restrict__ partial_db, int64_t rows, int64_t n) {
  using A = Acc<T>;
  const int n_packs = static_cast<int>(n / kVec);  // a row held in registers has at most 8192 values
  HeldBackwardPacks<T, kVec> held;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const A row_mean = kSubtractMean ? mean[row] : A(0), row_rstd = rstd[row];
    const RowSums<A> sums =
        block_reduce(held.template load<kAllLoadsFirst>(grad_out + row * n, x + row * n, weight, n_packs, row_mean,
                                                        row_rstd),
                     Add{});
    const A mean_g = kSubtractMean ? sums.g / A(n) : A(0), mean_g_xhat = sums.g_xhat / A(n);
    held.store_dx(grad_x + row * n, n_packs, row_rstd, mean_g, mean_g_xhat);
  }
  held.template store_partials<kSubtractMean>(partial_dw + blockIdx.x * n, partial_db + blockIdx.x * n, n_packs);
}

// Long rows the cluster kernel can't take: on GPUs before sm_90, rows not in 16-byte packs, rows longer
// than 16 blocks' registers. Pass 1 reads x, dy and w for the two row sums; pass 2 reads them again (from
// L2 when the row fits there), writes dx, and adds dy*xhat and dy into this block's partial row (a
// read-modify-write of it per row). No other block touches that row, and no other thread of the block
// touches these columns.
template <typename T, int kVec, bool kSubtractMean>
__global__ void __launch_bounds__(kMaxThreads)
layer_norm_backward_looped_kernel(const T* __restrict__ grad_out, const T* __restrict__ x, const T* __restrict__ weight,
                                  const Acc<T>* __restrict__ mean, const Acc<T>* __restrict__ rstd,
                                  T* __restrict__ grad_x, Acc<T>* __restrict__ partial_dw,
                                  Acc<T>* __restrict__ partial_db, int64_t rows, int64_t n) {
  using A = Acc<T>;
  const int64_t n_packs = n / kVec;
  A* block_dw = partial_dw + blockIdx.x * n;
  A* block_db = partial_db + blockIdx.x * n;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const A row_mean = kSubtractMean ? mean[row] : A(0), row_rstd = rstd[row];
    const T* dy_row = grad_out + row * n;
    const T* x_row = x + row * n;
    RowSums<A> sums{};
    for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
      const Pack<T, kVec> dy = load_pack<T, kVec>(dy_row + pack * kVec);
      const Pack<T, kVec> in = load_pack<T, kVec>(x_row + pack * kVec);
      const Pack<T, kVec> w = load_pack<T, kVec>(weight + pack * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const A g = product_rounded(to_acc(w.val[j]), to_acc(dy.val[j]));
        sums = sums + RowSums<A>{g, g * (to_acc(in.val[j]) - row_mean) * row_rstd};
      }
    }
    sums = block_reduce(sums, Add{});
    const A mean_g = kSubtractMean ? sums.g / A(n) : A(0), mean_g_xhat = sums.g_xhat / A(n);
    const bool first_row_of_block = row == blockIdx.x;  // the partial row starts from 0, not from garbage
    for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
      const Pack<T, kVec> dy = load_pack<T, kVec>(dy_row + pack * kVec);
      const Pack<T, kVec> in = load_pack<T, kVec>(x_row + pack * kVec);
      const Pack<T, kVec> w = load_pack<T, kVec>(weight + pack * kVec);
      Pack<T, kVec> out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const int64_t column = pack * kVec + j;
        const A dy_j = to_acc(dy.val[j]);
        const A xhat = (to_acc(in.val[j]) - row_mean) * row_rstd;
        out.val[j] = from_acc<T>(row_rstd * (product_rounded(to_acc(w.val[j]), dy_j) - mean_g - xhat * mean_g_xhat));
        block_dw[column] = (first_row_of_block ? A(0) : block_dw[column]) + dy_j * xhat;
        if constexpr (kSubtractMean) block_db[column] = (first_row_of_block ? A(0) : block_db[column]) + dy_j;
      }
      store_pack_once<T, kVec>(grad_x + row * n + pack * kVec, out);
    }
  }
}

// Few long rows (fewer than the persistent grid has blocks): the grid is cut by COLUMNS instead, so
// every SM has work however few the rows. Block s owns slice s of every row, one pack per thread.
// Pass 1 writes each row's slice sums (sum g, sum g*xhat) to partial_sums[row * splits + s].
template <typename T, int kVec, bool kSubtractMean>
__global__ void __launch_bounds__(kMaxThreads)
layer_norm_backward_slice_sums_kernel(const T* __restrict__ grad_out, const T* __restrict__ x,
                                      const T* __restrict__ weight, const Acc<T>* __restrict__ mean,
                                      const Acc<T>* __restrict__ rstd, RowSums<Acc<T>>* __restrict__ partial_sums,
                                      int64_t rows, int64_t n, int splits, int64_t slice_packs) {
  using A = Acc<T>;
  const int64_t pack = blockIdx.x * slice_packs + threadIdx.x;
  const bool inside = threadIdx.x < slice_packs && pack < n / kVec;
  for (int64_t row = 0; row < rows; ++row) {
    const A row_mean = kSubtractMean ? mean[row] : A(0), row_rstd = rstd[row];
    RowSums<A> sums{};
    if (inside) {
      // Plain loads: pass 2 re-reads these packs, from L2 while the few rows fit there. w is re-read
      // from L1 each row rather than held across the loop (1024-thread blocks leave 64 registers).
      const Pack<T, kVec> dy = load_pack<T, kVec>(grad_out + row * n + pack * kVec);
      const Pack<T, kVec> in = load_pack<T, kVec>(x + row * n + pack * kVec);
      const Pack<T, kVec> w = load_pack<T, kVec>(weight + pack * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const A g = product_rounded(to_acc(w.val[j]), to_acc(dy.val[j]));
        sums = sums + RowSums<A>{g, g * ((to_acc(in.val[j]) - row_mean) * row_rstd)};
      }
    }
    sums = block_reduce(sums, Add{});
    if (threadIdx.x == 0) partial_sums[row * splits + blockIdx.x] = sums;
  }
}

// Between the passes, one block per row adds up its slice sums in a fixed order (deterministic) and
// leaves the row's total in the row's first entry, so pass 2 reads one pair per row, not `splits`.
template <typename A>
__global__ void __launch_bounds__(kMaxThreads)
layer_norm_backward_row_sums_kernel(RowSums<A>* __restrict__ partial_sums, int splits) {
  RowSums<A>* row_sums = partial_sums + int64_t{blockIdx.x} * splits;
  RowSums<A> total{};
  for (int s = threadIdx.x; s < splits; s += blockDim.x) total = total + row_sums[s];
  total = block_reduce(total, Add{});  // its barriers: every read is done before the write below
  if (threadIdx.x == 0) row_sums[0] = total;
}

// Pass 2: each block writes dx for its slice of every row; its threads own their columns in every row,
// so they keep dw, db in registers and write them at the end: no partial buffer, no column reduction,
// no atomics.
template <typename T, int kVec, bool kSubtractMean>
__global__ void __launch_bounds__(kMaxThreads)
layer_norm_backward_slice_dx_kernel(const T* __restrict__ grad_out, const T* __restrict__ x,
                                    const T* __restrict__ weight, const Acc<T>* __restrict__ mean,
                                    const Acc<T>* __restrict__ rstd, const RowSums<Acc<T>>* __restrict__ partial_sums,
                                    T* __restrict__ grad_x, T* __restrict__ grad_weight, T* __restrict__ grad_bias,
                                    int64_t rows, int64_t n, int splits, int64_t slice_packs) {
  using A = Acc<T>;
  const int64_t pack = blockIdx.x * slice_packs + threadIdx.x;
  if (threadIdx.x >= slice_packs || pack >= n / kVec) return;  // no barrier below waits for this thread
  const Pack<T, kVec> w = load_pack<T, kVec>(weight + pack * kVec);
  A dw[kVec] = {}, db[kVec] = {};  // RMSNorm never writes db, and the compiler drops it
  for (int64_t row = 0; row < rows; ++row) {
    const RowSums<A> sums = partial_sums[row * splits];
    const A row_mean = kSubtractMean ? mean[row] : A(0), row_rstd = rstd[row];
    const A mean_g = kSubtractMean ? sums.g / A(n) : A(0), mean_g_xhat = sums.g_xhat / A(n);
    const Pack<T, kVec> dy = load_pack_once<T, kVec>(grad_out + row * n + pack * kVec);
    const Pack<T, kVec> in = load_pack_once<T, kVec>(x + row * n + pack * kVec);
    Pack<T, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const A dy_j = to_acc(dy.val[j]);
      const A xhat = (to_acc(in.val[j]) - row_mean) * row_rstd;
      out.val[j] = from_acc<T>(row_rstd * (product_rounded(to_acc(w.val[j]), dy_j) - mean_g - xhat * mean_g_xhat));
      dw[j] += dy_j * xhat;
      db[j] += dy_j;
    }
    store_pack_once<T, kVec>(grad_x + row * n + pack * kVec, out);
  }
  Pack<T, kVec> dw_out, db_out;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    dw_out.val[j] = from_acc<T>(dw[j]);
    db_out.val[j] = from_acc<T>(db[j]);
  }
  store_pack<T, kVec>(grad_weight + pack * kVec, dw_out);
  if constexpr (kSubtractMean) store_pack<T, kVec>(grad_bias + pack * kVec, db_out);
}

// dw, db = column sums of the (partial_rows, n) buffers. A 32 x 32 block owns 32 adjacent columns:
// each warp (fixed threadIdx.y) reads 32 adjacent values of one partial row (one 128-byte line in
// float32) and walks down every 32nd row; then the 32 per-warp sums of each column meet in shared memory.
constexpr int kColumnTile = 32;

template <typename T, bool kSubtractMean>
__global__ void __launch_bounds__(kColumnTile * kColumnTile)
layer_norm_weight_grads_kernel(const Acc<T>* __restrict__ partial_dw, const Acc<T>* __restrict__ partial_db,
                               int64_t partial_rows, int64_t n, T* __restrict__ grad_weight, T* __restrict__ grad_bias) {
  using A = Acc<T>;
  __shared__ A dw_tile[kColumnTile][kColumnTile];
  __shared__ A db_tile[kColumnTile][kColumnTile];  // RMSNorm leaves it unused
  const int64_t column = static_cast<int64_t>(blockIdx.x) * kColumnTile + threadIdx.x;
  A dw = 0, db = 0;
  if (column < n) {
    for (int64_t r = threadIdx.y; r < partial_rows; r += kColumnTile) {
      dw += partial_dw[r * n + column];
      if constexpr (kSubtractMean) db += partial_db[r * n + column];
    }
  }
  dw_tile[threadIdx.y][threadIdx.x] = dw;
  if constexpr (kSubtractMean) db_tile[threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y == 0 && column < n) {
    // A fixed order of additions: the same inputs give the same bits on every run.
    for (int i = 1; i < kColumnTile; ++i) {
      dw += dw_tile[i][threadIdx.x];
      if constexpr (kSubtractMean) db += db_tile[i][threadIdx.x];
    }
    grad_weight[column] = from_acc<T>(dw);
    if constexpr (kSubtractMean) grad_bias[column] = from_acc<T>(db);
  }
}

// --- launchers -----------------------------------------------------------------------------------
// The register kernel and its looped twin take the same arguments, so a launcher picks a kernel pointer
// and a block size, then launches once. LayerNorm's launchers and RMSNorm's are the same templates;
// RMSNorm passes null for the mean, the bias gradient and db's buffer, which its kernels never touch.

// Whether one block's registers hold a row of n values (layer_norm_backward_kernel), kBackwardValues a thread.
template <typename T>
bool backward_row_in_registers(int64_t n) {
  return n <= int64_t{kMaxThreads} * kBackwardValues<Acc<T>>;
}

// A float32 row in registers whose block has more than half of kMaxThreads fills its SM alone (64
// registers a thread): its threads issue both their 16-byte packs' loads before any arithmetic
// (HeldBackwardPacks::load). Measured (H200, the backward alone,
// profiling/results/h200/norm-backward-level5-probe26.log): rows of 8192, LayerNorm 72.1 -> 85.2 % of
// copy bandwidth, RMSNorm 76.3 -> 87.5; rows of 2048, four blocks an SM, keep the one-pack-at-a-time
// order, which is faster there (88.2 against 85.6). 16-bit rows hold one pack a thread (the same loads in
// the other form lost 0.5-2.8 points); float64 keeps the plain order too (not measured).
template <typename T, int kVec, bool kSubtractMean>
auto backward_kernel_for(int64_t n, int* threads) {
  if (!backward_row_in_registers<T>(n)) {
    *threads = kMaxThreads;
    return layer_norm_backward_looped_kernel<T, kVec, kSubtractMean>;
  }
  *threads = row_threads(n, kBackwardValues<Acc<T>>);
  if constexpr (std::is_same_v<T, float> && kVec == kVecOf<T>) {
    if (*threads > kMaxThreads / 2) return layer_norm_backward_kernel<T, kVec, kSubtractMean, true>;
  }
  return layer_norm_backward_kernel<T, kVec, kSubtractMean, false>;
}

// The backward's grid for (rows, n): a persistent grid of partial_rows blocks (splits == 1); for rows too
// long for one block's registers, in 16-byte packs, the cooperative grid of
// layer_norm_backward_cooperative.cuh (`cooperative`, partial_rows its rows at once) while it holds at
// least 3 rows (rows up to ~4 MB on an H100); past that, on sm_90+, partial_rows clusters (in_clusters)
// when the rows are many, or, when they are fewer than the blocks the GPU holds at once, `splits`
// column slices.
struct BackwardPlan {
  int64_t partial_rows = 0;
  int64_t splits = 1;
  bool in_clusters = false;
  CooperativePlan cooperative;  // its splits > 0: the cooperative grid, rows_at_once == partial_rows
};

template <bool kSubtractMean>
BackwardPlan make_backward_plan(DType dtype, int64_t rows, int64_t n) {
  BackwardPlan plan;
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    int threads = 0, blocks_per_sm = 0;
    const auto kernel = backward_kernel_for<T, kVecOf<T>, kSubtractMean>(n, &threads);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, threads, 0);
    const int64_t multiprocessors = std::max(multiprocessor_count(), 1);
    // As many blocks as are resident at once: each then walks its rows without waiting for a second wave,
    // and the partial buffer has no more rows than the GPU has blocks in flight.
    const int64_t resident = std::max(blocks_per_sm, 1) * multiprocessors;
    const bool in_registers = backward_row_in_registers<T>(n);
    // Longer rows in 16-byte packs: the cooperative grid, which reads x and dy once, when it holds at
    // least kCooperativeMinRowsAtOnce rows (or all of them) at once.
    if (!in_registers) {
      plan.cooperative = backward_cooperative_plan<T, kSubtractMean>(rows, n);
      if (plan.cooperative.splits > 0) {
        plan.partial_rows = plan.cooperative.rows_at_once;
        return;
      }
    }
    if (in_registers || rows >= resident) {
      plan.partial_rows = std::min(rows, resident);
      // Longer rows on sm_90+: as many clusters as are resident at once, one partial row each. The
      // workspace is sized for them, so a launch whose pointers turn out not 16-byte aligned runs the
      // looped kernel on that many blocks (fewer than `resident`, but any grid walks every row).
      const int clusters = in_registers ? 0 : backward_resident_clusters<T, kSubtractMean>(n);
      if (clusters > 0) {
        plan.partial_rows = std::min<int64_t>(rows, clusters);
        plan.in_clusters = true;
      }
      return;
    }
    // Slices of at most kMaxThreads values (one pack a thread, even unvectorised), enough for
    // kSplitBlocksPerSM blocks an SM, and at least a warp of 16-byte packs each.
    plan.splits = std::max(ceil_div(n, kMaxThreads),
                           std::min(kSplitBlocksPerSM * multiprocessors, ceil_div(n, kWarpSize * kVecOf<T>)));
  });
  return plan;
}

// Made once per device and shape (its occupancy queries are driver calls): a backward asks twice, for
// its workspace's size and to launch.
template <bool kSubtractMean>
BackwardPlan backward_plan(DType dtype, int64_t rows, int64_t n) {
  return memoised_per_device([&] { return make_backward_plan<kSubtractMean>(dtype, rows, n); }, dtype, rows, n);
}

// Scratch in statistics-type values: the partial dw (and db) rows, or a (sum g, sum g*xhat) per slice of
// each row, or for the cooperative grid both, then a word per row that counts its arrived blocks.
template <bool kSubtractMean>
int64_t backward_workspace(DType dtype, int64_t rows, int64_t n) {
  const BackwardPlan plan = backward_plan<kSubtractMean>(dtype, rows, n);
  const int64_t partial_rows = plan.partial_rows * n * (kSubtractMean ? 2 : 1);
  if (plan.cooperative.splits > 0) return partial_rows + rows * plan.cooperative.splits * 2 + rows;
  return plan.splits > 1 ? rows * plan.splits * 2 : partial_rows;
}

template <bool kSubtractMean>
void launch_backward(DType dtype, const void* grad_out, const void* x, const void* weight, const void* mean,
                     const void* rstd, void* grad_x, void* grad_weight, void* grad_bias, void* workspace,
                     int64_t rows, int64_t n, void* stream) {
  const BackwardPlan plan = backward_plan<kSubtractMean>(dtype, rows, n);
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    using A = Acc<T>;
    const auto s = static_cast<cudaStream_t>(stream);
    const T* dy = static_cast<const T*>(grad_out);
    const T* in = static_cast<const T*>(x);
    const T* w = static_cast<const T*>(weight);
    const A* means = static_cast<const A*>(mean);
    const A* rstds = static_cast<const A*>(rstd);
    T* dx = static_cast<T*>(grad_x);
    const bool vectorise = n % kVecOf<T> == 0 && aligned_16(grad_out) && aligned_16(x) && aligned_16(weight) &&
                           aligned_16(grad_x) && aligned_16(grad_weight) && (!kSubtractMean || aligned_16(grad_bias));
    if (plan.splits > 1) {
      auto* sums = static_cast<RowSums<A>*>(workspace);
      const auto splits = static_cast<int>(plan.splits);
      dispatch_vector_width<T>(vectorise, [&](auto vec) {
        constexpr int kVec = decltype(vec)::value;
        const int64_t slice_packs = ceil_div(n / kVec, splits);
        const int threads = row_threads(slice_packs, 1);
        layer_norm_backward_slice_sums_kernel<T, kVec, kSubtractMean>
            <<<splits, threads, 0, s>>>(dy, in, w, means, rstds, sums, rows, n, splits, slice_packs);
        layer_norm_backward_row_sums_kernel<A>
            <<<static_cast<unsigned>(rows), std::min(kMaxThreads, row_threads(splits, 1)), 0, s>>>(sums, splits);
        layer_norm_backward_slice_dx_kernel<T, kVec, kSubtractMean><<<splits, threads, 0, s>>>(
            dy, in, w, means, rstds, sums, dx, static_cast<T*>(grad_weight), static_cast<T*>(grad_bias), rows, n,
            splits, slice_packs);
      });
      return;
    }
    A* partial_dw = static_cast<A*>(workspace);
    A* partial_db = kSubtractMean ? partial_dw + plan.partial_rows * n : nullptr;
    const CooperativePlan& cooperative = plan.cooperative;
    if (cooperative.splits > 0 && vectorise) {
      auto* sums = reinterpret_cast<RowSums<A>*>(partial_dw + plan.partial_rows * n * (kSubtractMean ? 2 : 1));
      unsigned* arrivals = zeroed_row_counters(sums, rows, cooperative.splits, s);
      launch_cooperative(layer_norm_backward_cooperative_kernel<T, kSubtractMean>,
                         cooperative.rows_at_once * cooperative.splits, cooperative.threads,
                         static_cast<int>(cooperative.slice_packs * 16 * 2), s, dy, in, w, means, rstds, dx, partial_dw,
                         partial_db, sums, arrivals, rows, n, static_cast<int>(cooperative.splits),
                         cooperative.slice_packs);
    } else if (plan.in_clusters && vectorise) {
      launch_backward_cluster<T, kSubtractMean>(dy, in, w, means, rstds, dx, partial_dw, partial_db, rows, n,
                                                plan.partial_rows, s);
    } else {
      dispatch_vector_width<T>(vectorise, [&](auto vec) {
        int threads = 0;
        const auto kernel = backward_kernel_for<T, decltype(vec)::value, kSubtractMean>(n, &threads);
        kernel<<<static_cast<unsigned>(plan.partial_rows), threads, 0, s>>>(dy, in, w, means, rstds, dx, partial_dw,
                                                                           partial_db, rows, n);
      });
    }
    const dim3 tile(kColumnTile, kColumnTile);
    layer_norm_weight_grads_kernel<T, kSubtractMean><<<static_cast<unsigned>(ceil_div(n, kColumnTile)), tile, 0, s>>>(
        partial_dw, partial_db, plan.partial_rows, n, static_cast<T*>(grad_weight), static_cast<T*>(grad_bias));
  });
}

int64_t layer_norm_backward_workspace(DType dtype, int64_t rows, int64_t n) {
  return backward_workspace<true>(dtype, rows, n);
}

void launch_layer_norm_backward(DType dtype, const void* grad_out, const void* x, const void* weight,
                                const void* mean, const void* rstd, void* grad_x, void* grad_weight,
                                void* grad_bias, void* workspace, int64_t rows, int64_t n, void* stream) {
  launch_backward<true>(dtype, grad_out, x, weight, mean, rstd, grad_x, grad_weight, grad_bias, workspace, rows, n,
                        stream);
}

int64_t rms_norm_backward_workspace(DType dtype, int64_t rows, int64_t n) {
  return backward_workspace<false>(dtype, rows, n);
}

void launch_rms_norm_backward(DType dtype, const void* grad_out, const void* x, const void* weight, const void* rstd,
                              void* grad_x, void* grad_weight, void* workspace, int64_t rows, int64_t n,
                              void* stream) {
  launch_backward<false>(dtype, grad_out, x, weight, nullptr, rstd, grad_x, grad_weight, nullptr, workspace, rows, n,
                         stream);
}

}  // namespace kernel_ladder
