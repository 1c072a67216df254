// The fused LM head + cross-entropy as PyTorch ops: matmuls by cuBLAS, everything between them ours
// (linear_cross_entropy.cu, linear_cross_entropy_cpu.cpp); the autograd formula and the registration
// laid out as swish_ops.cpp explains, with binding.h's helpers.
//
//   linear_cross_entropy_forward(hidden, weight, targets, ignore_index, compute_gradients, chunk_rows=0)
//       -> (loss, grad_hidden, grad_weight)
//   linear_cross_entropy_backward(grad_loss, grad_hidden, grad_weight)
//       -> (grad_hidden * grad_loss, grad_weight * grad_loss)
//
// hidden (T, C), weight (V, C) (an nn.Linear's, or GPT-2's tied token embedding), targets (T,) int64.
// loss = the mean over tokens whose target is not ignore_index of logsumexp(logits) - logits[target],
// logits = hidden weight^T, as a 0-dim tensor in the accumulator type (float32; float64 for float64).
// The gradients come out of the forward: the logits are never whole in memory (linear_cross_entropy.cu
// says why), so there is nothing for a backward to start from but the gradients themselves. With
// compute_gradients false the forward skips the gradient kernels' writes and the two gradient matmuls
// and returns grad_hidden and grad_weight as empty (0,) tensors; the Autograd kernel asks for them
// whenever autograd will record the call, and its backward only multiplies them by the loss's gradient.
// No valid token (every target ignored, or T = 0): loss 0 and zero gradients.
//
// chunk_rows is the number of tokens whose logits are in memory at once; 0 chooses equal chunks of at most
// 2^28 logits (kLogitsPerChunk). Tests pass a small count to run several chunks on tiny shapes.
//
// Check
//   python -m pytest tests -k "linear_cross_entropy and cuda"
#include <algorithm>
#include <optional>

#include "binding.h"

namespace kernel_ladder {
namespace {

// At most 2^28 logits a chunk (512 MB in bfloat16), in equal chunks: GPT-2's 16384 tokens x 50304 make 4
// chunks of 4096 rows, its 8192 make 2. Bigger chunks are faster, because the grad_hidden GEMM of a
// 2560-row chunk (the earlier 2^27 logits) has 120 output tiles for 132 SMs: measured on an H200
// (profiling/results/h200/README.md, the LM head's chunk sizes), 6.74 ms a call at 4096 rows against
// 6.94 at 2560 and 6.71 at 8192, where the logits held at once are 0.41, 0.26 and 0.82 GB, and 8192 rows
// would hold the 8192-token step's logits whole. Chunks are whole multiples of 128 rows, the height of
// cuBLAS's larger tiles, so only the last chunk has a partial tile. Level 4 chooses the same chunks
// (triton_kernels/linear_cross_entropy.py, choose_chunk_rows), so the two levels compare like for like.
constexpr int64_t kLogitsPerChunk = int64_t{1} << 28;
constexpr int64_t kChunkRowMultiple = 128;
// The vocabulary is padded to a multiple of 64 tokens (128 bytes in bfloat16) for the three GEMMs: the
// weight gets zero rows up to the padded width, the logits buffer as many columns. With GPT-2's own
// vocabulary, 50257 (odd), the logits' dimension would be odd in all three GEMMs: the leading dimension of
// the logits operand would not be a multiple of 16 bytes, which cuBLAS's fastest kernels require (Hopper's
// TMA copies need 16-byte aligned strides), and even with padded rows an odd dimension leaves cuBLAS
// choosing kernels that load one element at a time ("align1"): measured on an H100, the three GEMMs of
// transformers' GPT-2 took ~12 ms a step unpadded against ~2.5 ms for our GPT's 50304. The same reason
// has nanoGPT and our own GPT round the vocabulary up to 50304; here the model keeps its 50257 and only
// the scratch copies are wider. The padded logits are exactly zero (zero weight rows), the row kernels
// read and write only the first `vocabulary` columns, so the padded columns stay zero and add nothing to
// grad_hidden; the padded rows of grad_weight are cut off.
constexpr int64_t kLogitsRowAlignment = 64;

int64_t choose_chunk_rows(int64_t tokens, int64_t vocabulary, int64_t requested) {
  int64_t rows = requested;
  if (rows == 0) {
    const auto ceil_div = [](int64_t a, int64_t b) { return (a + b - 1) / b; };
    const int64_t chunks = std::max<int64_t>(1, ceil_div(tokens * vocabulary, kLogitsPerChunk));
    rows = ceil_div(ceil_div(tokens, chunks), kChunkRowMultiple) * kChunkRowMultiple;
  }
  return std::clamp<int64_t>(rows, 1, std::max<int64_t>(tokens, 1));
}

void check_linear_cross_entropy(const char* op, const at::Tensor& hidden, const at::Tensor& weight,
                                const at::Tensor& targets, int64_t chunk_rows) {
  TORCH_CHECK_VALUE(hidden.dim() == 2, "cuda_kernels::", op, ": hidden must be a (tokens, features) matrix, got shape ",
                    hidden.sym_sizes());
  TORCH_CHECK_VALUE(weight.dim() == 2, "cuda_kernels::", op, ": weight must be a (vocabulary, features) matrix, got shape ",
                    weight.sym_sizes());
  TORCH_CHECK_VALUE(weight.sym_size(1) == hidden.sym_size(1), "cuda_kernels::", op, ": hidden has ", hidden.sym_size(1),
                    " features (shape ", hidden.sym_sizes(), ") but weight has ", weight.sym_size(1), " (shape ",
                    weight.sym_sizes(), ")");
  TORCH_CHECK_TYPE(weight.scalar_type() == hidden.scalar_type(), "cuda_kernels::", op, ": hidden has dtype ",
                   hidden.scalar_type(), " but weight has dtype ", weight.scalar_type());
  TORCH_CHECK_VALUE(weight.device() == hidden.device(), "cuda_kernels::", op, ": hidden is on ", hidden.device(),
                    " but weight is on ", weight.device());
  check_argument(op, "targets", targets, hidden, at::kLong, {hidden.sym_size(0)});
  TORCH_CHECK_VALUE(chunk_rows >= 0, "cuda_kernels::", op, ": chunk_rows must be >= 0 (0 chooses), got ", chunk_rows);
  kernel_dtype(op, hidden);
}

// The targets' count and range, computed where they are. The count stays there: the kernels read 1/n from
// it. The count and the smallest and largest valid target travel to the host together (OnTheWayToHost),
// and the wrapper reads them (check_range) only after queuing its kernels: the read still waits for the
// GPU to reach the copy, behind whatever was queued before the call, but the GPU then has the call's
// GEMMs to run while the host goes on, where a .cpu() first left it idle until the host's next launch.
class ValidTargets {
 public:
  ValidTargets(const at::Tensor& targets, int64_t ignore_index) : ValidTargets(targets, targets.ne(ignore_index)) {}

  // n, an int64 on the targets' device.
  const int64_t* count() const { return count_.const_data_ptr<int64_t>(); }

  // Raises if a target other than ignore_index lies outside [0, vocabulary). The kernels it follows read
  // such a target as no class (linear_cross_entropy.cu), so a bad target fails the call, never the GPU.
  void check_range(const char* op, int64_t ignore_index, int64_t vocabulary) const {
    const int64_t* numbers = summary_.arrived().const_data_ptr<int64_t>();
    const int64_t count = numbers[0], smallest = numbers[1], largest = numbers[2];
    TORCH_CHECK_VALUE(count == 0 || (smallest >= 0 && largest < vocabulary), "cuda_kernels::", op, ": target ",
                      smallest < 0 ? smallest : largest, " is out of range: every target must lie in [0, ", vocabulary,
                      ") or equal ignore_index (", ignore_index, ")");
  }

 private:
  // Ignored rows stand in as class 0, always in range: one where and one aminmax give both extremes.
  ValidTargets(const at::Tensor& targets, const at::Tensor& valid)
      : count_(valid.sum()), summary_(with_extremes(count_, at::where(valid, targets, 0))) {}

  static at::Tensor with_extremes(const at::Tensor& count, const at::Tensor& targets) {
    const auto [smallest, largest] = at::aminmax(targets);
    return at::stack({count, smallest, largest});
  }

  at::Tensor count_;
  OnTheWayToHost summary_;
};

TensorTriple linear_cross_entropy_forward(const at::Tensor& hidden, const at::Tensor& weight, const at::Tensor& targets,
                                          int64_t ignore_index, bool compute_gradients, int64_t chunk_rows) {
  const char* op = "linear_cross_entropy_forward";
  check_linear_cross_entropy(op, hidden, weight, targets, chunk_rows);
  const at::TensorOptions loss_options = hidden.options().dtype(statistics_dtype(hidden));
  // grad_hidden and grad_weight: shaped as hidden and weight, or (0,) without gradients.
  const auto gradient_shape = [&](const at::Tensor& input) {
    return compute_gradients ? c10::SymDimVector(input.sym_sizes().begin(), input.sym_sizes().end()) : c10::SymDimVector{0};
  };
  if (hidden.is_meta()) {
    return {at::empty({}, loss_options), at::empty_symint(gradient_shape(hidden), hidden.options()),
            at::empty_symint(gradient_shape(weight), hidden.options())};
  }
  const int64_t tokens = hidden.size(0), vocabulary = weight.size(0);
  if (tokens == 0) {  // a mean over no tokens: 0, as over tokens that are all ignored
    return {at::zeros({}, loss_options), at::zeros_symint(gradient_shape(hidden), hidden.options()),
            at::zeros_symint(gradient_shape(weight), hidden.options())};
  }
  const DType dtype = kernel_dtype(op, hidden);
  const int64_t padded_vocabulary = (vocabulary + kLogitsRowAlignment - 1) / kLogitsRowAlignment * kLogitsRowAlignment;
  const at::Tensor h = hidden.contiguous(), t = targets.contiguous();
  const at::Tensor w = padded_vocabulary == vocabulary
                           ? weight.contiguous()
                           : at::constant_pad_nd(weight, {0, 0, 0, padded_vocabulary - vocabulary});
  const int64_t rows_per_chunk = choose_chunk_rows(tokens, vocabulary, chunk_rows);
  // Reused by every chunk: (rows_per_chunk, padded_vocabulary), the row kernels' rows padded_vocabulary apart.
  // One buffer on one stream, so a chunk's row kernel waits for its logits GEMM and its gradient GEMMs wait
  // for it. Running each chunk's row kernel on a second stream beside the neighbouring chunks' GEMMs (two
  // buffers taking turns) hid 2 % of it on an H200: cuBLAS's Hopper GEMMs keep every SM busy to their last
  // tile, and telling cuBLAS to leave SMs free for the row kernel (an SM count target) slowed the GEMMs by
  // more than the row kernel costs (profiling/results/h200/README.md, session of 2026-11-29, seventh).
  at::Tensor logits = at::empty({rows_per_chunk, padded_vocabulary}, h.options());
  std::optional<ValidTargets> valid_targets;  // made after the first GEMM is queued (below)
  at::Tensor row_losses = at::empty({tokens}, loss_options);
  at::Tensor grad_hidden = at::empty_symint(gradient_shape(h), h.options());
  at::Tensor grad_weight = at::empty_symint(gradient_shape(w), h.options());
  for (int64_t start = 0; start < tokens; start += rows_per_chunk) {
    const int64_t rows = std::min(rows_per_chunk, tokens - start);
    at::Tensor chunk_logits = logits.narrow(0, 0, rows);
    const at::Tensor chunk_hidden = h.narrow(0, start, rows);
    void* chunk_losses = row_losses.narrow(0, start, rows).mutable_data_ptr();
    const int64_t* chunk_targets = t.const_data_ptr<int64_t>() + start;
    at::mm_out(chunk_logits, chunk_hidden, w.t());
    // The targets' count and range are queued behind the first chunk's logits GEMM: the GPU runs that GEMM
    // while the host queues their half-dozen small ops. Queued ahead of it, they would leave the GPU idle
    // until the host reached the GEMM.
    if (!valid_targets) valid_targets.emplace(t, ignore_index);
    // The logits become their gradient in place (or, without gradients, are only read).
    run_on_device_of(
        h,
        [&](void* stream) {
          launch_cross_entropy_rows(dtype, chunk_logits.mutable_data_ptr(), chunk_targets, chunk_losses, rows, vocabulary,
                                    padded_vocabulary, ignore_index, valid_targets->count(), compute_gradients, stream);
        },
        [&] {
          cross_entropy_rows_cpu(dtype, chunk_logits.mutable_data_ptr(), chunk_targets, chunk_losses, rows, vocabulary,
                                 padded_vocabulary, ignore_index, valid_targets->count(), compute_gradients);
        });
    if (!compute_gradients) continue;
    at::Tensor chunk_grad_hidden = grad_hidden.narrow(0, start, rows);
    at::mm_out(chunk_grad_hidden, chunk_logits, w);
    // grad_weight adds up over the chunks in the input dtype: cuBLAS reads it, adds this chunk's product
    // in float32 and rounds once per chunk, where one GEMM over all tokens would round once. In bfloat16
    // each rounding is at most 2^-8 relative; 4 chunks at GPT-2's 16384 tokens stay under 1.6 % even if
    // all 4 went the same way, inside bfloat16's 4e-2 tolerance. A float32 accumulator would cost a
    // (V, C) float32 tensor, and a bfloat16 product to add to it, per chunk.
    if (start == 0) {
      at::mm_out(grad_weight, chunk_logits.t(), chunk_hidden);
    } else {
      grad_weight.addmm_(chunk_logits.t(), chunk_hidden);
    }
  }
  at::Tensor loss = at::empty({}, loss_options);
  run_on_device_of(
      h,
      [&](void* stream) {
        launch_mean_loss(dtype, row_losses.const_data_ptr(), loss.mutable_data_ptr(), tokens, valid_targets->count(),
                         stream);
      },
      [&] {
        mean_loss_cpu(dtype, row_losses.const_data_ptr(), loss.mutable_data_ptr(), tokens, valid_targets->count());
      });
  valid_targets->check_range(op, ignore_index, vocabulary);
  // The first `vocabulary` rows of a contiguous matrix are contiguous: no copy.
  return {loss, grad_hidden, compute_gradients ? grad_weight.narrow(0, 0, vocabulary) : grad_weight};
}

// gradient * factor, factor a 0-dim accumulator-type tensor on the same device, read there by the kernel.
at::Tensor scaled_by(DType dtype, const at::Tensor& gradient, const at::Tensor& factor) {
  at::Tensor scaled = at::empty_symint(gradient.sym_sizes(), gradient.options());
  if (gradient.is_meta() || gradient.numel() == 0) return scaled;
  const at::Tensor input = gradient.contiguous();
  run_on_device_of(
      input,
      [&](void* stream) {
        launch_scale_by_device_scalar(dtype, input.const_data_ptr(), factor.const_data_ptr(), scaled.mutable_data_ptr(),
                                      input.numel(), stream);
      },
      [&] {
        scale_by_device_scalar_cpu(dtype, input.const_data_ptr(), factor.const_data_ptr(), scaled.mutable_data_ptr(),
                                   input.numel());
      });
  return scaled;
}

TensorPair linear_cross_entropy_backward(const at::Tensor& grad_loss, const at::Tensor& grad_hidden,
                                         const at::Tensor& grad_weight) {
  const char* op = "linear_cross_entropy_backward";
  const DType dtype = kernel_dtype(op, grad_hidden);
  check_argument(op, "grad_weight", grad_weight, grad_hidden, grad_hidden.scalar_type(), grad_weight.sym_sizes());
  check_argument(op, "grad_loss", grad_loss, grad_hidden, statistics_dtype(grad_hidden), {});
  // New tensors, the saved gradients untouched: a second backward (retain_graph) finds them as they were.
  return {scaled_by(dtype, grad_hidden, grad_loss), scaled_by(dtype, grad_weight, grad_loss)};
}

// The backward of one LM head + loss call: the forward computed the whole backward already, so the
// gradients of hidden and the weight (for a loss gradient of 1) are what it saves, and it only scales them.
struct LinearCrossEntropyBackward : OpNode<LinearCrossEntropyBackward> {
  static constexpr const char* kName = "LinearCrossEntropyBackward";

  torch::autograd::variable_list gradients(const at::Tensor& grad, const std::vector<at::Tensor>& saved) {
    auto [grad_hidden, grad_weight] = call_backward_op<&linear_cross_entropy_backward>(
        "cuda_kernels::linear_cross_entropy_backward", grad, saved[0], saved[1]);
    // Edges: hidden, weight, targets (integers: never a gradient).
    return {gradient_if_needed(0, grad_hidden), gradient_if_needed(1, grad_weight), at::Tensor()};
  }
};

TensorTriple linear_cross_entropy_forward_autograd(const at::Tensor& hidden, const at::Tensor& weight,
                                                   const at::Tensor& targets, int64_t ignore_index, bool compute_gradients,
                                                   int64_t chunk_rows) {
  refuse_tangents("linear_cross_entropy_forward", hidden, weight);
  if (!records_gradient(hidden, weight)) {
    return call_below_autograd<&linear_cross_entropy_forward>("cuda_kernels::linear_cross_entropy_forward", hidden, weight,
                                                              targets, ignore_index, compute_gradients, chunk_rows);
  }
  auto [loss, grad_hidden, grad_weight] = call_below_autograd<&linear_cross_entropy_forward>(
      "cuda_kernels::linear_cross_entropy_forward", hidden, weight, targets, ignore_index, true, chunk_rows);
  // The gradients are outputs too, which autograd treats as constants.
  auto node = record_node<LinearCrossEntropyBackward>(loss, hidden, weight, targets);
  node->save(grad_hidden);
  node->save(grad_weight);
  return {loss, grad_hidden, grad_weight};
}

}  // namespace
}  // namespace kernel_ladder

TORCH_LIBRARY_FRAGMENT(cuda_kernels, m) {
  m.def("linear_cross_entropy_forward(Tensor hidden, Tensor weight, Tensor targets, int ignore_index, "
        "bool compute_gradients, int chunk_rows=0) -> (Tensor loss, Tensor grad_hidden, Tensor grad_weight)");
  m.def("linear_cross_entropy_backward(Tensor grad_loss, Tensor grad_hidden, Tensor grad_weight) -> (Tensor, Tensor)");
  kernel_ladder::impl_differentiable<&kernel_ladder::linear_cross_entropy_forward,
                                     &kernel_ladder::linear_cross_entropy_backward,
                                     &kernel_ladder::linear_cross_entropy_forward_autograd>(
      m, "linear_cross_entropy_forward", "linear_cross_entropy_backward");
}
