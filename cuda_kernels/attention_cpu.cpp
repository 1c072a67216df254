// Attention on the CPU: the C++ twin of attention_forward.cu / attention_backward.cu, registered for the
// CPU dispatch key of the same ops.
//
// What it computes, for each (batch, head), with S = q k^T * scale restricted to the visible keys
//   forward    P = softmax(S) row by row,  out = P v,  lse = log(sum(exp(S))) per query row
//   decode     one new token's key and value appended to a static cache, its query over the filled keys
//   backward   delta = rowsum(dout * out),  P = exp(S - lse) recomputed,  dP = dout v^T,
//              dS = P * (dP - delta),  dq = dS k * scale,  dk = dS^T q * scale,  dv = P^T dout
//
// The one idea that makes it fast
//   Flash attention's plan on cores instead of SMs. A task is one (batch*head, tile of 32 queries);
//   it streams tiles of 64 keys (which stay in L1/L2 while all 32 queries use them) and merges them
//   with the online softmax: a running max m, a running sum l and a running output, rescaled by
//   exp(m_old - m_new) whenever a tile raises the max. So no seq x seq matrix is ever stored, and the
//   backward recomputes P from the saved lse. The backward runs two passes, each writing its own
//   outputs only (no atomics, deterministic): dq per query tile, then dk, dv per key tile (with
//   grouped-query attention, summed over the group's query heads in order). Masks are
//   ranges (attention_mask.h), so invisible keys are never visited. Inner loops over head_dim are
//   `omp simd` dot products and axpys; exp is the vectorisable one of cpu_common.h.
//
// Layout
//   q, k, v, out and dout are read (and out written) where they lie, as their HeadStrides say
//   (kernels.h): usually the heads of the fused q·k·v projection, and out in (batch, tokens, heads,
//   head_dim) order. Only each row's head_dim values are contiguous, so a task finds its head's first
//   row once and steps from row to row by `row`. lse, delta, dq, dk and dv are contiguous.
//
// Limits
//   float32 (accumulating in float32, as the CUDA kernels do) and float64; any head_dim up to 256 (the
//   loops run over the row as it is; the binding admits multiples of 8, as the CUDA kernels do); k and
//   v may have 1 / group as many heads as q (grouped-query attention).
//
// Check
//   python -m pytest tests -k "attention and cuda and cpu"
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "attention_mask.h"
#include "cpu_common.h"

namespace kernel_ladder {
namespace {

constexpr int64_t kQueryTile = 32;
constexpr int64_t kKeyTile = 64;
constexpr int64_t kMaxHeadDim = 256;  // the accumulator rows of a query tile: 32 x 256 x 8 bytes = 64 KB

template <typename T>
inline T dot(const T* __restrict a, const T* __restrict b, int64_t d) {
  T sum = 0;
#pragma omp simd reduction(+ : sum)
  for (int64_t c = 0; c < d; ++c) sum += a[c] * b[c];
  return sum;
}

// y += a * x
template <typename T>
inline void axpy(T* __restrict y, T a, const T* __restrict x, int64_t d) {
#pragma omp simd
  for (int64_t c = 0; c < d; ++c) y[c] += a * x[c];
}

template <typename T>
void attention_forward(const AttentionShape& shape, const T* q, const T* k, const T* v, T* out, T* lse) {
  const VisibleKeys visible(shape);
  const int64_t lq = shape.query_length, d = shape.head_dim, kv_heads = shape.heads / shape.group;
  const T scale = static_cast<T>(shape.scale);
  const int64_t query_tiles = (lq + kQueryTile - 1) / kQueryTile;
#pragma omp parallel for schedule(dynamic)
  for (int64_t task = 0; task < shape.batch_heads * query_tiles; ++task) {
    const int64_t bh = task / query_tiles, i0 = (task % query_tiles) * kQueryTile;
    const int64_t i1 = std::min(i0 + kQueryTile, lq);
    const T* q_bh = q + shape.q.of_head(bh, shape.heads);
    const T* k_bh = k + shape.k.of_head(bh / shape.group, kv_heads);  // the kv head of this query head's group
    const T* v_bh = v + shape.v.of_head(bh / shape.group, kv_heads);
    T* out_bh = out + shape.out.of_head(bh, shape.heads);
    T acc[kQueryTile][kMaxHeadDim] = {};
    T row_max[kQueryTile], row_sum[kQueryTile] = {};
    std::fill(row_max, row_max + kQueryTile, -std::numeric_limits<T>::infinity());
    T scores[kKeyTile];
    // Key tiles that any query of this tile sees; each query then takes its own range inside.
    for (int64_t j0 = visible.first_key(i0) / kKeyTile * kKeyTile; j0 < visible.end_key(i1 - 1); j0 += kKeyTile) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t first = std::max(j0, visible.first_key(i)), end = std::min(j0 + kKeyTile, visible.end_key(i));
        if (first >= end) continue;
        const T* q_row = q_bh + i * shape.q.row;
        T tile_max = row_max[i - i0];
        for (int64_t j = first; j < end; ++j) {
          scores[j - first] = dot(q_row, k_bh + j * shape.k.row, d) * scale;
          tile_max = std::max(tile_max, scores[j - first]);
        }
        // The online softmax: what was summed against the old max is rescaled to the new one.
        const T rescale = exp_branch_free(row_max[i - i0] - tile_max);
        T* acc_row = acc[i - i0];
        for (int64_t c = 0; c < d; ++c) acc_row[c] *= rescale;
        T tile_sum = 0;
#pragma omp simd reduction(+ : tile_sum)
        for (int64_t j = 0; j < end - first; ++j) {
          scores[j] = exp_branch_free(scores[j] - tile_max);
          tile_sum += scores[j];
        }
        for (int64_t j = first; j < end; ++j) axpy(acc_row, scores[j - first], v_bh + j * shape.v.row, d);
        row_sum[i - i0] = row_sum[i - i0] * rescale + tile_sum;
        row_max[i - i0] = tile_max;
      }
    }
    for (int64_t i = i0; i < i1; ++i) {
      const T inverse_sum = T(1) / row_sum[i - i0];
      T* out_row = out_bh + i * shape.out.row;
      for (int64_t c = 0; c < d; ++c) out_row[c] = acc[i - i0][c] * inverse_sum;
      lse[bh * lq + i] = row_max[i - i0] + std::log(row_sum[i - i0]);
    }
  }
}

// Recomputed probability and score gradient of one visible (query, key) pair, from the saved lse and
// delta = rowsum(dout * out): recomputing costs two dot products, storing P would cost seq^2 memory.
template <typename T>
struct PairGradient {
  T p, ds;
};

template <typename T>
inline PairGradient<T> pair_gradient(const T* q_row, const T* dout_row, const T* k_row, const T* v_row, T lse, T delta,
                                     T scale, int64_t d) {
  const T p = exp_branch_free(dot(q_row, k_row, d) * scale - lse);
  return {p, p * (dot(dout_row, v_row, d) - delta)};
}

template <typename T>
void attention_backward(const AttentionShape& shape, const T* dout, const T* q, const T* k, const T* v, const T* out,
                        const T* lse, T* dq, T* dk, T* dv) {
  const VisibleKeys visible(shape);
  const int64_t lq = shape.query_length, lk = shape.key_length, d = shape.head_dim, bhs = shape.batch_heads;
  const int64_t heads = shape.heads, group = shape.group, kv_heads = heads / group;
  const T scale = static_cast<T>(shape.scale);
  std::vector<T> delta(static_cast<size_t>(bhs * lq));
#pragma omp parallel for schedule(static) if (bhs * lq * d >= kMinParallelElements)
  for (int64_t row = 0; row < bhs * lq; ++row) {
    const int64_t bh = row / lq, i = row % lq;
    delta[row] = dot(dout + shape.grad_out.of_head(bh, heads) + i * shape.grad_out.row,
                     out + shape.out.of_head(bh, heads) + i * shape.out.row, d);
  }

  // Pass 1: dq, one task per (batch*head, query tile), streaming the key tiles it sees.
  const int64_t query_tiles = (lq + kQueryTile - 1) / kQueryTile;
#pragma omp parallel for schedule(dynamic)
  for (int64_t task = 0; task < bhs * query_tiles; ++task) {
    const int64_t bh = task / query_tiles, i0 = (task % query_tiles) * kQueryTile;
    const int64_t i1 = std::min(i0 + kQueryTile, lq);
    const T* q_bh = q + shape.q.of_head(bh, heads);
    const T* dout_bh = dout + shape.grad_out.of_head(bh, heads);
    const T* k_bh = k + shape.k.of_head(bh / group, kv_heads);  // the kv head of this query head's group
    const T* v_bh = v + shape.v.of_head(bh / group, kv_heads);
    T* dq_bh = dq + shape.grad_q.of_head(bh, heads);
    for (int64_t i = i0; i < i1; ++i) std::fill_n(dq_bh + i * shape.grad_q.row, d, T(0));
    for (int64_t j0 = visible.first_key(i0) / kKeyTile * kKeyTile; j0 < visible.end_key(i1 - 1); j0 += kKeyTile) {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t row = bh * lq + i;  // of the contiguous lse and delta
        const int64_t end = std::min(j0 + kKeyTile, visible.end_key(i));
        const T* q_row = q_bh + i * shape.q.row;
        const T* dout_row = dout_bh + i * shape.grad_out.row;
        T* dq_row = dq_bh + i * shape.grad_q.row;
        for (int64_t j = std::max(j0, visible.first_key(i)); j < end; ++j) {
          const T* k_row = k_bh + j * shape.k.row;
          const PairGradient<T> g =
              pair_gradient(q_row, dout_row, k_row, v_bh + j * shape.v.row, lse[row], delta[row], scale, d);
          axpy(dq_row, g.ds * scale, k_row, d);
        }
      }
    }
  }

  // Pass 2: dk and dv, one task per (batch*kv head, key tile), streaming the query tiles that see it,
  // of each query head of its group in turn (one order: deterministic sums over the group).
  const int64_t key_tiles = (lk + kKeyTile - 1) / kKeyTile;
#pragma omp parallel for schedule(dynamic)
  for (int64_t task = 0; task < bhs / group * key_tiles; ++task) {
    const int64_t kv = task / key_tiles, j0 = (task % key_tiles) * kKeyTile;
    const int64_t j1 = std::min(j0 + kKeyTile, lk);
    const T* k_kv = k + shape.k.of_head(kv, kv_heads);
    const T* v_kv = v + shape.v.of_head(kv, kv_heads);
    T* dk_kv = dk + shape.grad_k.of_head(kv, kv_heads);
    T* dv_kv = dv + shape.grad_v.of_head(kv, kv_heads);
    for (int64_t j = j0; j < j1; ++j) {
      std::fill_n(dk_kv + j * shape.grad_k.row, d, T(0));
      std::fill_n(dv_kv + j * shape.grad_v.row, d, T(0));
    }
    for (int64_t bh = kv * group; bh < (kv + 1) * group; ++bh) {
      const T* q_bh = q + shape.q.of_head(bh, heads);
      const T* dout_bh = dout + shape.grad_out.of_head(bh, heads);
      for (int64_t i0 = visible.first_query(j0) / kQueryTile * kQueryTile; i0 < visible.end_query(j1 - 1);
           i0 += kQueryTile) {
        for (int64_t j = j0; j < j1; ++j) {
          T* dk_row = dk_kv + j * shape.grad_k.row;
          T* dv_row = dv_kv + j * shape.grad_v.row;
          const T* k_row = k_kv + j * shape.k.row;
          const T* v_row = v_kv + j * shape.v.row;
          const int64_t end = std::min(i0 + kQueryTile, visible.end_query(j));
          for (int64_t i = std::max(i0, visible.first_query(j)); i < end; ++i) {
            const int64_t row = bh * lq + i;
            const T* q_row = q_bh + i * shape.q.row;
            const T* dout_row = dout_bh + i * shape.grad_out.row;
            const PairGradient<T> g = pair_gradient(q_row, dout_row, k_row, v_row, lse[row], delta[row], scale, d);
            axpy(dv_row, g.p, dout_row, d);
            axpy(dk_row, g.ds * scale, q_row, d);
          }
        }
      }
    }
  }
}

// One new token per sequence over a static cache (attention_decode.cu's twin): its key and value
// written at the last filled position (first, once per kv head, so that every query head of a group
// then reads them there), then the scores of the filled keys and their softmax-weighted sum of values,
// one (sequence, head) per task.
template <typename T>
void attention_decode(const DecodeShape& shape, const T* q, const T* k_new, const T* v_new, T* k_cache, T* v_cache,
                      const int32_t* key_lengths, T* out) {
  const int64_t d = shape.head_dim, tasks = shape.batch * shape.heads, kv_heads = shape.heads / shape.group;
  const T scale = static_cast<T>(shape.scale);
  for (int64_t kv = 0; kv < shape.batch * kv_heads; ++kv) {
    const int64_t sequence = kv / kv_heads;
    const int64_t token = sequence * shape.kv_stride_batch + kv % kv_heads * shape.kv_stride_head;
    const int64_t slot = (kv * shape.capacity + std::clamp<int64_t>(key_lengths[sequence], 1, shape.capacity) - 1) * d;
    std::copy(k_new + token, k_new + token + d, k_cache + slot);
    std::copy(v_new + token, v_new + token + d, v_cache + slot);
  }
#pragma omp parallel for schedule(static) if (tasks * shape.capacity * d >= kMinParallelElements)
  for (int64_t bh = 0; bh < tasks; ++bh) {
    const int64_t sequence = bh / shape.heads, head = bh % shape.heads;
    const T* query = q + sequence * shape.q_stride_batch + head * shape.q_stride_head;
    const int64_t filled = std::clamp<int64_t>(key_lengths[sequence], 1, shape.capacity);  // the new token is one
    const int64_t first = shape.window > 0 ? std::max<int64_t>(filled - shape.window, 0) : 0;
    const T* keys = k_cache + bh / shape.group * shape.capacity * d;
    const T* values = v_cache + bh / shape.group * shape.capacity * d;
    T* o = out + bh * d;
    T maximum = -std::numeric_limits<T>::infinity();
    for (int64_t j = first; j < filled; ++j) maximum = std::max(maximum, dot(query, keys + j * d, d) * scale);
    std::fill(o, o + d, T(0));
    T sum = 0;
    for (int64_t j = first; j < filled; ++j) {
      const T p = std::exp(dot(query, keys + j * d, d) * scale - maximum);
      sum += p;
      axpy(o, p, values + j * d, d);
    }
    const T inverse_sum = T(1) / sum;  // > 0: the new key is always visible
#pragma omp simd
    for (int64_t c = 0; c < d; ++c) o[c] *= inverse_sum;
  }
}

}  // namespace

void attention_decode_cpu(DType dtype, const DecodeShape& shape, const void* q, const void* k_new, const void* v_new,
                          void* k_cache, void* v_cache, const int32_t* key_lengths, void* out) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    attention_decode<T>(shape, static_cast<const T*>(q), static_cast<const T*>(k_new), static_cast<const T*>(v_new),
                        static_cast<T*>(k_cache), static_cast<T*>(v_cache), key_lengths, static_cast<T*>(out));
  });
}

void attention_forward_cpu(DType dtype, const AttentionShape& shape, const void* q, const void* k, const void* v,
                           void* out, void* lse) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    attention_forward<T>(shape, static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v),
                         static_cast<T*>(out), static_cast<T*>(lse));
  });
}

void attention_backward_cpu(DType dtype, const AttentionShape& shape, const void* grad_out, const void* q,
                            const void* k, const void* v, const void* out, const void* lse, void* grad_q,
                            void* grad_k, void* grad_v) {
  dispatch_cpu_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    attention_backward<T>(shape, static_cast<const T*>(grad_out), static_cast<const T*>(q), static_cast<const T*>(k),
                          static_cast<const T*>(v), static_cast<const T*>(out), static_cast<const T*>(lse),
                          static_cast<T*>(grad_q), static_cast<T*>(grad_k), static_cast<T*>(grad_v));
  });
}

}  // namespace kernel_ladder
