// SPDX-License-Identifier: Apache-2.0
// Inside the Gloo backend: the transport class, whose collectives live one
// file each (allgather.cc, allreduce.cc, exchange.cc), as Gloo keeps its
// own. They are written once, against Gloo's unbound buffers: sealing is
// the device's business (record/device.h), below every one of them.
#pragma once

#include <gloo/context.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/common/log.h"
#include "daemon/transport/gloo/record/device.h"
#include "daemon/transport/link_model.h"
#include "daemon/transport/transport.h"

namespace microd::transport::gloo_backend {

// Up to this many elements an allreduce is an allgather plus a local sum.
constexpr size_t kSmallAllreduceElements = 4096;
// Up to this many bytes in all, an allgather is direct: every rank sends its
// block to every peer at once and waits for all of them, one round. Larger
// ones go in n - 1 rounds of a shifted permutation (each rank sends its own
// block to rank r + s and receives rank r - s's in round s: a ring's bytes
// per link, and no rank forwards another's block).
constexpr size_t kDirectAllgatherBytes = 256 << 10;
// Gloo slot prefixes of microd's collectives (Gloo's own use 0x01-0x08).
constexpr uint8_t kDirectAllgatherSlotPrefix = 0x40;
constexpr uint8_t kReduceScatterSlotPrefix = 0x41;
constexpr uint8_t kAllgatherSlotPrefix = 0x42;
// A direct round's first transfer (its size in the slot's low 24 bits) and,
// for a message past the inline size, its second.
constexpr uint8_t kRoundSlotPrefix = 0x43;
constexpr uint8_t kRoundRestSlotPrefix = 0x44;
constexpr uint8_t kStepAllgatherSlotPrefix = 0x45;
// The most of a round message that travels in its first transfer (what a
// pre-posted receive holds per peer).
constexpr size_t kMaxInlineBytes = size_t{64} << 20;
// Rounds of a tag whose receives Expect keeps posted.
constexpr size_t kRoundsPosted = 2;
// A round message says its length first.
constexpr size_t kRoundLengthBytes = sizeof(uint64_t);
// Segments of the large allreduce (allreduce.cc).
constexpr size_t kSegmentBytes = 8 << 20;
constexpr size_t kStepSegmentBytes = 6 << 20;
constexpr size_t kMinSegmentBytes = 1 << 20;
constexpr size_t kMaxSegments = 64;
// A link whose round (not posted ahead) takes this long gets several
// connections per pair by default, and the large allreduce posts ahead.
constexpr double kLongLinkSeconds = 2e-3;
// A large allreduce takes another lane (connection) for every this many
// bytes, up to the lanes there are.
constexpr size_t kLaneBytes = 4 << 20;
// Up to this many bytes converging on one receiver, the large allreduce
// sends each phase's transfers all at once (ReduceBurst).
constexpr size_t kBurstIncastBytes = 128 << 10;

// Gloo matches operations by tag alone: the kind of collective is folded
// into the Gloo tag, so that ranks calling different collectives (a
// contract violation) time out instead of matching.
enum class GlooKind : uint32_t {
  kAllgather = 1,
  kAllgatherV = 2,
  kReduceScatter = 3,
  kBarrier = 4
};
inline uint32_t GlooTag(uint32_t tag, GlooKind kind) {
  return tag * 8 + static_cast<uint32_t>(kind);
}

class GlooTransport final : public Transport {
 public:
  // `lane` carries every collective (AddLanes: more connections, for parts
  // of large allreduces); `device`: its device, for its counters.
  GlooTransport(std::shared_ptr<::gloo::Context> lane, std::shared_ptr<record::Device> device,
                absl::Duration default_timeout, bool sealed, bool confirm);
  // Called as each collective begins, with its tag (GlooOptions).
  void SetOnCollective(std::function<void(uint32_t tag, int peers)> f) {
    on_collective_ = std::move(f);
  }
  void AddLanes(std::vector<std::shared_ptr<::gloo::Context>> lanes,
                std::vector<std::shared_ptr<record::Device>> devices);

  int rank() const override { return lanes_[0]->rank; }
  int size() const override { return lanes_[0]->size; }
  const char* name() const override { return "gloo"; }
  uint64_t scratch_bytes() const override { return scratch_bytes_.load(); }
  bool sealed() const override { return sealed_; }
  uint64_t refused_transfers() const override;

  absl::Status Allgather(const void* in, size_t bytes, void* out,
                         const CollectiveOptions& o) override;
  absl::Status AllgatherV(const void* in, absl::Span<const size_t> recv_bytes, void* out,
                          const CollectiveOptions& o) override;
  absl::Status AllreduceSum(void* data, size_t count, DataType type,
                            const CollectiveOptions& o) override;
  absl::Status AllreduceAverage(float* data, size_t count, float divisor,
                                const CollectiveOptions& o) override;
  absl::Status Barrier(const CollectiveOptions& o) override;
  absl::Status ExchangeRound(std::string_view mine, std::vector<std::string>* from,
                             const CollectiveOptions& o) override;
  void Expect(uint32_t tag, size_t inline_bytes) override;
  bool DirectCheaper(size_t bytes) const override { return model_.DirectCheaper(bytes); }
  absl::Status Confirm(absl::Time deadline) override;
  uint64_t confirmed() const override { return confirmed_.load(); }
  const LinkModel* link_model() const override { return &model_; }
  void Abort(const absl::Status& reason) override;

  // The link model every rank uses, measured (or `given`) and shared.
  absl::Status MeasureLinks(absl::Time deadline, const std::optional<LinkModel>& given);
  size_t lanes() const { return lanes_.size(); }

 private:
  using Buffer = ::gloo::transport::UnboundBuffer;
  using Timeout = std::chrono::milliseconds;

  template <typename Body>
  absl::Status Run(const char* op, const CollectiveOptions& o, size_t bytes, Body body);
  absl::Status Break(absl::Status status);
  absl::Status ShareLinkModel(const LinkModel& mine, const CollectiveOptions& o);

  // Buffers of the collective in flight are tracked so that Abort can wake
  // it: Gloo has no cancellation, but its buffers' waits can be aborted.
  // Each scope (a collective, or one lane's part of it, on its own thread)
  // untracks its own buffers; declare it before the buffers it tracks are
  // freed.
  struct ActiveScope {
    explicit ActiveScope(GlooTransport* transport);
    ~ActiveScope();
    void Add(Buffer* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->active_mu_);
    GlooTransport* const t;
    ActiveScope* const outer;
    std::vector<Buffer*> mine;
    static thread_local ActiveScope* current;
  };
  std::unique_ptr<Buffer> Track(void* ptr, size_t bytes, size_t lane = 0);
  // Every wait of a collective: false (Abort woke it) throws.
  static void WaitRecv(Buffer* b, std::chrono::steady_clock::time_point deadline);
  static void WaitSend(Buffer* b, std::chrono::steady_clock::time_point deadline);

  // allgather.cc
  void GatherFixed(const void* in, size_t bytes, void* out, uint32_t tag, Timeout timeout);
  void GatherV(const void* in, const std::vector<size_t>& bytes, void* out, uint32_t tag,
               Timeout timeout);
  void GatherDirect(const void* in, const std::vector<size_t>& bytes, void* out, uint32_t tag,
                    Timeout timeout);
  void GatherInSteps(const void* in, const std::vector<size_t>& bytes, void* out, uint32_t tag,
                     Timeout timeout);

  // exchange.cc: a direct round's receives, posted (by Expect, or by
  // Exchange itself): one buffer of the inline size per peer.
  struct PostedRound {
    size_t inline_bytes = 0;
    std::vector<std::unique_ptr<char[]>> inbox;
    std::vector<std::unique_ptr<Buffer>> recv;
  };
  uint64_t InlineSlot(uint32_t tag, size_t inline_bytes) const;
  std::unique_ptr<PostedRound> PostRound(uint32_t tag, size_t inline_bytes = 0);
  void Exchange(std::string_view mine, std::vector<std::string>* from, const CollectiveOptions& o,
                Timeout timeout);

  // allreduce.cc (`divisor`, floats only, 0: none, divides every sum)
  template <typename T>
  void Reduce(T* data, size_t count, uint32_t tag, Timeout timeout, float divisor = 0);
  template <typename T>
  void ReduceBurst(T* data, size_t count, uint32_t tag, Timeout timeout, float divisor);
  template <typename T>
  void ReduceLarge(T* data, size_t count, uint32_t tag, Timeout timeout, float divisor);
  template <typename T>
  void ReduceLargeOn(size_t lane, T* data, size_t count, uint32_t tag, Timeout timeout,
                     float divisor);
  // One large allreduce on one lane: its plan, buffers and rounds.
  template <typename T>
  class LargeReduce;
  void ReduceAny(void* data, size_t count, DataType type, uint32_t tag, Timeout timeout);

  // Working memory of the large allreduce, one per lane, kept between
  // calls (a fresh buffer of a large bucket's size costs its page faults on
  // every step); far larger than asked (over 4x, and over 16 MiB) it is
  // given back. One collective at a time, one thread per lane: no lock.
  struct Scratchpad {
    std::unique_ptr<char[]> bytes;
    size_t size = 0;
  };
  void* Scratch(size_t bytes, size_t lane = 0);

  std::vector<std::shared_ptr<::gloo::Context>> lanes_;
  std::vector<std::shared_ptr<record::Device>> devices_;
  const absl::Duration default_timeout_;
  const bool sealed_;
  const bool confirm_;           // Confirm takes a round
  bool confirm_posted_ = false;  // its receives were posted (engine thread only)
  std::atomic<uint64_t> confirmed_{0};
  LinkModel model_;  // the same on every rank (MeasureLinks)
  // Rounds whose receives Expect posted, by tag (engine thread only).
  std::map<uint32_t, std::deque<std::unique_ptr<PostedRound>>> posted_;
  std::vector<Scratchpad> scratch_;
  std::atomic<uint64_t> scratch_bytes_{0};  // over every lane's scratch
  absl::Mutex mu_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  std::function<void(uint32_t tag, int peers)> on_collective_;
  absl::Mutex active_mu_;
  std::vector<Buffer*> active_ ABSL_GUARDED_BY(active_mu_);
  bool aborted_ ABSL_GUARDED_BY(active_mu_) = false;
};

// What a Gloo exception says, as a Status: a failed link's own (the
// device's LinkError), else by Gloo's words (timeouts: DeadlineExceeded).
absl::Status FromException(const std::exception& e, const char* op, uint32_t tag);

template <typename Body>
absl::Status GlooTransport::Run(const char* op, const CollectiveOptions& o, size_t bytes,
                                Body body) {
  if (on_collective_) on_collective_(o.tag, 0);
  {
    absl::MutexLock lock(&mu_);
    if (!broken_.ok()) return broken_;
  }
  const absl::Time now = absl::Now();
  const absl::Time deadline =
      o.deadline == absl::InfiniteFuture() ? now + default_timeout_ : o.deadline;
  if (deadline <= now) {
    return Break(absl::DeadlineExceededError(
        absl::StrCat("gloo ", op, " tag ", o.tag, ": deadline already passed")));
  }
  const auto timeout =
      std::chrono::milliseconds(std::max<int64_t>(1, absl::ToInt64Milliseconds(deadline - now)));
  try {
    body(timeout);
  } catch (const std::exception& e) {
    return Break(FromException(e, op, o.tag));
  }
  // Off by default (--log_level=debug): one relaxed load when off.
  MICROD_LOG(Debug, "gloo %s tag %u (slot %u, kind %u): %zu bytes from rank %d of %d, %.3f ms", op,
             o.tag, o.tag >> 8, o.tag & 0xffu, bytes, rank(), size(),
             absl::ToDoubleMilliseconds(absl::Now() - now));
  absl::MutexLock lock(&mu_);
  return broken_;  // an abort during the call fails it even if Gloo returned
}

}  // namespace microd::transport::gloo_backend
