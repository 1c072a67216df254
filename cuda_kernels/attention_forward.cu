// Flash attention in CUDA, forward: out = softmax(q k^T * scale + mask) v and lse, per (batch, head).
//
// What it computes, with S = q k^T * scale restricted to the keys each query sees (attention_mask.h)
//   out = softmax(S) v row by row,   lse = log(sum(exp(S))) per query (saved for the backward)
//
// Kernels
//   attention_forward_tensor_core_kernel<T, kD, kWarps>   float16 / bfloat16, FlashAttention-2's
//       plan on mma.sync: a CTA owns kWarps * 16 queries, each warp 16 of them; q's fragments stay
//       in registers (up to tile width 128; wider tiles re-read them from shared memory, see
//       kQueryInRegisters); K and V tiles of 64 keys (32 at tile width 256) stream through shared
//       memory, double-buffered with cp.async (tile j + 1 loads while tile j is multiplied); S and P
//       never leave registers
//   float32 / float64 run attention_forward_simt_kernel (attention_simt.cuh), the same algorithm on
//       FMA units
//   On a Hopper GPU (compute capability 9.0, in a build with the sm_90a target) float16 / bfloat16 at
//       head dims up to 128 run attention_forward_hopper_kernel instead (attention_forward_hopper.cu:
//       wgmma, TMA, warp specialisation); the op cuda_kernels::use_hopper_attention(False) turns it off
//
// The one idea that makes it fast
//   The seq x seq score matrix is never stored. A warp computes its 16 x 64 tile of S on the tensor
//   cores, and the online softmax folds it into a running max m, running sum l and running output o
//   (rescaled by 2^(m_old - m_new) when a tile raises the max past its lag, kMaxLag in tensor_core.cuh;
//   this kernel multiplies by the factor of 1 that leaves, where the Hopper one skips it); P, rounded to
//   16 bits, is already in the register layout of mma's A operand, so o += P v follows without touching
//   shared memory. So memory traffic is q, k, v read and o written, and the time is the tensor cores'
//   and the exp unit's. exp is 2^x on the special-function unit, log2(e) folded into the score scale.
//   Mask: only tiles that hold a masked pair (the causal diagonal, the window's edge, the padding
//   past the last key) pay for the mask; tiles no query of the CTA sees are never visited, so with
//   a sliding window the work grows with seq x window.
//
// Measured (H100, (batch 4, heads 16, seq 4096, head_dim 128) bfloat16, causal, CUDA-graph replays)
//   1.08 ms, 254 TFLOP/s: 0.83x the speed of PyTorch SDPA's flash backend (0.90 ms), 11x level 1
//   (12.0 ms). Sliding window 1024 at seq 16384 (batch 1): 0.56 ms against 3.86 ms fully causal.
//
// Head dims and heads
//   kD is a tile width (common.cuh: dispatch_attention_tile): a head dim d <= kD runs on the smallest
//   tile that holds it, its rows zero-filled past d on the way into shared memory and stored only up
//   to d (tensor_core.cuh). Grouped-query attention: query head bh reads kv head bh / group.
//   q, k, v are read and out is written where they lie (kernels.h, HeadStrides): q, k, v are usually
//   heads of the fused q·k·v projection, out goes in the (batch, tokens, heads, head_dim) order the output
//   projection reads, so neither side of the kernel copies a tensor. Only each row's head_dim values need
//   be contiguous: a CTA finds its heads' first rows once and steps from row to row by the row strides.
//
// Limits
//   head_dim a multiple of 8 up to 256 (tile widths 16, 32, 64, 96, 128, 192, 256); any lengths, Lq <= Lk
//   when causal; (batch * heads) * ceil(Lq / 64) < 2^31 CTAs. Rows of q, k, v, out 16-byte aligned
//   (attention_ops.cpp copies an operand whose rows are not). lse contiguous, in float32 (float64 for
//   float64 inputs).
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -v -c cuda_kernels/attention_forward.cu -o /tmp/attention_forward.o
//   python -m pytest tests -k "attention and cuda"
#include "attention_mask.h"
#include "attention_simt.cuh"
#include "tensor_core.cuh"

namespace kernel_ladder {

// Keys per shared-memory tile of the tensor-core kernel. At tile width 256 the 16 x 64 score tile's 32
// registers pushed ptxas past 255 registers (164 bytes of spills, sm_90); 32 keys halve them, and the
// K and V buffers with them: (64 + 4 x 32) rows x 528 bytes = 99 KB of shared memory, two CTAs an SM.
template <int kD> constexpr int kKeyTileOf = kD > 192 ? 32 : 64;

// Shared memory of the tensor-core forward: q (kWarps * 16 rows), then two K and two V buffers.
template <typename T, int kD, int kWarps>
constexpr int attention_forward_shared_bytes() {
  return (kWarps * 16 + 4 * kKeyTileOf<kD>) * kPaddedPitch<kD> * static_cast<int>(sizeof(T));
}

// Up to tile width 128 a warp loads its q fragments once and keeps them (kD / 4 registers). At 192
// and 256 they would take 48-64 registers beside a 96-128-register output accumulator and push the
// kernel past 255 registers into spills, so there the warp re-reads them from its rows of the q tile
// (ldmatrix, shared memory) for every key tile instead: one more shared-memory read per k fragment.
template <int kD> constexpr bool kQueryInRegisters = kD <= 128;
template <int kD> constexpr int kQueryFragments = kQueryInRegisters<kD> ? kD / 16 : 1;

// One 16 x kKeyTileOf<kD> tile of scores for one warp: s = q k^T for the warp's 16 queries and the tile's keys
// (q from the fragments held in registers, or from q_rows, the warp's rows of the q tile).
template <typename T, int kD>
__device__ __forceinline__ void tile_scores(float (&s)[kKeyTileOf<kD> / 8][4], const uint32_t (&q)[kQueryFragments<kD>][4],
                                            const T* q_rows, const T* k_tile) {
#pragma unroll
  for (int n = 0; n < kKeyTileOf<kD> / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.0f;
#pragma unroll
  for (int d = 0; d < kD / 16; ++d) {
    if constexpr (kQueryInRegisters<kD>) {
      multiply_slice_by_transpose<T, kKeyTileOf<kD>, kPaddedPitch<kD>>(s, q[d], k_tile + d * 16);
    } else {
      uint32_t a[4];
      load_a_fragment<kPaddedPitch<kD>>(a, q_rows + d * 16);
      multiply_slice_by_transpose<T, kKeyTileOf<kD>, kPaddedPitch<kD>>(s, a, k_tile + d * 16);
    }
  }
}

// The online softmax for one tile: s becomes P = 2^(s * scale_log2 - m) with m the new running max
// (in log2 units) of each of the thread's two rows; o and the partial row sums are rescaled to it.
// kMasked: pairs the mask hides get s = -inf first (row0 = the query of the thread's first row).
template <bool kMasked, int kD>
__device__ __forceinline__ void online_softmax(float (&s)[kKeyTileOf<kD> / 8][4], float (&o)[kD / 8][4], float (&row_max)[2],
                                               float (&row_sum)[2], float scale_log2, const VisibleKeys& visible,
                                               int64_t row0, int64_t key0) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the warp's 16
#pragma unroll
    for (int n = 0; n < kKeyTileOf<kD> / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (kMasked && !visible.sees(row0 + 8 * half, key0 + n * 8 + lane % 4 * 2 + e)) s[n][2 * half + e] = -INFINITY;
      }
    }
    const float rescale = exponentiate_row(s, half, scale_log2, row_max[half], row_sum[half]);
#pragma unroll
    for (int d = 0; d < kD / 8; ++d) {
      o[d][2 * half] *= rescale;
      o[d][2 * half + 1] *= rescale;
    }
  }
}

// o += P v: P (16 x kKeyTileOf<kD>, in registers) rounded to T as the A operand, v's tile as B via ldmatrix.trans.
template <typename T, int kD>
__device__ __forceinline__ void accumulate_pv(float (&o)[kD / 8][4], const float (&p)[kKeyTileOf<kD> / 8][4],
                                              const T* v_tile) {
#pragma unroll
  for (int k = 0; k < kKeyTileOf<kD> / 16; ++k) {
    uint32_t a[4];
    a_fragment_from_accumulators<T>(a, p[2 * k], p[2 * k + 1]);
    multiply_slice<T, kD, kPaddedPitch<kD>>(o, a, v_tile + k * 16 * kPaddedPitch<kD>);
  }
}

template <typename T, int kD, int kWarps>
__global__ void __launch_bounds__(kWarps * kWarpSize)
attention_forward_tensor_core_kernel(AttentionShape shape, const T* __restrict__ q, const T* __restrict__ k,
                                     const T* __restrict__ v, T* __restrict__ out, float* __restrict__ lse) {
  constexpr int kQueries = kWarps * 16, kThreads = kWarps * kWarpSize, kPitch = kPaddedPitch<kD>;
  constexpr int kKeyTile = kKeyTileOf<kD>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* q_tile = reinterpret_cast<T*>(shared_bytes);
  T* k_tiles = q_tile + kQueries * kPitch;       // two buffers of kKeyTile rows
  T* v_tiles = k_tiles + 2 * kKeyTile * kPitch;  // two buffers of kKeyTile rows

  // Consecutive CTAs share a (batch, head), so its K and V stay in L2 while they stream past; within
  // it the last query tiles (most keys when causal) start first, so the short ones fill the tail.
  const VisibleKeys visible(shape);
  const int64_t lq = shape.query_length, lk = shape.key_length, query_tiles = ceil_div(lq, kQueries);
  const int d = static_cast<int>(shape.head_dim);  // <= kD: the row length in global memory
  const int64_t bh = blockIdx.x / query_tiles;
  const int64_t i0 = (query_tiles - 1 - blockIdx.x % query_tiles) * kQueries;
  const int64_t i1 = min(i0 + kQueries, lq);
  // Where this CTA's heads start (kernels.h, HeadStrides), found once: of_head's 64-bit divisions are long
  // instruction sequences on the GPU. out's is found where it is written, so that the key loop holds no
  // pointer for it. Within a head, rows lie shape.q.row (k.row, ...) elements apart.
  const int64_t kv = bh / shape.group;  // the kv head of this query head's group (of heads / group a batch)
  q += shape.q.of_head(bh, shape.heads);
  k += shape.k.of_head(kv, shape.heads / shape.group);
  v += shape.v.of_head(kv, shape.heads / shape.group);
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int64_t row0 = i0 + warp * 16 + lane / 4;  // the thread's rows: row0 and row0 + 8

  // Key tiles any query of this CTA sees: [key_begin, key_end) in steps of kKeyTile.
  const int64_t key_begin = visible.first_key(i0) / kKeyTile * kKeyTile, key_end = visible.end_key(i1 - 1);
  const int tiles = static_cast<int>(ceil_div(key_end - key_begin, kKeyTile));

  load_tile_async<kQueries, kD, kThreads>(q_tile, q, shape.q.row, i0, lq, d);
  copy_async_commit();
  load_tile_async<kKeyTile, kD, kThreads>(k_tiles, k, shape.k.row, key_begin, lk, d);
  load_tile_async<kKeyTile, kD, kThreads>(v_tiles, v, shape.v.row, key_begin, lk, d);
  copy_async_commit();
  copy_async_wait<1>();  // q has landed (the first K, V tile may still be in flight)
  __syncthreads();
  const T* q_rows = q_tile + warp * 16 * kPitch;
  uint32_t q_fragments[kQueryFragments<kD>][4];
  if constexpr (kQueryInRegisters<kD>) {
#pragma unroll
    for (int slice = 0; slice < kD / 16; ++slice) load_a_fragment<kPitch>(q_fragments[slice], q_rows + slice * 16);
  }

  float o[kD / 8][4] = {};
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
  const float scale_log2 = static_cast<float>(shape.scale) * kLog2e;
  for (int t = 0; t < tiles; ++t) {
    const int64_t key0 = key_begin + int64_t{t} * kKeyTile;
    if (t + 1 < tiles) {  // prefetch tile t + 1 into the other buffer, freed by the barrier that ended t - 1
      load_tile_async<kKeyTile, kD, kThreads>(k_tiles + (t + 1) % 2 * kKeyTile * kPitch, k, shape.k.row,
                                              key0 + kKeyTile, lk, d);
      load_tile_async<kKeyTile, kD, kThreads>(v_tiles + (t + 1) % 2 * kKeyTile * kPitch, v, shape.v.row,
                                              key0 + kKeyTile, lk, d);
    }
    copy_async_commit();  // possibly empty: keeps "all but the newest group" meaning tile t
    copy_async_wait<1>();
    __syncthreads();
    const T* k_tile = k_tiles + t % 2 * kKeyTile * kPitch;
    const T* v_tile = v_tiles + t % 2 * kKeyTile * kPitch;
    float s[kKeyTile / 8][4];
    tile_scores<T, kD>(s, q_fragments, q_rows, k_tile);
    if (visible.sees_all(i0, i1, key0, key0 + kKeyTile)) {
      online_softmax<false, kD>(s, o, row_max, row_sum, scale_log2, visible, row0, key0);
    } else {
      online_softmax<true, kD>(s, o, row_max, row_sum, scale_log2, visible, row0, key0);
    }
    accumulate_pv<T, kD>(o, s, v_tile);
    __syncthreads();  // every warp is done with buffer t % 2 before iteration t + 1 refills it
  }

  // out = o / l, staged through the warp's own rows of q_tile for 16-byte stores; lse = ln 2 * (m + log2 l).
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 1);
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 2);
    const int64_t row = row0 + 8 * half;
    if (lane % 4 == 0 && row < lq) lse[bh * lq + row] = (row_max[half] + __log2f(row_sum[half])) * kLn2;
    const float inverse_sum = 1.0f / row_sum[half];
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      o[n][2 * half] *= inverse_sum;
      o[n][2 * half + 1] *= inverse_sum;
    }
  }
  T* warp_rows = q_tile + warp * 16 * kPitch;
  stage_accumulators<T, kD>(warp_rows, o, 1.0f);
  __syncwarp();
  copy_rows_to_global<16, kD>(out + shape.out.of_head(bh, shape.heads), shape.out.row, warp_rows, i0 + warp * 16,
                              lq, d);
}

// --- launcher ------------------------------------------------------------------------------------

void launch_attention_forward(DType dtype, const AttentionShape& shape, const void* q, const void* k, const void* v,
                              void* out, void* lse, void* stream) {
  if (launch_attention_forward_hopper(dtype, shape, q, k, v, out, lse, stream)) return;
  const auto s = static_cast<cudaStream_t>(stream);
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    dispatch_attention_tile(shape.head_dim, [&](auto tile_width) {
      constexpr int kD = decltype(tile_width)::value;
      if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
        using Rows = SimtRows<kD>;
        const auto blocks = static_cast<unsigned>(shape.batch_heads * ceil_div(shape.query_length, Rows::kRowsPerBlock));
        attention_forward_simt_kernel<T, kD><<<blocks, Rows::kThreads, 0, s>>>(
            shape, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), static_cast<T*>(out),
            static_cast<T*>(lse));
      } else {
        // 4 warps (64 queries a CTA): 1.08 ms against 1.20 ms with 8 at (4, 16, 4096, 128) bf16 causal on
        // an H100; two CTAs of 4 warps share an SM (230 registers a thread, 85 KB of shared memory each).
        // At tile width 256 a CTA takes (64 + 4 * 64) rows x 528 bytes = 165 KB (of the 227 KB a block
        // may have): one CTA an SM.
        constexpr int kWarps = 4;
        constexpr int kBytes = attention_forward_shared_bytes<T, kD, kWarps>();
        auto* kernel = attention_forward_tensor_core_kernel<T, kD, kWarps>;
        // Beyond 48 KB a kernel's dynamic shared memory must be asked for (per device, so every launch).
        cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
        const auto blocks = static_cast<unsigned>(shape.batch_heads * ceil_div(shape.query_length, kWarps * 16));
        kernel<<<blocks, kWarps * kWarpSize, kBytes, s>>>(shape, static_cast<const T*>(q), static_cast<const T*>(k),
                                                          static_cast<const T*>(v), static_cast<T*>(out),
                                                          static_cast<float*>(lse));
      }
    });
  });
}

}  // namespace kernel_ladder
