// Flash attention backward on Hopper (sm_90a): FlashAttention-3's backward on wgmma, TMA and warp
// specialisation.
//
// What it computes: exactly what attention_backward.cu computes (grad_q, grad_k, grad_v from grad_out,
// recomputing P from the forward's lse; the same AttentionShape and masks), for float16 / bfloat16 and
// head dims up to 128. launch_attention_backward tries this kernel first and runs its mma.sync kernel when
// launch_attention_backward_hopper says it does not apply (another GPU, another dtype, a wider head).
//
// Kernels, in the order they run
//   attention_backward_delta_kernel    delta = rowsum(dout * out) (attention_backward.cuh, shared)
//   attention_backward_hopper_kernel<T, kD>   one CTA per 128 keys of one kv head, 3 warpgroups:
//     warpgroup 0, the producer: one thread loads the K and V tiles once (TMA), then streams tiles of 64
//       queries (q and dout) of each query head of the kv head's group through a ring of 2 stages; a
//       second warp copies the tiles' lse and delta rows beside them. Each stage has a "full" mbarrier
//       (TMA's bytes and the 32 lanes' rows have landed) and an "empty" one (the 8 consumer warps are done).
//     warpgroups 1 and 2, the consumers: 64 keys each, whose dk and dv accumulators (64 x kD floats each)
//       stay in registers for the whole loop. Per query tile, with the products on wgmma:
//         S^T = K q^T and dP^T = V dout^T    (both operands from shared memory, K-major, m64n64)
//         P^T = 2^(S^T scale log2 e - lse log2 e) and dS^T = P^T (dP^T - delta), in registers
//         dv += P^T dout and dk += dS^T q    (A from registers, as the forward's P V; B MN-major)
//         dq = dS K                          (dS^T written to shared memory and read back MN-major: the
//                                             one product whose A is a transpose of what registers hold)
//       dq needs all 128 keys of the CTA, so the two consumers meet at a named barrier once both dS^T
//       halves are in shared memory, and each computes half of dq's columns (64 x kD / 2) over all 128
//       keys, which it adds to the float32 dq accumulator with vector atomics (red.global.add.v2.f32).
//   attention_backward_dq_kernel       grad_q = scale * that accumulator, rounded to T (shared)
//
// The one idea that makes it fast: every product is one warpgroup instruction on operands the tensor
//   cores read from shared memory themselves, and no consumer thread spends an instruction on a copy: TMA
//   moves every q and dout tile, zero-fills rows past a sequence's end and columns past head_dim, and
//   writes dk and dv. A CTA of 128 keys adds each dq value once per 64 x 128 block (the mma.sync kernel:
//   likewise); dS^T round-trips through shared memory (16 KB a tile), double-buffered so that the next
//   tile's stores need no second barrier. Not yet done (FlashAttention-3 does): overlapping one tile's
//   softmax backward with the previous tile's products; here each consumer waits for S^T and dP^T before
//   the elementwise work, and only dv, dk and dq run while it reaches the barrier.
//
// Registers: dk + dv 2 x kD / 2 = 128 at kD 128, S^T and dP^T 32 each, then P^T and dS^T as 16-bit A
//   fragments (16 each) and dq (kD / 4) after S^T and dP^T have died: setmaxnreg gives the consumers 240.
//
// Limits
//   float16 / bfloat16; head_dim a multiple of 8 up to 128 (tile width 64 for d <= 64, else 128); any
//   lengths below 2^31; q, k, v, out, grad_out and the gradients strided as kernels.h's HeadStrides
//   allow, every stride a multiple of 16 bytes (attention_ops.cpp makes sure). Built only when nvcc targets sm_90a
//   (cuda_kernels/ops.py adds it, and -DKERNEL_LADDER_SM90A, when it sees an H100-class GPU); runs only on
//   compute capability 9.0. dq is summed in a nondeterministic order (atomics); dk and dv are not.
//
// Check
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DKERNEL_LADDER_SM90A -Xptxas -v,-warn-spills \
//        -c cuda_kernels/attention_backward_hopper.cu -o /tmp/attention_backward_hopper.o
//   python -m pytest tests -k "attention and (cuda or hopper)"    (on a GPU; both kernels, float64 reference)
#include <climits>

#include "attention_backward.cuh"
#include "hopper.cuh"

namespace kernel_ladder {

// The CTA: a producer warpgroup, then two consumer warpgroups of 64 keys each (wgmma's M).
constexpr int kBackwardConsumers = 2;
constexpr int kBackwardThreads = (1 + kBackwardConsumers) * kWarpgroupThreads;
constexpr int kConsumerKeys = 64;
constexpr int kBackwardKeys = kBackwardConsumers * kConsumerKeys;
// Queries per streamed tile: S^T and dP^T are m64n64 accumulators, 32 floats a thread each.
constexpr int kBackwardQueries = 64;
constexpr int kBackwardStages = 2;

struct BackwardBarriers {
  uint64_t keys_full;  // K and V have landed
  uint64_t full[kBackwardStages], empty[kBackwardStages];
};

// Shared memory: tiles of 128-byte rows in 64-column boxes (hopper.cuh): K and V (128 keys), 2
// stages of q and dout (64 queries), 2 buffers of dS^T (128 keys x 64 queries), 2 stages of lse and
// delta, the barriers. 162 KB at tile width 128, 98 KB at 64; 1 KB more lets the kernel start the tiles
// on a 1024-byte boundary, which the swizzle needs (hopper.cuh).
template <int kD>
struct BackwardSharedLayout {
  static constexpr int kBoxes = kD / kBoxColumns;
  static constexpr int kKeyBoxBytes = kBackwardKeys * kRowBytes;
  static constexpr int kQueryBoxBytes = kBackwardQueries * kRowBytes;
  static constexpr int kKeyTileBytes = kBoxes * kKeyBoxBytes;
  static constexpr int kQueryTileBytes = kBoxes * kQueryBoxBytes;
  static constexpr int kScoreGradBytes = kBackwardKeys * kRowBytes;
  static constexpr int kK = 0;
  static constexpr int kV = kK + kKeyTileBytes;
  static constexpr int kQ = kV + kKeyTileBytes;
  static constexpr int kDout = kQ + kBackwardStages * kQueryTileBytes;
  static constexpr int kScoreGrads = kDout + kBackwardStages * kQueryTileBytes;
  static constexpr int kLse = kScoreGrads + 2 * kScoreGradBytes;
  static constexpr int kDelta = kLse + kBackwardStages * kBackwardQueries * static_cast<int>(sizeof(float));
  static constexpr int kBarriers = kDelta + kBackwardStages * kBackwardQueries * static_cast<int>(sizeof(float));
  static constexpr int kBytes = kBarriers + static_cast<int>(sizeof(BackwardBarriers)) + 1024;
};

// The work of one CTA: kv head `kv`, keys [key0, key0 + 128), query tiles [query_begin, + 64 tiles) of
// each of the group's query heads.
struct BackwardBlock {
  int64_t kv, key0, query_begin;
  int tiles;
  TileHead kv_head;  // kv as TMA's coordinates, worked out before the warps specialise (the producer's few
                     // registers hold no 64-bit division)
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

constexpr int kBackwardConsumerWarps = kBackwardConsumers * 4;
// Named barriers (0 is __syncthreads): both consumers' dS^T is in shared memory; both are done reading
// K; consumer c's dk and dv rows are staged for TMA (3 + c).
constexpr int kScoreGradsBarrier = 1;
constexpr int kKeysReadBarrier = 2;
constexpr int kFirstStoreBarrier = 3;

// --- producer -------------------------------------------------------------------------------------------

// Warp 0's lane 0 issues every TMA copy; warp 1 copies lse and delta rows (too few bytes, and lse's rows
// not 16-byte aligned for TMA at ragged lengths) with ordinary loads, arriving on the same full barrier.
template <int kD>
__device__ __forceinline__ void load_backward_tiles(const CUtensorMap* q_map, const CUtensorMap* k_map,
                                                    const CUtensorMap* v_map, const CUtensorMap* dout_map,
                                                    const AttentionProblem& shape, const float* lse, const float* delta,
                                                    unsigned char* tiles, BackwardBarriers& barriers,
                                                    const BackwardBlock& block) {
  using Layout = BackwardSharedLayout<kD>;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  if (warp == 0 && lane == 0) {
    mbarrier_expect_bytes(&barriers.keys_full, 2 * Layout::kKeyTileBytes);
    const int key0 = static_cast<int>(block.key0);
    tma_load_tile<Layout::kBoxes>(tiles + Layout::kK, Layout::kKeyBoxBytes, k_map, key0, block.kv_head,
                                  &barriers.keys_full);
    tma_load_tile<Layout::kBoxes>(tiles + Layout::kV, Layout::kKeyBoxBytes, v_map, key0, block.kv_head,
                                  &barriers.keys_full);
  }
  if (warp > 1 || (warp == 0 && lane > 0)) return;
  const int64_t lq = shape.query_length;
  float* lse_stages = reinterpret_cast<float*>(tiles + Layout::kLse);
  float* delta_stages = reinterpret_cast<float*>(tiles + Layout::kDelta);
  for (int64_t head = 0; head < shape.group; ++head) {
    const int64_t bh = block.kv * shape.group + head;
    for (int t = 0; t < block.tiles; ++t) {
      const int64_t n = head * block.tiles + t, i0 = block.query_begin + int64_t{t} * kBackwardQueries;
      const int stage = static_cast<int>(n % kBackwardStages);
      mbarrier_wait(&barriers.empty[stage], (n / kBackwardStages + 1) % 2);
      if (warp == 0) {
        mbarrier_expect_bytes(&barriers.full[stage], 2 * Layout::kQueryTileBytes);
        const int offset = stage * Layout::kQueryTileBytes, row = static_cast<int>(i0);
        // Query head `head` of the kv head's group: the group's heads are consecutive heads of one batch.
        const TileHead query_head{block.kv_head.head * static_cast<int>(shape.group) + static_cast<int>(head),
                                  block.kv_head.batch};
        tma_load_tile<Layout::kBoxes>(tiles + Layout::kQ + offset, Layout::kQueryBoxBytes, q_map, row, query_head,
                                      &barriers.full[stage]);
        tma_load_tile<Layout::kBoxes>(tiles + Layout::kDout + offset, Layout::kQueryBoxBytes, dout_map, row,
                                      query_head, &barriers.full[stage]);
      } else {
        // Rows past the last query get 0: their pairs are masked, and a finite lse keeps them from NaN.
#pragma unroll
        for (int r = lane; r < kBackwardQueries; r += kWarpSize) {
          const int64_t row = i0 + r;
          lse_stages[stage * kBackwardQueries + r] = row < lq ? lse[bh * lq + row] : 0.0f;
          delta_stages[stage * kBackwardQueries + r] = row < lq ? delta[bh * lq + row] : 0.0f;
        }
        mbarrier_arrive(&barriers.full[stage]);  // release: the stores above are seen by whoever waits
      }
    }
  }
}

// --- consumers ------------------------------------------------------------------------------------------

// c (S^T or dP^T: the warpgroup's 64 keys x 64 queries) = rows (K or V, K-major) times the query tile (q
// or dout, K-major)^T: kD / 16 wgmmas, a k16 step being 32 bytes of every row, four of them a box.
template <typename T, int kD>
__device__ __forceinline__ void issue_keys_times_queries(float (&c)[kBackwardQueries / 8][4], uint32_t key_rows,
                                                         uint32_t query_tile) {
  using Layout = BackwardSharedLayout<kD>;
#pragma unroll
  for (int step = 0; step < kD / 16; ++step) {
    const uint32_t column_bytes = step % 4 * 32;
    wgmma_64xNx16_shared<T, kBackwardQueries, 0, 0>(
        c, k_major_descriptor(key_rows + step / 4 * Layout::kKeyBoxBytes + column_bytes),
        k_major_descriptor(query_tile + step / 4 * Layout::kQueryBoxBytes + column_bytes), step > 0);
  }
}

// c (dv or dk: 64 keys x kD) += a (P^T or dS^T, A fragments of 16 queries each) times the query tile
// (dout or q), whose 16 rows a step are read MN-major.
template <typename T, int kD>
__device__ __forceinline__ void issue_accumulate_over_queries(float (&c)[kD / 8][4],
                                                              const uint32_t (&a)[kBackwardQueries / 16][4],
                                                              uint32_t query_tile) {
  using Layout = BackwardSharedLayout<kD>;
#pragma unroll
  for (int step = 0; step < kBackwardQueries / 16; ++step) {
    wgmma_64xNx16_from_registers<T, kD>(
        c, a[step], mn_major_descriptor(query_tile + step * 16 * kRowBytes, Layout::kQueryBoxBytes));
  }
}

// dq (64 queries x kD / 2 columns from the consumer's column0) = dS K: A = dS, read MN-major out of the
// dS^T buffer (a row of keys holds the 64 queries contiguously), B = the columns of K, MN-major (a row
// of keys holds the columns contiguously); 16 keys a step over all 128.
template <typename T, int kD>
__device__ __forceinline__ void issue_query_grads(float (&dq)[kD / 16][4], uint32_t score_grads, uint32_t key_columns) {
  using Layout = BackwardSharedLayout<kD>;
#pragma unroll
  for (int step = 0; step < kBackwardKeys / 16; ++step) {
    const uint32_t rows = step * 16 * kRowBytes;
    wgmma_64xNx16_shared<T, kD / 2, 1, 1>(dq, mn_major_descriptor(score_grads + rows, Layout::kScoreGradBytes),
                                          mn_major_descriptor(key_columns + rows, Layout::kKeyBoxBytes), step > 0);
  }
}

// A consumer warpgroup: its 64 keys against every query tile of the block, then its rows of dk and dv.
template <typename T, int kD>
__device__ __forceinline__ void attend_backward(const AttentionProblem& shape, const CUtensorMap* dk_map,
                                                const CUtensorMap* dv_map, float* dq_accumulator,
                                                unsigned char* tiles, BackwardBarriers& barriers,
                                                const BackwardBlock& block, int consumer) {
  using Layout = BackwardSharedLayout<kD>;
  constexpr int kDqColumns = kD / 2;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize % 4, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const VisibleKeys visible(shape);
  const int64_t lq = shape.query_length, d = shape.head_dim;
  const int64_t keys0 = block.key0 + consumer * kConsumerKeys;  // the warpgroup's first key
  const int64_t key0 = keys0 + warp * 16 + lane / 4;            // the thread's keys: key0 and key0 + 8
  unsigned char* k_rows = tiles + Layout::kK + consumer * kConsumerKeys * kRowBytes;
  unsigned char* v_rows = tiles + Layout::kV + consumer * kConsumerKeys * kRowBytes;
  const uint32_t k_rows_address = shared_address(k_rows), v_rows_address = shared_address(v_rows);
  const uint32_t q_stages = shared_address(tiles + Layout::kQ), dout_stages = shared_address(tiles + Layout::kDout);
  const int dq_column0 = consumer * kDqColumns;
  // The consumer's dq columns of K: a box, or (tile width 64) half of one, 64 bytes into each row.
  const uint32_t k_dq_columns =
      shared_address(tiles + Layout::kK) + dq_column0 / 64 * Layout::kKeyBoxBytes + dq_column0 % 64 * 2;
  const float* lse_stages = reinterpret_cast<const float*>(tiles + Layout::kLse);
  const float* delta_stages = reinterpret_cast<const float*>(tiles + Layout::kDelta);
  const float scale_log2 = static_cast<float>(shape.scale) * kLog2e;

  float dk[kD / 8][4] = {}, dv[kD / 8][4] = {};
  mbarrier_wait(&barriers.keys_full, 0);
  for (int64_t head = 0; head < shape.group; ++head) {
    float* dq_head = dq_accumulator + (block.kv * shape.group + head) * lq * d;
    for (int t = 0; t < block.tiles; ++t) {
      const int64_t n = head * block.tiles + t, i0 = block.query_begin + int64_t{t} * kBackwardQueries;
      const int stage = static_cast<int>(n % kBackwardStages);
      const uint32_t q_tile = q_stages + stage * Layout::kQueryTileBytes;
      const uint32_t dout_tile = dout_stages + stage * Layout::kQueryTileBytes;
      unsigned char* score_grads = tiles + Layout::kScoreGrads + n % 2 * Layout::kScoreGradBytes;
      mbarrier_wait(&barriers.full[stage], n / kBackwardStages % 2);

      float s[kBackwardQueries / 8][4], dp[kBackwardQueries / 8][4];  // S^T, dP^T
      wgmma_fence();
      issue_keys_times_queries<T, kD>(s, k_rows_address, q_tile);
      issue_keys_times_queries<T, kD>(dp, v_rows_address, dout_tile);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(s);
      fence_registers(dp);
      // Only tiles that hold a masked pair (or padding) for some key of this warpgroup pay for the mask.
      const float* lse_tile = lse_stages + stage * kBackwardQueries;
      const float* delta_tile = delta_stages + stage * kBackwardQueries;
      if (visible.sees_all(i0, i0 + kBackwardQueries, keys0, keys0 + kConsumerKeys)) {
        probabilities_and_score_grads<false, kBackwardQueries>(s, dp, lse_tile, delta_tile, scale_log2, visible,
                                                               key0, i0);
      } else {
        probabilities_and_score_grads<true, kBackwardQueries>(s, dp, lse_tile, delta_tile, scale_log2, visible, key0,
                                                              i0);
      }
      uint32_t p[kBackwardQueries / 16][4], ds[kBackwardQueries / 16][4];
#pragma unroll
      for (int k = 0; k < kBackwardQueries / 16; ++k) {
        a_fragment_from_accumulators<T>(p[k], s[2 * k], s[2 * k + 1]);
        a_fragment_from_accumulators<T>(ds[k], dp[2 * k], dp[2 * k + 1]);
      }
      // dS^T into the warpgroup's 64 rows of this step's buffer, before wgmma may read ds (registers an
      // in-flight wgmma reads must not be touched).
      store_swizzled_rows<T, kBackwardQueries>(score_grads + consumer * kConsumerKeys * kRowBytes,
                                               Layout::kScoreGradBytes, dp, 1.0f);
      fence_registers(dv);
      fence_registers(dk);
      fence_registers(p);
      fence_registers(ds);
      wgmma_fence();
      issue_accumulate_over_queries<T, kD>(dv, p, dout_tile);
      issue_accumulate_over_queries<T, kD>(dk, ds, q_tile);
      wgmma_commit();
      // wgmma reads shared memory through the async proxy: fence the dS^T stores for it, then wait for
      // the other consumer's half. dv and dk run on meanwhile.
      fence_shared_for_tma();
      named_barrier_sync(kScoreGradsBarrier, kBackwardConsumers * kWarpgroupThreads);
      float dq[kDqColumns / 8][4];
      wgmma_fence();
      issue_query_grads<T, kD>(dq, shared_address(score_grads), k_dq_columns);
      wgmma_commit();
      wgmma_wait<0>();
      fence_registers(dq);
      fence_registers(dv);
      fence_registers(dk);
      // The stage's q, dout (wgmma) and lse, delta (every lane, hence the __syncwarp) are no longer read.
      __syncwarp();
      if (lane == 0) mbarrier_arrive(&barriers.empty[stage]);
      add_to_dq<kDqColumns>(dq_head, dq, i0 + warp * 16, dq_column0, lq, static_cast<int>(d));
    }
  }

  // dk * scale and dv through the warpgroup's own rows of the K and V tiles, written by TMA (rows past
  // the last key and columns past head_dim skipped). The other consumer's dq may still read these rows of
  // K until it reaches the barrier.
  named_barrier_sync(kKeysReadBarrier, kBackwardConsumers * kWarpgroupThreads);
  store_swizzled_rows<T, kD>(k_rows, Layout::kKeyBoxBytes, dk, static_cast<float>(shape.scale));
  store_swizzled_rows<T, kD>(v_rows, Layout::kKeyBoxBytes, dv, 1.0f);
  fence_shared_for_tma();
  named_barrier_sync(kFirstStoreBarrier + consumer, kWarpgroupThreads);
  if (threadIdx.x % kWarpgroupThreads == 0 && keys0 < shape.key_length) {
    tma_store_tile<Layout::kBoxes>(dk_map, k_rows, Layout::kKeyBoxBytes, static_cast<int>(keys0), block.kv_head);
    tma_store_tile<Layout::kBoxes>(dv_map, v_rows, Layout::kKeyBoxBytes, static_cast<int>(keys0), block.kv_head);
    tma_store_wait_for_reads();
  }
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <typename T, int kD>
__global__ void __launch_bounds__(kBackwardThreads, 1)
attention_backward_hopper_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                                 const __grid_constant__ CUtensorMap v_map,
                                 const __grid_constant__ CUtensorMap dout_map,
                                 const __grid_constant__ CUtensorMap dk_map,
                                 const __grid_constant__ CUtensorMap dv_map, AttentionProblem shape,
                                 const float* __restrict__ lse, const float* __restrict__ delta,
                                 float* __restrict__ dq_accumulator) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Layout = BackwardSharedLayout<kD>;
  extern __shared__ unsigned char shared_bytes[];
  unsigned char* tiles = swizzle_aligned(shared_bytes);
  BackwardBarriers& barriers = *reinterpret_cast<BackwardBarriers*>(tiles + Layout::kBarriers);

  // The mma.sync kernel's grid order: consecutive CTAs share a kv head, whose queries' q and dout stay in
  // L2, and the first key blocks (seen by the most queries when causal) start first.
  const VisibleKeys visible(shape);
  const int64_t lk = shape.key_length, key_blocks = ceil_div(lk, kBackwardKeys);
  BackwardBlock block;
  block.kv = blockIdx.x / key_blocks;
  block.key0 = blockIdx.x % key_blocks * kBackwardKeys;
  block.kv_head = tile_head(block.kv, shape.heads / shape.group);
  const int64_t key_end = min(block.key0 + kBackwardKeys, lk);
  // Query tiles that see any key of the block (none, for keys no query sees: dk = dv = 0).
  block.query_begin = visible.first_query(block.key0) / kBackwardQueries * kBackwardQueries;
  const int64_t query_end = visible.end_query(key_end - 1);
  block.tiles = query_end > block.query_begin
                    ? static_cast<int>(ceil_div(query_end - block.query_begin, kBackwardQueries))
                    : 0;

  if (threadIdx.x == 0) {
    mbarrier_init(&barriers.keys_full, 1);
#pragma unroll
    for (int stage = 0; stage < kBackwardStages; ++stage) {
      mbarrier_init(&barriers.full[stage], 1 + kWarpSize);  // the TMA thread's arrive, the lse warp's 32
      mbarrier_init(&barriers.empty[stage], kBackwardConsumerWarps);
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  run_warp_specialised(
      [&] { load_backward_tiles<kD>(&q_map, &k_map, &v_map, &dout_map, shape, lse, delta, tiles, barriers, block); },
      [&](int consumer) {
        attend_backward<T, kD>(shape, &dk_map, &dv_map, dq_accumulator, tiles, barriers, block, consumer);
      });
#else
  __trap();  // only the sm_90a image holds this kernel, and the launcher starts it on no other GPU
#endif
}

// --- launcher ------------------------------------------------------------------------------------

namespace {

// delta, the zeroed dq accumulator, the main kernel, grad_q: maps are q, k, v, dout, dk, dv.
template <typename T, int kD>
void launch_hopper_backward(const AttentionShape& shape, const CUtensorMap (&maps)[6], const void* grad_out,
                            const void* out, const void* lse, void* grad_q, float* workspace, cudaStream_t stream) {
  const int64_t rows = shape.batch_heads * shape.query_length, d = shape.head_dim;
  float* dq_accumulator = workspace;  // then delta: attention_backward_workspace_size's layout
  float* delta = dq_accumulator + rows * d;
  launch_attention_backward_delta<T, kD>(shape, static_cast<const T*>(grad_out), static_cast<const T*>(out), delta,
                                         stream);
  cudaMemsetAsync(dq_accumulator, 0, rows * d * sizeof(float), stream);
  constexpr int kBytes = BackwardSharedLayout<kD>::kBytes;
  auto* kernel = attention_backward_hopper_kernel<T, kD>;
  // Beyond 48 KB a kernel's dynamic shared memory must be asked for (per device, so every launch).
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  const auto blocks =
      static_cast<unsigned>(shape.batch_heads / shape.group * ceil_div(shape.key_length, kBackwardKeys));
  const AttentionProblem& problem = shape;  // the kernel takes no strides: its maps hold them (kernels.h)
  kernel<<<blocks, kBackwardThreads, kBytes, stream>>>(maps[0], maps[1], maps[2], maps[3], maps[4], maps[5], problem,
                                                       static_cast<const float*>(lse), delta, dq_accumulator);
  launch_attention_backward_dq<T, kD>(shape, dq_accumulator, static_cast<T*>(grad_q), stream);
}

}  // namespace

bool launch_attention_backward_hopper(DType dtype, const AttentionShape& shape, const void* grad_out, const void* q,
                                      const void* k, const void* v, const void* out, const void* lse, void* grad_q,
                                      void* grad_k, void* grad_v, void* workspace, void* stream) {
  const int64_t batch = shape.batch_heads / shape.heads, kv_heads = shape.heads / shape.group, d = shape.head_dim;
  const int64_t lq = shape.query_length, lk = shape.key_length;
  // TMA's coordinates, the kernel's key indices and the grid are 32-bit.
  const bool fits = lq < INT_MAX && lk < INT_MAX && batch * kv_heads * ceil_div(lk, kBackwardKeys) < INT_MAX;
  if (!fits || !hopper_attention_applies(dtype, d, 128)) return false;
  CUtensorMap maps[6];  // q, k, v, dout, dk, dv
  if (!encode_swizzled_tensor_map(&maps[0], dtype, q, batch, shape.heads, lq, d, shape.q, kBackwardQueries) ||
      !encode_swizzled_tensor_map(&maps[1], dtype, k, batch, kv_heads, lk, d, shape.k, kBackwardKeys) ||
      !encode_swizzled_tensor_map(&maps[2], dtype, v, batch, kv_heads, lk, d, shape.v, kBackwardKeys) ||
      !encode_swizzled_tensor_map(&maps[3], dtype, grad_out, batch, shape.heads, lq, d, shape.grad_out,
                                  kBackwardQueries) ||
      !encode_swizzled_tensor_map(&maps[4], dtype, grad_k, batch, kv_heads, lk, d, shape.grad_k, kConsumerKeys) ||
      !encode_swizzled_tensor_map(&maps[5], dtype, grad_v, batch, kv_heads, lk, d, shape.grad_v, kConsumerKeys)) {
    return false;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  auto* scratch = static_cast<float*>(workspace);
  const bool narrow = d <= 64;  // tile width 64, else 128
  if (dtype == DType::BFloat16) {
    narrow ? launch_hopper_backward<__nv_bfloat16, 64>(shape, maps, grad_out, out, lse, grad_q, scratch, s)
           : launch_hopper_backward<__nv_bfloat16, 128>(shape, maps, grad_out, out, lse, grad_q, scratch, s);
  } else {
    narrow ? launch_hopper_backward<__half, 64>(shape, maps, grad_out, out, lse, grad_q, scratch, s)
           : launch_hopper_backward<__half, 128>(shape, maps, grad_out, out, lse, grad_q, scratch, s);
  }
  return true;
}

}  // namespace kernel_ladder
