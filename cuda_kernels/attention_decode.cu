// Decode attention in CUDA: one new token per sequence appended to a static KV cache and attended, the
// step generation replays as a CUDA graph.
//
// What it computes
//   K[b, h, n - 1] = k_new[b, h],  V[b, h, n - 1] = v_new[b, h]   (in place)
//   out[b, h] = softmax(q[b, h] . K[b, h, :n]^T * scale) . V[b, h, :n],   n = key_lengths[b]
//   over the first n positions of caches preallocated to `capacity` (with a window W > 0, over the last
//   min(W, n) of them). The query is the newest token, at position n - 1.
//
// Kernel
//   attention_decode_kernel   one block of 4 warps per (sequence, head). A group of G lanes holds one
//                             key: each lane loads 16 bytes of the key row and of the value row, the
//                             group sums its dot products with shuffles. Every group keeps its own
//                             online softmax (running max, rescaled sum, rescaled output) over the keys
//                             it visits; at the end the groups' states merge, across the warp by
//                             shuffles and across warps through shared memory, with the same merge the
//                             softmax kernels use: (m, l, o) + (m', l', o') rescaled to max(m, m').
//                             The group that draws position n - 1 reads the new key and value instead
//                             of the cache, and writes them there for the steps after this one.
//   Head dims: the block runs on a power-of-two tile kD >= head_dim (16 ... 256); lanes whose 16-byte
//   pieces lie past head_dim load zeros and store nothing. Grouped-query attention: the block of query
//   head h reads kv head h / group, and only the group's first block writes the new key and value.
//
// The one idea
//   n is read from device memory: a CUDA graph freezes its launches' arguments at capture, so a count
//   passed by value would stay the captured step's. With the count on the device one captured launch
//   serves every step, and each step reads only the n keys it needs, not the whole cache. One query is a
//   matrix-vector product (no tensor cores: they need 16 query rows), so what matters is keeping many
//   16-byte loads in flight: 4 warps x (32 / G) keys per iteration. Writing the new key and value here,
//   instead of in two copy kernels before, saves two launches a layer: a captured decode step of GPT-2
//   small is ~150 small kernels, so each one is a share of its time.
//
// Limits
//   head_dim a multiple of 8 up to 256; q (B, H, 1, D), k_new, v_new (B, Hkv, 1, D) strided alike, last
//   dims contiguous (heads may be views of the fused projection; rows 16-byte aligned), caches contiguous
//   (B, Hkv, capacity, D), 16-byte aligned; key_lengths int32 on the GPU (clamped to [1, capacity]: the new
//   token is always there). float16, bfloat16, float32, float64
//   (float64, the tests' precision, calls double exp, whose call frame spills 8-12 bytes; the others none).
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -v -c cuda_kernels/attention_decode.cu -o /tmp/attention_decode.o
//   python -m pytest tests -k "static_cache and cuda"
#include <algorithm>

#include "common.cuh"

namespace kernel_ladder {
namespace {

constexpr int kDecodeWarps = 4;

// Values of one key row each lane holds: one 16-byte load, or more where a row is wider than a warp's
// loads (double at head dim 128).
template <typename T, int kD>
constexpr int kValuesPerLane = kVecOf<T> * kWarpSize >= kD ? kVecOf<T> : kD / kWarpSize;

// A lane's kValues consecutive values of a row, converted to the accumulator type, in 16-byte loads;
// `in_row` of them lie inside the row (head_dim is a multiple of 8, so a pack is wholly in or out), the
// rest read as zero.
template <typename T, int kValues>
__device__ __forceinline__ void load_row_part(const T* row, Acc<T> (&values)[kValues], int in_row) {
  constexpr int kVec = kVecOf<T>;
#pragma unroll
  for (int pack = 0; pack < kValues / kVec; ++pack) {
    if (pack * kVec < in_row) {
      const Pack<T, kVec> loaded = load_pack<T, kVec>(row + pack * kVec);
#pragma unroll
      for (int i = 0; i < kVec; ++i) values[pack * kVec + i] = to_acc(loaded.val[i]);
    } else {
#pragma unroll
      for (int i = 0; i < kVec; ++i) values[pack * kVec + i] = Acc<T>(0);
    }
  }
}

template <typename T, int kValues>
__device__ __forceinline__ void copy_row_part(const T* from, T* to, int in_row) {
  constexpr int kVec = kVecOf<T>;
#pragma unroll
  for (int pack = 0; pack < kValues / kVec; ++pack) {
    if (pack * kVec < in_row) store_pack<T, kVec>(to + pack * kVec, load_pack<T, kVec>(from + pack * kVec));
  }
}

template <typename A, int kValues>
struct DecodeState {
  A max, sum;
  A out[kValues];
};

// Merges `other` into `state`: both rescaled to the larger maximum.
template <typename A, int kValues>
__device__ __forceinline__ void merge_into(DecodeState<A, kValues>& state, const DecodeState<A, kValues>& other) {
  const A max = state.max > other.max ? state.max : other.max;
  if (max == A(-INFINITY)) return;  // neither has seen a key
  const A mine = exp_acc(state.max - max), theirs = exp_acc(other.max - max);
  state.sum = state.sum * mine + other.sum * theirs;
#pragma unroll
  for (int i = 0; i < kValues; ++i) state.out[i] = state.out[i] * mine + other.out[i] * theirs;
  state.max = max;
}

template <typename A, int kValues>
__device__ __forceinline__ DecodeState<A, kValues> shuffle_state(const DecodeState<A, kValues>& state, int lane_mask) {
  DecodeState<A, kValues> other;
  other.max = shuffle_xor(state.max, lane_mask);
  other.sum = shuffle_xor(state.sum, lane_mask);
#pragma unroll
  for (int i = 0; i < kValues; ++i) other.out[i] = shuffle_xor(state.out[i], lane_mask);
  return other;
}

// (..., 1): one resident block per SM is all this grid of B x H blocks needs; without it ptxas capped
// the registers and float32 at head dim 64 spilled.
template <typename T, int kD>
__global__ void __launch_bounds__(kDecodeWarps * kWarpSize, 1)
attention_decode_kernel(const T* __restrict__ q, const T* __restrict__ k_new, const T* __restrict__ v_new,
                        T* __restrict__ k_cache, T* __restrict__ v_cache, const int32_t* __restrict__ key_lengths,
                        T* __restrict__ out, DecodeShape shape) {
  using A = Acc<T>;
  constexpr int kValues = kValuesPerLane<T, kD>;
  constexpr int kGroup = kD / kValues;              // lanes per key
  constexpr int kKeysPerWarp = kWarpSize / kGroup;  // keys a warp visits at once
  const int64_t heads = shape.heads, capacity = shape.capacity, window = shape.window, d = shape.head_dim;
  const int64_t sequence_head = blockIdx.x, sequence = sequence_head / heads, head = sequence_head % heads;
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int dim = (lane % kGroup) * kValues;  // this lane's first dim
  const int in_row = static_cast<int>(d) - dim;  // how many of its kValues dims the row has (<= 0: none)

  const int64_t token = sequence * shape.q_stride_batch + head * shape.q_stride_head + dim;
  const int64_t kv_token = sequence * shape.kv_stride_batch + head / shape.group * shape.kv_stride_head + dim;
  A query[kValues];
  load_row_part<T, kValues>(q + token, query, in_row);
  const A scale = static_cast<A>(shape.scale);
#pragma unroll
  for (int i = 0; i < kValues; ++i) query[i] *= scale;

  const int64_t filled = min(max(int64_t{key_lengths[sequence]}, int64_t{1}), capacity);  // the new token is one
  const int64_t first = window > 0 ? max(filled - window, int64_t{0}) : 0;
  // The kv head of this query head's group: (sequence, head / group) = sequence_head / group.
  T* keys = k_cache + sequence_head / shape.group * capacity * d + dim;
  T* values = v_cache + sequence_head / shape.group * capacity * d + dim;
  const bool writes_new_token = head % shape.group == 0;  // one block of the group stores it

  DecodeState<A, kValues> state{A(-INFINITY), A(0), {}};
  // The loop bound is the warp's, so every lane reaches the shuffles; a group past the last key adds
  // nothing (its score is -inf).
  for (int64_t base = first + int64_t{warp} * kKeysPerWarp; base < filled; base += kDecodeWarps * kKeysPerWarp) {
    const int64_t key = base + lane / kGroup;
    const bool visible = key < filled;
    // Both rows are loaded before either is used: two 16-byte loads in flight per lane, not one.
    const bool new_token = key == filled - 1;  // from the projection, not (yet) the cache
    A k_values[kValues] = {}, v_values[kValues] = {};
    if (visible) {
      load_row_part<T, kValues>(new_token ? k_new + kv_token : keys + key * d, k_values, in_row);
      load_row_part<T, kValues>(new_token ? v_new + kv_token : values + key * d, v_values, in_row);
    }
    if (new_token && writes_new_token) {
      copy_row_part<T, kValues>(k_new + kv_token, keys + key * d, in_row);
      copy_row_part<T, kValues>(v_new + kv_token, values + key * d, in_row);
    }
    A partial = 0;
#pragma unroll
    for (int i = 0; i < kValues; ++i) partial += query[i] * k_values[i];
#pragma unroll
    for (int offset = kGroup / 2; offset > 0; offset /= 2) partial += shuffle_xor(partial, offset);
    if (!visible) continue;
    const A new_max = state.max > partial ? state.max : partial;
    const A rescale = exp_acc(state.max - new_max), p = exp_acc(partial - new_max);
    state.sum = state.sum * rescale + p;
#pragma unroll
    for (int i = 0; i < kValues; ++i) state.out[i] = state.out[i] * rescale + p * v_values[i];
    state.max = new_max;
  }

  // Lanes at the same place in their groups hold the same dims: merge the warp's groups into group 0.
#pragma unroll
  for (int offset = kGroup; offset < kWarpSize; offset *= 2) merge_into(state, shuffle_state(state, offset));

  __shared__ DecodeState<A, kValues> warp_states[kDecodeWarps][kGroup];
  if (lane < kGroup) warp_states[warp][lane] = state;
  __syncthreads();
  if (warp != 0 || lane >= kGroup) return;
#pragma unroll
  for (int other = 1; other < kDecodeWarps; ++other) merge_into(state, warp_states[other][lane]);
  const A inverse_sum = A(1) / state.sum;  // > 0: the new key is always visible
  T* out_row = out + sequence_head * d + dim;
#pragma unroll
  for (int i = 0; i < kValues; ++i) {
    if (i < in_row) out_row[i] = from_acc<T>(state.out[i] * inverse_sum);
  }
}

}  // namespace

void launch_attention_decode(DType dtype, const DecodeShape& shape, const void* q, const void* k_new, const void* v_new,
                             void* k_cache, void* v_cache, const int32_t* key_lengths, void* out, void* stream) {
  dispatch_dtype(dtype, [&](auto type_tag) {
    using T = decltype(type_tag);
    // Power-of-two tiles: a group of lanes per key must be a power of two for its shuffles.
    dispatch_tile_width<16, 32, 64, 128, 256>(shape.head_dim, [&](auto tile_width) {
      constexpr int kD = decltype(tile_width)::value;
      attention_decode_kernel<T, kD><<<static_cast<unsigned>(shape.batch * shape.heads), kDecodeWarps * kWarpSize, 0,
                                       static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(q), static_cast<const T*>(k_new), static_cast<const T*>(v_new), static_cast<T*>(k_cache),
          static_cast<T*>(v_cache), key_lengths, static_cast<T*>(out), shape);
    });
  });
}

}  // namespace kernel_ladder
