// The level-5 binding: the `cuda_kernels` op schemas, their input checks and output allocation, and the
// registration of one C++ function per op for the CPU dispatch key and (in a CUDA build) the CUDA key.
//
// The kernels themselves never see a tensor: each op below checks its inputs (TORCH_CHECK, so a bad
// call is a Python RuntimeError naming the op and the argument), allocates its outputs with PyTorch's
// allocator, and hands raw pointers to the C++ CPU functions or to the CUDA launchers on the current
// stream. fake (shape-only) and autograd registrations are in Python, in __init__.py.
//
// KERNEL_LADDER_WITH_CUDA is defined by the loader only when it compiles the .cu files too; without
// it this file needs no CUDA header and links against PyTorch's CPU-only build.
#include <ATen/ATen.h>
#include <torch/library.h>

#ifdef KERNEL_LADDER_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <initializer_list>
#include <optional>
#include <tuple>

#include "kernels.h"

namespace kernel_ladder {
namespace {

using TensorTriple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The kernels' DType for x's dtype, if our kernels compute it on x's device.
DType kernel_dtype(const char* op, const at::Tensor& x) {
  const at::ScalarType type = x.scalar_type();
  const bool ieee = type == at::kFloat || type == at::kDouble;
  const bool half = type == at::kHalf || type == at::kBFloat16;
  TORCH_CHECK(ieee || (half && x.is_cuda()), "cuda_kernels::", op, " got dtype ", type, " on ", x.device(),
              "; supported: ", x.is_cuda() ? "Float, Double, Half, BFloat16" : "Float, Double (Half and BFloat16 on CUDA only)");
  switch (type) {
    case at::kDouble: return DType::Float64;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    default: return DType::Float32;
  }
}

// mean and rstd, and the backward's partial sums, are kept in the kernels' accumulator type.
at::ScalarType statistics_dtype(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// Every tensor argument: on x's device, of the expected dtype and shape, and contiguous (the kernels
// index memory linearly).
void check_argument(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x, at::ScalarType dtype,
                    at::IntArrayRef shape) {
  TORCH_CHECK(t.device() == x.device(), "cuda_kernels::", op, ": ", name, " is on ", t.device(), " but x is on ", x.device());
  TORCH_CHECK(t.scalar_type() == dtype, "cuda_kernels::", op, ": ", name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK(t.sizes() == shape, "cuda_kernels::", op, ": ", name, " has shape ", t.sizes(), ", expected ", shape);
  TORCH_CHECK(t.is_contiguous(), "cuda_kernels::", op, ": ", name, " must be contiguous (call .contiguous() first)");
}

// x of LayerNorm: a (rows, n) matrix with n >= 1 (a row of no elements has no mean).
void check_rows(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "cuda_kernels::", op, ": x must be a (rows, N) matrix, got shape ", x.sizes());
  TORCH_CHECK(x.size(1) >= 1, "cuda_kernels::", op, ": rows of 0 elements have no mean (x has shape ", x.sizes(), ")");
  TORCH_CHECK(x.size(0) < (int64_t{1} << 31), "cuda_kernels::", op, ": at most 2^31 - 1 rows (one CUDA block each), got ", x.size(0));
}

// Runs `cuda(stream)` for a CUDA tensor x, on x's GPU and its current stream, then checks the launch;
// runs `cpu()` otherwise. (A CPU-only build registers no CUDA kernels, so no CUDA tensor gets here.)
template <typename Cuda, typename Cpu>
void run_on_device_of([[maybe_unused]] const at::Tensor& x, [[maybe_unused]] Cuda&& cuda, Cpu&& cpu) {
#ifdef KERNEL_LADDER_WITH_CUDA
  if (x.is_cuda()) {
    const c10::cuda::CUDAGuard device_guard(x.device());
    cuda(static_cast<void*>(at::cuda::getCurrentCUDAStream(x.get_device()).stream()));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
#endif
  cpu();
}

// --- the ops -------------------------------------------------------------------------------------

at::Tensor swish_forward(const at::Tensor& x, double beta) {
  const DType dtype = kernel_dtype("swish_forward", x);
  check_argument("swish_forward", "x", x, x, x.scalar_type(), x.sizes());
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return y;  // no 0-block launch
  run_on_device_of(
      x, [&](void* stream) { launch_swish_forward(dtype, x.const_data_ptr(), y.mutable_data_ptr(), x.numel(), beta, stream); },
      [&] { swish_forward_cpu(dtype, x.const_data_ptr(), y.mutable_data_ptr(), x.numel(), beta); });
  return y;
}

at::Tensor swish_backward(const at::Tensor& grad_out, const at::Tensor& x, double beta) {
  const DType dtype = kernel_dtype("swish_backward", x);
  check_argument("swish_backward", "x", x, x, x.scalar_type(), x.sizes());
  check_argument("swish_backward", "grad_out", grad_out, x, x.scalar_type(), x.sizes());
  at::Tensor grad_x = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return grad_x;
  run_on_device_of(
      x,
      [&](void* stream) {
        launch_swish_backward(dtype, grad_out.const_data_ptr(), x.const_data_ptr(), grad_x.mutable_data_ptr(), x.numel(),
                              beta, stream);
      },
      [&] { swish_backward_cpu(dtype, grad_out.const_data_ptr(), x.const_data_ptr(), grad_x.mutable_data_ptr(), x.numel(), beta); });
  return grad_x;
}

TensorTriple layer_norm_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  const char* op = "layer_norm_forward";
  check_rows(op, x);
  const DType dtype = kernel_dtype(op, x);
  const int64_t rows = x.size(0), n = x.size(1);
  check_argument(op, "x", x, x, x.scalar_type(), {rows, n});
  check_argument(op, "weight", weight, x, x.scalar_type(), {n});
  check_argument(op, "bias", bias, x, x.scalar_type(), {n});
  at::Tensor y = at::empty({rows, n}, x.options());
  at::Tensor mean = at::empty({rows}, x.options().dtype(statistics_dtype(x)));
  at::Tensor rstd = at::empty({rows}, mean.options());
  if (rows == 0) return {y, mean, rstd};
  run_on_device_of(
      x,
      [&](void* stream) {
        launch_layer_norm_forward(dtype, x.const_data_ptr(), weight.const_data_ptr(), bias.const_data_ptr(),
                                  y.mutable_data_ptr(), mean.mutable_data_ptr(), rstd.mutable_data_ptr(), rows, n, eps,
                                  stream);
      },
      [&] {
        layer_norm_forward_cpu(dtype, x.const_data_ptr(), weight.const_data_ptr(), bias.const_data_ptr(),
                               y.mutable_data_ptr(), mean.mutable_data_ptr(), rstd.mutable_data_ptr(), rows, n, eps);
      });
  return {y, mean, rstd};
}

TensorTriple layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                                 const at::Tensor& mean, const at::Tensor& rstd) {
  const char* op = "layer_norm_backward";
  check_rows(op, x);
  const DType dtype = kernel_dtype(op, x);
  const int64_t rows = x.size(0), n = x.size(1);
  check_argument(op, "x", x, x, x.scalar_type(), {rows, n});
  check_argument(op, "grad_out", grad_out, x, x.scalar_type(), {rows, n});
  check_argument(op, "weight", weight, x, x.scalar_type(), {n});
  check_argument(op, "mean", mean, x, statistics_dtype(x), {rows});
  check_argument(op, "rstd", rstd, x, statistics_dtype(x), {rows});
  at::Tensor grad_x = at::empty({rows, n}, x.options());
  if (rows == 0) return {grad_x, at::zeros({n}, weight.options()), at::zeros({n}, weight.options())};
  at::Tensor grad_weight = at::empty({n}, weight.options());
  at::Tensor grad_bias = at::empty({n}, weight.options());
  run_on_device_of(
      x,
      [&](void* stream) {
        // Scratch for the per-block partial dw and db rows, from PyTorch's caching allocator: freed
        // when this returns, and reused only by work queued after ours on the same stream.
        const int64_t partial_rows = layer_norm_backward_partial_rows(dtype, rows, n);
        at::Tensor workspace = at::empty({2, partial_rows, n}, x.options().dtype(statistics_dtype(x)));
        launch_layer_norm_backward(dtype, grad_out.const_data_ptr(), x.const_data_ptr(), weight.const_data_ptr(),
                                   mean.const_data_ptr(), rstd.const_data_ptr(), grad_x.mutable_data_ptr(),
                                   grad_weight.mutable_data_ptr(), grad_bias.mutable_data_ptr(),
                                   workspace.mutable_data_ptr(), partial_rows, rows, n, stream);
      },
      [&] {
        layer_norm_backward_cpu(dtype, grad_out.const_data_ptr(), x.const_data_ptr(), weight.const_data_ptr(),
                                mean.const_data_ptr(), rstd.const_data_ptr(), grad_x.mutable_data_ptr(),
                                grad_weight.mutable_data_ptr(), grad_bias.mutable_data_ptr(), rows, n);
      });
  return {grad_x, grad_weight, grad_bias};
}

// x of softmax: a (rows, N) matrix; rows of 0 elements give empty outputs.
void check_softmax_rows(const char* op, const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2, "cuda_kernels::", op, ": x must be a (rows, N) matrix, got shape ", x.sizes());
  TORCH_CHECK(x.size(0) < (int64_t{1} << 31), "cuda_kernels::", op, ": at most 2^31 - 1 rows (one CUDA block each), got ", x.size(0));
}

at::Tensor softmax_forward(const at::Tensor& x) {
  const char* op = "softmax_forward";
  check_softmax_rows(op, x);
  const DType dtype = kernel_dtype(op, x);
  check_argument(op, "x", x, x, x.scalar_type(), x.sizes());
  at::Tensor y = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return y;
  const int64_t rows = x.size(0), n = x.size(1);
  run_on_device_of(
      x, [&](void* stream) { launch_softmax_forward(dtype, x.const_data_ptr(), y.mutable_data_ptr(), rows, n, stream); },
      [&] { softmax_forward_cpu(dtype, x.const_data_ptr(), y.mutable_data_ptr(), rows, n); });
  return y;
}

at::Tensor softmax_backward(const at::Tensor& grad_out, const at::Tensor& y) {
  const char* op = "softmax_backward";
  check_softmax_rows(op, y);
  const DType dtype = kernel_dtype(op, y);
  check_argument(op, "y", y, y, y.scalar_type(), y.sizes());
  check_argument(op, "grad_out", grad_out, y, y.scalar_type(), y.sizes());
  at::Tensor grad_x = at::empty(y.sizes(), y.options());
  if (y.numel() == 0) return grad_x;
  const int64_t rows = y.size(0), n = y.size(1);
  run_on_device_of(
      y,
      [&](void* stream) {
        launch_softmax_backward(dtype, grad_out.const_data_ptr(), y.const_data_ptr(), grad_x.mutable_data_ptr(), rows, n, stream);
      },
      [&] { softmax_backward_cpu(dtype, grad_out.const_data_ptr(), y.const_data_ptr(), grad_x.mutable_data_ptr(), rows, n); });
  return grad_x;
}

// The CUDA attention kernels copy rows in 16-byte pieces. A tensor from PyTorch's allocator always
// allows it; only a view that starts at an odd offset into its storage does not.
void check_aligned_16(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK(!t->is_cuda() || reinterpret_cast<uintptr_t>(t->const_data_ptr()) % 16 == 0, "cuda_kernels::", op,
                ": tensors must start at 16-byte aligned addresses on the GPU (call .clone() on this view)");
  }
}

// q (B, H, Lq, D), k and v (B, H, Lk, D), one dtype and device, contiguous; D one of the kernels' tile
// widths; causal attention needs Lq <= Lk (queries are aligned to the end of the keys).
AttentionShape attention_shape(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                               int64_t window, double scale) {
  TORCH_CHECK(q.dim() == 4, "cuda_kernels::", op, ": q must be (batch, heads, seq, head_dim), got shape ", q.sizes());
  const int64_t batch = q.size(0), heads = q.size(1), lq = q.size(2), d = q.size(3);
  const int64_t lk = k.dim() == 4 ? k.size(2) : -1;
  check_argument(op, "q", q, q, q.scalar_type(), {batch, heads, lq, d});
  check_argument(op, "k", k, q, q.scalar_type(), {batch, heads, lk, d});
  check_argument(op, "v", v, q, q.scalar_type(), {batch, heads, lk, d});
  TORCH_CHECK(d == 16 || d == 32 || d == 64 || d == 128, "cuda_kernels::", op, ": head_dim ", d,
              " is not supported by the CUDA attention kernel (supported: 16, 32, 64, 128)");
  TORCH_CHECK(!causal || lq <= lk, "cuda_kernels::", op, ": causal attention with ", lq, " queries but only ", lk,
              " keys (queries are aligned to the end of the keys)");
  TORCH_CHECK(lk >= 1 || lq == 0 || batch * heads == 0, "cuda_kernels::", op, ": ", lq, " queries and no key to attend to");
  TORCH_CHECK(window >= 0, "cuda_kernels::", op, ": window must be >= 0 (0: none), got ", window);
  TORCH_CHECK(window == 0 || causal, "cuda_kernels::", op, ": a sliding window (", window,
              ") looks back from each query, so it needs causal=True");
  check_aligned_16(op, {&q, &k, &v});
  return AttentionShape{batch * heads, lq, lk, d, causal, window, scale};
}

std::tuple<at::Tensor, at::Tensor> attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                     bool causal, int64_t window, double scale) {
  const char* op = "attention_forward";
  const DType dtype = kernel_dtype(op, q);
  const AttentionShape shape = attention_shape(op, q, k, v, causal, window, scale);
  at::Tensor out = at::empty(q.sizes(), q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1), q.size(2)}, q.options().dtype(statistics_dtype(q)));
  if (out.numel() == 0) return {out, lse};  // no 0-block launch
  run_on_device_of(
      q,
      [&](void* stream) {
        launch_attention_forward(dtype, shape, q.const_data_ptr(), k.const_data_ptr(), v.const_data_ptr(),
                                 out.mutable_data_ptr(), lse.mutable_data_ptr(), stream);
      },
      [&] {
        attention_forward_cpu(dtype, shape, q.const_data_ptr(), k.const_data_ptr(), v.const_data_ptr(),
                              out.mutable_data_ptr(), lse.mutable_data_ptr());
      });
  return {out, lse};
}

TensorTriple attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& out, const at::Tensor& lse, bool causal, int64_t window, double scale) {
  const char* op = "attention_backward";
  const DType dtype = kernel_dtype(op, q);
  const AttentionShape shape = attention_shape(op, q, k, v, causal, window, scale);
  check_argument(op, "grad_out", grad_out, q, q.scalar_type(), q.sizes());
  check_argument(op, "out", out, q, q.scalar_type(), q.sizes());
  check_aligned_16(op, {&grad_out, &out});
  check_argument(op, "lse", lse, q, statistics_dtype(q), {q.size(0), q.size(1), q.size(2)});
  if (q.numel() == 0 || k.numel() == 0) {  // nothing to launch; keys no query sees get zero gradients
    return {at::zeros(q.sizes(), q.options()), at::zeros(k.sizes(), k.options()), at::zeros(v.sizes(), v.options())};
  }
  at::Tensor grad_q = at::empty(q.sizes(), q.options());
  at::Tensor grad_k = at::empty(k.sizes(), k.options());
  at::Tensor grad_v = at::empty(v.sizes(), v.options());
  run_on_device_of(
      q,
      [&](void* stream) {
        // delta (and dq partial sums), from PyTorch's caching allocator: freed when this returns, and
        // reused only by work queued after ours on the same stream.
        at::Tensor workspace = at::empty({attention_backward_workspace_size(dtype, shape)}, lse.options());
        launch_attention_backward(dtype, shape, grad_out.const_data_ptr(), q.const_data_ptr(), k.const_data_ptr(),
                                  v.const_data_ptr(), out.const_data_ptr(), lse.const_data_ptr(),
                                  grad_q.mutable_data_ptr(), grad_k.mutable_data_ptr(), grad_v.mutable_data_ptr(),
                                  workspace.mutable_data_ptr(), stream);
      },
      [&] {
        attention_backward_cpu(dtype, shape, grad_out.const_data_ptr(), q.const_data_ptr(), k.const_data_ptr(),
                               v.const_data_ptr(), out.const_data_ptr(), lse.const_data_ptr(), grad_q.mutable_data_ptr(),
                               grad_k.mutable_data_ptr(), grad_v.mutable_data_ptr());
      });
  return {grad_q, grad_k, grad_v};
}

// --- linear layers and the feed-forward block: matmuls by cuBLAS, everything around them ours ---------
//
// A matmul of these sizes is compute-bound, and cuBLAS's tensor-core GEMMs (MKL or oneDNN on the CPU) are
// its ceiling: the issue lets level 5 call them through ATen. A bias goes in at::addmm, which hands a 1-D
// bias to cuBLASLt's epilogue: added while the output tile is still in registers, for no extra pass over
// memory. Our kernels do the memory-bound rest: GELU, its backward, the bias gradients.
// float32 stays IEEE float32: cuBLAS rounds inputs to TF32 only when the user allows it
// (torch.backends.cuda.matmul.allow_tf32, or torch.set_float32_matmul_precision("high"); ATen reads it
// as at::globalContext().allowTF32CuBLAS()). It is off by default and never set here, and F.linear at
// levels 1-3 follows the same flag, so every level multiplies alike.

// x (rows, K) and an nn.Linear weight (N, K), of one dtype and device, contiguous.
void check_linear(const char* op, const at::Tensor& x, const at::Tensor& weight, const char* weight_name) {
  TORCH_CHECK(x.dim() == 2, "cuda_kernels::", op, ": x must be a (rows, features) matrix, got shape ", x.sizes());
  TORCH_CHECK(weight.dim() == 2, "cuda_kernels::", op, ": ", weight_name,
              " must be an (out_features, in_features) matrix, got shape ", weight.sizes());
  TORCH_CHECK(weight.size(1) == x.size(1), "cuda_kernels::", op, ": x has ", x.size(1), " features but ", weight_name,
              " expects ", weight.size(1));
  check_argument(op, "x", x, x, x.scalar_type(), x.sizes());
  check_argument(op, weight_name, weight, x, x.scalar_type(), weight.sizes());
}

void check_bias(const char* op, const char* name, const std::optional<at::Tensor>& bias, const at::Tensor& x,
                int64_t features) {
  if (bias.has_value()) check_argument(op, name, *bias, x, x.scalar_type(), {features});
}

// x W^T (+ bias): the bias in cuBLAS's epilogue (see above).
at::Tensor matmul_transposed(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? at::addmm(*bias, x, weight.t()) : at::mm(x, weight.t());
}

// A bias gradient: the column sums (n,) of a (rows, n) matrix, made by `cuda(sums, workspace, strips,
// stream)` or `cpu(sums)`. An empty matrix: zeros, and nothing launched.
template <typename Cuda, typename Cpu>
at::Tensor bias_gradient(DType dtype, const at::Tensor& matrix, Cuda&& cuda, Cpu&& cpu) {
  const int64_t rows = matrix.size(0), n = matrix.size(1);
  if (matrix.numel() == 0) return at::zeros({n}, matrix.options());
  at::Tensor sums = at::empty({n}, matrix.options());
  run_on_device_of(
      matrix,
      [&](void* stream) {
        // The strips' partial sums, from PyTorch's caching allocator: freed when this returns, and reused
        // only by work queued after ours on the same stream. One strip needs none.
        const int64_t strips = column_sum_strips(dtype, rows, n);
        at::Tensor workspace = at::empty({strips > 1 ? strips : 0, n}, matrix.options().dtype(statistics_dtype(matrix)));
        cuda(sums.mutable_data_ptr(), workspace.mutable_data_ptr(), strips, stream);
      },
      [&] { cpu(sums.mutable_data_ptr()); });
  return sums;
}

at::Tensor column_sums(DType dtype, const at::Tensor& matrix) {
  const int64_t rows = matrix.size(0), n = matrix.size(1);
  return bias_gradient(
      dtype, matrix,
      [&](void* sums, void* workspace, int64_t strips, void* stream) {
        launch_column_sum(dtype, matrix.const_data_ptr(), sums, workspace, strips, rows, n, stream);
      },
      [&](void* sums) { column_sum_cpu(dtype, matrix.const_data_ptr(), sums, rows, n); });
}

at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "linear_forward";
  kernel_dtype(op, x);  // the level's dtypes, though only cuBLAS runs here: the backward's kernel must take them
  check_linear(op, x, weight, "weight");
  check_bias(op, "bias", bias, x, weight.size(0));
  return matmul_transposed(x, weight, bias);
}

TensorTriple linear_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight) {
  const char* op = "linear_backward";
  const DType dtype = kernel_dtype(op, x);
  check_linear(op, x, weight, "weight");
  check_argument(op, "grad_out", grad_out, x, x.scalar_type(), {x.size(0), weight.size(0)});
  // With no rows the two matmuls over rows give zeros, and column_sums launches nothing.
  return {at::mm(grad_out, weight), at::mm(grad_out.t(), x), column_sums(dtype, grad_out)};
}

// x (rows, C), fc_weight (H, C), proj_weight (C, H): the hidden layer's H features come back to C.
void check_feed_forward(const char* op, const at::Tensor& x, const at::Tensor& fc_weight, const at::Tensor& proj_weight) {
  check_linear(op, x, fc_weight, "fc_weight");
  check_argument(op, "proj_weight", proj_weight, x, x.scalar_type(), {x.size(1), fc_weight.size(0)});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> feed_forward_forward(const at::Tensor& x, const at::Tensor& fc_weight,
                                                                    const std::optional<at::Tensor>& fc_bias,
                                                                    const at::Tensor& proj_weight,
                                                                    const std::optional<at::Tensor>& proj_bias) {
  const char* op = "feed_forward_forward";
  const DType dtype = kernel_dtype(op, x);
  check_feed_forward(op, x, fc_weight, proj_weight);
  // Both biases or neither, as GPT-2's `bias` flag sets them.
  TORCH_CHECK(fc_bias.has_value() == proj_bias.has_value(), "cuda_kernels::", op,
              ": give both biases or neither (fc_bias is ", fc_bias.has_value() ? "given" : "None", ", proj_bias is ",
              proj_bias.has_value() ? "given" : "None", ")");
  check_bias(op, "fc_bias", fc_bias, x, fc_weight.size(0));
  check_bias(op, "proj_bias", proj_bias, x, x.size(1));
  // h = x W_fc^T + b_fc, bias in the GEMM's epilogue: h is written once, by cuBLAS. (Adding b_fc in our
  // GELU kernel instead would cost one more write of h.)
  at::Tensor pre_activation = matmul_transposed(x, fc_weight, fc_bias);
  at::Tensor activation = at::empty_like(pre_activation);
  if (pre_activation.numel() > 0) {  // no 0-block launch
    run_on_device_of(
        x,
        [&](void* stream) {
          launch_gelu_forward(dtype, pre_activation.const_data_ptr(), activation.mutable_data_ptr(),
                              pre_activation.numel(), stream);
        },
        [&] { gelu_forward_cpu(dtype, pre_activation.const_data_ptr(), activation.mutable_data_ptr(), pre_activation.numel()); });
  }
  return {matmul_transposed(activation, proj_weight, proj_bias), pre_activation, activation};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> feed_forward_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& fc_weight, const at::Tensor& proj_weight,
    const at::Tensor& pre_activation, const at::Tensor& activation) {
  const char* op = "feed_forward_backward";
  const DType dtype = kernel_dtype(op, x);
  check_feed_forward(op, x, fc_weight, proj_weight);
  const int64_t rows = x.size(0), hidden = fc_weight.size(0);
  check_argument(op, "grad_out", grad_out, x, x.scalar_type(), x.sizes());
  check_argument(op, "pre_activation", pre_activation, x, x.scalar_type(), {rows, hidden});
  check_argument(op, "activation", activation, x, x.scalar_type(), {rows, hidden});
  // da = dy W_proj by cuBLAS; then our kernel turns it into dh = da * gelu'(h) in place, summing dh's
  // columns (b_fc's gradient) in the same pass.
  at::Tensor grad_hidden = at::mm(grad_out, proj_weight);
  at::Tensor grad_fc_bias = bias_gradient(
      dtype, grad_hidden,
      [&](void* sums, void* workspace, int64_t strips, void* stream) {
        launch_gelu_backward(dtype, grad_hidden.mutable_data_ptr(), pre_activation.const_data_ptr(), sums, workspace,
                             strips, rows, hidden, stream);
      },
      [&](void* sums) {
        gelu_backward_cpu(dtype, grad_hidden.mutable_data_ptr(), pre_activation.const_data_ptr(), sums, rows, hidden);
      });
  return {at::mm(grad_hidden, fc_weight), at::mm(grad_hidden.t(), x), grad_fc_bias, at::mm(grad_out.t(), activation),
          column_sums(dtype, grad_out)};
}

// The same functions serve both dispatch keys: they branch on the device themselves.
void register_kernels(torch::Library& m) {
  m.impl("swish_forward", &swish_forward);
  m.impl("swish_backward", &swish_backward);
  m.impl("layer_norm_forward", &layer_norm_forward);
  m.impl("layer_norm_backward", &layer_norm_backward);
  m.impl("softmax_forward", &softmax_forward);
  m.impl("softmax_backward", &softmax_backward);
  m.impl("attention_forward", &attention_forward);
  m.impl("attention_backward", &attention_backward);
  m.impl("linear_forward", &linear_forward);
  m.impl("linear_backward", &linear_backward);
  m.impl("feed_forward_forward", &feed_forward_forward);
  m.impl("feed_forward_backward", &feed_forward_backward);
}

}  // namespace
}  // namespace kernel_ladder

// The contract shared with level 4 (namespace triton_kernels has the same schemas).
TORCH_LIBRARY(cuda_kernels, m) {
  m.def("swish_forward(Tensor x, float beta) -> Tensor");
  m.def("swish_backward(Tensor grad_out, Tensor x, float beta) -> Tensor");
  m.def("layer_norm_forward(Tensor x, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor)");
  m.def("softmax_forward(Tensor x) -> Tensor");
  m.def("softmax_backward(Tensor grad_out, Tensor y) -> Tensor");
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, bool causal, int window, float scale) -> (Tensor, Tensor)");
  m.def("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
        "int window, float scale) -> (Tensor, Tensor, Tensor)");
  m.def("linear_forward(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_backward(Tensor grad_out, Tensor x, Tensor weight) -> (Tensor, Tensor, Tensor)");
  m.def("feed_forward_forward(Tensor x, Tensor fc_weight, Tensor? fc_bias, Tensor proj_weight, Tensor? proj_bias) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("feed_forward_backward(Tensor grad_out, Tensor x, Tensor fc_weight, Tensor proj_weight, Tensor pre_activation, "
        "Tensor activation) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(cuda_kernels, CPU, m) { kernel_ladder::register_kernels(m); }

#ifdef KERNEL_LADDER_WITH_CUDA
TORCH_LIBRARY_IMPL(cuda_kernels, CUDA, m) { kernel_ladder::register_kernels(m); }
#endif
