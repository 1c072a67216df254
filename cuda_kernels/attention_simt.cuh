// What the SIMT (float32 and float64) attention kernels share: how a block's threads split the rows
// of q, k, v, and the sum across the threads of one row. These kernels run the same flash algorithm
// as the tensor-core ones (tiles, online softmax, lse, recomputation), on ordinary FMA units: the
// tensor cores' float32 mode (TF32) keeps 10 mantissa bits, too few for float32's 2e-5 tolerance.
#pragma once

#include "common.cuh"

namespace kernel_ladder {

// Each row (of q in the forward and dq kernels, of k and v in the dk/dv kernel) belongs to
// kThreadsPerRow adjacent lanes; lane `part` of the group owns head-dim columns part,
// part + kThreadsPerRow, ... (kColumns of them). A group then reads a row of a shared tile in one
// conflict-free sweep of consecutive addresses, and the groups of a warp read the same addresses,
// which shared memory serves as a broadcast. Rows of other tiles stream through shared memory in
// steps of kSimtTileRows.
template <int kD>
struct SimtRows {
  static constexpr int kColumns = 16;
  static constexpr int kThreadsPerRow = kD / kColumns;  // 1, 2, 4, 8 for head dims 16 ... 128
  static constexpr int kThreads = 128;
  static constexpr int kRowsPerBlock = kThreads / kThreadsPerRow;
};
constexpr int kSimtTileRows = 16;

// Sum over the kGroup adjacent lanes that share a row (kGroup a power of two, at most 32).
template <int kGroup, typename A>
__device__ __forceinline__ A row_group_sum(A value) {
#pragma unroll
  for (int mask = kGroup / 2; mask > 0; mask /= 2) value += shuffle_xor(value, mask);
  return value;
}

// This thread's columns of row `row` of a (rows, kD) matrix, in the accumulator type; zeros past `rows`.
template <int kD, typename T>
__device__ __forceinline__ void load_row_part(Acc<T> (&values)[SimtRows<kD>::kColumns], const T* matrix, int64_t row,
                                              int64_t rows, int part) {
#pragma unroll
  for (int c = 0; c < SimtRows<kD>::kColumns; ++c) {
    values[c] = row < rows ? to_acc(matrix[row * kD + part + c * SimtRows<kD>::kThreadsPerRow]) : Acc<T>(0);
  }
}

template <int kD, typename T>
__device__ __forceinline__ void store_row_part(T* matrix, int64_t row, const Acc<T> (&values)[SimtRows<kD>::kColumns],
                                               Acc<T> scale, int part) {
#pragma unroll
  for (int c = 0; c < SimtRows<kD>::kColumns; ++c) {
    matrix[row * kD + part + c * SimtRows<kD>::kThreadsPerRow] = from_acc<T>(values[c] * scale);
  }
}

// Partial dot product of this thread's columns with row `row` of a shared tile (kD columns per row).
template <int kD, typename A>
__device__ __forceinline__ A dot_row_part(const A (&values)[SimtRows<kD>::kColumns], const A* tile, int row, int part) {
  A sum = 0;
#pragma unroll
  for (int c = 0; c < SimtRows<kD>::kColumns; ++c) sum += values[c] * tile[row * kD + part + c * SimtRows<kD>::kThreadsPerRow];
  return sum;
}

// values += weight * (this thread's columns of row `row` of a shared tile)
template <int kD, typename A>
__device__ __forceinline__ void add_row_part(A (&values)[SimtRows<kD>::kColumns], A weight, const A* tile, int row, int part) {
#pragma unroll
  for (int c = 0; c < SimtRows<kD>::kColumns; ++c) values[c] += weight * tile[row * kD + part + c * SimtRows<kD>::kThreadsPerRow];
}

// Rows [row0, row0 + kSimtTileRows) of a (rows, kD) matrix into a shared tile, in the accumulator
// type, zeros past `rows`; the whole block takes part (coalesced: consecutive threads, consecutive
// elements).
template <int kD, typename T>
__device__ __forceinline__ void load_simt_tile(Acc<T>* tile, const T* matrix, int64_t row0, int64_t rows) {
  for (int e = static_cast<int>(threadIdx.x); e < kSimtTileRows * kD; e += static_cast<int>(blockDim.x)) {
    tile[e] = row0 + e / kD < rows ? to_acc(matrix[row0 * kD + e]) : Acc<T>(0);
  }
}

}  // namespace kernel_ladder
