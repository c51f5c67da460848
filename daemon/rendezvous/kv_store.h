// SPDX-License-Identifier: Apache-2.0
// A key-value store with blocking reads, the rendezvous medium of the data
// plane (Gloo pair addresses, later the NCCL unique id). The coordinator's
// client implements it over gRPC; InMemoryKeyValueStore serves one process.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "absl/types/span.h"

namespace microd::rendezvous {

class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  // Sets (or replaces) a value. Blocks for at most the implementation's call timeout.
  virtual absl::Status Set(const std::string& key, const std::string& value) = 0;
  // Returns the values of every key, waiting until all exist or `deadline`
  // (kDeadlineExceeded naming the missing keys). A deadline in the past
  // does not wait (kNotFound when a key is missing).
  virtual absl::StatusOr<std::vector<std::string>> Get(absl::Span<const std::string> keys,
                                                       absl::Time deadline) = 0;
};

// Validation shared by every store: non-empty keys of at most kMaxKeyBytes,
// values of at most kMaxValueBytes.
constexpr size_t kMaxKeyBytes = 1024;
constexpr size_t kMaxValueBytes = 1 << 20;
absl::Status ValidateKey(const std::string& key);
absl::Status ValidateValue(const std::string& value);

class InMemoryKeyValueStore final : public KeyValueStore {
 public:
  absl::Status Set(const std::string& key, const std::string& value) override;
  absl::StatusOr<std::vector<std::string>> Get(absl::Span<const std::string> keys,
                                               absl::Time deadline) override;
  // Makes every pending and later Get fail with `status` (job failure).
  void Fail(const absl::Status& status);
  // Drops every key for which `drop` says so.
  void EraseIf(const std::function<bool(const std::string&)>& drop);
  size_t size() const;

 private:
  mutable absl::Mutex mu_;
  std::map<std::string, std::string> values_ ABSL_GUARDED_BY(mu_);
  absl::Status failed_ ABSL_GUARDED_BY(mu_);
};

}  // namespace microd::rendezvous
