// SPDX-License-Identifier: Apache-2.0
// The Gloo backend's allreduce. A large one is a reduce-scatter (rank j
// receives chunk j from every rank) summed in rank order, then an
// allgather of the summed chunks, pipelined in segments and sent in rounds
// of a shifted permutation (ReduceLarge): the bytes and link use of a ring,
// and the same bits as the in-process backend, so results do not depend on
// the backend. Small ones (histograms, a few values) are an allgather and a
// rank-order sum on every rank: one round.
#include <algorithm>
#include <cstring>
#include <exception>
#include <thread>
#include <type_traits>

#include "daemon/transport/gloo/gloo_internal.h"
#include "daemon/transport/half_sum.h"

namespace microd::transport::gloo_backend {
namespace {

// Rank j's chunk of a large allreduce: count / n elements, the first
// count % n one more, in rank order.
void Chunks(size_t count, int n, std::vector<size_t>* chunk, std::vector<size_t>* offset) {
  chunk->resize(n);
  offset->resize(n);
  for (int j = 0; j < n; ++j) {
    (*chunk)[j] = count / n + (static_cast<size_t>(j) < count % n ? 1 : 0);
    (*offset)[j] = j == 0 ? 0 : (*offset)[j - 1] + (*chunk)[j - 1];
  }
}

template <typename T>
void Divide(T* data, size_t count, float divisor) {
  if constexpr (std::is_same_v<T, float>) {
    if (divisor != 0) {
      for (size_t i = 0; i < count; ++i) data[i] /= divisor;
    }
  }
}

}  // namespace

absl::Status GlooTransport::AllreduceSum(void* data, size_t count, DataType type,
                                         const CollectiveOptions& o) {
  if (count > 0 && data == nullptr) return absl::InvalidArgumentError("AllreduceSum: null data");
  return Run("AllreduceSum", o, count * kernels::ElementBytes(type), [&](Timeout timeout) {
    if (count == 0 || size() == 1) return;
    ReduceAny(data, count, type, o.tag, timeout);
  });
}

void GlooTransport::ReduceAny(void* data, size_t count, DataType type, uint32_t tag,
                              Timeout timeout) {
  switch (type) {
    case DataType::kFloat32:
      return Reduce(static_cast<float*>(data), count, tag, timeout);
    case DataType::kInt32:
      return Reduce(static_cast<int32_t*>(data), count, tag, timeout);
    case DataType::kInt64:
      return Reduce(static_cast<int64_t*>(data), count, tag, timeout);
    case DataType::kBFloat16:
      return Reduce(static_cast<Bf16*>(data), count, tag, timeout);
    case DataType::kFloat16:
      return Reduce(static_cast<F16*>(data), count, tag, timeout);
  }
}

absl::Status GlooTransport::AllreduceAverage(float* data, size_t count, float divisor,
                                             const CollectiveOptions& o) {
  if (count > 0 && data == nullptr) {
    return absl::InvalidArgumentError("AllreduceAverage: null data");
  }
  return Run("AllreduceAverage", o, count * sizeof(float), [&](Timeout timeout) {
    if (count == 0) return;
    if (size() == 1) {
      for (size_t i = 0; i < count; ++i) data[i] /= divisor;
      return;
    }
    Reduce(data, count, o.tag, timeout, divisor);
  });
}

template <typename T>
void GlooTransport::Reduce(T* data, size_t count, uint32_t tag, Timeout timeout, float divisor) {
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

// A medium allreduce (a few hundred KiB at most): the reduce-scatter and
// the allgather of ReduceLarge's chunks, every transfer of a phase at once
// (two rounds in all, where ReduceLarge's lockstep takes 2 (n - 1)).
template <typename T>
void GlooTransport::ReduceBurst(T* data, size_t count, uint32_t tag, Timeout timeout,
                                float divisor) {
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
  std::unique_ptr<Buffer> whole = Track(data, count * sizeof(T));
  std::unique_ptr<Buffer> parts = Track(len > 0 ? c : &dummy, len * n * sizeof(T));
  const uint64_t rs_slot = ::gloo::Slot::build(kReduceScatterSlotPrefix, tag);
  const uint64_t ag_slot = ::gloo::Slot::build(kAllgatherSlotPrefix, tag);
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
  for (int i = 0; i < rs_recvs; ++i) WaitRecv(parts.get(), deadline);
  // Every send of the reduce-scatter has left (its buffer is sent again
  // below, and the allgather writes into the other chunks).
  for (; sends > 0; --sends) WaitSend(whole.get(), deadline);
  if (len > 0) {
    SumInRankOrder(c, len, n, len, out);
    Divide(out, len, divisor);
    for (int s = 1; s < n; ++s) {
      whole->send((r + s) % n, ag_slot, offset[r] * sizeof(T), len * sizeof(T));
      ++sends;
    }
  }
  for (int i = 0; i < ag_recvs; ++i) WaitRecv(whole.get(), deadline);
  for (; sends > 0; --sends) WaitSend(whole.get(), deadline);
}

// The large allreduce, over several lanes (connections) at once: one part
// of the data each, on a thread each. Every element is still summed in
// rank order by its part's chunk owner: the same bits as one lane.
template <typename T>
void GlooTransport::ReduceLarge(T* data, size_t count, uint32_t tag, Timeout timeout,
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
      for (Buffer* b : active_) {
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

// Rank j owns chunk j; each chunk is cut into the same number of segments
// on every rank. Per segment: every rank sends its part to the chunk's
// owner (reduce-scatter), the owner sums the n contributions in rank order
// (the bits of the in-process backend) and sends the sum to every rank
// (allgather). The transfers go in rounds of a shifted permutation (round
// s: to rank r + s, from rank r - s) with every rank in step: a send goes
// only once the receiver has posted the matching receive, and a rank posts
// the next round only when this one is done both ways. So every link
// carries one transfer each way at a time, as in a ring. Posting them all
// at once makes n - 1 transfers converge on each receiver's link, whose
// queue then drops and stalls TCP (on 1 Gbit/s links 0.8-1.0 s instead of
// 0.64 s for the reduce-scatter of 25.6 M floats); ranks left to run ahead
// drift into the same (0.83x a ring's speed on 100 Mbit/s links). A
// segment is summed (and divided, for an average) while the next one is on
// the wire.
template <typename T>
class GlooTransport::LargeReduce {
 public:
  // The plan (chunks, segments, the scratch's slots, the rounds) and the
  // buffers, tracked for Abort.
  LargeReduce(GlooTransport* t, size_t lane, T* data, size_t count, uint32_t tag, float divisor)
      : t_(t),
        lane_(lane),
        data_(data),
        divisor_(divisor),
        n_(t->size()),
        r_(t->rank()),
        ahead_(t->model_.round_seconds >= kLongLinkSeconds),
        scope_(t),
        rs_slot_(::gloo::Slot::build(kReduceScatterSlotPrefix, tag)),
        ag_slot_(::gloo::Slot::build(kAllgatherSlotPrefix, tag)) {
    Chunks(count, n_, &chunk_, &offset_);
    // The same segment count on every rank (from count and the link model,
    // alike everywhere).
    const size_t segment_bytes =
        ahead_ ? kSegmentBytes : std::max(kMinSegmentBytes, kStepSegmentBytes / (n_ - 1));
    const size_t chunk_bytes = (count / n_) * sizeof(T);
    segments_ = static_cast<int>(
        std::clamp<size_t>((chunk_bytes + segment_bytes - 1) / segment_bytes, 1, kMaxSegments));
    // Scratch: the other n - 1 contributions to a segment of my chunk, side
    // by side in one of `window_` slots used in turn (my own stays in
    // place). A segment's slot is free again once it is summed; in step,
    // its receives are posted a round after the segment two back was
    // summed; on a long link they are posted `window_` segments ahead. So
    // the scratch holds a few segments, not the chunk: a large dense
    // bucket costs a fixed tile beyond itself.
    window_ = std::min(segments_, ahead_ ? 3 : 2);
    slot_len_ = static_cast<size_t>(n_ - 1) * ((chunk_[r_] + segments_ - 1) / segments_);
    scratch_ = static_cast<T*>(t->Scratch(slot_len_ * window_ * sizeof(T) + sizeof(T), lane));
    whole_ = t->Track(count > 0 ? static_cast<void*>(data) : &dummy_, count * sizeof(T), lane);
    parts_.resize(segments_);
    for (int k = 0; k < segments_; ++k) {
      const size_t len = SegLen(r_, k);
      parts_[k] = t->Track(len > 0 ? Contributions(k) : &dummy_, len * (n_ - 1) * sizeof(T), lane);
    }
    // The rounds, in the same order on every rank. In round s rank r sends
    // to r + s and receives from r - s: segment `rs` of the receiver's chunk
    // (reduce-scatter) and, behind it on the same connection, the summed
    // segment `ag` of the sender's own chunk (allgather); -1: none. Segment
    // k is shared (ag) in the rounds that carry segment k + 1's
    // contributions (rs), so each round is one transfer per link and way.
    for (int s = 1; s < n_; ++s) rounds_.push_back({0, -1, s});
    for (int k = 0; k < segments_; ++k) {
      for (int s = 1; s < n_; ++s) rounds_.push_back({k + 1 < segments_ ? k + 1 : -1, k, s});
    }
  }

  // Round by round, every rank in step. On a long link the receives are
  // posted ahead, before the first send (the allgather's all at once, the
  // reduce-scatter's `window_` segments ahead, as slots free up): a
  // receive's notice then reaches its sender rounds ahead, and each round
  // costs a one-way trip instead of a round trip. On a short one the
  // rounds stay in step: posted ahead, a rank done with round m sends round
  // m + 1 into a receiver still taking round m from another, and the
  // converging transfers stall TCP (1 Gbit/s, 0.3 ms round trips:
  // 1.65-2.08 s instead of 1.31 s). Each receive has its own place, and the
  // waits count them round by round.
  void Run(std::chrono::steady_clock::time_point deadline) {
    if (lane_ == 0) t_->CountRounds(rounds_.size());  // the lanes' rounds run side by side
    if (ahead_) {
      for (const Round& x : rounds_) PostAg(x);
      for (int k = 0; k < window_; ++k) PostSegment(k);
    }
    for (const Round& x : rounds_) RunRound(x, deadline);
  }

 private:
  struct Round {
    int rs, ag, s;
  };
  size_t SegBegin(int j, int k) const { return chunk_[j] * k / segments_; }
  size_t SegLen(int j, int k) const { return SegBegin(j, k + 1) - SegBegin(j, k); }
  T* Contributions(int k) const { return scratch_ + (k % window_) * slot_len_; }
  // Where rank q's contribution to segment k goes in its slot.
  size_t Place(int q, int k) const {
    return static_cast<size_t>(q < r_ ? q : q - 1) * SegLen(r_, k);
  }
  int From(const Round& x) const { return (r_ - x.s + n_) % n_; }

  void PostRs(const Round& x) {
    const int from = From(x);
    if (x.rs >= 0 && SegLen(r_, x.rs) > 0) {
      parts_[x.rs]->recv(from, rs_slot_ + static_cast<uint8_t>(x.rs), Place(from, x.rs) * sizeof(T),
                         SegLen(r_, x.rs) * sizeof(T));
    }
  }
  void PostAg(const Round& x) {
    const int from = From(x);
    if (x.ag >= 0 && SegLen(from, x.ag) > 0) {
      whole_->recv(from, ag_slot_ + static_cast<uint8_t>(x.ag),
                   (offset_[from] + SegBegin(from, x.ag)) * sizeof(T),
                   SegLen(from, x.ag) * sizeof(T));
    }
  }
  // Ahead: the reduce-scatter receives of segment k, posted once segment
  // k - window_ is summed (its slot free).
  void PostSegment(int k) {
    if (k >= segments_) return;
    for (const Round& x : rounds_) {
      if (x.rs == k) PostRs(x);
    }
  }
  // Sums segment k of my chunk into place, in rank order (and divides it,
  // for an average): every contribution is in. Ahead, its slot then takes
  // segment k + window_'s.
  void Sum(int k) {
    const size_t len = SegLen(r_, k);
    if (len > 0) {
      T* out = data_ + offset_[r_] + SegBegin(r_, k);
      SumInRankOrderInPlace(Contributions(k), len, n_, r_, len, out);
      Divide(out, len, divisor_);
    }
    if (ahead_) PostSegment(k + window_);
  }
  // One round's sends (a segment summed while its reduce-scatter part is on
  // the wire) and its waits.
  void RunRound(const Round& x, std::chrono::steady_clock::time_point deadline) {
    const int to = (r_ + x.s) % n_;
    if (!ahead_) {
      PostRs(x);
      PostAg(x);
    }
    const int from = From(x);
    int recvs_rs = 0, recvs_ag = 0, sends = 0;
    if (x.rs >= 0) {
      if (SegLen(r_, x.rs) > 0) ++recvs_rs;
      const size_t bytes = SegLen(to, x.rs) * sizeof(T);
      if (bytes > 0) {
        whole_->send(to, rs_slot_ + static_cast<uint8_t>(x.rs),
                     (offset_[to] + SegBegin(to, x.rs)) * sizeof(T), bytes);
        ++sends;
      }
    }
    if (x.ag >= 0) {
      if (SegLen(from, x.ag) > 0) ++recvs_ag;
      if (summed_ <= x.ag) Sum(summed_++);
      const size_t bytes = SegLen(r_, x.ag) * sizeof(T);
      if (bytes > 0) {
        whole_->send(to, ag_slot_ + static_cast<uint8_t>(x.ag),
                     (offset_[r_] + SegBegin(r_, x.ag)) * sizeof(T), bytes);
        ++sends;
      }
    }
    for (int i = 0; i < recvs_rs; ++i) WaitRecv(parts_[x.rs].get(), deadline);
    for (int i = 0; i < recvs_ag; ++i) WaitRecv(whole_.get(), deadline);
    for (int i = 0; i < sends; ++i) WaitSend(whole_.get(), deadline);
  }

  GlooTransport* const t_;
  const size_t lane_;
  T* const data_;
  const float divisor_;
  const int n_, r_;
  const bool ahead_;
  std::vector<size_t> chunk_, offset_;
  int segments_ = 1, window_ = 1;
  size_t slot_len_ = 0;
  T* scratch_ = nullptr;
  T dummy_{};
  ActiveScope scope_;  // before the buffers: it untracks them once they are gone
  std::unique_ptr<Buffer> whole_;
  std::vector<std::unique_ptr<Buffer>> parts_;
  const ::gloo::Slot rs_slot_, ag_slot_;
  std::vector<Round> rounds_;
  int summed_ = 0;
};

template <typename T>
void GlooTransport::ReduceLargeOn(size_t lane, T* data, size_t count, uint32_t tag, Timeout timeout,
                                  float divisor) {
  LargeReduce<T> reduce(this, lane, data, count, tag, divisor);
  reduce.Run(std::chrono::steady_clock::now() + timeout);
}

}  // namespace microd::transport::gloo_backend
