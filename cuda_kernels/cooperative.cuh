// A row split over the blocks of a cooperative grid: what the long-row kernels of softmax.cu,
// layer_norm_long_rows.cuh and layer_norm_backward.cu share. Pure CUDA, as common.cuh.
//
// A cooperative launch starts every block of its grid at once or fails with an error, so its blocks
// may wait for each other: a block that waits cannot keep another from ever starting. That is what
// lets the blocks of one row agree on its statistics while each still holds its slice on chip, so the
// row crosses DRAM once where two passes read it twice.
#pragma once

#include "common.cuh"

namespace kernel_ladder {

// Block-wide arrival at a row's counter (zeroed before the launch): thread 0 counts the block in once
// its partial result is stored, then spins until `expected` blocks have arrived; every thread leaves
// after it. __threadfence orders this thread's stores before the arrival, the acquire loads order
// the other blocks' stores before whatever this block reads next (with __ldcg, from L2: the partials
// of a neighbouring row share a cache line, which L1 may hold from before they were written).
__device__ __forceinline__ void arrive_and_wait(unsigned* counter, unsigned expected) {
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(counter, 1u);
    unsigned arrived;
    do {
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];\n" : "=r"(arrived) : "l"(counter) : "memory");
    } while (arrived < expected);
  }
  __syncthreads();
}

// Where block blockIdx.x of a cooperative grid sits: it owns slice `piece` (slice_packs packs of kVec
// values from first_column; n_packs of them inside the row) of rows first_row, first_row + row_step, ...
struct CooperativeSlice {
  int piece, n_packs, first_row, row_step;  // a grid has fewer than 2^31 blocks
  int64_t first_column;
};

template <int kVec>
__device__ __forceinline__ CooperativeSlice cooperative_slice(int64_t n, int splits, int64_t slice_packs) {
  const int piece = static_cast<int>(blockIdx.x % splits);
  return {piece, static_cast<int>(min(slice_packs, n / kVec - piece * slice_packs)),
          static_cast<int>(blockIdx.x / splits), static_cast<int>(gridDim.x / splits), piece * slice_packs * kVec};
}

// The merge of one row's `splits` partial results (Moments, (max, sum) pairs, row sums), which other
// blocks stored a moment ago: read from L2 a field at a time (__ldcg on words of the fields' size),
// combined in the same order in every block of the row, so that all of them get the same bits.
template <typename S, typename Combine>
__device__ __forceinline__ S merge_row_partials(const S* row_partials, int splits, Combine combine) {
  using Word = std::conditional_t<alignof(S) >= 8, unsigned long long, unsigned>;
  static_assert(sizeof(S) % sizeof(Word) == 0, "partials are structs of floats or of doubles");
  constexpr int kWords = static_cast<int>(sizeof(S) / sizeof(Word));
  S total{};
  for (int s = threadIdx.x; s < splits; s += blockDim.x) {
    Word words[kWords];
    const auto* stored = reinterpret_cast<const Word*>(row_partials + s);
#pragma unroll
    for (int i = 0; i < kWords; ++i) words[i] = __ldcg(stored + i);
    S partial;
    memcpy(&partial, words, sizeof(S));
    total = combine(total, partial);
  }
  return block_reduce(total, combine);
}

// How many blocks of `kernel` (with `threads` threads and shared_bytes of dynamic shared memory) the
// GPU holds at once: the largest cooperative grid it accepts. 0 when the query fails (error cleared).
// Asked once per device and shape. The kernel's dynamic shared-memory limit is raised to
// max_shared_bytes, the most any of its launches asks for, not to this shape's: a plan made later
// for a smaller shape must not lower the limit below what an earlier, remembered one launches with.
template <typename... Params>
int64_t resident_blocks(void (*kernel)(Params...), int threads, int shared_bytes, int max_shared_bytes) {
  return memoised_per_device(
      [&] {
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, max_shared_bytes);
        int per_multiprocessor = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_multiprocessor, kernel, threads, shared_bytes) !=
            cudaSuccess) {
          cudaGetLastError();
          return int64_t{0};
        }
        return int64_t{per_multiprocessor} * multiprocessor_count();
      },
      reinterpret_cast<const void*>(kernel), threads, shared_bytes);
}

// A cooperative grid's geometry for rows of n values of T: slices of up to slice_bytes, one block each,
// staged in shared memory (staged_arrays of them: x, or x and dy; packs_per_thread 16-byte packs a
// thread), and as many rows at once as the GPU holds blocks of `kernel` for. `splits` is 0 when it does not apply: rows not in 16-byte packs,
// or fewer than kCooperativeMinRowsAtOnce rows (or than all of them) at once.
struct CooperativePlan {
  int64_t splits = 0, slice_packs = 0, rows_at_once = 0;
  int threads = 0;
};

// With fewer rows at once every block waits on the same row or two, and the loads stop while they
// wait: on an H100 the two passes won there (LayerNorm over 16 float32 rows of 4,194,304: 61 % of copy
// bandwidth in two passes, 40 % cooperatively; at 3 rows at once each won about half the points).
constexpr int64_t kCooperativeMinRowsAtOnce = 3;
// Rows longer than this many 64 KB slices go to the cooperative grid rather than a cluster: all of a
// cluster's blocks must be resident in one GPC (up to 18 SMs) at once, and on an H100 clusters of 8 and
// 16 moved 76 and 54 % of copy bandwidth where the cooperative grid moved 83 and 68 %.
constexpr int kClusterRowBlocks = 4;

template <typename T, typename... Params>
CooperativePlan cooperative_plan(void (*kernel)(Params...), int64_t rows, int64_t n, int packs_per_thread,
                                 int64_t slice_bytes = kSharedRowBytes, int staged_arrays = 1) {
  constexpr int kVec = kVecOf<T>;
  if (n % kVec != 0) return {};
  const int64_t splits = ceil_div(n * static_cast<int64_t>(sizeof(T)), slice_bytes);
  const int64_t slice_packs = ceil_div(n / kVec, splits);
  const int threads = row_threads(slice_packs * kVec, packs_per_thread * kVec);
  const int shared_bytes = static_cast<int>(slice_packs * 16 * staged_arrays);
  const int max_shared_bytes = static_cast<int>(slice_bytes * staged_arrays);  // slice_packs * 16 <= slice_bytes
  const int64_t rows_at_once =
      std::min(rows, resident_blocks(kernel, threads, shared_bytes, max_shared_bytes) / splits);
  if (rows_at_once < std::min(rows, kCooperativeMinRowsAtOnce)) return {};
  return {splits, slice_packs, rows_at_once, threads};
}

// The counters arrive_and_wait counts on, one word per row: the ops allocate them just past the grid's
// rows x splits partial results (of type S), and each launch zeroes them on its stream first.
template <typename S>
unsigned* zeroed_row_counters(S* partials, int64_t rows, int64_t splits, cudaStream_t stream) {
  auto* counters = reinterpret_cast<unsigned*>(partials + rows * splits);
  cudaMemsetAsync(counters, 0, rows * sizeof(unsigned), stream);
  return counters;
}

// `blocks` blocks of `kernel`, launched cooperatively (all resident at once, or an error).
template <typename... Params, typename... Args>
void launch_cooperative(void (*kernel)(Params...), int64_t blocks, int threads, int shared_bytes, cudaStream_t stream,
                        Args... args) {
  cudaLaunchAttribute cooperative;
  cooperative.id = cudaLaunchAttributeCooperative;
  cooperative.val.cooperative = 1;
  const cudaLaunchConfig_t config = launch_config(&cooperative, blocks, threads, shared_bytes, stream);
  cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

}  // namespace kernel_ladder
