// Which keys a query sees, shared by the CPU and CUDA attention kernels (levels/attention.py,
// visible_keys_mask, is the specification). Every mask here is a contiguous range of keys per query
// and of queries per key, so kernels never test pairs one by one outside the edge tiles: loop bounds
// skip whatever is invisible, and the work grows with seq x window, not seq^2.
#pragma once

#include <cstdint>

#include "kernels.h"  // AttentionProblem, KERNEL_LADDER_HOST_DEVICE

namespace kernel_ladder {

struct VisibleKeys {
  int64_t query_length, key_length;
  int64_t offset;  // query i sits at key position i + offset (queries are aligned to the end of the keys)
  int64_t window;  // > 0: only the `window` most recent keys; 0: no window
  bool causal;

  KERNEL_LADDER_HOST_DEVICE explicit VisibleKeys(const AttentionProblem& s)
      : query_length(s.query_length), key_length(s.key_length), offset(s.key_length - s.query_length),
        window(s.causal ? s.window : 0), causal(s.causal) {}

  // Query i sees keys [first_key(i), end_key(i)).
  KERNEL_LADDER_HOST_DEVICE int64_t first_key(int64_t i) const {
    const int64_t first = window > 0 ? i + offset - window + 1 : 0;
    return first > 0 ? first : 0;
  }
  KERNEL_LADDER_HOST_DEVICE int64_t end_key(int64_t i) const {
    const int64_t end = causal ? i + offset + 1 : key_length;
    return end < key_length ? end : key_length;
  }
  // Key j is seen by queries [first_query(j), end_query(j)).
  KERNEL_LADDER_HOST_DEVICE int64_t first_query(int64_t j) const {
    const int64_t first = causal ? j - offset : 0;
    return first > 0 ? first : 0;
  }
  KERNEL_LADDER_HOST_DEVICE int64_t end_query(int64_t j) const {
    const int64_t end = window > 0 ? j - offset + window : query_length;
    return end < query_length ? end : query_length;
  }
  // Padding rows past the last query (or key) of a tile see nothing.
  KERNEL_LADDER_HOST_DEVICE bool sees(int64_t i, int64_t j) const {
    return i < query_length && j >= first_key(i) && j < end_key(i);
  }
  // Does every query of [i0, i1) see every key of [j0, j1)? Then a tile needs no mask. Tiles that
  // reach past the last query or key are never "all visible": their padding must be masked.
  KERNEL_LADDER_HOST_DEVICE bool sees_all(int64_t i0, int64_t i1, int64_t j0, int64_t j1) const {
    return i1 <= query_length && j1 <= key_length && first_key(i1 - 1) <= j0 && end_key(i0) >= j1;
  }
};

}  // namespace kernel_ladder
