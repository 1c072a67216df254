// What every level-5 CUDA kernel shares: the accumulator type, 16-byte packs, conversions, warp and
// block reductions, and the dtype switch that turns a runtime DType into a template argument.
// Pure CUDA (no torch headers), so each .cu file that includes it compiles on its own with nvcc -c.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "kernels.h"

namespace kernel_ladder {

constexpr int kWarpSize = 32;
constexpr int kMaxThreads = 1024;  // the most threads a block may have on every GPU since 2010

// --- accumulator type ----------------------------------------------------------------------------
// Every sum and every product is done in float, also for half-precision inputs: float16 has an
// 11-bit mantissa, so a sum of a few thousand values in it would already be off in the third digit.
// Float64 inputs keep float64 all the way.
template <typename T> struct AccumulatorOf { using type = float; };
template <> struct AccumulatorOf<double> { using type = double; };
template <typename T> using Acc = typename AccumulatorOf<T>::type;

__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }
__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T> __device__ __forceinline__ T from_acc(Acc<T> v) { return static_cast<T>(v); }
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// --- 16-byte packs -------------------------------------------------------------------------------
// A warp's memory request is served in 32-byte sectors. One 16-byte load per thread (LDG.E.128)
// asks for 512 contiguous bytes per warp instruction: 4x fewer instructions than float loads, and more
// bytes in flight per thread, which is what keeps HBM busy. kVec = 1 is the scalar fallback.
template <typename T> constexpr int kVecOf = 16 / static_cast<int>(sizeof(T));  // 4 float, 8 half, 2 double

template <typename T, int kVec>
struct alignas(sizeof(T) * kVec) Pack {
  T val[kVec];
};

template <int kBytes> struct BitsOfSize;
template <> struct BitsOfSize<16> { using type = int4; };
template <> struct BitsOfSize<8> { using type = int2; };
template <> struct BitsOfSize<4> { using type = int; };
template <> struct BitsOfSize<2> { using type = unsigned short; };

template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, kVec>*>(p);
}

template <typename T, int kVec>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, kVec>& pack) {
  *reinterpret_cast<Pack<T, kVec>*>(p) = pack;
}

// For data touched exactly once: the .cs ("cache streaming", evict-first) hint keeps the stream from
// pushing reused data (LayerNorm's weight and bias) out of L1 and L2.
template <typename T, int kVec>
__device__ __forceinline__ Pack<T, kVec> load_pack_once(const T* p) {
  using Bits = typename BitsOfSize<sizeof(Pack<T, kVec>)>::type;
  const Bits bits = __ldcs(reinterpret_cast<const Bits*>(p));
  Pack<T, kVec> pack;
  memcpy(&pack, &bits, sizeof(pack));
  return pack;
}

template <typename T, int kVec>
__device__ __forceinline__ void store_pack_once(T* p, const Pack<T, kVec>& pack) {
  using Bits = typename BitsOfSize<sizeof(Pack<T, kVec>)>::type;
  Bits bits;
  memcpy(&bits, &pack, sizeof(pack));
  __stcs(reinterpret_cast<Bits*>(p), bits);
}

// A 16-byte load from an address that is not a multiple of 16 faults, so the launchers check every
// pointer (a tensor view can start anywhere) and fall back to kVec = 1.
inline bool aligned_16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

__host__ __device__ inline int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// The SMs of the current GPU: how many blocks it takes to keep every one of them busy.
inline int multiprocessor_count() {
  int device = 0, count = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device);
  return count;
}

// make() once per (current device, key...) at each call site, then its value from a table. For host plans
// built on occupancy queries: each query is a driver call of microseconds, and a training step asks
// the same few shapes of the same kernels on every call, where a small kernel runs in fewer. (Each
// call site's lambda is a type of its own, so each gets its own table; the lock makes it safe from
// autograd's device threads.)
template <typename Make, typename... Key>
auto memoised_per_device(const Make& make, Key... key) -> decltype(make()) {
  using Value = decltype(make());
  static std::mutex mutex;
  static std::map<std::tuple<int, Key...>, Value> table;
  int device = 0;
  cudaGetDevice(&device);
  const std::tuple<int, Key...> full_key{device, key...};
  {
    const std::lock_guard<std::mutex> lock(mutex);
    const auto found = table.find(full_key);
    if (found != table.end()) return found->second;
  }
  const Value value = make();  // outside the lock: two threads may both make it, and agree
  const std::lock_guard<std::mutex> lock(mutex);
  return table.emplace(full_key, value).first->second;
}

// One block per row: enough warps that `values_per_thread` values each cover the row
// (n <= 1024 * values_per_thread).
inline int row_threads(int64_t n, int values_per_thread) {
  return static_cast<int>(ceil_div(ceil_div(n, values_per_thread), kWarpSize) * kWarpSize);
}

// --- row strategies shared by the row-wise kernels (softmax.cu, layer_norm.cu, layer_norm_long_rows.cuh)
// Short rows: a group of kLanes lanes per row, 128 bytes of the row per lane in registers (32 floats,
// 16 doubles); a warp takes 32 / kLanes rows, a block kWarpsPerBlock warps.
template <typename A> constexpr int kLaneRowValues = 128 / static_cast<int>(sizeof(A));
constexpr int kWarpsPerBlock = 4;  // 128-thread blocks

// Calls fn(std::integral_constant<int, kLanes>{}) with the fewest lanes (a power of two) whose
// registers hold a row of n values, kLaneRowValues each.
template <typename A, typename Fn>
void dispatch_lanes_per_row(int64_t n, Fn&& fn) {
  const int64_t lanes = ceil_div(n, kLaneRowValues<A>);
  if (lanes <= 1) fn(std::integral_constant<int, 1>{});
  else if (lanes <= 2) fn(std::integral_constant<int, 2>{});
  else if (lanes <= 4) fn(std::integral_constant<int, 4>{});
  else if (lanes <= 8) fn(std::integral_constant<int, 8>{});
  else if (lanes <= 16) fn(std::integral_constant<int, 16>{});
  else fn(std::integral_constant<int, 32>{});
}

// Where a thread sits in the short-row layout: the first row of its warp, its own row (one per group
// of kLanes lanes) and its lane in that group. A kernel returns when first_row_of_warp is past the last
// row (the whole warp leaves, so no shuffle waits for it); lanes of a warp's last rows that do not
// exist stay for the shuffles, which take the whole warp, but read and write nothing.
template <int kLanes>
struct LaneGroupRow {
  static constexpr int kRowsPerWarp = kWarpSize / kLanes;
  static constexpr int64_t kRowsPerBlock = int64_t{kWarpsPerBlock} * kRowsPerWarp;
  int64_t first_row_of_warp;
  int64_t row;
  int lane;
  __device__ LaneGroupRow()
      : first_row_of_warp((int64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / kWarpSize) * kRowsPerWarp),
        row(first_row_of_warp + threadIdx.x % kWarpSize / kLanes),
        lane(static_cast<int>(threadIdx.x) % kLanes) {}
  // Blocks of kWarpsPerBlock warps that cover `rows` rows.
  static unsigned blocks(int64_t rows) { return static_cast<unsigned>(ceil_div(rows, kRowsPerBlock)); }
};

// load_row_packs' loader for a row read from global memory once (load_pack_once: streaming, no L1 allocation).
template <typename T, int kVec>
__device__ __forceinline__ auto read_once_from(const T* x_row) {
  return [x_row](int pack) { return load_pack_once<T, kVec>(x_row + pack * kVec); };
}

// A thread's part of a row held in registers, as accumulator values: packs first, first + stride, ... (a
// lane of a group in the short-row layout, stride kLanes, so the group reads kLanes adjacent packs at each
// step; a thread of a block holding the row, stride blockDim.x), each from load(pack) (x read once from
// global memory, or a row staged in shared memory), and `pad` stands where a pack lies past the row, or
// the row past the last; `fold` sees each value as it lands (a sum, a max).
// kLoadsFirst: every load is issued before the first value is used, so that a thread's kPacks loads are in
// flight together and the row's memory latency is paid once. Loaded and used pack by pack, the warp
// kernels' warps waited far longer on their loads than level 4's kernel (ncu) and short float32 rows moved
// less of copy bandwidth (profiling/results/h100/level5-trailing-rows-ncu.md); so did LayerNorm's float32
// rows held by a block (profiling/results/h200/norm-forward-probes.md). Not everywhere: that block kernel's
// 16-bit RMSNorm got slower with its loads first, and other instances of it spend more registers on them, so
// it asks for the order only where it was measured to help (layer_norm.cu).
template <typename T, int kVec, int kPacks, bool kLoadsFirst = true, typename Load, typename Fold>
__device__ __forceinline__ void load_row_packs(Acc<T> (&values)[kPacks][kVec], Load&& load, int first, int stride,
                                               int n_packs, bool row_exists, Acc<T> pad, Fold&& fold) {
  Pack<T, kVec> loaded[kLoadsFirst ? kPacks : 1];
  if constexpr (kLoadsFirst) {
#pragma unroll
    for (int k = 0; k < kPacks; ++k) {
      const int pack = first + k * stride;
      if (row_exists && pack < n_packs) loaded[k] = load(pack);
    }
  }
#pragma unroll
  for (int k = 0; k < kPacks; ++k) {
    const int pack = first + k * stride;
    const bool inside = row_exists && pack < n_packs;
    Pack<T, kVec> in;
    if constexpr (kLoadsFirst) {
      in = loaded[k];
    } else if (inside) {
      in = load(pack);
    }
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      values[k][j] = inside ? to_acc(in.val[j]) : pad;
      fold(values[k][j]);
    }
  }
}

// The most of a row one block stages in shared memory: 64 KB leaves room for 3 blocks an SM, so one
// block's copies fly while another reduces and a third writes. A cluster of up to kMaxClusterBlocks
// blocks (Hopper's largest; beyond 8 is "non-portable", opted into) holds a row of 16 such slices.
constexpr int64_t kSharedRowBytes = 64 * 1024;
constexpr int kMaxClusterBlocks = 16;
// Split rows: enough blocks for 4 per SM, each slice at least 64 KB so a block's fixed cost is small.
constexpr int kSplitBlocksPerSM = 4;
constexpr int64_t kMinSliceBytes = 64 * 1024;

// How many slices each of `rows` rows of row_bytes is split into (1: none). Only rows longer than one
// block or one cluster holds on chip (held_on_chip bytes, in shared memory or registers) are split, into
// enough slices for kSplitBlocksPerSM blocks an SM over all rows, none under kMinSliceBytes.
inline int64_t row_splits(int64_t rows, int64_t row_bytes, int64_t held_on_chip) {
  if (row_bytes <= held_on_chip) return 1;
  const int64_t wanted = ceil_div(int64_t{kSplitBlocksPerSM} * multiprocessor_count(), rows);
  return std::max<int64_t>(1, std::min(wanted, row_bytes / kMinSliceBytes));
}

// Whether `kernel` was loaded from an sm_90 (or later) image, and so may use clusters and distributed
// shared memory: cudaFuncGetAttributes reports the image this device loaded, so an older build or GPU
// answers false and the launcher takes another kernel. Callers cache the answer (a static).
template <typename Kernel>
bool compiled_for_clusters(Kernel kernel) {
  cudaFuncAttributes attributes;
  if (cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) return false;
  return attributes.ptxVersion >= 90 && attributes.binaryVersion >= 90;
}

// The most dynamic shared memory a block of `kernel` may ask for on the current GPU: the per-block opt-in
// limit (227 KB on Hopper, 163 KB on an A100, 99 KB on most consumer GPUs) less the kernel's own static
// shared memory (block_reduce's, say), which a launch must fit beside it. Driver queries, asked once per
// device and kernel; 0 if one fails (its error cleared, so the next launch's check does not report it).
template <typename... Params>
int64_t dynamic_shared_bytes_limit(void (*kernel)(Params...)) {
  return memoised_per_device(
      [kernel] {
        int device = 0, per_block = 0;
        cudaFuncAttributes attributes;
        if (cudaGetDevice(&device) != cudaSuccess ||
            cudaDeviceGetAttribute(&per_block, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) != cudaSuccess ||
            cudaFuncGetAttributes(&attributes, kernel) != cudaSuccess) {
          cudaGetLastError();
          return int64_t{0};
        }
        return per_block - static_cast<int64_t>(attributes.sharedSizeBytes);
      },
      reinterpret_cast<const void*>(kernel));
}

// Clusters of 9 to 16 blocks are "non-portable", and dynamic shared memory beyond 48 KB must be asked
// for: both per kernel and per device, so before every launch or occupancy query.
template <typename... Params>
void allow_clusters(void (*kernel)(Params...), int shared_bytes) {
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, shared_bytes);
  cudaFuncSetAttribute(kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
}

// `blocks` blocks of `threads`, each with shared_bytes of dynamic shared memory, launched with one
// `attribute` (a cluster shape, cooperation), which must outlive the configuration.
inline cudaLaunchConfig_t launch_config(cudaLaunchAttribute* attribute, int64_t blocks, int threads, int shared_bytes,
                                        cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(static_cast<unsigned>(blocks));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.dynamicSmemBytes = static_cast<size_t>(shared_bytes);
  config.stream = stream;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

// The same, in clusters of cluster_blocks (1-D, up to 16); `shape` is the attribute.
inline cudaLaunchConfig_t cluster_launch_config(cudaLaunchAttribute* shape, int64_t blocks, int cluster_blocks,
                                                int threads, int shared_bytes, cudaStream_t stream) {
  shape->id = cudaLaunchAttributeClusterDimension;
  shape->val.clusterDim.x = static_cast<unsigned>(cluster_blocks);
  shape->val.clusterDim.y = 1;
  shape->val.clusterDim.z = 1;
  return launch_config(shape, blocks, threads, shared_bytes, stream);
}

// Launches kernel(args...) on `blocks` blocks of `threads` in clusters of cluster_blocks.
template <typename... Params, typename... Args>
void launch_in_clusters(void (*kernel)(Params...), int64_t blocks, int cluster_blocks, int threads, int shared_bytes,
                        cudaStream_t stream, Args... args) {
  allow_clusters(kernel, shared_bytes);
  cudaLaunchAttribute shape;
  const cudaLaunchConfig_t config =
      cluster_launch_config(&shape, blocks, cluster_blocks, threads, shared_bytes, stream);
  cudaLaunchKernelEx(&config, kernel, static_cast<Params>(args)...);
}

// How many clusters of cluster_blocks blocks the GPU runs at once: a persistent grid launches that many.
// A cluster's blocks must share one GPC (a group of up to 18 SMs on the H100), so this is not the
// blocks an SM holds x SMs / cluster_blocks: what a GPC has left over beyond whole clusters stays idle.
// 0 when the query fails; its error is cleared, since no launch failed.
template <typename... Params>
int resident_clusters(void (*kernel)(Params...), int cluster_blocks, int threads, int shared_bytes) {
  allow_clusters(kernel, shared_bytes);
  cudaLaunchAttribute shape;
  const cudaLaunchConfig_t config =
      cluster_launch_config(&shape, cluster_blocks, cluster_blocks, threads, shared_bytes, nullptr);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return clusters;
}

// 2^x on the special-function unit (MUFU.EX2), one instruction; 2^-inf = 0. `.ftz` flushes results below
// 2^-126 to zero. Without it (plain ex2.approx.f32, which __expf emits when nvcc runs without
// --use_fast_math, as ours does) the compiler wraps the MUFU in a compare, two predicated multiplies and
// so four instructions, to produce subnormal results no softmax or gradient here can tell from zero.
// Instructions count in a memory-bound kernel too: an SM issues 4 x 32 lane-instructions a clock and, at
// copy speed, receives 12 (H100) to 16 (H200) bytes a clock, so a bfloat16 kernel that reads and writes
// each value (4 bytes) has 32 to 43 instructions a value to spend, and a softmax spends two exps a value.
// The attention kernels fold log2(e) into the score scale, so exp(s) = 2^(s * log2 e) costs no multiply.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// exp in the accumulator type: 2^(v log2 e) (exp2_approx), a few ulp, without the ~20 instructions and
// slow-path branch of IEEE expf. Float64 keeps exp.
__device__ __forceinline__ float exp_acc(float v) { return exp2_approx(v * kLog2e); }
__device__ __forceinline__ double exp_acc(double v) { return exp(v); }

// --- asynchronous copies (cp.async, sm_80+) -------------------------------------------------------
// The copy engine moves global memory into shared memory without holding registers, so the warps
// compute on one tile (or row) while the next is in flight. `.cg` bypasses L1: what is copied is read
// from global memory once per block.

__device__ __forceinline__ uint32_t shared_address(const void* pointer) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(pointer));
}

// 16 bytes; with valid == false the source is not read and the destination is zero-filled.
__device__ __forceinline__ void copy_async_16(void* shared, const void* global, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)), "l"(global),
               "r"(valid ? 16 : 0));
}

__device__ __forceinline__ void copy_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }

// Wait until at most kPending of this thread's committed groups are still in flight.
template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending));
}

// An L2 cache policy for data read from global memory exactly once: its lines go first when L2 needs
// room. A row staged in shared memory is such data; without the hint its lines push out what other
// blocks read again. LayerNorm's weight and bias are as long as a row and read once per row: at rows of
// 2^21 float32 values they are 16 MB, the rows in flight stream several times that through L2 between
// two reads of the same weights, and with every line at the same priority the weights come back from
// DRAM: three tensors read where one was meant (y is already written evict-first: store_pack_once).
// Measured: profiling/results/h100/evict-first-staging.md.
__device__ __forceinline__ uint64_t evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}

// copy_async_16 for a source read once (evict_first_policy), always valid.
__device__ __forceinline__ void copy_async_16_once(void* shared, const void* global, uint64_t policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(shared_address(shared)),
               "l"(global), "l"(policy));
}

// Copies a slice of n_packs 16-byte packs, read once, from global into shared memory and waits for it.
// Each thread copies (and its caller later reads) only its own packs t, t + blockDim.x, ..., so its own
// wait is all the ordering it needs: no barrier. Nothing is held in registers while the copies fly.
template <typename T>
__device__ __forceinline__ void stage_slice(const T* global_slice, T* staged, int n_packs) {
  constexpr int kVec = 16 / static_cast<int>(sizeof(T));
  const uint64_t policy = evict_first_policy();
  for (int pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    copy_async_16_once(staged + pack * kVec, global_slice + pack * kVec, policy);
  }
  copy_async_commit();
  copy_async_wait<0>();
}

// --- reductions ----------------------------------------------------------------------------------
// Any trivially copyable value made of 4-byte words (a float, a double, a struct of them) can cross
// lanes: __shfl_xor_sync moves one 32-bit register between the 32 lanes of a warp without touching
// shared memory, so the value is moved word by word.
template <typename T>
__device__ __forceinline__ T shuffle_xor(T value, int lane_mask) {
  static_assert(sizeof(T) % 4 == 0, "shuffle_xor moves 4-byte words");
  int words[sizeof(T) / 4];
  memcpy(words, &value, sizeof(T));
#pragma unroll
  for (int i = 0; i < static_cast<int>(sizeof(T) / 4); ++i) words[i] = __shfl_xor_sync(0xffffffffu, words[i], lane_mask);
  memcpy(&value, words, sizeof(T));
  return value;
}

// Butterfly: after 5 exchanges every lane holds the combination of all 32 lanes. With kLanes < 32,
// each aligned group of kLanes lanes (a power of two) combines only its own values: the exchanges
// with lane masks below kLanes never leave the group.
template <int kLanes = kWarpSize, typename T, typename Combine>
__device__ __forceinline__ T warp_reduce(T value, Combine combine) {
#pragma unroll
  for (int mask = kLanes / 2; mask > 0; mask /= 2) value = combine(value, shuffle_xor(value, mask));
  return value;
}

// Combine one value per thread across the block; every thread gets the result. blockDim.x must be a
// multiple of 32, and T{} must be the identity of `combine` (0 for sums). Warps reduce in registers,
// then one value per warp crosses shared memory, and every warp reduces those itself: two barriers,
// no third one to broadcast the answer.
template <typename T, typename Combine>
__device__ __forceinline__ T block_reduce(T value, Combine combine) {
  __shared__ T warp_results[kMaxThreads / kWarpSize];
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  value = warp_reduce(value, combine);
  __syncthreads();  // a previous call's readers are done with warp_results
  if (lane == 0) warp_results[warp] = value;
  __syncthreads();
  value = lane < static_cast<int>(blockDim.x / kWarpSize) ? warp_results[lane] : T{};
  return warp_reduce(value, combine);
}

struct Add {
  template <typename T> __device__ __forceinline__ T operator()(T a, T b) const { return a + b; }
};

template <typename A>
__device__ __forceinline__ A block_sum(A value) { return block_reduce(value, Add{}); }

// --- a row held by a thread-block cluster (Hopper, sm_90+: softmax.cu, layer_norm*.cu*) ----------------
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// One cluster per row (a 1-D grid of rows x cluster size blocks): block `rank` of a cluster owns slice
// `rank` of slice_packs packs of kVec values, n_packs of them inside the row, starting `offset` values
// into x. In a persistent grid of clusters (layer_norm_backward.cu), `row` is the cluster's index and
// first row, and the block owns the same slice of every row the cluster walks.
struct ClusterSlice {
  int rank;
  int64_t row;
  int64_t first_pack;
  int n_packs;
  int64_t offset;
};

template <int kVec>
__device__ __forceinline__ ClusterSlice cluster_slice(int64_t n, int64_t slice_packs) {
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  const int rank = static_cast<int>(cluster.block_rank());
  const int64_t row = int64_t{blockIdx.x} / cluster.num_blocks(), first_pack = rank * slice_packs;
  return {rank, row, first_pack, static_cast<int>(min(slice_packs, n / kVec - first_pack)), row * n + first_pack * kVec};
}

// Every block's `mine` combined across the cluster; every thread gets the result. The first barrier
// makes each block's `statistic` (a __shared__ slot of its kernel) readable by the others through
// distributed shared memory (SM to SM, not through L2 or HBM); each warp reads the cluster's values,
// one a lane, and merges them. The second barrier keeps every block, and so its shared memory, alive
// until all have read. T{} must be the identity of `combine` (lanes past the cluster's size hold it).
template <typename T, typename Combine>
__device__ __forceinline__ T cluster_reduce(T* statistic, T mine, Combine combine) {
  const cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
  if (threadIdx.x == 0) *statistic = mine;
  cluster.sync();
  const int lane = static_cast<int>(threadIdx.x) % kWarpSize;
  T theirs{};
  if (lane < static_cast<int>(cluster.num_blocks())) theirs = *cluster.map_shared_rank(statistic, lane);
  const T total = warp_reduce(theirs, combine);
  cluster.sync();
  return total;
}
#endif

// --- the online softmax's statistics (softmax.cu, linear_cross_entropy.cu) ----------------------------
// A row's statistics: the largest value seen and the sum of exp(value - max). Pairs merge exactly,
// (m, s) + (m', s') = (M, s e^(m - M) + s' e^(m' - M)) with M = max(m, m'), so a row's max and sum
// cross a warp or a block in one reduction, and a row of any length streams through in one pass. The
// defaults are the identity of `merge` (block_reduce pads with T{}).
template <typename A>
struct MaxSum {
  A max = -INFINITY;
  A sum = 0;
};

template <typename A>
__device__ __forceinline__ MaxSum<A> merge(MaxSum<A> a, MaxSum<A> b) {
  const A max = a.max > b.max ? a.max : b.max;
  if (max == A(-INFINITY)) return a;  // both empty: exp(-inf - -inf) would be NaN
  return {max, a.sum * exp_acc(a.max - max) + b.sum * exp_acc(b.max - max)};
}

struct Merge {
  template <typename A> __device__ __forceinline__ MaxSum<A> operator()(MaxSum<A> a, MaxSum<A> b) const { return merge(a, b); }
};

// The statistics of one 16-byte pack: its max, then the sum of exp(value - max) (the identity of
// `merge` for a pack of only -inf). A thread folds its packs in with `merge`.
template <typename T, int kVec>
__device__ __forceinline__ MaxSum<Acc<T>> max_sum_of_pack(const Pack<T, kVec>& pack) {
  using A = Acc<T>;
  MaxSum<A> statistics;
#pragma unroll
  for (int j = 0; j < kVec; ++j) statistics.max = fmax(statistics.max, to_acc(pack.val[j]));
  if (statistics.max == A(-INFINITY)) return statistics;
#pragma unroll
  for (int j = 0; j < kVec; ++j) statistics.sum += exp_acc(to_acc(pack.val[j]) - statistics.max);
  return statistics;
}

// Copies n_packs 16-byte packs of x into shared memory (stage_slice) and returns the block's (max, sum)
// of them, in every thread; each thread reads back only the packs it copied, and the block reduction's
// barriers leave the whole staged slice readable by all (softmax.cu's staged kernels,
// linear_cross_entropy.cu's staged rows).
template <typename T>
__device__ __forceinline__ MaxSum<Acc<T>> stage_and_reduce(const T* x_slice, T* staged, int n_packs) {
  using A = Acc<T>;
  constexpr int kVec = kVecOf<T>;
  stage_slice<T>(x_slice, staged, n_packs);
  MaxSum<A> mine;
  for (int pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load_pack<T, kVec>(staged + pack * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) mine.max = fmax(mine.max, to_acc(in.val[j]));
  }
  // A thread with no packs (or only -inf) shifts by 0: exp(-inf - 0) = 0, where exp(-inf + inf) is NaN.
  const A shift = mine.max == A(-INFINITY) ? A(0) : mine.max;
  for (int pack = threadIdx.x; pack < n_packs; pack += blockDim.x) {
    const Pack<T, kVec> in = load_pack<T, kVec>(staged + pack * kVec);
#pragma unroll
    for (int j = 0; j < kVec; ++j) mine.sum += exp_acc(to_acc(in.val[j]) - shift);
  }
  return block_reduce(mine, Merge{});  // a thread of only -inf gives (-inf, 0): merge's identity
}

// --- dtype switch --------------------------------------------------------------------------------
// Calls fn(T{}) with T the C++ type of `dtype`; fn is a generic lambda that reads T back with decltype.
template <typename Fn>
void dispatch_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::Float32: fn(float{}); break;
    case DType::Float64: fn(double{}); break;
    case DType::Float16: fn(__half{}); break;
    case DType::BFloat16: fn(__nv_bfloat16{}); break;
  }
}

// Calls fn(std::integral_constant<int, kVec>{}) with kVec = 16 / sizeof(T) when every pointer allows
// 16-byte accesses (`vectorise`), else with kVec = 1.
template <typename T, typename Fn>
void dispatch_vector_width(bool vectorise, Fn&& fn) {
  if (vectorise) {
    fn(std::integral_constant<int, kVecOf<T>>{});
  } else {
    fn(std::integral_constant<int, 1>{});
  }
}

// Calls fn(std::integral_constant<int, kTile>{}) with the smallest of kTiles (ascending) that holds
// head_dim: the attention kernels run a head dim on a tile that wide, zero-filling the columns past it.
template <int... kTiles, typename Fn>
void dispatch_tile_width(int64_t head_dim, Fn&& fn) {
  bool done = false;
  ((!done && head_dim <= kTiles ? (fn(std::integral_constant<int, kTiles>{}), done = true) : false), ...);
}

// The flash-attention kernels' tile widths (a head dim is a multiple of 8 up to 256; ops.cpp checked
// it): multiples of 16, the k-step of mma.sync m16n8k16. Each is one more instantiation per dtype and
// direction, so only a few: the common head dims (64, 128) run unpadded, and between them a head dim
// pads by at most 64 columns (head dim 136 on the 192-wide tile: 41 % more work than it needs).
template <typename Fn>
void dispatch_attention_tile(int64_t head_dim, Fn&& fn) {
  dispatch_tile_width<16, 32, 64, 96, 128, 192, 256>(head_dim, fn);
}

}  // namespace kernel_ladder
