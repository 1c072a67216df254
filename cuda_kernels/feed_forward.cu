// The feed-forward block around its matmuls, in CUDA: GELU forward, GELU backward fused with the bias
// gradient, and the column sums that make every bias gradient.
//
// What it computes (GPT-2's MLP: y = gelu_tanh(x W_fc^T + b_fc) W_proj^T + b_proj. ops.cpp runs the
// matmuls with cuBLAS through ATen, biases in their epilogue; the kernels here do the rest)
//   gelu_forward_kernel    a = gelu_tanh(h) of the pre-activation h = x W_fc^T + b_fc
//   gelu_backward_kernel   dh = da * gelu_tanh'(h), written over da, and in the same pass the column sums
//                          of dh over each strip of rows (the gradient of b_fc)
//   column_sum_kernel      the column sums of a matrix over each strip of rows: of dy, the gradient of a
//                          linear layer's bias; and of the strips' partial sums (the second pass)
//
//   gelu_tanh(h)  = 0.5 h (1 + tanh(u)) = h s,          u = sqrt(2/pi) (h + 0.044715 h^3)
//   gelu_tanh'(h) = s + 2 h s (1 - s) sqrt(2/pi) (1 + 3 * 0.044715 h^2)
//   with s = 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)) (and 0.5 (1 - tanh(u)^2) = 2 s (1 - s)): one exp and
//   one reciprocal, no tanh.
//
// The one idea that makes it fast
//   The matmuls are compute-bound and cuBLAS's tensor-core GEMMs are their ceiling; everything around
//   them is memory-bound, so each (tokens, hidden) matrix must cross DRAM as few times as the math
//   allows. Forward: the fc bias rides in cuBLAS's epilogue (added while the output tile is in
//   registers), so h is written once by the GEMM, read once here, and a written once. Adding the bias
//   here instead would write h twice (the GEMM's output, then h + b). Backward: dh and its column sums
//   come out of the same registers, so da and h are read once and dh written once, where PyTorch's GELU
//   backward and then the bias gradient's sum read dh again (4 passes over the hidden matrix become 3).
//   The column sums need no atomics: a block owns 32 adjacent 16-byte packs of columns (a warp reads
//   512 contiguous bytes of a row) and one strip of rows, which its 8 warps walk; the 8 running sums of
//   a column meet in shared memory, and each strip's sums become one float32 row of a workspace that a
//   small second launch adds up. Fixed order everywhere: the same input gives the same bits on every
//   run, where atomicAdd would not. Enough strips to fill the GPU, but no more than one per 64 rows;
//   when one strip covers every row, the first pass writes the answer itself.
//
// Limits
//   Any rows, n >= 1 (the binding never calls with 0 rows). 16-byte packs need 16-byte-aligned pointers
//   and, for the column sums, n a multiple of the pack width (4 float, 8 half, 2 double), else
//   1-element accesses; the GELU forward takes any count (the last thread does the ragged tail).
//   float16, bfloat16, float32 (computed and summed in float32) and float64. The float32 exp and
//   reciprocal are the hardware's fast ones (a few ulp); see half_one_plus_tanh.
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -v -c cuda_kernels/feed_forward.cu -o /tmp/feed_forward.o
//   python -m pytest tests -k "feed_forward and cuda"
#include <algorithm>
#include <type_traits>

#include "common.cuh"

namespace kernel_ladder {

// --- GELU, tanh approximation --------------------------------------------------------------------

// u = sqrt(2/pi) (h + 0.044715 h^3), and du/dh.
template <typename A>
__device__ __forceinline__ A gelu_argument(A h) { return A(0.79788456080286535588) * (h + A(0.044715) * h * h * h); }
template <typename A>
__device__ __forceinline__ A gelu_argument_slope(A h) { return A(0.79788456080286535588) * (A(1) + A(3 * 0.044715) * h * h); }

// s = 0.5 (1 + tanh(u)) = 1 / (1 + exp(-2u)). exp_acc is the hardware's exp2 unit (MUFU.EX2) and
// __fdividef a reciprocal (MUFU.RCP) and a multiply: a few ulp each, where tanhf takes a branch and a
// polynomial. The denominator is >= 1, where both are accurate, or inf (float32 h below about -10),
// giving s = 0: the limit.
__device__ __forceinline__ float half_one_plus_tanh(float u) { return __fdividef(1.0f, 1.0f + exp_acc(-2.0f * u)); }
__device__ __forceinline__ double half_one_plus_tanh(double u) { return 1.0 / (1.0 + exp_acc(-2.0 * u)); }

template <typename A>
__device__ __forceinline__ A gelu(A h) { return h * half_one_plus_tanh(gelu_argument(h)); }

template <typename A>
__device__ __forceinline__ A gelu_slope(A h) {
  const A s = half_one_plus_tanh(gelu_argument(h));
  return s + A(2) * h * s * (A(1) - s) * gelu_argument_slope(h);
}

// --- forward: a = gelu_tanh(h) -------------------------------------------------------------------

constexpr int kGeluThreads = 256;

// Thread i owns elements [i*kVec, i*kVec + kVec): one pack, or the ragged tail if the array ends inside it.
template <typename T, int kVec>
__global__ void __launch_bounds__(kGeluThreads)
gelu_forward_kernel(const T* __restrict__ pre_activation, T* __restrict__ activation, int64_t numel) {
  const int64_t first = (int64_t{blockIdx.x} * blockDim.x + threadIdx.x) * kVec;
  if (first + kVec <= numel) {
    // h is not read again before the backward: evict-first. a is the next GEMM's input: an ordinary
    // store, which L2 may still hold when cuBLAS reads it.
    const Pack<T, kVec> h = load_pack_once<T, kVec>(pre_activation + first);
    Pack<T, kVec> a;
#pragma unroll
    for (int j = 0; j < kVec; ++j) a.val[j] = from_acc<T>(gelu(to_acc(h.val[j])));
    store_pack<T, kVec>(activation + first, a);
  } else {
    for (int64_t i = first; i < numel; ++i) activation[i] = from_acc<T>(gelu(to_acc(pre_activation[i])));
  }
}

// --- column sums over strips of rows -------------------------------------------------------------

constexpr int kTilePacks = 32;    // threadIdx.x: a warp reads 32 adjacent packs of one row
constexpr int kStripLanes = 8;    // threadIdx.y: 8 warps walk the strip's rows, each every 8th row
constexpr int kStripThreads = kTilePacks * kStripLanes;
constexpr int64_t kMinStripRows = 64;  // a strip per 64 rows at most: ~8 rows a thread, partial sums <= ~1/64 of the input

// This block's tile of columns summed over its strip of rows into strip_sums[blockIdx.y][...].
// row_values(row, pack) returns the kVec accumulator values of that pack of that row (and may store).
template <int kVec, typename A, typename Out, typename RowValues>
__device__ __forceinline__ void sum_strip_tile(RowValues row_values, Out* __restrict__ strip_sums, int64_t rows,
                                               int64_t n, int64_t strip_rows) {
  // [lane][j][pack]: at each j, a warp's 32 lanes write 32 consecutive words, one per bank.
  __shared__ A lane_sums[kStripLanes][kVec][kTilePacks];
  const int64_t pack = int64_t{blockIdx.x} * kTilePacks + threadIdx.x;
  const bool in_matrix = pack < n / kVec;
  const int64_t first_row = int64_t{blockIdx.y} * strip_rows;
  const int64_t end_row = first_row + strip_rows < rows ? first_row + strip_rows : rows;
  A sums[kVec] = {};
  if (in_matrix) {
    for (int64_t row = first_row + threadIdx.y; row < end_row; row += kStripLanes) {
      const Pack<A, kVec> values = row_values(row, pack);
#pragma unroll
      for (int j = 0; j < kVec; ++j) sums[j] += values.val[j];
    }
  }
#pragma unroll
  for (int j = 0; j < kVec; ++j) lane_sums[threadIdx.y][j][threadIdx.x] = sums[j];
  __syncthreads();
  if (threadIdx.y != 0 || !in_matrix) return;
  Out* out = strip_sums + int64_t{blockIdx.y} * n + pack * kVec;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    for (int lane = 1; lane < kStripLanes; ++lane) sums[j] += lane_sums[lane][j][threadIdx.x];  // fixed order
    out[j] = from_acc<Out>(sums[j]);
  }
}

// dy is also an input of the weight-gradient GEMM: ordinary loads, so L2 may keep it for cuBLAS.
template <typename T, int kVec, typename Out>
__global__ void __launch_bounds__(kStripThreads)
column_sum_kernel(const T* __restrict__ matrix, Out* __restrict__ strip_sums, int64_t rows, int64_t n,
                  int64_t strip_rows) {
  using A = Acc<T>;
  const auto row_values = [&](int64_t row, int64_t pack) {
    const Pack<T, kVec> in = load_pack<T, kVec>(matrix + row * n + pack * kVec);
    Pack<A, kVec> values;
#pragma unroll
    for (int j = 0; j < kVec; ++j) values.val[j] = to_acc(in.val[j]);
    return values;
  };
  sum_strip_tile<kVec, A>(row_values, strip_sums, rows, n, strip_rows);
}

// --- backward: dh = da * gelu_tanh'(h) and its column sums, in one pass ----------------------------

// da and h are read once (evict-first); dh is the input of the two GEMMs that follow (dh^T x and
// dh W_fc): an ordinary store. The column sums add dh before it is rounded to T.
template <typename T, int kVec, typename Out>
__global__ void __launch_bounds__(kStripThreads)
gelu_backward_kernel(T* __restrict__ grad, const T* __restrict__ pre_activation, Out* __restrict__ strip_sums,
                     int64_t rows, int64_t n, int64_t strip_rows) {
  using A = Acc<T>;
  const auto row_values = [&](int64_t row, int64_t pack) {
    const int64_t offset = row * n + pack * kVec;
    const Pack<T, kVec> da = load_pack_once<T, kVec>(grad + offset);
    const Pack<T, kVec> h = load_pack_once<T, kVec>(pre_activation + offset);
    Pack<A, kVec> dh;
    Pack<T, kVec> out;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      dh.val[j] = to_acc(da.val[j]) * gelu_slope(to_acc(h.val[j]));
      out.val[j] = from_acc<T>(dh.val[j]);
    }
    store_pack<T, kVec>(grad + offset, out);
    return dh;
  };
  sum_strip_tile<kVec, A>(row_values, strip_sums, rows, n, strip_rows);
}

// --- launchers -----------------------------------------------------------------------------------

void launch_gelu_forward(DType dtype, const void* pre_activation, void* activation, int64_t numel, void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    dispatch_vector_width<T>(aligned_16(pre_activation) && aligned_16(activation), [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      const auto blocks = static_cast<unsigned>(ceil_div(ceil_div(numel, kVec), kGeluThreads));
      gelu_forward_kernel<T, kVec><<<blocks, kGeluThreads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(pre_activation), static_cast<T*>(activation), numel);
    });
  });
}

int64_t column_sum_strips(DType dtype, int64_t rows, int64_t n) {
  // As many blocks as the GPU holds at once (2048 threads an SM on Hopper: 8 blocks of 256), split
  // between the column tiles and the strips.
  int device = 0, multiprocessors = 0, threads_per_multiprocessor = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  cudaDeviceGetAttribute(&threads_per_multiprocessor, cudaDevAttrMaxThreadsPerMultiProcessor, device);
  int64_t tiles = 1;
  dispatch_dtype(dtype, [&](auto zero) { tiles = ceil_div(n, int64_t{kTilePacks} * kVecOf<decltype(zero)>); });
  const int64_t resident_blocks = int64_t{multiprocessors} * threads_per_multiprocessor / kStripThreads;
  return std::max<int64_t>(1, std::min(ceil_div(resident_blocks, tiles), ceil_div(rows, kMinStripRows)));
}

// One block per (tile of kTilePacks packs of columns, strip of rows).
dim3 strip_grid(int64_t n, int vec, int64_t strips) {
  return dim3(static_cast<unsigned>(ceil_div(n / vec, kTilePacks)), static_cast<unsigned>(strips));
}

// Runs pass 1, `first_pass(strip_sums, strip_rows)`, which launches a kernel over strip_grid(n, kVec,
// strips). With one strip it writes the answer straight into `sums` (T); otherwise it writes each strip's
// sums into the accumulator-type `workspace` (strips, n), and pass 2 sums those columns into `sums`.
template <typename T, typename FirstPass>
void sum_columns_in_strips(FirstPass first_pass, void* sums, void* workspace, int64_t strips, int64_t rows, int64_t n,
                           cudaStream_t stream) {
  using A = Acc<T>;
  const int64_t strip_rows = ceil_div(rows, strips);
  if (strips == 1) {
    first_pass(static_cast<T*>(sums), strip_rows);
    return;
  }
  A* partial_sums = static_cast<A*>(workspace);
  first_pass(partial_sums, strip_rows);
  dispatch_vector_width<A>(n % kVecOf<A> == 0 && aligned_16(workspace), [&](auto vec) {
    constexpr int kVec = decltype(vec)::value;
    column_sum_kernel<A, kVec, T><<<strip_grid(n, kVec, 1), dim3(kTilePacks, kStripLanes), 0, stream>>>(
        partial_sums, static_cast<T*>(sums), strips, n, strips);
  });
}

void launch_column_sum(DType dtype, const void* matrix, void* sums, void* workspace, int64_t strips, int64_t rows,
                       int64_t n, void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    const auto s = static_cast<cudaStream_t>(stream);
    dispatch_vector_width<T>(n % kVecOf<T> == 0 && aligned_16(matrix), [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      const auto first_pass = [&](auto* strip_sums, int64_t strip_rows) {
        using Out = std::remove_pointer_t<decltype(strip_sums)>;
        column_sum_kernel<T, kVec, Out><<<strip_grid(n, kVec, strips), dim3(kTilePacks, kStripLanes), 0, s>>>(
            static_cast<const T*>(matrix), strip_sums, rows, n, strip_rows);
      };
      sum_columns_in_strips<T>(first_pass, sums, workspace, strips, rows, n, s);
    });
  });
}

void launch_gelu_backward(DType dtype, void* grad, const void* pre_activation, void* grad_bias, void* workspace,
                          int64_t strips, int64_t rows, int64_t n, void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    const auto s = static_cast<cudaStream_t>(stream);
    dispatch_vector_width<T>(n % kVecOf<T> == 0 && aligned_16(grad) && aligned_16(pre_activation), [&](auto vec) {
      constexpr int kVec = decltype(vec)::value;
      const auto first_pass = [&](auto* strip_sums, int64_t strip_rows) {
        using Out = std::remove_pointer_t<decltype(strip_sums)>;
        gelu_backward_kernel<T, kVec, Out><<<strip_grid(n, kVec, strips), dim3(kTilePacks, kStripLanes), 0, s>>>(
            static_cast<T*>(grad), static_cast<const T*>(pre_activation), strip_sums, rows, n, strip_rows);
      };
      sum_columns_in_strips<T>(first_pass, grad_bias, workspace, strips, rows, n, s);
    });
  });
}

}  // namespace kernel_ladder
