// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/step_memory.h"

#include <algorithm>
#include <cstdio>

#include "absl/strings/cord.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/status_map.h"

namespace microd::engine {
namespace {

absl::Status InBucket(const absl::Status& s, const std::string& bucket, size_t local_rank) {
  return WithMessage(
      s, absl::StrCat("bucket '", bucket, "', local rank ", local_rank, ": ", s.message()));
}

// Calls `begin` on the device memory of each CUDA buffer until one fails,
// then awaits every one (also after a failure); the first error, named.
absl::Status ForEachDevice(const Work& w, absl::Time deadline,
                           const std::function<absl::Status(local::DeviceMemory&)>& begin) {
  absl::Status result;
  for (size_t r = 0; r < w.buffers.size() && result.ok(); ++r) {
    local::DeviceMemory* dev = w.buffers[r] != nullptr ? w.buffers[r]->device() : nullptr;
    if (dev == nullptr) continue;
    absl::Status s = begin(*dev);
    if (!s.ok()) result = InBucket(s, w.bucket->name, r);
  }
  for (size_t r = 0; r < w.buffers.size(); ++r) {
    local::DeviceMemory* dev = w.buffers[r] != nullptr ? w.buffers[r]->device() : nullptr;
    if (dev == nullptr) continue;
    absl::Status s = dev->Finish(deadline);
    if (!s.ok() && result.ok()) result = InBucket(s, w.bucket->name, r);
  }
  return result;
}

// A bf16/fp16 host buffer's elements widened into its fp32 copy (`in`), or
// the copy rounded back into them.
absl::Status ConvertHalfs(const Work& w, kernels::SparseOps* ops, bool in) {
  for (size_t r = 0; r < w.buffers.size(); ++r) {
    const local::ProcessBuffer* b = w.buffers[r].get();
    if (b == nullptr || b->half() == nullptr) continue;
    const auto type = static_cast<kernels::ElementType>(b->dtype());
    const kernels::KernelStatus k =
        in ? ops->HalfToFloat(b->half(), type, b->count(), b->data(), nullptr)
           : ops->FloatToHalf(b->data(), type, b->count(), b->half(), nullptr);
    if (k != kernels::KernelStatus::kOk) {
      return InBucket(absl::InternalError(absl::StrCat(in ? "widening " : "rounding ",
                                                       kernels::ElementTypeName(type), ": ",
                                                       kernels::KernelStatusString(k))),
                      w.bucket->name, r);
    }
  }
  return absl::OkStatus();
}

class HostStaging final : public StepMemory {
 public:
  // `ops`: the host backend (the conversions of bf16/fp16 buffers).
  explicit HostStaging(kernels::SparseOps* ops) : ops_(ops) {}
  absl::Status Admit(const std::string&, const local::ProcessBuffer&) const override {
    return absl::OkStatus();
  }
  float* Data(const local::ProcessBuffer& b) const override { return b.data(); }
  absl::Status StageIn(const Work& w, absl::Time deadline,
                       const std::function<bool()>& abandoned) override {
    RETURN_IF_ERROR(ConvertHalfs(w, ops_, /*in=*/true));
    return ForEachDevice(w, deadline, [&](local::DeviceMemory& dev) {
      return dev.BeginCopyIn(deadline, abandoned);
    });
  }
  absl::Status StageOut(const Work& w, absl::Time deadline) override {
    RETURN_IF_ERROR(ConvertHalfs(w, ops_, /*in=*/false));
    return ForEachDevice(w, deadline, [](local::DeviceMemory& dev) { return dev.BeginCopyOut(); });
  }
  absl::Status EndBatch(const std::vector<const Work*>&, absl::Duration) override {
    return absl::OkStatus();
  }
  bool on_host() const override { return true; }
  const char* what() const override { return "CUDA staging"; }

 private:
  kernels::SparseOps* const ops_;
};

class DeviceResident final : public StepMemory {
 public:
  DeviceResident(int device, kernels::SparseOps* ops) : device_(device), ops_(ops) {}

  absl::Status Admit(const std::string& name, const local::ProcessBuffer& buffer) const override {
    const local::DeviceMemory* dev = buffer.device();
    if (dev != nullptr && dev->ordinal() == device_) return absl::OkStatus();
    return WithClientStatus(
        absl::FailedPreconditionError(absl::StrCat(
            "buffer '", name, "': this daemon reduces on GPU ", device_,
            " (--transport=nccl) and takes only CUDA buffers on that GPU; this one is ",
            dev == nullptr ? "host memory" : absl::StrCat("on GPU ", dev->ordinal()))),
        ClientStatus::kUnsupported);
  }
  float* Data(const local::ProcessBuffer& b) const override { return b.device()->mapped(); }
  absl::Status StageIn(const Work& w, absl::Time deadline,
                       const std::function<bool()>& abandoned) override {
    return ForEachDevice(
        w, deadline, [&](local::DeviceMemory& dev) { return dev.WaitReady(deadline, abandoned); });
  }
  absl::Status StageOut(const Work& w, absl::Time deadline) override {
    // The update was written in place by the step's GPU work: done when it is.
    const kernels::KernelStatus k =
        ops_->SynchronizeFor(nullptr, std::max(0.0, absl::ToDoubleSeconds(deadline - absl::Now())));
    if (k == kernels::KernelStatus::kOk) return absl::OkStatus();
    return absl::InternalError(absl::StrCat("bucket '", w.bucket->name, "': the step's GPU work (",
                                            ops_->name(), "): ", kernels::KernelStatusString(k)));
  }
  absl::Status EndBatch(const std::vector<const Work*>& works, absl::Duration timeout) override {
    const auto k = ops_->SynchronizeFor(nullptr, absl::ToDoubleSeconds(timeout));
    if (k == kernels::KernelStatus::kOk) return absl::OkStatus();
    MICROD_LOG(Error,
               "the GPU work of a batch did not end (%s): its buffers stay "
               "mapped until the daemon exits",
               kernels::KernelStatusString(k));
    for (const Work* w : works) kept_.insert(kept_.end(), w->buffers.begin(), w->buffers.end());
    return absl::DeadlineExceededError("the GPU work of a batch did not end");
  }
  bool on_host() const override { return false; }
  const char* what() const override { return "GPU step"; }

 private:
  const int device_;
  kernels::SparseOps* const ops_;
  // Buffers whose GPU work never ended: kept mapped, never released.
  std::vector<std::shared_ptr<local::ProcessBuffer>> kept_;
};

}  // namespace

std::unique_ptr<StepMemory> MakeStepMemory(bool device_resident, int device,
                                           kernels::SparseOps* ops) {
  if (device_resident) return std::make_unique<DeviceResident>(device, ops);
  return std::make_unique<HostStaging>(ops);
}

}  // namespace microd::engine
