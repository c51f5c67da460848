// SPDX-License-Identifier: Apache-2.0
// The fence (MICROD_WIRE_CAP_FENCE): a submission a local process made
// before it read the job's latest change of membership is not for the new
// epoch. Per connected process, the changes it must have read; a change is
// made (Change), then told to every process (Told). A submission the fence
// refuses while a change is being told is parked and answered once it is
// (the process learns its place first). Not thread-safe: under the
// engine's lock.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace microd::engine {

class Fence {
 public:
  struct Parked {
    uint64_t client = 0;
    uint32_t buffer_id = 0;
    uint64_t ticket = 0;
    std::string bucket;
  };
  enum class Verdict { kPass, kPark, kRefuse };

  void Connect(uint64_t client) { need_[client] = 0; }
  void Disconnect(uint64_t client) { need_.erase(client); }
  // A submission of `client`, which had read `seen` changes (none: a
  // process that does not speak the fence, which passes).
  Verdict Check(uint64_t client, std::optional<uint32_t> seen) const {
    auto it = need_.find(client);
    if (!seen.has_value() || it == need_.end() || *seen >= it->second) return Verdict::kPass;
    return changes_ > told_ ? Verdict::kPark : Verdict::kRefuse;
  }
  void Park(Parked p) { parked_.push_back(std::move(p)); }
  // A change of membership: every connected process must read it.
  void Change() {
    ++changes_;
    for (auto& [client, need] : need_) ++need;
  }
  // The change told to every process: the submissions parked meanwhile.
  std::vector<Parked> Told() {
    told_ = changes_;
    return TakeParked();
  }
  // The job ended: the submissions parked, to answer with the failure.
  std::vector<Parked> TakeParked() {
    std::vector<Parked> out;
    out.swap(parked_);
    return out;
  }

 private:
  std::map<uint64_t, uint32_t> need_;  // by client
  uint64_t changes_ = 0;
  uint64_t told_ = 0;
  std::vector<Parked> parked_;
};

}  // namespace microd::engine
