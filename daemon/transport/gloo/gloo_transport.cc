// Gloo backend. Gloo throws; every exception is caught here and becomes a
// Status, after which the transport is broken (all later calls fail at once).
//
// AllreduceSum is a reduce-scatter (rank j receives chunk j from every rank)
// summed in rank order, then an allgather of the summed chunks, pipelined in
// segments and sent in rounds of a shifted permutation (ReduceLarge): the
// bytes and link use of a ring, and the same bits as the in-process backend,
// so results do not depend on the backend. Small ones (histograms, a few
// values) are an allgather and a rank-order sum on every rank: one round
// (a direct exchange with every peer, not Gloo's ring, while they are small).
#include "daemon/transport/gloo/gloo_transport.h"

#include <gloo/allgather.h>
#include <gloo/allgatherv.h>
#include <gloo/common/error.h>
#include <gloo/rendezvous/context.h>
#include <gloo/rendezvous/store.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/unbound_buffer.h>
#include <gloo/types.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <future>
#include <map>
#include <memory>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/common/status_macros.h"
#include "daemon/transport/gloo/store_adapter.h"
#include "daemon/transport/half_sum.h"
#include "daemon/transport/link_model.h"

namespace microd::transport {
namespace {

absl::Status FromException(const std::exception& e, const char* op, uint32_t tag) {
  const std::string what = e.what();
  const std::string msg = absl::StrCat("gloo ", op, " tag ", tag, ": ", what);
  if (absl::StrContains(what, "Timed out") || absl::StrContains(what, "timed out") ||
      absl::StrContains(what, "Timeout")) {
    return absl::DeadlineExceededError(msg);
  }
  return absl::UnavailableError(msg);
}

// The control tag's slot of Confirm's rounds (the links' probes take 1-4).
constexpr uint32_t kConfirmSlot = 6;

// Up to this many elements an allreduce is an allgather plus a local sum.
constexpr size_t kSmallAllreduceElements = 4096;

// Up to this many bytes in all, an allgather is direct: every rank sends its
// block to every peer at once over Gloo's point-to-point buffers and waits
// for all of them, one round, where Gloo's ring takes n - 1 rounds one after
// another (each a wake-up on every rank: what a small bucket's latency is
// made of). Larger ones use Gloo's ring, which moves fewer bytes per link.
constexpr size_t kDirectAllgatherBytes = 256 << 10;
// Gloo slot prefixes of the direct allgather and of the large allreduce's
// two phases (Gloo's own collectives use 0x01-0x08).
constexpr uint8_t kDirectAllgatherSlotPrefix = 0x40;
constexpr uint8_t kReduceScatterSlotPrefix = 0x41;
constexpr uint8_t kAllgatherSlotPrefix = 0x42;
// A direct round's first transfer (its size in the slot's low 24 bits) and,
// for a message past the inline size, its second.
constexpr uint8_t kRoundSlotPrefix = 0x43;
constexpr uint8_t kRoundRestSlotPrefix = 0x44;
// The most of a round message that travels in its first transfer (what a
// pre-posted receive holds per peer).
constexpr size_t kMaxInlineBytes = size_t{64} << 20;
// Rounds of a tag whose receives Expect keeps posted.
constexpr size_t kRoundsPosted = 2;
// A round message says its length first.
constexpr size_t kRoundLengthBytes = sizeof(uint64_t);
// No message of a round is longer (a peer's length past it is a bad peer).
constexpr uint64_t kMaxRoundBytes = uint64_t{1} << 32;
// Segments of the large allreduce: about this many bytes of a chunk each,
// at most kMaxSegments (slot deltas are 8 bits). On a long link (rounds
// posted ahead, each costing a one-way trip) a segment is kSegmentBytes; in
// step, what a rank receives of one segment from all its peers together is
// kStepSegmentBytes (the scratch holds two such), at least
// kMinSegmentBytes a peer.
constexpr size_t kSegmentBytes = 8 << 20;
constexpr size_t kStepSegmentBytes = 6 << 20;
constexpr size_t kMinSegmentBytes = 1 << 20;
constexpr size_t kMaxSegments = 64;
// A link whose round (not posted ahead) takes this long gets several
// connections per pair by default.
constexpr double kLongLinkSeconds = 2e-3;
// A large allreduce takes another lane (connection) for every this many
// bytes, up to the lanes there are.
constexpr size_t kLaneBytes = 4 << 20;
// Up to this many bytes converging on one receiver, the large allreduce
// sends each phase's transfers all at once (ReduceBurst).
constexpr size_t kBurstIncastBytes = 128 << 10;

// Sealed transfers (GlooOptions::seal): each transfer's number for its
// direction's key is the call's ordinal (every rank makes the same calls in
// the same order) and what the transfer is within the call: its kind, its
// lane and an item (a segment, a block), so no number repeats for a key and
// a transfer replayed into another call, phase or segment does not open.
enum class SealKind : uint64_t {
  kDirect = 1,       // a direct allgather's block (every reader alike)
  kRoundHeader = 2,  // a round message's length
  kRoundBody = 3,    // a round message's bytes
  kRing = 4,         // a block of Gloo's ring allgather (forwarded unchanged)
  kScatter = 5,      // a contribution to a chunk's owner (reduce-scatter)
  kGather = 6,       // a summed segment sent to every rank (allgather)
};
// A round message's sealed length, before its sealed bytes.
constexpr size_t kSealedHeaderBytes = sizeof(uint64_t) + SealKeys::kOverhead;

// A transfer that failed verification, or could not be sealed: its status
// fails the call (a DataLoss naming the link).
struct SealFailure : std::runtime_error {
  explicit SealFailure(absl::Status s) : std::runtime_error("seal"), status(std::move(s)) {}
  absl::Status status;
};

// Gloo matches operations by tag alone and aborts the process when two
// ranks use one tag for buffers of different sizes. The kind of collective
// is folded into the Gloo tag, so that ranks calling different collectives
// (a contract violation) time out instead.
enum class GlooKind : uint32_t {
  kAllgather = 1,
  kAllgatherV = 2,
  kReduceScatter = 3,
  kBarrier = 4
};
uint32_t GlooTag(uint32_t tag, GlooKind kind) { return tag * 8 + static_cast<uint32_t>(kind); }

// A test hook: MICROD_TEST_EXIT_AT="KIND:N" ends this process at once, as a
// SIGKILL would (no goodbye; the kernel closes its connections), when it
// enters its N-th collective with a tag of kind KIND (TagKind's values), in
// any epoch's data plane: the end-to-end tests lose a node in a given phase
// of a step. Not a flag, and unset in production.
void MaybeExitForTest(uint32_t tag) {
  static const std::pair<long, long> at = [] {
    long kind = -1, n = 0;
    if (const char* v = std::getenv("MICROD_TEST_EXIT_AT"); v != nullptr) {
      if (std::sscanf(v, "%ld:%ld", &kind, &n) != 2 || n < 1) kind = -1;
    }
    return std::make_pair(kind, n);
  }();
  static std::atomic<long> seen{0};
  if (at.first < 0 || static_cast<long>(tag & 0xffu) != at.first) return;
  if (seen.fetch_add(1) + 1 != at.second) return;
  std::fprintf(stderr, "MICROD_TEST_EXIT_AT=%ld:%ld: exiting in the collective of tag %u\n",
               at.first, at.second, tag);
  std::fflush(stderr);
  std::_Exit(137);
}

class GlooTransport final : public Transport {
 public:
  GlooTransport(std::shared_ptr<gloo::Context> context, absl::Duration default_timeout,
                std::shared_ptr<const SealKeys> seal, bool confirm)
      : lanes_{std::move(context)},
        default_timeout_(default_timeout),
        seal_(std::move(seal)),
        confirm_(confirm),
        scratch_(1),
        seal_scratch_(1) {}

  int rank() const override { return lanes_[0]->rank; }
  int size() const override { return lanes_[0]->size; }
  const char* name() const override { return "gloo"; }
  uint64_t scratch_bytes() const override { return scratch_bytes_.load(); }
  bool sealed() const override { return seal_ != nullptr; }
  uint64_t refused_transfers() const override { return refused_.load(); }

  absl::Status Allgather(const void* in, size_t bytes, void* out,
                         const CollectiveOptions& o) override {
    if (absl::Status s = CheckBuffers("Allgather", bytes, in, out); !s.ok()) return s;
    return Run("Allgather", o, [&](std::chrono::milliseconds timeout) {
      if (bytes == 0) return;
      if (size() == 1) {
        std::memmove(out, in, bytes);
        return;
      }
      GatherFixed(const_cast<void*>(in), bytes, out, GlooTag(o.tag, GlooKind::kAllgather), timeout);
    });
  }

  absl::Status ExchangeRound(std::string_view mine, std::vector<std::string>* from,
                             const CollectiveOptions& o) override {
    if (from == nullptr) return absl::InvalidArgumentError("ExchangeRound: no output");
    return Run("ExchangeRound", o,
               [&](std::chrono::milliseconds timeout) { Exchange(mine, from, o.tag, timeout); });
  }

  void Expect(uint32_t tag, size_t inline_bytes) override {
    if (size() == 1) return;
    std::deque<std::unique_ptr<PostedRound>>& queue = posted_[tag];
    {
      absl::MutexLock lock(&mu_);
      if (!broken_.ok()) return;
    }
    try {
      // Two rounds ahead: a receive's notice takes a one-way trip to reach
      // the sender, so the round right after this one (a cycle after a
      // cycle) finds the next one's notice there already.
      while (queue.size() < kRoundsPosted) queue.push_back(PostRound(tag, inline_bytes));
    } catch (const std::exception& e) {
      Break(FromException(e, "Expect", tag));
    }
  }

  bool DirectCheaper(size_t bytes) const override { return model_.DirectCheaper(bytes); }

  // An empty direct round with its receives posted ahead (a one-way trip).
  absl::Status Confirm(absl::Time deadline) override {
    if (!confirm_ || size() == 1) return absl::OkStatus();
    CollectiveOptions o;
    o.tag = MakeTag(kConfirmSlot, TagKind::kControl);
    o.deadline = deadline;
    if (!confirm_posted_) {
      Expect(o.tag, 0);
      confirm_posted_ = true;
    }
    std::vector<std::string> from;
    absl::Status s = ExchangeRound("", &from, o);
    Expect(o.tag, 0);  // the next Confirm's
    return s;
  }

  // The link model every rank uses: each rank times direct rounds of a few
  // bytes, without and with their receives posted ahead (the latencies),
  // and posted ones of 60 and 240 KiB to every peer (the bandwidth, from
  // the difference: what a round's first flight costs cancels out); then
  // all take the slowest of each (LinkModel::Combine). A `given` model
  // replaces this rank's probes.
  absl::Status MeasureLinks(absl::Time deadline, const std::optional<LinkModel>& given) {
    model_.ranks = size();
    if (size() == 1) return absl::OkStatus();
    CollectiveOptions o;
    o.deadline = deadline;
    o.tag = MakeTag(0, TagKind::kControl);
    if (given.has_value()) {
      LinkModel mine = *given;
      mine.ranks = size();
      return ShareLinkModel(mine, o);
    }
    std::vector<std::string> from;
    // Each kind of probe round its own tag (slots 1-4 of the control tags).
    auto timed = [&](size_t bytes, bool posted) -> absl::StatusOr<double> {
      const std::string mine(bytes, 'x');
      CollectiveOptions r = o;
      r.tag = MakeTag(!posted               ? 1
                      : bytes <= 8          ? 2
                      : bytes <= (64 << 10) ? 3
                                            : 4,
                      TagKind::kControl);
      if (posted) {
        Expect(r.tag, bytes + 4096);
        // The others post theirs too before anyone sends: a round apart.
        RETURN_IF_ERROR(ExchangeRound("", &from, o));
      }
      const absl::Time t0 = absl::Now();
      RETURN_IF_ERROR(ExchangeRound(mine, &from, r));
      return absl::ToDoubleSeconds(absl::Now() - t0);
    };
    // The fastest of each: what the link does (the daemons start at once,
    // and a busy machine only ever adds to a round).
    auto fastest = [](const std::vector<double>& v) {
      return *std::min_element(v.begin(), v.end());
    };
    std::vector<double> cold, posted, small, large;
    for (int i = 0; i < 5; ++i) {
      ASSIGN_OR_RETURN(const double t, timed(8, false));
      cold.push_back(t);
    }
    for (int i = 0; i < 5; ++i) {
      ASSIGN_OR_RETURN(const double t, timed(8, true));
      posted.push_back(t);
    }
    constexpr size_t kSmall = 60 << 10, kLarge = 240 << 10;
    for (int i = 0; i < 2; ++i) {
      ASSIGN_OR_RETURN(const double a, timed(kSmall, true));
      small.push_back(a);
      ASSIGN_OR_RETURN(const double b, timed(kLarge, true));
      large.push_back(b);
    }
    LinkModel mine;
    mine.ranks = size();
    mine.round_seconds = fastest(cold);
    mine.posted_round_seconds = std::min(fastest(posted), mine.round_seconds);
    const double extra = *std::min_element(large.begin(), large.end()) -
                         *std::min_element(small.begin(), small.end());
    mine.bytes_per_second =
        static_cast<double>(size() - 1) * (kLarge - kSmall) / std::max(extra, 1e-6);
    return ShareLinkModel(mine, o);
  }
  absl::Status ShareLinkModel(const LinkModel& mine, const CollectiveOptions& o) {
    std::vector<LinkModel> all(size());
    RETURN_IF_ERROR(Allgather(&mine, sizeof mine, all.data(), o));
    model_ = LinkModel::Combine(all);
    return absl::OkStatus();
  }
  const LinkModel* link_model() const override { return &model_; }

  absl::Status AllgatherV(const void* in, absl::Span<const size_t> recv_bytes, void* out,
                          const CollectiveOptions& o) override {
    if (absl::Status s = CheckAllgatherV(rank(), size(), in, recv_bytes, out); !s.ok()) return s;
    return Run("AllgatherV", o, [&](std::chrono::milliseconds timeout) {
      GatherV(in, std::vector<size_t>(recv_bytes.begin(), recv_bytes.end()), out,
              GlooTag(o.tag, GlooKind::kAllgatherV), timeout);
    });
  }

  absl::Status AllreduceSum(void* data, size_t count, DataType type,
                            const CollectiveOptions& o) override {
    if (count > 0 && data == nullptr) return absl::InvalidArgumentError("AllreduceSum: null data");
    return Run("AllreduceSum", o, [&](std::chrono::milliseconds timeout) {
      if (count == 0 || size() == 1) return;
      switch (type) {
        case DataType::kFloat32:
          Reduce(static_cast<float*>(data), count, o.tag, timeout);
          break;
        case DataType::kInt32:
          Reduce(static_cast<int32_t*>(data), count, o.tag, timeout);
          break;
        case DataType::kInt64:
          Reduce(static_cast<int64_t*>(data), count, o.tag, timeout);
          break;
        case DataType::kBFloat16:
          Reduce(static_cast<Bf16*>(data), count, o.tag, timeout);
          break;
        case DataType::kFloat16:
          Reduce(static_cast<F16*>(data), count, o.tag, timeout);
          break;
      }
    });
  }

  absl::Status AllreduceAverage(float* data, size_t count, float divisor,
                                const CollectiveOptions& o) override {
    if (count > 0 && data == nullptr) {
      return absl::InvalidArgumentError("AllreduceAverage: null data");
    }
    return Run("AllreduceAverage", o, [&](std::chrono::milliseconds timeout) {
      if (count == 0) return;
      if (size() == 1) {
        for (size_t i = 0; i < count; ++i) data[i] /= divisor;
        return;
      }
      Reduce(data, count, o.tag, timeout, divisor);
    });
  }

  // An allgather of one byte: unlike gloo::barrier it can be aborted.
  absl::Status Barrier(const CollectiveOptions& o) override {
    return Run("Barrier", o, [&](std::chrono::milliseconds timeout) {
      if (size() == 1) return;
      char mine = 1;
      std::vector<char> all(size());
      GatherFixed(&mine, 1, all.data(), GlooTag(o.tag, GlooKind::kBarrier), timeout);
    });
  }

  void Abort(const absl::Status& reason) override {
    {
      absl::MutexLock lock(&mu_);
      if (broken_.ok()) {
        broken_ = absl::AbortedError(absl::StrCat("gloo transport aborted: ", reason.message()));
      }
    }
    // Wake a collective blocked on this rank. Gloo consumes an abort with
    // the one wait it ends, and its algorithms go on to their next wait, so
    // keep aborting until the collective has left (its buffers untracked),
    // for a bounded time.
    const absl::Time give_up = absl::Now() + absl::Seconds(2);
    for (bool first = true;; first = false) {
      {
        absl::MutexLock lock(&active_mu_);
        aborted_ = true;
        if (!first && active_.empty()) break;
        for (gloo::transport::UnboundBuffer* b : active_) {
          b->abortWaitRecv();
          b->abortWaitSend();
        }
      }
      if (absl::Now() > give_up) break;
      absl::SleepFor(absl::Milliseconds(5));
    }
    // Closing the connections makes a blocked call on this rank fail, and
    // every peer's calls fail when they notice the closed sockets.
    for (auto& lane : lanes_) {
      try {
        lane->closeConnections();
      } catch (const std::exception&) {
      }
    }
  }

  // Connections beyond the first (each lane a full mesh of its own): a large
  // allreduce is cut into one part per lane, reduced at once.
  void AddLanes(std::vector<std::shared_ptr<gloo::Context>> lanes) {
    for (auto& l : lanes) lanes_.push_back(std::move(l));
    scratch_.resize(lanes_.size());
    seal_scratch_.resize(lanes_.size());
    model_.connections = static_cast<int>(lanes_.size());
  }
  size_t lanes() const { return lanes_.size(); }

 private:
  template <typename Body>
  absl::Status Run(const char* op, const CollectiveOptions& o, Body body) {
    MaybeExitForTest(o.tag);
    call_ = ++calls_;  // counted on every rank alike, whatever happens next
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
    } catch (const SealFailure& e) {
      return Break(e.status);
    } catch (const std::exception& e) {
      return Break(FromException(e, op, o.tag));
    }
    absl::MutexLock lock(&mu_);
    return broken_;  // an abort during the call fails it even if Gloo returned
  }

  // Buffers of the collective in flight are tracked so that Abort can wake
  // it: gloo has no cancellation, but its buffers' waits can be aborted.
  // Declare an ActiveScope after the collective's options object, so that the
  // buffers are untracked before the options free them.
  // Each scope (a collective, or one lane's part of it, on its own thread)
  // untracks its own buffers.
  struct ActiveScope {
    explicit ActiveScope(GlooTransport* transport) : t(transport), outer(current) {
      current = this;
    }
    ~ActiveScope() {
      current = outer;
      absl::MutexLock lock(&t->active_mu_);
      for (gloo::transport::UnboundBuffer* b : mine) {
        auto it = std::find(t->active_.begin(), t->active_.end(), b);
        if (it != t->active_.end()) t->active_.erase(it);
      }
    }
    void Add(gloo::transport::UnboundBuffer* b) ABSL_EXCLUSIVE_LOCKS_REQUIRED(t->active_mu_) {
      t->active_.push_back(b);
      mine.push_back(b);
    }
    GlooTransport* const t;
    ActiveScope* const outer;
    std::vector<gloo::transport::UnboundBuffer*> mine;
    static thread_local ActiveScope* current;
  };
  std::unique_ptr<gloo::transport::UnboundBuffer> Track(void* ptr, size_t bytes, size_t lane = 0) {
    auto b = lanes_[lane]->createUnboundBuffer(ptr, bytes);
    absl::MutexLock lock(&active_mu_);
    // Aborted before the collective began waiting: do not start it (Run
    // turns this into the transport's broken status).
    if (aborted_) throw std::runtime_error("transport aborted");
    if (ActiveScope::current != nullptr) ActiveScope::current->Add(b.get());
    return b;
  }

  // The number of a call's transfer (see SealKind).
  uint64_t Sequence(SealKind kind, size_t item, size_t lane = 0) const {
    return (call_ << 24) | (static_cast<uint64_t>(lane) << 20) |
           (static_cast<uint64_t>(kind) << 16) | (item & 0xffff);
  }
  // Seals `size` bytes for `receiver` (SealKeys::kAll: every peer reads the
  // same bytes) into `out` (size + SealKeys::kOverhead bytes).
  void SealFor(int receiver, uint32_t tag, uint64_t sequence, const void* plain, size_t size,
               void* out) const {
    if (absl::Status s = seal_->Seal(rank(), receiver, tag, sequence, plain, size, out); !s.ok()) {
      throw SealFailure(std::move(s));
    }
  }
  // Opens what `sender` sealed for `receiver` (this rank or kAll) into
  // `out`, which is written only once the transfer verified.
  void OpenFrom(int sender, int receiver, uint32_t tag, uint64_t sequence, const void* sealed,
                size_t sealed_size, void* out) {
    if (absl::Status s =
            seal_->Open(sender, receiver, tag, sequence, sealed, sealed_size, out, rank());
        !s.ok()) {
      if (absl::IsDataLoss(s)) ++refused_;
      throw SealFailure(std::move(s));
    }
  }

  void GatherFixed(void* in, size_t bytes, void* out, uint32_t tag,
                   std::chrono::milliseconds timeout) {
    if (bytes * size() <= kDirectAllgatherBytes) {
      GatherDirect(in, bytes, out, tag, timeout);
      return;
    }
    if (seal_ != nullptr) {
      GatherSealed(in, std::vector<size_t>(size(), bytes), out, tag, timeout, /*direct=*/false);
      return;
    }
    CountRounds(size() - 1);  // Gloo's ring
    gloo::AllgatherOptions opts(lanes_[0]);
    ActiveScope scope{this};
    opts.setInput<char>(Track(in, bytes));
    opts.setOutput<char>(Track(out, bytes * size()));
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::allgather(opts);
  }

  void GatherDirect(void* in, size_t bytes, void* out, uint32_t tag,
                    std::chrono::milliseconds timeout) {
    GatherDirectV(in, std::vector<size_t>(size(), bytes), out, tag, timeout);
  }

  // Rank q's bytes[q] from every rank at once over Gloo's point-to-point
  // buffers, into `out` in rank order: one round. A transfer's slot carries
  // its size (below 2^24 here: the slot's low 24 bits, which Gloo leaves to
  // the collective), so ranks that disagree on a size never match each
  // other's transfers: Gloo would abort the process on a message longer than
  // the receive posted for it; this way the call fails by its deadline.
  void GatherDirectV(const void* in, const std::vector<size_t>& bytes, void* out, uint32_t tag,
                     std::chrono::milliseconds timeout) {
    if (seal_ != nullptr) {
      GatherSealed(in, bytes, out, tag, timeout, /*direct=*/true);
    } else {
      GatherDirectRaw(in, bytes, out, tag, timeout);
    }
  }

  void GatherDirectRaw(const void* in, const std::vector<size_t>& bytes, void* out, uint32_t tag,
                       std::chrono::milliseconds timeout) {
    const int n = size();
    const int r = rank();
    std::vector<size_t> at(n, 0);
    for (int q = 1; q < n; ++q) at[q] = at[q - 1] + bytes[q - 1];
    const size_t total = at[n - 1] + bytes[n - 1];
    char* const dst = static_cast<char*>(out);
    if (bytes[r] > 0) std::memmove(dst + at[r], in, bytes[r]);
    if (n == 1 || total == 0) return;
    CountRounds(1);
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    // The buffers outlive the scope: Abort may touch them until it untracks.
    std::unique_ptr<gloo::transport::UnboundBuffer> send, recv;
    ActiveScope scope{this};
    char dummy = 0;
    send = Track(bytes[r] > 0 ? const_cast<void*>(in) : &dummy, bytes[r]);
    recv = Track(total > 0 ? out : &dummy, total);
    const uint64_t slot = gloo::Slot::build(kDirectAllgatherSlotPrefix, tag);
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
    // Each wait ends one transfer; false means Abort woke it.
    for (int i = 0; i < recvs; ++i) {
      if (!recv->waitRecv(deadline)) throw std::runtime_error("transport aborted");
    }
    for (int i = 0; i < sends; ++i) {
      if (!send->waitSend(deadline)) throw std::runtime_error("transport aborted");
    }
  }

  // A direct round's receives, posted (by Expect, or by Exchange itself):
  // one buffer of the inline size per peer.
  struct PostedRound {
    size_t inline_bytes = 0;
    std::vector<std::unique_ptr<char[]>> inbox;
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> recv;
  };

  // The inline size (a multiple of 4 KiB, at most kMaxInlineBytes) in the
  // slot's low 24 bits, in 4 KiB units: ranks that disagree on it never
  // match each other's transfers (Gloo aborts the process on a message
  // longer than the receive posted for it).
  uint64_t InlineSlot(uint32_t tag, size_t inline_bytes) const {
    static_assert((kMaxInlineBytes >> 12) < (1 << 24), "the inline size fits the slot's low bits");
    return gloo::Slot::build(kRoundSlotPrefix, tag) + (inline_bytes >> 12);
  }

  std::unique_ptr<PostedRound> PostRound(uint32_t tag, size_t inline_bytes = 0) {
    auto round = std::make_unique<PostedRound>();
    // At least the model's, rounded up to 4 KiB, at most kMaxInlineBytes.
    inline_bytes = std::max(inline_bytes, model_.InlineBytes());
    // What sealing adds: the length's tag and the bytes' tag.
    if (seal_ != nullptr) inline_bytes += kSealedHeaderBytes + SealKeys::kOverhead;
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

  // One direct round. Every message is its length (8 bytes) and its bytes;
  // the first inline_bytes of it go in one transfer, the rest (if any) in a
  // second, which the receiver posts once it read the length. Receives
  // posted ahead (Expect) make the first transfer leave at once: Gloo sends
  // only once the receiver has posted. Sealed: the length and the bytes are
  // sealed apiece (the same for every peer), so that the length is verified
  // before a receive of the rest is posted for it.
  void Exchange(std::string_view mine, std::vector<std::string>* from, uint32_t tag,
                std::chrono::milliseconds timeout) {
    const int n = size();
    const int r = rank();
    from->assign(n, std::string());
    if (n == 1) {
      (*from)[r] = std::string(mine);
      return;
    }
    const auto started = std::chrono::steady_clock::now();
    const auto deadline = started + timeout;
    std::unique_ptr<PostedRound> round;
    if (auto it = posted_.find(tag); it != posted_.end() && !it->second.empty()) {
      round = std::move(it->second.front());
      it->second.pop_front();
    } else {
      round = PostRound(tag);
    }
    const size_t inline_bytes = round->inline_bytes;
    const bool sealed = seal_ != nullptr;
    const size_t head = sealed ? kSealedHeaderBytes : kRoundLengthBytes;
    const size_t trailer = sealed ? SealKeys::kOverhead : 0;
    std::string out(head + mine.size() + trailer, '\0');
    const uint64_t length = mine.size();
    if (sealed) {
      SealFor(SealKeys::kAll, tag, Sequence(SealKind::kRoundHeader, 0), &length, sizeof length,
              out.data());
      SealFor(SealKeys::kAll, tag, Sequence(SealKind::kRoundBody, 0), mine.data(), mine.size(),
              out.data() + head);
    } else {
      std::memcpy(out.data(), &length, sizeof length);
      if (!mine.empty()) std::memcpy(out.data() + kRoundLengthBytes, mine.data(), mine.size());
    }
    const size_t first = std::min(out.size(), inline_bytes);
    const size_t rest = out.size() - first;
    const uint64_t rest_slot = gloo::Slot::build(kRoundRestSlotPrefix, tag);
    ActiveScope scope{this};
    std::unique_ptr<gloo::transport::UnboundBuffer> send = Track(out.data(), out.size());
    {
      absl::MutexLock lock(&active_mu_);
      for (int p = 0; p < n; ++p) {
        if (p != r) scope.Add(round->recv[p].get());
      }
    }
    int sends = 0;
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      send->send(p, InlineSlot(tag, inline_bytes), 0, first);
      ++sends;
      if (rest > 0) {
        send->send(p, rest_slot, first, rest);
        ++sends;
      }
    }
    bool spilled = rest > 0;
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> rest_recv(n);
    int rest_recvs = 0;
    for (int p = 0; p < n; ++p) {
      if (p == r) continue;
      if (!round->recv[p]->waitRecv(deadline)) throw std::runtime_error("transport aborted");
      uint64_t len = 0;
      if (sealed) {
        OpenFrom(p, SealKeys::kAll, tag, Sequence(SealKind::kRoundHeader, 0), round->inbox[p].get(),
                 kSealedHeaderBytes, &len);
      } else {
        std::memcpy(&len, round->inbox[p].get(), sizeof len);
      }
      if (len > kMaxRoundBytes) {
        throw std::runtime_error(
            absl::StrCat("rank ", p, " sent a round message of ", len, " bytes; a bad peer"));
      }
      // The message's bytes as they travel (sealed: their tag after them).
      const size_t wire = len + trailer;
      std::string& msg = (*from)[p];
      msg.resize(wire);
      const size_t here = std::min<size_t>(wire, inline_bytes - head);
      if (here > 0) std::memcpy(msg.data(), round->inbox[p].get() + head, here);
      if (wire > here) {
        spilled = true;
        rest_recv[p] = Track(msg.data() + here, wire - here);
        rest_recv[p]->recv(p, rest_slot, 0, wire - here);
        ++rest_recvs;
      }
    }
    for (int p = 0; p < n; ++p) {
      if (rest_recv[p] != nullptr && !rest_recv[p]->waitRecv(deadline)) {
        throw std::runtime_error("transport aborted");
      }
    }
    for (int i = 0; i < sends; ++i) {
      if (!send->waitSend(deadline)) throw std::runtime_error("transport aborted");
    }
    if (sealed) {
      for (int p = 0; p < n; ++p) {
        if (p == r) continue;
        std::string& msg = (*from)[p];
        OpenFrom(p, SealKeys::kAll, tag, Sequence(SealKind::kRoundBody, 0), msg.data(), msg.size(),
                 msg.data());
        msg.resize(msg.size() - SealKeys::kOverhead);
      }
      (*from)[r] = std::string(mine);
    } else {
      // This rank's own message: the one sent, less its length (no second
      // copy of a message that can be tens of MB).
      out.erase(0, kRoundLengthBytes);
      (*from)[r] = std::move(out);
    }
    CountRounds(spilled ? 2 : 1);
  }

  absl::Status Break(absl::Status status) {
    absl::MutexLock lock(&mu_);
    if (broken_.ok()) broken_ = status;
    return broken_;
  }

  void GatherV(const void* in, std::vector<size_t> bytes, void* out, uint32_t tag,
               std::chrono::milliseconds timeout) {
    size_t total = 0;
    for (size_t b : bytes) total += b;
    if (total == 0) return;
    if (size() == 1) {
      std::memmove(out, in, bytes[0]);
      return;
    }
    if (total <= kDirectAllgatherBytes) {
      GatherDirectV(in, bytes, out, tag, timeout);
      return;
    }
    if (seal_ != nullptr) {
      GatherSealed(in, bytes, out, tag, timeout, /*direct=*/false);
    } else {
      GatherRing(in, std::move(bytes), out, tag, timeout);
    }
  }

  // Gloo's ring allgather-v (n - 1 rounds; some bytes in all).
  void GatherRing(const void* in, std::vector<size_t> bytes, void* out, uint32_t tag,
                  std::chrono::milliseconds timeout) {
    size_t total = 0;
    for (size_t b : bytes) total += b;
    CountRounds(size() - 1);
    gloo::AllgathervOptions opts(lanes_[0]);
    ActiveScope scope{this};
    char dummy = 0;
    opts.setInput<char>(Track(bytes[rank()] > 0 ? const_cast<void*>(in) : &dummy, bytes[rank()]));
    opts.setOutput<char>(Track(out, total), std::move(bytes));
    opts.setTag(tag);
    opts.setTimeout(timeout);
    gloo::allgatherv(opts);
  }

  // An allgather-v of sealed blocks, by one direct round or Gloo's ring
  // (which forwards blocks unchanged): each rank seals its block once for
  // every reader, and opens every other rank's block into place once it
  // verified. Empty blocks travel as they are (nothing).
  void GatherSealed(const void* in, const std::vector<size_t>& bytes, void* out, uint32_t tag,
                    std::chrono::milliseconds timeout, bool direct) {
    const int n = size();
    const int r = rank();
    std::vector<size_t> sealed(n), at(n, 0), sealed_at(n, 0);
    for (int q = 0; q < n; ++q) {
      sealed[q] = bytes[q] > 0 ? bytes[q] + SealKeys::kOverhead : 0;
      if (q > 0) {
        at[q] = at[q - 1] + bytes[q - 1];
        sealed_at[q] = sealed_at[q - 1] + sealed[q - 1];
      }
    }
    std::vector<char> mine(sealed[r]), stage(sealed_at[n - 1] + sealed[n - 1]);
    const uint64_t sequence = Sequence(direct ? SealKind::kDirect : SealKind::kRing, 0);
    if (bytes[r] > 0) SealFor(SealKeys::kAll, tag, sequence, in, bytes[r], mine.data());
    if (direct) {
      GatherDirectRaw(mine.data(), sealed, stage.data(), tag, timeout);
    } else {
      GatherRing(mine.data(), sealed, stage.data(), tag, timeout);
    }
    char* const dst = static_cast<char*>(out);
    if (bytes[r] > 0) std::memmove(dst + at[r], in, bytes[r]);
    for (int q = 0; q < n; ++q) {
      if (q == r || bytes[q] == 0) continue;
      OpenFrom(q, SealKeys::kAll, tag, sequence, stage.data() + sealed_at[q], sealed[q],
               dst + at[q]);
    }
  }

  // `divisor` (floats only; 0: none) divides every sum.
  template <typename T>
  void Reduce(T* data, size_t count, uint32_t tag, std::chrono::milliseconds timeout,
              float divisor = 0) {
    const int n = size();
    if (count <= kSmallAllreduceElements) {
      // Small: one allgather, then every rank sums all contributions in rank
      // order (one round instead of two).
      std::vector<T> all(count * n);
      GatherFixed(data, count * sizeof(T), all.data(), GlooTag(tag, GlooKind::kAllgather), timeout);
      SumInRankOrder(all.data(), count, n, count, data);
      Divide(data, count, divisor);
      return;
    }
    // What converges on a receiver at once when every transfer goes out
    // together: small enough for any switch queue, one round per phase.
    if ((n - 1) * ((count + n - 1) / n) * sizeof(T) <= kBurstIncastBytes) {
      ReduceBurst(data, count, tag, timeout, divisor);
    } else {
      ReduceLarge(data, count, tag, timeout, divisor);
    }
  }

  // Rank j's chunk of a large allreduce: count / n elements, the first
  // count % n one more, in rank order.
  static void Chunks(size_t count, int n, std::vector<size_t>* chunk, std::vector<size_t>* offset) {
    chunk->resize(n);
    offset->resize(n);
    for (int j = 0; j < n; ++j) {
      (*chunk)[j] = count / n + (static_cast<size_t>(j) < count % n ? 1 : 0);
      (*offset)[j] = j == 0 ? 0 : (*offset)[j - 1] + (*chunk)[j - 1];
    }
  }

  // A medium allreduce (a few hundred KiB at most): the reduce-scatter and
  // the allgather of ReduceLarge's chunks, every transfer of a phase at once
  // (two rounds in all, where ReduceLarge's lockstep takes 2 (n - 1)).
  template <typename T>
  void ReduceBurst(T* data, size_t count, uint32_t tag, std::chrono::milliseconds timeout,
                   float divisor) {
    if (seal_ != nullptr) {
      ReduceBurstSealed(data, count, tag, timeout, divisor);
      return;
    }
    const int n = size();
    const int r = rank();
    std::vector<size_t> chunk, offset;
    Chunks(count, n, &chunk, &offset);
    const size_t len = chunk[r];
    CountRounds(2);
    T* c = static_cast<T*>(Scratch(len * n * sizeof(T) + sizeof(T)));
    T* const out = data + offset[r];
    if (len > 0) std::memcpy(c + r * len, out, len * sizeof(T));
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    ActiveScope scope{this};
    T dummy{};
    std::unique_ptr<gloo::transport::UnboundBuffer> whole = Track(data, count * sizeof(T));
    std::unique_ptr<gloo::transport::UnboundBuffer> parts =
        Track(len > 0 ? c : &dummy, len * n * sizeof(T));
    const uint64_t rs_slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
    const uint64_t ag_slot = gloo::Slot::build(kAllgatherSlotPrefix, tag);
    int rs_recvs = 0, ag_recvs = 0, sends = 0;
    for (int q = 0; q < n; ++q) {
      if (q == r) continue;
      if (len > 0) {
        parts->recv(q, rs_slot, q * len * sizeof(T), len * sizeof(T));
        ++rs_recvs;
      }
      if (chunk[q] > 0) {
        whole->recv(q, ag_slot, offset[q] * sizeof(T), chunk[q] * sizeof(T));
        ++ag_recvs;
      }
    }
    for (int s = 1; s < n; ++s) {
      const int to = (r + s) % n;
      if (chunk[to] == 0) continue;
      whole->send(to, rs_slot, offset[to] * sizeof(T), chunk[to] * sizeof(T));
      ++sends;
    }
    for (int i = 0; i < rs_recvs; ++i) {
      if (!parts->waitRecv(deadline)) throw std::runtime_error("transport aborted");
    }
    // Every send of the reduce-scatter has left (its buffer is sent again
    // below, and the allgather writes into the other chunks).
    for (; sends > 0; --sends) {
      if (!whole->waitSend(deadline)) throw std::runtime_error("transport aborted");
    }
    if (len > 0) {
      SumInRankOrder(c, len, n, len, out);
      Divide(out, len, divisor);
      for (int s = 1; s < n; ++s) {
        whole->send((r + s) % n, ag_slot, offset[r] * sizeof(T), len * sizeof(T));
        ++sends;
      }
    }
    for (int i = 0; i < ag_recvs; ++i) {
      if (!whole->waitRecv(deadline)) throw std::runtime_error("transport aborted");
    }
    for (; sends > 0; --sends) {
      if (!whole->waitSend(deadline)) throw std::runtime_error("transport aborted");
    }
  }

  // ReduceBurst with sealed transfers: each contribution sealed for its
  // chunk's owner (one round, all at once), opened there before it is
  // summed; then the sums go to every rank by a sealed direct allgather.
  template <typename T>
  void ReduceBurstSealed(T* data, size_t count, uint32_t tag, std::chrono::milliseconds timeout,
                         float divisor) {
    const int n = size();
    const int r = rank();
    std::vector<size_t> chunk, offset;
    Chunks(count, n, &chunk, &offset);
    const size_t len = chunk[r];
    const size_t piece = len * sizeof(T) + SealKeys::kOverhead;  // a sealed contribution
    const uint64_t sequence = Sequence(SealKind::kScatter, 0);
    std::vector<size_t> send_at(n, 0);
    size_t send_bytes = 0;
    for (int q = 0; q < n; ++q) {
      send_at[q] = send_bytes;
      if (q != r && chunk[q] > 0) send_bytes += chunk[q] * sizeof(T) + SealKeys::kOverhead;
    }
    std::vector<char> outbox(send_bytes + 1), inbox((n - 1) * piece + 1);
    for (int q = 0; q < n; ++q) {
      if (q == r || chunk[q] == 0) continue;
      SealFor(q, tag, sequence, data + offset[q], chunk[q] * sizeof(T), outbox.data() + send_at[q]);
    }
    auto room = [&](int q) { return static_cast<size_t>(q < r ? q : q - 1) * piece; };
    CountRounds(1);
    {
      const auto deadline = std::chrono::steady_clock::now() + timeout;
      ActiveScope scope{this};
      std::unique_ptr<gloo::transport::UnboundBuffer> send = Track(outbox.data(), outbox.size());
      std::unique_ptr<gloo::transport::UnboundBuffer> recv = Track(inbox.data(), inbox.size());
      const uint64_t slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
      int recvs = 0, sends = 0;
      for (int q = 0; q < n; ++q) {
        if (q == r || len == 0) continue;
        recv->recv(q, slot, room(q), piece);
        ++recvs;
      }
      for (int s = 1; s < n; ++s) {
        const int to = (r + s) % n;
        if (chunk[to] == 0) continue;
        send->send(to, slot, send_at[to], chunk[to] * sizeof(T) + SealKeys::kOverhead);
        ++sends;
      }
      for (int i = 0; i < recvs; ++i) {
        if (!recv->waitRecv(deadline)) throw std::runtime_error("transport aborted");
      }
      for (int i = 0; i < sends; ++i) {
        if (!send->waitSend(deadline)) throw std::runtime_error("transport aborted");
      }
    }
    T* const out = data + offset[r];
    if (len > 0) {
      T* c = static_cast<T*>(Scratch(len * n * sizeof(T)));
      std::memcpy(c + r * len, out, len * sizeof(T));
      for (int q = 0; q < n; ++q) {
        if (q != r) OpenFrom(q, r, tag, sequence, inbox.data() + room(q), piece, c + q * len);
      }
      SumInRankOrder(c, len, n, len, out);
      Divide(out, len, divisor);
    }
    std::vector<size_t> bytes(n);
    for (int q = 0; q < n; ++q) bytes[q] = chunk[q] * sizeof(T);
    GatherDirectV(out, bytes, data, GlooTag(tag, GlooKind::kAllgather), timeout);
  }

  template <typename T>
  static void Divide(T* data, size_t count, float divisor) {
    if constexpr (std::is_same_v<T, float>) {
      if (divisor != 0) {
        for (size_t i = 0; i < count; ++i) data[i] /= divisor;
      }
    }
  }

  // The large allreduce. Rank j owns chunk j (count / n elements, the first
  // count % n one more); each chunk is cut into the same number of segments
  // on every rank. Per segment: every rank sends its part to the chunk's
  // owner (reduce-scatter), the owner sums the n contributions in rank order
  // (the bits of the in-process backend) and sends the sum to every rank
  // (allgather). The transfers go in rounds of a shifted permutation (round
  // s: to rank r + s, from rank r - s) with every rank in step: Gloo sends
  // only once the receiver has posted the matching receive, and a rank posts
  // the next round only when this one is done both ways. So every link
  // carries one transfer each way at a time, as in a ring. Posting them all
  // at once makes n - 1 transfers converge on each receiver's link, whose
  // queue then drops and stalls TCP (on 1 Gbit/s links 0.8-1.0 s instead of
  // 0.64 s for the reduce-scatter of 25.6 M floats); ranks left to run
  // ahead drift into the same (0.83x a ring's speed on 100 Mbit/s links).
  // A segment is summed (and divided, for an average) while the next one is
  // on the wire.
  // Over several lanes (connections) at once: one part of the data each,
  // on a thread each. Every element is still summed in rank order by its
  // part's chunk owner: the same bits as one lane.
  template <typename T>
  void ReduceLarge(T* data, size_t count, uint32_t tag, std::chrono::milliseconds timeout,
                   float divisor) {
    const size_t L = std::min(lanes_.size(), std::max<size_t>(1, count * sizeof(T) / kLaneBytes));
    if (L == 1) {
      ReduceLargeOn(0, data, count, tag, timeout, divisor);
      return;
    }
    std::vector<std::exception_ptr> failed(L);
    std::vector<std::thread> threads;
    auto part = [&](size_t i) {
      const size_t begin = count * i / L, end = count * (i + 1) / L;
      try {
        ReduceLargeOn(i, data + begin, end - begin, tag, timeout, divisor);
      } catch (...) {
        failed[i] = std::current_exception();
        // The other lanes' waits end too (they may wait on peers that gave up).
        absl::MutexLock lock(&active_mu_);
        for (gloo::transport::UnboundBuffer* b : active_) {
          b->abortWaitRecv();
          b->abortWaitSend();
        }
      }
    };
    for (size_t i = 1; i < L; ++i) threads.emplace_back(part, i);
    part(0);
    for (auto& t : threads) t.join();
    for (const auto& e : failed) {
      if (e != nullptr) std::rethrow_exception(e);
    }
  }

  template <typename T>
  void ReduceLargeOn(size_t lane, T* data, size_t count, uint32_t tag,
                     std::chrono::milliseconds timeout, float divisor) {
    const int n = size();
    const int r = rank();
    std::vector<size_t> chunk, offset;
    Chunks(count, n, &chunk, &offset);
    // The same segment count on every rank (from count and the link model,
    // alike everywhere).
    const bool ahead = model_.round_seconds >= kLongLinkSeconds;
    const size_t segment_bytes =
        ahead ? kSegmentBytes : std::max(kMinSegmentBytes, kStepSegmentBytes / (n - 1));
    const size_t chunk_bytes = (count / n) * sizeof(T);
    const int segments = static_cast<int>(
        std::clamp<size_t>((chunk_bytes + segment_bytes - 1) / segment_bytes, 1, kMaxSegments));
    auto seg_begin = [&](int j, int k) { return chunk[j] * k / segments; };
    auto seg_len = [&](int j, int k) { return seg_begin(j, k + 1) - seg_begin(j, k); };
    // Scratch: the other n - 1 contributions to a segment of my chunk, side
    // by side in one of `window` slots used in turn (my own stays in place).
    // A segment's slot is free again once it is summed; in step, its
    // receives are posted a round after the segment two back was summed; on
    // a long link they are posted `window` segments ahead. So the scratch
    // holds a few segments, not the chunk: a large dense bucket costs a
    // fixed tile beyond itself.
    const int window = std::min(segments, ahead ? 3 : 2);
    const size_t slot_len = static_cast<size_t>(n - 1) * ((chunk[r] + segments - 1) / segments);
    T* scratch = static_cast<T*>(Scratch(slot_len * window * sizeof(T) + sizeof(T), lane));
    auto contributions = [&](int k) { return scratch + (k % window) * slot_len; };
    // Where rank q's contribution to segment k goes in its slot.
    auto place = [&](int q, int k) {
      return static_cast<size_t>(q < r ? q : q - 1) * seg_len(r, k);
    };

    // Sealed, every transfer goes through the transport's own pad: a
    // sealed segment (its bytes and its tag) takes a `piece` of it. Sends:
    // this round's contribution, then the summed segment being shared
    // (sealed once for every reader); receives: the contributions of the
    // `window` segments in turn, each opened into its slot just before it
    // is summed, and every summed segment from every peer, opened into
    // place once the last of its rounds is done.
    const bool sealed = seal_ != nullptr;
    size_t longest = 0;
    for (int j = 0; j < n && sealed; ++j) {
      for (int k = 0; k < segments; ++k) longest = std::max(longest, seg_len(j, k));
    }
    const size_t piece = longest * sizeof(T) + SealKeys::kOverhead;
    const size_t peers = static_cast<size_t>(n - 1);
    char* const pad =
        sealed ? static_cast<char*>(SealScratch(piece * (2 + peers * (window + segments)), lane))
               : nullptr;
    char* const rs_inbox = sealed ? pad + 2 * piece : nullptr;
    char* const ag_inbox = sealed ? rs_inbox + peers * window * piece : nullptr;
    auto room = [&](int q) { return static_cast<size_t>(q < r ? q : q - 1) * piece; };

    const auto deadline = std::chrono::steady_clock::now() + timeout;
    ActiveScope scope{this};
    T dummy{};
    std::unique_ptr<gloo::transport::UnboundBuffer> whole =
        sealed ? Track(pad, 2 * piece, lane)
               : Track(count > 0 ? static_cast<void*>(data) : &dummy, count * sizeof(T), lane);
    std::vector<std::unique_ptr<gloo::transport::UnboundBuffer>> parts(segments), shared;
    for (int k = 0; k < segments; ++k) {
      const size_t len = seg_len(r, k);
      parts[k] = sealed ? Track(rs_inbox + (k % window) * peers * piece, peers * piece, lane)
                        : Track(len > 0 ? contributions(k) : &dummy, len * peers * sizeof(T), lane);
      if (sealed) shared.push_back(Track(ag_inbox + k * peers * piece, peers * piece, lane));
    }
    const gloo::Slot rs_slot = gloo::Slot::build(kReduceScatterSlotPrefix, tag);
    const gloo::Slot ag_slot = gloo::Slot::build(kAllgatherSlotPrefix, tag);
    // The rounds, in the same order on every rank. In round s rank r sends
    // to r + s and receives from r - s: segment `rs` of the receiver's chunk
    // (reduce-scatter) and, behind it on the same connection, the summed
    // segment `ag` of the sender's own chunk (allgather); -1: none. Segment
    // k is shared (ag) in the rounds that carry segment k + 1's
    // contributions (rs), so each round is one transfer per link and way.
    struct Round {
      int rs, ag, s;
    };
    std::vector<Round> rounds;
    for (int s = 1; s < n; ++s) rounds.push_back({0, -1, s});
    for (int k = 0; k < segments; ++k) {
      for (int s = 1; s < n; ++s) rounds.push_back({k + 1 < segments ? k + 1 : -1, k, s});
    }
    if (lane == 0) CountRounds(rounds.size());  // the lanes' rounds run side by side
    // Round by round, every rank in step: Gloo sends only once the
    // receiver has posted the matching receive, and a rank posts the next
    // round's receives only when this round is done both ways.
    // On a long link the receives are posted ahead, before the first send
    // (the allgather's all at once, the reduce-scatter's `window` segments
    // ahead, as slots free up): a receive's notice then reaches its sender
    // rounds ahead, and each round costs a one-way trip instead of a round
    // trip (Gloo sends only once the receiver has posted). On a short one
    // the rounds stay in step (below): posted ahead, a rank done with round
    // m sends round m + 1 into a receiver still taking round m from
    // another, and the converging transfers stall TCP (1 Gbit/s, 0.3 ms
    // round trips: 1.65-2.08 s instead of 1.31 s). Each receive has its own
    // place, and the waits below count them round by round.
    auto post_rs = [&](const Round& x) {
      const int from = (r - x.s + n) % n;
      if (x.rs >= 0 && seg_len(r, x.rs) > 0) {
        if (sealed) {
          parts[x.rs]->recv(from, rs_slot + static_cast<uint8_t>(x.rs), room(from),
                            seg_len(r, x.rs) * sizeof(T) + SealKeys::kOverhead);
        } else {
          parts[x.rs]->recv(from, rs_slot + static_cast<uint8_t>(x.rs),
                            place(from, x.rs) * sizeof(T), seg_len(r, x.rs) * sizeof(T));
        }
      }
    };
    auto post_ag = [&](const Round& x) {
      const int from = (r - x.s + n) % n;
      if (x.ag >= 0 && seg_len(from, x.ag) > 0) {
        if (sealed) {
          shared[x.ag]->recv(from, ag_slot + static_cast<uint8_t>(x.ag), room(from),
                             seg_len(from, x.ag) * sizeof(T) + SealKeys::kOverhead);
        } else {
          whole->recv(from, ag_slot + static_cast<uint8_t>(x.ag),
                      (offset[from] + seg_begin(from, x.ag)) * sizeof(T),
                      seg_len(from, x.ag) * sizeof(T));
        }
      }
    };
    // Sealed: the contributions to segment k, opened into its slot.
    auto open_rs = [&](int k) {
      for (int q = 0; q < n; ++q) {
        if (q == r || seg_len(r, k) == 0) continue;
        OpenFrom(q, r, tag, Sequence(SealKind::kScatter, k, lane),
                 rs_inbox + (k % window) * peers * piece + room(q),
                 seg_len(r, k) * sizeof(T) + SealKeys::kOverhead, contributions(k) + place(q, k));
      }
    };
    // Sealed: every peer's summed segment k, opened into place.
    auto open_ag = [&](int k) {
      for (int q = 0; q < n; ++q) {
        if (q == r || seg_len(q, k) == 0) continue;
        OpenFrom(q, SealKeys::kAll, tag, Sequence(SealKind::kGather, k, lane),
                 ag_inbox + k * peers * piece + room(q),
                 seg_len(q, k) * sizeof(T) + SealKeys::kOverhead,
                 data + offset[q] + seg_begin(q, k));
      }
    };
    // Ahead: the reduce-scatter receives of segment k, posted once segment
    // k - window is summed (its slot free).
    auto post_segment = [&](int k) {
      if (k >= segments) return;
      for (const Round& x : rounds) {
        if (x.rs == k) post_rs(x);
      }
    };
    // Sums segment k of my chunk into place, in rank order (and divides it,
    // for an average): every contribution is in. Ahead, its
    // slot then takes segment k + window's.
    auto sum = [&](int k) {
      const size_t len = seg_len(r, k);
      if (sealed) open_rs(k);
      if (len > 0) {
        T* out = data + offset[r] + seg_begin(r, k);
        SumInRankOrderInPlace(contributions(k), len, n, r, len, out);
        Divide(out, len, divisor);
      }
      if (ahead) post_segment(k + window);
    };
    if (ahead) {
      for (const Round& x : rounds) post_ag(x);
      for (int k = 0; k < window; ++k) post_segment(k);
    }
    int summed = 0;
    for (const Round& x : rounds) {
      const int to = (r + x.s) % n;
      const int from = (r - x.s + n) % n;
      if (!ahead) {
        post_rs(x);
        post_ag(x);
      }
      int recvs_rs = 0, recvs_ag = 0, sends = 0;
      if (x.rs >= 0) {
        const size_t len = seg_len(r, x.rs);
        if (len > 0) ++recvs_rs;
        const size_t bytes = seg_len(to, x.rs) * sizeof(T);
        T* const part = data + offset[to] + seg_begin(to, x.rs);
        if (bytes > 0 && sealed) {
          SealFor(to, tag, Sequence(SealKind::kScatter, x.rs, lane), part, bytes, pad);
          whole->send(to, rs_slot + static_cast<uint8_t>(x.rs), 0, bytes + SealKeys::kOverhead);
          ++sends;
        } else if (bytes > 0) {
          whole->send(to, rs_slot + static_cast<uint8_t>(x.rs),
                      (offset[to] + seg_begin(to, x.rs)) * sizeof(T), bytes);
          ++sends;
        }
      }
      if (x.ag >= 0) {
        if (seg_len(from, x.ag) > 0) ++recvs_ag;
        // Summed while this round's reduce-scatter part is on the wire.
        if (summed <= x.ag) sum(summed++);
        const size_t bytes = seg_len(r, x.ag) * sizeof(T);
        T* const mine = data + offset[r] + seg_begin(r, x.ag);
        if (bytes > 0 && sealed) {
          // Sealed once, in the first of the segment's rounds.
          if (x.s == 1) {
            SealFor(SealKeys::kAll, tag, Sequence(SealKind::kGather, x.ag, lane), mine, bytes,
                    pad + piece);
          }
          whole->send(to, ag_slot + static_cast<uint8_t>(x.ag), piece, bytes + SealKeys::kOverhead);
          ++sends;
        } else if (bytes > 0) {
          whole->send(to, ag_slot + static_cast<uint8_t>(x.ag),
                      (offset[r] + seg_begin(r, x.ag)) * sizeof(T), bytes);
          ++sends;
        }
      }
      for (int i = 0; i < recvs_rs; ++i) {
        if (!parts[x.rs]->waitRecv(deadline)) throw std::runtime_error("transport aborted");
      }
      for (int i = 0; i < recvs_ag; ++i) {
        gloo::transport::UnboundBuffer* into = sealed ? shared[x.ag].get() : whole.get();
        if (!into->waitRecv(deadline)) throw std::runtime_error("transport aborted");
      }
      for (int i = 0; i < sends; ++i) {
        if (!whole->waitSend(deadline)) throw std::runtime_error("transport aborted");
      }
      // The segment's last round: every peer's sum of it is in.
      if (sealed && x.ag >= 0 && x.s == n - 1) open_ag(x.ag);
    }
  }

  // Working memory of the large allreduce, one per lane, kept between
  // calls: a fresh buffer of a large bucket's size costs its page faults on
  // every step. One collective at a time (the Transport contract), one
  // thread per lane: no lock.
  struct Scratchpad {
    std::unique_ptr<char[]> bytes;
    size_t size = 0;
  };
  // Far larger than asked (over 4x, and over 16 MiB: a dense warm-up's
  // buckets, then sparse steps' values), it is given back: kept, it would
  // hold the largest bucket's size for good.
  void* Scratch(size_t bytes, size_t lane = 0) { return Pad(scratch_[lane], bytes); }
  // The sealed transfers' staging of the large allreduce, one per lane.
  void* SealScratch(size_t bytes, size_t lane) { return Pad(seal_scratch_[lane], bytes); }
  void* Pad(Scratchpad& s, size_t bytes) {
    if (bytes > s.size || (s.size > (size_t{16} << 20) && bytes <= s.size / 4)) {
      s.bytes.reset();
      scratch_bytes_ -= s.size;
      s.bytes.reset(new char[bytes]);
      s.size = bytes;
      scratch_bytes_ += bytes;
    }
    return s.bytes.get();
  }

  // lanes_[0] is the connection every collective uses; the others carry
  // parts of large allreduces.
  std::vector<std::shared_ptr<gloo::Context>> lanes_;
  const absl::Duration default_timeout_;
  const std::shared_ptr<const SealKeys> seal_;  // null: transfers go as they are
  const bool confirm_;                          // Confirm takes a round
  bool confirm_posted_ = false;                 // its receives were posted (engine thread only)
  LinkModel model_;                             // the same on every rank (MeasureLinks)
  // Rounds whose receives Expect posted, by tag (engine thread only).
  std::map<uint32_t, std::deque<std::unique_ptr<PostedRound>>> posted_;
  std::vector<Scratchpad> scratch_;
  std::vector<Scratchpad> seal_scratch_;
  // Collectives begun (the same on every rank), and the one in flight: the
  // sealed transfers' numbers (Sequence).
  uint64_t calls_ = 0;
  uint64_t call_ = 0;
  std::atomic<uint64_t> refused_{0};        // transfers that failed verification
  std::atomic<uint64_t> scratch_bytes_{0};  // over every lane's scratch
  absl::Mutex mu_;
  absl::Status broken_ ABSL_GUARDED_BY(mu_);
  absl::Mutex active_mu_;
  std::vector<gloo::transport::UnboundBuffer*> active_ ABSL_GUARDED_BY(active_mu_);
  bool aborted_ ABSL_GUARDED_BY(active_mu_) = false;
};

thread_local GlooTransport::ActiveScope* GlooTransport::ActiveScope::current = nullptr;

// Runs setpriority on Gloo's network thread itself: an eventfd registered
// with the device's event loop, whose handler runs on that thread.
class IoNiceSetter final : public gloo::transport::tcp::Handler {
 public:
  explicit IoNiceSetter(int nice) : nice_(nice) {}

  absl::Status Apply(gloo::transport::tcp::Device& device) {
    const int fd = eventfd(1, EFD_NONBLOCK | EFD_CLOEXEC);
    if (fd < 0) return absl::InternalError(absl::StrCat("eventfd: ", strerror(errno)));
    std::future<int> done = result_.get_future();
    device.registerDescriptor(fd, EPOLLIN, this);
    const bool ran = done.wait_for(std::chrono::seconds(10)) == std::future_status::ready;
    device.unregisterDescriptor(fd, this);  // waits for a loop tick: no call after this
    close(fd);
    if (!ran) return absl::DeadlineExceededError("gloo: the network thread did not run in 10 s");
    if (const int err = done.get(); err != 0) {
      return absl::InternalError(absl::StrCat("gloo: could not set the network thread's nice to ",
                                              nice_, ": ", strerror(err)));
    }
    return absl::OkStatus();
  }

  void handleEvents(int) override {
    if (fired_) return;  // level-triggered: may run again before unregistering
    fired_ = true;
    const id_t tid = static_cast<id_t>(gettid());
    errno = 0;
    const int current = getpriority(PRIO_PROCESS, tid);
    int err = errno;
    if (err == 0 && setpriority(PRIO_PROCESS, tid, std::min(19, current + nice_)) != 0) err = errno;
    result_.set_value(err);
  }

 private:
  const int nice_;
  bool fired_ = false;  // touched by the network thread only
  std::promise<int> result_;
};

void IgnoreSigpipe() {
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
}

}  // namespace

absl::StatusOr<std::unique_ptr<Transport>> CreateGlooTransport(const GlooOptions& o) {
  if (o.size < 1 || o.rank < 0 || o.rank >= o.size) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo: rank ", o.rank, " of ", o.size, " is out of range"));
  }
  if (o.store == nullptr) return absl::InvalidArgumentError("gloo: no rendezvous store");
  if (o.timeout <= absl::ZeroDuration()) {
    return absl::InvalidArgumentError("gloo: timeout must be positive");
  }
  if (o.connections < 0 || o.connections > 16) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo: connections must be 0 to 16, not ", o.connections));
  }
  if (o.io_nice < 0 || o.io_nice > 19) {
    return absl::InvalidArgumentError(
        absl::StrCat("gloo: io_nice must be 0 to 19, not ", o.io_nice));
  }
  // Gloo writes to sockets without MSG_NOSIGNAL: a peer that died would kill
  // this process with SIGPIPE instead of failing the call.
  IgnoreSigpipe();
  try {
    gloo::transport::tcp::attr attr;
    attr.hostname = o.hostname;
    auto device = gloo::transport::tcp::CreateDevice(attr);
    if (o.io_nice > 0) {
      auto* tcp = dynamic_cast<gloo::transport::tcp::Device*>(device.get());
      if (tcp == nullptr) return absl::InternalError("gloo: the device is not a tcp device");
      IoNiceSetter setter(o.io_nice);
      if (absl::Status s = setter.Apply(*tcp); !s.ok()) return s;
    }
    const absl::Duration connect = o.connect_timeout > absl::ZeroDuration()
                                       ? std::min(o.connect_timeout, o.timeout)
                                       : o.timeout;
    auto millis = [](absl::Duration d) {
      return std::chrono::milliseconds(absl::ToInt64Milliseconds(d));
    };
    auto context = std::make_shared<gloo::rendezvous::Context>(o.rank, o.size);
    context->setTimeout(millis(connect));
    if (o.size > 1) {
      GlooStoreAdapter store(o.store, o.prefix, connect);
      context->connectFullMesh(store, device);
    }
    auto transport = std::make_unique<GlooTransport>(context, o.timeout, o.seal, o.confirm);
    if (absl::Status s = transport->MeasureLinks(absl::Now() + connect, o.link_model); !s.ok()) {
      return absl::UnavailableError(absl::StrCat("gloo: rank ", o.rank, " of ", o.size,
                                                 " could not measure its links: ", s.message()));
    }
    // More connections per pair where one cannot fill the link: on a long
    // link one TCP connection's window (and its congestion control's
    // estimate) holds back a large allreduce. The model is every rank's
    // alike, so every rank makes as many.
    int lanes = o.connections;
    if (lanes == 0) lanes = transport->link_model()->round_seconds >= kLongLinkSeconds ? 4 : 1;
    // The lanes connect at once, each through keys of its own: on a long
    // link their rendezvous (a few round trips each) would add up.
    std::vector<std::future<std::shared_ptr<gloo::Context>>> connecting;
    for (int i = 1; i < lanes && o.size > 1; ++i) {
      connecting.push_back(
          std::async(std::launch::async, [&, i]() -> std::shared_ptr<gloo::Context> {
            auto lane = std::make_shared<gloo::rendezvous::Context>(o.rank, o.size);
            lane->setTimeout(millis(connect));
            GlooStoreAdapter store(o.store, absl::StrCat(o.prefix, "/lane", i), connect);
            lane->connectFullMesh(store, device);
            lane->setTimeout(millis(o.timeout));
            return lane;
          }));
    }
    std::vector<std::shared_ptr<gloo::Context>> extra;
    std::exception_ptr failed;
    for (auto& f : connecting) {
      try {
        extra.push_back(f.get());  // every one waited for, even after a failure
      } catch (...) {
        if (!failed) failed = std::current_exception();
      }
    }
    if (failed) std::rethrow_exception(failed);
    context->setTimeout(millis(o.timeout));
    transport->AddLanes(std::move(extra));
    return std::unique_ptr<Transport>(std::move(transport));
  } catch (const std::exception& e) {
    return absl::UnavailableError(
        absl::StrCat("gloo: rank ", o.rank, " of ", o.size, " could not connect: ", e.what()));
  }
}

}  // namespace microd::transport
