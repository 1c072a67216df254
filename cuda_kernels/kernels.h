// The level-5 kernels' interface: what ops.cpp calls, and nothing else.
//
// Plain C++ on purpose. The binding file includes this header in every build, also on a machine whose
// PyTorch has no CUDA, so no CUDA type may appear here: tensors travel as `void*` plus a DType, and a
// CUDA stream as `void*` (a cudaStream_t is a pointer). The .cu files cast them back.
//
// Conventions, for every function below:
//   - pointers address contiguous memory (except where a shape says otherwise: AttentionShape, DecodeShape); a
//     (rows, n) matrix is row-major;
//   - sizes are element counts and are > 0 (the binding returns empty outputs without calling us);
//   - arithmetic is float32 for float16/bfloat16/float32 inputs and float64 for float64 inputs; the
//     LayerNorm statistics (mean, rstd = reciprocal standard deviation) and RMSNorm's (rstd = reciprocal
//     root mean square) are stored in that type.
#pragma once

#include <cstdint>

// The few helpers that the C++ CPU twins and the CUDA kernels share (a head's offset, attention_mask.h's
// masks) are compiled for both sides by nvcc, and as plain inline functions by the C++ compiler.
#ifdef __CUDACC__
#define KERNEL_LADDER_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define KERNEL_LADDER_HOST_DEVICE inline
#endif

namespace kernel_ladder {

enum class DType { Float32, Float64, Float16, BFloat16 };

// Where the rows of a (batch, heads, rows, head_dim) attention operand lie: row i of head h of batch b
// starts `b * batch + h * head + i * row` elements after the tensor's first, and its head_dim values are
// contiguous. A contiguous tensor has row = head_dim, head = rows * row, batch = heads * head. The heads
// of a fused q·k·v projection, (batch, tokens, 3, heads, head_dim) viewed as three (batch, heads, tokens,
// head_dim) tensors, have row = 3 * heads * head_dim and head = head_dim: the kernels read them where
// they lie, so the projection's output is never copied into head-major order, and write `out` in the
// (batch, tokens, heads, head_dim) order the output projection reads.
struct HeadStrides {
  int64_t batch, head, row;
  // The first element of head `index` of a tensor with `heads` heads per batch (index counts batch * heads).
  KERNEL_LADDER_HOST_DEVICE int64_t of_head(int64_t index, int64_t heads) const {
    return index / heads * batch + index % heads * head;
  }
};

// One attention call: q is (batch, heads, query_length, head_dim), batch_heads = batch * heads of them; k
// and v (batch, heads / group, key_length, head_dim): query head bh reads kv head bh / group
// (grouped-query attention; group 1: a kv head per query head). head_dim is a multiple of 8, at most
// 256. Query i sits at key position i + key_length - query_length; `causal` lets it see keys at or before
// that position, `window` > 0 only the `window` most recent of them (attention_mask.h).
struct AttentionProblem {
  int64_t batch_heads, query_length, key_length, head_dim, group;
  bool causal;
  int64_t window;
  double scale;  // multiplies q.k
  int64_t heads;  // query heads per batch: batch_heads / heads is the batch
};

// The problem and where its operands lie. q, k, v, out and, in the backward, grad_out and the gradients
// grad_q, grad_k, grad_v lie as their HeadStrides say: row i of query head bh at q.of_head(bh, heads) +
// i * q.row, of kv head bh / group at k.of_head(bh / group, heads / group) + i * k.row. On CUDA every
// stride is a multiple of 16 bytes (the rows are copied in 16-byte pieces and by TMA). lse
// (batch_heads, query_length) is contiguous. Each gradient lies as its operand does (attention_ops.cpp,
// empty_gradient): tokens first for the heads of a fused projection, else contiguous.
//
// The Hopper kernels take the AttentionProblem alone (their TMA maps hold the strides): with the then
// 15 strides in their by-value parameter, nvcc kept one copy of the backward's softmax code where it had
// kept two, and the backward ran 8.5 % slower on an H100 (GPT-2's attention, bf16).
struct AttentionShape : AttentionProblem {
  HeadStrides q, k, v, out, grad_out, grad_q, grad_k, grad_v;
};

// One decode-attention call (attention_decode.cu): q (batch, heads, 1, head_dim), rows of head_dim
// contiguous at + b * q_stride_batch + h * q_stride_head (heads may be views of a fused projection);
// k_new, v_new (batch, heads / group, 1, head_dim) likewise with the kv strides; caches (batch, heads /
// group, capacity, head_dim) contiguous, of which sequence b fills key_lengths[b] positions (read on the
// device) with this step; query head h reads kv head h / group; `window` > 0 keeps the most recent.
struct DecodeShape {
  int64_t batch, heads, group, capacity, head_dim, q_stride_batch, q_stride_head, kv_stride_batch, kv_stride_head,
      window;
  double scale;  // multiplies q.k
};

// One AdamW step's tensors: `count` lists of four (param, grad, exp_avg, exp_avg_sq) of one dtype,
// numels[i] > 0 values each. params, exp_avgs and exp_avg_sqs are updated in place.
struct AdamWTensors {
  void* const* params;
  const void* const* grads;
  void* const* exp_avgs;
  void* const* exp_avg_sqs;
  const int64_t* numels;
  int64_t count;
};

// The step's numbers, computed once on the host in double (adamw_ops.cpp) from lr, the betas, eps,
// weight_decay and the 1-based step.
struct AdamWFactors {
  double decay;                  // 1 - lr * weight_decay
  double one_minus_beta1;        // how far exp_avg moves toward grad
  double beta2, one_minus_beta2;
  double eps;
  double step_size;              // lr / (1 - beta1^step)
  double bias_correction2_sqrt;  // sqrt(1 - beta2^step)
};

// --- CUDA launchers (swish.cu, layer_norm.cu, layer_norm_backward.cu, softmax.cu, attention_forward.cu,
// attention_forward_hopper.cu, attention_backward.cu, feed_forward.cu, linear_cross_entropy.cu, adamw.cu) ---
// They enqueue on `stream` and return without waiting.
// The caller checks cudaGetLastError() afterwards. Every dtype of DType is supported.

// y = x * sigmoid(beta * x)
void launch_swish_forward(DType dtype, const void* x, void* y, int64_t numel, double beta, void* stream);
// The same y by version 1, 2 or 3 of the climb to launch_swish_forward's kernel (swish.cu lists them).
void launch_swish_forward_version(DType dtype, const void* x, void* y, int64_t numel, double beta, int version,
                                  void* stream);
// grad_x = grad_out * s * (1 + beta * x * (1 - s)),  s = sigmoid(beta * x) recomputed
void launch_swish_backward(DType dtype, const void* grad_out, const void* x, void* grad_x, int64_t numel,
                           double beta, void* stream);

// y = (x - mean) * rstd * weight + bias over each row of x (rows, n); writes mean and rstd (rows,).
void launch_layer_norm_forward(DType dtype, const void* x, const void* weight, const void* bias, void* y,
                               void* mean, void* rstd, int64_t rows, int64_t n, double eps, int64_t splits,
                               void* partials, void* stream);
// How many slices the LayerNorm and RMSNorm forwards split each row into (1: none): rows too long for an
// SM (or a cluster of them) to hold, and too few to fill the GPU. With splits > 1 the launchers need
// `partials`, rows * splits (count, mean, M2) triples of the accumulator type (float; double for float64).
int64_t layer_norm_forward_splits(DType dtype, int64_t rows, int64_t n);

// How much scratch the backward wants, in statistics-type values (float; double for float64): partial
// weight/bias gradient rows, one per block of its persistent grid (as many blocks as fit on the GPU at
// once, never more than `rows`), or for few long rows a pair of row sums per column slice of each row.
// The caller allocates it (kernels never allocate memory).
int64_t layer_norm_backward_workspace(DType dtype, int64_t rows, int64_t n);

// grad_x (rows, n), grad_weight and grad_bias (n,) in `dtype`. `workspace` is scratch, see above.
void launch_layer_norm_backward(DType dtype, const void* grad_out, const void* x, const void* weight,
                                const void* mean, const void* rstd, void* grad_x, void* grad_weight,
                                void* grad_bias, void* workspace, int64_t rows, int64_t n, void* stream);

// RMSNorm (layer_norm.cu's kernels without the mean and the bias): y = x * rstd * w, rstd (rows,) saved.
void launch_rms_norm_forward(DType dtype, const void* x, const void* weight, void* y, void* rstd, int64_t rows,
                             int64_t n, double eps, int64_t splits, void* partials, void* stream);
// As LayerNorm's (partial rows of dw only).
int64_t rms_norm_backward_workspace(DType dtype, int64_t rows, int64_t n);
void launch_rms_norm_backward(DType dtype, const void* grad_out, const void* x, const void* weight, const void* rstd,
                              void* grad_x, void* grad_weight, void* workspace, int64_t rows, int64_t n,
                              void* stream);

// softmax over each row of x (rows, n).
void launch_softmax_forward(DType dtype, const void* x, void* y, int64_t rows, int64_t n, int64_t splits,
                            void* partials, void* stream);
// How many slices the forward splits each row into (1: none): rows too long for an SM (or a cluster of
// them) to hold, and too few to fill the GPU. With splits > 1, launch_softmax_forward needs `partials`,
// rows * splits (max, sum) pairs of the accumulator type (float; double for float64).
int64_t softmax_forward_splits(DType dtype, int64_t rows, int64_t n);
// grad_x = y * (grad_out - sum(grad_out * y)) row by row.
void launch_softmax_backward(DType dtype, const void* grad_out, const void* y, void* grad_x, int64_t rows, int64_t n,
                             void* stream);

// out = softmax(q k^T * scale + mask) v; lse (batch_heads, query_length) = log of each softmax's
// denominator, max included (natural log, in the accumulator type). head_dim as AttentionShape says;
// every pointer is 16-byte aligned; every query sees at least one key.
void launch_attention_forward(DType dtype, const AttentionShape& shape, const void* q, const void* k, const void* v,
                              void* out, void* lse, void* stream);
// The same forward on Hopper's wgmma and TMA (attention_forward_hopper.cu), which launch_attention_forward
// tries first. Returns false, launching nothing, unless this build holds the kernel's sm_90a image, the
// current GPU is compute capability 9.0, dtype is float16 or bfloat16, head_dim <= 256 and
// hopper_attention_enabled().
bool launch_attention_forward_hopper(DType dtype, const AttentionShape& shape, const void* q, const void* k,
                                     const void* v, void* out, void* lse, void* stream);
// The same backward on Hopper's wgmma and TMA (attention_backward_hopper.cu), which
// launch_attention_backward tries first, under the same conditions as launch_attention_forward_hopper
// but head_dim <= 128; false: nothing was launched.
bool launch_attention_backward_hopper(DType dtype, const AttentionShape& shape, const void* grad_out, const void* q,
                                      const void* k, const void* v, const void* out, const void* lse, void* grad_q,
                                      void* grad_k, void* grad_v, void* workspace, void* stream);
// The switch behind the op cuda_kernels::use_hopper_attention (attention_ops.cpp defines both): on unless
// a caller turned it off, so that one process can time the mma.sync kernel on a Hopper GPU too.
bool hopper_attention_enabled();
// How much scratch the attention backward wants, in accumulator-type values (float; double for
// float64): delta = rowsum(grad_out * out) per query, and for float16/bfloat16 a float32 dq
// accumulator of batch_heads * query_length * head_dim values (kernels never allocate memory).
int64_t attention_backward_workspace_size(DType dtype, const AttentionShape& shape);
// grad_q, grad_k, grad_v in `dtype`; `workspace` is scratch, see above.
void launch_attention_backward(DType dtype, const AttentionShape& shape, const void* grad_out, const void* q,
                               const void* k, const void* v, const void* out, const void* lse, void* grad_q,
                               void* grad_k, void* grad_v, void* workspace, void* stream);

// Writes k_new and v_new at position key_lengths[b] - 1 of the caches, then out (batch, heads, 1,
// head_dim) = softmax(q k^T * scale) v over each sequence's filled keys (see DecodeShape); key_lengths
// is an int32 device array, clamped to [1, capacity].
void launch_attention_decode(DType dtype, const DecodeShape& shape, const void* q, const void* k_new, const void* v_new,
                             void* k_cache, void* v_cache, const int32_t* key_lengths, void* out, void* stream);

// The work around the feed-forward block's matmuls (ops.cpp runs those with cuBLAS through ATen).
// a = gelu_tanh(h), elementwise over numel values.
void launch_gelu_forward(DType dtype, const void* pre_activation, void* activation, int64_t numel, void* stream);
// How many strips of rows the column sums below split `rows` into (enough blocks to fill the GPU). When
// it is more than 1 the caller allocates a workspace of strips * n accumulator-type values, the
// strips' partial sums (kernels never allocate memory); with 1 the workspace is not touched.
int64_t column_sum_strips(DType dtype, int64_t rows, int64_t n);
// sums (n,) = the column sums of matrix (rows, n): a linear layer's bias gradient from dy.
void launch_column_sum(DType dtype, const void* matrix, void* sums, void* workspace, int64_t strips, int64_t rows,
                       int64_t n, void* stream);
// grad (rows, n) holds da on entry and dh = da * gelu_tanh'(pre_activation) on return; grad_bias (n,) is
// the column sums of dh. `strips` and `workspace` as for launch_column_sum.
void launch_gelu_backward(DType dtype, void* grad, const void* pre_activation, void* grad_bias, void* workspace,
                          int64_t strips, int64_t rows, int64_t n, void* stream);

// The fused LM head + cross-entropy around its matmuls (linear_cross_entropy_ops.cpp runs those).
// logits (rows, n) holds one chunk of hidden @ weight^T, row r starting at logits + r * row_stride
// (row_stride >= n: the binding pads rows for cuBLAS, see linear_cross_entropy_ops.cpp). Row r's loss term, logsumexp(logits[r]) -
// logits[r][targets[r]], goes to row_losses[r] (accumulator type), 0 where targets[r] == ignore_index.
// With write_gradient the row is overwritten in place with (softmax(row) - onehot(target)) / n_valid,
// zeros for an ignored row. n_valid is one int64 in device memory, counted there by the binding (0: no
// valid target, and every term and gradient is 0). A target outside [0, n) reads as no class: the binding
// raises for it once its kernels are queued, and until then nothing reads outside the row.
void launch_cross_entropy_rows(DType dtype, void* logits, const int64_t* targets, void* row_losses, int64_t rows,
                               int64_t n, int64_t row_stride, int64_t ignore_index, const int64_t* n_valid,
                               bool write_gradient, void* stream);
// loss (one accumulator-type value) = the sum of row_losses (rows values) / n_valid (0 when n_valid is 0),
// summed in one fixed order: the same bits on every run.
void launch_mean_loss(DType dtype, const void* row_losses, void* loss, int64_t rows, const int64_t* n_valid,
                      void* stream);
// out = x * factor[0], elementwise over numel values; factor is one accumulator-type value in device
// memory (the loss's gradient, read there: no copy to the host, no wait).
void launch_scale_by_device_scalar(DType dtype, const void* x, const void* factor, void* out, int64_t numel,
                                   void* stream);

// One AdamW step over every tensor, in as few launches as the kernel-argument limit allows (adamw.cu).
void launch_adamw_step(DType dtype, const AdamWTensors& tensors, const AdamWFactors& factors, void* stream);

// --- C++ CPU twins (swish_cpu.cpp, layer_norm_cpu.cpp, softmax_cpu.cpp, attention_cpu.cpp,
// feed_forward_cpu.cpp, linear_cross_entropy_cpu.cpp, adamw_cpu.cpp) ---
// OpenMP, float32 and float64 only.

void swish_forward_cpu(DType dtype, const void* x, void* y, int64_t numel, double beta);
void swish_backward_cpu(DType dtype, const void* grad_out, const void* x, void* grad_x, int64_t numel,
                        double beta);
void layer_norm_forward_cpu(DType dtype, const void* x, const void* weight, const void* bias, void* y,
                            void* mean, void* rstd, int64_t rows, int64_t n, double eps);
void layer_norm_backward_cpu(DType dtype, const void* grad_out, const void* x, const void* weight,
                             const void* mean, const void* rstd, void* grad_x, void* grad_weight,
                             void* grad_bias, int64_t rows, int64_t n);
void rms_norm_forward_cpu(DType dtype, const void* x, const void* weight, void* y, void* rstd, int64_t rows,
                          int64_t n, double eps);
void rms_norm_backward_cpu(DType dtype, const void* grad_out, const void* x, const void* weight, const void* rstd,
                           void* grad_x, void* grad_weight, int64_t rows, int64_t n);

void softmax_forward_cpu(DType dtype, const void* x, void* y, int64_t rows, int64_t n);
void softmax_backward_cpu(DType dtype, const void* grad_out, const void* y, void* grad_x, int64_t rows, int64_t n);
void attention_forward_cpu(DType dtype, const AttentionShape& shape, const void* q, const void* k, const void* v,
                           void* out, void* lse);
void attention_decode_cpu(DType dtype, const DecodeShape& shape, const void* q, const void* k_new, const void* v_new,
                          void* k_cache, void* v_cache, const int32_t* key_lengths, void* out);
void attention_backward_cpu(DType dtype, const AttentionShape& shape, const void* grad_out, const void* q,
                            const void* k, const void* v, const void* out, const void* lse, void* grad_q,
                            void* grad_k, void* grad_v);
void gelu_forward_cpu(DType dtype, const void* pre_activation, void* activation, int64_t numel);
void column_sum_cpu(DType dtype, const void* matrix, void* sums, int64_t rows, int64_t n);
void gelu_backward_cpu(DType dtype, void* grad, const void* pre_activation, void* grad_bias, int64_t rows, int64_t n);
void cross_entropy_rows_cpu(DType dtype, void* logits, const int64_t* targets, void* row_losses, int64_t rows, int64_t n,
                            int64_t row_stride, int64_t ignore_index, const int64_t* n_valid, bool write_gradient);
void mean_loss_cpu(DType dtype, const void* row_losses, void* loss, int64_t rows, const int64_t* n_valid);
void scale_by_device_scalar_cpu(DType dtype, const void* x, const void* factor, void* out, int64_t numel);
void adamw_step_cpu(DType dtype, const AdamWTensors& tensors, const AdamWFactors& factors);

}  // namespace kernel_ladder
