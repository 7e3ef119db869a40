// CUDA runtime calls for pinned host memory; see cuda_host.h. The only file that includes
// <cuda_runtime.h>, and only when UCPFS_HAVE_CUDA is defined (by core/CMakeLists.txt, for this
// file's library alone).
#include "core/io/cuda_host.h"

#include <string>

#if defined(UCPFS_HAVE_CUDA)
#include <cuda_runtime.h>
#endif

namespace ucpfs::io {

#if defined(UCPFS_HAVE_CUDA)

bool CudaBuilt() { return true; }

int CudaDeviceCount() {
  // A function-local static: initialized once, thread-safe, so the runtime (which loads the
  // driver library on its first call) is asked at most once per process.
  static const int n_devices = [] {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) return 0;
    return n;
  }();
  return n_devices;
}

Result<std::byte*> CudaHostAlloc(size_t n_bytes) {
  void* data = nullptr;
  const cudaError_t err = cudaHostAlloc(&data, n_bytes, cudaHostAllocPortable);
  if (err != cudaSuccess || data == nullptr) {
    return ResourceExhaustedError("cudaHostAlloc of " + std::to_string(n_bytes) +
                                  " bytes failed: " + cudaGetErrorString(err));
  }
  return static_cast<std::byte*>(data);
}

void CudaFreeHost(std::byte* data) {
  if (data != nullptr) cudaFreeHost(data);
}

#else  // built without CUDA

bool CudaBuilt() { return false; }

int CudaDeviceCount() { return 0; }

Result<std::byte*> CudaHostAlloc(size_t n_bytes) {
  return UnsupportedError("cudaHostAlloc of " + std::to_string(n_bytes) +
                          " bytes: ucpfs was built without CUDA (UCPFS_CUDA=OFF or no toolkit)");
}

void CudaFreeHost(std::byte*) {}

#endif

}  // namespace ucpfs::io
