// SPDX-License-Identifier: Apache-2.0
// A bucket's state saved and loaded (bucket.h: Save, CheckCheckpoint, Load):
// the residual, the velocity and the threshold controller's state.
#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "daemon/common/status_macros.h"
#include "daemon/sparsify/bucket.h"

namespace microd::sparsify {

absl::StatusOr<BucketCheckpoint> BucketState::Save() const {
  BucketCheckpoint c;
  c.step = step_;
  const uint64_t d = spec_.size;
  auto copy_out = [&](const DeviceBuffer<float>& from, std::vector<float>* to) -> absl::Status {
    if (!from.ok()) return absl::OkStatus();
    to->resize(d);
    return Check(ops_->CopyToHost(to->data(), from.get(), d * sizeof(float), stream_), "copy");
  };
  RETURN_IF_ERROR(copy_out(residual_, &c.residual));
  RETURN_IF_ERROR(copy_out(velocity_, &c.velocity));
  if (controller_ != nullptr) c.controller = controller_->Save();
  return c;
}

absl::Status BucketState::CheckCheckpoint(const BucketCheckpoint& c) const {
  const uint64_t d = spec_.size;
  auto fits = [&](const DeviceBuffer<float>& buffer, const std::vector<float>& v,
                  const char* what) -> absl::Status {
    const uint64_t want = buffer.ok() ? d : 0;
    if (v.size() == want) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat("bucket '", spec_.name, "': the checkpoint's ",
                                                   what, " has ", v.size(),
                                                   " elements, this bucket keeps ", want,
                                                   " (another size, sparsifier or momentum "
                                                   "correction)"));
  };
  RETURN_IF_ERROR(fits(residual_, c.residual, "residual"));
  RETURN_IF_ERROR(fits(velocity_, c.velocity, "velocity"));
  if ((controller_ != nullptr) != !c.controller.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(
        "bucket '", spec_.name, "': the checkpoint ", c.controller.empty() ? "has no" : "has a",
        " threshold controller state, this bucket ", controller_ ? "needs one" : "has none"));
  }
  if (controller_ != nullptr) {
    // The controller checks its bytes on a copy of itself.
    std::unique_ptr<ThresholdController> trial = CreateController(options_.controller, k_);
    if (absl::Status s = trial->Load(c.controller); !s.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("bucket '", spec_.name, "': ", s.message()));
    }
  }
  return absl::OkStatus();
}

absl::Status BucketState::Load(const BucketCheckpoint& c) {
  RETURN_IF_ERROR(CheckCheckpoint(c));
  const uint64_t d = spec_.size;
  if (controller_ != nullptr) RETURN_IF_ERROR(controller_->Load(c.controller));
  if (!c.residual.empty()) {
    RETURN_IF_ERROR(
        Check(ops_->CopyToDevice(residual_.get(), c.residual.data(), d * sizeof(float), stream_),
              "copy"));
    residual_zero_ = std::all_of(c.residual.begin(), c.residual.end(), [](float x) {
      uint32_t bits;
      std::memcpy(&bits, &x, sizeof bits);
      return bits == 0;
    });
  }
  if (!c.velocity.empty()) {
    RETURN_IF_ERROR(
        Check(ops_->CopyToDevice(velocity_.get(), c.velocity.data(), d * sizeof(float), stream_),
              "copy"));
  }
  step_ = c.step;
  return absl::OkStatus();
}

}  // namespace microd::sparsify
