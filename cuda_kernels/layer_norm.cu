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
// Kernels, by row length (the forward's launcher picks; the long-row ones are in layer_norm_long_rows.cuh,
// the backward's in layer_norm_backward.cu)
//   layer_norm_forward_warp_kernel      short rows (up to 32 values per lane x 32 lanes): a group of 1 to
//                                       32 lanes per row, the row in registers, reduced with shuffles, so
//                                       128-value rows keep all 32 lanes of a warp busy (8 rows a warp)
//   layer_norm_forward_kernel           rows of up to 64 KB (32 KB for LayerNorm in float64 and rows not
//                                       in 16-byte packs): one block per row; the row sits in registers
//                                       (four or eight 16-byte packs a thread): read once, mean, then
//                                       variance of the centred values (exact two-pass, no second read),
//                                       normalise, write once
//   layer_norm_forward_prefetch_kernel  rows of 16384-32768 values in 16-byte packs (2- and 4-byte types),
//                                       at least twice as many as SMs: a persistent grid of one 1024-thread
//                                       block an SM, each holding a row in registers while its next row
//                                       flies into shared memory (cp.async), so the SM's loads never stop
//   layer_norm_forward_cluster_kernel   rows of up to 4 x 64 KB (more when the cooperative grid below does
//                                       not apply), Hopper (sm_90) and later: a thread-block
//                                       CLUSTER per row, each block staging a 64 KB slice in shared memory;
//                                       the blocks swap their slices' (count, mean, M2) through distributed
//                                       shared memory, so the row is still read from HBM once
//   layer_norm_forward_cooperative_kernel  longer rows, too few of them to fill the GPU (or no clusters):
//                                       each row split into 64 KB slices over a COOPERATIVE grid (every
//                                       block resident at once), each block staging its slice in shared
//                                       memory and waiting for its row's other slices' (count, mean, M2):
//                                       x read once
//   layer_norm_partials_kernel +        the same rows where the cooperative grid does not apply (fewer than
//   layer_norm_normalise_kernel         kCooperativeMinRowsAtOnce rows at once, or not in 16-byte packs):
//                                       pass 1 writes each slice's (count, mean, M2), pass 2 merges and
//                                       re-reads x
//   layer_norm_forward_looped_kernel    long rows, enough of them (or not in 16-byte packs): one block per
//                                       row, each pass (mean, variance, output) re-reading the row, from L2
//                                       when it is still there
//   layer_norm_backward_kernel          a persistent grid: each block walks rows blockIdx.x, + gridDim.x,
//                                       ... holding x, dy in registers; writes dx, and keeps its running
//                                       dw, db in registers, written once as its row of a partial buffer
//   layer_norm_backward_cluster_kernel  the same for rows of up to 16 blocks' registers, Hopper (sm_90) and
//                                       later: a thread-block CLUSTER in place of each block, each of its
//                                       blocks holding one column slice of every row it walks
//   layer_norm_backward_looped_kernel   long rows the clusters can't take: two passes over each row, and
//                                       the block's dw, db accumulated in its partial row in global memory
//   layer_norm_weight_grads_kernel      sums the partial rows' columns into dw and db (deterministic)
//
// The one idea that makes it fast
//   Every element crosses DRAM the fewest times the math allows: x read once and y written once
//   forward; x, dy read once and dx written once backward. Reductions happen in registers (warp
//   shuffles) and one small shared-memory pass. A row's statistics merge: slices of a row become
//   (count, mean, M2) triples combined with Chan's formula (exact, no sum-of-squares cancellation), so a
//   row too long for one SM is held by a cluster of SMs, or split over many blocks when the rows are too
//   few for 132 SMs. Each backward thread owns the same columns in every row, so the cross-row sums
//   dw, db need neither atomics nor a second pass over x and dy.
//
// Limits
//   Any n >= 1. Forward: rows of up to 1024 float32/half-precision values (512 float64) in a few lanes' registers, up
//   to 64 KB in a block's registers (32 KB for LayerNorm in float64 and unvectorised rows), up to 256 KB (4 x 64 KB)
//   in a cluster's shared memory on sm_90+ when n is a multiple of the pack width, and longer such rows in 64 KB
//   slices over a cooperative grid while it holds at least 3 rows' slices at once (a 25 MB row does not fit at all);
//   other long rows are split (too few rows to fill the GPU: x read twice, the second time from L2 while it fits) or
//   looped (x read three times). Backward: 8192 values (4096 float64) in a block's registers, up to 16 times that in
//   a cluster's on sm_90+ (16-byte packs); other long rows are read twice: by one block per row, or, when the rows
//   are fewer than the blocks the GPU holds at once (sm_90 too), by column slices of every row (x and dy re-read from
//   L2 while they fit). 16-byte loads need n to be a multiple of the pack width (4 float, 8 half, 2 double) and
//   16-byte-aligned pointers, else 1-element loads. rows < 2^31.
//   float16, bfloat16, float32 (statistics and sums in float32) and float64.
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -v -c cuda_kernels/layer_norm.cu -o /tmp/layer_norm.o
//   python -m pytest tests -k "(layer_norm or rms_norm) and cuda"
//   python -m profiling --sweep row_length --component layer_norm rms_norm
#include <algorithm>

#include "common.cuh"
#include "layer_norm_long_rows.cuh"

namespace kernel_ladder {

// Loads first (common.cuh: load_row_packs) only where measured to help at no cost in registers: LayerNorm's
// 4- and 8-byte rows in 16-byte packs. In 16-bit rows they gained nothing (LayerNorm) or lost (RMSNorm); in
// the other instances ptxas gave the hoisted loads more registers (RMSNorm's float32 kernel 32 -> 38: one
// 1024-thread block an SM instead of two; the unvectorised ones 39-46 -> 50-60).
template <typename T, int kVec, bool kSubtractMean>
constexpr bool kForwardLoadsFirst = kSubtractMean && kVec > 1 && sizeof(T) >= 4;
// Threads of the block kernel (layer_norm_forward_kernel, below): 1024 except in two cases, which stop at 512.
// Rows not in 16-byte packs load value by value, and at 1024 threads ptxas caps a thread at 64 registers, so
// their addresses would spill. And LayerNorm's 4- and 8-byte kernels need more than 32 registers a thread
// (ptxas -v): two 1024-thread blocks would need more than an SM's 64 K registers, so one block would have the SM
// to itself, and while it sat in its two reductions nothing else on the SM would read memory
// (profiling/results/h100/level5-trailing-rows-ncu.md).
template <typename T, int kVec, bool kSubtractMean>
constexpr int kForwardThreads = kVec == 1 || (kSubtractMean && sizeof(T) >= 4) ? 512 : 1024;
// Row values per thread in registers, counted in 16-byte packs of the input: what matters is how many loads
// a thread keeps in flight and how many blocks share an SM while others wait in their two block reductions
// (barriers), not the number of values. Four packs (64 bytes: 16 floats, 32 halves) by default, so a
// 1024-thread block holds a 64 KB row and longer rows go to the cluster kernels of layer_norm_long_rows.cuh.
// Eight in LayerNorm's float32 kernel, so that its 512 threads hold 64 KB rows too (16384 floats): with its
// loads first, 8 packs a thread moved as much of copy bandwidth as 4 on rows of 2048-8192 floats (95.0 / 94.2
// / 93.3 % against 95.0 / 94.1 / 93.4), and rows of 16384, which the cluster kernel read at 78.4 %, run at 96 %
// in registers (61 registers a thread, still two blocks an SM), 1.17x torch.compile, on an H200
// (profiling/results/h200/norm-forward-probes.md). Loaded in turn, 8 packs had lost (77.3 % at 8192).
// float64 keeps 4: at 8 its kernel takes 66 registers, one block an SM (not measured).
template <typename T, int kVec, bool kSubtractMean>
constexpr int kForwardValues =
    (kForwardLoadsFirst<T, kVec, kSubtractMean> && sizeof(T) == 4 ? 128 : 64) / static_cast<int>(sizeof(T));

// --- forward -------------------------------------------------------------------------------------

// Short rows (up to 32 values a lane x 32 lanes): a group of kLanes lanes per row (softmax.cu's layout),
// so 128-value rows keep every lane of a warp busy (8 rows a warp) where a block per row idled most of
// its threads. The row stays in registers for LayerNorm's two exact passes (mean, then the squares of
// the centred values), each reduced with kLanes-wide shuffles: no shared memory, no barrier.
template <typename T, int kVec, int kLanes, bool kSubtractMean>
__global__ void __launch_bounds__(kWarpsPerBlock * kWarpSize)
layer_norm_forward_warp_kernel(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
                               T* __restrict__ y, Acc<T>* __restrict__ mean_out, Acc<T>* __restrict__ rstd_out,
                               int64_t rows, int64_t n, Acc<T> eps) {
  using A = Acc<T>;
  constexpr int kPacks = kLaneRowValues<A> / kVec;
  const LaneGroupRow<kLanes> place;
  if (place.first_row_of_warp >= rows) return;
  const int64_t row = place.row;
  const bool row_exists = row < rows;
  const int lane = place.lane;
  const int n_packs = static_cast<int>(n / kVec);
  A values[kPacks][kVec];
  A sum = 0;
  load_row_packs<T, kVec, kPacks>(values, read_once_from<T, kVec>(x + row * n), lane, kLanes, n_packs, row_exists,
                                  A(0), [&](A value) { sum += value; });
  A mean = 0;  // RMSNorm's: no reduction for it
  if constexpr (kSubtractMean) mean = warp_reduce<kLanes>(sum, Add{}) / A(n);
  A squares = 0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const bool inside = row_exists && lane + k * kLanes < n_packs;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const A centred = inside ? values[k][j] - mean : A(0);
      squares += centred * centred;
    }
  }
  const A rstd = rsqrt(warp_reduce<kLanes>(squares, Add{}) / A(n) + eps);
  if (!row_exists) return;
  if (lane == 0) {
    if constexpr (kSubtractMean) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
  // From this lane's first column, its k-th pack is at a compile-time offset: one address per array
  // rather than one per pack, which on scalar rows (32 packs a lane) made ptxas spill.
  const int64_t first_column = int64_t{lane} * kVec;
  T* y_lane = y + row * n + first_column;
  const T* weight_lane = weight + first_column;
  const T* bias_lane = kSubtractMean ? bias + first_column : bias;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    if (lane + k * kLanes < n_packs) {
      write_normalized_pack<T, kVec, kSubtractMean>(y_lane, weight_lane, bias_lane, k * kLanes, values[k], mean, rstd);
    }
  }
}

// The second half of a block's work on a row it holds in registers, `values` (packs threadIdx.x,
// + blockDim.x, ...; `sum` their sum): mean, then the variance of the centred values from registers (as
// exact as two passes, for the price of one read), the row's statistics, y.
template <typename T, int kVec, int kPacks, bool kSubtractMean>
__device__ __forceinline__ void normalize_held_row(const Acc<T> (&values)[kPacks][kVec], Acc<T> sum, int64_t row,
                                                   int64_t n, int n_packs, const T* __restrict__ weight,
                                                   const T* __restrict__ bias, T* __restrict__ y,
                                                   Acc<T>* __restrict__ mean_out, Acc<T>* __restrict__ rstd_out,
                                                   Acc<T> eps) {
  using A = Acc<T>;
  // (RMSNorm: mean 0, and no block reduction for it; its sum is dead code the compiler drops.)
  A mean = 0;
  if constexpr (kSubtractMean) mean = block_sum(sum) / A(n);
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
    if constexpr (kSubtractMean) mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = threadIdx.x + k * blockDim.x;
    if (pack < n_packs) write_normalized_pack<T, kVec, kSubtractMean>(y + row * n, weight, bias, pack, values[k], mean, rstd);
  }
}

// Rows of up to kForwardThreads x kForwardValues (64 KB or 32 KB): one block per row, the row in registers.
template <typename T, int kVec, bool kSubtractMean>
__global__ void __launch_bounds__(kForwardThreads<T, kVec, kSubtractMean>)
layer_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
                          T* __restrict__ y, Acc<T>* __restrict__ mean_out, Acc<T>* __restrict__ rstd_out,
                          int64_t n, Acc<T> eps) {
  using A = Acc<T>;
  constexpr int kPacks = kForwardValues<T, kVec, kSubtractMean> / kVec;
  const int64_t row = blockIdx.x;
  const int n_packs = static_cast<int>(n / kVec);  // a row held in registers has at most 16384 values
  // Thread t owns packs t, t + blockDim.x, ...: at each step a warp reads 32 adjacent packs (coalesced).
  // Indices into `values` are compile-time constants after unrolling, so the array stays in registers.
  A values[kPacks][kVec];
  A sum = 0;
  load_row_packs<T, kVec, kPacks, kForwardLoadsFirst<T, kVec, kSubtractMean>>(
      values, read_once_from<T, kVec>(x + row * n), threadIdx.x, blockDim.x, n_packs, true, A(0),
      [&](A value) { sum += value; });
  normalize_held_row<T, kVec, kPacks, kSubtractMean>(values, sum, row, n, n_packs, weight, bias, y, mean_out, rstd_out,
                                                     eps);
}

// Rows of 16384-32768 values in 16-byte packs of 2- or 4-byte types, at least two for every block: a persistent
// grid of one 1024-thread block an SM, each walking rows blockIdx.x, + gridDim.x, ... with the row it works on in
// registers (32 values a thread) while its next row is already on its way into shared memory (cp.async, which
// holds no registers while the bytes fly). A block that held one row and nothing else, as the block kernel above
// does, left its SM's share of HBM bandwidth idle from its last load to its first store, while it sat in its two
// block reductions: one 1024-thread block is all an SM holds of such rows (its 64-register cap), so no other block
// read meanwhile. Measured on an H200 at 2048 rows of 32768 (profiling/results/h200/norm-forward-probes.md):
// 89.7-90.0 % of copy bandwidth in float32 (a cluster of two blocks: 76.8 %), 89.4-90.1 % in bfloat16 (the block
// kernel: 77.7 %); at rows of 16384 the kernels that hold one row a block were faster (two or more blocks an SM
// take turns there). Longer rows are not split over this grid: a row's blocks would have to meet before any of them
// writes, and while an SM's one to four such blocks wait for the others, nothing on it loads but the prefetch already
// in flight. layer_norm_long_rows.cuh's kernels (64 KB slices staged in shared memory, three blocks an SM; two passes
// for the longest float32 rows) won 14 of 16 sweep points against three ways of meeting
// (profiling/results/h200/norm-forward-probes.md, last section).
constexpr int kPrefetchThreads = 1024;
constexpr int kPrefetchValues = 32;  // a thread's share of the row in registers: at most 64 registers
constexpr int64_t kPrefetchMinRowValues = 16384;
template <typename T, int kVec>
constexpr bool kPrefetchable = kVec > 1 && (sizeof(T) == 2 || sizeof(T) == 4);

template <typename T, int kVec, bool kSubtractMean>
__global__ void __launch_bounds__(kPrefetchThreads)
layer_norm_forward_prefetch_kernel(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
                                   T* __restrict__ y, Acc<T>* __restrict__ mean_out, Acc<T>* __restrict__ rstd_out,
                                   int64_t rows, int64_t n, Acc<T> eps) {
  using A = Acc<T>;
  using P = Pack<T, kVec>;
  constexpr int kPacks = kPrefetchValues / kVec;
  extern __shared__ __align__(16) unsigned char next_row_bytes[];
  P* next_row = reinterpret_cast<P*>(next_row_bytes);
  const int n_packs = static_cast<int>(n / kVec);
  const uint64_t read_once = evict_first_policy();
  // Each thread copies, and later reads back, only its own packs, so its own wait orders both: no barrier.
  const auto fetch = [&](int64_t row) {
    const P* source = reinterpret_cast<const P*>(x + row * n);
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int pack = threadIdx.x + k * kPrefetchThreads;
      if (pack < n_packs) copy_async_16_once(&next_row[pack], &source[pack], read_once);
    }
    copy_async_commit();
  };
  int64_t row = blockIdx.x;
  if (row < rows) fetch(row);
  for (; row < rows; row += gridDim.x) {
    copy_async_wait<0>();
    A values[kPacks][kVec];
    A sum = 0;
    // In turn: shared memory answers in a few dozen cycles, and a second copy of the row in registers beside
    // the first (loads first) made ptxas spill 92-212 bytes a thread at this kernel's 64-register cap.
    load_row_packs<T, kVec, kPacks, false>(values, [next_row](int pack) { return next_row[pack]; }, threadIdx.x,
                                           kPrefetchThreads, n_packs, true, A(0), [&](A value) { sum += value; });
    if (row + gridDim.x < rows) fetch(row + gridDim.x);  // in flight through this row's reductions and stores
    normalize_held_row<T, kVec, kPacks, kSubtractMean>(values, sum, row, n, n_packs, weight, bias, y, mean_out,
                                                       rstd_out, eps);
  }
}

// The prefetching kernel's grid for these rows, or 0 where it does not take them: one block an SM, every
// block with a second row to fetch, and the row within the shared memory a block may ask for on this GPU.
template <typename T, int kVec, bool kSubtractMean>
int prefetch_grid(int64_t rows, int64_t n) {
  if (n <= kPrefetchMinRowValues || n > int64_t{kPrefetchThreads} * kPrefetchValues) return 0;
  const int multiprocessors = multiprocessor_count();
  if (rows < 2 * int64_t{multiprocessors}) return 0;
  const int64_t shared_limit = dynamic_shared_bytes_limit(layer_norm_forward_prefetch_kernel<T, kVec, kSubtractMean>);
  return n * static_cast<int64_t>(sizeof(T)) <= shared_limit ? multiprocessors : 0;
}

// --- launchers -----------------------------------------------------------------------------------
// LayerNorm's launcher and RMSNorm's are one template; RMSNorm passes null for the mean and the bias,
// which its kernels never touch. By row length: a few lanes, a block's registers, a persistent grid
// prefetching rows of 16384-32768 values, then the long-row kernels of layer_norm_long_rows.cuh (a cluster,
// a split or a looped block per row).

int64_t layer_norm_forward_splits(DType dtype, int64_t rows, int64_t n) {
  int64_t splits = 1;
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    // What one block (in registers, LayerNorm's bound: 64 KB in 16-byte packs, 32 KB in float64, where
    // RMSNorm's holds 64 KB) or one cluster (16 blocks' shared memory) reads once. The launcher honours a
    // split even where RMSNorm's block could hold the row.
    constexpr int kVec = kVecOf<T>;
    const int64_t in_registers = int64_t{kForwardThreads<T, kVec, true>} * kForwardValues<T, kVec, true> *
                                 static_cast<int64_t>(sizeof(T));
    const int64_t row_bytes = n * static_cast<int64_t>(sizeof(T));
    const bool clusters = norm_clusters_available<T>();
    // Rows longer than a cluster of kClusterRowBlocks holds (or than a block's registers, without
    // clusters) are read once by a cooperative grid where its plan applies; the launcher makes the same
    // plan (LayerNorm's and RMSNorm's kernels are alike in registers and shared memory).
    if (row_bytes > (clusters ? kClusterRowBlocks * kSharedRowBytes : in_registers)) {
      const CooperativePlan plan = cooperative_forward_plan<T, true>(rows, n);
      if (plan.splits > 1) {
        splits = plan.splits;
        return;
      }
    }
    const int64_t held_on_chip = clusters ? kMaxClusterBlocks * kSharedRowBytes : in_registers;
    splits = row_splits(rows, row_bytes, held_on_chip);
  });
  return splits;
}

template <bool kSubtractMean>
void launch_forward(DType dtype, const void* x, const void* weight, const void* bias, void* y, void* mean, void* rstd,
                    int64_t rows, int64_t n, double eps, int64_t splits, void* partials, void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    using A = Acc<T>;
    const auto s = static_cast<cudaStream_t>(stream);
    const T* in = static_cast<const T*>(x);
    const T* w = static_cast<const T*>(weight);
    const T* b = static_cast<const T*>(bias);
    T* out = static_cast<T*>(y);
    A* means = static_cast<A*>(mean);
    A* rstds = static_cast<A*>(rstd);
    const bool vectorise = n % kVecOf<T> == 0 && aligned_16(x) && aligned_16(weight) &&
                           (!kSubtractMean || aligned_16(bias)) && aligned_16(y);
    dispatch_vector_width<T>(vectorise, [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      constexpr int kValues = kForwardValues<T, kVec, kSubtractMean>;
      if constexpr (kPrefetchable<T, kVec>) {
        if (const int blocks = splits == 1 ? prefetch_grid<T, kVec, kSubtractMean>(rows, n) : 0; blocks > 0) {
          const auto kernel = layer_norm_forward_prefetch_kernel<T, kVec, kSubtractMean>;
          const int shared_bytes = static_cast<int>(n * static_cast<int64_t>(sizeof(T)));
          cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
          kernel<<<blocks, kPrefetchThreads, shared_bytes, s>>>(in, w, b, out, means, rstds, rows, n, static_cast<A>(eps));
          return;
        }
      }
      if (splits > 1 || n > int64_t{kForwardThreads<T, kVec, kSubtractMean>} * kValues) {
        launch_norm_forward_long_rows<T, kSubtractMean>(in, w, b, out, means, rstds, rows, n, static_cast<A>(eps),
                                                        splits, partials, vectorise, s);
      } else if (n <= kWarpSize * kLaneRowValues<A>) {
        dispatch_lanes_per_row<A>(n, [&](auto lanes) {
          constexpr int kLanes = decltype(lanes)::value;
          layer_norm_forward_warp_kernel<T, kVec, kLanes, kSubtractMean>
              <<<LaneGroupRow<kLanes>::blocks(rows), kWarpsPerBlock * kWarpSize, 0, s>>>(
                  in, w, b, out, means, rstds, rows, n, static_cast<A>(eps));
        });
      } else {
        // One block per row: a row's reductions never leave its block.
        layer_norm_forward_kernel<T, kVec, kSubtractMean>
            <<<static_cast<unsigned>(rows), row_threads(n, kValues), 0, s>>>(in, w, b, out, means, rstds, n,
                                                                                        static_cast<A>(eps));
      }
    });
  });
}

void launch_layer_norm_forward(DType dtype, const void* x, const void* weight, const void* bias, void* y,
                               void* mean, void* rstd, int64_t rows, int64_t n, double eps, int64_t splits,
                               void* partials, void* stream) {
  launch_forward<true>(dtype, x, weight, bias, y, mean, rstd, rows, n, eps, splits, partials, stream);
}

void launch_rms_norm_forward(DType dtype, const void* x, const void* weight, void* y, void* rstd, int64_t rows,
                             int64_t n, double eps, int64_t splits, void* partials, void* stream) {
  launch_forward<false>(dtype, x, weight, nullptr, y, nullptr, rstd, rows, n, eps, splits, partials, stream);
}

}  // namespace kernel_ladder
