// What the C++ CPU twins share: the float/double switch and when OpenMP is worth a thread team.
#pragma once

#include <cstdint>

#include "kernels.h"

namespace kernel_ladder {

// Waking a thread team costs a few microseconds: below this many elements one thread finishes first.
constexpr int64_t kMinParallelElements = 1 << 15;

// Calls fn(T{}) with T = float or double; fn is a generic lambda that reads T back with decltype.
// The binding has already rejected every other dtype for CPU tensors.
template <typename Fn>
void dispatch_cpu_dtype(DType dtype, Fn&& fn) {
  if (dtype == DType::Float64) {
    fn(double{});
  } else {
    fn(float{});
  }
}

}  // namespace kernel_ladder
