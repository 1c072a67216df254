// Level 4's eager calls replayed from C++: Triton's compiled kernels, launched without Python, forward and
// backward (what AOTInductor does for torch.compile's Triton kernels, done here for our own).
//
// Why it lives here. A level-4 call from Python pays Triton's Python launcher per kernel, and on a GPU its
// backward, a torch.autograd.Function's Python, runs on PyTorch's autograd device thread, where Python runs
// cold (profiling/results/h200/README.md, "Autograd's device thread"). Level 5 pays neither: its launches
// and its autograd are C++ (binding.h). triton_kernels/replay.py records, once per input signature, what
// level 4's Python forward and backward did: which compiled Triton kernels they launched, with which grids
// and arguments, and which buffers they allocated. Every later call of that signature is one op of this
// file: allocate, launch, attach a C++ backward node that allocates and launches in turn.
//
//   cuda_kernels::make_triton_plan(int[][] forward_allocations, int[][] forward_launches, int output,
//                                  int[] saved, int[][] backward_allocations, int[][] backward_launches,
//                                  int[] input_gradients) -> int
//     keeps a recorded call and returns its number. Tensors are numbered slots. Forward: the call's
//     arguments (one slot each, undefined for a non-tensor), then one per forward allocation; `output` is
//     the slot returned and `saved` the slots the backward keeps. Backward: 0 the incoming gradient (made
//     contiguous), then the saved tensors, then one per backward allocation; `input_gradients` the slot of
//     each argument's gradient, or -1.
//       an allocation: [scalar type, dim 0, dim 1, ...], an uninitialised buffer on the call's device (the
//         recorder accepts only calls whose kernels write every byte they read);
//       a launch: [CUfunction, grid x, grid y, grid z, threads, shared bytes, then (kind, value) per kernel
//         parameter], kinds as ParameterKind below.
//   cuda_kernels::run_triton_plan(Tensor?[] arguments, int plan) -> Tensor
//     the forward, and (when grad mode is on and an argument requires grad) the output's grad_fn: a
//     TritonBackward node, which keeps the saved slots as SavedVariables (so an in-place change of a saved
//     tensor, or a second backward, raises PyTorch's own error).
//   cuda_kernels::release_triton_plan(int plan) -> ()
//     forgets a plan (nodes already made keep theirs).
//
// The plan is a number, not a TorchScript custom class: converting an op argument of a custom class from
// Python costs more than the whole launch it replaces (profiling/results/h200/replay-from-cpp.md).
//
// Launching. Triton's launcher passes a kernel its non-constexpr arguments in order, then its scratch
// pointers (null when the kernel asks for no scratch); the recorder checked that list against the kernel's
// PTX, parameter by parameter, so a launch here only fills each parameter's bytes and calls cuLaunchKernel
// (found through the runtime: driver_api.h) on the current stream, which autograd sets to the forward's
// for the backward.
#include "binding.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/csrc/autograd/saved_variable.h>

#ifdef KERNEL_LADDER_WITH_CUDA
#include "driver_api.h"
#endif

#include <algorithm>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace kernel_ladder {
namespace {

using torch::autograd::SavedVariable;
using torch::autograd::variable_list;

// A kernel parameter's source (the first of each (kind, value) pair in a launch).
enum ParameterKind : int64_t {
  kTensor = 0,         // value: a slot; the parameter is its data pointer
  kAlignedTensor = 1,  // the same, for a kernel compiled assuming a 16-byte-aligned pointer
  kBits32 = 2,         // value: 4 bytes of an int32 or a float32, in the low half
  kBits64 = 3,         // value: 8 bytes of an int64 or a float64
};

struct Launch {
  uint64_t function;
  unsigned grid[3], threads, shared_bytes;
  std::vector<std::pair<int64_t, int64_t>> parameters;
};

struct Allocation {
  at::ScalarType dtype;
  std::vector<int64_t> shape;
};

// One recorded pass: buffers to allocate after the slots it is handed, and the kernels to launch over them.
struct Pass {
  std::vector<Allocation> allocations;
  std::vector<Launch> launches;

  Pass(const std::vector<std::vector<int64_t>>& allocation_rows, const std::vector<std::vector<int64_t>>& launch_rows) {
    for (const auto& row : allocation_rows) {
      TORCH_CHECK(!row.empty() && row[0] >= 0 && row[0] < static_cast<int64_t>(at::ScalarType::NumOptions),
                  "make_triton_plan: an allocation is a scalar type and a shape");
      allocations.push_back({static_cast<at::ScalarType>(row[0]), std::vector<int64_t>(row.begin() + 1, row.end())});
    }
    for (const auto& row : launch_rows) {
      TORCH_CHECK(row.size() >= 6 && row.size() % 2 == 0, "make_triton_plan: a launch is 6 numbers and (kind, value) pairs");
      Launch launch{static_cast<uint64_t>(row[0]),
                    {static_cast<unsigned>(row[1]), static_cast<unsigned>(row[2]), static_cast<unsigned>(row[3])},
                    static_cast<unsigned>(row[4]),
                    static_cast<unsigned>(row[5]),
                    {}};
      for (size_t i = 6; i < row.size(); i += 2) {
        TORCH_CHECK(kTensor <= row[i] && row[i] <= kBits64, "make_triton_plan: no parameter kind ", row[i]);
        launch.parameters.emplace_back(row[i], row[i + 1]);
      }
      launches.push_back(std::move(launch));
    }
  }

  // Every slot a launch names exists, when the pass is handed `handed` slots: a wrong number would read past
  // a vector, not raise.
  void check_slots(int64_t handed) const {
    const auto slots = handed + static_cast<int64_t>(allocations.size());
    for (const Launch& launch : launches) {
      for (const auto& [kind, value] : launch.parameters) {
        TORCH_CHECK(kind > kAlignedTensor || (0 <= value && value < slots), "make_triton_plan: a launch names no slot ", value);
      }
    }
  }

  // Appends the allocations to `slots` (on `options`' device) and launches every kernel.
  void run(std::vector<at::Tensor>& slots, const at::TensorOptions& options) const {
    for (const Allocation& allocation : allocations) slots.push_back(at::empty(allocation.shape, options.dtype(allocation.dtype)));
    if (launches.empty()) return;
    TORCH_CHECK(options.device().is_cuda(), "run_triton_plan launches CUDA kernels; got tensors on ", options.device());
#ifdef KERNEL_LADDER_WITH_CUDA
    static const auto launch_kernel = driver_function<PFN_cuLaunchKernel_v4000>("cuLaunchKernel", 4000);
    static const auto error_string = driver_function<PFN_cuGetErrorString_v6000>("cuGetErrorString", 6000);
    TORCH_CHECK(launch_kernel != nullptr && error_string != nullptr, "run_triton_plan: this CUDA driver hands out no cuLaunchKernel");
    const c10::cuda::CUDAGuard device_guard(options.device());
    const CUstream stream = at::cuda::getCurrentCUDAStream(options.device().index()).stream();
    std::vector<uint64_t> words;
    std::vector<void*> parameters;
    for (const Launch& launch : launches) {
      words.assign(launch.parameters.size(), 0);
      parameters.resize(launch.parameters.size());
      for (size_t i = 0; i < launch.parameters.size(); ++i) {
        const auto [kind, value] = launch.parameters[i];
        if (kind == kTensor || kind == kAlignedTensor) {
          TORCH_CHECK(slots[value].defined(), "run_triton_plan: a launch reads slot ", value, ", which holds no tensor");
          const auto address = reinterpret_cast<uint64_t>(slots[value].const_data_ptr());
          TORCH_CHECK(kind == kTensor || address % 16 == 0, "run_triton_plan: slot ", value,
                      " is not 16-byte aligned, but its kernel was compiled for an aligned pointer");
          words[i] = address;
        } else {
          words[i] = static_cast<uint64_t>(value);  // kBits32: cuLaunchKernel reads the low 4 bytes (little-endian)
        }
        parameters[i] = &words[i];
      }
      const CUresult status = launch_kernel(reinterpret_cast<CUfunction>(launch.function), launch.grid[0], launch.grid[1],
                                            launch.grid[2], launch.threads, 1, 1, launch.shared_bytes, stream,
                                            parameters.data(), nullptr);
      if (status != CUDA_SUCCESS) {
        const char* message = nullptr;
        error_string(status, &message);
        TORCH_CHECK(false, "run_triton_plan: cuLaunchKernel failed: ", message ? message : "unknown error");
      }
    }
#else
    TORCH_CHECK(false, "run_triton_plan launches CUDA kernels; this extension was built without CUDA");
#endif
  }
};

struct TritonPlan {
  Pass forward;
  int64_t output;
  std::vector<int64_t> saved;
  Pass backward;
  std::vector<int64_t> input_gradients;
};

// The plans by number. Made on whichever thread records (autograd's device thread, for a backward), read
// by the thread that calls: hence the lock. Numbers are never reused, so a forgotten one raises.
struct PlanRegistry {
  std::mutex lock;
  std::unordered_map<int64_t, std::shared_ptr<const TritonPlan>> plans;
  int64_t next = 0;
};

PlanRegistry& registry() {
  static PlanRegistry instance;
  return instance;
}

int64_t make_triton_plan(const std::vector<std::vector<int64_t>>& forward_allocations,
                         const std::vector<std::vector<int64_t>>& forward_launches, int64_t output,
                         std::vector<int64_t> saved, const std::vector<std::vector<int64_t>>& backward_allocations,
                         const std::vector<std::vector<int64_t>>& backward_launches, std::vector<int64_t> input_gradients) {
  auto plan = std::make_shared<const TritonPlan>(TritonPlan{Pass(forward_allocations, forward_launches), output,
                                                           std::move(saved), Pass(backward_allocations, backward_launches),
                                                           std::move(input_gradients)});
  // The forward is handed the arguments, the backward the gradient and the saved tensors; each pass's
  // allocations come after those.
  const auto arguments = static_cast<int64_t>(plan->input_gradients.size());
  const auto backward_handed = 1 + static_cast<int64_t>(plan->saved.size());
  plan->forward.check_slots(arguments);
  plan->backward.check_slots(backward_handed);
  const int64_t forward_slots = arguments + static_cast<int64_t>(plan->forward.allocations.size());
  const int64_t backward_slots = backward_handed + static_cast<int64_t>(plan->backward.allocations.size());
  TORCH_CHECK(arguments <= plan->output && plan->output < forward_slots, "make_triton_plan: the output must be a forward allocation");
  for (int64_t slot : plan->saved) TORCH_CHECK(0 <= slot && slot < forward_slots, "make_triton_plan: no forward slot ", slot);
  for (int64_t slot : plan->input_gradients) {
    TORCH_CHECK(slot == -1 || (backward_handed <= slot && slot < backward_slots),
                "make_triton_plan: a gradient must be a backward allocation");
  }
  PlanRegistry& plans = registry();
  const std::lock_guard<std::mutex> hold(plans.lock);
  plans.plans.emplace(plans.next, std::move(plan));
  return plans.next++;
}

void release_triton_plan(int64_t number) {
  PlanRegistry& plans = registry();
  const std::lock_guard<std::mutex> hold(plans.lock);
  plans.plans.erase(number);
}

std::shared_ptr<const TritonPlan> find_plan(int64_t number) {
  PlanRegistry& plans = registry();
  const std::lock_guard<std::mutex> hold(plans.lock);
  const auto found = plans.plans.find(number);
  TORCH_CHECK(found != plans.plans.end(), "run_triton_plan: no plan number ", number, " (released?)");
  return found->second;
}

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

constexpr const char* kSecondDerivative =
    "trying to differentiate twice a function that was marked with @once_differentiable: level 4's backward "
    "kernels compute first derivatives only";

struct TritonBackward : torch::autograd::Node {
  std::shared_ptr<const TritonPlan> plan;
  std::vector<SavedVariable> saved;

  std::string name() const override { return "TritonBackward"; }

  void release_variables() override {
    for (auto& variable : saved) variable.reset_data();
  }

  variable_list apply(variable_list&& grads) override {
    const auto self = pointer_to(this);
    const at::Tensor grad = grads[0].defined() ? grads[0] : input_metadata(0).zeros_like();
    std::vector<at::Tensor> slots;
    slots.reserve(1 + saved.size() + plan->backward.allocations.size());
    // A gradient at an address that is not a multiple of 16 (a view into a larger tensor) is copied, once,
    // for kernels compiled for aligned pointers: a copy's storage is fresh, so aligned.
    const at::Tensor contiguous = grad.contiguous();
    slots.push_back(reinterpret_cast<uintptr_t>(contiguous.const_data_ptr()) % 16 == 0 ? contiguous : contiguous.clone());
    for (const auto& variable : saved) slots.push_back(variable.unpack(self));
    plan->backward.run(slots, slots[0].options());
    variable_list result;
    result.reserve(plan->input_gradients.size());
    for (int64_t slot : plan->input_gradients) result.push_back(slot < 0 ? at::Tensor() : slots[slot]);
    const bool differentiable = std::any_of(slots.begin(), slots.begin() + 1 + saved.size(),
                                            [](const at::Tensor& tensor) { return tensor.requires_grad(); });
    if (at::GradMode::is_enabled() && differentiable) {
      // create_graph=True: what once_differentiable does for a Python backward, a gradient whose own
      // backward raises (a silent zero second derivative would be a wrong answer).
      for (auto& tensor : result) {
        if (tensor.defined()) tensor = tensor.detach().requires_grad_(true);
      }
      return new_node<torch::autograd::DelayedError>(kSecondDerivative, static_cast<int64_t>(result.size()))
          ->apply(std::move(result));
    }
    return result;
  }
};

at::Tensor run_triton_plan(const c10::List<std::optional<at::Tensor>>& arguments, int64_t number) {
  const std::shared_ptr<const TritonPlan> plan = find_plan(number);
  TORCH_CHECK(arguments.size() == plan->input_gradients.size(), "run_triton_plan: plan ", number, " takes ",
              plan->input_gradients.size(), " arguments, got ", arguments.size());
  std::vector<at::Tensor> slots;
  slots.reserve(arguments.size() + plan->forward.allocations.size());
  torch::autograd::edge_list edges;
  edges.reserve(arguments.size());
  std::optional<at::TensorOptions> options;  // the first tensor argument's: where the buffers go
  bool differentiable = false;
  for (const std::optional<at::Tensor>& argument : arguments) {
    slots.push_back(argument.has_value() ? *argument : at::Tensor());
    const at::Tensor& slot = slots.back();
    if (slot.defined() && !options) options = slot.options();
    const bool tracked = slot.defined() && slot.requires_grad();
    edges.push_back(tracked ? torch::autograd::impl::gradient_edge(slot) : torch::autograd::Edge());
    differentiable = differentiable || tracked;
  }
  TORCH_CHECK(options.has_value(), "run_triton_plan: no tensor among the arguments");
  plan->forward.run(slots, *options);
  at::Tensor output = slots[plan->output];
  if (!differentiable || !at::GradMode::is_enabled()) return output;
  auto node = new_node<TritonBackward>();
  node->plan = plan;
  node->set_next_edges(std::move(edges));
  torch::autograd::set_history(output, node);
  node->saved.reserve(plan->saved.size());
  for (int64_t slot : plan->saved) node->saved.emplace_back(slots[slot], /*is_output=*/slot == plan->output);
  return output;
}

}  // namespace
}  // namespace kernel_ladder

TORCH_LIBRARY_FRAGMENT(cuda_kernels, m) {
  // One kernel for every dispatch key: run_triton_plan makes its own autograd node.
  m.def("make_triton_plan(int[][] forward_allocations, int[][] forward_launches, int output, int[] saved, "
        "int[][] backward_allocations, int[][] backward_launches, int[] input_gradients) -> int",
        &kernel_ladder::make_triton_plan);
  m.def("release_triton_plan(int plan) -> ()", &kernel_ladder::release_triton_plan);
  m.def("run_triton_plan(Tensor?[] arguments, int plan) -> Tensor", &kernel_ladder::run_triton_plan);
}
