// LayerNorm and RMSNorm as PyTorch ops: the host wrappers around layer_norm.cu and layer_norm_cpu.cpp
// (whose kernels serve both), the autograd formulas, and the registration (laid out as swish_ops.cpp
// explains, with binding.h's helpers).
//
//   layer_norm_forward(x, weight, bias, eps)              -> (y, mean, rstd)
//   layer_norm_backward(grad_out, x, weight, mean, rstd)  -> (grad_x, grad_weight, grad_bias)
//   rms_norm_forward(x, weight, eps)                      -> (y, rstd)
//   rms_norm_backward(grad_out, x, weight, rstd)          -> (grad_x, grad_weight)
//
// x is any contiguous tensor (..., n), normalised over its last dim: its leading dims are the rows, so a
// caller with a (batch, tokens, n) activation passes it as it is, with no view in between (each view is
// a tensor object and an autograd node, microseconds a call at decode sizes). weight and bias are
// n-vectors. mean and rstd (reciprocal standard deviation, one per row, in the accumulator type) are
// outputs so that the backward can reuse them instead of reducing each row again; autograd marks them
// non-differentiable and the Python function returns y. RMSNorm is the same without the mean and the
// bias: its rstd is the reciprocal root mean square.
//
// Check
//   python -m pytest tests -k "(layer_norm or rms_norm) and cuda"
#include "binding.h"

namespace kernel_ladder {
namespace {

// x of LayerNorm and RMSNorm: (..., n) with n >= 1 (a row of no elements has no mean); returns (rows, n).
std::pair<c10::SymInt, c10::SymInt> check_rows(const char* op, const at::Tensor& x) {
  const c10::SymInt rows = leading_rows(op, x);
  TORCH_CHECK_VALUE(x.sym_size(-1) >= 1, "cuda_kernels::", op, ": rows of 0 elements have no mean (x has shape ",
                    x.sym_sizes(), ")");
  return {rows, x.sym_size(-1)};
}

// Scratch for rows the forward splits over several blocks (splits > 1, layer_norm_forward_splits): one
// (count, mean, M2) triple per slice, and one more per row whose first word counts the row's arrived
// blocks in the cooperative kernel, with the options of `statistics` (dtype, device), from PyTorch's
// caching allocator and held in `buffer` until the launch is queued. Null when rows are not split.
void* forward_partials(at::Tensor& buffer, int64_t splits, int64_t rows, const at::Tensor& statistics) {
  if (splits == 1) return nullptr;
  buffer = at::empty({rows * (splits + 1), 3}, statistics.options());
  return buffer.mutable_data_ptr();
}

TensorTriple layer_norm_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  const char* op = "layer_norm_forward";
  const auto shape = check_rows(op, x);
  const c10::SymInt rows = shape.first, n = shape.second;
  const DType dtype = kernel_dtype(op, x);
  check_argument(op, "weight", weight, x, x.scalar_type(), {n});
  check_argument(op, "bias", bias, x, x.scalar_type(), {n});
  at::Tensor y = at::empty_symint(x.sym_sizes(), x.options());
  at::Tensor mean = at::empty_symint({rows}, x.options().dtype(statistics_dtype(x)));
  at::Tensor rstd = at::empty_symint({rows}, mean.options());
  if (x.is_meta() || x.numel() == 0) return {y, mean, rstd};
  const at::Tensor input = x.contiguous(), w = weight.contiguous(), b = bias.contiguous();
  run_on_device_of(
      input,
      [&](void* stream) {
        const int64_t splits = layer_norm_forward_splits(dtype, rows.expect_int(), n.expect_int());
        at::Tensor partials;
        launch_layer_norm_forward(dtype, input.const_data_ptr(), w.const_data_ptr(), b.const_data_ptr(),
                                  y.mutable_data_ptr(), mean.mutable_data_ptr(), rstd.mutable_data_ptr(),
                                  rows.expect_int(), n.expect_int(), eps, splits,
                                  forward_partials(partials, splits, rows.expect_int(), rstd), stream);
      },
      [&] {
        layer_norm_forward_cpu(dtype, input.const_data_ptr(), w.const_data_ptr(), b.const_data_ptr(), y.mutable_data_ptr(),
                               mean.mutable_data_ptr(), rstd.mutable_data_ptr(), rows.expect_int(), n.expect_int(), eps);
      });
  return {y, mean, rstd};
}

TensorTriple layer_norm_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                                 const at::Tensor& mean, const at::Tensor& rstd) {
  const char* op = "layer_norm_backward";
  const auto shape = check_rows(op, x);
  const c10::SymInt rows = shape.first, n = shape.second;
  const DType dtype = kernel_dtype(op, x);
  check_argument(op, "grad_out", grad_out, x, x.scalar_type(), x.sym_sizes());
  check_argument(op, "weight", weight, x, x.scalar_type(), {n});
  check_argument(op, "mean", mean, x, statistics_dtype(x), {rows});
  check_argument(op, "rstd", rstd, x, statistics_dtype(x), {rows});
  at::Tensor grad_x = at::empty_symint(x.sym_sizes(), x.options());
  at::Tensor grad_weight = at::empty_symint({n}, weight.options());
  at::Tensor grad_bias = at::empty_symint({n}, weight.options());
  if (x.is_meta()) return {grad_x, grad_weight, grad_bias};
  if (x.numel() == 0) return {grad_x, grad_weight.zero_(), grad_bias.zero_()};  // no rows: nothing to sum
  const at::Tensor dy = grad_out.contiguous(), input = x.contiguous(), w = weight.contiguous();
  const at::Tensor mu = mean.contiguous(), r = rstd.contiguous();
  run_on_device_of(
      input,
      [&](void* stream) {
        // Scratch for the per-block partial dw and db rows (or per-slice row sums), from PyTorch's caching
        // allocator: freed when this returns, and reused only by work queued after ours on the same stream.
        const int64_t values = layer_norm_backward_workspace(dtype, rows.expect_int(), n.expect_int());
        at::Tensor workspace = at::empty({values}, x.options().dtype(statistics_dtype(x)));
        launch_layer_norm_backward(dtype, dy.const_data_ptr(), input.const_data_ptr(), w.const_data_ptr(),
                                   mu.const_data_ptr(), r.const_data_ptr(), grad_x.mutable_data_ptr(),
                                   grad_weight.mutable_data_ptr(), grad_bias.mutable_data_ptr(),
                                   workspace.mutable_data_ptr(), rows.expect_int(), n.expect_int(), stream);
      },
      [&] {
        layer_norm_backward_cpu(dtype, dy.const_data_ptr(), input.const_data_ptr(), w.const_data_ptr(), mu.const_data_ptr(),
                                r.const_data_ptr(), grad_x.mutable_data_ptr(), grad_weight.mutable_data_ptr(),
                                grad_bias.mutable_data_ptr(), rows.expect_int(), n.expect_int());
      });
  return {grad_x, grad_weight, grad_bias};
}

// The backward of one LayerNorm call: x (contiguous), the weight, and the forward's mean and rstd saved,
// in that order; the bias enters no gradient.
struct LayerNormBackward : OpNode<LayerNormBackward> {
  static constexpr const char* kName = "LayerNormBackward";

  torch::autograd::variable_list gradients(const at::Tensor& grad, const std::vector<at::Tensor>& saved) {
    auto [grad_x, grad_weight, grad_bias] = call_backward_op<&layer_norm_backward>(
        "cuda_kernels::layer_norm_backward", grad, saved[0], saved[1], saved[2], saved[3]);
    return {gradient_if_needed(0, grad_x), gradient_if_needed(1, grad_weight), gradient_if_needed(2, grad_bias)};
  }
};

TensorTriple layer_norm_forward_autograd(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  refuse_tangents("layer_norm_forward", x, weight, bias);
  if (!records_gradient(x, weight, bias)) {
    return call_below_autograd<&layer_norm_forward>("cuda_kernels::layer_norm_forward", x, weight, bias, eps);
  }
  const at::Tensor input = contiguous_for_saving(x);
  auto [y, mean, rstd] = call_below_autograd<&layer_norm_forward>("cuda_kernels::layer_norm_forward", input, weight,
                                                                  bias, eps);
  auto node = record_node<LayerNormBackward>(y, x, weight, bias);  // mean and rstd: constants to autograd
  node->save(input);
  node->save(weight);
  node->save(mean);
  node->save(rstd);
  return {y, mean, rstd};
}

// --- RMSNorm: LayerNorm's wrappers without mean and bias --------------------------------------------

TensorPair rms_norm_forward(const at::Tensor& x, const at::Tensor& weight, double eps) {
  const char* op = "rms_norm_forward";
  const auto shape = check_rows(op, x);
  const c10::SymInt rows = shape.first, n = shape.second;
  const DType dtype = kernel_dtype(op, x);
  check_argument(op, "weight", weight, x, x.scalar_type(), {n});
  at::Tensor y = at::empty_symint(x.sym_sizes(), x.options());
  at::Tensor rstd = at::empty_symint({rows}, x.options().dtype(statistics_dtype(x)));
  if (x.is_meta() || x.numel() == 0) return {y, rstd};
  const at::Tensor input = x.contiguous(), w = weight.contiguous();
  run_on_device_of(
      input,
      [&](void* stream) {
        const int64_t splits = layer_norm_forward_splits(dtype, rows.expect_int(), n.expect_int());
        at::Tensor partials;
        launch_rms_norm_forward(dtype, input.const_data_ptr(), w.const_data_ptr(), y.mutable_data_ptr(),
                                rstd.mutable_data_ptr(), rows.expect_int(), n.expect_int(), eps, splits,
                                forward_partials(partials, splits, rows.expect_int(), rstd), stream);
      },
      [&] {
        rms_norm_forward_cpu(dtype, input.const_data_ptr(), w.const_data_ptr(), y.mutable_data_ptr(),
                             rstd.mutable_data_ptr(), rows.expect_int(), n.expect_int(), eps);
      });
  return {y, rstd};
}

TensorPair rms_norm_backward(const at::Tensor& grad_out, const at::Tensor& x, const at::Tensor& weight,
                             const at::Tensor& rstd) {
  const char* op = "rms_norm_backward";
  const auto shape = check_rows(op, x);
  const c10::SymInt rows = shape.first, n = shape.second;
  const DType dtype = kernel_dtype(op, x);
  check_argument(op, "grad_out", grad_out, x, x.scalar_type(), x.sym_sizes());
  check_argument(op, "weight", weight, x, x.scalar_type(), {n});
  check_argument(op, "rstd", rstd, x, statistics_dtype(x), {rows});
  at::Tensor grad_x = at::empty_symint(x.sym_sizes(), x.options());
  at::Tensor grad_weight = at::empty_symint({n}, weight.options());
  if (x.is_meta()) return {grad_x, grad_weight};
  if (x.numel() == 0) return {grad_x, grad_weight.zero_()};  // no rows: nothing to sum
  const at::Tensor dy = grad_out.contiguous(), input = x.contiguous(), w = weight.contiguous(), r = rstd.contiguous();
  run_on_device_of(
      input,
      [&](void* stream) {
        // Scratch for the per-block partial dw rows (or per-slice row sums), as in layer_norm_backward.
        const int64_t values = rms_norm_backward_workspace(dtype, rows.expect_int(), n.expect_int());
        at::Tensor workspace = at::empty({values}, x.options().dtype(statistics_dtype(x)));
        launch_rms_norm_backward(dtype, dy.const_data_ptr(), input.const_data_ptr(), w.const_data_ptr(),
                                 r.const_data_ptr(), grad_x.mutable_data_ptr(), grad_weight.mutable_data_ptr(),
                                 workspace.mutable_data_ptr(), rows.expect_int(), n.expect_int(), stream);
      },
      [&] {
        rms_norm_backward_cpu(dtype, dy.const_data_ptr(), input.const_data_ptr(), w.const_data_ptr(), r.const_data_ptr(),
                              grad_x.mutable_data_ptr(), grad_weight.mutable_data_ptr(), rows.expect_int(),
                              n.expect_int());
      });
  return {grad_x, grad_weight};
}

// RMSNorm's: x (contiguous), the weight and the forward's rstd saved.
struct RMSNormBackward : OpNode<RMSNormBackward> {
  static constexpr const char* kName = "RMSNormBackward";

  torch::autograd::variable_list gradients(const at::Tensor& grad, const std::vector<at::Tensor>& saved) {
    auto [grad_x, grad_weight] =
        call_backward_op<&rms_norm_backward>("cuda_kernels::rms_norm_backward", grad, saved[0], saved[1], saved[2]);
    return {gradient_if_needed(0, grad_x), gradient_if_needed(1, grad_weight)};
  }
};

TensorPair rms_norm_forward_autograd(const at::Tensor& x, const at::Tensor& weight, double eps) {
  refuse_tangents("rms_norm_forward", x, weight);
  if (!records_gradient(x, weight)) {
    return call_below_autograd<&rms_norm_forward>("cuda_kernels::rms_norm_forward", x, weight, eps);
  }
  const at::Tensor input = contiguous_for_saving(x);
  auto [y, rstd] = call_below_autograd<&rms_norm_forward>("cuda_kernels::rms_norm_forward", input, weight, eps);
  auto node = record_node<RMSNormBackward>(y, x, weight);
  node->save(input);
  node->save(weight);
  node->save(rstd);
  return {y, rstd};
}

}  // namespace
}  // namespace kernel_ladder

TORCH_LIBRARY_FRAGMENT(cuda_kernels, m) {
  m.def("layer_norm_forward(Tensor x, Tensor weight, Tensor bias, float eps) -> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor mean, Tensor rstd) -> (Tensor, Tensor, Tensor)");
  kernel_ladder::impl_differentiable<&kernel_ladder::layer_norm_forward, &kernel_ladder::layer_norm_backward,
                                     &kernel_ladder::layer_norm_forward_autograd>(m, "layer_norm_forward",
                                                                                  "layer_norm_backward");
  m.def("rms_norm_forward(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)");
  m.def("rms_norm_backward(Tensor grad_out, Tensor x, Tensor weight, Tensor rstd) -> (Tensor, Tensor)");
  kernel_ladder::impl_differentiable<&kernel_ladder::rms_norm_forward, &kernel_ladder::rms_norm_backward,
                                     &kernel_ladder::rms_norm_forward_autograd>(m, "rms_norm_forward",
                                                                                "rms_norm_backward");
}
