// Swish as a PyTorch op: the worked example of how every level-5 component meets PyTorch. Read this
// file first; the other *_ops.cpp files do the same with the two helpers of binding.h.
//
// Three pieces make `torch.ops.cuda_kernels.swish_forward` a first-class op, all in C++:
//   1. The host wrappers swish_forward / swish_backward: check the arguments, allocate the output, make
//      the input contiguous, and hand raw pointers to the CUDA launcher (swish.cu) or to the C++ CPU
//      twin (swish_cpu.cpp). The kernels never see a tensor.
//   2. The autograd kernel swish_forward_autograd, registered for the Autograd key: it calls the forward
//      op below autograd and, when autograd records the call, hangs a SwishBackward node on y that saves x;
//      the node's backward calls the backward op. So a forward and backward never enter Python (a
//      crossing into Python costs ~25 us, more than the kernels at decode sizes). The node is an OpNode
//      (binding.h): the recipe PyTorch's generated code uses for its own ops, leaner per call than a
//      torch::autograd::Function.
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

// The node autograd keeps for one swish call, and runs in the backward.
struct SwishBackward : OpNode<SwishBackward> {
  static constexpr const char* kName = "SwishBackward";  // what y.grad_fn.name() shows
  double beta = 1.0;                                      // a number the backward needs: a plain member

  // grad: dL/dy (autograd has matched its sizes to y's); saved: what the forward saved, in order (x).
  // Returns one gradient per tensor input of the forward (x only: beta is a number, with no edge).
  torch::autograd::variable_list gradients(const at::Tensor& grad, const std::vector<at::Tensor>& saved) {
    static const auto swish_backward_op = find_op<decltype(swish_backward)>("cuda_kernels::swish_backward");
    // A plain .backward() runs this with grad mode off: nothing will be recorded, so straight below
    // autograd, past swish_backward's Autograd kernel (a boxed not-implemented node that would only pass
    // the call on). Under create_graph=True that kernel runs and makes a second derivative raise.
    std::optional<at::AutoDispatchBelowADInplaceOrView> below_autograd;
    if (!at::GradMode::is_enabled()) below_autograd.emplace();
    // Autograd may hand us a broadcast (stride-0) gradient, e.g. from y.sum().backward(); the wrapper
    // makes it contiguous, copying only then.
    return {swish_backward_op.call(grad, saved[0], beta)};
  }
};

at::Tensor swish_forward_autograd(const at::Tensor& x, double beta) {
  // A dual tensor of forward-mode AD would lose its tangent here: refused, with a clear error.
  refuse_tangents("swish_forward", x);
  static const auto swish_forward_op = find_op<decltype(swish_forward)>("cuda_kernels::swish_forward");
  // Nothing to record (torch.no_grad, or an x that needs no gradient): straight to the kernel below
  // autograd, with no node built.
  if (!at::GradMode::is_enabled() || !x.requires_grad()) {
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    return swish_forward_op.call(x, beta);
  }
  // x only: the backward recomputes sigmoid(beta * x). Made contiguous here (below autograd, so the copy,
  // if any, records no node of its own), so the backward's wrapper does not copy a strided x a second time.
  const at::Tensor input = contiguous_for_saving(x);
  at::Tensor y;
  {
    // Below autograd: the call goes on to the CPU/CUDA (or Meta) kernel instead of back to us.
    at::AutoDispatchBelowADInplaceOrView below_autograd;
    y = swish_forward_op.call(input, beta);
  }
  // The node: an edge to x's own gradient (its grad_fn, or its accumulator if x is a leaf), then made y's
  // grad_fn (set_history); then what the backward needs.
  auto node = new_node<SwishBackward>();
  node->set_next_edges(torch::autograd::collect_next_edges(x));
  torch::autograd::set_history(y, node);
  node->save(input);
  node->beta = beta;
  return y;
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
