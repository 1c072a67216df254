// Flash attention forward on Hopper (sm_90a): FlashAttention-3's plan of wgmma, TMA and warp specialisation.
//
// What it computes: exactly what attention_forward.cu computes (the same AttentionShape and masks, out in
// the input dtype, lse = natural log-sum-exp of the scaled scores in float32), for float16 / bfloat16 and
// head dims up to 256. launch_attention_forward tries this kernel first and runs its mma.sync kernel when
// launch_attention_forward_hopper says it does not apply (another GPU, another dtype).
//
// Kernel
//   attention_forward_hopper_kernel<T, kD>   one CTA per 128 queries of one (batch, head), 3 warpgroups;
//   kD, the tile width, is the smallest of 64, 80, 96, 128, 192, 256 that holds head_dim, and sets the
//   key tile (HopperTile): 128 keys up to kD = 128, 112 at 192, 80 at 256.
//     warpgroup 0, the producer: one thread issues TMA copies, the q tile once, then K and V tiles into a
//       ring of 2 stages. Each stage has a "full" mbarrier (TMA's bytes have landed) and an "empty" one
//       (the 8 consumer warps are done reading it). It needs few registers and hands the rest to the
//       consumers (setmaxnreg: 24 here, 240 there).
//     warpgroups 1 and 2, the consumers: 64 queries each. S = q K^T is kD / 16 wgmmas m64n{keys}k16 whose
//       operands the tensor cores read from shared memory themselves; the online softmax runs in registers
//       as in the mma.sync kernel; O += P V is keys / 16 wgmmas m64n{kD}k16 that take P from registers
//       (rounded to T, already in the A-fragment layout) and V from shared memory, read transposed
//       through its descriptor. Neither product does work past kD: head dim 80 costs 5 k-steps and n80.
//
// The one idea that makes it fast: the tensor cores never wait for the softmax
//   wgmma is asynchronous. Each consumer issues S(j) = q K(j)^T and then O += P(j-1) V(j-1), and computes
//   the softmax of S(j) while the second product is still running: the exp unit (16 results a clock per
//   SM) and the tensor cores work at the same time (registers: S, O and P live at once, keys / 2 + kD / 2
//   + keys / 4 a thread of the 240: 160 at kD = 128; at kD = 256, 224 with 128 keys but 188 with 80, hence
//   the smaller key tiles of the wide heads).
//   Across warpgroups, two named barriers make the consumers take turns issuing their products, so one's
//   softmax runs while the other's matmuls keep the tensor cores busy ("ping-pong"). And no consumer
//   thread spends an instruction or a register on an address or a copy: TMA moves every tile, zero-fills
//   the rows past a sequence's end and the columns past head_dim, and skips them on the way out.
//
// Limits
//   float16 / bfloat16; head_dim a multiple of 8 up to 256; any lengths below 2^31 (TMA's coordinates are
//   32-bit); q, k, v, out strided as kernels.h's HeadStrides allow, every stride a multiple of 16 bytes
//   (attention_ops.cpp makes sure). Built only when nvcc targets sm_90a
//   (cuda_kernels/ops.py adds it, and -DKERNEL_LADDER_SM90A, when it sees an H100-class GPU); runs only
//   on compute capability 9.0.
//
// Speed (bf16, causal, (4, 16, 4096, D), TFLOP/s; profiling/results/h200/README.md, h100/hopper-narrow-heads.md)
//   On an H200: D = 128 about 520, cuDNN's speed; D = 64, 80, 96: 363, 413-418, 441-462 (1.2x cuDNN at 80);
//   D = 256 on the suite's run 631 (1.14x cuDNN). The narrow heads run at 0.69-0.88x D = 128's TFLOP/s
//   because a key tile costs the consumers the same softmax at every D for less tensor-core work. What
//   limits that softmax is latency, not the exp unit: ncu at D = 80 has the tensor pipe 47 % busy, the exp
//   unit 40 %, the issue slots 41 %, and the warps mostly waiting on fixed-latency dependencies (hence the
//   independent chains in exponentiate_row, and the lagging running max that lets a warp skip the output's
//   rescale: 0-3 % more TFLOP/s, most at D = 96, on another H200 whose D = 80 ran at 390-397 before it).
//   Probed and not adopted: wider key tiles (176) and three consumer warpgroups at D <= 96 (H100), a share
//   of the exponentials on the FMA pipes (H200).
//
// Check
//   nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a -DKERNEL_LADDER_SM90A -Xptxas -v,-warn-spills \
//        -c cuda_kernels/attention_forward_hopper.cu -o /tmp/attention_forward_hopper.o
//   python -m pytest tests -k "attention and (cuda or hopper)"    (on a GPU; both kernels, float64 reference)
#include <climits>

#include "attention_mask.h"
#include "hopper.cuh"
#include "tensor_core.cuh"

namespace kernel_ladder {

// The CTA: a producer warpgroup, then two consumer warpgroups of 64 queries each (wgmma's M).
constexpr int kConsumerWarpgroups = 2;
constexpr int kHopperThreads = (1 + kConsumerWarpgroups) * kWarpgroupThreads;
constexpr int kWarpgroupQueries = 64;
constexpr int kHopperQueries = kConsumerWarpgroups * kWarpgroupQueries;
constexpr int kHopperStages = 2;

// Shared memory is tiles of rows (queries or keys) in 64-column boxes (hopper.cuh). A tile kD wide is
// ceil(kD / 64) boxes; TMA zero-fills the columns past kD of the last one, which cost shared memory but
// no tensor-core work: the products stop at kD.
constexpr int kQueryBoxBytes = kHopperQueries * kRowBytes;

struct HopperBarriers {
  uint64_t q_full;
  uint64_t k_full[kHopperStages], k_empty[kHopperStages];
  uint64_t v_full[kHopperStages], v_empty[kHopperStages];
};

// The tile of one head-dim width kD (a multiple of 16, wgmma's k-step) and its shared memory: q, then the
// K stages, the V stages and the barriers. Keys per K and V tile: 128 up to kD = 128, where a consumer
// thread holds S (m64n128: 64 floats), O (kD / 2) and P (32) at once. Wider O leaves less room, so the key
// tile shrinks as FlashAttention-3's does (hopper/tile_size.h): 112 at kD = 192 (S 56, O 96, P 28) and
// 80 at kD = 256 (S 40, O 128, P 20). Shared memory sets the same limits: 2 stages of K and V of 112 x 192
// or 80 x 256 beside q are 216 KB and 224 KB of the 227 KB a CTA may have. 1 KB more lets the kernel start
// the tiles on a 1024-byte boundary, which the swizzle needs (hopper.cuh); every box is a multiple of 8
// rows, so of 1024 bytes.
template <int kD>
struct HopperTile {
  static_assert(kD % 16 == 0 && kD <= 256, "tile widths are multiples of 16 up to 256");
  static constexpr int kKeys = kD <= 128 ? 128 : kD <= 192 ? 112 : 80;
  static constexpr int kBoxes = (kD + kBoxColumns - 1) / kBoxColumns;
  static constexpr int kKeyBoxBytes = kKeys * kRowBytes;
  static constexpr int kQueryTileBytes = kBoxes * kQueryBoxBytes;
  static constexpr int kKeyTileBytes = kBoxes * kKeyBoxBytes;
  static constexpr int kQ = 0;
  static constexpr int kK = kQ + kQueryTileBytes;
  static constexpr int kV = kK + kHopperStages * kKeyTileBytes;
  static constexpr int kBarriers = kV + kHopperStages * kKeyTileBytes;
  static constexpr int kBytes = kBarriers + static_cast<int>(sizeof(HopperBarriers)) + 1024;
  static_assert(kBytes <= 227 * 1024, "a CTA may have 227 KB of shared memory on Hopper");
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

constexpr int kConsumerWarps = kConsumerWarpgroups * 4;
// Named barriers: 1 and 2 are the consumers' turns to issue matmuls, 3 and 4 their epilogues (0 is
// __syncthreads).
constexpr int kFirstTurnBarrier = 1;
constexpr int kFirstEpilogueBarrier = 3;

// --- producer -------------------------------------------------------------------------------------------

// Tile t of K or V (keys key_begin + kKeys t ...) into stage t % kHopperStages of `stages`, once the
// consumers have released the tile that used that stage before it. The bytes announced are the whole
// box, also where TMA zero-fills rows past the last key.
template <int kD>
__device__ __forceinline__ void load_key_tile(const CUtensorMap* map, unsigned char* stages, uint64_t* full,
                                              uint64_t* empty, int t, int key_begin, TileHead kv_head) {
  using Tile = HopperTile<kD>;
  const int stage = t % kHopperStages;
  mbarrier_wait(&empty[stage], (t / kHopperStages + 1) % 2);
  mbarrier_expect_bytes(&full[stage], Tile::kKeyTileBytes);
  tma_load_tile<Tile::kBoxes>(stages + stage * Tile::kKeyTileBytes, Tile::kKeyBoxBytes, map,
                              key_begin + t * Tile::kKeys, kv_head, &full[stage]);
}

// One thread issues every copy, in the order the consumers use them: q, K(0), then K(j + 1) before V(j),
// since a consumer multiplies q K(j + 1)^T before P(j) V(j).
template <int kD>
__device__ __forceinline__ void load_tiles(const CUtensorMap* q_map, const CUtensorMap* k_map, const CUtensorMap* v_map,
                                           unsigned char* tiles, HopperBarriers& barriers, int query0, TileHead head,
                                           TileHead kv_head, int key_begin, int key_tiles) {
  using Tile = HopperTile<kD>;
  prefetch_tensor_map(k_map);
  prefetch_tensor_map(v_map);
  mbarrier_expect_bytes(&barriers.q_full, Tile::kQueryTileBytes);
  tma_load_tile<Tile::kBoxes>(tiles + Tile::kQ, kQueryBoxBytes, q_map, query0, head, &barriers.q_full);
  for (int t = 0; t <= key_tiles; ++t) {
    if (t < key_tiles) {
      load_key_tile<kD>(k_map, tiles + Tile::kK, barriers.k_full, barriers.k_empty, t, key_begin, kv_head);
    }
    if (t > 0) {
      load_key_tile<kD>(v_map, tiles + Tile::kV, barriers.v_full, barriers.v_empty, t - 1, key_begin, kv_head);
    }
  }
}

// --- consumers ------------------------------------------------------------------------------------------

// S = q K^T for the warpgroup's 64 queries (q_rows: their rows of the q tile) and one key tile: kD / 16
// wgmmas m64n{kKeys}k16, the first overwriting S (kD = 80: 5 steps, not the 8 of a 128-wide tile). A k16
// step is 32 bytes of every row; four of them cross a box, whose size differs between q and K.
template <typename T, int kD>
__device__ __forceinline__ void issue_scores(float (&s)[HopperTile<kD>::kKeys / 8][4], uint32_t q_rows,
                                             uint32_t k_tile) {
#pragma unroll
  for (int step = 0; step < kD / 16; ++step) {
    const uint32_t row_bytes = step % 4 * 32;
    wgmma_64xNx16<T, HopperTile<kD>::kKeys>(
        s, k_major_descriptor(q_rows + step / 4 * kQueryBoxBytes + row_bytes),
        k_major_descriptor(k_tile + step / 4 * HopperTile<kD>::kKeyBoxBytes + row_bytes), step > 0);
  }
}

// O += P V: P's 16-key slices are A fragments in registers; V's 16 rows of keys a step, MN-major, N = kD.
template <typename T, int kD>
__device__ __forceinline__ void issue_output(float (&o)[kD / 8][4], const uint32_t (&p)[HopperTile<kD>::kKeys / 16][4],
                                             uint32_t v_tile) {
  using Tile = HopperTile<kD>;
#pragma unroll
  for (int step = 0; step < Tile::kKeys / 16; ++step) {
    wgmma_64xNx16_from_registers<T, kD>(o, p[step],
                                        mn_major_descriptor(v_tile + step * 16 * kRowBytes, Tile::kKeyBoxBytes));
  }
}

// The online softmax of one tile, as in the mma.sync kernel (online_softmax there), except that o is not
// touched: a P V product may still be accumulating into it. s becomes P = 2^(s * scale_log2 - m) with m
// the new running max (log2 units) of each of the thread's two rows, row_sum is rescaled and grows by
// the tile's P, and `rescale` returns 2^(m_old - m_new) for o once that product has completed.
// kMasked: keys outside [first_key, end_key) of a row get s = -inf first (key0: the tile's first key).
template <int kKeys, bool kMasked>
__device__ __forceinline__ void online_softmax_of_tile(float (&s)[kKeys / 8][4], float (&row_max)[2],
                                                       float (&row_sum)[2], float (&rescale)[2], float scale_log2,
                                                       const int (&first_key)[2], const int (&end_key)[2], int key0) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the warp's 16
    // The thread's columns relative to the row's visible keys: key0 + 2 (lane % 4) + 8 n + e.
    const int lowest = first_key[half] - key0 - lane % 4 * 2, past = end_key[half] - key0 - lane % 4 * 2;
#pragma unroll
    for (int n = 0; n < kKeys / 8; ++n) {
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        if (kMasked && (n * 8 + e < lowest || n * 8 + e >= past)) s[n][2 * half + e] = -INFINITY;
      }
    }
    rescale[half] = exponentiate_row(s, half, scale_log2, row_max[half], row_sum[half]);
  }
}

// out = o / l and lse = ln 2 * (m + log2 l) for the warpgroup's rows below query_length. o is rounded to T
// into the warpgroup's own 64 rows of the q tile (its last q K^T has completed), in the 128-byte swizzled
// layout, and TMA stores them: rows past the last query and columns past head_dim are not written.
template <typename T, int kD>
__device__ __forceinline__ void store_rows(float (&o)[kD / 8][4], float (&row_max)[2], float (&row_sum)[2],
                                           unsigned char* q_rows, const CUtensorMap* out_map, float* lse, int64_t bh,
                                           TileHead head, int64_t rows0, int64_t query_length, int consumer) {
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
  store_swizzled_rows<T, kD>(q_rows, kQueryBoxBytes, o, 1.0f);
  fence_shared_for_tma();
  named_barrier_sync(kFirstEpilogueBarrier + consumer, kWarpgroupThreads);
  if (threadIdx.x % kWarpgroupThreads == 0 && rows0 < query_length) {
    tma_store_tile<HopperTile<kD>::kBoxes>(out_map, q_rows, kQueryBoxBytes, static_cast<int>(rows0),
                                           head);
    tma_store_wait_for_reads();
  }
}

// A consumer warpgroup: its 64 queries against key tiles 0..key_tiles-1 of the CTA's range.
template <typename T, int kD>
__device__ __forceinline__ void attend(const AttentionProblem& shape, const CUtensorMap* out_map, float* lse,
                                       unsigned char* tiles, HopperBarriers& barriers, int consumer, int64_t query0,
                                       int64_t bh, int key_begin, int key_tiles) {
  using Tile = HopperTile<kD>;
  constexpr int kKeys = Tile::kKeys;
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
  unsigned char* q_rows = tiles + Tile::kQ + consumer * kWarpgroupQueries * kRowBytes;
  const uint32_t q_rows_address = shared_address(q_rows);
  const uint32_t k_stages = shared_address(tiles + Tile::kK), v_stages = shared_address(tiles + Tile::kV);
  const float scale_log2 = static_cast<float>(shape.scale) * kLog2e;
  // Only tiles that hold a masked pair for some row of this warpgroup pay for the mask; the warpgroup's
  // rows reach past the last query only in the last query block, whose tiles are then all masked.
  const auto softmax = [&](float (&s)[kKeys / 8][4], float (&row_max)[2], float (&row_sum)[2],
                           float (&rescale)[2], int t) {
    const int key0 = key_begin + t * kKeys;
    if (visible.sees_all(rows0, rows0 + kWarpgroupQueries, key0, key0 + kKeys)) {
      online_softmax_of_tile<kKeys, false>(s, row_max, row_sum, rescale, scale_log2, first_key, end_key, key0);
    } else {
      online_softmax_of_tile<kKeys, true>(s, row_max, row_sum, rescale, scale_log2, first_key, end_key, key0);
    }
  };
  // A stage is released by one lane per consumer warp, once the warp's wgmmas reading it have completed.
  const auto release = [&](uint64_t* empty) {
    if (lane == 0) mbarrier_arrive(empty);
  };

  float o[kD / 8][4] = {};
  float s[kKeys / 8][4];
  uint32_t p[kKeys / 16][4];
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
  for (int k = 0; k < kKeys / 16; ++k) a_fragment_from_accumulators<T>(p[k], s[2 * k], s[2 * k + 1]);

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
    issue_scores<T, kD>(s, q_rows_address, k_stages + stage * Tile::kKeyTileBytes);
    wgmma_commit();
    mbarrier_wait(&barriers.v_full[previous], (t - 1) / kHopperStages % 2);
    wgmma_fence();  // ptxas wants o and p fenced again after the wait's loop (it would insert this: info C7519)
    issue_output<T, kD>(o, p, v_stages + previous * Tile::kKeyTileBytes);
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
    // The running max lags (kMaxLag, tensor_core.cuh): mostly no row of the warp moved it, every factor is
    // exactly 1, and the warp skips the kD / 2 multiplies a thread that stand between the wait for P V and
    // its next turn at the tensor cores.
    if (__any_sync(0xffffffffu, rescale[0] != 1.0f || rescale[1] != 1.0f)) {
#pragma unroll
      for (int n = 0; n < kD / 8; ++n) {
        o[n][0] *= rescale[0];
        o[n][1] *= rescale[0];
        o[n][2] *= rescale[1];
        o[n][3] *= rescale[1];
      }
    }
#pragma unroll
    for (int k = 0; k < kKeys / 16; ++k) a_fragment_from_accumulators<T>(p[k], s[2 * k], s[2 * k + 1]);
  }

  // The last tile's O += P V, then the output.
  const int last = (key_tiles - 1) % kHopperStages;
  mbarrier_wait(&barriers.v_full[last], (key_tiles - 1) / kHopperStages % 2);
  fence_registers(o);
  fence_registers(p);
  wgmma_fence();
  issue_output<T, kD>(o, p, v_stages + last * Tile::kKeyTileBytes);
  wgmma_commit();
  wgmma_wait<0>();
  fence_registers(o);
  release(&barriers.v_empty[last]);
  store_rows<T, kD>(o, row_max, row_sum, q_rows, out_map, lse, bh, tile_head(bh, shape.heads), rows0,
                    shape.query_length, consumer);
}

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <typename T, int kD>
__global__ void __launch_bounds__(kHopperThreads, 1)
attention_forward_hopper_kernel(const __grid_constant__ CUtensorMap q_map, const __grid_constant__ CUtensorMap k_map,
                                const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap out_map,
                                AttentionProblem shape, float* __restrict__ lse) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Tile = HopperTile<kD>;
  extern __shared__ unsigned char shared_bytes[];
  unsigned char* tiles = swizzle_aligned(shared_bytes);
  HopperBarriers& barriers = *reinterpret_cast<HopperBarriers*>(tiles + Tile::kBarriers);

  // The mma.sync kernel's grid order: consecutive CTAs share a (batch, head), whose K and V stay in L2,
  // and within it the last query blocks (most keys when causal) start first.
  const VisibleKeys visible(shape);
  const int64_t lq = shape.query_length, query_blocks = ceil_div(lq, kHopperQueries);
  const int64_t bh = blockIdx.x / query_blocks;
  const int64_t i0 = (query_blocks - 1 - blockIdx.x % query_blocks) * kHopperQueries;
  const int64_t i1 = min(i0 + kHopperQueries, lq);
  // Key tiles any query of this CTA sees: [key_begin, key_end) in steps of Tile::kKeys.
  const int key_begin = static_cast<int>(visible.first_key(i0) / Tile::kKeys * Tile::kKeys);
  const int key_tiles = static_cast<int>(ceil_div(visible.end_key(i1 - 1) - key_begin, Tile::kKeys));

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

  run_warp_specialised(
      [&] {
        if (threadIdx.x == 0) {
          load_tiles<kD>(&q_map, &k_map, &v_map, tiles, barriers, static_cast<int>(i0), tile_head(bh, shape.heads),
                         tile_head(bh / shape.group, shape.heads / shape.group), key_begin, key_tiles);
        }
      },
      [&](int consumer) {
        attend<T, kD>(shape, &out_map, lse, tiles, barriers, consumer, i0, bh, key_begin, key_tiles);
      });
#else
  __trap();  // only the sm_90a image holds this kernel, and the launcher starts it on no other GPU
#endif
}

// --- launcher ------------------------------------------------------------------------------------

namespace {

// Encodes the four tensor maps for tile width kD (K and V boxes of its key tile) and launches. False if the
// driver refuses a map.
template <typename T, int kD>
bool launch_hopper_kernel(const AttentionShape& shape, const void* q, const void* k, const void* v, void* out,
                          void* lse, cudaStream_t stream) {
  using Tile = HopperTile<kD>;
  const DType dtype = std::is_same_v<T, __half> ? DType::Float16 : DType::BFloat16;
  const int64_t batch = shape.batch_heads / shape.heads, kv_heads = shape.heads / shape.group, d = shape.head_dim;
  const int64_t lq = shape.query_length, lk = shape.key_length;
  CUtensorMap maps[4];  // q, k, v, out
  if (!encode_swizzled_tensor_map(&maps[0], dtype, q, batch, shape.heads, lq, d, shape.q, kHopperQueries) ||
      !encode_swizzled_tensor_map(&maps[1], dtype, k, batch, kv_heads, lk, d, shape.k, Tile::kKeys) ||
      !encode_swizzled_tensor_map(&maps[2], dtype, v, batch, kv_heads, lk, d, shape.v, Tile::kKeys) ||
      !encode_swizzled_tensor_map(&maps[3], dtype, out, batch, shape.heads, lq, d, shape.out, kWarpgroupQueries)) {
    return false;
  }
  auto* kernel = attention_forward_hopper_kernel<T, kD>;
  // Beyond 48 KB a kernel's dynamic shared memory must be asked for (per device, so every launch).
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Tile::kBytes);
  const auto blocks = static_cast<unsigned>(shape.batch_heads * ceil_div(shape.query_length, kHopperQueries));
  const AttentionProblem& problem = shape;  // the kernel takes no strides: its maps hold them (kernels.h)
  kernel<<<blocks, kHopperThreads, Tile::kBytes, stream>>>(maps[0], maps[1], maps[2], maps[3], problem,
                                                           static_cast<float*>(lse));
  return true;
}

}  // namespace

bool launch_attention_forward_hopper(DType dtype, const AttentionShape& shape, const void* q, const void* k,
                                     const void* v, void* out, void* lse, void* stream) {
  // TMA's coordinates, the kernel's key indices and the grid are 32-bit.
  const bool fits = shape.query_length < INT_MAX && shape.key_length < INT_MAX &&
                    shape.batch_heads * ceil_div(shape.query_length, kHopperQueries) < INT_MAX;
  if (!fits || !hopper_attention_applies(dtype, shape.head_dim, 256)) return false;
  // The tile widths: the common head dims (64, 80, 96, 128, 192, 256) run unpadded; between them a head dim
  // pads by at most 64 columns of tensor-core work (144 on the 192 tile: 1.33x what it needs). Each width
  // is one kernel per dtype.
  bool launched = false;
  dispatch_tile_width<64, 80, 96, 128, 192, 256>(shape.head_dim, [&](auto width) {
    constexpr int kD = decltype(width)::value;
    const auto s = static_cast<cudaStream_t>(stream);
    launched = dtype == DType::BFloat16 ? launch_hopper_kernel<__nv_bfloat16, kD>(shape, q, k, v, out, lse, s)
                                        : launch_hopper_kernel<__half, kD>(shape, q, k, v, out, lse, s);
  });
  return launched;
}

}  // namespace kernel_ladder
