// Driver (libcuda) functions without linking libcuda: the CUDA runtime hands out their addresses.
// PyTorch loads the runtime and the driver; the extension links only the runtime, so a machine whose
// libcuda sits somewhere the linker would not look still builds it. Used by hopper.cuh (TMA's
// cuTensorMapEncodeTiled) and triton_replay.cpp (cuLaunchKernel and cuLaunchKernelEx, for Triton's
// compiled kernels).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>  // PFN_<function>_v<version>: each driver function's type, by the version it took it
#include <cuda_runtime_api.h>

namespace kernel_ladder {

// The driver's `name` in the form it had in CUDA `version` (e.g. 12000 for 12.0), cast to `Function`; null
// if this driver has none. Look each one up once (a static), not per call.
template <typename Function>
Function driver_function(const char* name, int version) {
  void* function = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
#if CUDART_VERSION >= 12050
  cudaGetDriverEntryPointByVersion(name, &function, version, cudaEnableDefault, &found);
#else
  (void)version;  // this runtime hands out the newest form
  cudaGetDriverEntryPoint(name, &function, cudaEnableDefault, &found);
#endif
  return found == cudaDriverEntryPointSuccess ? reinterpret_cast<Function>(function) : nullptr;
}

}  // namespace kernel_ladder
