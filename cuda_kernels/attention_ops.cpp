// Flash attention as a PyTorch op: the host wrappers around attention_forward.cu, attention_backward.cu
// and attention_cpu.cpp, the autograd formula, and the registration (laid out as swish_ops.cpp
// explains, with binding.h's helpers).
//
//   attention_forward(q, k, v, causal, window, scale)                 -> (out, lse)
//   attention_backward(grad_out, q, k, v, out, lse, causal, window, scale) -> (grad_q, grad_k, grad_v)
//   decode_attention(q, k_new, v_new, k_cache!, v_cache!, key_lengths, window, scale) -> out  (inference only;
//                    writes the new key and value into the caches)
//   use_hopper_attention(enable) -> the previous setting  (whether forward and backward may take their Hopper
//                    kernels, attention_{forward,backward}_hopper.cu, where they apply; on by default)
//
// q is (B, H, Lq, D), k and v (B, Hkv, Lk, D) with H a multiple of Hkv (grouped-query attention: query
// head h reads kv head h / (H / Hkv)); D a multiple of 8 up to 256; query i sits at key position i + Lk - Lq. lse, the log of
// each softmax's denominator (B, H, Lq, in the accumulator type), is an output so that the backward can
// recompute the probabilities tile by tile instead of storing them; autograd marks it
// non-differentiable and the Python function returns out.
//
// Check
//   python -m pytest tests -k "attention and cuda"
#include <atomic>

#include "binding.h"

namespace kernel_ladder {
namespace {

// The head dims the kernels run (cuda_kernels/limits.py states the same rule for Python).
void check_head_dim(const char* op, const c10::SymInt& d) {
  TORCH_CHECK_VALUE(d % 8 == 0 && d >= 8 && d <= 256, "cuda_kernels::", op, ": head_dim ", d,
                    " is not supported by the CUDA attention kernel (supported: multiples of 8 from 8 to 256)");
}

// Heads of q (or of the new token's query) that share each kv head: the group of grouped-query attention.
void check_heads_fit(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  const c10::SymInt heads = q.sym_size(1), kv_heads = k.dim() == 4 ? k.sym_size(1) : c10::SymInt(-1);
  TORCH_CHECK_VALUE(k.dim() == 4 && v.dim() == 4 && k.sym_sizes() == v.sym_sizes() && k.sym_size(0) == q.sym_size(0) &&
                        k.sym_size(3) == q.sym_size(3) && (heads == kv_heads || (kv_heads > 0 && heads % kv_heads == 0)),
                    "cuda_kernels::", op, ": shapes do not fit together: q ", q.sym_sizes(), ", k ", k.sym_sizes(), ", v ",
                    v.sym_sizes(), " (q's heads must be a multiple of k's and v's)");
}

// q (B, H, Lq, D), k and v (B, Hkv, Lk, D), one dtype and device, H a multiple of Hkv; D a multiple of 8
// up to 256; causal attention needs Lq <= Lk (queries are aligned to the end of the keys).
void check_attention(const char* op, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                     int64_t window) {
  TORCH_CHECK_VALUE(q.dim() == 4, "cuda_kernels::", op, ": q must be (batch, heads, seq, head_dim), got shape ", q.sym_sizes());
  check_heads_fit(op, q, k, v);
  const c10::SymInt batch = q.sym_size(0), lq = q.sym_size(2), d = q.sym_size(3);
  const c10::SymInt lk = k.sym_size(2);
  check_argument(op, "k", k, q, q.scalar_type(), k.sym_sizes());
  check_argument(op, "v", v, q, q.scalar_type(), k.sym_sizes());
  check_head_dim(op, d);
  TORCH_CHECK_VALUE(!causal || lq <= lk, "cuda_kernels::", op, ": causal attention with ", lq, " queries but only ", lk,
                    " keys (queries are aligned to the end of the keys)");
  TORCH_CHECK_VALUE(lk >= 1 || lq == 0 || batch * q.sym_size(1) == 0, "cuda_kernels::", op, ": ", lq,
                    " queries and no key to attend to");
  TORCH_CHECK_VALUE(window >= 0, "cuda_kernels::", op, ": window must be >= 0 (0: none), got ", window);
  TORCH_CHECK_VALUE(window == 0 || causal, "cuda_kernels::", op, ": a sliding window (", window,
                    ") looks back from each query, so it needs causal=True");
}

// The CUDA kernels move rows in 16-byte pieces; PyTorch's allocator always aligns a tensor so, only a view
// that starts at an odd offset into its storage does not.
bool starts_16_byte_aligned(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.const_data_ptr()) % 16 == 0; }

// The decode kernel writes the caches in place: they cannot be copied to fix their alignment, so a
// misaligned cache is refused.
void check_aligned_16(const char* op, std::initializer_list<const at::Tensor*> tensors) {
  for (const at::Tensor* t : tensors) {
    TORCH_CHECK_VALUE(!t->is_cuda() || starts_16_byte_aligned(*t), "cuda_kernels::", op,
                      ": tensors must start at 16-byte aligned addresses on the GPU (call .clone() on this view)");
  }
}

// Whether the kernels can read a (batch, heads, rows, head_dim) operand where it lies (kernels.h,
// HeadStrides): its head_dim values are contiguous and, on the GPU, every row starts 16 bytes after a
// multiple of 16 (the kernels copy rows in 16-byte pieces, TMA included). The heads of a fused q·k·v
// projection qualify; an odd view does not, and is copied once, on purpose (`readable`). A dim of size 1
// is never stepped along, so its stride does not count.
bool readable_where_it_lies(const at::Tensor& t) {
  if (t.size(3) > 1 && t.stride(3) != 1) return false;
  if (!t.is_cuda()) return true;
  const int64_t step = 16 / static_cast<int64_t>(t.element_size());  // elements in 16 bytes
  for (int64_t dim = 0; dim < 3; ++dim) {
    if (t.size(dim) > 1 && t.stride(dim) % step != 0) return false;
  }
  return starts_16_byte_aligned(t);
}

// t, or its contiguous copy where the kernels cannot read it where it lies. The autograd forward calls it
// and saves what it returns, so an odd view is copied once, not again in the backward. A tensor of
// symbolic shape (torch.compile tracing) has no address to check yet and goes on as it is: the op's
// wrapper decides on the real tensor.
at::Tensor readable(const at::Tensor& t) {
  if (t.unsafeGetTensorImpl()->has_symbolic_sizes_strides()) return t;
  return readable_where_it_lies(t) ? t : t.contiguous();
}

// The strides of a readable operand. A dim of size 1 gets its contiguous stride, which no kernel steps
// along but TMA checks (a multiple of 16 bytes).
HeadStrides head_strides(const at::Tensor& t) {
  const int64_t row = t.size(2) > 1 ? t.stride(2) : t.size(3);
  const int64_t head = t.size(1) > 1 ? t.stride(1) : t.size(2) * row;
  const int64_t batch = t.size(0) > 1 ? t.stride(0) : t.size(1) * head;
  return HeadStrides{batch, head, row};
}

// The forward's output (batch, heads, query_length, head_dim), laid out as (batch, query_length, heads,
// head_dim): the order in which GPT's output projection reads the heads back as one row of n_embd per
// token, so that `out.transpose(1, 2).reshape(batch, tokens, n_embd)` is a view, not a copy. (The
// layout depends on nothing but the shape, so the Meta kernel gives torch.compile the same strides.)
at::Tensor empty_attention_output(const at::Tensor& q) {
  return at::empty_symint({q.sym_size(0), q.sym_size(2), q.sym_size(1), q.sym_size(3)}, q.options()).transpose(1, 2);
}

// The gradient of t before the backward writes it, laid out as t lies: tokens first (as
// empty_attention_output) where t's rows lie farther apart than its heads, as the heads of a fused q·k·v
// projection do, else contiguous. Level 4's rule too (triton_kernels/attention_tiles.py, empty_gradient,
// which says why: unbind's backward then stacks the three gradients at copy speed). The rule reads only
// sizes and strides, so the Meta kernel gives torch.compile the same layout.
at::Tensor empty_gradient(const at::Tensor& t) {
  if (t.sym_size(1) > 1 && t.sym_size(2) > 1 && t.sym_stride(1) < t.sym_stride(2)) return empty_attention_output(t);
  return at::empty_symint(t.sym_sizes(), t.options());
}

// The forward's shape: the backward's tensors (grad_out and the gradients) are left unset, as it reads none.
AttentionShape attention_shape(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& out,
                               bool causal, int64_t window, double scale) {
  const int64_t group = k.size(1) > 0 ? q.size(1) / k.size(1) : 1;
  const AttentionProblem problem{q.size(0) * q.size(1), q.size(2), k.size(2), q.size(3), group, causal, window, scale,
                                 q.size(1)};
  return AttentionShape{problem, head_strides(q), head_strides(k), head_strides(v), head_strides(out)};
}

TensorPair attention_forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal, int64_t window,
                             double scale) {
  const char* op = "attention_forward";
  const DType dtype = kernel_dtype(op, q);
  check_attention(op, q, k, v, causal, window);
  at::Tensor out = empty_attention_output(q);
  at::Tensor lse = at::empty_symint(q.sym_sizes().slice(0, 3), q.options().dtype(statistics_dtype(q)));
  if (q.is_meta() || out.numel() == 0) return {out, lse};  // (no 0-block launch)
  const at::Tensor queries = readable(q), keys = readable(k), values = readable(v);
  const AttentionShape shape = attention_shape(queries, keys, values, out, causal, window, scale);
  run_on_device_of(
      queries,
      [&](void* stream) {
        launch_attention_forward(dtype, shape, queries.const_data_ptr(), keys.const_data_ptr(), values.const_data_ptr(),
                                 out.mutable_data_ptr(), lse.mutable_data_ptr(), stream);
      },
      [&] {
        attention_forward_cpu(dtype, shape, queries.const_data_ptr(), keys.const_data_ptr(), values.const_data_ptr(),
                              out.mutable_data_ptr(), lse.mutable_data_ptr());
      });
  return {out, lse};
}

TensorTriple attention_backward(const at::Tensor& grad_out, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const at::Tensor& out, const at::Tensor& lse, bool causal, int64_t window, double scale) {
  const char* op = "attention_backward";
  const DType dtype = kernel_dtype(op, q);
  check_attention(op, q, k, v, causal, window);
  check_argument(op, "grad_out", grad_out, q, q.scalar_type(), q.sym_sizes());
  check_argument(op, "out", out, q, q.scalar_type(), q.sym_sizes());
  check_argument(op, "lse", lse, q, statistics_dtype(q), q.sym_sizes().slice(0, 3));
  at::Tensor grad_q = empty_gradient(q), grad_k = empty_gradient(k), grad_v = empty_gradient(v);
  if (q.is_meta()) return {grad_q, grad_k, grad_v};
  if (q.numel() == 0 || k.numel() == 0) {  // nothing to launch; keys no query sees get zero gradients
    return {grad_q.zero_(), grad_k.zero_(), grad_v.zero_()};
  }
  const at::Tensor dy = readable(grad_out), queries = readable(q), keys = readable(k), values = readable(v);
  const at::Tensor output = readable(out), log_sum_exp = lse.contiguous();
  AttentionShape shape = attention_shape(queries, keys, values, output, causal, window, scale);
  shape.grad_out = head_strides(dy);
  shape.grad_q = head_strides(grad_q);
  shape.grad_k = head_strides(grad_k);
  shape.grad_v = head_strides(grad_v);
  run_on_device_of(
      queries,
      [&](void* stream) {
        // delta (and dq partial sums), from PyTorch's caching allocator: freed when this returns, and
        // reused only by work queued after ours on the same stream.
        at::Tensor workspace = at::empty({attention_backward_workspace_size(dtype, shape)}, lse.options());
        launch_attention_backward(dtype, shape, dy.const_data_ptr(), queries.const_data_ptr(), keys.const_data_ptr(),
                                  values.const_data_ptr(), output.const_data_ptr(), log_sum_exp.const_data_ptr(),
                                  grad_q.mutable_data_ptr(), grad_k.mutable_data_ptr(), grad_v.mutable_data_ptr(),
                                  workspace.mutable_data_ptr(), stream);
      },
      [&] {
        attention_backward_cpu(dtype, shape, dy.const_data_ptr(), queries.const_data_ptr(), keys.const_data_ptr(),
                               values.const_data_ptr(), output.const_data_ptr(), log_sum_exp.const_data_ptr(),
                               grad_q.mutable_data_ptr(), grad_k.mutable_data_ptr(), grad_v.mutable_data_ptr());
      });
  return {grad_q, grad_k, grad_v};
}

// The backward of one attention call: q, k, v as the kernels read them, the output and its log-sum-exp
// saved, in that order (lse, not the probabilities: the backward recomputes them), and the mask.
struct AttentionBackward : OpNode<AttentionBackward> {
  static constexpr const char* kName = "AttentionBackward";
  bool causal = false;
  int64_t window = 0;
  double scale = 1.0;

  torch::autograd::variable_list gradients(const at::Tensor& grad, const std::vector<at::Tensor>& saved) {
    auto [grad_q, grad_k, grad_v] = call_backward_op<&attention_backward>(
        "cuda_kernels::attention_backward", grad, saved[0], saved[1], saved[2], saved[3], saved[4], causal, window,
        scale);
    return {gradient_if_needed(0, grad_q), gradient_if_needed(1, grad_k), gradient_if_needed(2, grad_v)};
  }
};

TensorPair attention_forward_autograd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal,
                                      int64_t window, double scale) {
  refuse_tangents("attention_forward", q, k, v);
  if (!records_gradient(q, k, v)) {
    return call_below_autograd<&attention_forward>("cuda_kernels::attention_forward", q, k, v, causal, window, scale);
  }
  at::Tensor queries, keys, values;
  {
    at::AutoDispatchBelowADInplaceOrView below_autograd;  // a copy `readable` makes records no node
    queries = readable(q);
    keys = readable(k);
    values = readable(v);
  }
  auto [out, lse] = call_below_autograd<&attention_forward>("cuda_kernels::attention_forward", queries, keys, values,
                                                            causal, window, scale);
  auto node = record_node<AttentionBackward>(out, q, k, v);  // lse: a constant to autograd
  node->causal = causal;
  node->window = window;
  node->scale = scale;
  for (const at::Tensor& tensor : {queries, keys, values}) node->save(tensor);
  node->save(out, /*is_output=*/true);
  node->save(lse);
  return {out, lse};
}

// One new token per sequence appended to a static KV cache and attended (attention_decode.cu): the
// decode step a CUDA graph replays. key_lengths lives on the device and is read by the kernel, so it is
// not checked here (a value outside [1, capacity] is clamped). Inference only: no autograd formula.
at::Tensor decode_attention(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new, at::Tensor& k_cache,
                            at::Tensor& v_cache, const at::Tensor& key_lengths, int64_t window, double scale) {
  const char* op = "decode_attention";
  const DType dtype = kernel_dtype(op, q);
  TORCH_CHECK_VALUE(q.dim() == 4 && q.sym_size(2) == 1, "cuda_kernels::", op,
                    ": q must be (batch, heads, 1, head_dim), got shape ", q.sym_sizes());
  const c10::SymInt batch = q.sym_size(0), heads = q.sym_size(1), d = q.sym_size(3);
  check_heads_fit(op, q, k_cache, v_cache);
  const c10::SymInt kv_heads = k_cache.sym_size(1), capacity = k_cache.sym_size(2);
  check_argument(op, "k_new", k_new, q, q.scalar_type(), {batch, kv_heads, 1, d});
  check_argument(op, "v_new", v_new, q, q.scalar_type(), {batch, kv_heads, 1, d});
  check_argument(op, "k_cache", k_cache, q, q.scalar_type(), k_cache.sym_sizes());
  check_argument(op, "v_cache", v_cache, q, q.scalar_type(), k_cache.sym_sizes());
  check_argument(op, "key_lengths", key_lengths, q, at::kInt, {batch});
  check_head_dim(op, d);
  TORCH_CHECK_VALUE(window >= 0, "cuda_kernels::", op, ": window must be >= 0 (0: none), got ", window);
  TORCH_CHECK_VALUE(k_cache.is_contiguous() && v_cache.is_contiguous(), "cuda_kernels::", op,
                    ": the caches are written in place, so they must be contiguous");
  at::Tensor out = at::empty_symint({batch, heads, 1, d}, q.options());
  if (q.is_meta() || out.numel() == 0) return out;
  check_aligned_16(op, {&k_cache, &v_cache});
  // q, k_new and v_new are usually the heads of the fused projection (k_new and v_new strided alike):
  // read where they lie when they can be (always, for a projection of whole heads), else all three
  // copied once.
  const bool in_place = readable_where_it_lies(q) && readable_where_it_lies(k_new) && readable_where_it_lies(v_new) &&
                        v_new.strides() == k_new.strides();
  const at::Tensor query = in_place ? q : q.contiguous(), key = in_place ? k_new : k_new.contiguous(),
                   value = in_place ? v_new : v_new.contiguous(), lengths = key_lengths.contiguous();
  const int64_t group = k_cache.size(1) > 0 ? q.size(1) / k_cache.size(1) : 1;
  const DecodeShape shape{q.size(0), q.size(1), group, k_cache.size(2), q.size(3), query.stride(0), query.stride(1),
                          key.stride(0), key.stride(1), window, scale};
  run_on_device_of(
      query,
      [&](void* stream) {
        launch_attention_decode(dtype, shape, query.const_data_ptr(), key.const_data_ptr(), value.const_data_ptr(),
                                k_cache.mutable_data_ptr(), v_cache.mutable_data_ptr(), lengths.const_data_ptr<int32_t>(),
                                out.mutable_data_ptr(), stream);
      },
      [&] {
        attention_decode_cpu(dtype, shape, query.const_data_ptr(), key.const_data_ptr(), value.const_data_ptr(),
                             k_cache.mutable_data_ptr(), v_cache.mutable_data_ptr(), lengths.const_data_ptr<int32_t>(),
                             out.mutable_data_ptr());
      });
  return out;
}

// Inference only, and the Autograd key says so: with a gradient asked for, the output would carry no graph,
// and the gradients of everything before it would be silently missing (PyTorch's default for an op with no
// Autograd kernel: a warning, then None).
at::Tensor decode_attention_autograd(const at::Tensor& q, const at::Tensor& k_new, const at::Tensor& v_new,
                                     at::Tensor& k_cache, at::Tensor& v_cache, const at::Tensor& key_lengths,
                                     int64_t window, double scale) {
  TORCH_CHECK(!records_gradient(q, k_new, v_new), "cuda_kernels::decode_attention is inference only (it has no "
              "backward): call it under torch.no_grad(), or use attention_forward where gradients are wanted");
  return call_below_autograd<&decode_attention>("cuda_kernels::decode_attention", q, k_new, v_new, k_cache, v_cache,
                                                key_lengths, window, scale);
}

// One process-wide switch, read by every launch, so that a benchmark or a lesson can time both forward
// kernels on one Hopper GPU (cuda_kernels.ops.portable_attention()). A CPU-only build keeps it too: there
// it only stores the flag.
std::atomic<bool> hopper_attention{true};

bool use_hopper_attention(bool enable) { return hopper_attention.exchange(enable); }

}  // namespace

bool hopper_attention_enabled() { return hopper_attention.load(std::memory_order_relaxed); }

}  // namespace kernel_ladder

TORCH_LIBRARY_FRAGMENT(cuda_kernels, m) {
  m.def("attention_forward(Tensor q, Tensor k, Tensor v, bool causal, int window, float scale) -> (Tensor, Tensor)");
  m.def("attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
        "int window, float scale) -> (Tensor, Tensor, Tensor)");
  kernel_ladder::impl_differentiable<&kernel_ladder::attention_forward, &kernel_ladder::attention_backward,
                                     &kernel_ladder::attention_forward_autograd>(m, "attention_forward",
                                                                                 "attention_backward");
  m.def("decode_attention(Tensor q, Tensor k_new, Tensor v_new, Tensor(a!) k_cache, Tensor(b!) v_cache, "
        "Tensor key_lengths, int window, float scale) -> Tensor");
  kernel_ladder::impl_on_every_device<&kernel_ladder::decode_attention>(m, "decode_attention");
  m.impl("decode_attention", torch::dispatch(c10::DispatchKey::Autograd, TORCH_FN(kernel_ladder::decode_attention_autograd)));
  // No tensor argument, so no device to dispatch on: one kernel for every backend.
  m.def("use_hopper_attention(bool enable) -> bool");
  m.impl("use_hopper_attention", torch::dispatch(c10::DispatchKey::CompositeExplicitAutograd,
                                                 TORCH_FN(kernel_ladder::use_hopper_attention)));
}
