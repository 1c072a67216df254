// The Hopper (sm_90a) building blocks of the flash-attention kernels (attention_forward_hopper.cu,
// attention_backward_hopper.cu):
// TMA bulk copies, the mbarriers that say when a copy has landed or a buffer is free, warpgroup register
// reallocation and named barriers, and wgmma, the warpgroup-wide matrix product that reads its operands
// from shared memory. tensor_core.cuh is the same for mma.sync (sm_80+).
//
// What changes from mma.sync (PTX ISA, "Asynchronous Warpgroup Level Matrix Multiply-Accumulate")
//   - One instruction per warpgroup (4 warps, 128 threads): m64nNk16, a 64 x 16 by 16 x N product. Warp w
//     of the warpgroup holds rows 16w..16w+15 of the accumulator in exactly mma.sync m16n8's C layout, N / 8
//     of them side by side (register 4j + {0,1}: row lane / 4, columns 8j + 2(lane % 4) + {0,1}; 4j + {2,3}:
//     row lane / 4 + 8), so the quad-shuffle row reductions and a_fragment_from_accumulators carry over.
//   - The operands are read by the tensor cores straight from shared memory, each described by a 64-bit
//     descriptor (A may come from registers instead, in mma.sync's A-fragment layout): no ldmatrix, and no
//     registers spent on B.
//   - It is asynchronous: issue, commit a group, keep computing, wait for the group. Registers an in-flight
//     wgmma reads or writes must not be touched until the wait, and the compiler must be told so
//     (fence_registers), since to it an asm statement's outputs exist as soon as it has run.
//
// Shared-memory layout: 128-byte swizzle. TMA writes a box of rows of 64 16-bit values (128 bytes), and
// XORs each 16-byte chunk's index within its row with the row's index mod 8 (address bits 4-6 ^= bits 7-9),
// so the 8 rows of one 16-byte column sit in 8 different groups of 4 banks: reading or writing a column
// of rows is conflict-free. wgmma's "128-byte swizzle" descriptors describe the same layout. The swizzle is
// computed from the address, so every 8-row atom (1024 bytes) must start 1024-byte aligned. A tile wider
// than 64 columns is several such boxes, one after the other.
//
// Everything here is sm_90a-only PTX: it exists only in a device pass for compute_90a (nvcc defines
// __CUDA_ARCH_FEAT_SM90_ALL there), so the same .cu files also compile for sm_80 and plain sm_90.
#pragma once

#include <atomic>

#include "common.cuh"
#include "driver_api.h"  // CUtensorMap, and cuTensorMapEncodeTiled without linking libcuda
#include "tensor_core.cuh"  // pack_pair

namespace kernel_ladder {

// Both Hopper kernels are warp-specialised CTAs of warpgroups (wgmma's unit: 4 warps, 128 threads), and
// keep their tiles as TMA's widest 128-byte-swizzled box writes them: rows of 128 bytes, 64 columns of 16
// bits, a tile wider than 64 columns being several boxes one after the other.
constexpr int kWarpgroupThreads = 128;
constexpr int kBoxColumns = 64;
constexpr int kRowBytes = 128;

// The head a tile belongs to: TMA's two outer coordinates (the maps are 4-D: see the TMA section).
struct TileHead {
  int head, batch;
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)

// --- mbarrier: a shared-memory barrier that counts arrivals and, for TMA, bytes ---------------------------
// A phase completes when `arrivals` threads have arrived and every byte announced by expect_bytes has
// landed; then the next phase begins. Waiters name a phase by its parity, so the n-th fill of a ring
// buffer's stage is waited for as parity n % 2.

__device__ __forceinline__ void mbarrier_init(uint64_t* barrier, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(arrivals) : "memory");
}

// The barriers' initial state must be visible to the TMA unit (another proxy) before the first copy
// names them; a __syncthreads after this makes it visible to the other threads.
__device__ __forceinline__ void mbarrier_init_fence() {
  asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
}

// One arrival that also announces `bytes` more bytes that TMA will deliver to this phase.
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* barrier, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;\n" ::"r"(shared_address(barrier)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void mbarrier_arrive(uint64_t* barrier) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];\n" ::"r"(shared_address(barrier)) : "memory");
}

// Spins until the phase of parity `parity` has completed. (try_wait suspends the thread for a while in
// hardware before it answers no, so the loop does not hammer shared memory.) A freshly initialised barrier
// counts its phase "-1" (parity 1) as complete: a producer waiting for parity 1 on an empty-slot barrier
// passes at once, before any consumer has released anything.
__device__ __forceinline__ void mbarrier_wait(uint64_t* barrier, uint32_t parity) {
  uint32_t done = 0;
  while (!done) {
    asm volatile(
        "{\n.reg .pred complete;\n"
        "mbarrier.try_wait.parity.shared::cta.b64 complete, [%1], %2;\n"
        "selp.u32 %0, 1, 0, complete;\n}\n"
        : "=r"(done)
        : "r"(shared_address(barrier)), "r"(parity)
        : "memory");
  }
}

// --- TMA (the Tensor Memory Accelerator): one thread moves a whole box ------------------------------------
// The box's shape, the tensor's sizes and strides and the swizzle live in a CUtensorMap built on the host
// (cuTensorMapEncodeTiled). Elements outside the tensor are zero-filled on loads and skipped on stores:
// ragged lengths and head dims narrower than the box need no padding in memory and no bounds checks here.

// Every map is 4-D, innermost first: (column, row, head, batch) of a (batch, heads, rows, head_dim)
// operand, each dim with its own stride, so that heads that are views of a fused projection (rows
// 3 * n_embd apart, heads head_dim apart) are read where they lie (kernels.h, HeadStrides).

// Head `index` of a tensor with `heads` heads a batch, where index counts batch * heads as the kernels' bh
// does (or bh / group for a kv head).
__device__ __forceinline__ TileHead tile_head(int64_t index, int64_t heads) {
  return TileHead{static_cast<int>(index % heads), static_cast<int>(index / heads)};
}

// The box at (column, row) of head `at` into shared memory; its bytes count toward `barrier`'s phase.
__device__ __forceinline__ void tma_load_4d(void* shared, const CUtensorMap* map, int column, int row, TileHead at,
                                            uint64_t* barrier) {
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
      "[%6];\n"
      :
      : "r"(shared_address(shared)), "l"(reinterpret_cast<uint64_t>(map)), "r"(column), "r"(row), "r"(at.head),
        "r"(at.batch), "r"(shared_address(barrier))
      : "memory");
}

// The box at (column, row) of head `at` from shared memory to global memory, as one bulk group.
__device__ __forceinline__ void tma_store_4d(const CUtensorMap* map, const void* shared, int column, int row,
                                             TileHead at) {
  asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%2, %3, %4, %5}], [%1];\n"
               :
               : "l"(reinterpret_cast<uint64_t>(map)), "r"(shared_address(shared)), "r"(column), "r"(row),
                 "r"(at.head), "r"(at.batch)
               : "memory");
}

// A tile of kBoxes 64-column boxes (box_bytes apart in shared memory) whose rows start at `row` of head
// `at`, onto `barrier`; and the same tile stored back.
template <int kBoxes>
__device__ __forceinline__ void tma_load_tile(void* shared, int box_bytes, const CUtensorMap* map, int row, TileHead at,
                                              uint64_t* barrier) {
#pragma unroll
  for (int box = 0; box < kBoxes; ++box) {
    tma_load_4d(static_cast<unsigned char*>(shared) + box * box_bytes, map, box * kBoxColumns, row, at, barrier);
  }
}

template <int kBoxes>
__device__ __forceinline__ void tma_store_tile(const CUtensorMap* map, const void* shared, int box_bytes, int row,
                                               TileHead at) {
#pragma unroll
  for (int box = 0; box < kBoxes; ++box) {
    tma_store_4d(map, static_cast<const unsigned char*>(shared) + box * box_bytes, box * kBoxColumns, row, at);
  }
}

// Closes this thread's bulk stores into a group and waits until they have read their shared memory (the
// CTA may then exit: the writes to global memory complete on their own).
__device__ __forceinline__ void tma_store_wait_for_reads() {
  asm volatile("cp.async.bulk.commit_group;\ncp.async.bulk.wait_group.read 0;\n" ::: "memory");
}

// Ordinary stores to shared memory and TMA's reads of it are different proxies: a thread's stores must
// be fenced before a TMA store (issued by another thread, after a barrier) may read them.
__device__ __forceinline__ void fence_shared_for_tma() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Fetches a tensor map (kernel parameter memory) into the TMA unit's cache ahead of its first use.
__device__ __forceinline__ void prefetch_tensor_map(const CUtensorMap* map) {
  asm volatile("prefetch.tensormap [%0];\n" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// --- warpgroups: registers and named barriers ------------------------------------------------------------
// A warp-specialised kernel launches every thread with the same register count; setmaxnreg then hands a
// warpgroup's registers back to the SM's pool (dec) or takes more from it (inc, waiting until the pool has
// them). Every warp of the warpgroup executes it. ptxas gives each side of the branch that holds it its
// own register budget only if the two sit in one if/else (else it ignores them: warning C7508).
template <int kRegisters>
__device__ __forceinline__ void warpgroup_release_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

template <int kRegisters>
__device__ __forceinline__ void warpgroup_claim_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kRegisters));
}

// A CTA of one producer warpgroup and consumer warpgroups: 384 threads start with 168 registers each
// (65,536 / 384, rounded down to a multiple of 8); the producer, which only issues copies, hands back 144
// a thread and the consumers take 72 more: 128 x 24 + 256 x 240 = 64,512 of 65,536.
constexpr int kProducerRegisters = 24;
constexpr int kConsumerRegisters = 240;

// Runs producer() on warpgroup 0 and consumer(c) on warpgroup c + 1, each with its register budget. The
// role as the compiler sees it is the same across each warp (a broadcast from lane 0): else ptxas must
// assume wgmma in a divergent path and serialises every one (warning C7520). The two setmaxnreg sit in
// one if/else, as ptxas requires (warning C7508).
template <typename Producer, typename Consumer>
__device__ __forceinline__ void run_warp_specialised(const Producer& producer, const Consumer& consumer) {
  const int warpgroup = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x) / kWarpgroupThreads, 0);
  if (warpgroup == 0) {
    warpgroup_release_registers<kProducerRegisters>();
    producer();
  } else {
    warpgroup_claim_registers<kConsumerRegisters>();
    consumer(warpgroup - 1);
  }
}

// The first 1024-byte boundary in dynamic shared memory (the kernels ask for 1 KB more): the swizzle is
// computed from address bits 7-9, so every 8-row atom must start there.
__device__ __forceinline__ unsigned char* swizzle_aligned(unsigned char* shared_bytes) {
  return shared_bytes + (1024 - shared_address(shared_bytes) % 1024) % 1024;
}

// Barriers 1..15 of the CTA (0 is __syncthreads) among `threads` threads: bar.sync waits for them,
// bar.arrive counts itself in and goes on, so one warpgroup can signal another without waiting.
__device__ __forceinline__ void named_barrier_sync(int barrier, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(barrier), "r"(threads) : "memory");
}

__device__ __forceinline__ void named_barrier_arrive(int barrier, int threads) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(barrier), "r"(threads) : "memory");
}

// --- wgmma ----------------------------------------------------------------------------------------------

// Orders this warpgroup's register writes before the wgmmas issued after it (required before the first
// wgmma that reads an accumulator or A fragment some other instruction has written).
__device__ __forceinline__ void wgmma_fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }

// Closes the wgmmas issued since the last commit into one group.
__device__ __forceinline__ void wgmma_commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }

// Waits until at most kPending of this warpgroup's committed groups are still running.
template <int kPending>
__device__ __forceinline__ void wgmma_wait() {
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(kPending) : "memory");
}

// An empty asm that claims to read and rewrite each register: the compiler may move no read or write of
// them across it. After a wgmma_wait it makes later code read what the tensor cores wrote (not a copy
// hoisted above the wait); before a wgmma_fence it makes every earlier write to them land before the fence.
template <int kRows>
__device__ __forceinline__ void fence_registers(float (&registers)[kRows][4]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+f"(registers[i][j])::"memory");
  }
}

template <int kRows>
__device__ __forceinline__ void fence_registers(uint32_t (&registers)[kRows][4]) {
#pragma unroll
  for (int i = 0; i < kRows; ++i) {
#pragma unroll
    for (int j = 0; j < 4; ++j) asm volatile("" : "+r"(registers[i][j])::"memory");
  }
}

// Shared-memory matrix descriptor (PTX ISA, "Matrix Descriptor Format"): bits 0-13 start address >> 4,
// 16-29 leading-dimension byte offset >> 4, 32-45 stride-dimension byte offset >> 4, 49-51 base offset
// (0: every swizzle atom starts 1024-byte aligned), 62-63 swizzle mode (1: 128-byte).
__device__ __forceinline__ uint64_t swizzle_128b_descriptor(uint32_t address, uint32_t leading_bytes,
                                                            uint32_t stride_bytes) {
  return uint64_t{1} << 62 | uint64_t{stride_bytes >> 4} << 32 | uint64_t{leading_bytes >> 4} << 16 | address >> 4;
}

// An operand stored K-major (its M or N rows each hold k contiguously: q and K for q k^T), as TMA writes a
// 64-column box: 8-row atoms 1024 bytes apart (the stride offset). One k16 step reads 32 bytes of each row,
// so step s of a box starts `address + 32 s` (the hardware swizzles from the address bits); the leading
// offset is unused when the step lies inside one swizzled row, and is 1 (16 bytes) by convention.
__device__ __forceinline__ uint64_t k_major_descriptor(uint32_t address) {
  return swizzle_128b_descriptor(address, 16, 1024);
}

// An operand stored MN-major (k runs down the rows and N along them: V, keys x head dims, for P V): a k16
// step is 16 rows, two 8-row atoms 1024 bytes apart (the stride offset), and N runs on past 64 columns into
// the next box, box_bytes further (the leading offset). Step s starts `address + 16 rows * 128 bytes * s`.
// The PTX ISA defines the layout in core matrices (8 rows of 16 bytes), so N need not fill the last box:
// N = 80 reads 8 core-matrix columns of the first box and 2 of the second.
__device__ __forceinline__ uint64_t mn_major_descriptor(uint32_t address, uint32_t box_bytes) {
  return swizzle_128b_descriptor(address, box_bytes, 1024);
}

// wgmma m64nNk16 for the N the attention kernel uses. The accumulator is N / 8 blocks of 4 floats a thread
// (N / 2 registers, listed first in each asm statement: %0 ... %(N/2 - 1)), the operands after them, so
// every N has its own instruction string. They are written out once here, 8 registers at a time.
#define KERNEL_LADDER_R0 "%0, %1, %2, %3, %4, %5, %6, %7"
#define KERNEL_LADDER_R1 "%8, %9, %10, %11, %12, %13, %14, %15"
#define KERNEL_LADDER_R2 "%16, %17, %18, %19, %20, %21, %22, %23"
#define KERNEL_LADDER_R3 "%24, %25, %26, %27, %28, %29, %30, %31"
#define KERNEL_LADDER_R4 "%32, %33, %34, %35, %36, %37, %38, %39"
#define KERNEL_LADDER_R5 "%40, %41, %42, %43, %44, %45, %46, %47"
#define KERNEL_LADDER_R6 "%48, %49, %50, %51, %52, %53, %54, %55"
#define KERNEL_LADDER_R7 "%56, %57, %58, %59, %60, %61, %62, %63"
#define KERNEL_LADDER_R8 "%64, %65, %66, %67, %68, %69, %70, %71"
#define KERNEL_LADDER_R9 "%72, %73, %74, %75, %76, %77, %78, %79"
#define KERNEL_LADDER_R10 "%80, %81, %82, %83, %84, %85, %86, %87"
#define KERNEL_LADDER_R11 "%88, %89, %90, %91, %92, %93, %94, %95"
#define KERNEL_LADDER_R12 "%96, %97, %98, %99, %100, %101, %102, %103"
#define KERNEL_LADDER_R13 "%104, %105, %106, %107, %108, %109, %110, %111"
#define KERNEL_LADDER_R14 "%112, %113, %114, %115, %116, %117, %118, %119"
#define KERNEL_LADDER_R15 "%120, %121, %122, %123, %124, %125, %126, %127"
#define KERNEL_LADDER_L16 KERNEL_LADDER_R0 ", " KERNEL_LADDER_R1
#define KERNEL_LADDER_L32 KERNEL_LADDER_R0 ", " KERNEL_LADDER_R1 ", " KERNEL_LADDER_R2 ", " KERNEL_LADDER_R3
#define KERNEL_LADDER_L40 KERNEL_LADDER_L32 ", " KERNEL_LADDER_R4
#define KERNEL_LADDER_L48 KERNEL_LADDER_L40 ", " KERNEL_LADDER_R5
#define KERNEL_LADDER_L56 KERNEL_LADDER_L48 ", " KERNEL_LADDER_R6
#define KERNEL_LADDER_L64 KERNEL_LADDER_L56 ", " KERNEL_LADDER_R7
#define KERNEL_LADDER_L96 \
  KERNEL_LADDER_L64 ", " KERNEL_LADDER_R8 ", " KERNEL_LADDER_R9 ", " KERNEL_LADDER_R10 ", " KERNEL_LADDER_R11
#define KERNEL_LADDER_L128 \
  KERNEL_LADDER_L96 ", " KERNEL_LADDER_R12 ", " KERNEL_LADDER_R13 ", " KERNEL_LADDER_R14 ", " KERNEL_LADDER_R15
// The matching C++ operands: blocks 2i and 2i + 1 of c, 8 registers.
#define KERNEL_LADDER_C4(n) "+f"(c[n][0]), "+f"(c[n][1]), "+f"(c[n][2]), "+f"(c[n][3])
#define KERNEL_LADDER_C8(i) KERNEL_LADDER_C4(2 * (i)), KERNEL_LADDER_C4(2 * (i) + 1)
#define KERNEL_LADDER_C16 KERNEL_LADDER_C8(0), KERNEL_LADDER_C8(1)
#define KERNEL_LADDER_C32 KERNEL_LADDER_C8(0), KERNEL_LADDER_C8(1), KERNEL_LADDER_C8(2), KERNEL_LADDER_C8(3)
#define KERNEL_LADDER_C40 KERNEL_LADDER_C32, KERNEL_LADDER_C8(4)
#define KERNEL_LADDER_C48 KERNEL_LADDER_C40, KERNEL_LADDER_C8(5)
#define KERNEL_LADDER_C56 KERNEL_LADDER_C48, KERNEL_LADDER_C8(6)
#define KERNEL_LADDER_C64 KERNEL_LADDER_C56, KERNEL_LADDER_C8(7)
#define KERNEL_LADDER_C96 \
  KERNEL_LADDER_C64, KERNEL_LADDER_C8(8), KERNEL_LADDER_C8(9), KERNEL_LADDER_C8(10), KERNEL_LADDER_C8(11)
#define KERNEL_LADDER_C128 \
  KERNEL_LADDER_C96, KERNEL_LADDER_C8(12), KERNEL_LADDER_C8(13), KERNEL_LADDER_C8(14), KERNEL_LADDER_C8(15)

// c (64 x N, float) = a b^T, or += with the flag: a (64 x 16) and b (N x 16) in shared memory, both K-major
// (descriptors). The trailing immediates: scale a and b by 1, neither transposed. A, B, FLAG: the operand
// numbers after the accumulator's.
#define KERNEL_LADDER_WGMMA_SHARED(TYPE, N, LIST, C, A, B, FLAG)                                             \
  asm volatile("{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %" #FLAG ", 0;\n"                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" LIST "}, %" #A ", %" #B \
               ", accumulate, 1, 1, 0, 0;\n}\n"                                                                \
               : C                                                                                              \
               : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)))
// c (64 x N, float) += a b: a (64 x 16) in registers, each warp's 16 rows an mma.sync A fragment (operands
// A0..A0+3); b (16 x N) in shared memory, MN-major (the trailing 1: "transposed" relative to K-major).
#define KERNEL_LADDER_WGMMA_REGISTERS(TYPE, N, LIST, C, A0, A1, A2, A3, B, FLAG)                               \
  asm volatile("{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %" #FLAG ", 0;\n"                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" LIST "}, {%" #A0 ", %" #A1 \
               ", %" #A2 ", %" #A3 "}, %" #B ", accumulate, 1, 1, 1;\n}\n"                                   \
               : C                                                                                              \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(1))

template <int kN>
struct Wgmma64xN;  // one specialisation per N below

// R is N / 2, the first operand number after the accumulator; R1 ... R5 the next ones.
#define KERNEL_LADDER_WGMMA_SHAPE(N, R, R1, R2, R3, R4, R5)                                                       \
  template <>                                                                                                   \
  struct Wgmma64xN<N> {                                                                                         \
    template <typename T>                                                                                       \
    static __device__ __forceinline__ void shared(float (&c)[N / 8][4], uint64_t a, uint64_t b, bool accumulate) { \
      if constexpr (std::is_same_v<T, __half>) {                                                                \
        KERNEL_LADDER_WGMMA_SHARED("f16", N, KERNEL_LADDER_L##R, KERNEL_LADDER_C##R, R, R1, R2);                \
      } else {                                                                                                  \
        KERNEL_LADDER_WGMMA_SHARED("bf16", N, KERNEL_LADDER_L##R, KERNEL_LADDER_C##R, R, R1, R2);               \
      }                                                                                                         \
    }                                                                                                           \
    template <typename T>                                                                                       \
    static __device__ __forceinline__ void from_registers(float (&c)[N / 8][4], const uint32_t (&a)[4], uint64_t b) { \
      if constexpr (std::is_same_v<T, __half>) {                                                                \
        KERNEL_LADDER_WGMMA_REGISTERS("f16", N, KERNEL_LADDER_L##R, KERNEL_LADDER_C##R, R, R1, R2, R3, R4, R5); \
      } else {                                                                                                  \
        KERNEL_LADDER_WGMMA_REGISTERS("bf16", N, KERNEL_LADDER_L##R, KERNEL_LADDER_C##R, R, R1, R2, R3, R4, R5); \
      }                                                                                                         \
    }                                                                                                           \
  };

// Key tiles of 128, 112 and 80 (S = q K^T); head-dim tiles of 64, 80, 96, 128, 192 and 256 (O += P V).
KERNEL_LADDER_WGMMA_SHAPE(64, 32, 33, 34, 35, 36, 37)
KERNEL_LADDER_WGMMA_SHAPE(80, 40, 41, 42, 43, 44, 45)
KERNEL_LADDER_WGMMA_SHAPE(96, 48, 49, 50, 51, 52, 53)
KERNEL_LADDER_WGMMA_SHAPE(112, 56, 57, 58, 59, 60, 61)
KERNEL_LADDER_WGMMA_SHAPE(128, 64, 65, 66, 67, 68, 69)
KERNEL_LADDER_WGMMA_SHAPE(192, 96, 97, 98, 99, 100, 101)
KERNEL_LADDER_WGMMA_SHAPE(256, 128, 129, 130, 131, 132, 133)

// c (64 x kN) = a b^T (+= with `accumulate`), both operands in shared memory (see above).
template <typename T, int kN>
__device__ __forceinline__ void wgmma_64xNx16(float (&c)[kN / 8][4], uint64_t a, uint64_t b, bool accumulate) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "wgmma takes 16-bit inputs here");
  Wgmma64xN<kN>::template shared<T>(c, a, b, accumulate);
}

// c (64 x kN) += a b, a from registers (see above).
template <typename T, int kN>
__device__ __forceinline__ void wgmma_64xNx16_from_registers(float (&c)[kN / 8][4], const uint32_t (&a)[4],
                                                             uint64_t b) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "wgmma takes 16-bit inputs here");
  Wgmma64xN<kN>::template from_registers<T>(c, a, b);
}

// c (64 x kN, float) = a b, or += with `accumulate`: both operands in shared memory, each K-major (0) or
// MN-major (1) as kTransposeA / kTransposeB say. The backward's dq = dS K reads dS from a buffer of
// dS^T (keys x queries: M contiguous, MN-major) and K as it lies (keys x head dims: N contiguous).
#define KERNEL_LADDER_WGMMA_TRANSPOSED(TYPE, N, LIST, C, A, B, FLAG, TRANSPOSE_A, TRANSPOSE_B)                    \
  asm volatile("{\n.reg .pred accumulate;\nsetp.ne.b32 accumulate, %" #FLAG ", 0;\n"                          \
               "wgmma.mma_async.sync.aligned.m64n" #N "k16.f32." TYPE "." TYPE " {" LIST "}, %" #A ", %" #B \
               ", accumulate, 1, 1, %" #TRANSPOSE_A ", %" #TRANSPOSE_B ";\n}\n"                             \
               : C                                                                                              \
               : "l"(a), "l"(b), "r"(static_cast<int>(accumulate)), "n"(kTransposeA), "n"(kTransposeB))

template <typename T, int kN, int kTransposeA, int kTransposeB>
__device__ __forceinline__ void wgmma_64xNx16_shared(float (&c)[kN / 8][4], uint64_t a, uint64_t b, bool accumulate) {
  static_assert(std::is_same_v<T, __half> || std::is_same_v<T, __nv_bfloat16>, "wgmma takes 16-bit inputs here");
  static_assert(kN == 32 || kN == 64, "instantiated for N = 32 and 64");
  if constexpr (kN == 32 && std::is_same_v<T, __half>) {
    KERNEL_LADDER_WGMMA_TRANSPOSED("f16", 32, KERNEL_LADDER_L16, KERNEL_LADDER_C16, 16, 17, 18, 19, 20);
  } else if constexpr (kN == 32) {
    KERNEL_LADDER_WGMMA_TRANSPOSED("bf16", 32, KERNEL_LADDER_L16, KERNEL_LADDER_C16, 16, 17, 18, 19, 20);
  } else if constexpr (std::is_same_v<T, __half>) {
    KERNEL_LADDER_WGMMA_TRANSPOSED("f16", 64, KERNEL_LADDER_L32, KERNEL_LADDER_C32, 32, 33, 34, 35, 36);
  } else {
    KERNEL_LADDER_WGMMA_TRANSPOSED("bf16", 64, KERNEL_LADDER_L32, KERNEL_LADDER_C32, 32, 33, 34, 35, 36);
  }
}

// A warpgroup's 64 x kColumns accumulator, times `scale` and rounded to T, into 64 rows of a tile of
// 128-byte swizzled boxes (`rows`: the first row in box 0; box_bytes apart), the layout TMA and wgmma
// read. The stores of one instruction go to 16-byte chunk n % 8 of their row XOR the row's index mod 8
// (= lane / 4): 8 rows x 4 lanes cover all 32 banks.
template <typename T, int kColumns>
__device__ __forceinline__ void store_swizzled_rows(unsigned char* rows, int box_bytes,
                                                    const float (&c)[kColumns / 8][4], float scale) {
  const int warp = static_cast<int>(threadIdx.x) / kWarpSize % 4, lane = static_cast<int>(threadIdx.x) % kWarpSize;
  const int g = lane / 4;
#pragma unroll
  for (int n = 0; n < kColumns / 8; ++n) {
    unsigned char* top = rows + n / 8 * box_bytes + (warp * 16 + g) * kRowBytes + (n % 8 ^ g) * 16 + lane % 4 * 4;
    *reinterpret_cast<uint32_t*>(top) = pack_pair<T>(c[n][0] * scale, c[n][1] * scale);
    *reinterpret_cast<uint32_t*>(top + 8 * kRowBytes) = pack_pair<T>(c[n][2] * scale, c[n][3] * scale);
  }
}

#undef KERNEL_LADDER_WGMMA_SHAPE
#undef KERNEL_LADDER_WGMMA_REGISTERS
#undef KERNEL_LADDER_WGMMA_SHARED
#undef KERNEL_LADDER_WGMMA_TRANSPOSED
#undef KERNEL_LADDER_C128
#undef KERNEL_LADDER_C96
#undef KERNEL_LADDER_C64
#undef KERNEL_LADDER_C56
#undef KERNEL_LADDER_C48
#undef KERNEL_LADDER_C40
#undef KERNEL_LADDER_C32
#undef KERNEL_LADDER_C16
#undef KERNEL_LADDER_C8
#undef KERNEL_LADDER_C4
#undef KERNEL_LADDER_L128
#undef KERNEL_LADDER_L96
#undef KERNEL_LADDER_L64
#undef KERNEL_LADDER_L56
#undef KERNEL_LADDER_L48
#undef KERNEL_LADDER_L40
#undef KERNEL_LADDER_L32
#undef KERNEL_LADDER_L16
#undef KERNEL_LADDER_R15
#undef KERNEL_LADDER_R14
#undef KERNEL_LADDER_R13
#undef KERNEL_LADDER_R12
#undef KERNEL_LADDER_R11
#undef KERNEL_LADDER_R10
#undef KERNEL_LADDER_R9
#undef KERNEL_LADDER_R8
#undef KERNEL_LADDER_R7
#undef KERNEL_LADDER_R6
#undef KERNEL_LADDER_R5
#undef KERNEL_LADDER_R4
#undef KERNEL_LADDER_R3
#undef KERNEL_LADDER_R2
#undef KERNEL_LADDER_R1
#undef KERNEL_LADDER_R0

#endif  // __CUDA_ARCH_FEAT_SM90_ALL

// --- host side: tensor maps and the device check (both Hopper launchers) ---------------------------------

#ifdef KERNEL_LADDER_SM90A
constexpr bool kHopperImageBuilt = true;  // the build added -gencode arch=compute_90a,code=sm_90a
#else
constexpr bool kHopperImageBuilt = false;
#endif

// cuTensorMapEncodeTiled is a driver (libcuda) function (driver_api.h). Looked up once; null if this
// driver has none.
inline PFN_cuTensorMapEncodeTiled_v12000 tensor_map_encode_function() {
  static const auto encode =
      driver_function<PFN_cuTensorMapEncodeTiled_v12000>("cuTensorMapEncodeTiled", 12000);
  return encode;
}

// A (batch, heads, rows, head_dim) operand of 16-bit values lying as `strides` says, as a TMA tensor map
// whose boxes are box_rows rows x 64 columns of one head, 128-byte swizzled. The sizes (innermost first)
// bound every box: rows past `rows` (a sequence's end, not the next head's first rows) and columns past
// head_dim read as zero and are never written. False if the driver refuses it (TMA wants every stride a
// multiple of 16 bytes, which the host has made sure of).
inline bool encode_swizzled_tensor_map(CUtensorMap* map, DType dtype, const void* tensor, int64_t batch, int64_t heads,
                                       int64_t rows, int64_t head_dim, const HeadStrides& strides, int box_rows) {
  const PFN_cuTensorMapEncodeTiled_v12000 encode = tensor_map_encode_function();
  if (encode == nullptr) return false;
  // The driver call needs a context current on this thread, which the runtime binds on a thread's first
  // call that needs one. Autograd runs the backward on a thread of its own, where this may come first:
  // the driver would answer "invalid context" and the caller fall back to the mma.sync kernel. A no-op
  // runtime call binds the device's primary context, once a thread (a later switch of device goes
  // through cudaSetDevice, which binds that device's).
  thread_local const bool context_bound = cudaFree(nullptr) == cudaSuccess;
  (void)context_bound;
  constexpr cuuint64_t kBytes = 2;
  const cuuint64_t sizes[4] = {static_cast<cuuint64_t>(head_dim), static_cast<cuuint64_t>(rows),
                               static_cast<cuuint64_t>(heads), static_cast<cuuint64_t>(batch)};
  const cuuint64_t byte_strides[3] = {static_cast<cuuint64_t>(strides.row) * kBytes,
                                      static_cast<cuuint64_t>(strides.head) * kBytes,
                                      static_cast<cuuint64_t>(strides.batch) * kBytes};
  const cuuint32_t box[4] = {64, static_cast<cuuint32_t>(box_rows), 1, 1};
  const cuuint32_t element_steps[4] = {1, 1, 1, 1};
  const CUtensorMapDataType type =
      dtype == DType::BFloat16 ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16 : CU_TENSOR_MAP_DATA_TYPE_FLOAT16;
  return encode(map, type, 4, const_cast<void*>(tensor), sizes, byte_strides, box, element_steps,
                CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_256B,
                CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}


// The sm_90a image runs on compute capability 9.0 only (H100, H200, GH200). Asked once per device: a
// static array is zero ("not asked yet") before the first call.
inline bool is_hopper_device() {
  constexpr int kMaxDevices = 64;
  static std::atomic<int> answers[kMaxDevices];  // 1: yes, 2: no
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= kMaxDevices) return false;
  int answer = answers[device].load(std::memory_order_relaxed);
  if (answer == 0) {
    int major = 0, minor = 0;
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device);
    answer = major == 9 && minor == 0 ? 1 : 2;
    answers[device].store(answer, std::memory_order_relaxed);
  }
  return answer == 1;
}

// Whether a Hopper kernel taking head dims up to widest_head_dim serves this call: the build holds the
// sm_90a image, the caller has not turned the path off (hopper_attention_enabled, kernels.h), the inputs
// are 16-bit and the current GPU is a Hopper.
inline bool hopper_attention_applies(DType dtype, int64_t head_dim, int64_t widest_head_dim) {
  const bool sixteen_bit = dtype == DType::Float16 || dtype == DType::BFloat16;
  return kHopperImageBuilt && hopper_attention_enabled() && sixteen_bit && head_dim <= widest_head_dim &&
         is_hopper_device();
}

}  // namespace kernel_ladder
