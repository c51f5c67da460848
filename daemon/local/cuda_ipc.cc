// SPDX-License-Identifier: Apache-2.0
#include "daemon/local/cuda_ipc.h"

#include "absl/status/status.h"
#include "microd/config.h"
#if MICROD_HAVE_CUDA
#include "daemon/local/cuda/cuda_ipc_registry.h"
#endif

namespace microd::local {

absl::StatusOr<std::unique_ptr<CudaIpcRegistry>> CreateCudaIpcRegistry(int resident_device) {
#if MICROD_HAVE_CUDA
  return cuda::CreateRegistry(resident_device);
#else
  (void)resident_device;
  return absl::UnimplementedError(
      "microd was built without CUDA (a CPU build): use host buffers, or a CUDA build of microd");
#endif
}

}  // namespace microd::local
