// The tensor-core building blocks of the flash-attention kernels (attention_forward.cu,
// attention_backward.cu): asynchronous copies into padded shared-memory tiles, ldmatrix fragment
// loads, and the warp-wide matrix product mma.sync m16n8k16 (float16/bfloat16 in, float32 out).
//
// Fragments (PTX ISA, "Matrix Fragments for mma.m16n8k16"). A warp multiplies A (16x16) by B (16x8)
// into C (16x8); lane l holds pieces at row g = l / 4 and column pair c = 2 * (l % 4):
//   A  4 registers of 2 halves: (g, c..c+1), (g+8, c..c+1), (g, c+8..c+9), (g+8, c+8..c+9)
//   B  2 registers of 2 halves: (k = c..c+1, n = g), (k = c+8..c+9, n = g)
//   C  4 floats:                (g, c), (g, c+1), (g+8, c), (g+8, c+1)
// So a C tile 16 x 16 (two C fragments side by side), rounded to halves, IS an A fragment: the
// probabilities of q k^T feed the next product p v straight from registers, with no shuffle.
// ldmatrix gives each lane exactly these pieces from shared memory: each of its four 8x8 matrices
// (16-byte rows whose addresses come from lanes 8i..8i+7) lands as lane l's pair (l / 4, 2 * (l % 4));
// .trans lands the transposed pair, which is how a row-major V becomes the B operand of p v.
//
// Shared-memory layout: a tile of kCols halves per row is stored with rows kCols + 8 halves apart.
// ldmatrix reads 8 rows of 16 bytes at one column; with rows a multiple of 128 bytes apart all 8
// would sit in the same 4 banks (an 8-way conflict). 16 bytes of padding shift each row by 4 banks,
// so the 8 rows cover all 32 banks, for every tile width (row pitches of 48, 80, 144, 208, 272, 400,
// 528 bytes: odd multiples of 16 bytes).
//
// Tiles and rows. A tile is kCols wide (a multiple of 16, the k-step of mma.sync); the matrix rows in
// global memory hold row_length <= kCols values (a head dim, a multiple of 8, so a row is whole 16-byte
// pieces) and lie row_stride elements apart: row_length for a contiguous matrix, more for a head of a
// fused q·k·v projection or an output written in (tokens, heads) order (kernels.h, HeadStrides). The
// stride is a multiple of 16 bytes too, so every row starts 16-byte aligned, as cp.async and the vector
// stores need. Loads zero-fill the tile's columns past row_length (zeros add nothing to any product) and
// stores skip them: the tensors are never padded in memory.
#pragma once

#include "common.cuh"

namespace kernel_ladder {

template <int kCols> constexpr int kPaddedPitch = kCols + 8;  // elements between rows of a shared tile

// --- tile copies (cp.async; the primitives are in common.cuh) ------------------------------------

// 4 bytes (one float of lse or delta, whose rows need not be 16-byte aligned); zero-filled if invalid.
__device__ __forceinline__ void copy_async_4(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" ::"r"(shared_address(shared)), "l"(global),
               "r"(valid ? 4 : 0));
}

// Rows [row0, row0 + kRows) of a (rows, row_length) matrix whose rows lie row_stride elements apart into
// a padded shared tile kCols wide, 16 bytes per copy, spread over kThreads threads; rows at or past
// `rows` and columns at or past row_length are zero-filled (a zero adds nothing to any product, and
// never leaves garbage that could be NaN).
//
// Unrolled or not (ptxas -v, sm_90): unrolled, the compiler works each copy's offset (row * row_stride
// + col) out once and holds it through the caller's loop, a 64-bit register pair per copy and matrix
// (K's and V's cannot be shared: their strides may differ). At tile widths 96 and 192, whose 12 and 24
// chunks a row do not divide the thread count, every chunk of a thread has a row and column of its own,
// and the forward spilled at 192: there the loop stays rolled, one multiply-add per 16-byte copy. Where
// kChunksPerRow divides kThreads a thread's chunks share a column, evenly many rows apart, and unrolled
// does better (rolled, the backward at tile width 128 spilled 260 bytes instead of 12).
template <int kRows, int kCols, int kThreads, typename T>
__device__ __forceinline__ void load_tile_async(T* tile, const T* matrix, int64_t row_stride, int64_t row0,
                                                int64_t rows, int row_length) {
  constexpr int kChunkElements = 16 / sizeof(T);
  constexpr int kChunksPerRow = kCols / kChunkElements;
  constexpr int kChunksPerThread = kRows * kChunksPerRow / kThreads;
  static_assert((kRows * kChunksPerRow) % kThreads == 0, "every thread copies the same number of chunks");
  const T* first_row = matrix + row0 * row_stride;  // the one 64-bit multiply by row0 a call
#pragma unroll(kThreads % kChunksPerRow == 0 ? kChunksPerThread : 1)
  for (int i = 0; i < kChunksPerThread; ++i) {
    const int chunk = static_cast<int>(threadIdx.x) + i * kThreads;
    const int row = chunk / kChunksPerRow, col = chunk % kChunksPerRow * kChunkElements;
    const bool valid = row0 + row < rows && col < row_length;
    copy_async_16(tile + row * kPaddedPitch<kCols> + col, valid ? first_row + row * row_stride + col : matrix, valid);
  }
}

// One float per row, rows [row0, row0 + kRows) of `vector`, zero past `rows` (threads 0..kRows-1).
template <int kRows>
__device__ __forceinline__ void load_row_values_async(float* shared, const float* vector, int64_t row0, int64_t rows) {
  const int row = static_cast<int>(threadIdx.x);
  if (row < kRows) {
    const bool valid = row0 + row < rows;
    copy_async_4(shared + row, vector + (valid ? row0 + row : 0), valid);
  }
}

// --- ldmatrix ------------------------------------------------------------------------------------
// Four 8x8 matrices of 16-bit values; lane l gives the row address of matrix l / 8.

__device__ __forceinline__ void load_matrix_x4(uint32_t (&fragment)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
               : "r"(shared_address(row_address)));
}

__device__ __forceinline__ void load_matrix_x4_transposed(uint32_t (&fragment)[4], const void* row_address) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(fragment[0]), "=r"(fragment[1]), "=r"(fragment[2]), "=r"(fragment[3])
               : "r"(shared_address(row_address)));
}

// The 16x16 block of a row-major shared tile whose top-left element is `block`, as the A operand
// (rows = m, columns = k). Lane l addresses row l % 8 (+8 for lanes 8-15 and 24-31), column 0 or 8.
template <int kPitch, typename T>
__device__ __forceinline__ void load_a_fragment(uint32_t (&a)[4], const T* block) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  load_matrix_x4(a, block + (lane % 8 + (lane / 8) % 2 * 8) * kPitch + lane / 16 * 8);
}

// The A operand for the TRANSPOSE of a row-major shared tile: block is the top-left of the 16x16
// block stored as [k][m] (used for dS, stored key-major, in dq = dS k).
template <int kPitch, typename T>
__device__ __forceinline__ void load_a_fragment_transposed(uint32_t (&a)[4], const T* block) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  load_matrix_x4_transposed(a, block + (lane % 8 + lane / 16 * 8) * kPitch + (lane / 8) % 2 * 8);
}

// B operands of two adjacent n-tiles from a tile stored [n][k] (row n holds column n of B, as K's rows
// hold the columns of k^T): b[0], b[1] for n-tile 0, b[2], b[3] for n-tile 1; block = (n0, k0).
template <int kPitch, typename T>
__device__ __forceinline__ void load_b_fragments(uint32_t (&b)[4], const T* block) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  load_matrix_x4(b, block + (lane % 8 + lane / 16 * 8) * kPitch + (lane / 8) % 2 * 8);
}

// B operands of two adjacent n-tiles from a tile stored [k][n] (V: rows are keys = k, columns are
// head-dim = n); ldmatrix.trans transposes each 8x8 on the way. block = (k0, n0).
template <int kPitch, typename T>
__device__ __forceinline__ void load_b_fragments_transposed(uint32_t (&b)[4], const T* block) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  load_matrix_x4_transposed(b, block + (lane % 8 + (lane / 8) % 2 * 8) * kPitch + lane / 16 * 8);
}

// --- mma.sync ------------------------------------------------------------------------------------

// c += a b on the tensor cores: A 16x16, B 16x8, C 16x8 in float32.
template <typename T>
__device__ __forceinline__ void mma_16x8x16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1);

template <>
__device__ __forceinline__ void mma_16x8x16<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <>
__device__ __forceinline__ void mma_16x8x16<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                                            uint32_t b1) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
               "{%0, %1, %2, %3};\n"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// c (16 x kN) += a b^T over one 16-wide slice of k: a is the slice's A fragment, b_block the (n0 = 0,
// k0) corner of a shared tile stored [n][k] (rows of K for q k^T; rows of q for k q^T).
template <typename T, int kN, int kPitch>
__device__ __forceinline__ void multiply_slice_by_transpose(float (&c)[kN / 8][4], const uint32_t (&a)[4], const T* b_block) {
#pragma unroll
  for (int n = 0; n < kN / 8; n += 2) {
    uint32_t b[4];
    load_b_fragments<kPitch>(b, b_block + n * 8 * kPitch);
    mma_16x8x16<T>(c[n], a, b[0], b[1]);
    mma_16x8x16<T>(c[n + 1], a, b[2], b[3]);
  }
}

// c (16 x kN) += a b over one 16-wide slice of k: b_rows are the slice's 16 rows of a shared tile
// stored [k][n] (V for p v; dout, q, k in the backward), starting at column n0 = 0.
template <typename T, int kN, int kPitch>
__device__ __forceinline__ void multiply_slice(float (&c)[kN / 8][4], const uint32_t (&a)[4], const T* b_rows) {
#pragma unroll
  for (int n = 0; n < kN / 8; n += 2) {
    uint32_t b[4];
    load_b_fragments_transposed<kPitch>(b, b_rows + n * 8);
    mma_16x8x16<T>(c[n], a, b[0], b[1]);
    mma_16x8x16<T>(c[n + 1], a, b[2], b[3]);
  }
}

// Two floats rounded to T and packed into one register, the first in the low half (lower column).
template <typename T> __device__ __forceinline__ uint32_t pack_pair(float first, float second);

template <>
__device__ __forceinline__ uint32_t pack_pair<__half>(float first, float second) {
  const __half2 pair = __floats2half2_rn(first, second);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

template <>
__device__ __forceinline__ uint32_t pack_pair<__nv_bfloat16>(float first, float second) {
  const __nv_bfloat162 pair = __floats2bfloat162_rn(first, second);
  return *reinterpret_cast<const uint32_t*>(&pair);
}

// The A operand made of two C fragments side by side (columns 0-7 and 8-15 of a 16x16 block).
template <typename T>
__device__ __forceinline__ void a_fragment_from_accumulators(uint32_t (&a)[4], const float (&left)[4],
                                                             const float (&right)[4]) {
  a[0] = pack_pair<T>(left[0], left[1]);
  a[1] = pack_pair<T>(left[2], left[3]);
  a[2] = pack_pair<T>(right[0], right[1]);
  a[3] = pack_pair<T>(right[2], right[3]);
}

// The online softmax's step for one row of a score tile, shared by the mma.sync and wgmma forward kernels,
// whose accumulators have the C layout above (a thread holds columns 8 n + 2 (lane % 4) + e of two rows,
// `half` 0 and 1; the quad of lanes holding a row holds all of it). s holds the tile's raw scores, -inf
// where the mask hides a key; scale_log2 (> 0) takes them to log2 units. The row's part of s becomes
// P = 2^(s * scale_log2 - m) with m the new running max (log2 units), in one FFMA and one MUFU.EX2 a score:
// the max is taken over the raw scores, since a positive scale keeps their order (and rounding keeps it
// too, so the scaled max is the max of the scaled scores). row_max becomes m (which lags: kMaxLag below),
// row_sum is rescaled to it and grows by this lane's P (the quad's partial sums meet at the end); returns
// 2^(m_old - m), the factor the output accumulated so far must take, exactly 1 when m did not move.
//
// The max and the sum run as kSoftmaxChains independent chains, combined at the end. One running max or
// sum over a thread's 2 kBlocks scores (32 at 128 keys) is as many dependent instructions, each waiting a
// few cycles for the last, and the compiler may not reorder float additions to shorten it. In the wgmma
// kernel a warpgroup's softmax must finish while the other warpgroup's products run, and ncu on an H200
// found its warps mostly stalled on such fixed-latency dependencies (tensor pipe 47 % busy at head dim 80),
// not on the exp unit (40 %). Four chains there, against one, both builds in turns: 1.4-4.7 % more TFLOP/s at
// head dims 64 to 128 over 4096 tokens, 1.3-1.6 % over 16384 (profiling/results/h200/README.md).
constexpr int kSoftmaxChains = 4;

// How far (log2 units) a tile's max may pass the running max before the running max moves. Below that, P is
// taken against the stale max, so its values reach up to 2^kMaxLag = 256 instead of 1: harmless, since a
// float's relative precision does not depend on its size (P rounded to 16 bits, the float32 sums and the
// output are exactly as accurate), and 256 times a row's sum is far from float32's range. What it buys: the
// returned factor is then exactly 1, and after the first tile or two of a row it almost always is (a row's
// max grows by 2^8 only rarely once it has seen some keys), so a kernel can skip rescaling its output
// accumulator (FlashAttention-4's conditional rescaling; the Hopper kernel skips it per warp).
constexpr float kMaxLag = 8.0f;

template <int kBlocks>
__device__ __forceinline__ float exponentiate_row(float (&s)[kBlocks][4], int half, float scale_log2, float& row_max,
                                                  float& row_sum) {
  float chain_max[kSoftmaxChains];
#pragma unroll
  for (int c = 0; c < kSoftmaxChains; ++c) chain_max[c] = -INFINITY;
#pragma unroll
  for (int n = 0; n < kBlocks; ++n) {
    chain_max[n % kSoftmaxChains] = fmaxf(chain_max[n % kSoftmaxChains], fmaxf(s[n][2 * half], s[n][2 * half + 1]));
  }
  float tile_max = chain_max[0];
#pragma unroll
  for (int c = 1; c < kSoftmaxChains; ++c) tile_max = fmaxf(tile_max, chain_max[c]);
  // The 4 lanes of a quad hold the same two rows: two shuffles give each the row's max.
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
  tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
  // The running max lags: it moves only when the tile's max passes it by more than kMaxLag.
  const float scaled_tile_max = tile_max * scale_log2;
  const float new_max = scaled_tile_max > row_max + kMaxLag ? scaled_tile_max : row_max;
  // A row that has seen no visible key yet keeps max -inf; subtracting 0 instead keeps its
  // 2^(-inf) = 0 from turning into 2^(-inf + inf) = NaN.
  const float shift = new_max == -INFINITY ? 0.0f : new_max;
  const float rescale = exp2_approx(row_max - shift);
  row_max = new_max;
  float chain_sum[kSoftmaxChains] = {};
#pragma unroll
  for (int n = 0; n < kBlocks; ++n) {
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      float& p = s[n][2 * half + e];
      p = exp2_approx(fmaf(p, scale_log2, -shift));
      chain_sum[n % kSoftmaxChains] += p;
    }
  }
  float tile_sum = chain_sum[0];
#pragma unroll
  for (int c = 1; c < kSoftmaxChains; ++c) tile_sum += chain_sum[c];
  row_sum = row_sum * rescale + tile_sum;
  return rescale;
}

// Stage a warp's 16 x kCols accumulator rows (C fragments, kCols / 8 of them) into its rows of a
// padded shared tile (rows kPitch apart), rounded to T, so that the warp can then write them to global
// memory in coalesced 16-byte pieces (copy_rows_to_global).
template <typename T, int kCols, int kPitch = kPaddedPitch<kCols>>
__device__ __forceinline__ void stage_accumulators(T* rows16, const float (&c)[kCols / 8][4], float scale) {
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  T* top = rows16 + lane / 4 * kPitch + lane % 4 * 2;
#pragma unroll
  for (int n = 0; n < kCols / 8; ++n) {
    *reinterpret_cast<uint32_t*>(top + n * 8) = pack_pair<T>(c[n][0] * scale, c[n][1] * scale);
    *reinterpret_cast<uint32_t*>(top + 8 * kPitch + n * 8) = pack_pair<T>(c[n][2] * scale, c[n][3] * scale);
  }
}

// A warp copies the kRows rows of a padded shared tile kCols wide to rows [row0, row0 + kRows) of a
// (rows, row_length) global matrix whose rows lie row_stride elements apart, 16 bytes per lane per step;
// rows at or past `rows` and the tile's columns past row_length are not written.
template <int kRows, int kCols, typename T>
__device__ __forceinline__ void copy_rows_to_global(T* matrix, int64_t row_stride, const T* tile, int64_t row0,
                                                    int64_t rows, int row_length) {
  constexpr int kChunkElements = 16 / sizeof(T);
  constexpr int kChunksPerRow = kCols / kChunkElements;
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  for (int chunk = lane; chunk < kRows * kChunksPerRow; chunk += kWarpSize) {
    const int row = chunk / kChunksPerRow, col = chunk % kChunksPerRow * kChunkElements;
    if (row0 + row < rows && col < row_length) {
      *reinterpret_cast<int4*>(matrix + (row0 + row) * row_stride + col) =
          *reinterpret_cast<const int4*>(tile + row * kPaddedPitch<kCols> + col);
    }
  }
}

}  // namespace kernel_ladder
