// The fused LM head + cross-entropy in CUDA: the kernels between linear_cross_entropy_ops.cpp's matmuls.
//
// What it computes (over tokens t with targets[t] != ignore_index, n_valid of them)
//   loss         = 1/n_valid * sum_t (logsumexp_j logits[t][j] - logits[t][targets[t]]),  logits = hidden weight^T
//   grad_logits  = (softmax(logits[t]) - onehot(targets[t])) / n_valid   (0 for an ignored token)
//   grad_hidden  = grad_logits weight,  grad_weight = grad_logits^T hidden   (cuBLAS, in the binding)
//
// Kernels
//   cross_entropy_staged_rows_kernel  one block per row of a chunk of logits, rows of up to 112 KB in
//                                   16-byte packs (GPT-2's 50304 words in bfloat16: 100 KB): the row
//                                   copied into shared memory as it is read, its (max, sum of exp) and
//                                   loss term from there, then grad_logits written over the logits
//   cross_entropy_rows_kernel       the other rows: pass 1 the row's online (max, sum of exp) and its
//                                   loss term, pass 2 re-reads the row and writes grad_logits, in place
//   mean_loss_kernel                one block: the per-row loss terms summed in a fixed order, / n_valid
//   scale_by_device_scalar_kernel   the backward: grad_hidden and grad_weight times the loss's gradient,
//                                   read from device memory (no copy to the host, no wait)
//
// The one idea that makes it fast
//   The logits are never whole in memory. At GPT-2's scale, 16384 tokens x 50304 vocabulary, they are
//   1.65 GB in bfloat16, and an unfused loss keeps them and their gradient (another 1.65 GB) alive at
//   once. The binding instead takes chunk_rows tokens at a time (at most 2^28 logits: 4096 rows, 412 MB,
//   in 4 chunks): cuBLAS writes the chunk's logits, this kernel turns them into their gradient in place, and
//   the two gradient GEMMs read that gradient straight away, so the forward leaves grad_hidden (25 MB)
//   and grad_weight (77 MB) behind and nothing of size tokens x vocabulary. The staged row kernel moves
//   each logit across DRAM once in and once out: it keeps the row in shared memory while it reduces. Reading
//   the row twice and hoping the second read hits L2 did not work: 132 SMs running 4 blocks of 100 KB rows
//   keep 53 MB in flight, more than the L2 holds, so the logits came from DRAM twice (measured, before and
//   after: profiling/results/h200/linear-cross-entropy-floor.md).
//   The row's statistics use softmax.cu's merge: each thread folds its values into a (max, sum of
//   exp(x - max)) pair, pairs merge exactly, (m, s) + (m', s') = (M, s e^(m - M) + s' e^(m' - M)), and
//   the block's pairs meet in one block_reduce.
//   The binding pads each row of the chunk to a multiple of kLogitsRowAlignment values, so rows start
//   16-byte aligned even for GPT-2's odd 50257 (cuBLAS needs that, linear_cross_entropy_ops.cpp says why);
//   a row that does not is still read right: a few single values up to its first 16-byte boundary, then
//   16-byte packs, then the few values after the last pack.
//
// Limits
//   n >= 1 values a row, rows < 2^31 a chunk. float16, bfloat16, float32 (computed in float32, loss
//   terms kept in float32) and float64. The gradient is stored in the input dtype already divided by
//   n_valid: in float16, values below 6e-8 (a probability of 1e-3 over 16384 tokens is 6e-8) flush to
//   zero, as they do in PyTorch's float16 cross-entropy; bfloat16 has float32's range.
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -warn-spills -c cuda_kernels/linear_cross_entropy.cu -o /tmp/lce.o
//   python -m pytest tests -k "linear_cross_entropy and cuda"
#include <algorithm>

#include "common.cuh"

namespace kernel_ladder {
namespace {

// A row of 50304 values wants every thread it can get: 512 (the float64 exp needs the registers
// that 1024 threads would not leave), at least 8 packs each, as softmax.cu's online kernel.
constexpr int kRowThreads = 512;
constexpr int kPacksPerThread = 8;
constexpr int kElementwiseThreads = 256;
// The longest row the staged kernel holds in shared memory: two such blocks share an SM of Hopper (228 KB),
// so one block's copies fly while the other reduces or writes. Longer rows (GPT-2's vocabulary in float32,
// 201 KB) would leave one block an SM, idle for memory through each reduction: the two-pass kernel takes them.
constexpr int64_t kStagedRowBytes = 112 * 1024;

// Visits this thread's share of a row of n values: on_value(i) for the single values before the
// row's first 16-byte boundary and after its last whole pack, on_pack(i) for the pack at i..i+kVec-1.
// A 16-byte load from an address that is not a multiple of 16 faults: the head realigns a row that
// starts between two boundaries.
template <typename T, typename OnPack, typename OnValue>
__device__ __forceinline__ void for_each_in_row(const T* row, int64_t n, OnPack on_pack, OnValue on_value) {
  constexpr int kVec = kVecOf<T>;
  const auto misalignment = static_cast<int64_t>(reinterpret_cast<uintptr_t>(row) % 16 / sizeof(T));
  const int64_t to_boundary = misalignment == 0 ? 0 : kVec - misalignment;
  const int64_t head = to_boundary < n ? to_boundary : n;
  const int64_t packs_end = head + (n - head) / kVec * kVec;
  for (int64_t i = threadIdx.x; i < head; i += blockDim.x) on_value(i);
  for (int64_t i = head + int64_t{threadIdx.x} * kVec; i < packs_end; i += int64_t{blockDim.x} * kVec) on_pack(i);
  for (int64_t i = packs_end + threadIdx.x; i < n; i += blockDim.x) on_value(i);
}

// The mean's 1/n, from the count the binding left in device memory: the host never reads it, so it
// never waits for the GPU to count. No valid target gives 0, and with it a loss of 0, not 0/0.
template <typename A>
__device__ __forceinline__ A inverse_count(const int64_t* n_valid) {
  const int64_t count = *n_valid;
  return count > 0 ? A(1) / A(count) : A(0);
}

// A row whose target is ignore_index: a loss term of 0 and, with gradients, a gradient of zeros. The whole
// block returns through here, so no barrier waits for a thread that left.
template <typename T>
__device__ __forceinline__ void ignore_row(T* row, int64_t n, Acc<T>* row_loss, bool write_gradient) {
  constexpr int kVec = kVecOf<T>;
  if (threadIdx.x == 0) *row_loss = Acc<T>(0);
  if (!write_gradient) return;
  for_each_in_row(
      row, n, [&](int64_t i) { store_pack<T, kVec>(row + i, Pack<T, kVec>{}); }, [&](int64_t i) { row[i] = T{}; });
}

// grad_logits[i] = (exp(x_i - max) / sum - [i == target]) * scale, scale = 1 / n_valid. The row loops write
// every value's probability term (one multiply by probability_scale, no division) and test no index: the
// loop's instructions are what limits it (common.cuh, exp2_approx), and a 64-bit compare and a select for
// every value would serve one value a row. finish_target then writes that value again, with its -scale.
template <typename T>
struct LogitGradient {
  using A = Acc<T>;
  A max, probability_scale, scale;

  __device__ LogitGradient(MaxSum<A> total, A inverse_count)
      : max(total.max), probability_scale(inverse_count / total.sum), scale(inverse_count) {}

  __device__ __forceinline__ A probability_term(A value) const { return exp_acc(value - max) * probability_scale; }

  __device__ __forceinline__ T operator()(A value) const { return from_acc<T>(probability_term(value)); }

  // After the loops: the barrier orders the loop's store of row[target], by whichever thread, before this one.
  __device__ __forceinline__ void finish_target(T* row, int64_t target, bool in_row, A target_logit) const {
    __syncthreads();
    if (threadIdx.x == 0 && in_row) row[target] = from_acc<T>(probability_term(target_logit) - scale);
  }
};

// The row staged in shared memory (common.cuh's stage_and_reduce, as softmax.cu's staged kernels): read
// from DRAM once, reduced from shared memory, and the gradient computed from the staged copy. The
// launcher sends only rows in whole 16-byte packs that start 16-byte aligned, and asks for n values of
// dynamic shared memory.
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
cross_entropy_staged_rows_kernel(T* logits, const int64_t* __restrict__ targets, Acc<T>* __restrict__ row_losses,
                                 int64_t n, int64_t row_stride, int64_t ignore_index,
                                 const int64_t* __restrict__ n_valid, bool write_gradient) {
  using A = Acc<T>;
  constexpr int kVec = kVecOf<T>;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  T* staged = reinterpret_cast<T*>(shared_bytes);
  T* row = logits + int64_t{blockIdx.x} * row_stride;
  const int64_t target = targets[blockIdx.x];
  if (target == ignore_index) return ignore_row(row, n, row_losses + blockIdx.x, write_gradient);
  const int n_packs = static_cast<int>(n / kVec);
  const MaxSum<A> total = stage_and_reduce<T>(row, staged, n_packs);
  // A target outside the row fails the call once it is queued (the binding's range check); until then it
  // reads nothing: the row's term is wrong, and the call will not return it.
  const bool in_row = target >= 0 && target < n;
  const A target_logit = in_row ? to_acc(staged[target]) : A(0);
  if (threadIdx.x == 0) row_losses[blockIdx.x] = log(total.sum) + total.max - target_logit;
  if (!write_gradient) return;
  const LogitGradient<T> gradient(total, inverse_count<A>(n_valid));
  for (int pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load_pack<T, kVec>(staged + pack * kVec);
    Pack<T, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) out.val[j] = gradient(to_acc(in.val[j]));
    store_pack<T, kVec>(row + int64_t{pack} * kVec, out);
  }
  gradient.finish_target(row, target, in_row, target_logit);
}

// The longest row the staged kernel takes on the current GPU: kStagedRowBytes, or less where a block may
// have less shared memory (common.cuh's dynamic_shared_bytes_limit; 0 if the driver could not say, and the
// two-pass kernel takes every row).
template <typename T>
int64_t staged_row_bytes_limit() {
  return std::min<int64_t>(kStagedRowBytes, dynamic_shared_bytes_limit(cross_entropy_staged_rows_kernel<T>));
}

// The rows the staged kernel does not take (not in whole 16-byte packs, or longer than kStagedRowBytes), in
// two passes with ordinary loads and stores: pass 2 re-reads the row, from L2 where it is still there, and
// the gradient it writes is the next GEMMs' input, which L2 may still hold when cuBLAS reads it.
template <typename T>
__global__ void __launch_bounds__(kRowThreads)
cross_entropy_rows_kernel(T* logits, const int64_t* __restrict__ targets, Acc<T>* __restrict__ row_losses, int64_t n,
                          int64_t row_stride, int64_t ignore_index, const int64_t* __restrict__ n_valid,
                          bool write_gradient) {
  using A = Acc<T>;
  constexpr int kVec = kVecOf<T>;
  T* row = logits + int64_t{blockIdx.x} * row_stride;
  const int64_t target = targets[blockIdx.x];
  if (target == ignore_index) return ignore_row(row, n, row_losses + blockIdx.x, write_gradient);
  // Read before any thread can overwrite it: pass 2 starts after block_reduce's barriers. A target
  // outside the row fails the call once it is queued (the binding's range check); until then it reads
  // nothing: the row's term is wrong, and the call will not return it.
  const bool in_row = target >= 0 && target < n;
  const A target_logit = threadIdx.x == 0 && in_row ? to_acc(row[target]) : A(0);
  MaxSum<A> mine;
  for_each_in_row(
      row, n,
      [&](int64_t i) { mine = merge(mine, max_sum_of_pack<T, kVec>(load_pack<T, kVec>(row + i))); },
      [&](int64_t i) { mine = merge(mine, MaxSum<A>{to_acc(row[i]), A(1)}); });
  const MaxSum<A> total = block_reduce(mine, Merge{});
  if (threadIdx.x == 0) row_losses[blockIdx.x] = log(total.sum) + total.max - target_logit;
  if (!write_gradient) return;
  const LogitGradient<T> gradient(total, inverse_count<A>(n_valid));
  for_each_in_row(
      row, n,
      [&](int64_t i) {
        const Pack<T, kVec> in = load_pack<T, kVec>(row + i);
        Pack<T, kVec> out;
#pragma unroll
        for (int j = 0; j < kVec; ++j) out.val[j] = gradient(to_acc(in.val[j]));
        store_pack<T, kVec>(row + i, out);
      },
      [&](int64_t i) { row[i] = gradient(to_acc(row[i])); });
  gradient.finish_target(row, target, in_row, target_logit);
}

// A few thousand loss terms: one block is enough, and one fixed order of additions gives the same
// bits on every run, where atomicAdd from many blocks would not.
template <typename A>
__global__ void __launch_bounds__(kMaxThreads)
mean_loss_kernel(const A* __restrict__ row_losses, A* __restrict__ loss, int64_t rows,
                 const int64_t* __restrict__ n_valid) {
  A sum = 0;
  for (int64_t row = threadIdx.x; row < rows; row += blockDim.x) sum += row_losses[row];
  sum = block_sum(sum);
  if (threadIdx.x == 0) *loss = sum * inverse_count<A>(n_valid);
}

// Thread i owns elements [i*kVec, i*kVec + kVec): one pack, or the ragged tail. Every thread reads the
// same factor: one 4- or 8-byte load, served from L1/L2 after the first.
template <typename T, int kVec>
__global__ void __launch_bounds__(kElementwiseThreads)
scale_by_device_scalar_kernel(const T* __restrict__ x, const Acc<T>* __restrict__ factor, T* __restrict__ out,
                              int64_t numel) {
  const Acc<T> f = *factor;
  const int64_t first = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * kVec;
  if (first + kVec <= numel) {
    const Pack<T, kVec> in = load_pack_once<T, kVec>(x + first);
    Pack<T, kVec> scaled;
#pragma unroll
    for (int j = 0; j < kVec; ++j) scaled.val[j] = from_acc<T>(to_acc(in.val[j]) * f);
    store_pack_once<T, kVec>(out + first, scaled);
  } else {
    for (int64_t i = first; i < numel; ++i) out[i] = from_acc<T>(to_acc(x[i]) * f);
  }
}

}  // namespace

// --- launchers -----------------------------------------------------------------------------------

void launch_cross_entropy_rows(DType dtype, void* logits, const int64_t* targets, void* row_losses, int64_t rows,
                               int64_t n, int64_t row_stride, int64_t ignore_index, const int64_t* n_valid,
                               bool write_gradient, void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    const int threads = std::min(kRowThreads, row_threads(n, kPacksPerThread * kVecOf<T>));
    const int64_t row_bytes = n * static_cast<int64_t>(sizeof(T));
    // Both kernels take the same arguments; the staged one also n values of dynamic shared memory.
    const bool staged = n % kVecOf<T> == 0 && aligned_16(logits) &&
                        row_stride * static_cast<int64_t>(sizeof(T)) % 16 == 0 && row_bytes <= staged_row_bytes_limit<T>();
    auto* kernel = staged ? &cross_entropy_staged_rows_kernel<T> : &cross_entropy_rows_kernel<T>;
    const int shared_bytes = staged ? static_cast<int>(row_bytes) : 0;
    // Dynamic shared memory past 48 KB must be asked for, per kernel and per device: so at each launch.
    if (staged) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
    kernel<<<static_cast<unsigned>(rows), threads, shared_bytes, static_cast<cudaStream_t>(stream)>>>(
        static_cast<T*>(logits), targets, static_cast<Acc<T>*>(row_losses), n, row_stride, ignore_index, n_valid,
        write_gradient);
  });
}

void launch_mean_loss(DType dtype, const void* row_losses, void* loss, int64_t rows, const int64_t* n_valid,
                      void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using A = Acc<decltype(zero)>;
    const int threads = static_cast<int>(std::min<int64_t>(kMaxThreads, row_threads(rows, 1)));
    mean_loss_kernel<A><<<1, threads, 0, static_cast<cudaStream_t>(stream)>>>(
        static_cast<const A*>(row_losses), static_cast<A*>(loss), rows, n_valid);
  });
}

void launch_scale_by_device_scalar(DType dtype, const void* x, const void* factor, void* out, int64_t numel,
                                   void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    dispatch_vector_width<T>(aligned_16(x) && aligned_16(out), [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      const auto blocks = static_cast<unsigned>(ceil_div(ceil_div(numel, kVec), kElementwiseThreads));
      scale_by_device_scalar_kernel<T, kVec><<<blocks, kElementwiseThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(x), static_cast<const Acc<T>*>(factor), static_cast<T*>(out), numel);
    });
  });
}

}  // namespace kernel_ladder
