// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/recovery.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"

namespace microd::engine {

bool Recovery::Holdable(const absl::Status& why) const {
  if (!elastic_ || absl::IsInvalidArgument(why)) return false;
  return !absl::IsDataLoss(why) || seal_failure_step_;
}

bool Recovery::StartLocked(const absl::Status& why) {
  if (recovering_.load() || ended_) return false;
  recovering_.store(true, std::memory_order_release);
  started_ = absl::Now();
  until_ = started_ + wait_;
  cause_ = why;
  return true;
}

bool Recovery::Hold(std::vector<Work> works, const absl::Status& why) {
  absl::MutexLock lock(&mu_);
  for (Work& w : works) held_.push_back(std::move(w));
  return StartLocked(why);
}

bool Recovery::Offer(const control::Membership& m, const std::string& change, uint64_t current) {
  absl::MutexLock lock(&mu_);
  if (ended_ || m.epoch <= std::max(current, latest_epoch_)) return false;
  latest_epoch_ = m.epoch;
  next_ = {m, change};
  if (m.graceful && !recovering_.load()) return false;
  StartLocked(absl::UnavailableError(absl::StrCat("the job's membership changed: ", change)));
  return true;
}

void Recovery::ChangeDue() {
  absl::MutexLock lock(&mu_);
  change_due_ = true;
}

bool Recovery::StartIfDue() {
  absl::MutexLock lock(&mu_);
  if (!change_due_) return false;
  change_due_ = false;
  return StartLocked(absl::UnavailableError("the job's membership changed: a node joined"));
}

Recovery::Verdict Recovery::Await(uint64_t after) {
  absl::MutexLock lock(&mu_);
  auto decided = [this]()
                     ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) { return next_.has_value() || ended_; };
  mu_.AwaitWithDeadline(absl::Condition(&decided), until_);
  Verdict v;
  v.ended = ended_;
  v.cause = cause_;
  if (!ended_ && next_.has_value() && next_->first.epoch > after) {
    v.next = std::move(next_);
    next_.reset();
  }
  return v;
}

std::vector<Work> Recovery::Done() {
  absl::MutexLock lock(&mu_);
  recovering_.store(false, std::memory_order_release);
  cause_ = absl::OkStatus();
  last_seconds_ = absl::ToDoubleSeconds(absl::Now() - started_);
  std::vector<Work> out;
  out.swap(held_);
  return out;
}

void Recovery::Release(const std::vector<Work>& done) {
  absl::MutexLock lock(&mu_);
  for (const Work& w : done) {
    held_.erase(std::remove_if(held_.begin(), held_.end(),
                               [&](const Work& x) { return x.answer == w.answer; }),
                held_.end());
  }
}

std::vector<Work> Recovery::End() {
  absl::MutexLock lock(&mu_);
  ended_ = true;
  recovering_.store(false, std::memory_order_release);
  std::vector<Work> out;
  out.swap(held_);
  return out;
}

double Recovery::last_seconds() const {
  absl::MutexLock lock(&mu_);
  return last_seconds_;
}

}  // namespace microd::engine
