// AdamW on the CPU: the C++ twin of adamw.cu, registered for the CPU dispatch key of the same op.
//
// What it computes, for each (param, grad, exp_avg, exp_avg_sq), in place (torch.optim.AdamW's math;
// the factors computed once in double by the binding)
//   param      *= 1 - lr * weight_decay
//   exp_avg    += (1 - beta1) * (grad - exp_avg)
//   exp_avg_sq  = beta2 * exp_avg_sq + (1 - beta2) * grad * grad
//   param      -= lr / (1 - beta1^step) * exp_avg / (sqrt(exp_avg_sq) / sqrt(1 - beta2^step) + eps)
//
// The one idea that makes it fast
//   The CUDA kernel's flat schedule: every tensor cut into chunks, and OpenMP hands out the (tensor,
//   chunk) pairs of all tensors together, so GPT-2's 98 small vectors and its embedding share one
//   thread team instead of waking it 148 times. Inside a chunk one `omp simd` loop reads each array
//   once and writes three once (sqrt and division vectorise as AVX instructions).
//
// Limits
//   float32 (computed in float32, as the CUDA kernel does) and float64; any sizes > 0.
//
// Check
//   python -m pytest tests -k "adamw and cuda"
#include <cmath>
#include <vector>

#include "cpu_common.h"

namespace kernel_ladder {
namespace {

// 16384 values: 4 arrays x 64 KB of float32 in flight per thread, about a core's L2.
constexpr int64_t kChunkValues = 1 << 14;

struct Chunk {
  int64_t tensor, start, end;
};

template <typename T>
void adamw_step(const AdamWTensors& tensors, const AdamWFactors& factors) {
  const T decay = T(factors.decay), one_minus_beta1 = T(factors.one_minus_beta1), beta2 = T(factors.beta2),
          one_minus_beta2 = T(factors.one_minus_beta2), eps = T(factors.eps), step_size = T(factors.step_size),
          bias_correction2_sqrt = T(factors.bias_correction2_sqrt);
  std::vector<Chunk> chunks;
  int64_t total = 0;
  for (int64_t t = 0; t < tensors.count; ++t) {
    for (int64_t start = 0; start < tensors.numels[t]; start += kChunkValues) {
      chunks.push_back({t, start, std::min(start + kChunkValues, tensors.numels[t])});
    }
    total += tensors.numels[t];
  }
  const auto chunk_count = static_cast<int64_t>(chunks.size());
#pragma omp parallel for schedule(static) if (total >= kMinParallelElements)
  for (int64_t c = 0; c < chunk_count; ++c) {
    const Chunk chunk = chunks[c];
    T* __restrict param = static_cast<T*>(tensors.params[chunk.tensor]);
    const T* __restrict grad = static_cast<const T*>(tensors.grads[chunk.tensor]);
    T* __restrict exp_avg = static_cast<T*>(tensors.exp_avgs[chunk.tensor]);
    T* __restrict exp_avg_sq = static_cast<T*>(tensors.exp_avg_sqs[chunk.tensor]);
    // Operation by operation as torch.optim.AdamW (foreach=False) rounds them.
#pragma omp simd
    for (int64_t i = chunk.start; i < chunk.end; ++i) {
      const T g = grad[i];
      const T m = exp_avg[i] + one_minus_beta1 * (g - exp_avg[i]);
      const T v = beta2 * exp_avg_sq[i] + one_minus_beta2 * g * g;
      const T denominator = std::sqrt(v) / bias_correction2_sqrt + eps;
      param[i] = param[i] * decay - step_size * (m / denominator);
      exp_avg[i] = m;
      exp_avg_sq[i] = v;
    }
  }
}

}  // namespace

void adamw_step_cpu(DType dtype, const AdamWTensors& tensors, const AdamWFactors& factors) {
  dispatch_cpu_dtype(dtype, [&](auto zero) { adamw_step<decltype(zero)>(tensors, factors); });
}

}  // namespace kernel_ladder
