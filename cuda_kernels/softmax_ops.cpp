// Softmax as a PyTorch op: the host wrappers around softmax.cu and softmax_cpu.cpp, the autograd
// formula, and the registration (laid out as swish_ops.cpp explains, with binding.h's helpers).
//
//   softmax_forward(x)            -> y        over the last dim of x (..., n): each row of n
//   softmax_backward(grad_out, y) -> grad_x   = y * (grad_out - sum(grad_out * y)) row by row
//
// The backward needs y, not x: autograd saves the output. Rows of 0 elements give empty outputs.
//
// Check
//   python -m pytest tests -k "softmax and cuda"
#include "binding.h"

namespace kernel_ladder {
namespace {

at::Tensor softmax_forward(const at::Tensor& x) {
  const char* op = "softmax_forward";
  const c10::SymInt rows = leading_rows(op, x);
  const DType dtype = kernel_dtype(op, x);
  at::Tensor y = at::empty_symint(x.sym_sizes(), x.options());
  if (x.is_meta() || x.numel() == 0) return y;
  const at::Tensor input = x.contiguous();
  const int64_t row_count = rows.expect_int(), n = x.size(-1);
  run_on_device_of(
      input,
      [&](void* stream) {
        // Rows split over several blocks meet through a small buffer of per-slice (max, sum) pairs.
        const int64_t splits = softmax_forward_splits(dtype, row_count, n);
        at::Tensor partials;
        if (splits > 1) {
          // A (max, sum) pair per slice, and a pair more per row whose first word counts the row's arrived
          // blocks in the cooperative kernel.
          partials = at::empty({row_count * (splits + 1), 2},
                               input.options().dtype(dtype == DType::Float64 ? at::kDouble : at::kFloat));
        }
        launch_softmax_forward(dtype, input.const_data_ptr(), y.mutable_data_ptr(), row_count, n, splits,
                               splits > 1 ? partials.mutable_data_ptr() : nullptr, stream);
      },
      [&] { softmax_forward_cpu(dtype, input.const_data_ptr(), y.mutable_data_ptr(), row_count, n); });
  return y;
}

at::Tensor softmax_backward(const at::Tensor& grad_out, const at::Tensor& y) {
  const char* op = "softmax_backward";
  const c10::SymInt rows = leading_rows(op, y);
  const DType dtype = kernel_dtype(op, y);
  check_argument(op, "grad_out", grad_out, y, y.scalar_type(), y.sym_sizes());
  at::Tensor grad_x = at::empty_symint(y.sym_sizes(), y.options());
  if (y.is_meta() || y.numel() == 0) return grad_x;
  const at::Tensor dy = grad_out.contiguous(), probabilities = y.contiguous();
  const int64_t row_count = rows.expect_int(), n = y.size(-1);
  run_on_device_of(
      probabilities,
      [&](void* stream) {
        launch_softmax_backward(dtype, dy.const_data_ptr(), probabilities.const_data_ptr(), grad_x.mutable_data_ptr(), row_count,
                                n, stream);
      },
      [&] {
        softmax_backward_cpu(dtype, dy.const_data_ptr(), probabilities.const_data_ptr(), grad_x.mutable_data_ptr(), row_count, n);
      });
  return grad_x;
}

// The backward of one softmax call: y saved, not x (dx = y * (dy - sum(dy * y)) needs nothing else).
struct SoftmaxBackward : OpNode<SoftmaxBackward> {
  static constexpr const char* kName = "SoftmaxBackward";

  torch::autograd::variable_list gradients(const at::Tensor& grad, const std::vector<at::Tensor>& saved) {
    return {call_backward_op<&softmax_backward>("cuda_kernels::softmax_backward", grad, saved[0])};
  }
};

at::Tensor softmax_forward_autograd(const at::Tensor& x) {
  refuse_tangents("softmax_forward", x);
  at::Tensor y = call_below_autograd<&softmax_forward>("cuda_kernels::softmax_forward", x);
  if (records_gradient(x)) record_node<SoftmaxBackward>(y, x)->save(y, /*is_output=*/true);
  return y;
}

}  // namespace
}  // namespace kernel_ladder

TORCH_LIBRARY_FRAGMENT(cuda_kernels, m) {
  m.def("softmax_forward(Tensor x) -> Tensor");
  m.def("softmax_backward(Tensor grad_out, Tensor y) -> Tensor");
  kernel_ladder::impl_differentiable<&kernel_ladder::softmax_forward, &kernel_ladder::softmax_backward,
                                     &kernel_ladder::softmax_forward_autograd>(m, "softmax_forward", "softmax_backward");
}
