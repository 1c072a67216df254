// Swish in CUDA: y = x * sigmoid(beta * x), forward and backward.
//
// What it computes
//   swish_forward_kernel    y  = x * s,                          s = sigmoid(beta * x)
//   swish_backward_kernel   dx = dy * s * (1 + beta * x * (1 - s))  (s recomputed from x, never stored)
//
// The one idea that makes it fast
//   One pass over memory, in 16-byte pieces. Each thread loads one 16-byte pack (4 floats, 8 halves),
//   does a dozen FLOPs per element in float registers and stores one pack. A few FLOPs per 2-8 bytes
//   moved is far below what the SMs can do, so the kernel runs at copy bandwidth; the only things that
//   matter are wide, coalesced accesses and enough of them in flight (a full GPU of 256-thread blocks).
//   The backward recomputes s: one exp costs nothing next to writing s forward and reading it back.
//
// The climb to this kernel, kept runnable (swish_forward_version; lesson 01 shows each one's H100
// time), each version the same as the one before but:
//   version 1  one element per thread, IEEE expf and division: what a first port from C++ writes
//   version 2  the hardware's exp and reciprocal units (__expf, __fdividef) instead of IEEE's routines
//   version 3  16-byte packs (4 floats, 8 halves a load) with streaming cache hints: swish_forward_kernel
//
// Limits
//   Any numel (the last thread takes the ragged tail one element at a time); contiguous memory.
//   float16, bfloat16, float32 (computed in float32) and float64. Pointers that are not 16-byte aligned
//   (a view starting mid-allocation) take the same kernel with 1-element packs.
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -v -c cuda_kernels/swish.cu -o /tmp/swish.o
//   python -m pytest tests -k "swish and cuda"
#include "common.cuh"

namespace kernel_ladder {

constexpr int kSwishThreads = 256;

// __expf is the hardware's exp2 unit (MUFU.EX2) plus a multiply, and __fdividef a reciprocal (MUFU.RCP)
// and a multiply: a few ulp each, without the ~20 instructions and the slow-path branch of IEEE expf
// and division. The denominator is >= 1 (or inf, giving 0, the right limit), where both are accurate.
// (kFastMath = false is version 1's IEEE arithmetic, kept for the climb.)
template <bool kFastMath = true>
__device__ __forceinline__ float sigmoid(float z) {
  if constexpr (kFastMath) return __fdividef(1.0f, 1.0f + __expf(-z));
  return 1.0f / (1.0f + expf(-z));
}
template <bool kFastMath = true>
__device__ __forceinline__ double sigmoid(double z) { return 1.0 / (1.0 + exp(-z)); }

template <bool kFastMath = true, typename A>
__device__ __forceinline__ A swish_value(A x, A beta) { return x * sigmoid<kFastMath>(beta * x); }

template <typename A>
__device__ __forceinline__ A swish_gradient(A dy, A x, A beta) {
  const A s = sigmoid(beta * x);
  return dy * s * (A(1) + beta * x * (A(1) - s));
}

// Thread i owns elements [i*kVec, i*kVec + kVec): one pack, or the ragged tail if the array ends inside it.
template <int kVec>
__device__ __forceinline__ int64_t first_element_of_thread() {
  return (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) * kVec;
}

template <typename T, int kVec, bool kFastMath = true>
__global__ void __launch_bounds__(kSwishThreads)
swish_forward_kernel(const T* __restrict__ x, T* __restrict__ y, int64_t numel, Acc<T> beta) {
  const int64_t first = first_element_of_thread<kVec>();
  if (first + kVec <= numel) {
    const Pack<T, kVec> in = load_pack_once<T, kVec>(x + first);
    Pack<T, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.val[j] = from_acc<T>(swish_value<kFastMath>(to_acc(in.val[j]), beta));
    store_pack_once<T, kVec>(y + first, out);
  } else {
    for (int64_t i = first; i < numel; ++i) y[i] = from_acc<T>(swish_value<kFastMath>(to_acc(x[i]), beta));
  }
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kSwishThreads)
swish_backward_kernel(const T* __restrict__ grad_out, const T* __restrict__ x, T* __restrict__ grad_x,
                      int64_t numel, Acc<T> beta) {
  const int64_t first = first_element_of_thread<kVec>();
  if (first + kVec <= numel) {
    const Pack<T, kVec> dy = load_pack_once<T, kVec>(grad_out + first);
    const Pack<T, kVec> in = load_pack_once<T, kVec>(x + first);
    Pack<T, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.val[j] = from_acc<T>(swish_gradient(to_acc(dy.val[j]), to_acc(in.val[j]), beta));
    store_pack_once<T, kVec>(grad_x + first, out);
  } else {
    for (int64_t i = first; i < numel; ++i) grad_x[i] = from_acc<T>(swish_gradient(to_acc(grad_out[i]), to_acc(x[i]), beta));
  }
}

// One thread per pack: ceil(numel / kVec) threads in 256-thread blocks.
template <int kVec>
dim3 swish_grid(int64_t numel) { return dim3(static_cast<unsigned>(ceil_div(ceil_div(numel, kVec), kSwishThreads))); }

void launch_swish_forward(DType dtype, const void* x, void* y, int64_t numel, double beta, void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    dispatch_vector_width<T>(aligned_16(x) && aligned_16(y), [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      swish_forward_kernel<T, kVec><<<swish_grid<kVec>(numel), kSwishThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(x), static_cast<T*>(y), numel, Acc<T>(beta));
    });
  });
}

void launch_swish_forward_version(DType dtype, const void* x, void* y, int64_t numel, double beta, int version,
                                  void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    const auto s = static_cast<cudaStream_t>(stream);
    const T* in = static_cast<const T*>(x);
    T* out = static_cast<T*>(y);
    if (version == 1) {
      swish_forward_kernel<T, 1, false><<<swish_grid<1>(numel), kSwishThreads, 0, s>>>(in, out, numel, Acc<T>(beta));
    } else if (version == 2) {
      swish_forward_kernel<T, 1, true><<<swish_grid<1>(numel), kSwishThreads, 0, s>>>(in, out, numel, Acc<T>(beta));
    } else {
      launch_swish_forward(dtype, x, y, numel, beta, stream);
    }
  });
}

void launch_swish_backward(DType dtype, const void* grad_out, const void* x, void* grad_x, int64_t numel,
                           double beta, void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    dispatch_vector_width<T>(aligned_16(grad_out) && aligned_16(x) && aligned_16(grad_x), [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      swish_backward_kernel<T, kVec><<<swish_grid<kVec>(numel), kSwishThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(grad_out), static_cast<const T*>(x), static_cast<T*>(grad_x), numel, Acc<T>(beta));
    });
  });
}

}  // namespace kernel_ladder
