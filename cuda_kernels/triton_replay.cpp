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
//   cuda_kernels::make_triton_plan(int[][] forward_allocations, int[][] forward_views, int[][] forward_launches,
//                                  int output, int[] saved, int[] gradient_strides, int[][] backward_allocations,
//                                  int[][] backward_views, int[][] backward_launches, int[] input_gradients) -> int
//     keeps a recorded call and returns its number. Tensors are numbered slots. Forward: the call's
//     arguments (one slot each, undefined for a non-tensor), then one per forward allocation, then one per
//     forward view; `output` is the slot returned (an allocation or a view of one) and `saved` the slots the
//     backward keeps (an argument itself, or an allocation or a view of one). Backward: 0 the incoming
//     gradient, laid out with `gradient_strides` (copied there when it arrives otherwise), then the saved
//     tensors, then one per backward allocation and one per backward view; `input_gradients` the slot of
//     each argument's gradient (an allocation or a view of one), or -1.
//       an allocation: [scalar type, zero-filled, dims, sizes..., strides...], a buffer on the call's device,
//         uninitialised (the recorder accepts only calls whose kernels write every byte they read) or, where
//         zero-filled is 1, zeroed at each call (a cooperative grid's row counters);
//       a view: [slot, element offset, dims, sizes..., strides...], that slot's storage seen with these
//         sizes and strides from the slot's own offset plus the given one (a transposed weight, an
//         output laid out (B, L, H, D) and returned as (B, H, L, D), a reshape);
//       a launch: [CUfunction, grid x, grid y, grid z, threads, shared bytes, cooperative, then (kind, value)
//         per kernel parameter], kinds as ParameterKind below; cooperative 1 for a grid whose programs wait
//         on each other, so must all be resident at once (the driver's cooperative launch).
//   cuda_kernels::run_triton_plan(int function, Tensor?[] tensors, float[] numbers, int plan) -> Tensor
//     the forward, and (when grad mode is on and an argument requires grad) the output's grad_fn: a
//     TritonBackward node, which keeps the saved slots as SavedVariables (so an in-place change of a saved
//     tensor, or a second backward, raises PyTorch's own error). The call's arguments are `tensors` (None
//     for an absent one) followed by `numbers` (each a slot that holds no tensor). It also remembers the
//     call's key (below) for `function`, a level-4 op's number, so that its next call alike is found here.
//   cuda_kernels::run_known_triton_call(int function, Tensor?[] tensors, float[] numbers) -> Tensor?
//     the same for a call whose key was remembered, or None: then Python takes the call (records it, or
//     runs a plan it holds through run_triton_plan, which remembers the key).
//     The key is what replay.py's signature reads, worked out here: per tensor its sizes, strides, dtype,
//     device, requires_grad, address modulo 16 and dispatch keys (a functorch wrapper's differ from a plain
//     tensor's, so it keeps Python's path, which unwraps it); per number its bits.
//     In Python that signature, a dict lookup and the list for the op took 7 us of a GPU host's time at
//     every call, more than the op itself spends launching (profiling/results/h200/replay-known-calls.md).
//   cuda_kernels::release_triton_plan(int plan) -> ()
//     forgets a plan (nodes already made keep theirs).
//
// The plan is a number, not a TorchScript custom class: converting an op argument of a custom class from
// Python costs more than the whole launch it replaces (profiling/results/h200/replay-from-cpp.md).
//
// Launching. Triton's launcher passes a kernel its non-constexpr arguments in order, then its scratch
// pointers (null when the kernel asks for no scratch); the recorder checked that list against the kernel's
// PTX, parameter by parameter, so a launch here only fills each parameter's bytes and calls cuLaunchKernel,
// or cuLaunchKernelEx with the cooperative attribute as Triton's launcher does for such a grid (both found
// through the runtime: driver_api.h), on the current stream, which autograd sets to the forward's for the
// backward.
#include "binding.h"

#include <ATen/core/LegacyTypeDispatch.h>
#include <torch/csrc/autograd/functions/basic_ops.h>

#ifdef KERNEL_LADDER_WITH_CUDA
#include "driver_api.h"
#endif

#include <algorithm>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <type_traits>
#include <unordered_map>
#include <vector>

namespace kernel_ladder {
namespace {

using torch::autograd::variable_list;

// A kernel parameter's source (the first of each (kind, value) pair in a launch).
enum ParameterKind : int64_t {
  kTensor = 0,         // value: a slot; the parameter is its data pointer
  kAlignedTensor = 1,  // the same, for a kernel compiled assuming a 16-byte-aligned pointer
  kBits32 = 2,         // value: 4 bytes of an int32 or a float32, in the low half
  kBits64 = 3,         // value: 8 bytes of an int64 or a float64
  kScratch = 4,        // value: bytes of global scratch memory the kernel asks of its launcher (a TMA
                       // descriptor it builds on the device), allocated per launch like Triton's does
};

struct Launch {
  uint64_t function;
  unsigned grid[3], threads, shared_bytes;
  bool cooperative;
  std::vector<std::pair<int64_t, int64_t>> parameters;
};

struct Allocation {
  at::ScalarType dtype;
  bool zero_filled;
  std::vector<int64_t> sizes, strides;
};

struct View {
  int64_t base, offset;
  std::vector<int64_t> sizes, strides;
};

// [dims, sizes..., strides...] from `row`, starting at `at`.
std::pair<std::vector<int64_t>, std::vector<int64_t>> geometry(const std::vector<int64_t>& row, size_t at,
                                                               const char* what) {
  TORCH_CHECK(row.size() > at && row[at] >= 0 && row.size() == at + 1 + 2 * static_cast<size_t>(row[at]),
              "make_triton_plan: ", what, " ends in its dims, sizes and strides");
  const auto sizes = row.begin() + static_cast<std::ptrdiff_t>(at) + 1;
  return {std::vector<int64_t>(sizes, sizes + row[at]), std::vector<int64_t>(sizes + row[at], row.end())};
}

// One recorded pass: buffers to allocate after the slots it is handed, views of those slots, and the kernels
// to launch over them.
struct Pass {
  std::vector<Allocation> allocations;
  std::vector<View> views;
  std::vector<Launch> launches;

  Pass(const std::vector<std::vector<int64_t>>& allocation_rows, const std::vector<std::vector<int64_t>>& view_rows,
       const std::vector<std::vector<int64_t>>& launch_rows) {
    for (const auto& row : allocation_rows) {
      TORCH_CHECK(row.size() >= 2 && row[0] >= 0 && row[0] < static_cast<int64_t>(at::ScalarType::NumOptions) &&
                      (row[1] == 0 || row[1] == 1),
                  "make_triton_plan: an allocation starts with a scalar type and whether it is zero-filled (0 or 1)");
      auto [sizes, strides] = geometry(row, 2, "an allocation");
      allocations.push_back({static_cast<at::ScalarType>(row[0]), row[1] == 1, std::move(sizes), std::move(strides)});
    }
    for (const auto& row : view_rows) {
      TORCH_CHECK(row.size() >= 2, "make_triton_plan: a view starts with a slot and an offset");
      auto [sizes, strides] = geometry(row, 2, "a view");
      views.push_back({row[0], row[1], std::move(sizes), std::move(strides)});
    }
    for (const auto& row : launch_rows) {
      TORCH_CHECK(row.size() >= 7 && row.size() % 2 == 1 && (row[6] == 0 || row[6] == 1),
                  "make_triton_plan: a launch is 7 numbers (the last whether it is cooperative, 0 or 1) and (kind, value) pairs");
      Launch launch{static_cast<uint64_t>(row[0]),
                    {static_cast<unsigned>(row[1]), static_cast<unsigned>(row[2]), static_cast<unsigned>(row[3])},
                    static_cast<unsigned>(row[4]),
                    static_cast<unsigned>(row[5]),
                    row[6] == 1,
                    {}};
      for (size_t i = 7; i < row.size(); i += 2) {
        TORCH_CHECK(kTensor <= row[i] && row[i] <= kScratch, "make_triton_plan: no parameter kind ", row[i]);
        launch.parameters.emplace_back(row[i], row[i + 1]);
      }
      launches.push_back(std::move(launch));
    }
  }

  int64_t first_view(int64_t handed) const { return handed + static_cast<int64_t>(allocations.size()); }
  int64_t slots(int64_t handed) const { return first_view(handed) + static_cast<int64_t>(views.size()); }

  // Every slot a view or a launch names exists (a view's, before it), when the pass is handed `handed` slots:
  // a wrong number would read past a vector, not raise.
  void check_slots(int64_t handed) const {
    for (size_t i = 0; i < views.size(); ++i) {
      TORCH_CHECK(0 <= views[i].base && views[i].base < first_view(handed) + static_cast<int64_t>(i),
                  "make_triton_plan: a view of no earlier slot ", views[i].base);
    }
    for (const Launch& launch : launches) {
      for (const auto& [kind, value] : launch.parameters) {
        TORCH_CHECK(kind > kAlignedTensor || (0 <= value && value < slots(handed)), "make_triton_plan: a launch names no slot ", value);
      }
    }
  }

  // Whether `slot` is memory this pass allocated, or a view of it (through views of views), when it is handed
  // `handed` slots: what may leave the pass, where a view of a handed tensor would alias memory the caller
  // may change.
  bool allocated(int64_t slot, int64_t handed) const {
    if (slot < 0 || slot >= slots(handed)) return false;
    while (slot >= first_view(handed)) slot = views[slot - first_view(handed)].base;
    return slot >= handed;
  }

  // Appends the allocations and the views to `slots` (on `options`' device) and launches every kernel.
  void run(std::vector<at::Tensor>& slots, const at::TensorOptions& options) const {
    for (const Allocation& allocation : allocations) {
      slots.push_back(at::empty_strided(allocation.sizes, allocation.strides, options.dtype(allocation.dtype)));
      if (allocation.zero_filled) slots.back().zero_();
    }
    {
      // Views for the kernels and the caller, not for autograd: an output gets its node from run_triton_plan,
      // and a view of an argument that requires grad must not grow a graph of its own.
      const at::AutoDispatchBelowADInplaceOrView below_autograd;
      for (const View& view : views) {
        const at::Tensor base = slots[view.base];
        TORCH_CHECK(base.defined(), "run_triton_plan: a view of slot ", view.base, ", which holds no tensor");
        slots.push_back(base.as_strided(view.sizes, view.strides, base.storage_offset() + view.offset));
      }
    }
    if (launches.empty()) return;
    TORCH_CHECK(options.device().is_cuda(), "run_triton_plan launches CUDA kernels; got tensors on ", options.device());
#ifdef KERNEL_LADDER_WITH_CUDA
    static const auto launch_kernel = driver_function<PFN_cuLaunchKernel_v4000>("cuLaunchKernel", 4000);
    static const auto launch_kernel_ex = driver_function<PFN_cuLaunchKernelEx_v11060>("cuLaunchKernelEx", 11060);
    static const auto error_string = driver_function<PFN_cuGetErrorString_v6000>("cuGetErrorString", 6000);
    TORCH_CHECK(launch_kernel != nullptr && error_string != nullptr, "run_triton_plan: this CUDA driver hands out no cuLaunchKernel");
    const c10::cuda::CUDAGuard device_guard(options.device());
    const CUstream stream = at::cuda::getCurrentCUDAStream(options.device().index()).stream();
    std::vector<uint64_t> words;
    std::vector<void*> parameters;
    std::vector<at::Tensor> scratch;  // freed after the launches: the caching allocator orders reuse on the stream
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
        } else if (kind == kScratch) {
          scratch.push_back(at::empty({value}, options.dtype(at::kByte)));
          words[i] = reinterpret_cast<uint64_t>(scratch.back().const_data_ptr());
        } else {
          words[i] = static_cast<uint64_t>(value);  // kBits32: cuLaunchKernel reads the low 4 bytes (little-endian)
        }
        parameters[i] = &words[i];
      }
      CUresult status;
      if (launch.cooperative) {
        TORCH_CHECK(launch_kernel_ex != nullptr, "run_triton_plan: this CUDA driver hands out no cuLaunchKernelEx");
        CUlaunchAttribute cooperative{};
        cooperative.id = CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
        cooperative.value.cooperative = 1;
        CUlaunchConfig config{};
        config.gridDimX = launch.grid[0];
        config.gridDimY = launch.grid[1];
        config.gridDimZ = launch.grid[2];
        config.blockDimX = launch.threads;
        config.blockDimY = config.blockDimZ = 1;
        config.sharedMemBytes = launch.shared_bytes;
        config.hStream = stream;
        config.attrs = &cooperative;
        config.numAttrs = 1;
        status = launch_kernel_ex(&config, reinterpret_cast<CUfunction>(launch.function), parameters.data(), nullptr);
      } else {
        status = launch_kernel(reinterpret_cast<CUfunction>(launch.function), launch.grid[0], launch.grid[1],
                               launch.grid[2], launch.threads, 1, 1, launch.shared_bytes, stream, parameters.data(),
                               nullptr);
      }
      if (status != CUDA_SUCCESS) {
        const char* message = nullptr;
        error_string(status, &message);
        TORCH_CHECK(false, "run_triton_plan: cuLaunchKernel", launch.cooperative ? "Ex" : "", " failed: ",
                    message ? message : "unknown error");
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
  std::vector<int64_t> gradient_strides;
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
                         const std::vector<std::vector<int64_t>>& forward_views,
                         const std::vector<std::vector<int64_t>>& forward_launches, int64_t output,
                         std::vector<int64_t> saved, std::vector<int64_t> gradient_strides,
                         const std::vector<std::vector<int64_t>>& backward_allocations,
                         const std::vector<std::vector<int64_t>>& backward_views,
                         const std::vector<std::vector<int64_t>>& backward_launches, std::vector<int64_t> input_gradients) {
  auto plan = std::make_shared<const TritonPlan>(
      TritonPlan{Pass(forward_allocations, forward_views, forward_launches), output, std::move(saved),
                 std::move(gradient_strides), Pass(backward_allocations, backward_views, backward_launches),
                 std::move(input_gradients)});
  // The forward is handed the arguments, the backward the gradient and the saved tensors; each pass's
  // allocations, then its views, come after those.
  const auto arguments = static_cast<int64_t>(plan->input_gradients.size());
  const auto backward_handed = 1 + static_cast<int64_t>(plan->saved.size());
  const Pass& forward = plan->forward;
  const Pass& backward = plan->backward;
  forward.check_slots(arguments);
  backward.check_slots(backward_handed);
  TORCH_CHECK(forward.allocated(plan->output, arguments), "make_triton_plan: the output must be a forward allocation or a view of one");
  for (int64_t slot : plan->saved) {
    TORCH_CHECK((0 <= slot && slot < arguments) || forward.allocated(slot, arguments),
                "make_triton_plan: a saved slot must be an argument, a forward allocation or a view of one; got ", slot);
  }
  for (int64_t slot : plan->input_gradients) {
    TORCH_CHECK(slot == -1 || backward.allocated(slot, backward_handed),
                "make_triton_plan: a gradient must be a backward allocation or a view of one");
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

// The plan numbered `number`, or null once Python has released it.
std::shared_ptr<const TritonPlan> kept_plan(int64_t number) {
  PlanRegistry& plans = registry();
  const std::lock_guard<std::mutex> hold(plans.lock);
  const auto found = plans.plans.find(number);
  return found == plans.plans.end() ? nullptr : found->second;
}

std::shared_ptr<const TritonPlan> find_plan(int64_t number) {
  std::shared_ptr<const TritonPlan> plan = kept_plan(number);
  TORCH_CHECK(plan != nullptr, "run_triton_plan: no plan number ", number, " (released?)");
  return plan;
}

constexpr const char* kSecondDerivative =
    "trying to differentiate twice a function that was marked with @once_differentiable: level 4's backward "
    "kernels compute first derivatives only";

struct TritonBackward : SavingNode {
  std::shared_ptr<const TritonPlan> plan;

  std::string name() const override { return "TritonBackward"; }

  variable_list apply(variable_list&& grads) override {
    const std::lock_guard<std::mutex> lock(mutex_);
    // (Autograd has matched the gradient's sizes to the output's.)
    at::Tensor grad = grads[0].defined() ? grads[0] : input_metadata(0).zeros_like();
    // A gradient laid out otherwise than the recorded one (its kernels may read its strides as recorded
    // integers), or at an address that is not a multiple of 16 (for kernels compiled for aligned pointers), is
    // copied, once, into the recorded layout: a fresh buffer, so aligned.
    if (!grad.strides().equals(plan->gradient_strides) || reinterpret_cast<uintptr_t>(grad.const_data_ptr()) % 16 != 0) {
      grad = at::empty_strided(grad.sizes(), plan->gradient_strides, grad.options()).copy_(grad);
    }
    std::vector<at::Tensor> slots;
    slots.reserve(plan->backward.slots(1 + static_cast<int64_t>(saved.size())));
    slots.push_back(grad);
    unpack_saved_into(slots);
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

// What a call of a level-4 op depends on (see the top of this file), as numbers.
using CallKey = std::vector<int64_t>;

struct CallKeyHash {
  size_t operator()(const CallKey& key) const noexcept {
    uint64_t hash = 0xcbf29ce484222325ULL;  // FNV-1a over the key's words: cheap, and keys differ in a few words
    for (const int64_t word : key) hash = (hash ^ static_cast<uint64_t>(word)) * 0x100000001b3ULL;
    return static_cast<size_t>(hash);
  }
};

// None for a tensor without storage (a wrapper tensor's data lives elsewhere): no plan reads it.
std::optional<CallKey> call_key(int64_t function, const c10::List<std::optional<at::Tensor>>& tensors,
                                c10::ArrayRef<double> numbers) {
  CallKey key{function, static_cast<int64_t>(tensors.size()), static_cast<int64_t>(numbers.size())};
  key.reserve(3 + tensors.size() * 12 + numbers.size());
  for (const std::optional<at::Tensor>& maybe : tensors) {
    if (!maybe.has_value() || !maybe->defined()) {
      key.push_back(-1);
      continue;
    }
    const at::Tensor& tensor = *maybe;
    if (!tensor.has_storage()) return std::nullopt;
    key.push_back(tensor.dim());
    key.insert(key.end(), tensor.sizes().begin(), tensor.sizes().end());
    key.insert(key.end(), tensor.strides().begin(), tensor.strides().end());
    key.push_back((static_cast<int64_t>(tensor.scalar_type()) << 16) | (static_cast<int64_t>(tensor.device().type()) << 8) |
                  static_cast<uint8_t>(tensor.device().index()));
    key.push_back((tensor.requires_grad() ? 16 : 0) | static_cast<int64_t>(reinterpret_cast<uintptr_t>(tensor.const_data_ptr()) % 16));
    key.push_back(static_cast<int64_t>(tensor.key_set().raw_repr()));
  }
  for (const double number : numbers) {
    int64_t bits;
    std::memcpy(&bits, &number, sizeof bits);
    key.push_back(bits);
  }
  return key;
}

// The plan number of each call key seen, read by every thread that calls a level-4 op. Plans are forgotten
// by Python (release_triton_plan); a key whose plan is gone is dropped when next looked up. At most
// kMostKnownCalls keys: past that (a loop over ever-new shapes) the table starts again, as Python's does.
struct KnownCalls {
  std::mutex lock;
  std::unordered_map<CallKey, int64_t, CallKeyHash> plans;
};
constexpr size_t kMostKnownCalls = 4096;

KnownCalls& known_calls() {
  static KnownCalls instance;
  return instance;
}

at::Tensor run_plan(const std::shared_ptr<const TritonPlan>& shared_plan, const c10::List<std::optional<at::Tensor>>& tensors,
                    size_t numbers) {
  const TritonPlan& plan = *shared_plan;
  TORCH_CHECK(tensors.size() + numbers == plan.input_gradients.size(), "run_triton_plan: the plan takes ",
              plan.input_gradients.size(), " arguments, got ", tensors.size(), " tensors and ", numbers, " numbers");
  std::vector<at::Tensor> slots;
  slots.reserve(plan.forward.slots(static_cast<int64_t>(plan.input_gradients.size())));
  torch::autograd::edge_list edges;
  edges.reserve(plan.input_gradients.size());
  std::optional<at::TensorOptions> options;  // the first tensor argument's: where the buffers go
  bool differentiable = false;
  for (const std::optional<at::Tensor>& argument : tensors) {
    slots.push_back(argument.has_value() ? *argument : at::Tensor());
    const at::Tensor& slot = slots.back();
    if (slot.defined() && !options) options = slot.options();
    const bool tracked = slot.defined() && slot.requires_grad();
    edges.push_back(tracked ? torch::autograd::impl::gradient_edge(slot) : torch::autograd::Edge());
    differentiable = differentiable || tracked;
  }
  slots.resize(plan.input_gradients.size());  // the numbers' slots, which hold no tensor
  edges.resize(plan.input_gradients.size());
  TORCH_CHECK(options.has_value(), "run_triton_plan: no tensor among the arguments");
  plan.forward.run(slots, *options);
  at::Tensor output = slots[plan.output];
  if (!differentiable || !at::GradMode::is_enabled()) return output;
  auto node = new_node<TritonBackward>();
  node->plan = shared_plan;
  node->set_next_edges(std::move(edges));
  torch::autograd::set_history(output, node);
  node->saved.reserve(plan.saved.size());
  for (int64_t slot : plan.saved) node->save(slots[slot], /*is_output=*/slot == plan.output);
  return output;
}

at::Tensor run_triton_plan(int64_t function, const c10::List<std::optional<at::Tensor>>& tensors,
                           c10::ArrayRef<double> numbers, int64_t number) {
  const std::shared_ptr<const TritonPlan> plan = find_plan(number);
  at::Tensor output = run_plan(plan, tensors, numbers.size());
  std::optional<CallKey> key = call_key(function, tensors, numbers);
  if (!key) return output;
  KnownCalls& known = known_calls();
  const std::lock_guard<std::mutex> hold(known.lock);
  if (known.plans.size() >= kMostKnownCalls) known.plans.clear();
  known.plans.insert_or_assign(std::move(*key), number);
  return output;
}

std::optional<at::Tensor> run_known_triton_call(int64_t function, const c10::List<std::optional<at::Tensor>>& tensors,
                                                c10::ArrayRef<double> numbers) {
  const std::optional<CallKey> key = call_key(function, tensors, numbers);
  if (!key) return std::nullopt;
  KnownCalls& known = known_calls();
  int64_t number;
  {
    const std::lock_guard<std::mutex> hold(known.lock);
    const auto found = known.plans.find(*key);
    if (found == known.plans.end()) return std::nullopt;
    number = found->second;
  }
  const std::shared_ptr<const TritonPlan> plan = kept_plan(number);
  if (plan == nullptr) {  // released by Python since: Python records the call again
    const std::lock_guard<std::mutex> hold(known.lock);
    const auto found = known.plans.find(*key);
    if (found != known.plans.end() && found->second == number) known.plans.erase(found);  // not a newer plan's
    return std::nullopt;
  }
  return run_plan(plan, tensors, numbers.size());
}

}  // namespace
}  // namespace kernel_ladder

TORCH_LIBRARY_FRAGMENT(cuda_kernels, m) {
  // One kernel for every dispatch key: run_triton_plan makes its own autograd node.
  m.def("make_triton_plan(int[][] forward_allocations, int[][] forward_views, int[][] forward_launches, int output, "
        "int[] saved, int[] gradient_strides, int[][] backward_allocations, int[][] backward_views, "
        "int[][] backward_launches, int[] input_gradients) -> int",
        &kernel_ladder::make_triton_plan);
  m.def("release_triton_plan(int plan) -> ()", &kernel_ladder::release_triton_plan);
  m.def("run_triton_plan(int function, Tensor?[] tensors, float[] numbers, int plan) -> Tensor",
        &kernel_ladder::run_triton_plan);
  m.def("run_known_triton_call(int function, Tensor?[] tensors, float[] numbers) -> Tensor?",
        &kernel_ladder::run_known_triton_call);
}
