#include "daemon/local/cuda_ipc.h"

#include "absl/status/status.h"
#include "microd/config.h"
#if MICROD_HAVE_CUDA
#include "daemon/local/cuda/cuda_ipc_registry.h"
#endif

namespace microd::local {

absl::StatusOr<std::unique_ptr<CudaIpcRegistry>> CreateCudaIpcRegistry(bool staging) {
#if MICROD_HAVE_CUDA
  return cuda::CreateRegistry(staging);
#else
  (void)staging;
  return absl::UnimplementedError(
      "microd was built without CUDA (a CPU build): use host buffers, or a CUDA build of microd");
#endif
}

}  // namespace microd::local
