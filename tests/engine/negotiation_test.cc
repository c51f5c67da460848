// SPDX-License-Identifier: Apache-2.0
// The engine's negotiation, step runner and step memory as units: several
// nodes' engines in this process over the in-process control plane and
// transport (no gRPC server, no sockets but the local ones), each serving a
// training process through the C client. What is checked: buckets
// submitted in different orders on different nodes are agreed and reduced
// alike everywhere; the response cache takes repeated steps off the
// coordinator; a node that submits late is waited for.
#include <algorithm>
#include <cmath>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/control/control_plane.h"
#include "daemon/control/coordinator.h"
#include "daemon/engine/engine.h"
#include "daemon/local/local_server.h"
#include "daemon/transport/inproc/inproc_transport.h"
#include "gtest/gtest.h"
#include "kernels/sparse_ops.h"
#include "microd/microd.h"
#include "tests/integration/process_util.h"

namespace microd::engine {
namespace {

// The in-process control plane, counting what the engine reports.
class CountingControlPlane final : public control::ControlPlane {
 public:
  explicit CountingControlPlane(control::InProcessControlPlane inner) : inner_(std::move(inner)) {}
  absl::Status Report(const std::vector<control::BucketInfo>& ready) override {
    {
      absl::MutexLock lock(&mu_);
      reported_ += ready.size();
    }
    return inner_.Report(ready);
  }
  absl::StatusOr<std::vector<control::ScheduleBatch>> Poll(uint64_t next,
                                                           absl::Time deadline) override {
    return inner_.Poll(next, deadline);
  }
  absl::Status ReportFailure(const std::string& reason) override {
    return inner_.ReportFailure(reason);
  }
  absl::Status RefreshJobStatus() override { return inner_.RefreshJobStatus(); }
  const control::Membership& membership() const { return inner_.membership(); }
  // Buckets reported ready to the coordinator so far.
  uint64_t reported() {
    absl::MutexLock lock(&mu_);
    return reported_;
  }

 private:
  control::InProcessControlPlane inner_;
  absl::Mutex mu_;
  uint64_t reported_ = 0;
};

// `n` nodes of one job, one training process each.
class Cluster {
 public:
  Cluster(int n, EngineOptions eo) : dir_(testing::MakeTempDir("negotiation")) {
    control::CoordinatorOptions co;
    co.expected_nodes = n;
    coordinator_ = std::move(control::Coordinator::Create(co)).value();
    std::vector<std::unique_ptr<CountingControlPlane>> joined(n);
    std::vector<std::thread> joins;
    for (int r = 0; r < n; ++r) {
      joins.emplace_back([&, r] {
        auto c = control::InProcessControlPlane::Join(coordinator_.get(), "microd",
                                                      absl::StrCat("node", r), 1,
                                                      absl::Now() + absl::Seconds(20));
        if (c.ok()) joined[r] = std::make_unique<CountingControlPlane>(*std::move(c));
      });
    }
    for (auto& t : joins) t.join();
    transports_ = transport::CreateInprocGroup(n);
    control_.resize(n);
    for (auto& c : joined) {
      EXPECT_NE(c, nullptr);
      if (c == nullptr) return;
      const int rank = c->membership().node_rank;
      control_[rank] = std::move(c);
    }
    for (int r = 0; r < n; ++r) {
      ops_.push_back(kernels::CreateCpuSparseOps());
      engines_.push_back(std::make_unique<Engine>(eo, control_[r]->membership(), control_[r].get(),
                                                  transports_[r].get(), ops_[r].get()));
      local::LocalServerOptions lo;
      lo.socket_path = socket(r);
      servers_.push_back(std::move(local::LocalServer::Start(lo, engines_[r].get())).value());
      engines_[r]->SetServer(servers_[r].get());
      engines_[r]->Start();
    }
  }
  ~Cluster() {
    for (size_t r = 0; r < engines_.size(); ++r) {
      servers_[r]->Stop();
      engines_[r]->Stop(absl::CancelledError("test over"));
    }
    engines_.clear();
    servers_.clear();
  }
  int size() const { return static_cast<int>(engines_.size()); }
  std::string socket(int r) const { return absl::StrCat(dir_, "/node", r, ".sock"); }
  uint64_t reported(int r) { return control_[r]->reported(); }
  Engine& engine(int r) { return *engines_[r]; }

 private:
  const std::string dir_;
  std::unique_ptr<control::Coordinator> coordinator_;
  std::vector<std::unique_ptr<CountingControlPlane>> control_;
  std::vector<std::unique_ptr<transport::Transport>> transports_;
  std::vector<std::unique_ptr<kernels::SparseOps>> ops_;
  std::vector<std::unique_ptr<Engine>> engines_;
  std::vector<std::unique_ptr<local::LocalServer>> servers_;
};

// A training process with buckets of the given sizes.
class Trainer {
 public:
  // `dense`: every bucket registered MICROD_BUFFER_DENSE.
  Trainer(const std::string& socket, const std::vector<uint64_t>& sizes, bool dense = false) {
    microd_options o;
    microd_options_init(&o);
    o.socket_path = socket.c_str();
    o.timeout_ms = 20000;
    EXPECT_EQ(microd_connect(&o, &c_), MICROD_OK) << microd_last_error(nullptr);
    for (size_t b = 0; b < sizes.size(); ++b) {
      float* data = nullptr;
      int32_t id = -1;
      microd_buffer_options bo;
      microd_buffer_options_init(&bo);
      if (dense) bo.flags = MICROD_BUFFER_DENSE;
      void* raw = nullptr;
      EXPECT_EQ(
          microd_register_typed_buffer(c_, absl::StrCat("b", b).c_str(), sizes[b], &bo, &raw, &id),
          MICROD_OK)
          << microd_last_error(c_);
      data = static_cast<float*>(raw);
      data_.push_back(data);
      ids_.push_back(id);
      sizes_.push_back(sizes[b]);
    }
  }
  ~Trainer() { microd_close(c_); }

  // Submits every bucket in `order` (filled with `grad(b, i)`), then waits
  // for them all; the statuses, in bucket order.
  template <typename Grad>
  std::vector<microd_status> Step(const std::vector<int>& order, Grad grad, int timeout_ms) {
    std::vector<uint64_t> tickets(order.size());
    for (int b : order) {
      for (uint64_t i = 0; i < sizes_[b]; ++i) data_[b][i] = grad(b, i);
    }
    for (size_t k = 0; k < order.size(); ++k) {
      EXPECT_EQ(microd_allreduce_async(c_, ids_[order[k]], &tickets[k]), MICROD_OK);
    }
    std::vector<microd_status> status(order.size());
    for (size_t k = 0; k < order.size(); ++k) {
      status[order[k]] = microd_wait(c_, tickets[k], timeout_ms);
    }
    return status;
  }
  const float* data(int b) const { return data_[b]; }
  microd_status Save(const std::string& dir) { return microd_state_save(c_, dir.c_str(), 20000); }
  microd_status Load(const std::string& dir) { return microd_state_load(c_, dir.c_str(), 20000); }
  std::string error() const { return microd_last_error(c_); }

 private:
  microd_client* c_ = nullptr;
  std::vector<float*> data_;
  std::vector<int32_t> ids_;
  std::vector<uint64_t> sizes_;
};

float Grad(int node, int b, uint64_t i) {
  return std::sin(0.1f * float(i) + float(node) + 0.5f * float(b)) * (i % 53 == 0 ? 4.0f : 0.1f);
}

TEST(Negotiation, BucketsSubmittedInDifferentOrdersAreReducedAlikeEverywhere) {
  EngineOptions eo;
  eo.sparsify.density = 0.05;
  // Three small dense buckets (fused) and a sparse one.
  const std::vector<uint64_t> sizes = {1000, 3000, 70000, 500};
  Cluster cluster(3, eo);
  ASSERT_EQ(cluster.size(), 3);
  std::vector<std::unique_ptr<Trainer>> trainers;
  for (int r = 0; r < 3; ++r)
    trainers.push_back(std::make_unique<Trainer>(cluster.socket(r), sizes));
  for (int step = 0; step < 3; ++step) {
    std::vector<std::thread> threads;
    for (int r = 0; r < 3; ++r) {
      threads.emplace_back([&, r] {
        // Node r submits in its own order: rotated by r, reversed on odd steps.
        std::vector<int> order;
        for (int k = 0; k < 4; ++k) order.push_back((k + r) % 4);
        if (step % 2 == 1) std::reverse(order.begin(), order.end());
        for (microd_status s : trainers[r]->Step(
                 order, [&](int b, uint64_t i) { return Grad(r, b, i); }, 20000)) {
          EXPECT_EQ(s, MICROD_OK) << "node " << r << ": " << trainers[r]->error();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int b = 0; b < 4; ++b) {
      for (uint64_t i = 0; i < sizes[b]; ++i) {
        const float u = trainers[0]->data(b)[i];
        ASSERT_EQ(trainers[1]->data(b)[i], u) << "bucket " << b << " element " << i;
        ASSERT_EQ(trainers[2]->data(b)[i], u) << "bucket " << b << " element " << i;
        if (sizes[b] < eo.dense_floor) {
          const float want = (Grad(0, b, i) + Grad(1, b, i) + Grad(2, b, i)) / 3.0f;
          ASSERT_NEAR(u, want, 1e-6f) << "dense bucket " << b << " element " << i;
        }
      }
    }
  }
}

// Runs `steps` steps of the same buckets on two nodes; the buckets each node
// reported to the coordinator after each step.
std::vector<uint64_t> ReportsPerStep(bool response_cache, int steps) {
  EngineOptions eo;
  eo.response_cache = response_cache;
  const std::vector<uint64_t> sizes = {800, 100000};
  Cluster cluster(2, eo);
  std::vector<std::unique_ptr<Trainer>> trainers;
  for (int r = 0; r < 2; ++r)
    trainers.push_back(std::make_unique<Trainer>(cluster.socket(r), sizes));
  std::vector<uint64_t> reported;
  for (int step = 0; step < steps; ++step) {
    std::vector<std::thread> threads;
    for (int r = 0; r < 2; ++r) {
      threads.emplace_back([&, r] {
        for (microd_status s : trainers[r]->Step(
                 {1, 0}, [&](int b, uint64_t i) { return Grad(r, b, i) * float(step + 1); },
                 20000)) {
          EXPECT_EQ(s, MICROD_OK) << trainers[r]->error();
        }
      });
    }
    for (auto& t : threads) t.join();
    reported.push_back(cluster.reported(0));
  }
  return reported;
}

TEST(Negotiation, TheResponseCacheTakesRepeatedStepsOffTheCoordinator) {
  const std::vector<uint64_t> cached = ReportsPerStep(/*response_cache=*/true, 8);
  // The first steps are scheduled by the coordinator; from then on the
  // nodes agree between themselves: nothing more is reported.
  EXPECT_GT(cached[0], 0u);
  EXPECT_EQ(cached.back(), cached[2]) << "reports kept growing with the response cache on";
  const std::vector<uint64_t> uncached = ReportsPerStep(/*response_cache=*/false, 8);
  // Without it every step goes through the coordinator: both buckets, every step.
  EXPECT_EQ(uncached.back(), 2u * 8u);
}

// A node whose trainer is busy (evaluating, saving a checkpoint) submits
// later than the others by more than an operation's deadline: the others
// wait for it (the stall inspector reports such waits; --stall_abort_s ends
// them), with the response cache on and off.
TEST(Negotiation, ABucketSubmittedLateOnOneNodeIsWaitedFor) {
  for (const bool cache : {true, false}) {
    SCOPED_TRACE(cache ? "response cache" : "no response cache");
    EngineOptions eo;
    eo.op_timeout = absl::Seconds(1);
    eo.response_cache = cache;
    const std::vector<uint64_t> sizes = {1000, 2000};
    Cluster cluster(2, eo);
    Trainer t0(cluster.socket(0), sizes), t1(cluster.socket(1), sizes);
    for (int step = 0; step < 2; ++step) {
      std::thread late([&] {
        if (step == 1) absl::SleepFor(absl::Milliseconds(2500));
        for (microd_status st : t1.Step(
                 {0, 1}, [](int b, uint64_t i) { return Grad(1, b, i); }, 20000)) {
          EXPECT_EQ(st, MICROD_OK) << t1.error();
        }
      });
      for (microd_status st : t0.Step(
               {0, 1}, [](int b, uint64_t i) { return Grad(0, b, i); }, 20000)) {
        EXPECT_EQ(st, MICROD_OK) << t0.error();
      }
      late.join();
      for (int b = 0; b < 2; ++b) {
        EXPECT_EQ(t0.data(b)[7], (Grad(0, b, 7) + Grad(1, b, 7)) / 2.0f);
        EXPECT_EQ(t1.data(b)[7], t0.data(b)[7]);
      }
    }
  }
}

// With momentum correction the training side applies no momentum: the
// daemon must, to the dense buckets too (below --dense_floor, riding in a
// cycle or fused): their update is momentum SGD on the average,
// u = beta * u + average, with the response cache on and off.
TEST(Negotiation, DenseBucketsGetTheMomentumTheTrainingSideLeftOut) {
  for (const bool cache : {true, false}) {
    SCOPED_TRACE(cache ? "response cache" : "no response cache");
    EngineOptions eo;
    eo.response_cache = cache;
    eo.sparsify.momentum = 0.9;
    // 800 floats ride in a cycle (with the cache); 5000 do not fit one.
    const std::vector<uint64_t> sizes = {800, 5000};
    Cluster cluster(2, eo);
    Trainer t0(cluster.socket(0), sizes), t1(cluster.socket(1), sizes);
    std::vector<std::vector<float>> velocity = {std::vector<float>(800, 0.0f),
                                                std::vector<float>(5000, 0.0f)};
    for (int step = 0; step < 4; ++step) {
      auto grad = [step](int node) {
        return [node, step](int b, uint64_t i) { return Grad(node, b, i) + 0.01f * float(step); };
      };
      std::thread other([&] {
        for (microd_status st : t1.Step({1, 0}, grad(1), 20000)) EXPECT_EQ(st, MICROD_OK);
      });
      for (microd_status st : t0.Step({0, 1}, grad(0), 20000)) EXPECT_EQ(st, MICROD_OK);
      other.join();
      for (int b = 0; b < 2; ++b) {
        for (uint64_t i = 0; i < sizes[b]; ++i) {
          const float average = (grad(0)(b, i) + grad(1)(b, i)) / 2.0f;
          velocity[b][i] = 0.9f * velocity[b][i] + average;
          ASSERT_NEAR(t0.data(b)[i], velocity[b][i], 1e-6f * (1.0f + std::fabs(velocity[b][i])))
              << "bucket " << b << " element " << i << " step " << step;
          ASSERT_EQ(t1.data(b)[i], t0.data(b)[i]);
        }
      }
    }
  }
}

// A buffer registered MICROD_BUFFER_DENSE is averaged exactly, step after
// step, with momentum correction on: it may hold what is no gradient (the
// Python broadcast reuses one for every chunk of the parameters; with
// momentum its second chunk came out as 0.9 x the first + the second).
TEST(Negotiation, ABufferRegisteredDenseGetsNoMomentum) {
  EngineOptions eo;
  eo.sparsify.momentum = 0.9;
  for (const uint64_t d : {uint64_t{5000}, uint64_t{100000}}) {  // below and above the floor
    SCOPED_TRACE(::testing::Message() << "d=" << d);
    Cluster cluster(2, eo);
    Trainer t0(cluster.socket(0), {d}, /*dense=*/true), t1(cluster.socket(1), {d}, true);
    for (int step = 0; step < 3; ++step) {
      auto grad = [step](int node) {
        return [node, step](int b, uint64_t i) { return Grad(node, b, i) + float(step); };
      };
      std::thread other([&] {
        for (microd_status st : t1.Step({0}, grad(1), 20000)) EXPECT_EQ(st, MICROD_OK);
      });
      for (microd_status st : t0.Step({0}, grad(0), 20000)) EXPECT_EQ(st, MICROD_OK);
      other.join();
      for (uint64_t i = 0; i < d; i += 97) {
        ASSERT_NEAR(t0.data(0)[i], (grad(0)(0, i) + grad(1)(0, i)) / 2.0f, 1e-6f)
            << "element " << i << " step " << step;
      }
    }
  }
}

// A dense bucket's velocity is part of the saved state: a job restored from
// it continues as if it had not stopped.
TEST(Negotiation, ADenseBucketsVelocityIsSavedAndRestored) {
  EngineOptions eo;
  eo.sparsify.momentum = 0.9;
  const std::vector<uint64_t> sizes = {5000, 100000};  // dense, sparse
  const std::string dir = testing::MakeTempDir("negotiation-state");
  auto run = [&](Trainer& t0, Trainer& t1, int step) {
    auto grad = [step](int node) {
      return [node, step](int b, uint64_t i) { return Grad(node, b, i) * float(1 + step); };
    };
    std::thread other([&] {
      for (microd_status st : t1.Step({0, 1}, grad(1), 20000)) EXPECT_EQ(st, MICROD_OK);
    });
    for (microd_status st : t0.Step({1, 0}, grad(0), 20000)) EXPECT_EQ(st, MICROD_OK);
    other.join();
    return std::vector<float>(t0.data(0), t0.data(0) + sizes[0]);
  };
  auto both = [](Trainer& t0, Trainer& t1, microd_status (Trainer::*f)(const std::string&),
                 const std::string& d) {
    microd_status s1 = MICROD_OK;
    std::thread other([&] { s1 = (t1.*f)(d); });
    const microd_status s0 = (t0.*f)(d);
    other.join();
    EXPECT_EQ(s0, MICROD_OK) << t0.error();
    EXPECT_EQ(s1, MICROD_OK) << t1.error();
  };
  std::vector<std::vector<float>> straight;
  {
    Cluster cluster(2, eo);
    Trainer t0(cluster.socket(0), sizes), t1(cluster.socket(1), sizes);
    for (int step = 0; step < 2; ++step) run(t0, t1, step);
    both(t0, t1, &Trainer::Save, dir);
    for (int step = 2; step < 4; ++step) straight.push_back(run(t0, t1, step));
  }
  Cluster cluster(2, eo);
  Trainer t0(cluster.socket(0), sizes), t1(cluster.socket(1), sizes);
  both(t0, t1, &Trainer::Load, dir);
  for (int step = 2; step < 4; ++step) {
    EXPECT_EQ(run(t0, t1, step), straight[step - 2])
        << "the dense bucket's update at step " << step;
  }
}

// A gradient whose magnitudes spread smoothly (exponential, random signs),
// as a model's do: the top coarse bins of the hist controller hold few
// elements each.
float SmoothGrad(int node, int b, uint64_t i) {
  uint64_t x = (uint64_t(node) << 56) ^ (uint64_t(b) << 48) ^ i;
  x += 0x9e3779b97f4a7c15ull;  // splitmix64
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  const double u = (double(x >> 11) + 0.5) / double(uint64_t{1} << 53);
  return float((x & 1 ? 0.01 : -0.01) * -std::log(u));
}

// Each bucket reports the daemon's memory for it (microctl buckets, the
// metrics): one residual and candidates sized by k, one velocity with
// momentum correction, nothing more for clipping (a scale in the pass); a
// dense bucket's velocity.
TEST(Negotiation, EachBucketReportsTheDaemonsMemoryForIt) {
  struct Want {
    double momentum, clip;
    double sparse_min, sparse_max;  // bytes per element of the sparse bucket
    double dense;                   // of the dense one
  };
  const uint64_t d = 100000, small = 5000;
  // A sparse bucket of 2 nodes: one residual (4 B per element), one velocity
  // with momentum correction (4), room for 8 k candidates (k = 1000: 0.64);
  // no clipped copy. The step's small buffers (O(k)) stay under half a byte.
  // (Before: room for the partition, 4 B an element.) Read after 10 steps:
  // with momentum correction the first steps' sums outgrow the controller's
  // last bound and select more, and the room grows for them, then returns.
  for (const Want& w :
       {Want{0, 0, 4.64, 5.14, 0}, Want{0.9, 0, 8.64, 9.14, 4}, Want{0, 1.0, 4.64, 5.14, 0}}) {
    SCOPED_TRACE(::testing::Message() << "momentum " << w.momentum << ", clip " << w.clip);
    EngineOptions eo;
    eo.sparsify.momentum = w.momentum;
    eo.sparsify.clip_norm = w.clip;
    Cluster cluster(2, eo);
    Trainer t0(cluster.socket(0), {d, small}), t1(cluster.socket(1), {d, small});
    for (int step = 0; step < 10; ++step) {
      std::thread other([&] {
        (void)t1.Step(
            {0, 1}, [](int b, uint64_t i) { return SmoothGrad(1, b, i); }, 20000);
      });
      for (microd_status st : t0.Step(
               {0, 1}, [](int b, uint64_t i) { return SmoothGrad(0, b, i); }, 20000)) {
        EXPECT_EQ(st, MICROD_OK) << t0.error();
      }
      other.join();
    }
    const EngineSnapshot snap = cluster.engine(0).Snapshot();
    ASSERT_EQ(snap.buckets.size(), 2u);
    for (const BucketStats& b : snap.buckets) {
      const double per = static_cast<double>(b.state_bytes) / static_cast<double>(b.count);
      if (b.dense) {
        EXPECT_EQ(per, w.dense) << b.name;
      } else {
        EXPECT_GE(per, w.sparse_min) << b.name;
        EXPECT_LE(per, w.sparse_max) << b.name;
      }
    }
  }
}

}  // namespace
}  // namespace microd::engine
