// Flash attention in CUDA, backward: grad_q, grad_k, grad_v from grad_out, recomputing the scores.
//
// What it computes, per (batch, head), with S = q k^T * scale over the visible pairs
//   delta = rowsum(dout * out)                 one value per query (equals rowsum(P * dP))
//   P = exp(S - lse)                           recomputed from the forward's saved lse
//   dP = dout v^T,  dS = P * (dP - delta)      the softmax's backward, pair by pair
//   dv = P^T dout,  dk = dS^T q * scale,  dq = dS k * scale
//
// Kernels, in the order they run
//   attention_backward_delta_kernel            delta, one row per thread group, 16-byte loads
//   float16 / bfloat16 (tensor cores, FlashAttention-2's plan on mma.sync):
//     attention_backward_tensor_core_kernel    a CTA owns 16 keys per warp; its K and V tiles stay in
//                                              shared memory while tiles of 64 queries (q, dout, lse,
//                                              delta) stream past, double-buffered with cp.async.
//                                              Each warp recomputes its 16 x 64 tiles of S^T and dP^T
//                                              in registers, keeps dk and dv in registers for the
//                                              whole loop, and hands dS^T to the other warps through
//                                              shared memory for dq += dS k, which it adds to a
//                                              float32 buffer with atomics (vector red.add)
//     attention_backward_dq_kernel             grad_q = scale * that buffer, rounded to the dtype
//   float32 / float64: attention_backward_dq_simt_kernel and attention_backward_dk_dv_simt_kernel
//     (attention_simt.cuh), the same math in two deterministic passes
//
// The one idea that makes it fast
//   Recompute instead of store: P would be seq x seq; S costs one more q k^T on the tensor cores,
//   which are idle anyway while the exp unit and memory work. The key-major loop keeps the two
//   largest accumulators (dk, dv) in registers; only dq, which every key tile touches, goes through
//   atomics, once per (query tile, key tile) pair. Tiles no query sees are never visited.
//
// Measured (H100, (4, 16, 4096, 128) bfloat16, causal, CUDA-graph replays)
//   the tensor-core kernel 2.99 ms (230 TFLOP/s); forward + backward through autograd 4.26 ms against
//   3.61 ms for PyTorch SDPA's flash backend (0.85x its speed).
//
// Limits
//   As the forward (attention_forward.cu). The float16/bfloat16 path sums dq in a nondeterministic
//   order (atomics): results differ between runs by float32 rounding.
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -v -c cuda_kernels/attention_backward.cu -o /tmp/attention_backward.o
//   python -m pytest tests -k "attention and cuda"
#include "attention_mask.h"
#include "attention_simt.cuh"
#include "tensor_core.cuh"

namespace kernel_ladder {

// --- delta = rowsum(dout * out) ------------------------------------------------------------------

// A row of kD values is kD / kVec 16-byte packs, read by up to 16 threads (each summing the rest).
template <typename T, int kD>
struct DeltaRows {
  static constexpr int kPacks = kD / kVecOf<T>;
  static constexpr int kThreadsPerRow = kPacks < 16 ? kPacks : 16;
  static constexpr int kThreads = 256;
  static constexpr int kRowsPerBlock = kThreads / kThreadsPerRow;
};

template <typename T, int kD>
__global__ void __launch_bounds__(DeltaRows<T, kD>::kThreads)
attention_backward_delta_kernel(const T* __restrict__ grad_out, const T* __restrict__ out, Acc<T>* __restrict__ delta,
                                int64_t rows) {
  using Rows = DeltaRows<T, kD>;
  constexpr int kVec = kVecOf<T>;
  const int64_t row = int64_t{blockIdx.x} * Rows::kRowsPerBlock + threadIdx.x / Rows::kThreadsPerRow;
  const int part = static_cast<int>(threadIdx.x) % Rows::kThreadsPerRow;
  Acc<T> sum = 0;
  if (row < rows) {  // no early return: the whole warp takes part in the shuffles below
#pragma unroll
    for (int pack = part; pack < Rows::kPacks; pack += Rows::kThreadsPerRow) {
      const Pack<T, kVec> dy = load_pack<T, kVec>(grad_out + row * kD + pack * kVec);
      const Pack<T, kVec> y = load_pack<T, kVec>(out + row * kD + pack * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) sum += to_acc(dy.val[j]) * to_acc(y.val[j]);
    }
  }
  sum = row_group_sum<Rows::kThreadsPerRow>(sum);
  if (row < rows && part == 0) delta[row] = sum;
}

// --- float16 / bfloat16 on the tensor cores ------------------------------------------------------

constexpr int kQueryTile = 64;  // queries per shared-memory tile of the tensor-core backward

// Shared memory: K and V (kWarps * 16 rows each), two buffers each of q and dout, dS^T (keys x
// queries), and two buffers each of lse and delta.
template <typename T, int kD, int kWarps>
constexpr int attention_backward_shared_bytes() {
  return ((2 * kWarps * 16 + 4 * kQueryTile) * kPaddedPitch<kD> + kWarps * 16 * kPaddedPitch<kQueryTile>) *
             static_cast<int>(sizeof(T)) +
         4 * kQueryTile * static_cast<int>(sizeof(float));
}

// c (16 x kQueryTile) = a b^T, a = the warp's 16 rows of a key-major tile (K or V), b = a query tile
// (q or dout): S^T = k q^T and dP^T = v dout^T, one 16-wide slice of the head dim at a time.
template <typename T, int kD>
__device__ __forceinline__ void warp_rows_times_queries(float (&c)[kQueryTile / 8][4], const T* warp_rows,
                                                        const T* query_tile) {
#pragma unroll
  for (int n = 0; n < kQueryTile / 8; ++n) c[n][0] = c[n][1] = c[n][2] = c[n][3] = 0.0f;
#pragma unroll
  for (int d = 0; d < kD / 16; ++d) {
    uint32_t a[4];
    load_a_fragment<kPaddedPitch<kD>>(a, warp_rows + d * 16);
    multiply_slice_by_transpose<T, kQueryTile, kPaddedPitch<kD>>(c, a, query_tile + d * 16);
  }
}

// s (S^T) becomes P^T = 2^(s * scale_log2 - lse * log2 e) and dp (dP^T) becomes dS^T = P^T (dP^T -
// delta), for the thread's keys key0, key0 + 8 and queries query0 + 8n + 2 (lane % 4) + {0, 1}.
template <bool kMasked>
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

// dq_accumulator rows [query0, query0 + 16) += c (16 x kCols, columns from `column0`), skipping rows
// past `rows`. sm_90 adds a float2 in one atomic (red.global.add.v2.f32): half the atomic traffic.
template <int kD, int kCols>
__device__ __forceinline__ void add_to_dq(float* dq_accumulator, const float (&c)[kCols / 8][4], int64_t query0,
                                          int column0, int64_t rows) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = query0 + lane / 4 + 8 * half;
    if (row >= rows) continue;
#pragma unroll
    for (int n = 0; n < kCols / 8; ++n) {
      float* target = dq_accumulator + row * kD + column0 + n * 8 + lane % 4 * 2;
#if __CUDA_ARCH__ >= 900
      atomicAdd(reinterpret_cast<float2*>(target), make_float2(c[n][2 * half], c[n][2 * half + 1]));
#else
      atomicAdd(target, c[n][2 * half]);
      atomicAdd(target + 1, c[n][2 * half + 1]);
#endif
    }
  }
}

template <typename T, int kD, int kWarps>
__global__ void __launch_bounds__(kWarps * kWarpSize)
attention_backward_tensor_core_kernel(AttentionShape shape, const T* __restrict__ grad_out, const T* __restrict__ q,
                                      const T* __restrict__ k, const T* __restrict__ v, const float* __restrict__ lse,
                                      const float* __restrict__ delta, float* __restrict__ dq_accumulator,
                                      T* __restrict__ grad_k, T* __restrict__ grad_v) {
  constexpr int kKeys = kWarps * 16, kThreads = kWarps * kWarpSize, kPitch = kPaddedPitch<kD>;
  constexpr int kScorePitch = kPaddedPitch<kQueryTile>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* k_tile = reinterpret_cast<T*>(shared_bytes);
  T* v_tile = k_tile + kKeys * kPitch;
  T* q_tiles = v_tile + kKeys * kPitch;              // two buffers of kQueryTile rows
  T* dout_tiles = q_tiles + 2 * kQueryTile * kPitch;  // two buffers of kQueryTile rows
  T* score_grads = dout_tiles + 2 * kQueryTile * kPitch;  // dS^T: kKeys rows of kQueryTile
  float* lse_tiles = reinterpret_cast<float*>(score_grads + kKeys * kScorePitch);
  float* delta_tiles = lse_tiles + 2 * kQueryTile;

  // Consecutive CTAs share a (batch, head), so its q and dout stay in L2; the first key tiles (seen by
  // the most queries when causal) start first.
  const VisibleKeys visible(shape);
  const int64_t lq = shape.query_length, lk = shape.key_length, key_tiles = ceil_div(lk, kKeys);
  const int64_t bh = blockIdx.x / key_tiles, j0 = blockIdx.x % key_tiles * kKeys, j1 = min(j0 + kKeys, lk);
  q += bh * lq * kD;
  grad_out += bh * lq * kD;
  lse += bh * lq;
  delta += bh * lq;
  dq_accumulator += bh * lq * kD;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t key0 = j0 + warp * 16 + lane / 4;  // the thread's keys: key0 and key0 + 8

  // Query tiles that see any key of this CTA (none, for keys no query sees: dk = dv = 0).
  const int64_t query_begin = visible.first_query(j0) / kQueryTile * kQueryTile, query_end = visible.end_query(j1 - 1);
  const int tiles = query_end > query_begin ? static_cast<int>(ceil_div(query_end - query_begin, kQueryTile)) : 0;

  const auto load_query_tile = [&](int buffer, int64_t i0) {
    load_tile_async<kQueryTile, kD, kThreads>(q_tiles + buffer * kQueryTile * kPitch, q, i0, lq);
    load_tile_async<kQueryTile, kD, kThreads>(dout_tiles + buffer * kQueryTile * kPitch, grad_out, i0, lq);
    load_row_values_async<kQueryTile>(lse_tiles + buffer * kQueryTile, lse, i0, lq);
    load_row_values_async<kQueryTile>(delta_tiles + buffer * kQueryTile, delta, i0, lq);
  };
  load_tile_async<kKeys, kD, kThreads>(k_tile, k + bh * lk * kD, j0, lk);
  load_tile_async<kKeys, kD, kThreads>(v_tile, v + bh * lk * kD, j0, lk);
  if (tiles > 0) load_query_tile(0, query_begin);
  copy_async_commit();

  float dk[kD / 8][4] = {}, dv[kD / 8][4] = {};
  const float scale_log2 = static_cast<float>(shape.scale) * kLog2e;
  // dq += dS k is split over the warps: warp w takes query rows 16 (w % 4) .. + 16 and a share of the columns.
  constexpr int kRowBlocks = kQueryTile / 16, kColumnSplit = kWarps / kRowBlocks, kDqColumns = kD / kColumnSplit;
  static_assert(kWarps % kRowBlocks == 0 && kDqColumns % 16 == 0, "dq work must split evenly over the warps");
  const int dq_rows = warp % kRowBlocks * 16, dq_column0 = warp / kRowBlocks * kDqColumns;

  for (int t = 0; t < tiles; ++t) {
    const int64_t i0 = query_begin + int64_t{t} * kQueryTile;
    // Buffer (t + 1) % 2 was last read before the middle barrier of iteration t - 1.
    if (t + 1 < tiles) load_query_tile((t + 1) % 2, i0 + kQueryTile);
    copy_async_commit();
    copy_async_wait<1>();
    __syncthreads();
    const T* q_tile = q_tiles + t % 2 * kQueryTile * kPitch;
    const T* dout_tile = dout_tiles + t % 2 * kQueryTile * kPitch;

    float s[kQueryTile / 8][4], dp[kQueryTile / 8][4];  // S^T, dP^T: the warp's 16 keys x 64 queries
    warp_rows_times_queries<T, kD>(s, k_tile + warp * 16 * kPitch, q_tile);
    warp_rows_times_queries<T, kD>(dp, v_tile + warp * 16 * kPitch, dout_tile);
    if (visible.sees_all(i0, i0 + kQueryTile, j0, j0 + kKeys)) {
      probabilities_and_score_grads<false>(s, dp, lse_tiles + t % 2 * kQueryTile, delta_tiles + t % 2 * kQueryTile,
                                           scale_log2, visible, key0, i0);
    } else {
      probabilities_and_score_grads<true>(s, dp, lse_tiles + t % 2 * kQueryTile, delta_tiles + t % 2 * kQueryTile,
                                          scale_log2, visible, key0, i0);
    }
    // dv += P^T dout and dk += dS^T q: P^T and dS^T are already A fragments.
#pragma unroll
    for (int kq = 0; kq < kQueryTile / 16; ++kq) {
      uint32_t a[4];
      a_fragment_from_accumulators<T>(a, s[2 * kq], s[2 * kq + 1]);
      multiply_slice<T, kD, kPitch>(dv, a, dout_tile + kq * 16 * kPitch);
      a_fragment_from_accumulators<T>(a, dp[2 * kq], dp[2 * kq + 1]);
      multiply_slice<T, kD, kPitch>(dk, a, q_tile + kq * 16 * kPitch);
    }
    stage_accumulators<T, kQueryTile>(score_grads + warp * 16 * kScorePitch, dp, 1.0f);
    __syncthreads();  // all of dS^T is in shared memory; q, dout, lse, delta of buffer t % 2 are no longer read

    float dq[kDqColumns / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < kKeys / 16; ++kk) {
      uint32_t a[4];
      load_a_fragment_transposed<kScorePitch>(a, score_grads + kk * 16 * kScorePitch + dq_rows);
      multiply_slice<T, kDqColumns, kPitch>(dq, a, k_tile + kk * 16 * kPitch + dq_column0);
    }
    add_to_dq<kD, kDqColumns>(dq_accumulator, dq, i0 + dq_rows, dq_column0, lq);
    // No barrier here: the next writes to score_grads come after the next iteration's first barrier.
  }

  // dk * scale and dv through the warp's own rows of the K and V tiles, for 16-byte stores.
  __syncthreads();  // every warp is done reading K for dq
  T* k_rows = k_tile + warp * 16 * kPitch;
  T* v_rows = v_tile + warp * 16 * kPitch;
  stage_accumulators<T, kD>(k_rows, dk, static_cast<float>(shape.scale));
  stage_accumulators<T, kD>(v_rows, dv, 1.0f);
  __syncwarp();
  copy_rows_to_global<16, kD>(grad_k + bh * lk * kD, k_rows, j0 + warp * 16, lk);
  copy_rows_to_global<16, kD>(grad_v + bh * lk * kD, v_rows, j0 + warp * 16, lk);
}

// grad_q = scale * dq_accumulator, rounded to T; 4 values per thread (numel is a multiple of 16).
template <typename T>
__global__ void attention_backward_dq_kernel(const float* __restrict__ dq_accumulator, T* __restrict__ grad_q,
                                             int64_t numel, float scale) {
  const int64_t i = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * 4;
  if (i >= numel) return;
  const Pack<float, 4> sum = load_pack_once<float, 4>(dq_accumulator + i);
  Pack<T, 4> rounded;
#pragma unroll
  for (int j = 0; j < 4; ++j) rounded.val[j] = from_acc<T>(sum.val[j] * scale);
  store_pack<T, 4>(grad_q + i, rounded);
}

// --- launchers -----------------------------------------------------------------------------------

// float16/bfloat16 need a float32 dq accumulator (rows x head_dim) before delta (rows); the SIMT
// kernels only delta. The accumulator comes first so that its float2 atomics stay 8-byte aligned.
int64_t attention_backward_workspace_size(DType dtype, const AttentionShape& shape) {
  const int64_t rows = shape.batch_heads * shape.query_length;
  const bool tensor_cores = dtype == DType::Float16 || dtype == DType::BFloat16;
  return rows + (tensor_cores ? rows * shape.head_dim : 0);
}

void launch_attention_backward(DType dtype, const AttentionShape& shape, const void* grad_out, const void* q,
                               const void* k, const void* v, const void* out, const void* lse, void* grad_q,
                               void* grad_k, void* grad_v, void* workspace, void* stream) {
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t rows = shape.batch_heads * shape.query_length;
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    using A = Acc<T>;
    dispatch_head_dim(shape.head_dim, [&](auto head_dim) {
      constexpr int kD = decltype(head_dim)::value;
      const T* dy = static_cast<const T*>(grad_out);
      const T* q_ = static_cast<const T*>(q);
      const T* k_ = static_cast<const T*>(k);
      const T* v_ = static_cast<const T*>(v);
      constexpr bool kTensorCores = !(std::is_same_v<T, float> || std::is_same_v<T, double>);
      A* dq_accumulator = static_cast<A*>(workspace);
      A* delta = dq_accumulator + (kTensorCores ? rows * kD : 0);
      using DeltaLayout = DeltaRows<T, kD>;
      attention_backward_delta_kernel<T, kD>
          <<<static_cast<unsigned>(ceil_div(rows, DeltaLayout::kRowsPerBlock)), DeltaLayout::kThreads, 0, s>>>(
              dy, static_cast<const T*>(out), delta, rows);
      if constexpr (kTensorCores) {
        // Head dim 128: 8 warps (128 keys a CTA) halve the dq atomics and the q, dout reloads per key,
        // 2.99 ms against 3.48 ms with 4 for the kernel at (4, 16, 4096, 128) bf16 causal on an H100.
        // Smaller head dims do more of their work per byte in those reloads' place, and 4 warps win
        // (d 64: 1.71 against 1.75 ms; d 32: 1.01 against 1.15 ms).
        constexpr int kWarps = kD == 128 ? 8 : 4;
        constexpr int kBytes = attention_backward_shared_bytes<T, kD, kWarps>();
        auto* kernel = attention_backward_tensor_core_kernel<T, kD, kWarps>;
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
        cudaMemsetAsync(dq_accumulator, 0, rows * kD * sizeof(float), s);
        const auto blocks = static_cast<unsigned>(shape.batch_heads * ceil_div(shape.key_length, kWarps * 16));
        kernel<<<blocks, kWarps * kWarpSize, kBytes, s>>>(shape, dy, q_, k_, v_, static_cast<const float*>(lse), delta,
                                                          dq_accumulator, static_cast<T*>(grad_k), static_cast<T*>(grad_v));
        constexpr int kThreads = 256;
        attention_backward_dq_kernel<T><<<static_cast<unsigned>(ceil_div(rows * kD, 4 * kThreads)), kThreads, 0, s>>>(
            dq_accumulator, static_cast<T*>(grad_q), rows * kD, static_cast<float>(shape.scale));
      } else {
        using Rows = SimtRows<kD>;
        const T* lse_ = static_cast<const T*>(lse);
        attention_backward_dq_simt_kernel<T, kD>
            <<<static_cast<unsigned>(shape.batch_heads * ceil_div(shape.query_length, Rows::kRowsPerBlock)),
               Rows::kThreads, 0, s>>>(shape, dy, q_, k_, v_, lse_, delta, static_cast<T*>(grad_q));
        attention_backward_dk_dv_simt_kernel<T, kD>
            <<<static_cast<unsigned>(shape.batch_heads * ceil_div(shape.key_length, Rows::kRowsPerBlock)),
               Rows::kThreads, 0, s>>>(shape, dy, q_, k_, v_, lse_, delta, static_cast<T*>(grad_k),
                                       static_cast<T*>(grad_v));
      }
    });
  });
}

}  // namespace kernel_ladder
