// The pieces both 16-bit attention backward kernels share (attention_backward.cu on mma.sync,
// attention_backward_hopper.cu on wgmma): delta = rowsum(dout * out) before the main kernel, the
// softmax's backward on a tile of S^T and dP^T held in mma.sync's accumulator layout (which wgmma's
// accumulators repeat warp by warp), the float32 dq atomics, and grad_q = scale * that float32 sum after
// it. The main kernels differ only in how they compute the five products.
#pragma once

#include "attention_mask.h"
#include "attention_simt.cuh"  // row_group_sum
#include "tensor_core.cuh"

namespace kernel_ladder {

// --- delta = rowsum(dout * out) ------------------------------------------------------------------

// delta's and grad_q's kernels take one row of head_dim values (a query's) per thread group: a row of
// d <= kD values is d / kVec 16-byte packs of T, read by a power of two of threads, up to 16 (each taking
// the rest).
template <typename T, int kD>
struct QueryRows {
  static constexpr int kPacks = kD / kVecOf<T>;
  static constexpr int kThreadsPerRow = kPacks >= 16 ? 16 : kPacks >= 8 ? 8 : kPacks >= 4 ? 4 : kPacks >= 2 ? 2 : 1;
  static constexpr int kThreads = 256;
  static constexpr int kRowsPerBlock = kThreads / kThreadsPerRow;
};

// delta[bh * query_length + i] = dot(row i of grad_out's head bh, row i of out's head bh), the rows
// read where they lie (shape.grad_out, shape.out: strides of 16-byte multiples, so the packs stay aligned).
template <typename T, int kD>
__global__ void __launch_bounds__(QueryRows<T, kD>::kThreads)
attention_backward_delta_kernel(AttentionShape shape, const T* __restrict__ grad_out, const T* __restrict__ out,
                                Acc<T>* __restrict__ delta) {
  using Rows = QueryRows<T, kD>;
  constexpr int kVec = kVecOf<T>;
  const int64_t lq = shape.query_length, rows = shape.batch_heads * lq;
  const int d = static_cast<int>(shape.head_dim);
  const int64_t row = int64_t{blockIdx.x} * Rows::kRowsPerBlock + threadIdx.x / Rows::kThreadsPerRow;
  const int part = static_cast<int>(threadIdx.x) % Rows::kThreadsPerRow;
  Acc<T> sum = 0;
  if (row < rows) {  // no early return: the whole warp takes part in the shuffles below
    // A block's rows may belong to several heads (the grid is one flat range of rows), so each thread
    // finds where its own row lies: two 64-bit divisions, once, before the row's packs.
    const int64_t bh = row / lq, i = row % lq;
    const T* dy_row = grad_out + shape.grad_out.of_head(bh, shape.heads) + i * shape.grad_out.row;
    const T* y_row = out + shape.out.of_head(bh, shape.heads) + i * shape.out.row;
#pragma unroll
    for (int pack = part; pack < d / kVec; pack += Rows::kThreadsPerRow) {
      const Pack<T, kVec> dy = load_pack<T, kVec>(dy_row + pack * kVec);
      const Pack<T, kVec> y = load_pack<T, kVec>(y_row + pack * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum += to_acc(dy.val[j]) * to_acc(y.val[j]);
    }
  }
  sum = row_group_sum<Rows::kThreadsPerRow>(sum);
  if (row < rows && part == 0) delta[row] = sum;
}

// --- the softmax backward and the dq sum ------------------------------------------------------------

// s (S^T) becomes P^T = 2^(s * scale_log2 - lse * log2 e) and dp (dP^T) becomes dS^T = P^T (dP^T -
// delta), for the thread's keys key0, key0 + 8 and queries query0 + 8n + 2 (lane % 4) + {0, 1}.
template <bool kMasked, int kQueryTile>
__device__ __forceinline__ void probabilities_and_score_grads(float (&s)[kQueryTile / 8][4],
                                                              float (&dp)[kQueryTile / 8][4], const float* lse_tile,
                                                              const float* delta_tile, float scale_log2,
                                                              const VisibleKeys& visible, int64_t key0,
                                                              int64_t query0) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
#pragma unroll
  for (int n = 0; n < kQueryTile / 8; ++n) {
    const int column = n * 8 + lane % 4 * 2;
    const float2 lse_pair = *reinterpret_cast<const float2*>(lse_tile + column);
    const float2 delta_pair = *reinterpret_cast<const float2*>(delta_tile + column);
#pragma unroll
    for (int i = 0; i < 4; ++i) {  // (key0, q), (key0, q + 1), (key0 + 8, q), (key0 + 8, q + 1)
      const int e = i % 2;
      float p = exp2_approx(s[n][i] * scale_log2 - (e ? lse_pair.y : lse_pair.x) * kLog2e);
      if (kMasked && !visible.sees(query0 + column + e, key0 + i / 2 * 8)) p = 0.0f;
      s[n][i] = p;
      dp[n][i] = p * (dp[n][i] - (e ? delta_pair.y : delta_pair.x));
    }
  }
}

// dq_accumulator rows [query0, query0 + 16) (rows of d) += c (16 x kCols, columns from `column0`),
// skipping rows past `rows` and the tile's columns past d (whole 8-column n-tiles: d is a multiple of 8).
// sm_90 adds a float2 in one atomic (red.global.add.v2.f32): half the atomic traffic.
template <int kCols>
__device__ __forceinline__ void add_to_dq(float* dq_accumulator, const float (&c)[kCols / 8][4], int64_t query0,
                                          int column0, int64_t rows, int d) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = query0 + lane / 4 + 8 * half;
    if (row >= rows) continue;
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
      if (column0 + n * 8 >= d) break;
      float* target = dq_accumulator + row * d + column0 + n * 8 + lane % 4 * 2;
#if __CUDA_ARCH__ >= 900
      atomicAdd(reinterpret_cast<float2*>(target), make_float2(c[n][2 * half], c[n][2 * half + 1]));
#else
      atomicAdd(target, c[n][2 * half]);
      atomicAdd(target + 1, c[n][2 * half + 1]);
#endif
    }
  }
}

// --- grad_q ------------------------------------------------------------------------------------

// grad_q = scale * dq_accumulator (contiguous, row bh * query_length + i), rounded to T and written
// where grad_q's rows lie (shape.grad_q: tokens first for the heads of a fused projection, so that
// unbind's backward stacks whole rows). The rows are delta's, found the same way; T is 16-bit, so a pack
// of 8 values is 16 bytes out and two 16-byte loads in.
template <typename T, int kD>
__global__ void __launch_bounds__(QueryRows<T, kD>::kThreads)
attention_backward_dq_kernel(AttentionShape shape, const float* __restrict__ dq_accumulator, T* __restrict__ grad_q) {
  using Rows = QueryRows<T, kD>;
  constexpr int kVec = kVecOf<T>;
  const int64_t lq = shape.query_length;
  const int d = static_cast<int>(shape.head_dim);
  const int64_t row = int64_t{blockIdx.x} * Rows::kRowsPerBlock + threadIdx.x / Rows::kThreadsPerRow;
  if (row >= shape.batch_heads * lq) return;
  const int64_t bh = row / lq, i = row % lq;
  const float* sums = dq_accumulator + row * d;
  T* grad_row = grad_q + shape.grad_q.of_head(bh, shape.heads) + i * shape.grad_q.row;
  const float scale = static_cast<float>(shape.scale);
#pragma unroll
  for (int pack = static_cast<int>(threadIdx.x) % Rows::kThreadsPerRow; pack < d / kVec;
       pack += Rows::kThreadsPerRow) {
    Pack<T, kVec> rounded;
#pragma unroll
    for (int quarter = 0; quarter < kVec / 4; ++quarter) {
      const Pack<float, 4> sum = load_pack_once<float, 4>(sums + pack * kVec + quarter * 4);
#pragma unroll
      for (int j = 0; j < 4; ++j) rounded.val[quarter * 4 + j] = from_acc<T>(sum.val[j] * scale);
    }
    store_pack<T, kVec>(grad_row + pack * kVec, rounded);
  }
}

// delta (batch_heads * query_length values, contiguous; row bh * query_length + i for query i of head bh)
// from grad_out and out laid out as shape.grad_out and shape.out say, head_dim <= kD.
template <typename T, int kD>
void launch_attention_backward_delta(const AttentionShape& shape, const T* grad_out, const T* out, Acc<T>* delta,
                                     cudaStream_t stream) {
  using Rows = QueryRows<T, kD>;
  const int64_t rows = shape.batch_heads * shape.query_length;
  attention_backward_delta_kernel<T, kD><<<static_cast<unsigned>(ceil_div(rows, Rows::kRowsPerBlock)), Rows::kThreads,
                                           0, stream>>>(shape, grad_out, out, delta);
}

// grad_q = scale * dq_accumulator, laid out as shape.grad_q says.
template <typename T, int kD>
void launch_attention_backward_dq(const AttentionShape& shape, const float* dq_accumulator, T* grad_q,
                                  cudaStream_t stream) {
  using Rows = QueryRows<T, kD>;
  const int64_t rows = shape.batch_heads * shape.query_length;
  attention_backward_dq_kernel<T, kD><<<static_cast<unsigned>(ceil_div(rows, Rows::kRowsPerBlock)), Rows::kThreads,
                                        0, stream>>>(shape, dq_accumulator, grad_q);
}

}  // namespace kernel_ladder
