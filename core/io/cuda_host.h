// CUDA host memory for the pinned cache: the few CUDA runtime calls ucpfs makes, behind plain
// functions so that nothing else includes <cuda_runtime.h>. Compiled against the CUDA runtime
// (linked statically: no libcudart.so needed at run time, only the driver when a GPU is there)
// only when CMake found the toolkit (UCPFS_HAVE_CUDA); otherwise every function answers as if
// no GPU were present, and callers take their fallback.
// Not for: device memory, kernels, streams.
#pragma once

#include <cstddef>

#include "core/status.h"

namespace ucpfs::io {

// True when this build links the CUDA runtime.
bool CudaBuilt();

// The number of CUDA devices, asked of the runtime once per process (later calls return the
// first answer without calling it). 0 when built without CUDA, or when the runtime reports an
// error (no driver, no device, driver too old).
int CudaDeviceCount();

// n_bytes of page-locked host memory, portable (pinned for every CUDA context), from
// cudaHostAlloc(cudaHostAllocPortable). Alignment is the runtime's: callers that need more
// allocate more and align. Call only when CudaDeviceCount() > 0. Errors: kUnsupported when
// built without CUDA; kResourceExhausted naming the size and the runtime's error.
Result<std::byte*> CudaHostAlloc(size_t n_bytes);

// Frees memory from CudaHostAlloc; nullptr is ignored.
void CudaFreeHost(std::byte* data);

}  // namespace ucpfs::io
