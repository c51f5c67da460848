// The CUDA backend of daemon/local/cuda_ipc.h (CUDA builds only): device
// memory of the training processes opened with cudaIpcOpenMemHandle and
// staged through pinned host memory on one non-blocking stream per GPU.
#pragma once

#include <memory>

#include "absl/status/statusor.h"
#include "daemon/local/cuda_ipc.h"

namespace microd::local::cuda {

// Fails (UNSUPPORTED) without a usable device; creates no CUDA context.
// `staging`: allocate each buffer's pinned host copy (not needed by a
// device-resident engine, whose buffers' staging() is then null).
// `only_device` >= 0: buffers on any other GPU are refused before opening.
absl::StatusOr<std::unique_ptr<CudaIpcRegistry>> CreateRegistry(bool staging, int only_device);

}  // namespace microd::local::cuda
