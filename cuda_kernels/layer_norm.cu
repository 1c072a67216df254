// LayerNorm in CUDA: forward and backward over the rows of a (rows, n) matrix.
//
// What it computes ("rstd" is the reciprocal standard deviation)
//   forward    mean = sum(x)/n,  rstd = 1/sqrt(sum((x - mean)^2)/n + eps),  y = (x - mean)*rstd*w + b
//   backward   xhat = (x - mean)*rstd,  g = w*dy
//              dx = rstd*(g - mean(g) - xhat*mean(g*xhat))    a reduction along each row
//              dw = sum over rows of dy*xhat,  db = sum over rows of dy    reductions across rows
//
// Kernels, in the order they run
//   layer_norm_forward_kernel           one block per row; the row sits in registers (four 16-byte
//                                       packs per thread): read once, mean, then variance of the centred values
//                                       (exact two-pass, no second read), normalise, write once
//   layer_norm_forward_looped_kernel    rows too long for registers: the same exact two-pass math, but
//                                       each pass (mean, variance, output) re-reads the row, from L2
//                                       when it is still there
//   layer_norm_backward_kernel          a persistent grid: each block walks rows blockIdx.x, + gridDim.x,
//                                       ... holding x, dy in registers; writes dx, and keeps its running
//                                       dw, db in registers, written once as its row of a partial buffer
//   layer_norm_backward_looped_kernel   the same for long rows: two passes over each row, and the
//                                       block's dw, db accumulated in its partial row in global memory
//   layer_norm_weight_grads_kernel      sums the partial rows' columns into dw and db (deterministic)
//
// The one idea that makes it fast
//   Every element crosses DRAM the fewest times the math allows: x read once and y written once
//   forward; x, dy read once and dx written once backward. Reductions happen in registers (warp
//   shuffles) and one small shared-memory pass. Each thread owns the same columns in every row, so the
//   cross-row sums dw, db need neither atomics nor a second pass over x and dy.
//
// Limits
//   Any n >= 1. Rows of up to 16384 half-precision values (8192 float32, 4096 float64) are held in
//   registers forward, 8192 (4096 float64) backward. Longer rows loop: the forward reads them three times, the backward twice (the
//   re-reads come from L2 while the rows in flight fit there). 16-byte loads need n to be a multiple of
//   the pack width (4 float, 8 half, 2 double) and 16-byte-aligned pointers, else 1-element loads.
//   One block per row forward: fewer rows than SMs leave SMs idle. rows < 2^31.
//   float16, bfloat16, float32 (statistics and sums in float32) and float64.
//
// Check
//   nvcc -std=c++17 -O3 -arch=sm_90 -Xptxas -v -c cuda_kernels/layer_norm.cu -o /tmp/layer_norm.o
//   python -m pytest tests -k "layer_norm and cuda"
#include <algorithm>

#include "common.cuh"

namespace kernel_ladder {

// Row values per thread in registers. The forward holds one array: four 16-byte packs of the input a
// thread (16 floats, 32 halves, 8 doubles), in blocks of at most 512 threads (up to 128 registers
// each). Four packs is what the H100 liked for both widths, measured at (8192, 8192): with 64 bytes a
// thread, float32 reached 93.7 % of copy bandwidth and bfloat16 91.4 %; with 128 bytes (twice the
// values, half the threads) bfloat16 rose to 94.4 % and float32 fell to 87.5 %. What matters is the
// number of loads each thread keeps in flight and how many blocks share an SM while others wait in
// their two block reductions (barriers), so the budget is counted in packs, not in values. The backward
// holds four arrays (xhat, g, running dw, db: 8 floats, 4 doubles) in 1024-thread blocks of 64
// registers a thread.
constexpr int kForwardMaxThreads = 512;
template <typename T> constexpr int kForwardValues = 64 / static_cast<int>(sizeof(T));
template <typename A> constexpr int kBackwardValues = 32 / static_cast<int>(sizeof(A));

// g = w * dy, rounded on its own. nvcc would otherwise fuse the product into later additions (an FMA
// keeps it unrounded), and the g in g - mean(g) would differ from the g that was summed: with n = 1
// the exact answer dx = 0 would come out as rounding noise. __fmul_rn is never fused.
__device__ __forceinline__ float product_rounded(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ double product_rounded(double a, double b) { return __dmul_rn(a, b); }

// The two row sums of the backward, reduced together: one trip through shared memory, not two.
template <typename A>
struct RowSums {
  A g, g_xhat;
};

template <typename A>
__device__ __forceinline__ RowSums<A> operator+(RowSums<A> a, RowSums<A> b) { return {a.g + b.g, a.g_xhat + b.g_xhat}; }

// --- forward -------------------------------------------------------------------------------------

// y for one pack of the row from its values in registers; weight and bias are shared by every row and
// stay in L1/L2, so they use ordinary loads, while y is written once (streaming store).
template <typename T, int kVec>
__device__ __forceinline__ void write_normalized_pack(T* y_row, const T* weight, const T* bias, int64_t pack,
                                                      const Acc<T> (&values)[kVec], Acc<T> mean, Acc<T> rstd) {
  const Pack<T, kVec> w = load_pack<T, kVec>(weight + pack * kVec);
  const Pack<T, kVec> b = load_pack<T, kVec>(bias + pack * kVec);
  Pack<T, kVec> out;
#pragma unroll
  for (int j = 0; j < kVec; ++j) out.val[j] = from_acc<T>((values[j] - mean) * rstd * to_acc(w.val[j]) + to_acc(b.val[j]));
  store_pack_once<T, kVec>(y_row + pack * kVec, out);
}

template <typename T, int kVec>
__global__ void __launch_bounds__(kForwardMaxThreads)
layer_norm_forward_kernel(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
                          T* __restrict__ y, Acc<T>* __restrict__ mean_out, Acc<T>* __restrict__ rstd_out,
                          int64_t n, Acc<T> eps) {
  using A = Acc<T>;
  constexpr int kPacks = kForwardValues<T> / kVec;
  const T* x_row = x + static_cast<int64_t>(blockIdx.x) * n;
  const int n_packs = static_cast<int>(n / kVec);  // a row held in registers has at most 16384 values
  // Thread t owns packs t, t + blockDim.x, ...: at each step a warp reads 32 adjacent packs (coalesced).
  // Indices into `values` are compile-time constants after unrolling, so the array stays in registers.
  A values[kPacks][kVec];
  A sum = 0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = threadIdx.x + k * blockDim.x;
    Pack<T, kVec> in;
    if (pack < n_packs) in = load_pack_once<T, kVec>(x_row + pack * kVec);  // x is read exactly once
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      values[k][j] = pack < n_packs ? to_acc(in.val[j]) : A(0);
      sum += values[k][j];
    }
  }
  const A mean = block_sum(sum) / A(n);
  // Variance of the centred values from registers: as exact as two passes, for the price of one read.
  A squares = 0;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = threadIdx.x + k * blockDim.x;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      const A centred = pack < n_packs ? values[k][j] - mean : A(0);
      squares += centred * centred;
    }
  }
  const A rstd = rsqrt(block_sum(squares) / A(n) + eps);
  if (threadIdx.x == 0) {
    mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = threadIdx.x + k * blockDim.x;
    if (pack < n_packs) write_normalized_pack<T, kVec>(y + static_cast<int64_t>(blockIdx.x) * n, weight, bias, pack, values[k], mean, rstd);
  }
}

// Rows longer than the registers hold: the register kernel's math, with the row read once per pass.
// Plain (caching) loads: the next pass wants the row still in L2.
template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxThreads)
layer_norm_forward_looped_kernel(const T* __restrict__ x, const T* __restrict__ weight, const T* __restrict__ bias,
                                 T* __restrict__ y, Acc<T>* __restrict__ mean_out, Acc<T>* __restrict__ rstd_out,
                                 int64_t n, Acc<T> eps) {
  using A = Acc<T>;
  const T* x_row = x + static_cast<int64_t>(blockIdx.x) * n;
  const int64_t n_packs = n / kVec;
  A sum = 0;
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load_pack<T, kVec>(x_row + pack * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) sum += to_acc(in.val[j]);
  }
  const A mean = block_sum(sum) / A(n);
  A squares = 0;
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load_pack<T, kVec>(x_row + pack * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) squares += (to_acc(in.val[j]) - mean) * (to_acc(in.val[j]) - mean);
  }
  const A rstd = rsqrt(block_sum(squares) / A(n) + eps);
  if (threadIdx.x == 0) {
    mean_out[blockIdx.x] = mean;
    rstd_out[blockIdx.x] = rstd;
  }
  for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load_pack<T, kVec>(x_row + pack * kVec);
    A values[kVec];
#pragma unroll
    for (int j = 0; j < kVec; ++j) values[j] = to_acc(in.val[j]);
    write_normalized_pack<T, kVec>(y + static_cast<int64_t>(blockIdx.x) * n, weight, bias, pack, values, mean, rstd);
  }
}

// --- backward ------------------------------------------------------------------------------------

template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxThreads)
layer_norm_backward_kernel(const T* __restrict__ grad_out, const T* __restrict__ x, const T* __restrict__ weight,
                           const Acc<T>* __restrict__ mean, const Acc<T>* __restrict__ rstd, T* __restrict__ grad_x,
                           Acc<T>* __restrict__ partial_dw, Acc<T>* __restrict__ partial_db, int64_t rows, int64_t n) {
  using A = Acc<T>;
  constexpr int kPacks = kBackwardValues<A> / kVec;
  const int n_packs = static_cast<int>(n / kVec);  // a row held in registers has at most 8192 values
  // This thread's columns are the same in every row, so its share of dw and db lives in registers
  // across all the rows of the block.
  A dw[kPacks][kVec] = {};
  A db[kPacks][kVec] = {};
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const A row_mean = mean[row], row_rstd = rstd[row];
    const T* dy_row = grad_out + row * n;
    const T* x_row = x + row * n;
    A xhat[kPacks][kVec], g[kPacks][kVec];
    RowSums<A> sums{};
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int pack = threadIdx.x + k * blockDim.x;
      if (pack >= n_packs) continue;
      const Pack<T, kVec> dy = load_pack_once<T, kVec>(dy_row + pack * kVec);
      const Pack<T, kVec> in = load_pack_once<T, kVec>(x_row + pack * kVec);
      const Pack<T, kVec> w = load_pack<T, kVec>(weight + pack * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const A dy_j = to_acc(dy.val[j]);
        xhat[k][j] = (to_acc(in.val[j]) - row_mean) * row_rstd;
        g[k][j] = product_rounded(to_acc(w.val[j]), dy_j);
        dw[k][j] += dy_j * xhat[k][j];
        db[k][j] += dy_j;
        sums = sums + RowSums<A>{g[k][j], g[k][j] * xhat[k][j]};
      }
    }
    sums = block_reduce(sums, Add{});
    const A mean_g = sums.g / A(n), mean_g_xhat = sums.g_xhat / A(n);
    T* dx_row = grad_x + row * n;
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int pack = threadIdx.x + k * blockDim.x;
      if (pack >= n_packs) continue;
      Pack<T, kVec> out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) out.val[j] = from_acc<T>(row_rstd * (g[k][j] - mean_g - xhat[k][j] * mean_g_xhat));
      store_pack_once<T, kVec>(dx_row + pack * kVec, out);
    }
  }
  // This block's partial sums: one row of each buffer, written once, read by the column reduction.
  A* block_dw = partial_dw + blockIdx.x * n;
  A* block_db = partial_db + blockIdx.x * n;
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = threadIdx.x + k * blockDim.x;
    if (pack >= n_packs) continue;
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      block_dw[pack * kVec + j] = dw[k][j];
      block_db[pack * kVec + j] = db[k][j];
    }
  }
}

// Rows longer than the registers hold. Pass 1 reads x, dy and w for the two row sums; pass 2 reads them
// again (from L2 when the row fits there), writes dx, and adds dy*xhat and dy into this block's partial
// row. No other block touches that row, and no other thread of the block touches these columns.
template <typename T, int kVec>
__global__ void __launch_bounds__(kMaxThreads)
layer_norm_backward_looped_kernel(const T* __restrict__ grad_out, const T* __restrict__ x, const T* __restrict__ weight,
                                  const Acc<T>* __restrict__ mean, const Acc<T>* __restrict__ rstd,
                                  T* __restrict__ grad_x, Acc<T>* __restrict__ partial_dw,
                                  Acc<T>* __restrict__ partial_db, int64_t rows, int64_t n) {
  using A = Acc<T>;
  const int64_t n_packs = n / kVec;
  A* block_dw = partial_dw + blockIdx.x * n;
  A* block_db = partial_db + blockIdx.x * n;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const A row_mean = mean[row], row_rstd = rstd[row];
    const T* dy_row = grad_out + row * n;
    const T* x_row = x + row * n;
    RowSums<A> sums{};
    for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
      const Pack<T, kVec> dy = load_pack<T, kVec>(dy_row + pack * kVec);
      const Pack<T, kVec> in = load_pack<T, kVec>(x_row + pack * kVec);
      const Pack<T, kVec> w = load_pack<T, kVec>(weight + pack * kVec);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const A g = product_rounded(to_acc(w.val[j]), to_acc(dy.val[j]));
        sums = sums + RowSums<A>{g, g * (to_acc(in.val[j]) - row_mean) * row_rstd};
      }
    }
    sums = block_reduce(sums, Add{});
    const A mean_g = sums.g / A(n), mean_g_xhat = sums.g_xhat / A(n);
    const bool first_row_of_block = row == blockIdx.x;  // the partial row starts from 0, not from garbage
    for (int64_t pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
      const Pack<T, kVec> dy = load_pack<T, kVec>(dy_row + pack * kVec);
      const Pack<T, kVec> in = load_pack<T, kVec>(x_row + pack * kVec);
      const Pack<T, kVec> w = load_pack<T, kVec>(weight + pack * kVec);
      Pack<T, kVec> out;
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const int64_t column = pack * kVec + j;
        const A dy_j = to_acc(dy.val[j]);
        const A xhat = (to_acc(in.val[j]) - row_mean) * row_rstd;
        out.val[j] = from_acc<T>(row_rstd * (product_rounded(to_acc(w.val[j]), dy_j) - mean_g - xhat * mean_g_xhat));
        block_dw[column] = (first_row_of_block ? A(0) : block_dw[column]) + dy_j * xhat;
        block_db[column] = (first_row_of_block ? A(0) : block_db[column]) + dy_j;
      }
      store_pack_once<T, kVec>(grad_x + row * n + pack * kVec, out);
    }
  }
}

// dw, db = column sums of the (partial_rows, n) buffers. A 32 x 32 block owns 32 adjacent columns:
// each warp (fixed threadIdx.y) reads 32 adjacent values of one partial row (one 128-byte line in
// float32) and walks down every 32nd row; then the 32 per-warp sums of each column meet in shared memory.
constexpr int kColumnTile = 32;

template <typename T>
__global__ void __launch_bounds__(kColumnTile * kColumnTile)
layer_norm_weight_grads_kernel(const Acc<T>* __restrict__ partial_dw, const Acc<T>* __restrict__ partial_db,
                               int64_t partial_rows, int64_t n, T* __restrict__ grad_weight, T* __restrict__ grad_bias) {
  using A = Acc<T>;
  __shared__ A dw_tile[kColumnTile][kColumnTile];
  __shared__ A db_tile[kColumnTile][kColumnTile];
  const int64_t column = static_cast<int64_t>(blockIdx.x) * kColumnTile + threadIdx.x;
  A dw = 0, db = 0;
  if (column < n) {
    for (int64_t r = threadIdx.y; r < partial_rows; r += kColumnTile) {
      dw += partial_dw[r * n + column];
      db += partial_db[r * n + column];
    }
  }
  dw_tile[threadIdx.y][threadIdx.x] = dw;
  db_tile[threadIdx.y][threadIdx.x] = db;
  __syncthreads();
  if (threadIdx.y == 0 && column < n) {
    // A fixed order of additions: the same inputs give the same bits on every run.
    for (int i = 1; i < kColumnTile; ++i) {
      dw += dw_tile[i][threadIdx.x];
      db += db_tile[i][threadIdx.x];
    }
    grad_weight[column] = from_acc<T>(dw);
    grad_bias[column] = from_acc<T>(db);
  }
}

// --- launchers -----------------------------------------------------------------------------------
// The register kernel and its looped twin take the same arguments, so a launcher picks a kernel pointer
// and a block size, then launches once.

template <typename T, int kVec>
auto forward_kernel_for(int64_t n, int* threads) {
  const bool in_registers = n <= int64_t{kForwardMaxThreads} * kForwardValues<T>;
  *threads = in_registers ? row_threads(n, kForwardValues<T>) : kMaxThreads;
  return in_registers ? layer_norm_forward_kernel<T, kVec> : layer_norm_forward_looped_kernel<T, kVec>;
}

template <typename T, int kVec>
auto backward_kernel_for(int64_t n, int* threads) {
  using A = Acc<T>;
  const bool in_registers = n <= int64_t{kMaxThreads} * kBackwardValues<A>;
  *threads = in_registers ? row_threads(n, kBackwardValues<A>) : kMaxThreads;
  return in_registers ? layer_norm_backward_kernel<T, kVec> : layer_norm_backward_looped_kernel<T, kVec>;
}

void launch_layer_norm_forward(DType dtype, const void* x, const void* weight, const void* bias, void* y,
                               void* mean, void* rstd, int64_t rows, int64_t n, double eps, void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    using A = Acc<T>;
    const bool vectorise = n % kVecOf<T> == 0 && aligned_16(x) && aligned_16(weight) && aligned_16(bias) && aligned_16(y);
    dispatch_vector_width<T>(vectorise, [&](auto vec) {
      int threads = 0;
      const auto kernel = forward_kernel_for<T, decltype(vec)::value>(n, &threads);
      // One block per row: a row's reductions never leave its block.
      kernel<<<static_cast<unsigned>(rows), threads, 0, static_cast<cudaStream_t>(stream)>>>(
          static_cast<const T*>(x), static_cast<const T*>(weight), static_cast<const T*>(bias), static_cast<T*>(y),
          static_cast<A*>(mean), static_cast<A*>(rstd), n, static_cast<A>(eps));
    });
  });
}

int64_t layer_norm_backward_partial_rows(DType dtype, int64_t rows, int64_t n) {
  // As many blocks as are resident at once: each then walks its rows without waiting for a second wave,
  // and the partial buffer has no more rows than the GPU has blocks in flight.
  int blocks_per_sm = 0;
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    int threads = 0;
    const auto kernel = backward_kernel_for<T, kVecOf<T>>(n, &threads);
    cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks_per_sm, kernel, threads, 0);
  });
  int device = 0, multiprocessors = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&multiprocessors, cudaDevAttrMultiProcessorCount, device);
  return std::min<int64_t>(rows, int64_t{std::max(blocks_per_sm, 1)} * std::max(multiprocessors, 1));
}

void launch_layer_norm_backward(DType dtype, const void* grad_out, const void* x, const void* weight,
                                const void* mean, const void* rstd, void* grad_x, void* grad_weight,
                                void* grad_bias, void* workspace, int64_t partial_rows, int64_t rows,
                                int64_t n, void* stream) {
  dispatch_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    using A = Acc<T>;
    const auto s = static_cast<cudaStream_t>(stream);
    A* partial_dw = static_cast<A*>(workspace);
    A* partial_db = partial_dw + partial_rows * n;
    const bool vectorise = n % kVecOf<T> == 0 && aligned_16(grad_out) && aligned_16(x) && aligned_16(weight) &&
                           aligned_16(grad_x);
    dispatch_vector_width<T>(vectorise, [&](auto vec) {
      int threads = 0;
      const auto kernel = backward_kernel_for<T, decltype(vec)::value>(n, &threads);
      kernel<<<static_cast<unsigned>(partial_rows), threads, 0, s>>>(
          static_cast<const T*>(grad_out), static_cast<const T*>(x), static_cast<const T*>(weight),
          static_cast<const A*>(mean), static_cast<const A*>(rstd), static_cast<T*>(grad_x), partial_dw, partial_db,
          rows, n);
    });
    const dim3 tile(kColumnTile, kColumnTile);
    layer_norm_weight_grads_kernel<T><<<static_cast<unsigned>(ceil_div(n, kColumnTile)), tile, 0, s>>>(
        partial_dw, partial_db, partial_rows, n, static_cast<T*>(grad_weight), static_cast<T*>(grad_bias));
  });
}

}  // namespace kernel_ladder
