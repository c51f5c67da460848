// SPDX-License-Identifier: Apache-2.0
// Where a step reads the processes' gradients and writes their updates.
//
// Host staging (the step runs on host memory): host buffers are used in
// place; CUDA buffers are staged through host memory: before the local sum
// each one's ready event is awaited and its bytes are copied in; after the
// write-back the update is copied out and the copy awaited before the
// completion goes out.
//
// Device-resident (--transport=nccl: the step runs on the GPU): every buffer
// is a CUDA buffer on the daemon's GPU, read and written in place after its
// ready event; the update is out when the step's GPU work is done.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/time/time.h"
#include "daemon/engine/process_table.h"
#include "kernels/sparse_ops.h"

namespace microd::engine {

class StepMemory {
 public:
  virtual ~StepMemory() = default;

  // Whether a buffer of bucket `name` can take part in a step here.
  virtual absl::Status Admit(const std::string& name, const local::ProcessBuffer& buffer) const = 0;
  // Where the step reads a process's gradient and writes its update.
  virtual float* Data(const local::ProcessBuffer& buffer) const = 0;
  // The gradients readable at Data(). All copies are queued, then awaited
  // (deadline: the step's); `abandoned` ends the waits early (the job
  // failed). A failure names the bucket and the local rank.
  virtual absl::Status StageIn(const Work& work, absl::Time deadline,
                               const std::function<bool()>& abandoned) = 0;
  // The updates written at Data() are in the processes' buffers.
  virtual absl::Status StageOut(const Work& work, absl::Time deadline) = 0;
  // After a batch: a step that ended early (a failure) may have left GPU
  // work queued on the processes' memory; it is awaited before the Works
  // let go of the buffers (the last reference to a departed process's
  // mapping closes it). Work still running after `timeout` keeps the
  // buffers mapped for the life of the daemon, and the error says so.
  virtual absl::Status EndBatch(const std::vector<const Work*>& works, absl::Duration timeout) = 0;
  // Host memory: the cycle may read host buffers for its local sums.
  virtual bool on_host() const = 0;
  // What a failure of the memory is called in messages.
  virtual const char* what() const = 0;
};

std::unique_ptr<StepMemory> MakeStepMemory(bool device_resident, int device,
                                           kernels::SparseOps* ops);

}  // namespace microd::engine
