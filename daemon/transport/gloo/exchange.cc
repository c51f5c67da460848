// SPDX-License-Identifier: Apache-2.0
// The Gloo backend's direct rounds (ExchangeRound, Expect): every rank's
// message to every peer at once, whatever their sizes, in one transfer per
// pair and direction (two past the inline size), receives posted ahead.
#include <cstring>

#include "daemon/transport/gloo/gloo_internal.h"

namespace microd::transport::gloo_backend {

absl::Status GlooTransport::ExchangeRound(std::string_view mine, std::vector<std::string>* from,
                                          const CollectiveOptions& o) {
  if (from == nullptr) return absl::InvalidArgumentError("ExchangeRound: no output");
  return Run("ExchangeRound", o, mine.size(),
             [&](Timeout timeout) { Exchange(mine, from, o, timeout); });
}

void GlooTransport::Expect(uint32_t tag, size_t inline_bytes) {
  if (size() == 1) return;
  std::deque<std::unique_ptr<PostedRound>>& queue = posted_[tag];
  {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return;
  }
  try {
    // Two rounds ahead: a receive's notice takes a one-way trip to reach the
    // sender, so the round right after this one (a cycle after a cycle)
    // finds the next one's notice there already.
    while (queue.size() < kRoundsPosted) queue.push_back(PostRound(tag, inline_bytes));
  } catch (const std::exception& e) {
    // The transport is broken from here on: the next collective says why.
    (void)Break(FromException(e, "Expect", tag));
  }
}

// The inline size (a multiple of 4 KiB, at most kMaxInlineBytes) in the
// slot's low 24 bits, in 4 KiB units: ranks that disagree on it never match
// each other's transfers.
uint64_t GlooTransport::InlineSlot(uint32_t tag, size_t inline_bytes) const {
  static_assert((kMaxInlineBytes >> 12) < (1 << 24), "the inline size fits the slot's low bits");
  // In 64 bits: Slot::operator+ would take the units as a uint8_t.
  return static_cast<uint64_t>(::gloo::Slot::build(kRoundSlotPrefix, tag)) + (inline_bytes >> 12);
}

std::unique_ptr<GlooTransport::PostedRound> GlooTransport::PostRound(uint32_t tag,
                                                                     size_t inline_bytes) {
  auto round = std::make_unique<PostedRound>();
  // At least the model's, rounded up to 4 KiB, at most kMaxInlineBytes.
  inline_bytes = std::max(inline_bytes, model_.InlineBytes());
  inline_bytes = std::min<size_t>((inline_bytes + 4095) / 4096 * 4096, kMaxInlineBytes);
  round->inline_bytes = inline_bytes;
  const int n = size();
  round->inbox.resize(n);
  round->recv.resize(n);
  for (int p = 0; p < n; ++p) {
    if (p == rank()) continue;
    round->inbox[p].reset(new char[round->inline_bytes]);
    round->recv[p] = lanes_[0]->createUnboundBuffer(round->inbox[p].get(), round->inline_bytes);
    round->recv[p]->recv(p, InlineSlot(tag, round->inline_bytes), 0, round->inline_bytes);
  }
  return round;
}

// Every message is its length (8 bytes) and its bytes; the first
// inline_bytes of it go in one transfer, the rest (if any) in a second,
// which the receiver posts once it read the length. Receives posted ahead
// (Expect) make the first transfer leave at once: a send goes only once
// the receiver has posted.
void GlooTransport::Exchange(std::string_view mine, std::vector<std::string>* from,
                             const CollectiveOptions& o, Timeout timeout) {
  const uint32_t tag = o.tag;
  const int n = size();
  const int r = rank();
  from->assign(n, std::string());
  if (n == 1) {
    (*from)[r] = std::string(mine);
    return;
  }
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_ptr<PostedRound> round;
  if (auto it = posted_.find(tag); it != posted_.end() && !it->second.empty()) {
    round = std::move(it->second.front());
    it->second.pop_front();
  } else {
    round = PostRound(tag);
  }
  const size_t inline_bytes = round->inline_bytes;
  std::string out(kRoundLengthBytes + mine.size(), '\0');
  const uint64_t length = mine.size();
  std::memcpy(out.data(), &length, sizeof length);
  if (!mine.empty()) std::memcpy(out.data() + kRoundLengthBytes, mine.data(), mine.size());
  const size_t first = std::min(out.size(), inline_bytes);
  const size_t rest = out.size() - first;
  const uint64_t rest_slot = ::gloo::Slot::build(kRoundRestSlotPrefix, tag);
  ActiveScope scope{this};
  std::unique_ptr<Buffer> send = Track(out.data(), out.size());
  {
    absl::MutexLock lock(&active_mu_);
    for (int p = 0; p < n; ++p) {
      if (p != r) scope.Add(round->recv[p].get());
    }
  }
  int sends = 0, reached = 0;
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    send->send(p, InlineSlot(tag, inline_bytes), 0, first);
    ++sends;
    if (rest > 0) {
      send->send(p, rest_slot, first, rest);
      ++sends;
    }
    if (on_collective_) {  // the test seam: one peer at a time
      for (; sends > 0; --sends) WaitSend(send.get(), deadline);
      on_collective_(tag, ++reached);
    }
  }
  bool spilled = rest > 0;
  std::vector<std::unique_ptr<Buffer>> rest_recv(n);
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    WaitRecv(round->recv[p].get(), deadline);
    uint64_t len = 0;
    std::memcpy(&len, round->inbox[p].get(), sizeof len);
    // Checked before anything is allocated for it.
    if (absl::Status s = CheckRoundLength(len, o, p); !s.ok()) throw record::LinkError(s);
    std::string& msg = (*from)[p];
    msg.resize(len);
    const size_t here = std::min<size_t>(len, inline_bytes - kRoundLengthBytes);
    if (here > 0) std::memcpy(msg.data(), round->inbox[p].get() + kRoundLengthBytes, here);
    if (len > here) {
      spilled = true;
      rest_recv[p] = Track(msg.data() + here, len - here);
      rest_recv[p]->recv(p, rest_slot, 0, len - here);
    }
  }
  for (int p = 0; p < n; ++p) {
    if (rest_recv[p] != nullptr) WaitRecv(rest_recv[p].get(), deadline);
  }
  for (int i = 0; i < sends; ++i) WaitSend(send.get(), deadline);
  // This rank's own message: the one sent, less its length (no second copy
  // of a message that can be tens of MB).
  out.erase(0, kRoundLengthBytes);
  (*from)[r] = std::move(out);
  CountRounds(spilled ? 2 : 1);
}

}  // namespace microd::transport::gloo_backend
