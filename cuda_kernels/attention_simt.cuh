// Flash attention for float32 and float64 on the GPU's FMA units (SIMT), forward and backward; the
// float16/bfloat16 kernels on tensor cores are in attention_forward.cu and attention_backward.cu, whose
// launchers call these for the two IEEE types.
//
// Why not the tensor cores: their float32 mode (TF32) keeps 10 mantissa bits, too few for float32's
// 2e-5 tolerance. So these kernels run the same flash algorithm (tiles, online softmax, the saved lse,
// recomputation in the backward, loop bounds from attention_mask.h) with plain multiply-adds.
//
// Kernels
//   attention_forward_simt_kernel          a group of threads per query row: q and the running output
//                                          in registers; K, V tiles of 16 keys (8 past tile width 128)
//                                          in shared memory
//   attention_backward_dq_simt_kernel      per query rows, streaming the keys they see
//   attention_backward_dk_dv_simt_kernel   per key rows, streaming the queries that see them
//   Two backward passes that each write only their own outputs: no atomics, deterministic, as the C++
//   CPU twin (attention_cpu.cpp). With grouped-query attention the dk/dv pass of a kv head walks the
//   queries of every query head of its group in turn.
//
// Limits
//   head_dim a multiple of 8 up to 256, on the tile widths of attention_forward.cu (rows zero-filled past
//   head_dim in registers and shared memory, stored only up to it); as attention_forward.cu otherwise. A
//   lesson in the algorithm, not a rival to tuned kernels: forward at (1, 16, 2048, 64) float32 causal takes
//   0.98 ms on an H100, PyTorch's SDPA 0.43 ms.
#pragma once

#include "attention_mask.h"
#include "common.cuh"

namespace kernel_ladder {

// Each row (of q in the forward and dq kernels, of k and v in the dk/dv kernel) belongs to
// kThreadsPerRow adjacent lanes; lane `part` of the group owns head-dim columns part,
// part + kThreadsPerRow, ... (kColumns of them). A group then reads a row of a shared tile in one
// conflict-free sweep of consecutive addresses, and the groups of a warp read the same addresses,
// which shared memory serves as a broadcast. Rows of other tiles stream through shared memory in
// steps of kTileRows.
template <int kD>
struct SimtRows {
  // kD / 16 rounded up to a power of two (the shuffles of row_group_sum need one): 1, 2, 4, 8, 8, 16, 16
  // threads for tile widths 16, 32, 64, 96, 128, 192, 256, so that a thread holds at most 16 columns.
  static constexpr int kThreadsPerRow = kD <= 16 ? 1 : kD <= 32 ? 2 : kD <= 64 ? 4 : kD <= 128 ? 8 : 16;
  static constexpr int kColumns = kD / kThreadsPerRow;  // 16, or 12 at 96 and 192
  static constexpr int kThreads = 128;
  static constexpr int kRowsPerBlock = kThreads / kThreadsPerRow;
  // Rows of the other side per shared tile: two tiles of 16 x 128 doubles are 32 KB, of the 48 KB of
  // static shared memory a block may have; past 128 columns a tile takes 8 rows, to stay there.
  static constexpr int kTileRows = kD <= 128 ? 16 : 8;
};

// Sum over the kGroup adjacent lanes that share a row (kGroup a power of two, at most 32).
template <int kGroup, typename A>
__device__ __forceinline__ A row_group_sum(A value) {
#pragma unroll
  for (int mask = kGroup / 2; mask > 0; mask /= 2) value += shuffle_xor(value, mask);
  return value;
}

// The matrices below are (rows, d) with rows row_stride elements apart: d for the contiguous gradients,
// more for q, k, v, out and grad_out, which are read and written where they lie (kernels.h, HeadStrides).
// Each kernel finds its heads' first rows once (of_head's 64-bit divisions are long instruction
// sequences on the GPU) and steps from row to row by the row stride.

// This thread's columns of row `row` of a matrix, in the accumulator type; zeros past `rows` and in the
// tile's columns past d.
template <int kD, typename T>
__device__ __forceinline__ void load_row_part(Acc<T> (&values)[SimtRows<kD>::kColumns], const T* matrix,
                                              int64_t row_stride, int64_t row, int64_t rows, int d, int part) {
#pragma unroll
  for (int c = 0; c < SimtRows<kD>::kColumns; ++c) {
    const int column = part + c * SimtRows<kD>::kThreadsPerRow;
    values[c] = row < rows && column < d ? to_acc(matrix[row * row_stride + column]) : Acc<T>(0);
  }
}

// values * scale into this thread's columns of row `row` of a matrix, up to column d.
template <int kD, typename T>
__device__ __forceinline__ void store_row_part(T* matrix, int64_t row_stride, int64_t row,
                                               const Acc<T> (&values)[SimtRows<kD>::kColumns], Acc<T> scale, int d,
                                               int part) {
#pragma unroll
  for (int c = 0; c < SimtRows<kD>::kColumns; ++c) {
    const int column = part + c * SimtRows<kD>::kThreadsPerRow;
    if (column < d) matrix[row * row_stride + column] = from_acc<T>(values[c] * scale);
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

// Rows [row0, row0 + kTileRows) of a matrix into a shared tile kD wide, in the accumulator type, zeros
// past `rows` and past column d; the whole block takes part (coalesced: consecutive threads,
// consecutive elements of a row).
template <int kD, typename T>
__device__ __forceinline__ void load_simt_tile(Acc<T>* tile, const T* matrix, int64_t row_stride, int64_t row0,
                                               int64_t rows, int d) {
  for (int e = static_cast<int>(threadIdx.x); e < SimtRows<kD>::kTileRows * kD; e += static_cast<int>(blockDim.x)) {
    const int row = e / kD, column = e % kD;
    tile[e] = row0 + row < rows && column < d ? to_acc(matrix[(row0 + row) * row_stride + column]) : Acc<T>(0);
  }
}

// --- forward ------------------------------------------------------------------------------------

// float32 / float64: one query row per group of SimtRows<kD>::kThreadsPerRow threads, its q and
// running output in registers; K and V tiles of kTileRows keys in shared memory.
template <typename T, int kD>
__global__ void __launch_bounds__(SimtRows<kD>::kThreads)
attention_forward_simt_kernel(AttentionShape shape, const T* __restrict__ q, const T* __restrict__ k,
                              const T* __restrict__ v, T* __restrict__ out, T* __restrict__ lse) {
  using A = Acc<T>;
  using Rows = SimtRows<kD>;
  __shared__ A k_tile[Rows::kTileRows * kD], v_tile[Rows::kTileRows * kD];
  const VisibleKeys visible(shape);
  const int64_t lq = shape.query_length, lk = shape.key_length, query_tiles = ceil_div(lq, Rows::kRowsPerBlock);
  const int64_t bh = blockIdx.x / query_tiles;  // as in the tensor-core kernel: last query tiles first
  const int64_t i0 = (query_tiles - 1 - blockIdx.x % query_tiles) * Rows::kRowsPerBlock;
  const int64_t i1 = min(i0 + Rows::kRowsPerBlock, lq);
  const int64_t i = i0 + threadIdx.x / Rows::kThreadsPerRow;
  const int part = static_cast<int>(threadIdx.x) % Rows::kThreadsPerRow, d = static_cast<int>(shape.head_dim);
  const int64_t kv = bh / shape.group;  // the kv head of this query head's group (of heads / group a batch)
  q += shape.q.of_head(bh, shape.heads);
  k += shape.k.of_head(kv, shape.heads / shape.group);
  v += shape.v.of_head(kv, shape.heads / shape.group);

  A q_row[Rows::kColumns], o[Rows::kColumns] = {};
  load_row_part<kD>(q_row, q, shape.q.row, i, lq, d, part);
  A row_max = -INFINITY, row_sum = 0;
  const A scale = static_cast<A>(shape.scale);
  for (int64_t key0 = visible.first_key(i0); key0 < visible.end_key(i1 - 1); key0 += Rows::kTileRows) {
    __syncthreads();  // the previous tile is no longer read
    load_simt_tile<kD>(k_tile, k, shape.k.row, key0, lk, d);
    load_simt_tile<kD>(v_tile, v, shape.v.row, key0, lk, d);
    __syncthreads();
    A s[Rows::kTileRows];
    A tile_max = row_max;
#pragma unroll
    for (int j = 0; j < Rows::kTileRows; ++j) {
      s[j] = row_group_sum<Rows::kThreadsPerRow>(dot_row_part<kD>(q_row, k_tile, j, part)) * scale;
      if (!visible.sees(i, key0 + j)) s[j] = -INFINITY;
      tile_max = fmax(tile_max, s[j]);
    }
    if (tile_max == A(-INFINITY)) continue;  // no key of this row yet
    const A rescale = exp_acc(row_max - tile_max);
    row_sum *= rescale;
#pragma unroll
    for (int c = 0; c < Rows::kColumns; ++c) o[c] *= rescale;
#pragma unroll
    for (int j = 0; j < Rows::kTileRows; ++j) {
      const A p = exp_acc(s[j] - tile_max);
      row_sum += p;
      add_row_part<kD>(o, p, v_tile, j, part);
    }
    row_max = tile_max;
  }
  if (i < lq) {
    store_row_part<kD>(out + shape.out.of_head(bh, shape.heads), shape.out.row, i, o, A(1) / row_sum, d, part);
    if (part == 0) lse[bh * lq + i] = row_max + log(row_sum);
  }
}

// --- backward -----------------------------------------------------------------------------------

// dq for one query row per thread group (its q, dout, dq in registers), streaming the visible keys.
template <typename T, int kD>
__global__ void __launch_bounds__(SimtRows<kD>::kThreads)
attention_backward_dq_simt_kernel(AttentionShape shape, const T* __restrict__ grad_out, const T* __restrict__ q,
                                  const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ lse,
                                  const T* __restrict__ delta, T* __restrict__ grad_q) {
  using Rows = SimtRows<kD>;
  __shared__ T k_tile[Rows::kTileRows * kD], v_tile[Rows::kTileRows * kD];
  const VisibleKeys visible(shape);
  const int64_t lq = shape.query_length, lk = shape.key_length, query_tiles = ceil_div(lq, Rows::kRowsPerBlock);
  const int64_t bh = blockIdx.x / query_tiles;  // last query tiles (most keys when causal) first
  const int64_t i0 = (query_tiles - 1 - blockIdx.x % query_tiles) * Rows::kRowsPerBlock;
  const int64_t i1 = min(i0 + Rows::kRowsPerBlock, lq);
  const int64_t i = i0 + threadIdx.x / Rows::kThreadsPerRow;
  const int part = static_cast<int>(threadIdx.x) % Rows::kThreadsPerRow, d = static_cast<int>(shape.head_dim);
  const int64_t row = bh * lq + i;  // of lse and delta, which are contiguous
  const int64_t kv = bh / shape.group;  // the kv head of this query head's group (of heads / group a batch)
  k += shape.k.of_head(kv, shape.heads / shape.group);
  v += shape.v.of_head(kv, shape.heads / shape.group);

  T q_row[Rows::kColumns], dout_row[Rows::kColumns], dq[Rows::kColumns] = {};
  load_row_part<kD>(q_row, q + shape.q.of_head(bh, shape.heads), shape.q.row, i, lq, d, part);
  load_row_part<kD>(dout_row, grad_out + shape.grad_out.of_head(bh, shape.heads), shape.grad_out.row, i, lq, d, part);
  const T row_lse = i < lq ? lse[row] : T(0), row_delta = i < lq ? delta[row] : T(0);
  const T scale = static_cast<T>(shape.scale);
  for (int64_t key0 = visible.first_key(i0); key0 < visible.end_key(i1 - 1); key0 += Rows::kTileRows) {
    __syncthreads();  // the previous tile is no longer read
    load_simt_tile<kD>(k_tile, k, shape.k.row, key0, lk, d);
    load_simt_tile<kD>(v_tile, v, shape.v.row, key0, lk, d);
    __syncthreads();
#pragma unroll
    for (int j = 0; j < Rows::kTileRows; ++j) {
      const T s = row_group_sum<Rows::kThreadsPerRow>(dot_row_part<kD>(q_row, k_tile, j, part)) * scale;
      const T dp = row_group_sum<Rows::kThreadsPerRow>(dot_row_part<kD>(dout_row, v_tile, j, part));
      const T p = visible.sees(i, key0 + j) ? exp_acc(s - row_lse) : T(0);
      add_row_part<kD>(dq, p * (dp - row_delta), k_tile, j, part);
    }
  }
  if (i < lq) {
    store_row_part<kD>(grad_q + shape.grad_q.of_head(bh, shape.heads), shape.grad_q.row, i, dq, scale, d, part);
  }
}

// dk and dv for one key row per thread group (its k, v, dk, dv in registers), streaming the queries
// that see it: those of every query head of its kv head's group, one head after the other.
template <typename T, int kD>
__global__ void __launch_bounds__(SimtRows<kD>::kThreads)
attention_backward_dk_dv_simt_kernel(AttentionShape shape, const T* __restrict__ grad_out, const T* __restrict__ q,
                                     const T* __restrict__ k, const T* __restrict__ v, const T* __restrict__ lse,
                                     const T* __restrict__ delta, T* __restrict__ grad_k, T* __restrict__ grad_v) {
  using Rows = SimtRows<kD>;
  __shared__ T q_tile[Rows::kTileRows * kD], dout_tile[Rows::kTileRows * kD];
  __shared__ T lse_tile[Rows::kTileRows], delta_tile[Rows::kTileRows];
  const VisibleKeys visible(shape);
  const int64_t lq = shape.query_length, lk = shape.key_length, key_tiles = ceil_div(lk, Rows::kRowsPerBlock);
  const int64_t kv = blockIdx.x / key_tiles;  // first key tiles (seen by most queries when causal) first
  const int64_t j0 = blockIdx.x % key_tiles * Rows::kRowsPerBlock, j1 = min(j0 + Rows::kRowsPerBlock, lk);
  const int64_t j = j0 + threadIdx.x / Rows::kThreadsPerRow;
  const int part = static_cast<int>(threadIdx.x) % Rows::kThreadsPerRow, d = static_cast<int>(shape.head_dim);

  T k_row[Rows::kColumns], v_row[Rows::kColumns], dk[Rows::kColumns] = {}, dv[Rows::kColumns] = {};
  // kv counts the kv heads of all batches, heads / group of them a batch.
  load_row_part<kD>(k_row, k + shape.k.of_head(kv, shape.heads / shape.group), shape.k.row, j, lk, d, part);
  load_row_part<kD>(v_row, v + shape.v.of_head(kv, shape.heads / shape.group), shape.v.row, j, lk, d, part);
  const T scale = static_cast<T>(shape.scale);
  // The group's query heads kv * group .. + group are consecutive heads of one batch (heads is a multiple
  // of group), so their rows start shape.q.head (grad_out.head) elements apart: the pointers step from
  // head to head, with no 64-bit division for each.
  const T* q_head = q + shape.q.of_head(kv * shape.group, shape.heads);
  const T* dout_head = grad_out + shape.grad_out.of_head(kv * shape.group, shape.heads);
  for (int64_t bh = kv * shape.group; bh < (kv + 1) * shape.group;
       ++bh, q_head += shape.q.head, dout_head += shape.grad_out.head) {
    for (int64_t query0 = visible.first_query(j0); query0 < visible.end_query(j1 - 1); query0 += Rows::kTileRows) {
      __syncthreads();  // the previous tile is no longer read
      load_simt_tile<kD>(q_tile, q_head, shape.q.row, query0, lq, d);
      load_simt_tile<kD>(dout_tile, dout_head, shape.grad_out.row, query0, lq, d);
      if (threadIdx.x < Rows::kTileRows) {
        const bool valid = query0 + threadIdx.x < lq;
        lse_tile[threadIdx.x] = valid ? lse[bh * lq + query0 + threadIdx.x] : T(0);
        delta_tile[threadIdx.x] = valid ? delta[bh * lq + query0 + threadIdx.x] : T(0);
      }
      __syncthreads();
#pragma unroll
      for (int r = 0; r < Rows::kTileRows; ++r) {
        const T s = row_group_sum<Rows::kThreadsPerRow>(dot_row_part<kD>(k_row, q_tile, r, part)) * scale;
        const T dp = row_group_sum<Rows::kThreadsPerRow>(dot_row_part<kD>(v_row, dout_tile, r, part));
        const T p = visible.sees(query0 + r, j) ? exp_acc(s - lse_tile[r]) : T(0);
        add_row_part<kD>(dv, p, dout_tile, r, part);
        add_row_part<kD>(dk, p * (dp - delta_tile[r]), q_tile, r, part);
      }
    }
  }
  if (j < lk) {
    // Found again here rather than kept from the loads above: held through the loop, it made the float64
    // kernel at tile width 256 spill on sm_80.
    const int64_t kv_heads = shape.heads / shape.group;
    store_row_part<kD>(grad_k + shape.grad_k.of_head(kv, kv_heads), shape.grad_k.row, j, dk, scale, d, part);
    store_row_part<kD>(grad_v + shape.grad_v.of_head(kv, kv_heads), shape.grad_v.row, j, dv, T(1), d, part);
  }
}

}  // namespace kernel_ladder
