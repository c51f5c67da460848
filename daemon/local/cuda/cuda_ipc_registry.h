// SPDX-License-Identifier: Apache-2.0
// The CUDA backend of daemon/local/cuda_ipc.h (CUDA builds only): device
// memory of the training processes opened with cudaIpcOpenMemHandle and
// staged through pinned host memory on one non-blocking stream per GPU.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "daemon/local/cuda_ipc.h"

namespace microd::local::cuda {

// Fails (UNSUPPORTED) without a usable device; creates no CUDA context.
// `resident_device`: see CreateCudaIpcRegistry.
absl::StatusOr<std::unique_ptr<CudaIpcRegistry>> CreateRegistry(int resident_device);

}  // namespace microd::local::cuda
