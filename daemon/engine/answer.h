// SPDX-License-Identifier: Apache-2.0
// The answer owed to the submissions of one bucket's step: which local
// process (client), ticket and buffer id to complete, by local rank (ticket 0:
// that rank did not submit). Finish answers every submission exactly once,
// however often and from whichever thread it is called (the step's end, a
// failure of the job that ends every step in flight): the first call
// completes them, later calls do nothing.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <vector>

#include "absl/status/status.h"

namespace microd::engine {

class Answer {
 public:
  using Complete = std::function<void(uint64_t client, uint64_t ticket, uint32_t buffer_id,
                                      const absl::Status& status)>;
  Answer(std::vector<uint64_t> clients, std::vector<uint64_t> tickets,
         std::vector<uint32_t> buffer_ids)
      : clients_(std::move(clients)),
        tickets_(std::move(tickets)),
        buffer_ids_(std::move(buffer_ids)) {}
  Answer(const Answer&) = delete;
  Answer& operator=(const Answer&) = delete;

  // True for the call that answered.
  bool Finish(const absl::Status& status, const Complete& complete) {
    if (finished_.exchange(true)) return false;
    for (size_t r = 0; r < tickets_.size(); ++r) {
      if (tickets_[r] != 0) complete(clients_[r], tickets_[r], buffer_ids_[r], status);
    }
    return true;
  }
  bool finished() const { return finished_.load(); }

 private:
  const std::vector<uint64_t> clients_, tickets_;
  const std::vector<uint32_t> buffer_ids_;
  std::atomic<bool> finished_{false};
};

}  // namespace microd::engine
