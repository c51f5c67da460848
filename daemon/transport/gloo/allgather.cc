// SPDX-License-Identifier: Apache-2.0
// The Gloo backend's allgathers (fixed and variable size) and barrier.
// Small ones are one direct round (every rank's block to every peer at
// once); larger ones n - 1 rounds of a shifted permutation, in step. No
// rank ever forwards another's block (as a ring does): what a rank
// receives comes over the link of the rank that wrote it, so a sealed
// link's authentication names the block's author.
#include <cstring>

#include "daemon/transport/gloo/gloo_internal.h"

namespace microd::transport::gloo_backend {

absl::Status GlooTransport::Allgather(const void* in, size_t bytes, void* out,
                                      const CollectiveOptions& o) {
  if (absl::Status s = CheckBuffers("Allgather", bytes, in, out); !s.ok()) return s;
  return Run("Allgather", o, bytes, [&](Timeout timeout) {
    GatherFixed(in, bytes, out, GlooTag(o.tag, GlooKind::kAllgather), timeout);
  });
}

absl::Status GlooTransport::AllgatherV(const void* in, absl::Span<const size_t> recv_bytes,
                                       void* out, const CollectiveOptions& o) {
  if (absl::Status s = CheckAllgatherV(rank(), size(), in, recv_bytes, out); !s.ok()) return s;
  return Run("AllgatherV", o, recv_bytes[rank()], [&](Timeout timeout) {
    GatherV(in, std::vector<size_t>(recv_bytes.begin(), recv_bytes.end()), out,
            GlooTag(o.tag, GlooKind::kAllgatherV), timeout);
  });
}

// An allgather of one byte: unlike gloo::barrier it can be aborted.
absl::Status GlooTransport::Barrier(const CollectiveOptions& o) {
  return Run("Barrier", o, 1, [&](Timeout timeout) {
    char mine = 1;
    std::vector<char> all(size());
    GatherFixed(&mine, 1, all.data(), GlooTag(o.tag, GlooKind::kBarrier), timeout);
  });
}

void GlooTransport::GatherFixed(const void* in, size_t bytes, void* out, uint32_t tag,
                                Timeout timeout) {
  GatherV(in, std::vector<size_t>(size(), bytes), out, tag, timeout);
}

void GlooTransport::GatherV(const void* in, const std::vector<size_t>& bytes, void* out,
                            uint32_t tag, Timeout timeout) {
  size_t total = 0;
  for (size_t b : bytes) total += b;
  if (total == 0) return;
  if (size() == 1) {
    std::memmove(out, in, bytes[0]);
    return;
  }
  if (total <= kDirectAllgatherBytes) {
    GatherDirect(in, bytes, out, tag, timeout);
  } else {
    GatherInSteps(in, bytes, out, tag, timeout);
  }
}

// Rank q's bytes[q] from every rank at once, into `out` in rank order: one
// round. A transfer's slot carries its size (below 2^24 here: the slot's
// low 24 bits, which Gloo leaves to the collective), so ranks that disagree
// on a size never match each other's transfers: the call fails by its
// deadline.
void GlooTransport::GatherDirect(const void* in, const std::vector<size_t>& bytes, void* out,
                                 uint32_t tag, Timeout timeout) {
  const int n = size();
  const int r = rank();
  std::vector<size_t> at(n, 0);
  for (int q = 1; q < n; ++q) at[q] = at[q - 1] + bytes[q - 1];
  const size_t total = at[n - 1] + bytes[n - 1];
  char* const dst = static_cast<char*>(out);
  if (bytes[r] > 0) std::memmove(dst + at[r], in, bytes[r]);
  CountRounds(1);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  // The buffers outlive the scope: Abort may touch them until it untracks.
  std::unique_ptr<Buffer> send, recv;
  ActiveScope scope{this};
  char dummy = 0;
  send = Track(bytes[r] > 0 ? const_cast<void*>(in) : &dummy, bytes[r]);
  recv = Track(total > 0 ? out : &dummy, total);
  const uint64_t slot = ::gloo::Slot::build(kDirectAllgatherSlotPrefix, tag);
  static_assert(kDirectAllgatherBytes < (size_t{1} << 24), "sizes fit the slot's low bits");
  int recvs = 0, sends = 0;
  for (int p = 0; p < n; ++p) {
    if (p == r) continue;
    if (bytes[p] > 0) {
      recv->recv(p, slot + bytes[p], at[p], bytes[p]);
      ++recvs;
    }
    if (bytes[r] > 0) {
      send->send(p, slot + bytes[r]);
      ++sends;
    }
  }
  for (int i = 0; i < recvs; ++i) WaitRecv(recv.get(), deadline);
  for (int i = 0; i < sends; ++i) WaitSend(send.get(), deadline);
}

// In round s (1 to n - 1) rank r sends its own block to rank r + s and
// receives rank r - s's, every rank in step: a ring's bytes per link, n - 1
// rounds, each link carrying one transfer each way at a time.
void GlooTransport::GatherInSteps(const void* in, const std::vector<size_t>& bytes, void* out,
                                  uint32_t tag, Timeout timeout) {
  const int n = size();
  const int r = rank();
  std::vector<size_t> at(n, 0);
  for (int q = 1; q < n; ++q) at[q] = at[q - 1] + bytes[q - 1];
  char* const dst = static_cast<char*>(out);
  if (bytes[r] > 0) std::memmove(dst + at[r], in, bytes[r]);
  CountRounds(n - 1);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  std::unique_ptr<Buffer> send, recv;
  ActiveScope scope{this};
  send = Track(dst + at[r], bytes[r]);
  recv = Track(dst, at[n - 1] + bytes[n - 1]);
  const uint64_t slot = ::gloo::Slot::build(kStepAllgatherSlotPrefix, tag);
  for (int s = 1; s < n; ++s) {
    const int to = (r + s) % n;
    const int from = (r - s + n) % n;
    // The size's low bits in the slot: ranks that disagree on a block's
    // size do not match (a message longer than its receive fails the link).
    if (bytes[from] > 0) recv->recv(from, slot + (bytes[from] & 0xffffff), at[from], bytes[from]);
    if (bytes[r] > 0) send->send(to, slot + (bytes[r] & 0xffffff));
    if (bytes[from] > 0) WaitRecv(recv.get(), deadline);
    if (bytes[r] > 0) WaitSend(send.get(), deadline);
  }
}

}  // namespace microd::transport::gloo_backend
