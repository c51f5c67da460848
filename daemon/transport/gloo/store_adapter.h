// SPDX-License-Identifier: Apache-2.0
// Inside the Gloo backend (and its benchmark): gloo::rendezvous::Store over
// our KeyValueStore, so Gloo's rendezvous runs through the coordinator.
// Errors become gloo::IoException, as Gloo expects from a store.
#pragma once

#include <gloo/common/error.h>
#include <gloo/rendezvous/store.h>

#include <chrono>
#include <map>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "daemon/rendezvous/kv_store.h"

namespace microd::transport {

class GlooStoreAdapter final : public gloo::rendezvous::Store {
 public:
  GlooStoreAdapter(rendezvous::KeyValueStore* store, std::string prefix, absl::Duration timeout)
      : store_(store), prefix_(std::move(prefix)), timeout_(timeout) {}

  void set(const std::string& key, const std::vector<char>& data) override {
    absl::Status s = store_->Set(Key(key), std::string(data.begin(), data.end()));
    if (!s.ok()) throw gloo::IoException(std::string(s.message()));
  }
  std::vector<char> get(const std::string& key) override {
    const std::string k = Key(key);
    // Gloo waits for a key, then gets it: the wait brought it already (one
    // round trip to the coordinator instead of two, per peer).
    if (auto it = fetched_.find(k); it != fetched_.end()) {
      std::vector<char> out(it->second.begin(), it->second.end());
      fetched_.erase(it);
      return out;
    }
    auto v = store_->Get({&k, 1}, absl::Now() + timeout_);
    if (!v.ok()) throw gloo::IoException(std::string(v.status().message()));
    return std::vector<char>((*v)[0].begin(), (*v)[0].end());
  }
  void wait(const std::vector<std::string>& keys) override {
    wait(keys, std::chrono::milliseconds(absl::ToInt64Milliseconds(timeout_)));
  }
  void wait(const std::vector<std::string>& keys,
            const std::chrono::milliseconds& timeout) override {
    std::vector<std::string> full;
    for (const auto& k : keys) full.push_back(Key(k));
    auto v = store_->Get(full, absl::Now() + absl::FromChrono(timeout));
    if (!v.ok()) throw gloo::IoException(std::string(v.status().message()));
    for (size_t i = 0; i < full.size() && i < v->size(); ++i) fetched_[full[i]] = (*v)[i];
  }

 private:
  std::string Key(const std::string& k) const { return absl::StrCat(prefix_, "/", k); }
  rendezvous::KeyValueStore* const store_;
  const std::string prefix_;
  const absl::Duration timeout_;
  std::map<std::string, std::string> fetched_;  // by wait(), for the get() that follows
};

}  // namespace microd::transport
