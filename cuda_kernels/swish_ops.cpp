// Swish as a PyTorch op: the worked example of how every level-5 component meets PyTorch. Read this
// file first; the other *_ops.cpp files do the same with the two helpers of binding.h.
//
// Three pieces make `torch.ops.cuda_kernels.swish_forward` a first-class op, all in C++:
//   1. The host wrappers swish_forward / swish_backward: check the arguments, allocate the output, make
//      the input contiguous, and hand raw pointers to the CUDA launcher (swish.cu) or to the C++ CPU
//      twin (swish_cpu.cpp). The kernels never see a tensor.
//   2. SwishFunction, a torch::autograd::Function: its forward calls the forward op below autograd and
//      saves x; its backward calls the backward op. Registered for the Autograd key, so a forward and
//      backward never enter Python (a crossing into Python costs ~25 us, more than the kernels at
//      decode sizes).
//   3. The registration at the end: the schemas (TORCH_LIBRARY_FRAGMENT: each component adds its own
//      ops to the one `cuda_kernels` namespace) and one kernel per dispatch key: CPU, CUDA, Meta
//      (shapes only, for torch.compile and opcheck) and Autograd.
//
// Check
//   python -m pytest tests -k "swish and cuda"
//   python -m pytest tests/test_kernel_ops.py -k cuda        (opcheck: schema, Meta, autograd, compile)
#include "binding.h"

namespace kernel_ladder {
namespace {

// --- 1. host wrappers --------------------------------------------------------------------------------

at::Tensor swish_forward(const at::Tensor& x, double beta) {
  const char* op = "swish_forward";
  const DType dtype = kernel_dtype(op, x);
  at::Tensor y = at::empty_symint(x.sym_sizes(), x.options());
  // The Meta kernel stops here: torch.compile only needs y's shape, dtype and device.
  if (x.is_meta() || x.numel() == 0) return y;  // (and no 0-block launch)
  // Our kernels index memory linearly: a contiguous x is used as it is, any other copied once, here.
  const at::Tensor input = x.contiguous();
  run_on_device_of(
      input,
      [&](void* stream) {
        launch_swish_forward(dtype, input.const_data_ptr(), y.mutable_data_ptr(), input.numel(), beta, stream);
      },
      [&] { swish_forward_cpu(dtype, input.const_data_ptr(), y.mutable_data_ptr(), input.numel(), beta); });
  return y;
}

at::Tensor swish_backward(const at::Tensor& grad_out, const at::Tensor& x, double beta) {
  const char* op = "swish_backward";
  const DType dtype = kernel_dtype(op, x);
  check_argument(op, "grad_out", grad_out, x, x.scalar_type(), x.sym_sizes());
  at::Tensor grad_x = at::empty_symint(x.sym_sizes(), x.options());
  if (x.is_meta() || x.numel() == 0) return grad_x;
  const at::Tensor dy = grad_out.contiguous(), input = x.contiguous();
  run_on_device_of(
      input,
      [&](void* stream) {
        launch_swish_backward(dtype, dy.const_data_ptr(), input.const_data_ptr(), grad_x.mutable_data_ptr(),
                              input.numel(), beta, stream);
      },
      [&] {
        swish_backward_cpu(dtype, dy.const_data_ptr(), input.const_data_ptr(), grad_x.mutable_data_ptr(), input.numel(), beta);
      });
  return grad_x;
}

// The climb to swish_forward's kernel (swish.cu lists the versions), forward only, for the lesson's
// timings: CUDA kernels, with no CPU twin.
at::Tensor swish_forward_version(const at::Tensor& x, double beta, int64_t version) {
  const char* op = "swish_forward_version";
  const DType dtype = kernel_dtype(op, x);
  TORCH_CHECK_VALUE(version >= 1 && version <= 3, op, ": version ", version, " does not exist (versions: 1, 2, 3)");
  at::Tensor y = at::empty_symint(x.sym_sizes(), x.options());
  if (x.is_meta() || x.numel() == 0) return y;
  const at::Tensor input = x.contiguous();
  run_on_device_of(
      input,
      [&](void* stream) {
        launch_swish_forward_version(dtype, input.const_data_ptr(), y.mutable_data_ptr(), input.numel(), beta,
                                     static_cast<int>(version), stream);
      },
      [&] {
        TORCH_CHECK_NOT_IMPLEMENTED(false, op, ": the versions are CUDA kernels (the CPU has swish_forward's twin "
                                    "only); got a tensor on ", x.device());
      });
  return y;
}

// --- 2. autograd ---------------------------------------------------------------------------------------

struct SwishFunction : public torch::autograd::Function<SwishFunction> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& x, double beta) {
    // Below autograd: the call goes on to the CPU/CUDA (or Meta) kernel instead of back to us.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static const auto swish_forward_op = find_op<decltype(swish_forward)>("cuda_kernels::swish_forward");
    // x only: the backward recomputes sigmoid(beta * x). Saved contiguous, so the backward's wrapper
    // does not copy a strided x a second time.
    const at::Tensor input = x.contiguous();
    ctx->save_for_backward({input});
    ctx->saved_data["beta"] = beta;
    return swish_forward_op.call(input, beta);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    static const auto swish_backward_op = find_op<decltype(swish_backward)>("cuda_kernels::swish_backward");
    const at::Tensor x = ctx->get_saved_variables()[0];
    // A plain .backward() runs this with grad mode off: nothing will be recorded, so straight below
    // autograd, past swish_backward's Autograd kernel (a boxed not-implemented node that would only pass
    // the call on). Under create_graph=True that kernel runs and makes a second derivative raise.
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    // Autograd may hand us a broadcast (stride-0) gradient, e.g. from y.sum().backward(); the wrapper
    // makes it contiguous, copying only then.
    const at::Tensor grad_x = swish_backward_op.call(grad_outputs[0], x, ctx->saved_data["beta"].toDouble());
    return {grad_x, at::Tensor()};  // beta is a number: no gradient
  }
};

at::Tensor swish_forward_autograd(const at::Tensor& x, double beta) {
  // Nothing to record (torch.no_grad, or an x that needs no gradient): straight to the kernel below
  // autograd. SwishFunction::apply would build a graph node first and only then find it unneeded.
  if (!at::GradMode::is_enabled() || !x.requires_grad()) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    static const auto swish_forward_op = find_op<decltype(swish_forward)>("cuda_kernels::swish_forward");
    return swish_forward_op.call(x, beta);
  }
  return SwishFunction::apply(x, beta);
}

}  // namespace
}  // namespace kernel_ladder

// --- 3. registration -----------------------------------------------------------------------------------

// The contract shared with level 4 (namespace triton_kernels has the same schemas).
TORCH_LIBRARY_FRAGMENT(cuda_kernels, m) {
  m.def("swish_forward(Tensor x, float beta) -> Tensor");
  m.def("swish_backward(Tensor grad_out, Tensor x, float beta) -> Tensor");
  m.def("swish_forward_version(Tensor x, float beta, int version) -> Tensor");
}

// One host wrapper serves CPU tensors and (below) CUDA tensors: it branches on the device itself.
TORCH_LIBRARY_IMPL(cuda_kernels, CPU, m) {
  m.impl("swish_forward", TORCH_FN(kernel_ladder::swish_forward));
  m.impl("swish_backward", TORCH_FN(kernel_ladder::swish_backward));
  m.impl("swish_forward_version", TORCH_FN(kernel_ladder::swish_forward_version));
}

#ifdef KERNEL_LADDER_WITH_CUDA
TORCH_LIBRARY_IMPL(cuda_kernels, CUDA, m) {
  m.impl("swish_forward", TORCH_FN(kernel_ladder::swish_forward));
  m.impl("swish_backward", TORCH_FN(kernel_ladder::swish_backward));
  m.impl("swish_forward_version", TORCH_FN(kernel_ladder::swish_forward_version));
}
#endif

// Meta tensors carry only shapes: the wrappers allocate their outputs and return before any launch.
TORCH_LIBRARY_IMPL(cuda_kernels, Meta, m) {
  m.impl("swish_forward", TORCH_FN(kernel_ladder::swish_forward));
  m.impl("swish_backward", TORCH_FN(kernel_ladder::swish_backward));
  m.impl("swish_forward_version", TORCH_FN(kernel_ladder::swish_forward_version));
}

// The Autograd key (every backend's) comes first for tensors that require grad. The backward op's own
// derivative (a second derivative of swish) and the earlier versions' (forward only, for timing) are not
// implemented, and say so: PyTorch's not-implemented node raises when a gradient reaches it. With no
// Autograd kernel at all, PyTorch would warn and leave those gradients silently at zero.
TORCH_LIBRARY_IMPL(cuda_kernels, Autograd, m) {
  m.impl("swish_forward", TORCH_FN(kernel_ladder::swish_forward_autograd));
  m.impl("swish_backward", torch::autograd::autogradNotImplementedFallback());
  m.impl("swish_forward_version", torch::autograd::autogradNotImplementedFallback());
}
