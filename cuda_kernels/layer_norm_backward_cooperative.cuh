// LayerNorm's and RMSNorm's backward for rows longer than a block's registers, in 16-byte packs: a
// cooperative grid of column slices that reads x and dy once. layer_norm_backward.cu includes this file
// and plans when it runs (backward_plan); the formulas are in layer_norm.cu.
#pragma once

#include "common.cuh"
#include "cooperative.cuh"
#include "layer_norm_backward_cluster.cuh"

namespace kernel_ladder {

// Long rows in 16-byte packs, on a cooperative grid (every block resident at once: cooperative.cuh's
// cooperative_plan and arrive_and_wait). Block b owns column slice b % splits of rows b / splits, then
// that plus rows_at_once, and so on. Per row it stages its slices of x and dy in shared memory (one
// read of each from DRAM), posts the slice's (sum g, sum g*xhat), waits for the row's other slices,
// merges them in a fixed order (every block of the row gets the same bits) and writes dx from shared
// memory. Its threads own the same columns in every row it walks, so dw, db stay in registers until
// one partial row per block: rows_at_once partial rows, which layer_norm_weight_grads_kernel sums.
//
// Two blocks an SM: while one waits for its copies or for its row's other slices, the other computes.
// Registers bound that, not shared memory: every column a block owns keeps two accumulators (dw, db)
// across all its rows. At 4 packs a thread, bfloat16's 8 values a pack made that 64 floats, and the
// kernel took 128 registers, a whole SM's register file for one 512-thread block; float32 LayerNorm
// took 74, also one block an SM. Each such block waited with nothing else in flight (ncu on an H100, rows
// of 32,768 bfloat16: 25 % of warps active, 47 % of DRAM bandwidth). So __launch_bounds__ asks for two
// blocks an SM (64 registers; float32 and 16-bit LayerNorm spill one 8-byte value, and the figures below
// include it), and 16-bit types stage 2 packs a thread (16 KB slices of x), float32 keeps 4 (32 KB). On an H100,
// forward+backward at 32,768 to 524,288 went from 76-63 % to 85-71 % of copy bandwidth in float32
// LayerNorm and from 66-53 % to 72-56 % in bfloat16 RMSNorm; float32 RMSNorm (58 registers, already two
// blocks an SM) did not move (profiling/results/h100/cooperative-grids.md). float64 stages 2 packs of 2
// values and keeps one block an SM.
template <typename T> constexpr int kBackwardStagedPacks = sizeof(T) == 4 ? 4 : 2;
template <typename T>  // of x, and as much of dy: 64 KB (float32) or 32 KB a block
constexpr int64_t kBackwardSliceBytes = int64_t{kMaxThreads / 2} * kBackwardStagedPacks<T> * 16;

template <typename T, bool kSubtractMean>
__global__ void __launch_bounds__(kMaxThreads / 2, sizeof(T) == 8 ? 1 : 2)
layer_norm_backward_cooperative_kernel(const T* __restrict__ grad_out, const T* __restrict__ x,
                                       const T* __restrict__ weight, const Acc<T>* __restrict__ mean,
                                       const Acc<T>* __restrict__ rstd, T* __restrict__ grad_x,
                                       Acc<T>* __restrict__ partial_dw, Acc<T>* __restrict__ partial_db,
                                       RowSums<Acc<T>>* __restrict__ partial_sums, unsigned* __restrict__ arrivals,
                                       int64_t rows, int64_t n, int splits, int64_t slice_packs) {
  using A = Acc<T>;
  constexpr int kVec = kVecOf<T>, kPacks = kBackwardStagedPacks<T>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* x_slice = reinterpret_cast<T*>(shared_bytes);
  T* dy_slice = x_slice + slice_packs * kVec;
  const CooperativeSlice mine = cooperative_slice<kVec>(n, splits, slice_packs);
  const int n_packs = mine.n_packs;
  // Calls visit(k, pack, dy, x) for this thread's packs k = 0, 1, ... of the staged slices.
  const auto for_each_staged_pack = [&](auto&& visit) {
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int pack = threadIdx.x + k * blockDim.x;
      if (pack < n_packs) {
        visit(k, pack, load_pack<T, kVec>(dy_slice + pack * kVec), load_pack<T, kVec>(x_slice + pack * kVec));
      }
    }
  };
  Pack<T, kVec> w[kPacks];
  A dw[kPacks][kVec] = {}, db[kPacks][kVec] = {};  // RMSNorm never writes db, and the compiler drops it
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = threadIdx.x + k * blockDim.x;
    if (pack < n_packs) w[k] = load_pack<T, kVec>(weight + mine.first_column + pack * kVec);
  }
  for (int64_t row = mine.first_row; row < rows; row += mine.row_step) {
    const int64_t offset = row * n + mine.first_column;
    // Each thread copies, and later reads, only its own packs: its own wait orders them, and the next
    // row may overwrite them without a barrier.
    for (int pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
      copy_async_16(x_slice + pack * kVec, x + offset + pack * kVec, true);
      copy_async_16(dy_slice + pack * kVec, grad_out + offset + pack * kVec, true);
    }
    copy_async_commit();
    copy_async_wait<0>();
    const A row_mean = kSubtractMean ? mean[row] : A(0), row_rstd = rstd[row];
    RowSums<A> sums{};
    for_each_staged_pack([&](int k, int, const Pack<T, kVec>& dy, const Pack<T, kVec>& in) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const A g = product_rounded(to_acc(w[k].val[j]), to_acc(dy.val[j]));
        sums = sums + RowSums<A>{g, g * ((to_acc(in.val[j]) - row_mean) * row_rstd)};
      }
    });
    sums = block_reduce(sums, Add{});
    if (threadIdx.x == 0) partial_sums[row * splits + mine.piece] = sums;
    arrive_and_wait(arrivals + row, static_cast<unsigned>(splits));
    const RowSums<A> total = merge_row_partials(partial_sums + row * splits, splits, Add{});
    const A mean_g = kSubtractMean ? total.g / A(n) : A(0), mean_g_xhat = total.g_xhat / A(n);
    for_each_staged_pack([&](int k, int pack, const Pack<T, kVec>& dy, const Pack<T, kVec>& in) {
      Pack<T, kVec> out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const A dy_j = to_acc(dy.val[j]);
        const A xhat = (to_acc(in.val[j]) - row_mean) * row_rstd;
        out.val[j] = from_acc<T>(row_rstd * (product_rounded(to_acc(w[k].val[j]), dy_j) - mean_g - xhat * mean_g_xhat));
        dw[k][j] += dy_j * xhat;
        db[k][j] += dy_j;
      }
      store_pack_once<T, kVec>(grad_x + offset + pack * kVec, out);
    });
  }
  const int64_t partial = mine.first_row * n + mine.first_column;  // the block's partial row, its columns
  store_partial_row<kSubtractMean>(dw, db, partial_dw + partial, kSubtractMean ? partial_db + partial : nullptr, n_packs);
}

template <typename T, bool kSubtractMean>
CooperativePlan backward_cooperative_plan(int64_t rows, int64_t n) {
  return cooperative_plan<T>(layer_norm_backward_cooperative_kernel<T, kSubtractMean>, rows, n, kBackwardStagedPacks<T>,
                             kBackwardSliceBytes<T>, 2);
}

}  // namespace kernel_ladder
