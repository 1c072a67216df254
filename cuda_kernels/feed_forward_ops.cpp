// Linear layers and GPT-2's feed-forward block as PyTorch ops: matmuls by cuBLAS, everything around them
// ours (feed_forward.cu, feed_forward_cpu.cpp); the autograd formulas and the registration laid out as
// swish_ops.cpp explains, with binding.h's helpers.
//
//   linear_forward(x, weight, bias?)                           -> y = x weight^T + bias    (x: (..., in_features))
//   linear_backward(grad_out, x, weight)                       -> (grad_x, grad_weight, grad_bias)
//   feed_forward_forward(x, fc_weight, fc_bias?, proj_weight, proj_bias?)
//                                                              -> (y, pre_activation, activation)
//   feed_forward_backward(grad_out, x, fc_weight, proj_weight, pre_activation, activation)
//                                                              -> (grad_x, grad_fc_weight, grad_fc_bias,
//                                                                  grad_proj_weight, grad_proj_bias)
//
// x comes as the model holds it, (..., features), the tokens in its leading dims; y, grad_x and grad_out
// have x's leading dims. The GEMMs read x as a (rows, features) matrix, a view made here, below autograd
// (as_rows), so the caller makes none: each view it made was a tensor object in the forward and an
// autograd node in the backward, six per GPT-2 layer.
//
// A matmul of these sizes is compute-bound, and cuBLAS's tensor-core GEMMs (MKL or oneDNN on the CPU) are
// its ceiling, so level 5 calls them through ATen. A bias goes in at::addmm, which hands a 1-D bias to
// cuBLASLt's epilogue: added while the output tile is still in registers, for no extra pass over
// memory. Our kernels do the memory-bound rest: GELU, its backward, the bias gradients. The feed-forward's
// pre-activation h and activation a are outputs so that the backward can reuse them; autograd marks them
// non-differentiable and the Python function returns y.
// float32 stays IEEE float32: cuBLAS rounds inputs to TF32 only when the user allows it
// (torch.backends.cuda.matmul.allow_tf32, or torch.set_float32_matmul_precision("high"); ATen reads it
// as at::globalContext().allowTF32CuBLAS()). It is off by default and never set here, and F.linear at
// levels 1-3 follows the same flag, so every level multiplies alike.
//
// Check
//   python -m pytest tests -k "feed_forward and cuda"
//   python -m pytest tests/test_kernel_ops.py -k "linear_and_feed_forward and cuda"
#include "binding.h"

namespace kernel_ladder {
namespace {

// x (..., K) and an nn.Linear weight (N, K), of one dtype and device.
void check_linear(const char* op, const at::Tensor& x, const at::Tensor& weight, const char* weight_name) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "cuda_kernels::", op, ": x must be (..., features), got a scalar");
  TORCH_CHECK_VALUE(weight.dim() == 2, "cuda_kernels::", op, ": ", weight_name,
                    " must be an (out_features, in_features) matrix, got shape ", weight.sym_sizes());
  TORCH_CHECK_VALUE(weight.sym_size(1) == x.sym_size(-1), "cuda_kernels::", op, ": x has ", x.sym_size(-1),
                    " features but ", weight_name, " expects ", weight.sym_size(1));
  check_argument(op, weight_name, weight, x, x.scalar_type(), weight.sym_sizes());
}

// x (..., K) as the (rows, K) matrix the GEMMs read: a view of an x whose leading dims flatten into one
// (every activation the levels pass), otherwise a copy, made once. (The rows counted, not -1: an empty
// x with K = 0 has no inferable dim.)
at::Tensor as_rows(const at::Tensor& x) { return x.dim() == 2 ? x : x.reshape_symint({row_count(x), x.sym_size(-1)}); }

// The shape of an output with a row of `features` for each row of x: x's leading dims, then `features`.
c10::SymDimVector rows_of(const at::Tensor& x, const c10::SymInt& features) {
  c10::SymDimVector shape(x.sym_sizes().begin(), x.sym_sizes().end() - 1);
  shape.push_back(features);
  return shape;
}

// y (rows, n), made from as_rows(x), with x's leading dims: (..., n).
at::Tensor in_rows_of(const at::Tensor& x, const at::Tensor& y) {
  return x.dim() == 2 ? y : y.view_symint(rows_of(x, y.sym_size(1)));
}

void check_bias(const char* op, const char* name, const std::optional<at::Tensor>& bias, const at::Tensor& x,
                const c10::SymInt& features) {
  if (bias.has_value()) check_argument(op, name, *bias, x, x.scalar_type(), {features});
}

// x W^T (+ bias): the bias in cuBLAS's epilogue (see above).
at::Tensor matmul_transposed(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  return bias.has_value() ? at::addmm(*bias, x, weight.t()) : at::mm(x, weight.t());
}

// A bias gradient: the column sums (n,) of a contiguous (rows, n) matrix, made by `cuda(sums, workspace,
// strips, stream)` or `cpu(sums)`. An empty matrix: zeros, and nothing launched.
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

// A weight's gradient grad_out^T x, written in that weight's own layout. GPT-2's Conv1D (Hugging Face)
// stores (in, out), and levels.huggingface hands it to us as its transpose, a strided view: cuBLAS reads
// it in place, and a gradient made as (x^T grad_out)^T, the same GEMM, has the strides autograd
// accumulates into the (in, out) parameter without a copy.
at::Tensor weight_gradient(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight) {
  if (!weight.is_contiguous() && weight.t().is_contiguous()) return at::mm(x.t(), grad_out).t();
  return at::mm(grad_out.t(), x);
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

// --- linear --------------------------------------------------------------------------------------------

at::Tensor linear_forward(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  const char* op = "linear_forward";
  kernel_dtype(op, x);  // the level's dtypes, though only cuBLAS runs here: the backward's kernel must take them
  check_linear(op, x, weight, "weight");
  check_bias(op, "bias", bias, x, weight.sym_size(0));
  if (x.is_meta()) return at::empty_symint(rows_of(x, weight.sym_size(0)), x.options());
  // ATen's matmuls take any strides (cuBLAS transposes for free): nothing to make contiguous here.
  return in_rows_of(x, matmul_transposed(as_rows(x), weight, bias));
}

TensorTriple linear_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight) {
  const char* op = "linear_backward";
  const DType dtype = kernel_dtype(op, x);
  check_linear(op, x, weight, "weight");
  check_argument(op, "grad_out", grad_out, x, x.scalar_type(), rows_of(x, weight.sym_size(0)));
  if (x.is_meta()) {
    return {at::empty_symint(x.sym_sizes(), x.options()), at::empty_symint(weight.sym_sizes(), weight.options()),
            at::empty_symint({weight.sym_size(0)}, weight.options())};
  }
  const at::Tensor dy = as_rows(grad_out).contiguous();  // our column-sum kernel reads it linearly
  // With no rows the two matmuls over rows give zeros, and column_sums launches nothing.
  return {in_rows_of(x, at::mm(dy, weight)), at::mm(dy.t(), as_rows(x)), column_sums(dtype, dy)};
}

// The backward of one linear call: x and the weight saved (the bias enters no gradient).
struct LinearBackward : OpNode<LinearBackward> {
  static constexpr const char* kName = "LinearBackward";

  torch::autograd::variable_list gradients(const at::Tensor& grad, const std::vector<at::Tensor>& saved) {
    auto [grad_x, grad_weight, grad_bias] =
        call_backward_op<&linear_backward>("cuda_kernels::linear_backward", grad, saved[0], saved[1]);
    // An absent bias has an edge too (an empty one), so there are always three.
    return {gradient_if_needed(0, grad_x), gradient_if_needed(1, grad_weight), gradient_if_needed(2, grad_bias)};
  }
};

at::Tensor linear_forward_autograd(const at::Tensor& x, const at::Tensor& weight, const std::optional<at::Tensor>& bias) {
  refuse_tangents("linear_forward", x, weight, bias);
  at::Tensor y = call_below_autograd<&linear_forward>("cuda_kernels::linear_forward", x, weight, bias);
  if (records_gradient(x, weight, bias)) {
    auto node = record_node<LinearBackward>(y, x, weight, bias);
    node->save(x);
    node->save(weight);
  }
  return y;
}

// --- the feed-forward block --------------------------------------------------------------------------------

// x (..., C), fc_weight (H, C), proj_weight (C, H): the hidden layer's H features come back to C. Either weight
// may be the transpose of a contiguous matrix (a Conv1D's): ATen's matmuls read it in place (weight_gradient).
void check_feed_forward(const char* op, const at::Tensor& x, const at::Tensor& fc_weight, const at::Tensor& proj_weight) {
  check_linear(op, x, fc_weight, "fc_weight");
  check_argument(op, "proj_weight", proj_weight, x, x.scalar_type(), {x.sym_size(-1), fc_weight.sym_size(0)});
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> feed_forward_forward(const at::Tensor& x, const at::Tensor& fc_weight,
                                                                    const std::optional<at::Tensor>& fc_bias,
                                                                    const at::Tensor& proj_weight,
                                                                    const std::optional<at::Tensor>& proj_bias) {
  const char* op = "feed_forward_forward";
  const DType dtype = kernel_dtype(op, x);
  check_feed_forward(op, x, fc_weight, proj_weight);
  // Both biases or neither, as GPT-2's `bias` flag sets them.
  TORCH_CHECK_VALUE(fc_bias.has_value() == proj_bias.has_value(), "cuda_kernels::", op,
                    ": give both biases or neither (fc_bias is ", fc_bias.has_value() ? "given" : "None",
                    ", proj_bias is ", proj_bias.has_value() ? "given" : "None", ")");
  check_bias(op, "fc_bias", fc_bias, x, fc_weight.sym_size(0));
  check_bias(op, "proj_bias", proj_bias, x, x.sym_size(-1));
  if (x.is_meta()) {
    at::Tensor pre_activation = at::empty_symint({row_count(x), fc_weight.sym_size(0)}, x.options());
    return {at::empty_symint(x.sym_sizes(), x.options()), pre_activation, at::empty_like(pre_activation)};
  }
  // h = x W_fc^T + b_fc, bias in the GEMM's epilogue: h is written once, by cuBLAS. (Adding b_fc in our
  // GELU kernel instead would cost one more write of h.)
  at::Tensor pre_activation = matmul_transposed(as_rows(x), fc_weight, fc_bias);
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
  return {in_rows_of(x, matmul_transposed(activation, proj_weight, proj_bias)), pre_activation, activation};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> feed_forward_backward(
    const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& fc_weight, const at::Tensor& proj_weight,
    const at::Tensor& pre_activation, const at::Tensor& activation) {
  const char* op = "feed_forward_backward";
  const DType dtype = kernel_dtype(op, x);
  check_feed_forward(op, x, fc_weight, proj_weight);
  const c10::SymInt rows = row_count(x), hidden = fc_weight.sym_size(0);
  check_argument(op, "grad_out", grad_out, x, x.scalar_type(), x.sym_sizes());
  check_argument(op, "pre_activation", pre_activation, x, x.scalar_type(), {rows, hidden});
  check_argument(op, "activation", activation, x, x.scalar_type(), {rows, hidden});
  if (x.is_meta()) {
    // The weights' gradients in the weights' layouts, as weight_gradient makes them.
    return {at::empty_symint(x.sym_sizes(), x.options()), at::empty_like(fc_weight),
            at::empty_symint({hidden}, x.options()), at::empty_like(proj_weight),
            at::empty_symint({x.sym_size(-1)}, x.options())};
  }
  const at::Tensor dy = as_rows(grad_out).contiguous(), h = pre_activation.contiguous(), x_rows = as_rows(x);
  // da = dy W_proj by cuBLAS (a fresh contiguous matrix); then our kernel turns it into dh = da * gelu'(h)
  // in place, summing dh's columns (b_fc's gradient) in the same pass.
  at::Tensor grad_hidden = at::mm(dy, proj_weight);
  at::Tensor grad_fc_bias = bias_gradient(
      dtype, grad_hidden,
      [&](void* sums, void* workspace, int64_t strips, void* stream) {
        launch_gelu_backward(dtype, grad_hidden.mutable_data_ptr(), h.const_data_ptr(), sums, workspace, strips,
                             grad_hidden.size(0), grad_hidden.size(1), stream);
      },
      [&](void* sums) {
        gelu_backward_cpu(dtype, grad_hidden.mutable_data_ptr(), h.const_data_ptr(), sums, grad_hidden.size(0),
                          grad_hidden.size(1));
      });
  return {in_rows_of(x, at::mm(grad_hidden, fc_weight)), weight_gradient(grad_hidden, x_rows, fc_weight), grad_fc_bias,
          weight_gradient(dy, activation, proj_weight), column_sums(dtype, dy)};
}

// The backward of one feed-forward call: x, both weights, and the forward's h (for GELU's derivative) and
// a (for the gradient of W_proj) saved, in that order; the biases enter no gradient.
struct FeedForwardBackward : OpNode<FeedForwardBackward> {
  static constexpr const char* kName = "FeedForwardBackward";

  torch::autograd::variable_list gradients(const at::Tensor& grad, const std::vector<at::Tensor>& saved) {
    auto [grad_x, grad_fc_weight, grad_fc_bias, grad_proj_weight, grad_proj_bias] = call_backward_op<&feed_forward_backward>(
        "cuda_kernels::feed_forward_backward", grad, saved[0], saved[1], saved[2], saved[3], saved[4]);
    // Edges in the inputs' order: x, fc_weight, fc_bias, proj_weight, proj_bias (an absent bias: an empty one).
    return {gradient_if_needed(0, grad_x), gradient_if_needed(1, grad_fc_weight), gradient_if_needed(2, grad_fc_bias),
            gradient_if_needed(3, grad_proj_weight), gradient_if_needed(4, grad_proj_bias)};
  }
};

std::tuple<at::Tensor, at::Tensor, at::Tensor> feed_forward_forward_autograd(const at::Tensor& x, const at::Tensor& fc_weight,
                                                                             const std::optional<at::Tensor>& fc_bias,
                                                                             const at::Tensor& proj_weight,
                                                                             const std::optional<at::Tensor>& proj_bias) {
  refuse_tangents("feed_forward_forward", x, fc_weight, fc_bias, proj_weight, proj_bias);
  auto [y, pre_activation, activation] = call_below_autograd<&feed_forward_forward>(
      "cuda_kernels::feed_forward_forward", x, fc_weight, fc_bias, proj_weight, proj_bias);
  if (records_gradient(x, fc_weight, fc_bias, proj_weight, proj_bias)) {
    // h and a: constants to autograd
    auto node = record_node<FeedForwardBackward>(y, x, fc_weight, fc_bias, proj_weight, proj_bias);
    for (const at::Tensor& tensor : {x, fc_weight, proj_weight, pre_activation, activation}) node->save(tensor);
  }
  return {y, pre_activation, activation};
}

}  // namespace
}  // namespace kernel_ladder

TORCH_LIBRARY_FRAGMENT(cuda_kernels, m) {
  m.def("linear_forward(Tensor x, Tensor weight, Tensor? bias) -> Tensor");
  m.def("linear_backward(Tensor grad_out, Tensor x, Tensor weight) -> (Tensor, Tensor, Tensor)");
  m.def("feed_forward_forward(Tensor x, Tensor fc_weight, Tensor? fc_bias, Tensor proj_weight, Tensor? proj_bias) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("feed_forward_backward(Tensor grad_out, Tensor x, Tensor fc_weight, Tensor proj_weight, Tensor pre_activation, "
        "Tensor activation) -> (Tensor, Tensor, Tensor, Tensor, Tensor)");
  kernel_ladder::impl_differentiable<&kernel_ladder::linear_forward, &kernel_ladder::linear_backward,
                                     &kernel_ladder::linear_forward_autograd>(m, "linear_forward", "linear_backward");
  kernel_ladder::impl_differentiable<&kernel_ladder::feed_forward_forward, &kernel_ladder::feed_forward_backward,
                                     &kernel_ladder::feed_forward_forward_autograd>(m, "feed_forward_forward",
                                                                                    "feed_forward_backward");
}
