// Flash attention forward on Hopper (sm_90a): FlashAttention-3's plan of wgmma, TMA and warp specialisation.
//
// What it computes: exactly what attention_forward.cu computes (the same AttentionShape and masks, out in
// the input dtype, lse = natural log-sum-exp of the scaled scores in float32), for float16 / bfloat16 and
// head dims up to 128. launch_attention_forward tries this kernel first and runs its mma.sync kernel when
// launch_attention_forward_hopper says it does not apply (another GPU, another dtype, a wider head).
//
// Kernel
//   attention_forward_hopper_kernel<T, kD>   one CTA per 128 queries of one (batch, head), 3 warpgroups:
//     warpgroup 0, the producer: one thread issues TMA copies, the q tile once, then K and V tiles of 128
//       keys into a ring of 2 stages. Each stage has a "full" mbarrier (TMA's bytes have landed) and an
//       "empty" one (the 8 consumer warps are done reading it). It needs few registers and hands the rest
//       to the consumers (setmaxnreg: 24 here, 240 there).
//     warpgroups 1 and 2, the consumers: 64 queries each. S = q K^T is kD / 16 wgmmas m64n128k16 whose
//       operands the tensor cores read from shared memory themselves; the online softmax runs in registers
//       as in the mma.sync kernel; O += P V takes P from registers (rounded to T, already in the A-fragment
//       layout) and V from shared memory, read transposed through its descriptor.
//
// The one idea that makes it fast: the tensor cores never wait for the softmax
//   wgmma is asynchronous. Each consumer issues S(j) = q K(j)^T and then O += P(j-1) V(j-1), and computes
//   the softmax of S(j) while the second product is still running: the exp unit (16 results a clock per
//   SM) and the tensor cores work at the same time (registers: S, O and P live at once: 64 + kD / 2 + 32).
//   Across warpgroups, two named barriers make the consumers take turns issuing their products, so one's
//   softmax runs while the other's matmuls keep the tensor cores busy ("ping-pong"). And no consumer
//   thread spends an instruction or a register on an address or a copy: TMA moves every tile, zero-fills
//   the rows past a sequence's end and the columns past head_dim, and skips them on the way out.
//
// Limits
//   float16 / bfloat16; head_dim a multiple of 8 up to 128 (tile width 64 for d <= 64, else 128); any
//   lengths below 2^31 (TMA's coordinates are 32-bit); q, k, v, out 16-byte aligned (ops.cpp checks). Built
//   only when nvcc targets sm_90a (cuda_kernels/ops.py adds it, and -DKERNEL_LADDER_SM90A, when it sees an
//   H100-class GPU); runs only on compute capability 9.0.
//
// Check
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DKERNEL_LADDER_SM90A -Xptxas -v,-warn-spills \
//        -c cuda_kernels/attention_forward_hopper.cu -o /tmp/attention_forward_hopper.o
//   python -m pytest tests -k "attention and (cuda or hopper)"    (on a GPU; both kernels, float64 reference)
#include <cudaTypedefs.h>  // PFN_cuTensorMapEncodeTiled

#include <atomic>
#include <climits>

#include "attention_mask.h"
#include "hopper.cuh"
#include "tensor_core.cuh"

namespace kernel_ladder {

// The CTA: a producer warpgroup, then two consumer warpgroups of 64 queries each (wgmma's M).
constexpr int kWarpgroupThreads = 128;
constexpr int kConsumerWarpgroups = 2;
constexpr int kHopperThreads = (1 + kConsumerWarpgroups) * kWarpgroupThreads;
constexpr int kWarpgroupQueries = 64;
constexpr int kHopperQueries = kConsumerWarpgroups * kWarpgroupQueries;
// Keys per K and V tile: S is one m64n128 accumulator, 64 floats a thread, beside O and P.
constexpr int kHopperKeyTile = 128;
constexpr int kHopperStages = 2;

// Shared memory is tiles of 128 rows (queries or keys) cut into boxes of 64 columns: 128-byte rows, TMA's
// widest swizzled box.
constexpr int kBoxColumns = 64;
constexpr int kRowBytes = 128;
constexpr int kBoxBytes = 128 * kRowBytes;

struct HopperBarriers {
  uint64_t q_full;
  uint64_t k_full[kHopperStages], k_empty[kHopperStages];
  uint64_t v_full[kHopperStages], v_empty[kHopperStages];
};

// q, then the K stages, the V stages and the barriers: 160 KB at tile width 128, 80 KB at 64. 1 KB more
// lets the kernel start the tiles on a 1024-byte boundary, which the swizzle needs (hopper.cuh).
template <int kD>
struct HopperSharedLayout {
  static constexpr int kTileBytes = kD / kBoxColumns * kBoxBytes;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kTileBytes;
  static constexpr int kV = kK + kHopperStages * kTileBytes;
  static constexpr int kBarriers = kV + kHopperStages * kTileBytes;
  static constexpr int kBytes = kBarriers + static_cast<int>(sizeof(HopperBarriers)) + 1024;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

constexpr int kConsumerWarps = kConsumerWarpgroups * 4;
// 384 threads start with 168 registers each (65,536 / 384, rounded down to a multiple of 8). The producer
// hands back 144 a thread and the consumers take 72 more: 128 x 24 + 256 x 240 = 64,512 of 65,536.
constexpr int kProducerRegisters = 24;
constexpr int kConsumerRegisters = 240;
// Named barriers: 1 and 2 are the consumers' turns to issue matmuls, 3 and 4 their epilogues (0 is
// __syncthreads).
constexpr int kFirstTurnBarrier = 1;
constexpr int kFirstEpilogueBarrier = 3;

// --- producer -------------------------------------------------------------------------------------------

// Tile t of K or V (keys key_begin + 128 t ...) into stage t % kHopperStages of `stages`, once the
// consumers have released the tile that used that stage before it. The bytes announced are the whole
// box, also where TMA zero-fills rows past the last key.
template <int kD>
__device__ __forceinline__ void load_key_tile(const CUtensorMap* map, unsigned char* stages, uint64_t* full,
                                              uint64_t* empty, int t, int key_begin, int kv_head) {
  const int stage = t % kHopperStages;
  mbarrier_wait(&empty[stage], (t / kHopperStages + 1) % 2);
  mbarrier_expect_bytes(&full[stage], HopperSharedLayout<kD>::kTileBytes);
#pragma unroll
  for (int box = 0; box < kD / kBoxColumns; ++box) {
    tma_load_3d(stages + stage * HopperSharedLayout<kD>::kTileBytes + box * kBoxBytes, map, box * kBoxColumns,
                key_begin + t * kHopperKeyTile, kv_head, &full[stage]);
  }
}

// One thread issues every copy, in the order the consumers use them: q, K(0), then K(j + 1) before V(j),
// since a consumer multiplies q K(j + 1)^T before P(j) V(j).
template <int kD>
__device__ __forceinline__ void load_tiles(const CUtensorMap* q_map, const CUtensorMap* k_map, const CUtensorMap* v_map,
                                           unsigned char* tiles, HopperBarriers& barriers, int query0, int bh,
                                           int kv_head, int key_begin, int key_tiles) {
  using Layout = HopperSharedLayout<kD>;
  prefetch_tensor_map(k_map);
  prefetch_tensor_map(v_map);
  mbarrier_expect_bytes(&barriers.q_full, Layout::kTileBytes);
#pragma unroll
  for (int box = 0; box < kD / kBoxColumns; ++box) {
    tma_load_3d(tiles + Layout::kQ + box * kBoxBytes, q_map, box * kBoxColumns, query0, bh, &barriers.q_full);
  }
  for (int t = 0; t <= key_tiles; ++t) {
    if (t < key_tiles) {
      load_key_tile<kD>(k_map, tiles + Layout::kK, barriers.k_full, barriers.k_empty, t, key_begin, kv_head);
    }
    if (t > 0) {
      load_key_tile<kD>(v_map, tiles + Layout::kV, barriers.v_full, barriers.v_empty, t - 1, key_begin, kv_head);
    }
  }
}

// --- consumers ------------------------------------------------------------------------------------------

// S = q K^T for the warpgroup's 64 queries (q_rows: their rows of the q tile) and one key tile: kD / 16
// wgmmas, the first overwriting S. A k16 step is 32 bytes of every row; four of them cross a box.
template <typename T, int kD>
__device__ __forceinline__ void issue_scores(float (&s)[kHopperKeyTile / 8][4], uint32_t q_rows, uint32_t k_tile) {
#pragma unroll
  for (int step = 0; step < kD / 16; ++step) {
    const uint32_t columns = step / 4 * kBoxBytes + step % 4 * 32;
    wgmma_64x128x16<T>(s, k_major_descriptor(q_rows + columns), k_major_descriptor(k_tile + columns), step > 0);
  }
}

// O += P V: P's 16-key slices are A fragments in registers; V's 16 rows of keys a step, MN-major.
template <typename T, int kD>
__device__ __forceinline__ void issue_output(float (&o)[kD / 8][4], const uint32_t (&p)[kHopperKeyTile / 16][4],
                                             uint32_t v_tile) {
#pragma unroll
  for (int step = 0; step < kHopperKeyTile / 16; ++step) {
    wgmma_64xNx16_from_registers<T, kD>(o, p[step], mn_major_descriptor(v_tile + step * 16 * kRowBytes, kBoxBytes));
  }
}

// The online softmax of one tile, as in the mma.sync kernel (online_softmax there), except that o is not
// touched: a P V product may still be accumulating into it. s becomes P = 2^(s * scale_log2 - m) with m
// the new running max (log2 units) of each of the thread's two rows, row_sum is rescaled and grows by
// the tile's P, and `rescale` returns 2^(m_old - m_new) for o once that product has completed.
// kMasked: keys outside [first_key, end_key) of a row get s = -inf first (key0: the tile's first key).
template <bool kMasked>
__device__ __forceinline__ void online_softmax_of_tile(float (&s)[kHopperKeyTile / 8][4], float (&row_max)[2],
                                                       float (&row_sum)[2], float (&rescale)[2], float scale_log2,
                                                       const int (&first_key)[2], const int (&end_key)[2], int key0) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the warp's 16
    // The thread's columns relative to the row's visible keys: key0 + 2 (lane % 4) + 8 n + e.
    const int lowest = first_key[half] - key0 - lane % 4 * 2, past = end_key[half] - key0 - lane % 4 * 2;
    float tile_max = row_max[half];
#pragma unroll
    for (int n = 0; n < kHopperKeyTile / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& score = s[n][2 * half + e];
        score *= scale_log2;
        if (kMasked && (n * 8 + e < lowest || n * 8 + e >= past)) score = -INFINITY;
        tile_max = fmaxf(tile_max, score);
      }
    }
    // The 4 lanes of a quad hold the same two rows: two shuffles give each the row's max.
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
    tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
    // A row that has seen no visible key yet keeps max -inf; subtracting 0 instead keeps its
    // 2^(-inf) = 0 from turning into 2^(-inf + inf) = NaN.
    const float shift = tile_max == -INFINITY ? 0.0f : tile_max;
    rescale[half] = exp2_approx(row_max[half] - shift);
    row_max[half] = tile_max;
    row_sum[half] *= rescale[half];
#pragma unroll
    for (int n = 0; n < kHopperKeyTile / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        float& p = s[n][2 * half + e];
        p = exp2_approx(p - shift);
        row_sum[half] += p;  // this lane's columns only; the quad's partial sums meet at the end
      }
    }
  }
}

// out = o / l and lse = ln 2 * (m + log2 l) for the warpgroup's rows below query_length. o is rounded to T
// into the warpgroup's own 64 rows of the q tile (its last q K^T has completed), in the 128-byte swizzled
// layout, and TMA stores them: rows past the last query and columns past head_dim are not written.
// Stores of one instruction go to 16-byte chunk n % 8 of their row XOR the row's index mod 8 (= lane / 4):
// 8 rows x 4 lanes cover all 32 banks.
template <typename T, int kD>
__device__ __forceinline__ void store_rows(float (&o)[kD / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                           unsigned char* q_rows, const CUtensorMap* out_map, float* lse, int64_t bh,
                                           int64_t rows0, int64_t query_length, int consumer) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize % 4, lane = static_cast<int>(threadIdx.x) % kWarpSize;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 1);
    row_sum[half] += __shfl_xor_sync(0xffffffffu, row_sum[half], 2);
    const int64_t row = rows0 + warp * 16 + lane / 4 + 8 * half;
    if (lane % 4 == 0 && row < query_length) {
      lse[bh * query_length + row] = (row_max[half] + __log2f(row_sum[half])) * kLn2;
    }
    const float inverse_sum = 1.0f / row_sum[half];
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      o[n][2 * half] *= inverse_sum;
      o[n][2 * half + 1] *= inverse_sum;
    }
  }
  const int g = lane / 4;
#pragma unroll
  for (int n = 0; n < kD / 8; ++n) {
    unsigned char* top = q_rows + n / 8 * kBoxBytes + (warp * 16 + g) * kRowBytes + (n % 8 ^ g) * 16 + lane % 4 * 4;
    *reinterpret_cast<uint32_t*>(top) = pack_pair<T>(o[n][0], o[n][1]);
    *reinterpret_cast<uint32_t*>(top + 8 * kRowBytes) = pack_pair<T>(o[n][2], o[n][3]);
  }
  fence_shared_for_tma();
  named_barrier_sync(kFirstEpilogueBarrier + consumer, kWarpgroupThreads);
  if (threadIdx.x % kWarpgroupThreads == 0 && rows0 < query_length) {
#pragma unroll
    for (int box = 0; box < kD / kBoxColumns; ++box) {
      tma_store_3d(out_map, q_rows + box * kBoxBytes, box * kBoxColumns, static_cast<int>(rows0), static_cast<int>(bh));
    }
    tma_store_wait_for_reads();
  }
}

// A consumer warpgroup: its 64 queries against key tiles 0..key_tiles-1 of the CTA's range.
template <typename T, int kD>
__device__ __forceinline__ void attend(const AttentionShape& shape, const CUtensorMap* out_map, float* lse,
                                       unsigned char* tiles, HopperBarriers& barriers, int consumer, int64_t query0,
                                       int64_t bh, int key_begin, int key_tiles) {
  using Layout = HopperSharedLayout<kD>;
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize % 4, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const VisibleKeys visible(shape);
  const int64_t rows0 = query0 + consumer * kWarpgroupQueries;
  // The keys each of the thread's two rows sees; rows past the last query see none (VisibleKeys::sees).
  int first_key[2], end_key[2];
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int64_t row = rows0 + warp * 16 + lane / 4 + 8 * half;
    first_key[half] = static_cast<int>(visible.first_key(row));
    end_key[half] = row < shape.query_length ? static_cast<int>(visible.end_key(row)) : 0;
  }
  unsigned char* q_rows = tiles + Layout::kQ + consumer * kWarpgroupQueries * kRowBytes;
  const uint32_t q_rows_address = shared_address(q_rows);
  const uint32_t k_stages = shared_address(tiles + Layout::kK), v_stages = shared_address(tiles + Layout::kV);
  const float scale_log2 = static_cast<float>(shape.scale) * kLog2e;
  // Only tiles that hold a masked pair for some row of this warpgroup pay for the mask; the warpgroup's
  // rows reach past the last query only in the last query block, whose tiles are then all masked.
  const auto softmax = [&](float (&s)[kHopperKeyTile / 8][4], float (&row_max)[2], float (&row_sum)[2],
                           float (&rescale)[2], int t) {
    const int key0 = key_begin + t * kHopperKeyTile;
    if (visible.sees_all(rows0, rows0 + kWarpgroupQueries, key0, key0 + kHopperKeyTile)) {
      online_softmax_of_tile<false>(s, row_max, row_sum, rescale, scale_log2, first_key, end_key, key0);
    } else {
      online_softmax_of_tile<true>(s, row_max, row_sum, rescale, scale_log2, first_key, end_key, key0);
    }
  };
  // A stage is released by one lane per consumer warp, once the warp's wgmmas reading it have completed.
  const auto release = [&](uint64_t* empty) {
    if (lane == 0) mbarrier_arrive(empty);
  };

  float o[kD / 8][4] = {};
  float s[kHopperKeyTile / 8][4];
  uint32_t p[kHopperKeyTile / 16][4];
  float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f}, rescale[2];

  // Tile 0: S(0), its softmax, P(0). Both warpgroups start at once.
  mbarrier_wait(&barriers.q_full, 0);
  mbarrier_wait(&barriers.k_full[0], 0);
  wgmma_fence();
  issue_scores<T, kD>(s, q_rows_address, k_stages);
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers(s);
  release(&barriers.k_empty[0]);
  softmax(s, row_max, row_sum, rescale, 0);
#pragma unroll
  for (int k = 0; k < kHopperKeyTile / 16; ++k) a_fragment_from_accumulators<T>(p[k], s[2 * k], s[2 * k + 1]);

  // Turns: warpgroup c issues its matmuls after bar.sync on barrier 1 + c, then bar.arrives on the other's.
  // The first consumer's own arrive lets it go first; the second skips its last arrive, which nobody
  // would wait for, so that every barrier's phases are complete when the CTA exits.
  const int my_turn = kFirstTurnBarrier + consumer, other_turn = kFirstTurnBarrier + 1 - consumer;
  if (consumer == 0 && key_tiles > 1) named_barrier_arrive(my_turn, kConsumerWarpgroups * kWarpgroupThreads);
  for (int t = 1; t < key_tiles; ++t) {
    const int stage = t % kHopperStages, previous = (t - 1) % kHopperStages;
    mbarrier_wait(&barriers.k_full[stage], t / kHopperStages % 2);
    named_barrier_sync(my_turn, kConsumerWarpgroups * kWarpgroupThreads);
    fence_registers(s);
    fence_registers(o);
    fence_registers(p);
    wgmma_fence();
    issue_scores<T, kD>(s, q_rows_address, k_stages + stage * Layout::kTileBytes);
    wgmma_commit();
    mbarrier_wait(&barriers.v_full[previous], (t - 1) / kHopperStages % 2);
    wgmma_fence();  // ptxas wants o and p fenced again after the wait's loop (it would insert this: info C7519)
    issue_output<T, kD>(o, p, v_stages + previous * Layout::kTileBytes);
    wgmma_commit();
    if (consumer == 0 || t + 1 < key_tiles) named_barrier_arrive(other_turn, kConsumerWarpgroups * kWarpgroupThreads);
    wgmma_wait<1>();  // S(t) is done; O += P(t-1) V(t-1) runs on during the softmax
    fence_registers(s);
    release(&barriers.k_empty[stage]);
    softmax(s, row_max, row_sum, rescale, t);
    wgmma_wait<0>();
    fence_registers(o);
    fence_registers(p);
    release(&barriers.v_empty[previous]);
#pragma unroll
    for (int n = 0; n < kD / 8; ++n) {
      o[n][0] *= rescale[0];
      o[n][1] *= rescale[0];
      o[n][2] *= rescale[1];
      o[n][3] *= rescale[1];
    }
#pragma unroll
    for (int k = 0; k < kHopperKeyTile / 16; ++k) a_fragment_from_accumulators<T>(p[k], s[2 * k], s[2 * k + 1]);
  }

  // The last tile's O += P V, then the output.
  const int last = (key_tiles - 1) % kHopperStages;
  mbarrier_wait(&barriers.v_full[last], (key_tiles - 1) / kHopperStages % 2);
  fence_registers(o);
  fence_registers(p);
  wgmma_fence();
  issue_output<T, kD>(o, p, v_stages + last * Layout::kTileBytes);
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers(o);
  release(&barriers.v_empty[last]);
  store_rows<T, kD>(o, row_max, row_sum, q_rows, out_map, lse, bh, rows0, shape.query_length, consumer);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <typename T, int kD>
__global__ void __launch_bounds__(kHopperThreads, 1)
attention_forward_hopper_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                                const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap out_map,
                                AttentionShape shape, float* __restrict__ lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Layout = HopperSharedLayout<kD>;
  extern __shared__ unsigned char shared_bytes[];
  unsigned char* tiles = shared_bytes + (1024 - shared_address(shared_bytes) % 1024) % 1024;
  HopperBarriers& barriers = *reinterpret_cast<HopperBarriers*>(tiles + Layout::kBarriers);

  // The mma.sync kernel's grid order: consecutive CTAs share a (batch, head), whose K and V stay in L2,
  // and within it the last query blocks (most keys when causal) start first.
  const VisibleKeys visible(shape);
  const int64_t lq = shape.query_length, query_blocks = ceil_div(lq, kHopperQueries);
  const int64_t bh = blockIdx.x / query_blocks;
  const int64_t i0 = (query_blocks - 1 - blockIdx.x % query_blocks) * kHopperQueries;
  const int64_t i1 = min(i0 + kHopperQueries, lq);
  // Key tiles any query of this CTA sees: [key_begin, key_end) in steps of kHopperKeyTile.
  const int key_begin = static_cast<int>(visible.first_key(i0) / kHopperKeyTile * kHopperKeyTile);
  const int key_tiles = static_cast<int>(ceil_div(visible.end_key(i1 - 1) - key_begin, kHopperKeyTile));

  if (threadIdx.x == 0) {
    mbarrier_init(&barriers.q_full, 1);
#pragma unroll
    for (int stage = 0; stage < kHopperStages; ++stage) {
      mbarrier_init(&barriers.k_full[stage], 1);
      mbarrier_init(&barriers.v_full[stage], 1);
      mbarrier_init(&barriers.k_empty[stage], kConsumerWarps);
      mbarrier_init(&barriers.v_empty[stage], kConsumerWarps);
    }
    mbarrier_init_fence();
  }
  __syncthreads();

  // The role as the compiler can see it is the same across each warp (a broadcast from lane 0): else
  // ptxas must assume wgmma in a divergent path and serializes every one (warning C7520).
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / kWarpgroupThreads, 0);
  if (warpgroup == 0) {
    warpgroup_release_registers<kProducerRegisters>();
    if (threadIdx.x == 0) {
      load_tiles<kD>(&q_map, &k_map, &v_map, tiles, barriers, static_cast<int>(i0), static_cast<int>(bh),
                     static_cast<int>(bh / shape.group), key_begin, key_tiles);
    }
  } else {
    warpgroup_claim_registers<kConsumerRegisters>();
    attend<T, kD>(shape, &out_map, lse, tiles, barriers, warpgroup - 1, i0, bh, key_begin, key_tiles);
  }
#else
  __trap();  // only the sm_90a image holds this kernel, and the launcher starts it on no other GPU
#endif
}

// --- launcher ------------------------------------------------------------------------------------

#ifdef KERNEL_LADDER_SM90A
constexpr bool kBuiltWithHopperImage = true;  // the build added -gencode arch=compute_90a,code=sm_90a
#else
constexpr bool kBuiltWithHopperImage = false;
#endif

namespace {

// cuTensorMapEncodeTiled is a driver (libcuda) function; the runtime hands out its address, so the
// extension needs no -lcuda. Looked up once; null if this driver has none.
PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encoder() {
  static const PFN_cuTensorMapEncodeTiled_v12000 encode = [] {
    void* function = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
    cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &function, 12000, cudaEnableDefault, &found);
#else
    cudaGetDriverEntryPoint("cuTensorMapEncodeTiled", &function, cudaEnableDefault, &found);
#endif
    return found == cudaDriverEntryPointSuccess ? reinterpret_cast<PFN_cuTensorMapEncodeTiled_v12000>(function)
                                                : nullptr;
  }();
  return encode;
}

// A contiguous (matrices, rows, head_dim) tensor of 16-bit values as a TMA tensor map whose boxes are
// box_rows rows x 64 columns, 128-byte swizzled. The sizes (innermost first) bound every box: rows past
// `rows` (a sequence's end, not the next head's first rows) and columns past head_dim read as zero and
// are never written. False if the driver refuses it.
bool encode_tensor_map(CUtensorMap* map, DType dtype, const void* tensor, int64_t matrices, int64_t rows,
                       int64_t head_dim, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encoder();
  if (encode == nullptr) return false;
  const cuuint64_t sizes[3] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(rows),
                               static_cast<cuuint64_t>(matrices)};
  const cuuint64_t strides[2] = {static_cast<cuuint64_t>(head_dim) * 2, static_cast<cuuint64_t>(rows * head_dim) * 2};
  const cuuint32_t box[3] = {kBoxColumns, static_cast<cuuint32_t>(box_rows), 1};
  const cuuint32_t element_steps[3] = {1, 1, 1};
  const CUtensorMapDataType type =
      dtype == DType::BFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, type, 3, const_cast<void*>(tensor), sizes, strides, box, element_steps,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

// The sm_90a image runs on compute capability 9.0 only (H100, H200, GH200). Asked once per device: a
// static array is zero ("not asked yet") before the first call.
bool current_device_is_hopper() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> answers[kMaxDevices];  // 1: yes, 2: no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= kMaxDevices) return false;
  int answer = answers[device].load(std::memory_order_relaxed);
  if (answer == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    answer = major == 9 && minor == 0 ? 1 : 2;
    answers[device].store(answer, std::memory_order_relaxed);
  }
  return answer == 1;
}

template <typename T, int kD>
void launch_hopper_kernel(const AttentionShape& shape, const CUtensorMap (&maps)[4], void* lse, cudaStream_t stream) {
  constexpr int kBytes = HopperSharedLayout<kD>::kBytes;
  auto* kernel = attention_forward_hopper_kernel<T, kD>;
  // Beyond 48 KB a kernel's dynamic shared memory must be asked for (per device, so every launch).
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kBytes);
  const auto blocks = static_cast<unsigned>(shape.batch_heads * ceil_div(shape.query_length, kHopperQueries));
  kernel<<<blocks, kHopperThreads, kBytes, stream>>>(maps[0], maps[1], maps[2], maps[3], shape,
                                                     static_cast<float*>(lse));
}

}  // namespace

bool launch_attention_forward_hopper(DType dtype, const AttentionShape& shape, const void* q, const void* k,
                                     const void* v, void* out, void* lse, void* stream) {
  const bool sixteen_bit = dtype == DType::Float16 || dtype == DType::BFloat16;
  // TMA's coordinates, the kernel's key indices and the grid are 32-bit.
  const bool fits = shape.query_length < INT_MAX && shape.key_length < INT_MAX &&
                    shape.batch_heads * ceil_div(shape.query_length, kHopperQueries) < INT_MAX;
  if (!kBuiltWithHopperImage || !hopper_attention_enabled() || !sixteen_bit || shape.head_dim > 128 || !fits ||
      !current_device_is_hopper()) {
    return false;
  }
  const int64_t kv_heads = shape.batch_heads / shape.group, d = shape.head_dim;
  CUtensorMap maps[4];  // q, k, v, out
  if (!encode_tensor_map(&maps[0], dtype, q, shape.batch_heads, shape.query_length, d, kHopperQueries) ||
      !encode_tensor_map(&maps[1], dtype, k, kv_heads, shape.key_length, d, kHopperKeyTile) ||
      !encode_tensor_map(&maps[2], dtype, v, kv_heads, shape.key_length, d, kHopperKeyTile) ||
      !encode_tensor_map(&maps[3], dtype, out, shape.batch_heads, shape.query_length, d, kWarpgroupQueries)) {
    return false;
  }
  const auto s = static_cast<cudaStream_t>(stream);
  const bool narrow = d <= 64;  // tile width 64, else 128
  if (dtype == DType::BFloat16) {
    narrow ? launch_hopper_kernel<__nv_bfloat16, 64>(shape, maps, lse, s)
           : launch_hopper_kernel<__nv_bfloat16, 128>(shape, maps, lse, s);
  } else {
    narrow ? launch_hopper_kernel<__half, 64>(shape, maps, lse, s)
           : launch_hopper_kernel<__half, 128>(shape, maps, lse, s);
  }
  return true;
}

}  // namespace kernel_ladder
