// SPDX-License-Identifier: Apache-2.0
#include "daemon/rendezvous/kv_store.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace microd::rendezvous {

absl::Status ValidateKey(const std::string& key) {
  if (key.empty()) return absl::InvalidArgumentError("key-value store: empty key");
  if (key.size() > kMaxKeyBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("key-value store: key of ", key.size(), " bytes (limit ", kMaxKeyBytes, ")"));
  }
  return absl::OkStatus();
}

absl::Status ValidateValue(const std::string& value) {
  if (value.size() > kMaxValueBytes) {
    return absl::InvalidArgumentError(absl::StrCat("key-value store: value of ", value.size(),
                                                   " bytes (limit ", kMaxValueBytes, ")"));
  }
  return absl::OkStatus();
}

absl::Status InMemoryKeyValueStore::Set(const std::string& key, const std::string& value) {
  if (absl::Status s = ValidateKey(key); !s.ok()) return s;
  if (absl::Status s = ValidateValue(value); !s.ok()) return s;
  absl::MutexLock lock(&mu_);
  if (!failed_.ok()) return failed_;
  values_[key] = value;
  return absl::OkStatus();
}

absl::StatusOr<std::vector<std::string>> InMemoryKeyValueStore::Get(
    absl::Span<const std::string> keys, absl::Time deadline) {
  for (const std::string& k : keys) {
    if (absl::Status s = ValidateKey(k); !s.ok()) return s;
  }
  const bool wait = deadline > absl::Now();
  absl::MutexLock lock(&mu_);
  auto all_present = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    if (!failed_.ok()) return true;
    for (const std::string& k : keys) {
      if (values_.count(k) == 0) return false;
    }
    return true;
  };
  mu_.AwaitWithDeadline(absl::Condition(&all_present), deadline);
  if (!failed_.ok()) return failed_;
  std::vector<std::string> out;
  std::vector<std::string> missing;
  for (const std::string& k : keys) {
    auto it = values_.find(k);
    if (it == values_.end()) {
      missing.push_back(k);
    } else {
      out.push_back(it->second);
    }
  }
  if (!missing.empty()) {
    const std::string what = absl::StrJoin(missing, ", ");
    return wait ? absl::DeadlineExceededError(
                      absl::StrCat("key-value store: no value for ", what, " before the deadline"))
                : absl::NotFoundError(absl::StrCat("key-value store: no value for ", what));
  }
  return out;
}

void InMemoryKeyValueStore::Fail(const absl::Status& status) {
  absl::MutexLock lock(&mu_);
  if (failed_.ok()) failed_ = status;
}

void InMemoryKeyValueStore::EraseIf(const std::function<bool(const std::string&)>& drop) {
  absl::MutexLock lock(&mu_);
  for (auto it = values_.begin(); it != values_.end();) {
    it = drop(it->first) ? values_.erase(it) : std::next(it);
  }
}

size_t InMemoryKeyValueStore::size() const {
  absl::MutexLock lock(&mu_);
  return values_.size();
}

}  // namespace microd::rendezvous
