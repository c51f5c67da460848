// SPDX-License-Identifier: Apache-2.0
// The first rounds of a membership epoch (state_agreement.h), without an
// engine or a socket: nodes over the in-process transport, each with a
// StateHolder of its own. What a user relies on: a job whose nodes hold the
// same state goes on; one whose nodes differ fails on every node naming the
// node and both states; a node that joins takes the job's state; a step
// whose confirmation failed somewhere is committed or dropped alike on
// every node; a statement that does not parse names its node.
#include "daemon/engine/state_agreement.h"

#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "daemon/transport/inproc/inproc_transport.h"
#include "gtest/gtest.h"
#include "tests/transport/forwarding.h"

namespace microd::engine {
namespace {

class Holder final : public StateHolder {
 public:
  std::vector<BucketStated> Buckets() override { return buckets; }
  uint64_t Confirmed() override { return confirmed; }
  bool HasUnconfirmed() override { return unconfirmed; }
  void Settle(bool commit) override {
    settled = commit ? "committed" : "dropped";
    confirmed += commit ? 1 : 0;
    unconfirmed = false;
    if (commit) {
      for (BucketStated& b : buckets) ++b.step;
    }
  }
  void Adopt(std::map<std::string, BucketStated> b, uint64_t c) override {
    adopted = std::move(b);
    confirmed = c;
  }

  std::vector<BucketStated> buckets;
  uint64_t confirmed = 0;
  bool unconfirmed = false;
  std::string settled;
  std::map<std::string, BucketStated> adopted;
};

std::vector<BucketStated> AtStep(uint64_t step) {
  return {{"grads.0", step, std::string("\x01\x02", 2)}, {"grads\t1", step, ""}};
}

// Every node's agreement at once (`joining[r]`: node r joins).
std::vector<absl::Status> Agree(std::vector<Holder>& holders, std::vector<bool> joining = {}) {
  const int n = static_cast<int>(holders.size());
  joining.resize(n, false);
  auto group = transport::CreateInprocGroup(n);
  std::vector<absl::Status> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      control::Membership m;
      m.epoch = 4;
      m.node_rank = r;
      m.node_count = n;
      out[r] = AgreeOnState(*group[r], m, joining[r], absl::Seconds(20), holders[r]);
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

TEST(StateAgreement, NodesHoldingTheSameStateGoOn) {
  std::vector<Holder> h(3);
  for (Holder& x : h) {
    x.buckets = AtStep(7);
    x.confirmed = 7;
  }
  for (const absl::Status& s : Agree(h)) EXPECT_TRUE(s.ok()) << s;
  for (const Holder& x : h) EXPECT_TRUE(x.settled.empty());
}

TEST(StateAgreement, ANodeAtAnotherStepFailsEveryNodeNamingIt) {
  std::vector<Holder> h(3);
  for (Holder& x : h) {
    x.buckets = AtStep(7);
    x.confirmed = 7;
  }
  h[2].buckets = AtStep(8);  // the lost node's last step reached node 2 only
  h[2].confirmed = 8;
  const auto status = Agree(h);
  for (int r = 0; r < 3; ++r) {
    ASSERT_TRUE(absl::IsFailedPrecondition(status[r])) << "node " << r << ": " << status[r];
    const std::string msg(status[r].message());
    EXPECT_TRUE(absl::StrContains(msg, "of epoch 4 holds its buckets at other steps")) << msg;
    EXPECT_TRUE(absl::StrContains(msg, "grads.0\t8")) << msg;
    EXPECT_TRUE(absl::StrContains(msg, "grads.0\t7")) << msg;
  }
}

TEST(StateAgreement, AJoiningNodeTakesTheJobsState) {
  std::vector<Holder> h(3);
  for (int r : {0, 2}) {
    h[r].buckets = AtStep(11);
    h[r].confirmed = 11;
  }
  for (const absl::Status& s : Agree(h, {false, true, false})) EXPECT_TRUE(s.ok()) << s;
  ASSERT_EQ(h[1].adopted.size(), 2u);
  EXPECT_EQ(h[1].adopted["grads.0"].step, 11u);
  EXPECT_EQ(h[1].adopted["grads.0"].controller, std::string("\x01\x02", 2));
  EXPECT_EQ(h[1].adopted["grads\t1"].step, 11u);  // names are escaped on the wire
  EXPECT_EQ(h[1].confirmed, 11u);
  EXPECT_TRUE(h[0].adopted.empty());
}

TEST(StateAgreement, AJoiningNodeWithNoOneHoldingTheStateFails) {
  std::vector<Holder> h(2);
  const auto status = Agree(h, {true, true});
  for (const absl::Status& s : status) {
    EXPECT_TRUE(absl::IsFailedPrecondition(s)) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "no node of epoch 4 holds the job's state")) << s;
  }
}

// A Confirm refused on nodes 0 and 1 after node 2 passed it: node 2
// committed the step, so nodes 0 and 1 roll it forward and all agree.
TEST(StateAgreement, AStepAnotherNodeCommittedIsRolledForward) {
  std::vector<Holder> h(3);
  for (Holder& x : h) {
    x.buckets = AtStep(5);
    x.confirmed = 5;
    x.unconfirmed = true;
  }
  h[2].buckets = AtStep(6);
  h[2].confirmed = 6;
  h[2].unconfirmed = false;
  for (const absl::Status& s : Agree(h)) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(h[0].settled, "committed");
  EXPECT_EQ(h[1].settled, "committed");
  EXPECT_TRUE(h[2].settled.empty());
  for (const Holder& x : h) EXPECT_EQ(x.confirmed, 6u);
}

// No node passed Confirm: whoever holds the step drops it.
TEST(StateAgreement, AStepNoNodeCommittedIsDropped) {
  std::vector<Holder> h(3);
  for (Holder& x : h) {
    x.buckets = AtStep(5);
    x.confirmed = 5;
  }
  h[1].unconfirmed = true;
  for (const absl::Status& s : Agree(h)) EXPECT_TRUE(s.ok()) << s;
  EXPECT_EQ(h[1].settled, "dropped");
  EXPECT_TRUE(h[0].settled.empty());
  for (const Holder& x : h) EXPECT_EQ(x.confirmed, 5u);
}

// A peer whose statement does not parse: every node fails naming it.
class Garbling final : public transport::Forwarding {
 public:
  explicit Garbling(transport::Transport* inner) : Forwarding(inner) {}
  const char* name() const override { return "garbling"; }
  absl::Status ExchangeRound(std::string_view, std::vector<std::string>* from,
                             const transport::CollectiveOptions& o) override {
    return inner_->ExchangeRound("S12\tmaybe\n", from, o);
  }
};

TEST(StateAgreement, AStatementThatDoesNotParseFailsEveryNodeNamingIt) {
  auto group = transport::CreateInprocGroup(2);
  Garbling garbling(group[1].get());
  std::vector<Holder> h(2);
  std::vector<absl::Status> out(2);
  std::vector<std::thread> threads;
  for (int r = 0; r < 2; ++r) {
    threads.emplace_back([&, r] {
      control::Membership m;
      m.epoch = 9;
      m.node_rank = r;
      m.node_count = 2;
      transport::Transport& t = r == 1 ? garbling : *group[0];
      out[r] = AgreeOnState(t, m, false, absl::Seconds(20), h[r]);
    });
  }
  for (auto& t : threads) t.join();
  for (const absl::Status& s : out) {
    EXPECT_TRUE(absl::IsDataLoss(s)) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "node 1 of epoch 9 sent a bad statement")) << s;
  }
}

}  // namespace
}  // namespace microd::engine
