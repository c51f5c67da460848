// SPDX-License-Identifier: Apache-2.0
// CUDA buffers of the training processes (wire: REGISTER_CUDA): the daemon
// opens each allocation's IPC handle once per process and keeps it open
// until the process leaves (and the last step using it ended). The backend
// lives in cuda/ and exists only in CUDA builds; CreateCudaIpcRegistry says
// why there is none otherwise.
//
// Two ways the engine uses them: with the Gloo transport it stages them
// through pinned host memory (DeviceMemory) and runs the CPU step on them;
// with --transport=nccl (device-resident) the step runs on the GPU
// (kernels/cuda SparseOps, the NCCL transport) on the mapped memory in place.
// Not yet: the daemon's stream waiting on the ready event
// (cudaStreamWaitEvent) instead of the host polling it, and a completion
// event for the client's stream instead of the host waiting for the step.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "daemon/local/local_server.h"

namespace microd::local {

// What a process sent for one buffer (fields checked by the local server:
// 4 * count bytes at `offset` lie inside `alloc_bytes`).
struct CudaIpcRequest {
  uint64_t client = 0;     // the local server's id of the process
  pid_t pid = 0;           // for messages
  std::string name;        // the bucket
  uint64_t count = 0;      // fp32 elements
  int client_device = -1;  // the GPU's ordinal in the process (messages only)
  std::array<uint8_t, 16> device_uuid{};
  std::array<uint8_t, 64> mem_handle{};
  uint64_t alloc_bytes = 0;
  uint64_t offset = 0;
  std::array<uint8_t, 64> event_handle{};
};

class CudaIpcRegistry {
 public:
  virtual ~CudaIpcRegistry() = default;
  // Maps the buffer (opening the allocation unless this process already
  // registered a buffer in it), opens its ready event and allocates the host
  // staging copy. Errors carry the client status to answer with: the GPU is
  // not visible here (UNSUPPORTED), a handle that does not open or an
  // allocation smaller than claimed (INVALID_ARGUMENT), no memory (RESOURCE).
  // Blocks on CUDA calls only (the first one creates the device's context).
  virtual absl::StatusOr<std::unique_ptr<DeviceMemory>> Open(const CudaIpcRequest& request) = 0;
  // The process left: its allocations close as soon as no buffer of theirs
  // is in use any more (at once, unless a step holds one). Never blocks.
  virtual void ForgetClient(uint64_t client) = 0;
};

// The CUDA backend, or an error saying why there is none: a build without
// CUDA, or no usable device (e.g. "CUDA driver version is insufficient").
// Does not create a CUDA context.
// `resident_device` >= 0: for a device-resident engine on that GPU (this
// daemon's ordinal), which computes on mapped() and never copies: buffers on
// other GPUs are refused (UNSUPPORTED) before any CUDA call on them, and
// none gets a pinned host copy (staging() is null). -1: any GPU, each buffer
// with its host copy.
absl::StatusOr<std::unique_ptr<CudaIpcRegistry>> CreateCudaIpcRegistry(int resident_device = -1);

}  // namespace microd::local
