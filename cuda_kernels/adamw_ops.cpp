// AdamW as a PyTorch op: the host wrapper around adamw.cu and adamw_cpu.cpp and the registration
// (laid out as swish_ops.cpp explains, with binding.h's helpers).
//
//   adamw_step(params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps, weight_decay, step) -> ()
//
// One torch.optim.AdamW step (amsgrad and maximize off) over lists of tensors, updating params,
// exp_avgs and exp_avg_sqs in place; `step` is the 1-based count of steps, this one included (the
// caller increments it first, as torch.optim does). The bias corrections and the other factors are
// computed here, once, in double. The tensors are grouped by dtype, one launch sequence per dtype
// present. Zero-element tensors are skipped; four empty lists give the dispatcher no tensor to choose a
// kernel by, so the Python function (ops.adamw_step) returns before calling the op.
//
// No gradient, and how the Autograd key is handled: the op has an Autograd kernel that calls it below
// autograd and then bumps the version counters of the tensors it updated (what ADInplaceOrView does for
// PyTorch's in-place ops, so that a backward that saved a parameter before the step notices the change).
// In grad mode a tensor to update must not require grad: updating a leaf that requires grad in place
// is the error PyTorch raises too. torch.optim calls its step under torch.no_grad(), where parameters
// that require grad are fine. (torch.library.opcheck's autograd check therefore runs on tensors that
// do not require grad.)
//
// Check
//   python -m pytest tests -k "adamw and cuda"
#include <array>
#include <cmath>
#include <vector>

#include "binding.h"

namespace kernel_ladder {
namespace {

// lists[i] of one of the three state lists next to params[i]: same device, dtype and shape.
void check_beside_param(const char* op, const char* list, size_t i, const at::Tensor& t, const at::Tensor& param) {
  TORCH_CHECK_VALUE(t.device() == param.device(), "cuda_kernels::", op, ": ", list, "[", i, "] is on ", t.device(),
                    " but params[", i, "] is on ", param.device());
  TORCH_CHECK_TYPE(t.scalar_type() == param.scalar_type(), "cuda_kernels::", op, ": ", list, "[", i, "] has dtype ",
                   t.scalar_type(), " but params[", i, "] has dtype ", param.scalar_type());
  TORCH_CHECK_VALUE(t.sym_sizes() == param.sym_sizes(), "cuda_kernels::", op, ": ", list, "[", i, "] has shape ",
                    t.sym_sizes(), " but params[", i, "] has shape ", param.sym_sizes());
}

// The kernels walk each tensor's memory linearly, and the update must land in the tensor itself, so a
// strided tensor cannot be copied to a contiguous one behind the caller's back.
void check_contiguous(const char* op, const char* list, size_t i, const at::Tensor& t) {
  TORCH_CHECK_VALUE(t.is_contiguous(), "cuda_kernels::", op, ": ", list, "[", i, "] (shape ", t.sym_sizes(), ", strides ",
                    t.sym_strides(), ") is not contiguous: call .contiguous() on it first (the step writes in place, so no copy is made here)");
}

void check_adamw(const char* op, at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                 at::TensorList exp_avg_sqs, int64_t step) {
  TORCH_CHECK_VALUE(grads.size() == params.size() && exp_avgs.size() == params.size() && exp_avg_sqs.size() == params.size(),
                    "cuda_kernels::", op, ": params, grads, exp_avgs and exp_avg_sqs must be lists of equal length, got ",
                    params.size(), ", ", grads.size(), ", ", exp_avgs.size(), " and ", exp_avg_sqs.size(), " tensors");
  TORCH_CHECK_VALUE(step >= 1, "cuda_kernels::", op, ": step is the 1-based count of steps, this one included; got ", step);
  for (size_t i = 0; i < params.size(); ++i) {
    kernel_dtype(op, params[i]);
    TORCH_CHECK_VALUE(params[i].device() == params[0].device(), "cuda_kernels::", op, ": every tensor must be on one device, but params[",
                      i, "] is on ", params[i].device(), " and params[0] on ", params[0].device());
    check_beside_param(op, "grads", i, grads[i], params[i]);
    check_beside_param(op, "exp_avgs", i, exp_avgs[i], params[i]);
    check_beside_param(op, "exp_avg_sqs", i, exp_avg_sqs[i], params[i]);
    check_contiguous(op, "params", i, params[i]);
    check_contiguous(op, "grads", i, grads[i]);
    check_contiguous(op, "exp_avgs", i, exp_avgs[i]);
    check_contiguous(op, "exp_avg_sqs", i, exp_avg_sqs[i]);
  }
}

AdamWFactors adamw_factors(double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  const auto steps = static_cast<double>(step);
  const double bias_correction1 = 1.0 - std::pow(beta1, steps), bias_correction2 = 1.0 - std::pow(beta2, steps);
  return {1.0 - lr * weight_decay, 1.0 - beta1, beta2, 1.0 - beta2, eps, lr / bias_correction1, std::sqrt(bias_correction2)};
}

// The non-empty tensors of one dtype, as the kernels' pointer lists.
struct AdamWGroup {
  std::vector<void*> params, exp_avgs, exp_avg_sqs;
  std::vector<const void*> grads;
  std::vector<int64_t> numels;

  AdamWTensors tensors() const {
    return {params.data(), grads.data(), exp_avgs.data(), exp_avg_sqs.data(), numels.data(),
            static_cast<int64_t>(numels.size())};
  }
};

void adamw_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  const char* op = "adamw_step";
  check_adamw(op, params, grads, exp_avgs, exp_avg_sqs, step);
  if (params.empty() || params[0].is_meta()) return;  // the Meta kernel: nothing to allocate, nothing to update
  const AdamWFactors factors = adamw_factors(lr, beta1, beta2, eps, weight_decay, step);
  std::array<AdamWGroup, 4> groups;  // one per DType, indexed by its value
  for (size_t i = 0; i < params.size(); ++i) {
    if (params[i].numel() == 0) continue;
    AdamWGroup& group = groups[static_cast<size_t>(kernel_dtype(op, params[i]))];
    group.params.push_back(params[i].mutable_data_ptr());
    group.grads.push_back(grads[i].const_data_ptr());
    group.exp_avgs.push_back(exp_avgs[i].mutable_data_ptr());
    group.exp_avg_sqs.push_back(exp_avg_sqs[i].mutable_data_ptr());
    group.numels.push_back(params[i].numel());
  }
  for (size_t d = 0; d < groups.size(); ++d) {
    if (groups[d].numels.empty()) continue;
    const auto dtype = static_cast<DType>(d);
    run_on_device_of(
        params[0], [&](void* stream) { launch_adamw_step(dtype, groups[d].tensors(), factors, stream); },
        [&] { adamw_step_cpu(dtype, groups[d].tensors(), factors); });
  }
}

void adamw_step_autograd(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                         double lr, double beta1, double beta2, double eps, double weight_decay, int64_t step) {
  const auto refuse_gradients = [](const char* list, at::TensorList tensors) {
    for (size_t i = 0; i < tensors.size(); ++i) {
      TORCH_CHECK_VALUE(!records_gradient(tensors[i]), "cuda_kernels::adamw_step updates its tensors in place and has no "
                        "gradient, but ", list, "[", i, "] requires grad: call it under torch.no_grad(), as torch.optim does");
    }
  };
  refuse_gradients("params", params);
  refuse_gradients("exp_avgs", exp_avgs);
  refuse_gradients("exp_avg_sqs", exp_avg_sqs);
  call_below_autograd<&adamw_step>("cuda_kernels::adamw_step", params, grads, exp_avgs, exp_avg_sqs, lr, beta1, beta2, eps,
                                   weight_decay, step);
  for (const at::TensorList updated : {params, exp_avgs, exp_avg_sqs}) {
    for (const at::Tensor& t : updated) torch::autograd::impl::bump_version(t);
  }
}

}  // namespace
}  // namespace kernel_ladder

TORCH_LIBRARY_FRAGMENT(cuda_kernels, m) {
  m.def("adamw_step(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, Tensor(c!)[] exp_avg_sqs, float lr, "
        "float beta1, float beta2, float eps, float weight_decay, int step) -> ()");
  kernel_ladder::impl_on_every_device<&kernel_ladder::adamw_step>(m, "adamw_step");
  m.impl("adamw_step", torch::dispatch(c10::DispatchKey::Autograd, TORCH_FN(kernel_ladder::adamw_step_autograd)));
}
