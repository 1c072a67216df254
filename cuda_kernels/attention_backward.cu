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
//                                              (attention_backward.cuh, shared with the Hopper kernel;
//                                              on a Hopper GPU launch_attention_backward first tries
//                                              attention_backward_hopper.cu)
//   float16 / bfloat16 (tensor cores, FlashAttention-2's plan on mma.sync):
//     attention_backward_tensor_core_kernel    a CTA owns 16 keys per warp (per two warps past tile
//                                              width 128, see BackwardWarps) of one kv head; its K and
//                                              V tiles stay in shared memory while tiles of 64 queries
//                                              (32 at tile widths 96, 192, 256; q, dout, lse, delta)
//                                              stream past, double-buffered with cp.async, those of
//                                              each query head of the kv head's group in turn
//                                              (grouped-query attention). Each warp recomputes its
//                                              16-key tiles of S^T and dP^T in registers, keeps dk
//                                              and dv (or its half of their columns) in registers for the
//                                              whole loop, and hands dS^T to the other warps through
//                                              shared memory for dq += dS k, which it adds to a
//                                              float32 buffer with atomics (vector red.add)
//     attention_backward_dq_kernel             grad_q = scale * that buffer, rounded to the dtype
//                                              (attention_backward.cuh)
//   float32 / float64: attention_backward_dq_simt_kernel and attention_backward_dk_dv_simt_kernel
//     (attention_simt.cuh), the same math in two deterministic passes
//
// Layouts
//   q, k, v, out and dout are read where they lie (kernels.h, HeadStrides): q, k, v are usually heads
//   of the fused q·k·v projection, out and dout rows of (batch, tokens, heads, head_dim). Only each
//   row's head_dim values are contiguous; every kernel finds its heads' first rows once and steps from
//   row to row by the row strides. The gradients are written as their operands lie (tokens first for
//   the heads of a fused projection: attention_ops.cpp, empty_gradient); the scratch (delta, the float32
//   dq sum) is contiguous.
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
//   order (atomics): results differ between runs by float32 rounding. dk and dv are summed over a
//   grouped-query group by one CTA in one order: deterministic.
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -v -c cuda_kernels/attention_backward.cu -o /tmp/attention_backward.o
//   python -m pytest tests -k "attention and cuda"
#include "attention_backward.cuh"
#include "attention_simt.cuh"

namespace kernel_ladder {

// --- float16 / bfloat16 on the tensor cores ------------------------------------------------------

// How a CTA of the tensor-core backward splits its work. Each warp owns 16 keys and holds their dk and
// dv accumulators, 2 x kD / 2 registers at full width: past tile width 128 (2 x 96 or 2 x 128, beside
// S^T and dP^T) that no longer fits 255 registers, so there two warps share 16 keys, each summing dk
// and dv for half of the columns. Both then compute the keys' S^T and dP^T (two of the five products
// done twice), which costs less than spilling the accumulators to local memory.
template <int kD>
struct BackwardWarps {
  // Head dim 128: 8 warps (128 keys a CTA) halve the dq atomics and the q, dout reloads per key,
  // 2.99 ms against 3.48 ms with 4 for the kernel at (4, 16, 4096, 128) bf16 causal on an H100.
  // Smaller head dims do more of their work per byte in those reloads' place, and 4 warps win
  // (d 64: 1.71 against 1.75 ms; d 32: 1.01 against 1.15 ms); tile width 96 is not measured.
  static constexpr int kWarps = kD >= 128 ? 8 : 4;
  static constexpr int kColumnParts = kD > 128 ? 2 : 1;  // warps sharing 16 keys
  static constexpr int kColumns = kD / kColumnParts;     // dk, dv columns per warp
  static constexpr int kKeys = kWarps / kColumnParts * 16;  // keys per CTA
  // Queries per shared-memory tile: the warp's S^T and dP^T tiles take kQueries / 2 registers each. The
  // new tile widths (96, 192, 256) take 32, to leave room for the dk, dv accumulators: with 64, ptxas
  // spilled 16 (96), 8 (192) and 40 (256) bytes a thread. 128 keeps its measured 64 (and its 40).
  static constexpr int kQueries = kD <= 64 || kD == 128 ? 64 : 32;
};

// Shared memory: K and V (kKeys rows each), two buffers each of q and dout, dS^T (keys x queries), and
// two buffers each of lse and delta. At tile width 256: (128 + 256) x 528 + 64 x 144 + 1024 bytes = 208 KB
// of the 227 KB a block may have on an H100.
template <typename T, int kD>
constexpr int attention_backward_shared_bytes() {
  constexpr int kKeys = BackwardWarps<kD>::kKeys, kQueryTile = BackwardWarps<kD>::kQueries;
  return ((2 * kKeys + 4 * kQueryTile) * kPaddedPitch<kD> + kKeys * kPaddedPitch<kQueryTile>) *
             static_cast<int>(sizeof(T)) +
         4 * kQueryTile * static_cast<int>(sizeof(float));
}

// c (16 x kQueryTile) = a b^T, a = the warp's 16 rows of a key-major tile (K or V), b = a query tile
// (q or dout): S^T = k q^T and dP^T = v dout^T, one 16-wide slice of the head dim at a time.
template <typename T, int kD, int kQueryTile = BackwardWarps<kD>::kQueries>
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

template <typename T, int kD>
__global__ void __launch_bounds__(BackwardWarps<kD>::kWarps * kWarpSize)
attention_backward_tensor_core_kernel(AttentionShape shape, const T* __restrict__ grad_out, const T* __restrict__ q,
                                      const T* __restrict__ k, const T* __restrict__ v, const float* __restrict__ lse,
                                      const float* __restrict__ delta, float* __restrict__ dq_accumulator,
                                      T* __restrict__ grad_k, T* __restrict__ grad_v) {
  using Warps = BackwardWarps<kD>;
  constexpr int kWarps = Warps::kWarps, kKeys = Warps::kKeys, kColumns = Warps::kColumns;
  constexpr int kThreads = kWarps * kWarpSize, kPitch = kPaddedPitch<kD>;
  constexpr int kQueryTile = Warps::kQueries, kScorePitch = kPaddedPitch<kQueryTile>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* k_tile = reinterpret_cast<T*>(shared_bytes);
  T* v_tile = k_tile + kKeys * kPitch;
  T* q_tiles = v_tile + kKeys * kPitch;              // two buffers of kQueryTile rows
  T* dout_tiles = q_tiles + 2 * kQueryTile * kPitch;  // two buffers of kQueryTile rows
  T* score_grads = dout_tiles + 2 * kQueryTile * kPitch;  // dS^T: kKeys rows of kQueryTile
  float* lse_tiles = reinterpret_cast<float*>(score_grads + kKeys * kScorePitch);
  float* delta_tiles = lse_tiles + 2 * kQueryTile;

  // Consecutive CTAs share a kv head, so its queries' q and dout stay in L2; the first key tiles (seen
  // by the most queries when causal) start first.
  const VisibleKeys visible(shape);
  const int64_t lq = shape.query_length, lk = shape.key_length, key_tiles = ceil_div(lk, kKeys);
  const int d = static_cast<int>(shape.head_dim);  // <= kD: the row length in global memory
  const int64_t kv = blockIdx.x / key_tiles, j0 = blockIdx.x % key_tiles * kKeys, j1 = min(j0 + kKeys, lk);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  // Warp w owns keys 16 (w % (kWarps / parts)) .. + 16 and dk, dv columns kColumns (w / (kWarps / parts)) .. + kColumns.
  const int key_warp = warp % (kWarps / Warps::kColumnParts), column_part = warp / (kWarps / Warps::kColumnParts);
  const int column0 = column_part * kColumns;
  const int64_t key0 = j0 + key_warp * 16 + lane / 4;  // the thread's keys: key0 and key0 + 8

  // Query tiles that see any key of this CTA (none, for keys no query sees: dk = dv = 0), of each query
  // head of the kv head's group in turn. One CTA sums the whole group into its registers in this one
  // order: dk and dv are deterministic. The pointers below walk from head to head: the group's query
  // heads kv * group .. + group are consecutive heads of one batch (heads is a multiple of group), so
  // q's and dout's lie shape.q.head and shape.grad_out.head elements apart; dq, lse and delta are
  // contiguous. The first head's start is found once (of_head's 64-bit divisions are long instruction
  // sequences on the GPU); within a head, rows lie shape.q.row (grad_out.row, ...) elements apart.
  const int64_t query_begin = visible.first_query(j0) / kQueryTile * kQueryTile, query_end = visible.end_query(j1 - 1);
  const int tiles = query_end > query_begin ? static_cast<int>(ceil_div(query_end - query_begin, kQueryTile)) : 0;
  const int64_t first_head = kv * shape.group, dq_head_size = lq * d;  // values of one query head's dq
  q += shape.q.of_head(first_head, shape.heads);
  grad_out += shape.grad_out.of_head(first_head, shape.heads);
  dq_accumulator += first_head * dq_head_size;
  lse += first_head * lq;
  delta += first_head * lq;

  // Query tile i0 of the head `heads_ahead` heads after the current one into buffer `buffer`.
  const auto load_query_tile = [&](int buffer, int64_t i0, int heads_ahead) {
    load_tile_async<kQueryTile, kD, kThreads>(q_tiles + buffer * kQueryTile * kPitch, q + heads_ahead * shape.q.head,
                                              shape.q.row, i0, lq, d);
    load_tile_async<kQueryTile, kD, kThreads>(dout_tiles + buffer * kQueryTile * kPitch,
                                              grad_out + heads_ahead * shape.grad_out.head, shape.grad_out.row, i0,
                                              lq, d);
    load_row_values_async<kQueryTile>(lse_tiles + buffer * kQueryTile, lse + heads_ahead * lq, i0, lq);
    load_row_values_async<kQueryTile>(delta_tiles + buffer * kQueryTile, delta + heads_ahead * lq, i0, lq);
  };
  // kv counts the kv heads of all batches, heads / group of them a batch.
  load_tile_async<kKeys, kD, kThreads>(k_tile, k + shape.k.of_head(kv, shape.heads / shape.group), shape.k.row, j0,
                                       lk, d);
  load_tile_async<kKeys, kD, kThreads>(v_tile, v + shape.v.of_head(kv, shape.heads / shape.group), shape.v.row, j0,
                                       lk, d);
  if (tiles > 0) load_query_tile(0, query_begin, 0);
  copy_async_commit();

  float dk[kColumns / 8][4] = {}, dv[kColumns / 8][4] = {};
  const float scale_log2 = static_cast<float>(shape.scale) * kLog2e;
  // dq += dS k is split over the warps: warp w takes query rows 16 (w % kRowBlocks) .. + 16 and a share of
  // the columns.
  constexpr int kRowBlocks = kQueryTile / 16, kColumnSplit = kWarps / kRowBlocks, kDqColumns = kD / kColumnSplit;
  static_assert(kWarps % kRowBlocks == 0 && kDqColumns % 16 == 0, "dq work must split evenly over the warps");
  static_assert(kColumns % 16 == 0, "dk, dv columns must split into whole n-tile pairs");
  const int dq_rows = warp % kRowBlocks * 16, dq_column0 = warp / kRowBlocks * kDqColumns;

  int buffer = 0;  // the buffer of the tile in flight; steps alternate buffers across heads too
  for (int64_t head = 0; head < shape.group; ++head) {
    for (int t = 0; t < tiles; ++t, buffer ^= 1) {
      const int64_t i0 = query_begin + int64_t{t} * kQueryTile;
      // The other buffer was last read before the middle barrier of the previous step. Prefetch the next
      // tile of this head, or the first of the next head, from one call site: each inlined copy of the
      // loads holds its own address offsets through the loop (tensor_core.cuh, load_tile_async), and
      // with two, ptxas spilled 56 and 36 bytes at tile widths 128 and 64 (12 and none with one).
      if (t + 1 < tiles || head + 1 < shape.group) {
        const bool next_head = t + 1 == tiles;
        load_query_tile(buffer ^ 1, next_head ? query_begin : i0 + kQueryTile, next_head ? 1 : 0);
      }
      copy_async_commit();
      copy_async_wait<1>();
      __syncthreads();
      const T* q_tile = q_tiles + buffer * kQueryTile * kPitch;
      const T* dout_tile = dout_tiles + buffer * kQueryTile * kPitch;

      float s[kQueryTile / 8][4], dp[kQueryTile / 8][4];  // S^T, dP^T: the warp's 16 keys x kQueryTile queries
      warp_rows_times_queries<T, kD>(s, k_tile + key_warp * 16 * kPitch, q_tile);
      warp_rows_times_queries<T, kD>(dp, v_tile + key_warp * 16 * kPitch, dout_tile);
      if (visible.sees_all(i0, i0 + kQueryTile, j0, j0 + kKeys)) {
        probabilities_and_score_grads<false, kQueryTile>(s, dp, lse_tiles + buffer * kQueryTile,
                                                         delta_tiles + buffer * kQueryTile, scale_log2, visible, key0,
                                                         i0);
      } else {
        probabilities_and_score_grads<true, kQueryTile>(s, dp, lse_tiles + buffer * kQueryTile,
                                                        delta_tiles + buffer * kQueryTile, scale_log2, visible, key0,
                                                        i0);
      }
      // dv += P^T dout and dk += dS^T q over the warp's columns: P^T and dS^T are already A fragments.
#pragma unroll
      for (int kq = 0; kq < kQueryTile / 16; ++kq) {
        uint32_t a[4];
        a_fragment_from_accumulators<T>(a, s[2 * kq], s[2 * kq + 1]);
        multiply_slice<T, kColumns, kPitch>(dv, a, dout_tile + kq * 16 * kPitch + column0);
        a_fragment_from_accumulators<T>(a, dp[2 * kq], dp[2 * kq + 1]);
        multiply_slice<T, kColumns, kPitch>(dk, a, q_tile + kq * 16 * kPitch + column0);
      }
      if (column_part == 0) stage_accumulators<T, kQueryTile>(score_grads + key_warp * 16 * kScorePitch, dp, 1.0f);
      __syncthreads();  // all of dS^T is in shared memory; q, dout, lse, delta of this buffer are no longer read

      float dq[kDqColumns / 8][4] = {};
#pragma unroll
      for (int kk = 0; kk < kKeys / 16; ++kk) {
        uint32_t a[4];
        load_a_fragment_transposed<kScorePitch>(a, score_grads + kk * 16 * kScorePitch + dq_rows);
        multiply_slice<T, kDqColumns, kPitch>(dq, a, k_tile + kk * 16 * kPitch + dq_column0);
      }
      add_to_dq<kDqColumns>(dq_accumulator, dq, i0 + dq_rows, dq_column0, lq, d);
      // No barrier here: the next writes to score_grads come after the next step's first barrier.
    }
    q += shape.q.head;
    grad_out += shape.grad_out.head;
    dq_accumulator += dq_head_size;
    lse += lq;
    delta += lq;
  }

  // dk * scale and dv through the warps' own rows (and columns) of the K and V tiles, for 16-byte stores.
  __syncthreads();  // every warp is done reading K for dq
  T* k_rows = k_tile + key_warp * 16 * kPitch;
  T* v_rows = v_tile + key_warp * 16 * kPitch;
  stage_accumulators<T, kColumns, kPitch>(k_rows + column0, dk, static_cast<float>(shape.scale));
  stage_accumulators<T, kColumns, kPitch>(v_rows + column0, dv, 1.0f);
  __syncthreads();  // the column parts of a row come from different warps
  // kv's batch and head, for the gradients' strides, in 32-bit arithmetic (kv is a grid index, below 2^31):
  // of_head's 64-bit divisions here made ptxas spill registers at tile width 256 for sm_90.
  const auto kv_heads = static_cast<uint32_t>(shape.heads / shape.group), kv32 = static_cast<uint32_t>(kv);
  const int64_t kv_batch = kv32 / kv_heads, kv_head = kv32 % kv_heads;
  if (column_part == 0) {
    copy_rows_to_global<16, kD>(grad_k + kv_batch * shape.grad_k.batch + kv_head * shape.grad_k.head,
                                shape.grad_k.row, k_rows, j0 + key_warp * 16, lk, d);
  }
  if (column_part == Warps::kColumnParts - 1) {
    copy_rows_to_global<16, kD>(grad_v + kv_batch * shape.grad_v.batch + kv_head * shape.grad_v.head,
                                shape.grad_v.row, v_rows, j0 + key_warp * 16, lk, d);
  }
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
  if (launch_attention_backward_hopper(dtype, shape, grad_out, q, k, v, out, lse, grad_q, grad_k, grad_v, workspace,
                                       stream)) {
    return;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  const int64_t rows = shape.batch_heads * shape.query_length, d = shape.head_dim;
  const int64_t kv_heads = shape.batch_heads / shape.group;
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    using A = Acc<T>;
    dispatch_attention_tile(d, [&](auto tile_width) {
      constexpr int kD = decltype(tile_width)::value;
      const T* dy = static_cast<const T*>(grad_out);
      const T* q_ = static_cast<const T*>(q);
      const T* k_ = static_cast<const T*>(k);
      const T* v_ = static_cast<const T*>(v);
      constexpr bool kTensorCores = !(std::is_same_v<T, float> || std::is_same_v<T, double>);
      A* dq_accumulator = static_cast<A*>(workspace);
      A* delta = dq_accumulator + (kTensorCores ? rows * d : 0);
      launch_attention_backward_delta<T, kD>(shape, dy, static_cast<const T*>(out), delta, s);
      if constexpr (kTensorCores) {
        constexpr int kBytes = attention_backward_shared_bytes<T, kD>();
        auto* kernel = attention_backward_tensor_core_kernel<T, kD>;
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
        cudaMemsetAsync(dq_accumulator, 0, rows * d * sizeof(float), s);
        const auto blocks = static_cast<unsigned>(kv_heads * ceil_div(shape.key_length, BackwardWarps<kD>::kKeys));
        kernel<<<blocks, BackwardWarps<kD>::kWarps * kWarpSize, kBytes, s>>>(
            shape, dy, q_, k_, v_, static_cast<const float*>(lse), delta, dq_accumulator, static_cast<T*>(grad_k),
            static_cast<T*>(grad_v));
        launch_attention_backward_dq<T, kD>(shape, dq_accumulator, static_cast<T*>(grad_q), s);
      } else {
        using Rows = SimtRows<kD>;
        const T* lse_ = static_cast<const T*>(lse);
        attention_backward_dq_simt_kernel<T, kD>
            <<<static_cast<unsigned>(shape.batch_heads * ceil_div(shape.query_length, Rows::kRowsPerBlock)),
               Rows::kThreads, 0, s>>>(shape, dy, q_, k_, v_, lse_, delta, static_cast<T*>(grad_q));
        attention_backward_dk_dv_simt_kernel<T, kD>
            <<<static_cast<unsigned>(kv_heads * ceil_div(shape.key_length, Rows::kRowsPerBlock)), Rows::kThreads, 0,
               s>>>(shape, dy, q_, k_, v_, lse_, delta, static_cast<T*>(grad_k), static_cast<T*>(grad_v));
      }
    });
  });
}

}  // namespace kernel_ladder
