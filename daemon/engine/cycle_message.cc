// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/cycle_message.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace microd::engine {

CycleMessage CycleMessage::Empty(uint64_t ids, uint64_t floats) {
  CycleMessage m;
  m.ids = ids;
  m.ready.assign(BitWords(ids), 0);
  m.sent.assign(BitWords(ids), 0);
  m.area.assign(floats, 0.0f);
  return m;
}

std::vector<uint64_t> CycleMessage::Encode() const {
  const size_t bw = BitWords(ids);
  std::vector<uint64_t> words(Words(ids, area.size()), 0);
  words[0] = batches_received;
  words[1] = ids;
  std::copy(ready.begin(), ready.end(), words.begin() + 2);
  std::copy(sent.begin(), sent.end(), words.begin() + 2 + bw);
  if (!area.empty())
    std::memcpy(words.data() + 2 + 2 * bw, area.data(), area.size() * sizeof(float));
  return words;
}

absl::StatusOr<CycleMessage> CycleMessage::Decode(absl::Span<const uint64_t> words, uint64_t ids,
                                                  uint64_t floats) {
  if (words.size() != Words(ids, floats)) {
    return absl::InvalidArgumentError(
        absl::StrCat("cycle message of ", words.size(), " words, expected ", Words(ids, floats)));
  }
  if (words[1] != ids) {
    return absl::InternalError(absl::StrCat("response cache out of step: it has ", words[1],
                                            " cached buckets, this node ", ids));
  }
  const size_t bw = BitWords(ids);
  CycleMessage m = Empty(ids, floats);
  m.batches_received = words[0];
  std::copy(words.begin() + 2, words.begin() + 2 + bw, m.ready.begin());
  std::copy(words.begin() + 2 + bw, words.begin() + 2 + 2 * bw, m.sent.begin());
  if (floats > 0) std::memcpy(m.area.data(), words.data() + 2 + 2 * bw, floats * sizeof(float));
  return m;
}

CycleAgreement Intersect(const std::vector<CycleMessage>& messages) {
  CycleAgreement a;
  a.batches = messages[0].batches_received;
  a.ready = messages[0].ready;
  a.sent = messages[0].sent;
  for (const CycleMessage& m : messages) {
    a.batches = std::min(a.batches, m.batches_received);
    for (size_t w = 0; w < a.ready.size(); ++w) {
      a.ready[w] &= m.ready[w];
      a.sent[w] &= m.sent[w];
    }
  }
  // A bucket is reduced by the cycle only where it is ready everywhere.
  for (size_t w = 0; w < a.sent.size(); ++w) a.sent[w] &= a.ready[w];
  return a;
}

}  // namespace microd::engine
