// SPDX-License-Identifier: Apache-2.0
// The sparse step of docs/design.md section 1 for one bucket of a node or
// several at once, through the phases of BucketState (bucket.h), with each
// collective phase one direct round (Transport::ExchangeRound) that
// carries every bucket of the batch: a step of many buckets costs the
// rounds of one. A bucket stepped alone (BucketState::Step) is a batch of
// one.
//
//   round 1: per bucket, the header (count, NaN/Inf count, step, threshold
//            bits) and, for the `paper` controller, top-k and hard, the
//            selected indices; for the `hist` controller, the coarse
//            histogram of the candidates (every finite bin from the pass's
//            lower bound, sparse).
//            Every node then knows the global histogram, so the window
//            holding the k-th value is found locally; a rescan (too few
//            candidates, rare) costs a round of its own.
//   round 2 (hist): each node's candidates at or above the coarse bin of
//            the k-th value, each with its fine sub-bin there: every node
//            sums the fine histogram, picks the threshold (ChooseFine), and
//            keeps each node's candidates above it.
//   round 3: the values at every selected index in the bucket's wire type
//            (fp32, or rounded to bf16/fp16), summed in rank order, halves
//            in fp32 and rounded once (a direct round where the link model
//            says it is cheaper, Transport::DirectCheaper, else the
//            backend's allreduce, one per wire type): the same bits.
// So `paper`, top-k and hard take 2 rounds, `hist` 3, whatever the number
// of buckets, with the bits of each bucket stepped alone.
//
// A bucket with a NaN/Inf on some node, or missing on some node (its
// process left), fails alone; the others go on. A transport failure or a
// bad peer (a message that does not parse, counts or indices out of range)
// fails the batch.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/sparsify/bucket.h"
#include "daemon/transport/transport.h"

namespace microd::sparsify {

class BatchStep {
 public:
  // Whether `bucket`'s next step can run in a batch (BucketState::Batchable).
  static bool Batchable(const BucketState& bucket);

  // Batches of one transport run one after another, in the same order on
  // every node: their rounds of a kind share a tag, and each round posts the
  // next batch's receives (Transport::Expect).
  BatchStep(transport::Transport& transport, absl::Time deadline);
  ~BatchStep();
  BatchStep(const BatchStep&) = delete;
  BatchStep& operator=(const BatchStep&) = delete;

  // Phase 1, local: the bucket's read-only pass over `grad` (this node's
  // gradient, which must hold the same values until Finish: the values and
  // the commit read it again; null: this node has none, e.g. its process
  // left, and every node fails the bucket naming this node). Every node adds
  // the same buckets in the same order. A kernel failure is returned (the
  // batch cannot run).
  absl::Status Add(BucketState* bucket, const float* grad);
  // Keeps only the buckets added at these indices (ascending), in that
  // order: the others' passes are dropped, their state unchanged (a pass
  // writes only scratch). Before Run.
  void KeepOnly(const std::vector<size_t>& indices);
  // The rounds. An error is the batch's: no bucket's state changed.
  absl::Status Run();
  // Then, per bucket (index in Add order): its averaged update written to
  // `update` and its state advanced (residual, threshold, step), or why it
  // failed alone (its state unchanged).
  absl::StatusOr<StepStats> Finish(size_t i, float* update);
  size_t size() const;
  // Rounds the batch took (transport rounds during Run).
  uint64_t rounds() const { return rounds_; }
  // Run failed at its last round, the transport's Confirm, with every
  // transfer before it verified: the nodes that passed it commit the step,
  // and Finish still can here (BucketState::has_pending says why).
  bool unconfirmed() const { return reduced_ && !confirmed_; }

 private:
  struct Item;
  // The round's messages, one section per live bucket in order.
  std::string RoundOne();
  absl::Status ReadRoundOne(const std::vector<std::string>& from);
  absl::Status Rescans();
  std::string RoundTwo();
  absl::Status ReadRoundTwo(const std::vector<std::string>& from);
  absl::Status ReduceValues();
  // The local coarse histogram of the candidates, sparse.
  absl::Status LocalCoarse(Item& it);
  transport::CollectiveOptions Options(transport::TagKind kind) const;
  // One round of `kind`, then the next batch's round of that kind posted.
  absl::Status Exchange(transport::TagKind kind, std::string_view mine,
                        std::vector<std::string>* from);

  transport::Transport& transport_;
  const absl::Time deadline_;
  std::vector<Item> items_;
  uint64_t rounds_ = 0;
  bool ran_ = false;
  bool reduced_ = false;        // every round's transfers arrived
  bool confirmed_ = false;      // and Confirm passed
  bool direct_values_ = false;  // round 3 is a direct round (else an allreduce)
  std::string sums_;            // round 3: the live buckets' values, summed over nodes
};

}  // namespace microd::sparsify
