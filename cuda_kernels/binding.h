// What every level-5 host wrapper (the *_ops.cpp files) shares: the dtype switch, the argument checks,
// the CPU/CUDA branch, and the registration of one op for every dispatch key. swish_ops.cpp spells all
// of it out once, as the worked example; read it first.
//
// How a call travels, e.g. `y = layer_norm(x, weight, bias, eps)` with x requiring grad:
//   Autograd key  -> the op's autograd kernel: runs the op below autograd and hangs an OpNode (below) on
//                    its output, all in C++ (no Python on the way, forward or backward); when autograd
//                    will record nothing (torch.no_grad), straight on to the key below
//   CPU/CUDA key  -> the host wrapper: check, allocate, make contiguous, launch the kernel
//   Meta key      -> the same host wrapper, which returns after allocating: torch.compile and
//                    torch.library.opcheck trace shapes with it (SymInt sizes, so symbolic shapes work)
//
// Checks raise the Python exception a user expects: TORCH_CHECK_VALUE a ValueError (a shape, a size, a
// device), TORCH_CHECK_TYPE a TypeError (a dtype). All of them run before anything is allocated or
// launched, and none inside an OpenMP region: an exception must never cross a parallel region or leave
// work queued on a stream behind it.
//
// KERNEL_LADDER_WITH_CUDA is defined by the loader only when it compiles the .cu files too; without it
// these files need no CUDA header and link against PyTorch's CPU-only build.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/csrc/autograd/autograd_not_implemented_fallback.h>
#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>
#include <torch/library.h>

#ifdef KERNEL_LADDER_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "kernels.h"

namespace kernel_ladder {

using TensorPair = std::tuple<at::Tensor, at::Tensor>;
using TensorTriple = std::tuple<at::Tensor, at::Tensor, at::Tensor>;

// The kernels' DType for x's dtype, if our kernels compute it on x's device. Half precision runs
// everywhere but on the CPU: on CUDA, and on the Meta device, where torch.compile traces CUDA tensors.
inline DType kernel_dtype(const char* op, const at::Tensor& x) {
  const at::ScalarType type = x.scalar_type();
  const bool ieee = type == at::kFloat || type == at::kDouble;
  const bool half = type == at::kHalf || type == at::kBFloat16;
  TORCH_CHECK_TYPE(ieee || (half && !x.is_cpu()), "cuda_kernels::", op, " got dtype ", type, " on ", x.device(),
                   "; supported: ", x.is_cpu() ? "Float, Double (Half and BFloat16 on CUDA only)" : "Float, Double, Half, BFloat16");
  switch (type) {
    case at::kDouble: return DType::Float64;
    case at::kHalf: return DType::Float16;
    case at::kBFloat16: return DType::BFloat16;
    default: return DType::Float32;
  }
}

// LayerNorm's mean and rstd, attention's log-sum-exp and the backward's partial sums are kept in the
// kernels' accumulator type.
inline at::ScalarType statistics_dtype(const at::Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// Every tensor argument: on the device of x (the input the others are checked against), of the expected
// dtype and shape. Sizes are SymInts, so that the Meta kernel checks symbolic shapes too (on a real
// tensor a SymInt is a plain integer).
inline void check_argument(const char* op, const char* name, const at::Tensor& t, const at::Tensor& x, at::ScalarType dtype,
                           c10::SymIntArrayRef shape) {
  TORCH_CHECK_VALUE(t.device() == x.device(), "cuda_kernels::", op, ": ", name, " is on ", t.device(),
                    " while its other inputs are on ", x.device());
  TORCH_CHECK_TYPE(t.scalar_type() == dtype, "cuda_kernels::", op, ": ", name, " has dtype ", t.scalar_type(), ", expected ", dtype);
  TORCH_CHECK_VALUE(t.sym_sizes() == shape, "cuda_kernels::", op, ": ", name, " has shape ", t.sym_sizes(), ", expected ", shape);
}

// The number of rows of x (..., n): the product of its leading dims (a SymInt, so that the Meta kernels
// handle symbolic shapes).
inline c10::SymInt row_count(const at::Tensor& x) {
  c10::SymInt rows = 1;
  for (int64_t d = 0; d + 1 < x.dim(); ++d) rows *= x.sym_size(d);
  return rows;
}

// The row-wise ops (LayerNorm, softmax) take x as it comes, (..., n), and work on its last dim: the
// leading dims are the rows, so no caller needs a view (a tensor object and an autograd node each, which
// at decode sizes cost about as much as the kernel). Returns row_count(x), after checking that there is
// a last dim and that the rows fit the kernels' one-block-per-row grid.
inline c10::SymInt leading_rows(const char* op, const at::Tensor& x) {
  TORCH_CHECK_VALUE(x.dim() >= 1, "cuda_kernels::", op, ": x must have at least one dim (rows of N), got a scalar");
  const c10::SymInt rows = row_count(x);
  TORCH_CHECK_VALUE(rows < (int64_t{1} << 31), "cuda_kernels::", op, ": at most 2^31 - 1 rows (one CUDA block each), got ",
                    rows, " (x has shape ", x.sym_sizes(), ")");
  return rows;
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

// A few numbers computed on the device, on their way to the host. `.cpu()` would wait until the GPU has
// run everything queued before them (in a training step, the whole forward so far), and while the host
// waits it queues nothing, so the GPU then idles until the host's next launches reach it. Instead they
// travel by a non-blocking copy into pinned host memory with an event behind it: a wrapper queues its
// kernels first and only then calls `arrived()`, which waits for that copy (so for the work queued before
// it, not for the kernels queued after it: the GPU runs those while the host goes on). On the CPU the copy
// is the values themselves.
class OnTheWayToHost {
 public:
  explicit OnTheWayToHost(const at::Tensor& values) {
#ifdef KERNEL_LADDER_WITH_CUDA
    if (values.is_cuda()) {
      host_ = at::empty(values.sizes(), values.options().device(at::kCPU).pinned_memory(true));
      host_.copy_(values, /*non_blocking=*/true);
      copied_.record(at::cuda::getCurrentCUDAStream(values.get_device()));
      return;
    }
#endif
    host_ = values.contiguous();
  }

  // The values, once the copy has landed (contiguous, on the CPU).
  const at::Tensor& arrived() const {
#ifdef KERNEL_LADDER_WITH_CUDA
    copied_.synchronize();  // an event never recorded (CPU values) returns at once
#endif
    return host_;
  }

 private:
  at::Tensor host_;
#ifdef KERNEL_LADDER_WITH_CUDA
  at::cuda::CUDAEvent copied_;
#endif
};

// --- registration: what swish_ops.cpp writes out in full, as two calls ----------------------------------

// The op `name` of our namespace, looked up in the dispatcher once (the first call) and kept. Calling
// through it, rather than the wrapper directly, lets whatever sits below autograd see the op: the
// Meta kernel under torch.compile, the profiler, a TorchDispatchMode.
template <typename Signature>
c10::TypedOperatorHandle<Signature> find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").template typed<Signature>();
}

// One host wrapper serves every device: CPU, Meta (it returns after allocating the outputs) and, in a
// CUDA build, CUDA.
template <auto* kWrapper>
void impl_on_every_device(torch::Library& m, const char* op) {
  m.impl(op, torch::dispatch(c10::DispatchKey::CPU, TORCH_FN(kWrapper)));
  m.impl(op, torch::dispatch(c10::DispatchKey::Meta, TORCH_FN(kWrapper)));
#ifdef KERNEL_LADDER_WITH_CUDA
  m.impl(op, torch::dispatch(c10::DispatchKey::CUDA, TORCH_FN(kWrapper)));
#endif
}

// A differentiable op: `forward` and `backward` on every device, and `autograd` (which records an OpNode,
// below) for the Autograd key of every backend. The backward is first-order only, and says so: its Autograd
// kernel is PyTorch's not-implemented node, so a second derivative (a backward run with create_graph=True,
// then differentiated again) raises "derivative for ... is not implemented". An op with no Autograd kernel
// at all would get PyTorch's default instead, a warning and gradients silently left at zero. With grad mode
// off, as in every plain .backward(), call_backward_op (below) calls past the node.
template <auto* kForward, auto* kBackward, auto* kAutograd>
void impl_differentiable(torch::Library& m, const char* forward, const char* backward) {
  impl_on_every_device<kForward>(m, forward);
  impl_on_every_device<kBackward>(m, backward);
  m.impl(forward, torch::dispatch(c10::DispatchKey::Autograd, TORCH_FN(kAutograd)));
  m.impl(backward, torch::dispatch(c10::DispatchKey::Autograd, torch::autograd::autogradNotImplementedFallback()));
}

// Whether autograd will record this call: grad mode is on and some tensor input requires grad. Under
// torch.no_grad (inference: a decode step) an autograd kernel calls the op below autograd at once
// (call_below_autograd), with no node to build. swish_ops.cpp writes this out.
inline bool requires_grad(const at::Tensor& t) { return t.defined() && t.requires_grad(); }
inline bool requires_grad(const std::optional<at::Tensor>& t) { return t.has_value() && t->requires_grad(); }
template <typename NotATensor>
bool requires_grad(const NotATensor&) { return false; }

template <typename... Inputs>
bool records_gradient(const Inputs&... inputs) {
  return at::GradMode::is_enabled() && (requires_grad(inputs) || ...);
}

// Forward-mode AD (torch.func.jvp, torch.autograd.forward_ad) gives inputs a tangent. Our ops have no
// forward-mode formula, and an output without its tangent would be a silently wrong answer, so every
// autograd kernel refuses such inputs first, as PyTorch's own ops without a formula do.
inline bool has_tangent(const at::Tensor& t) { return t.defined() && t._fw_grad(/*level=*/0).defined(); }
inline bool has_tangent(const std::optional<at::Tensor>& t) { return t.has_value() && has_tangent(*t); }
template <typename NotATensor>
bool has_tangent(const NotATensor&) { return false; }

template <typename... Inputs>
void refuse_tangents(const char* op, const Inputs&... inputs) {
  TORCH_CHECK_NOT_IMPLEMENTED(!(has_tangent(inputs) || ...), "cuda_kernels::", op,
                              ": forward-mode AD is not implemented (an input has a tangent); use reverse mode");
}

// --- the graph node of a differentiable op -------------------------------------------------------------
//
// PyTorch's own ops record their backward the way its code generator writes it: collect the inputs'
// gradient edges, run the op below autograd, hang a node on the output (set_history), keep what the
// backward needs as SavedVariables. torch::autograd::Function::apply does the same for any forward, and
// pays for that generality on every call: metadata for every input and output, a set of non-differentiable
// outputs, forward-mode bookkeeping through std::function objects, an IValue map for each number kept.
// OpNode is the generated code's recipe, written once for our ops (swish_ops.cpp spells it out). Through
// Function::apply a LayerNorm forward with gradients took measurably longer on the host than F.layer_norm's;
// as an OpNode it takes what PyTorch's own node takes (profiling/results/h200/autograd-node-level5.md).

// PyTorch 2.13 holds autograd nodes in c10::intrusive_ptr, earlier versions in std::shared_ptr (the course
// runs on both): a new node, and a node's pointer to itself, in whichever this PyTorch uses.
template <typename T, typename... Args>
auto new_node(Args&&... args) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>) {
    return c10::make_intrusive<T>(std::forward<Args>(args)...);
  } else {
    return std::make_shared<T>(std::forward<Args>(args)...);
  }
}

template <typename T>
auto pointer_to(T* node) {
  if constexpr (std::is_base_of_v<c10::intrusive_ptr_target, T>) {
    return c10::intrusive_ptr<torch::autograd::Node>::unsafe_reclaim_from_nonowning(node);
  } else {
    return node->shared_from_this();
  }
}

// A node that keeps what its backward needs as SavedVariables: the base of OpNode (below) and of level 4's
// replay node (triton_replay.cpp). A SavedVariable checks, when unpacked, that nobody changed the tensor in
// place meanwhile, goes through autograd's saved-tensor hooks (activation checkpointing, offloading), and
// is freed by release_variables once a backward without retain_graph has used it.
struct SavingNode : torch::autograd::Node {
  std::vector<torch::autograd::SavedVariable> saved;

  // is_output: a tensor this node is the grad_fn of, kept without that link (a node holding its own output
  // would be a cycle).
  void save(const at::Tensor& tensor, bool is_output = false) { saved.emplace_back(tensor, is_output); }

  void release_variables() override {
    const std::lock_guard<std::mutex> lock(mutex_);  // apply holds it too: no release under a running backward
    for (auto& variable : saved) variable.reset_data();
  }

 protected:
  // Appends the saved tensors, in the order saved, to `tensors`. Call from apply, with mutex_ held.
  void unpack_saved_into(std::vector<at::Tensor>& tensors) {
    const auto self = pointer_to(this);
    for (const auto& variable : saved) tensors.push_back(variable.unpack(self));
  }
};

// The node of one op call. Derived names itself (kName) and computes the inputs' gradients:
//   torch::autograd::variable_list gradients(const at::Tensor& grad, const std::vector<at::Tensor>& saved)
// from the output's gradient and the saved tensors (in the order saved), one entry per tensor input (in
// the order given to record_node), undefined where none is wanted (gradient_if_needed). Numbers the
// backward needs are Derived's own members.
template <typename Derived>
struct OpNode : SavingNode {
  std::string name() const override { return Derived::kName; }

  // The gradient of the `index`-th tensor input if this backward is asked for it (it requires grad, and
  // torch.autograd.grad, if that is the caller, names it), else an undefined tensor (None).
  at::Tensor gradient_if_needed(size_t index, const at::Tensor& gradient) const {
    return task_should_compute_output(index) ? gradient : at::Tensor();
  }

  torch::autograd::variable_list apply(torch::autograd::variable_list&& grads) override {
    const std::lock_guard<std::mutex> lock(mutex_);
    // No gradient reached the output (a zero one): none goes on to the inputs either.
    if (!grads[0].defined()) return torch::autograd::variable_list(num_outputs());
    std::vector<at::Tensor> tensors;
    tensors.reserve(saved.size());
    unpack_saved_into(tensors);
    return static_cast<Derived*>(this)->gradients(grads[0], tensors);
  }
};

// A NodeType (an OpNode) made the grad_fn of `output`, the op's one differentiable output, with an edge to
// each tensor input (`inputs`, std::optional ones included: an absent one gets an empty edge). The caller
// then saves what its backward needs. Other outputs (statistics, log-sum-exps) get no history: autograd
// treats them as constants. (swish_ops.cpp writes these steps out.)
template <typename NodeType, typename... Inputs>
auto record_node(const at::Tensor& output, const Inputs&... inputs) {
  auto node = new_node<NodeType>();
  node->set_next_edges(torch::autograd::collect_next_edges(inputs...));
  torch::autograd::set_history(output, node);
  return node;
}

// The op whose host wrapper is kWrapper, named `name`, called below autograd (found once, then kept).
// The arguments are forwarded as they come: an op that writes into a tensor (a KV cache) takes it as Tensor&.
template <auto* kWrapper, typename... Args>
auto call_below_autograd(const char* name, Args&&... args) {
  static const auto op = find_op<std::remove_pointer_t<decltype(kWrapper)>>(name);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(std::forward<Args>(args)...);
}

// x laid out as the kernels read it (a contiguous x itself, any other copied once), made below autograd so
// that the copy records no node: the tensor an autograd kernel passes to the op and saves for the backward,
// whose wrapper then reads it as it is instead of copying a strided x again.
inline at::Tensor contiguous_for_saving(const at::Tensor& x) {
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return x.contiguous();
}

// A backward op, called from an OpNode's gradients. A plain .backward() runs that with
// grad mode off: nothing will be recorded, so the call goes below autograd, past the op's Autograd kernel
// (impl_differentiable's not-implemented node: a boxed call that would only pass it on). Under
// create_graph=True it goes through that kernel, which records a node that raises if differentiated.
// swish_ops.cpp writes this out.
template <auto* kWrapper, typename... Args>
auto call_backward_op(const char* name, Args&&... args) {
  static const auto op = find_op<std::remove_pointer_t<decltype(kWrapper)>>(name);
  if (at::GradMode::is_enabled()) return op.call(std::forward<Args>(args)...);
  at::AutoDispatchBelowADInplaceOrView below_autograd;
  return op.call(std::forward<Args>(args)...);
}

}  // namespace kernel_ladder
