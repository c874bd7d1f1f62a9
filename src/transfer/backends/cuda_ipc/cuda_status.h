// cuda_ipc/cuda_status.h — converts cudaError_t into Status, once, at the CUDA edge.
#pragma once

#include <cuda_runtime.h>

#include <string>
#include <string_view>

#include "kvbridge/common/status.h"

namespace kvbridge::cuda_ipc {

/// OK for cudaSuccess; otherwise a Status "`what`: <cuda error name>: <description>". Invalid
/// values and handles map to InvalidArgument, out-of-memory to ResourceExhausted, a missing or
/// unusable device to Unavailable, the rest to Internal.
inline Status CudaStatus(cudaError_t err, std::string_view what) {
  if (err == cudaSuccess) return OkStatus();
  std::string msg =
      std::string(what) + ": " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
  switch (err) {
    case cudaErrorInvalidValue:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorMapBufferObjectFailed:
      return InvalidArgumentError(std::move(msg));
    case cudaErrorMemoryAllocation:
      return ResourceExhaustedError(std::move(msg));
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorInvalidDevice:
    case cudaErrorDevicesUnavailable:
      return UnavailableError(std::move(msg));
    default:
      return InternalError(std::move(msg));
  }
}

#define KVB_CUDA_RETURN_IF_ERROR(call) \
  RETURN_IF_ERROR(::kvbridge::cuda_ipc::CudaStatus((call), #call))

/// Number of usable CUDA devices, or the reason there is none (Unavailable).
inline Result<int> CudaDeviceCount() {
  int n = 0;
  cudaError_t err = cudaGetDeviceCount(&n);
  if (err != cudaSuccess)
    return UnavailableError(std::string("no CUDA device: ") + cudaGetErrorString(err));
  if (n == 0) return UnavailableError("no CUDA device: cudaGetDeviceCount returned 0");
  return n;
}

}  // namespace kvbridge::cuda_ipc
