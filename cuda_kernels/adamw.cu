// AdamW in CUDA: one optimizer step over every parameter tensor, in a handful of launches.
//
// What it computes, for each (param, grad, exp_avg, exp_avg_sq), in place (torch.optim.AdamW's math,
// amsgrad and maximize off; the factors computed once on the host in double, adamw_ops.cpp)
//   param      *= 1 - lr * weight_decay
//   exp_avg    += (1 - beta1) * (grad - exp_avg)
//   exp_avg_sq  = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
//   param      -= lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps)
//
// Kernels
//   adamw_kernel   each block updates one chunk of 16384 values of one tensor; which tensor, it finds
//                  by a binary search of the launch's first-block table; 16-byte packs where the
//                  tensor's four pointers allow
//
// The one idea that makes it fast
//   Multi-tensor apply, the pattern of PyTorch's fused and foreach optimizers and of Apex: the kernel's
//   argument is a struct, passed by value, that holds the four pointers and the size of many tensors
//   and, per tensor, the index of its first block; block b works on the tensor whose range holds b
//   (8 or 9 comparisons in the argument's constant memory), on chunk b - first. The host fills structs
//   and launches one kernel per full struct. How many tensors one launch takes is set by the size of
//   the kernel's arguments: 4 KB until CUDA 12.1 (80 tensors), 32 KB since, on Volta and later (512
//   tensors, 23 KB). GPT-2 small's 148 tensors and 124M values are then one launch of ~7700 blocks,
//   where a loop over tensors would launch 148 kernels and a 4 KB struct two; each launch costs a
//   fill and a drain of the GPU, where the last wave of blocks leaves SMs idle, and 98 of GPT-2's
//   tensors are biases and LayerNorm vectors of 768 to 3072 values: one small block of work each.
//   Chunks of 16384 values (32 a thread) keep the blocks many and short, so the last wave is small.
//   The step is memory-bound: each value of the four tensors is read once and param, exp_avg and
//   exp_avg_sq written once, 7 x 4 = 28 bytes per float32 parameter (3.5 GB a step for GPT-2 small),
//   against about 20 FLOPs. So: 16-byte accesses, evict-first (nothing is read again in the step), and
//   math in float32 registers (float64 for float64).
//
// Limits
//   float16, bfloat16, float32 (computed in float32) and float64; one dtype per launch (the binding
//   groups the tensors by dtype). Any sizes > 0; 16-byte packs need the four pointers of a tensor
//   16-byte aligned, else its values go one at a time. The argument struct is read through
//   __grid_constant__ (sm_70+), so indexing it by the block's tensor copies nothing to local memory.
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -warn-spills -c cuda_kernels/adamw.cu -o /tmp/adamw.o
//   python -m pytest tests -k "adamw and cuda"
#include "common.cuh"

namespace kernel_ladder {
namespace {

constexpr int kAdamWThreads = 512;
constexpr int64_t kChunkValues = 16384;  // one block's share: 8 packs of 4 floats per thread
#if CUDART_VERSION >= 12010
constexpr size_t kMaxKernelArgumentBytes = 32764;  // CUDA 12.1 and later, on Volta and later GPUs
constexpr int kMaxTensorsPerLaunch = 512;
#else
constexpr size_t kMaxKernelArgumentBytes = 4096;
constexpr int kMaxTensorsPerLaunch = 80;
#endif

// The kernel's one argument. Pointers first, then sizes and factors, then the table: no padding.
struct AdamWLaunch {
  void* params[kMaxTensorsPerLaunch];
  const void* grads[kMaxTensorsPerLaunch];
  void* exp_avgs[kMaxTensorsPerLaunch];
  void* exp_avg_sqs[kMaxTensorsPerLaunch];
  int64_t numels[kMaxTensorsPerLaunch];
  AdamWFactors factors;
  int32_t first_block[kMaxTensorsPerLaunch + 1];  // tensor t owns blocks first_block[t] .. first_block[t + 1] - 1
  int32_t tensors;
};
static_assert(sizeof(AdamWLaunch) <= kMaxKernelArgumentBytes, "AdamWLaunch must fit in the kernel's arguments");

// The first step of the binary search: the largest power of two below kMaxTensorsPerLaunch, so that the
// steps (it, half of it, ..., 1) add up to any slot index.
constexpr int largest_power_of_two_below(int n) { return n <= 2 ? 1 : 2 * largest_power_of_two_below((n + 1) / 2); }
constexpr int kFirstSearchStep = largest_power_of_two_below(kMaxTensorsPerLaunch);
static_assert(2 * kFirstSearchStep - 1 >= kMaxTensorsPerLaunch - 1 && kFirstSearchStep < kMaxTensorsPerLaunch, "");

// The factors in the accumulator type, and the update of one value.
template <typename A>
struct AdamWMath {
  A decay, one_minus_beta1, beta2, one_minus_beta2, eps, step_size, bias_correction2_sqrt;

  __device__ explicit AdamWMath(const AdamWFactors& f)
      : decay(f.decay), one_minus_beta1(f.one_minus_beta1), beta2(f.beta2), one_minus_beta2(f.one_minus_beta2),
        eps(f.eps), step_size(f.step_size), bias_correction2_sqrt(f.bias_correction2_sqrt) {}

  // Operation by operation as torch.optim.AdamW (foreach=False) rounds them, so float32 agrees to an ulp
  // or two. sqrt and / are IEEE-rounded (nvcc's defaults without --use_fast_math).
  __device__ __forceinline__ void update(A& param, A grad, A& exp_avg, A& exp_avg_sq) const {
    param *= decay;
    exp_avg += one_minus_beta1 * (grad - exp_avg);
    exp_avg_sq = beta2 * exp_avg_sq + one_minus_beta2 * grad * grad;
    const A denominator = sqrt(exp_avg_sq) / bias_correction2_sqrt + eps;
    param -= step_size * (exp_avg / denominator);
  }
};

__device__ __forceinline__ bool aligned_16_on_device(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
__global__ void __launch_bounds__(kAdamWThreads) adamw_kernel(const __grid_constant__ AdamWLaunch launch) {
  using A = Acc<T>;
  constexpr int kVec = kVecOf<T>;
  // The last tensor whose first block is at or before this block.
  int tensor = 0;
  for (int step = kFirstSearchStep; step > 0; step /= 2) {
    if (tensor + step < launch.tensors && launch.first_block[tensor + step] <= static_cast<int32_t>(blockIdx.x)) tensor += step;
  }
  T* __restrict__ param = static_cast<T*>(launch.params[tensor]);
  const T* __restrict__ grad = static_cast<const T*>(launch.grads[tensor]);
  T* __restrict__ exp_avg = static_cast<T*>(launch.exp_avgs[tensor]);
  T* __restrict__ exp_avg_sq = static_cast<T*>(launch.exp_avg_sqs[tensor]);
  const AdamWMath<A> math(launch.factors);
  const int64_t start = int64_t{static_cast<int32_t>(blockIdx.x) - launch.first_block[tensor]} * kChunkValues;
  const int64_t end = start + kChunkValues < launch.numels[tensor] ? start + kChunkValues : launch.numels[tensor];
  // Chunks start at multiples of 16384 values, so one tensor's four aligned pointers keep every pack
  // aligned; a misaligned tensor (a view into a flat buffer) goes one value at a time.
  const bool vectorise = aligned_16_on_device(param) && aligned_16_on_device(grad) && aligned_16_on_device(exp_avg) &&
                         aligned_16_on_device(exp_avg_sq);
  const int64_t packs_end = vectorise ? start + (end - start) / kVec * kVec : start;
  for (int64_t i = start + int64_t{threadIdx.x} * kVec; i < packs_end; i += int64_t{blockDim.x} * kVec) {
    Pack<T, kVec> p = load_pack_once<T, kVec>(param + i), m = load_pack_once<T, kVec>(exp_avg + i),
                  v = load_pack_once<T, kVec>(exp_avg_sq + i);
    const Pack<T, kVec> g = load_pack_once<T, kVec>(grad + i);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      A p_j = to_acc(p.val[j]), m_j = to_acc(m.val[j]), v_j = to_acc(v.val[j]);
      math.update(p_j, to_acc(g.val[j]), m_j, v_j);
      p.val[j] = from_acc<T>(p_j);
      m.val[j] = from_acc<T>(m_j);
      v.val[j] = from_acc<T>(v_j);
    }
    store_pack_once<T, kVec>(param + i, p);
    store_pack_once<T, kVec>(exp_avg + i, m);
    store_pack_once<T, kVec>(exp_avg_sq + i, v);
  }
  for (int64_t i = packs_end + threadIdx.x; i < end; i += blockDim.x) {
    A p_i = to_acc(param[i]), m_i = to_acc(exp_avg[i]), v_i = to_acc(exp_avg_sq[i]);
    math.update(p_i, to_acc(grad[i]), m_i, v_i);
    param[i] = from_acc<T>(p_i);
    exp_avg[i] = from_acc<T>(m_i);
    exp_avg_sq[i] = from_acc<T>(v_i);
  }
}

}  // namespace

// Fills the struct tensor by tensor (each with its first block) and launches whenever its tensor slots
// are full, and at the end. A launch's blocks: the sum of its tensors' chunks (at most 512 tensors of
// 2^31 values each would overflow the int32 block index; no model has a tensor that large).
void launch_adamw_step(DType dtype, const AdamWTensors& tensors, const AdamWFactors& factors, void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    AdamWLaunch launch{};
    launch.factors = factors;
    for (int64_t index = 0; index < tensors.count; ++index) {
      const int slot = launch.tensors++;
      launch.params[slot] = tensors.params[index];
      launch.grads[slot] = tensors.grads[index];
      launch.exp_avgs[slot] = tensors.exp_avgs[index];
      launch.exp_avg_sqs[slot] = tensors.exp_avg_sqs[index];
      launch.numels[slot] = tensors.numels[index];
      launch.first_block[slot + 1] = launch.first_block[slot] + static_cast<int32_t>(ceil_div(tensors.numels[index], kChunkValues));
      if (launch.tensors < kMaxTensorsPerLaunch && index + 1 < tensors.count) continue;
      adamw_kernel<T><<<static_cast<unsigned>(launch.first_block[launch.tensors]), kAdamWThreads, 0,
                        static_cast<cudaStream_t>(stream)>>>(launch);
      launch.tensors = 0;
    }
  });
}

}  // namespace kernel_ladder
