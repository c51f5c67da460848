// SPDX-License-Identifier: Apache-2.0
// The step of every sparsifier against an independent, straightforward
// reference of docs/design.md section 1 written here: n in {1, 2, 3, 4, 7},
// sizes with remainders, 25 steps; updates and residuals must match bit for
// bit, and the `paper` threshold trajectory exactly.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "daemon/sparsify/batch_step.h"
#include "daemon/sparsify/bucket.h"
#include "daemon/transport/inproc/inproc_transport.h"
#include "gtest/gtest.h"
#include "kernels/sparse_ops.h"
#include "tests/transport/forwarding.h"

namespace microd::sparsify {
namespace {

using Vec = std::vector<float>;

uint32_t Bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, 4);
  return b;
}

void ExpectBitEqual(const Vec& got, const Vec& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_EQ(Bits(got[i]), Bits(want[i]))
        << what << " differs at " << i << ": " << got[i] << " vs " << want[i];
  }
}

// Gradients of n nodes at one step: a shared part (so top-k sets overlap)
// plus per-node noise, with layer-like scale changes along the bucket.
std::vector<Vec> MakeGrads(int n, uint64_t d, uint64_t t, uint32_t seed) {
  std::mt19937 shared_rng(seed * 7919 + t);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  Vec shared(d);
  for (auto& x : shared) x = normal(shared_rng);
  std::vector<Vec> g(n, Vec(d));
  for (int r = 0; r < n; ++r) {
    std::mt19937 rng(seed * 104729 + t * 131 + r);
    for (uint64_t i = 0; i < d; ++i) {
      const float scale = (i * 5 / std::max<uint64_t>(d, 1)) % 2 ? 0.05f : 0.002f;
      g[r][i] = scale * (shared[i] + 0.5f * normal(rng));
    }
  }
  return g;
}

// A half wire's rounding, from the definitions (not the kernels' code): bf16
// the nearer of the two truncations, ties to even; fp16 GCC's _Float16.
float ViaWire(int wire, float x) {
  if (wire == 2) {
    const uint32_t lo = Bits(x) & 0xffff0000u, hi = lo + 0x10000u;
    float flo, fhi;
    std::memcpy(&flo, &lo, sizeof flo);
    std::memcpy(&fhi, &hi, sizeof fhi);
    const double a = std::fabs(double(x) - flo), b = std::fabs(double(fhi) - x);
    return a < b || (a == b && ((lo >> 16) & 1u) == 0) ? flo : fhi;
  }
  return static_cast<float>(static_cast<_Float16>(x));
}

// The reference: state of every node, one step at a time. `wire` (2 bf16,
// 3 fp16; 1 fp32) is the selected values' type on the wire: each node's
// values rounded to it (the rest stays in its residual), their sum in fp32
// rounded once.
class Reference {
 public:
  Reference(int n, int W, uint64_t d, SparsifyOptions o, int wire = 1)
      : n_(n),
        W_(W),
        d_(d),
        wire_(wire),
        o_(o),
        k_(Budget(o.density, d)),
        e_(n, Vec(d, 0.0f)),
        m_(n, Vec(d, 0.0f)) {
    tau_ = 1.0 / (2.0 * std::sqrt(double(k_)));
  }

  // Returns the update every node receives. `micro_threshold` is used by
  // micro when the controller is not `paper`.
  Vec Step(const std::vector<Vec>& grads, float micro_threshold, uint64_t* K_out) {
    const std::vector<Vec>& raw = grads;  // as given (dense and warm-up steps)
    Vec u(d_, 0.0f);
    if (o_.sparsifier == SparsifierKind::kDense || o_.DenseAt(t_)) {
      // Dense (also during a dense warm-up: residual and threshold stay as
      // they are; with momentum correction the velocities are reduced, not
      // masked: momentum SGD on the average gradient).
      ++t_;
      const bool momentum = o_.momentum > 0 && o_.sparsifier != SparsifierKind::kDense;
      const float beta = static_cast<float>(o_.momentum);
      std::vector<Vec> in = raw;
      for (int r = 0; momentum && r < n_; ++r) {
        for (uint64_t i = 0; i < d_; ++i) in[r][i] = m_[r][i] = beta * m_[r][i] + raw[r][i];
      }
      for (uint64_t i = 0; i < d_; ++i) {
        float s = in[0][i];
        for (int r = 1; r < n_; ++r) s += in[r][i];
        u[i] = s / float(W_);
      }
      *K_out = d_;
      return u;
    }
    std::vector<Vec> g = grads;
    if (o_.clip_norm > 0) {
      // Local clipping: scale a node's gradient down to clip_norm / sqrt(n).
      const double limit = o_.clip_norm / std::sqrt(double(n_));
      for (int r = 0; r < n_; ++r) {
        double sum = 0;
        for (uint64_t i = 0; i < d_; ++i) sum += double(g[r][i]) * g[r][i];
        const double norm = std::sqrt(sum);
        if (norm > limit) {
          const float f = float(limit / norm);
          for (uint64_t i = 0; i < d_; ++i) g[r][i] = g[r][i] * f;
        }
      }
    }
    std::vector<Vec> acc(n_, Vec(d_));
    const bool momentum = o_.momentum > 0 && o_.sparsifier != SparsifierKind::kDense;
    const float beta = static_cast<float>(o_.momentum);
    for (int r = 0; r < n_; ++r) {
      for (uint64_t i = 0; i < d_; ++i) {
        // Momentum correction: accumulate the velocity instead of g.
        const float m = momentum ? beta * m_[r][i] + g[r][i] : g[r][i];
        if (momentum) m_[r][i] = m;
        acc[r][i] = e_[r][i] + m;
      }
    }
    std::vector<uint32_t> I;
    if (o_.sparsifier == SparsifierKind::kMicro) {
      const float thr = o_.controller == ControllerKind::kPaper ? float(tau_) : micro_threshold;
      for (int r = 0; r < n_; ++r) {
        const int p = int((t_ + r) % n_);
        const uint64_t q = d_ / n_, rem = d_ % n_;
        const uint64_t begin = p * q + std::min<uint64_t>(p, rem);
        const uint64_t end = begin + q + (uint64_t(p) < rem ? 1 : 0);
        for (uint64_t i = begin; i < end; ++i) {
          if (std::fabs(acc[r][i]) >= thr) I.push_back(uint32_t(i));
        }
      }
    } else {
      std::set<uint32_t> uni;
      for (int r = 0; r < n_; ++r) {
        if (o_.sparsifier == SparsifierKind::kHard) {
          const float lambda = float(o_.hard_threshold > 0 ? o_.hard_threshold
                                                           : 1.0 / (2.0 * std::sqrt(double(k_))));
          for (uint64_t i = 0; i < d_; ++i) {
            if (std::fabs(acc[r][i]) >= lambda) uni.insert(uint32_t(i));
          }
        } else {
          // The k largest magnitudes, ties to the lower index: the first k
          // of that total order (which k of them come first is all it needs).
          std::vector<uint32_t> order(d_);
          for (uint64_t i = 0; i < d_; ++i) order[i] = uint32_t(i);
          const uint64_t k = std::min(Budget(o_.DensityAt(t_), d_), d_);
          std::nth_element(order.begin(), order.begin() + k, order.end(),
                           [&](uint32_t a, uint32_t b) {
                             const float x = std::fabs(acc[r][a]), y = std::fabs(acc[r][b]);
                             return x > y || (x == y && a < b);
                           });
          uni.insert(order.begin(), order.begin() + k);
        }
      }
      I.assign(uni.begin(), uni.end());
    }
    for (uint32_t i : I) {
      if (wire_ != 1) {
        float v = ViaWire(wire_, acc[0][i]);
        for (int r = 1; r < n_; ++r) v += ViaWire(wire_, acc[r][i]);
        u[i] = ViaWire(wire_, v) / float(W_);
        continue;
      }
      float v = acc[0][i];
      for (int r = 1; r < n_; ++r) v += acc[r][i];
      u[i] = v / float(W_);
    }
    for (int r = 0; r < n_; ++r) {
      e_[r] = acc[r];
      for (uint32_t i : I) {
        e_[r][i] = wire_ != 1 ? acc[r][i] - ViaWire(wire_, acc[r][i]) : 0.0f;
        m_[r][i] = 0.0f;  // momentum factor masking
      }
    }
    const uint64_t K = I.size();
    const double x = double(K) / double(Budget(o_.DensityAt(t_), d_));
    tau_ *= x > 1.1 ? 1.005 : (x > 0.909 ? 1.00125 : 0.995);
    ++t_;
    *K_out = K;
    return u;
  }

  const Vec& residual(int r) const { return e_[r]; }
  double tau() const { return tau_; }

  // An elastic job's next epoch: nodes `kept` (old ranks, in their order)
  // go on as nodes 0..m-1 of a job of W processes, each with the residual
  // and velocity it held; t and the threshold go on.
  void Keep(const std::vector<int>& kept, int W) {
    std::vector<Vec> e, m;
    for (int r : kept) {
      e.push_back(e_[r]);
      m.push_back(m_[r]);
    }
    e_ = std::move(e);
    m_ = std::move(m);
    n_ = static_cast<int>(kept.size());
    W_ = W;
  }

 private:
  int n_, W_;
  const uint64_t d_;
  const int wire_;
  const SparsifyOptions o_;
  const uint64_t k_;
  std::vector<Vec> e_;
  std::vector<Vec> m_;  // velocities (momentum correction)
  double tau_;
  uint64_t t_ = 0;
};

// n nodes of one bucket over the in-process transport.
class Cluster {
 public:
  Cluster(int n, int W, uint64_t d, const SparsifyOptions& o, int wire = 1)
      : n_(n),
        W_(W),
        d_(d),
        o_(o),
        spec_{"grads.0", d, 3, static_cast<kernels::ElementType>(wire)} {
    group_ = transport::CreateInprocGroup(n);
    for (int r = 0; r < n; ++r) {
      // A backend per node, as each daemon has its own (and its own count of waits).
      ops_.push_back(kernels::CreateCpuSparseOps());
      auto b = BucketState::Create(spec_, {n, r, W}, o, ops_[r].get());
      EXPECT_TRUE(b.ok()) << b.status();
      buckets_.push_back(std::move(b).value());
    }
  }

  // One step on every node; returns each node's status. With `in_place` the
  // update is written over the gradient (what the engine does with one
  // training process per node).
  std::vector<absl::Status> Step(const std::vector<Vec>& g, std::vector<Vec>& updates,
                                 std::vector<StepStats>& stats, bool in_place = false) {
    if (in_place) {
      updates = g;
    } else {
      updates.assign(n_, Vec(d_, -1.0f));
    }
    stats.assign(n_, {});
    std::vector<absl::Status> status(n_);
    std::vector<std::thread> threads;
    for (int r = 0; r < n_; ++r) {
      threads.emplace_back([&, r] {
        auto s = buckets_[r]->Step(in_place ? updates[r].data() : g[r].data(), updates[r].data(),
                                   *group_[r], absl::Now() + absl::Seconds(30));
        if (s.ok()) {
          stats[r] = *s;
        } else {
          status[r] = s.status();
        }
      });
    }
    for (auto& t : threads) t.join();
    return status;
  }

  Vec residual(int r) const {
    const float* e = buckets_[r]->residual();
    return Vec(e, e + d_);
  }

  // The nodes `kept` (old ranks, ascending) go on as a job of their number
  // with W processes: a new transport among them, each bucket told its new
  // rank (BucketState::SetJob); the others are dropped, state and all.
  void Keep(const std::vector<int>& kept, int W) {
    const int m = static_cast<int>(kept.size());
    std::vector<std::unique_ptr<kernels::SparseOps>> ops;
    std::vector<std::unique_ptr<BucketState>> buckets;
    for (int i = 0; i < m; ++i) {
      ops.push_back(std::move(ops_[kept[i]]));
      buckets.push_back(std::move(buckets_[kept[i]]));
      const absl::Status s = buckets.back()->SetJob({m, i, W});
      ASSERT_TRUE(s.ok()) << s;
    }
    buckets_ = std::move(buckets);  // before ops_: a bucket frees into its backend
    ops_ = std::move(ops);
    group_ = transport::CreateInprocGroup(m);
    n_ = m;
    W_ = W;
  }
  BucketState& bucket(int r) { return *buckets_[r]; }

  // As a restarted job: every node saves its state, fresh states are made
  // (new memory, nothing kept) and load what was saved.
  void Restart() {
    for (int r = 0; r < n_; ++r) {
      auto saved = buckets_[r]->Save();
      ASSERT_TRUE(saved.ok()) << saved.status();
      auto fresh = BucketState::Create(spec_, {n_, r, W_}, o_, ops_[r].get());
      ASSERT_TRUE(fresh.ok()) << fresh.status();
      ASSERT_TRUE((*fresh)->Load(*saved).ok());
      buckets_[r] = std::move(fresh).value();
    }
  }

 private:
  int n_;
  int W_;
  const uint64_t d_;
  const SparsifyOptions o_;
  const BucketSpec spec_;
  std::vector<std::unique_ptr<kernels::SparseOps>> ops_;
  std::vector<std::unique_ptr<transport::Transport>> group_;
  std::vector<std::unique_ptr<BucketState>> buckets_;
};

// One step of every node with gradients `g`, checked bit for bit against
// the reference: each node's update and residual.
void StepLikeTheReference(Cluster& cluster, Reference& ref, const std::vector<Vec>& g,
                          std::vector<Vec>& updates, std::vector<StepStats>& stats) {
  for (const auto& s : cluster.Step(g, updates, stats)) ASSERT_TRUE(s.ok()) << s;
  uint64_t K = 0;
  const Vec want = ref.Step(g, float(stats[0].threshold), &K);
  for (size_t r = 0; r < updates.size(); ++r) {
    ExpectBitEqual(updates[r], want, "update of node " + std::to_string(r));
    ExpectBitEqual(cluster.residual(r), ref.residual(r), "residual of node " + std::to_string(r));
  }
}

// Every node's update (and residual, unless dense) against the reference's
// `want`, and each node's step, selection and threshold as node 0's.
void ExpectEveryNodeLikeTheReference(Cluster& cluster, const Reference& ref,
                                     const std::vector<Vec>& updates,
                                     const std::vector<StepStats>& stats, const Vec& want,
                                     uint64_t K, uint64_t t, bool residuals) {
  for (size_t r = 0; r < updates.size(); ++r) {
    ExpectBitEqual(updates[r], want, "update of node " + std::to_string(r));
    if (residuals) {
      ExpectBitEqual(cluster.residual(r), ref.residual(r), "residual of node " + std::to_string(r));
    }
    ASSERT_EQ(stats[r].step, t);
    ASSERT_EQ(stats[r].selected, K);
    ASSERT_EQ(stats[r].threshold, stats[0].threshold);
  }
}

struct Case {
  SparsifierKind sparsifier;
  ControllerKind controller;
  double momentum = 0.0;
  uint64_t warmup_steps = 0;
  double warmup_density = 0.0;  // decays to the density over 10 steps
  double clip_norm = 0.0;
  int wire = 1;              // the selected values on the wire: 1 fp32, 2 bf16, 3 fp16
  double dense_above = 0.0;  // --warmup_dense_above
};
void PrintTo(const Case& c, std::ostream* os) {
  *os << SparsifierName(c.sparsifier) << "/" << ControllerName(c.controller) << "/m" << c.momentum
      << (c.wire == 2   ? "/wire bf16"
          : c.wire == 3 ? "/wire fp16"
                        : "");
}

SparsifyOptions OptionsOf(const Case& c, double density) {
  SparsifyOptions o;
  o.sparsifier = c.sparsifier;
  o.controller = c.controller;
  o.density = density;
  o.momentum = c.momentum;
  o.warmup_steps = c.warmup_steps;
  o.warmup_density = c.warmup_density;
  o.warmup_decay_steps = c.warmup_density > 0 ? 10 : 0;
  o.warmup_dense_above = c.dense_above;
  o.clip_norm = c.clip_norm;
  return o;
}

class StepTest : public ::testing::TestWithParam<Case> {};

// Under a sanitizer (several times slower) each (n, d) runs one of the two
// densities, in turn, and a saved state continues at one size per n; the
// uninstrumented run takes them all.
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
constexpr bool kSanitized = true;
#else
constexpr bool kSanitized = false;
#endif

TEST_P(StepTest, MatchesReferenceBitForBit) {
  const Case c = GetParam();
  int combination = 0;
  for (int n : {1, 2, 3, 4, 7}) {
    for (uint64_t d : {uint64_t{5}, uint64_t{1003}, uint64_t{20011}}) {
      std::vector<std::vector<Vec>> grads;  // the same for both densities
      for (uint64_t t = 0; t < 25; ++t) grads.push_back(MakeGrads(n, d, t, uint32_t(d + n)));
      for (double density : {0.01, 0.1}) {
        if (kSanitized && (combination++ / 2 + (density == 0.1)) % 2 == 1) continue;
        SCOPED_TRACE(testing::Message() << "n=" << n << " d=" << d << " density=" << density);
        const SparsifyOptions o = OptionsOf(c, density);
        const int W = 2 * n;  // two training processes per node
        Cluster cluster(n, W, d, o, c.wire);
        Reference ref(n, W, d, o, c.wire);
        std::vector<Vec> updates;
        std::vector<StepStats> stats;
        bool any_clipped = false;
        for (uint64_t t = 0; t < 25; ++t) {
          const auto& g = grads[t];
          const double paper_tau = ref.tau();
          // Odd node counts write the update over the gradient.
          for (const auto& s : cluster.Step(g, updates, stats, n % 2 == 1)) {
            ASSERT_TRUE(s.ok()) << s;
          }
          for (const auto& st : stats) any_clipped = any_clipped || st.clipped;
          uint64_t K = 0;
          const Vec want = ref.Step(g, float(stats[0].threshold), &K);
          ExpectEveryNodeLikeTheReference(cluster, ref, updates, stats, want, K, t,
                                          c.sparsifier != SparsifierKind::kDense);
          if (HasFatalFailure()) return;
          if (c.sparsifier == SparsifierKind::kMicro) {
            // No build-up: the node sets are disjoint, K is the sum of the counts.
            ASSERT_EQ(stats[0].sum_of_counts, K);
            if (c.controller == ControllerKind::kPaper && t >= c.warmup_steps) {
              ASSERT_EQ(stats[0].threshold, double(float(paper_tau)));
              ASSERT_EQ(cluster.bucket(0).pass_threshold(), float(ref.tau()));
            }
          }
        }
        // The clipping cases must exercise clipping (d = 5 may stay below the limit).
        if (c.clip_norm > 0 && d > 5) {
          EXPECT_TRUE(any_clipped);
        }
      }
    }
  }
}

// An elastic job's epochs: 4 nodes, then node 2 lost (0, 1, 3 go on as
// 0, 1, 2), then the new node 1 lost (0 and 2 go on as 0 and 1). Each epoch
// re-cuts the partitions for its node count; the survivors keep their
// residuals, velocities, t and threshold: bit for bit the reference of
// their number, started from what they held (the lost nodes' residuals are
// lost with them).
TEST_P(StepTest, SurvivorsOfLostNodesGoOnAsAJobOfTheirNumber) {
  const Case c = GetParam();
  const uint64_t d = 20011;
  const SparsifyOptions o = OptionsOf(c, 0.01);
  Cluster cluster(4, 8, d, o, c.wire);
  Reference ref(4, 8, d, o, c.wire);
  std::vector<Vec> updates;
  std::vector<StepStats> stats;
  int n = 4;
  for (uint64_t t = 0; t < 24; ++t) {
    SCOPED_TRACE(testing::Message() << "step " << t << ", " << n << " nodes");
    if (t == 8 || t == 16) {
      const std::vector<int> kept = t == 8 ? std::vector<int>{0, 1, 3} : std::vector<int>{0, 2};
      n = static_cast<int>(kept.size());
      cluster.Keep(kept, 2 * n);
      ref.Keep(kept, 2 * n);
    }
    const auto g = MakeGrads(n, d, t, 77);
    for (const auto& s : cluster.Step(g, updates, stats)) ASSERT_TRUE(s.ok()) << s;
    uint64_t K = 0;
    const Vec want = ref.Step(g, float(stats[0].threshold), &K);
    ExpectEveryNodeLikeTheReference(cluster, ref, updates, stats, want, K, t,
                                    c.sparsifier != SparsifierKind::kDense);
    if (HasFatalFailure()) return;
  }
}

// A shape SetJob refuses changes nothing: the bucket steps on as before.
TEST(StepElastic, ABadShapeChangesNothing) {
  SparsifyOptions o;
  o.density = 0.01;
  Cluster cluster(2, 2, 1003, o);
  for (const JobShape bad : {JobShape{0, 0, 1}, JobShape{3, 3, 3}, JobShape{3, 1, 2}}) {
    const absl::Status s = cluster.bucket(1).SetJob(bad);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "grads.0")) << s;
  }
  EXPECT_EQ(cluster.bucket(1).job().num_nodes, 2);
  EXPECT_EQ(cluster.bucket(1).job().node_rank, 1);
  Reference ref(2, 2, 1003, o);
  std::vector<Vec> updates;
  std::vector<StepStats> stats;
  StepLikeTheReference(cluster, ref, MakeGrads(2, 1003, 0, 5), updates, stats);
}

INSTANTIATE_TEST_SUITE_P(
    Sparsifiers, StepTest,
    ::testing::Values(
        Case{SparsifierKind::kMicro, ControllerKind::kPaper},
        Case{SparsifierKind::kMicro, ControllerKind::kHistogram},
        Case{SparsifierKind::kTopK, ControllerKind::kHistogram},
        Case{SparsifierKind::kHard, ControllerKind::kHistogram},
        Case{SparsifierKind::kDense, ControllerKind::kHistogram},
        Case{SparsifierKind::kMicro, ControllerKind::kPaper, 0.9},
        Case{SparsifierKind::kMicro, ControllerKind::kHistogram, 0.9},
        Case{SparsifierKind::kTopK, ControllerKind::kHistogram, 0.5},
        Case{SparsifierKind::kMicro, ControllerKind::kPaper, 0.9, 3},
        Case{SparsifierKind::kMicro, ControllerKind::kHistogram, 0.0, 2, 0.25},
        // The shape of the defaults below 0.5 %: a dense warm-up,
        // then a decaying density, with momentum correction.
        Case{SparsifierKind::kMicro, ControllerKind::kHistogram, 0.9, 2, 0.25},
        Case{SparsifierKind::kTopK, ControllerKind::kHistogram, 0.0, 0, 0.25},
        Case{SparsifierKind::kMicro, ControllerKind::kPaper, 0.9, 0, 0.0, 0.3},
        Case{SparsifierKind::kHard, ControllerKind::kHistogram, 0.0, 0, 0.0, 0.5},
        // --wire_dtype=bucket for bf16/fp16 buckets.
        Case{SparsifierKind::kMicro, ControllerKind::kHistogram, 0.0, 0, 0.0, 0.0, 2},
        Case{SparsifierKind::kMicro, ControllerKind::kPaper, 0.9, 0, 0.0, 0.0, 3},
        Case{SparsifierKind::kTopK, ControllerKind::kHistogram, 0.0, 0, 0.0, 0.0, 2},
        Case{SparsifierKind::kHard, ControllerKind::kHistogram, 0.0, 0, 0.0, 0.0, 3},
        // --warmup_dense_above: the decay's first steps dense.
        Case{SparsifierKind::kMicro, ControllerKind::kHistogram, 0.9, 2, 0.5, 0.0, 1, 0.2},
        Case{SparsifierKind::kTopK, ControllerKind::kHistogram, 0.0, 0, 0.5, 0.0, 1, 0.2}),
    [](const auto& info) {
      return std::string(SparsifierName(info.param.sparsifier)) + "_" +
             ControllerName(info.param.controller) + (info.param.momentum > 0 ? "_momentum" : "") +
             (info.param.warmup_steps > 0 ? "_warmup" : "") +
             (info.param.warmup_density > 0 ? "_schedule" : "") +
             (info.param.clip_norm > 0 ? "_clip" : "") +
             (info.param.dense_above > 0 ? "_denseabove" : "") +
             (info.param.wire == 2   ? "_wirebf16"
              : info.param.wire == 3 ? "_wirefp16"
                                     : "");
    });

// A checkpoint of every node's state after 20 steps, loaded into fresh
// states, continues as if nothing happened: 20 + 20 steps equal 40 straight,
// update and residual, to the bit.
TEST_P(StepTest, ASavedStateContinuesBitForBit) {
  const Case c = GetParam();
  int combination = 0;
  for (int n : {1, 3, 4}) {
    for (uint64_t d : {uint64_t{1003}, uint64_t{20011}}) {
      // Under a sanitizer one size per n, in turn (the large one at n = 3).
      if (kSanitized && (combination++ / 2 + (d == 1003)) % 2 == 0) continue;
      SCOPED_TRACE(testing::Message() << "n=" << n << " d=" << d);
      const SparsifyOptions o = OptionsOf(c, 0.01);
      Cluster straight(n, 2 * n, d, o, c.wire), restarted(n, 2 * n, d, o, c.wire);
      std::vector<Vec> a, b;
      std::vector<StepStats> sa, sb;
      for (uint64_t t = 0; t < 40; ++t) {
        if (t == 20) restarted.Restart();
        const auto g = MakeGrads(n, d, t, uint32_t(d + n));
        for (const auto& s : straight.Step(g, a, sa)) ASSERT_TRUE(s.ok()) << s;
        for (const auto& s : restarted.Step(g, b, sb)) ASSERT_TRUE(s.ok()) << s;
        for (int r = 0; r < n; ++r) {
          ExpectBitEqual(b[r], a[r],
                         "update of node " + std::to_string(r) + " at step " + std::to_string(t));
          ASSERT_EQ(sb[r].step, t);
          ASSERT_EQ(sb[r].threshold, sa[r].threshold) << "step " << t;
        }
      }
      for (int r = 0; r < n && c.sparsifier != SparsifierKind::kDense; ++r) {
        ExpectBitEqual(restarted.residual(r), straight.residual(r), "final residual");
      }
    }
  }
}

// Selected values past fp16's range on an fp16 wire: the step fails on every
// node, saying so, instead of handing out an Inf update.
TEST(StepHalfWire, AnFp16OverflowFailsTheStepOnEveryNode) {
  SparsifyOptions o;
  o.density = 0.1;
  Cluster cluster(2, 2, 1003, o, /*wire=*/3);
  std::vector<Vec> g = MakeGrads(2, 1003, 0, 5);
  for (Vec& v : g) {
    for (float& x : v) x *= 1e7f;  // |x| up to ~1e6 > 65504
  }
  std::vector<Vec> updates;
  std::vector<StepStats> stats;
  for (const auto& s : cluster.Step(g, updates, stats)) {
    EXPECT_EQ(s.code(), absl::StatusCode::kOutOfRange) << s;
    EXPECT_TRUE(absl::StrContains(s.message(), "overflow float16 on the wire")) << s;
  }
}

// The density schedule: budgets follow the exponential decay on every node
// and the selection tracks them.
TEST(StepWarmup, DensityScheduleIsFollowedOnEveryNode) {
  const int n = 3;
  const uint64_t d = 20011;
  SparsifyOptions o;
  o.density = 0.01;
  o.warmup_steps = 2;
  o.warmup_density = 0.25;
  o.warmup_decay_steps = 8;
  Cluster cluster(n, n, d, o);
  std::vector<Vec> updates;
  std::vector<StepStats> stats;
  for (uint64_t t = 0; t < 14; ++t) {
    for (const auto& s : cluster.Step(MakeGrads(n, d, t, 9), updates, stats))
      ASSERT_TRUE(s.ok()) << s;
    double want = 0.01;
    if (t < 2) {
      want = 1.0;
    } else if (t < 10) {
      want = 0.25 * std::pow(0.01 / 0.25, (t - 2) / 8.0);
    }
    const uint64_t k = std::max<uint64_t>(1, uint64_t(std::floor(want * d)));
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(stats[r].budget, t < 2 ? d : k) << "node " << r << " step " << t;
      ASSERT_EQ(stats[r].dense, t < 2);
    }
    if (t >= 3) {
      EXPECT_LE(stats[0].cre, 0.05) << "step " << t;
    }
  }
}

// A bucket whose budget at the job's density is below min_k steps at the
// density that gives it min_k values, on every node, and the warm-up's
// density follows it where it was lower.
TEST(StepMinK, ASmallBucketGetsMinKValuesPerStep) {
  const int n = 3;
  const uint64_t d = 20011;
  SparsifyOptions o;
  o.density = 0.001;  // k = 20
  o.min_k = 500;
  Cluster cluster(n, n, d, o);
  std::vector<Vec> updates;
  std::vector<StepStats> stats;
  for (uint64_t t = 0; t < 6; ++t) {
    for (const auto& s : cluster.Step(MakeGrads(n, d, t, 9), updates, stats))
      ASSERT_TRUE(s.ok()) << s;
    for (int r = 0; r < n; ++r) ASSERT_EQ(stats[r].budget, 500u) << "node " << r;
  }
  EXPECT_LE(stats[0].cre, 0.1);

  // Exactly min_k, never one short by rounding, for any size.
  for (uint64_t size : {1001ull, 4099ull, 65537ull, 147146ull, 999999ull}) {
    SparsifyOptions b = o;
    b.min_k = 1000;
    EXPECT_EQ(Budget(b.ForBucket(size).density, size), std::min<uint64_t>(1000, size)) << size;
  }
  // A bucket at or above it, and a dense job, are left as they are.
  SparsifyOptions big = o;
  EXPECT_EQ(big.ForBucket(1000000).density, 0.001);
  big.min_k = 0;
  EXPECT_EQ(big.ForBucket(100).density, 0.001);
  SparsifyOptions warm = o;
  warm.warmup_density = 0.01;
  warm.warmup_decay_steps = 10;
  EXPECT_EQ(warm.ForBucket(20011).warmup_density, warm.ForBucket(20011).density);
}

// --warmup_dense_above: the decay's steps above the mark are dense, a
// prefix of the schedule; past the decay every step is sparse, whatever the
// density; the room a bucket starts with is the first sparse step's.
TEST(WarmUpDenseAbove, DecayStepsAboveTheMarkAreDense) {
  auto all = ParseRemedies("warmup,min_k");
  ASSERT_TRUE(all.ok());
  SparsifyOptions o;
  o.density = 0.001;
  ApplyRemedies(*all, &o);  // 50 dense steps, then 25 % -> 0.1 % over 399
  ASSERT_EQ(o.warmup_decay_steps, 399u);
  EXPECT_EQ(o.SparseFrom(0), 50u);  // the mark off: only the dense steps
  EXPECT_FALSE(o.DenseAt(50));
  o.warmup_dense_above = 0.01;
  ASSERT_TRUE(o.Validate().ok());
  // 0.25 * 0.004^(i / 399) <= 0.01 from i = 233 (399 * ln 25 / ln 250 = 232.6).
  for (uint64_t t : {0, 49, 50, 51, 200, 282}) EXPECT_TRUE(o.DenseAt(t)) << t;
  for (uint64_t t : {283, 284, 448, 449, 100000}) EXPECT_FALSE(o.DenseAt(t)) << t;
  EXPECT_GT(o.DensityAt(282), 0.01);
  EXPECT_LE(o.DensityAt(283), 0.01);
  for (uint64_t t : {0, 1, 50, 282, 283}) EXPECT_EQ(o.SparseFrom(t), 283u) << t;
  EXPECT_EQ(o.SparseFrom(300), 300u);
  // The remedy's line says so.
  SparsifyOptions said;
  said.density = 0.001;
  said.warmup_dense_above = 0.01;
  const std::vector<std::string> lines = ApplyRemedies(*all, &said);
  ASSERT_FALSE(lines.empty());
  EXPECT_TRUE(absl::StrContains(lines[0],
                                "above density 0.01 run dense, the first sparse one "
                                "is step 283"))
      << lines[0];
  // A target above the mark: dense through the decay, sparse after it.
  SparsifyOptions high;
  high.density = 0.05;
  high.warmup_density = 0.5;
  high.warmup_decay_steps = 10;
  high.warmup_dense_above = 0.1;
  // 0.5 * 0.1^(t / 10) > 0.1 up to t = 6 (0.5 * 0.1^0.7 = 0.0998).
  EXPECT_TRUE(high.DenseAt(0));
  EXPECT_TRUE(high.DenseAt(6));
  EXPECT_FALSE(high.DenseAt(7));
  EXPECT_EQ(high.SparseFrom(0), 7u);
  EXPECT_FALSE(high.DenseAt(10));
  EXPECT_FALSE(high.DenseAt(1000));
  // A target above the mark itself: sparse once the decay is over.
  high.warmup_dense_above = 0.01;
  EXPECT_TRUE(high.DenseAt(9));
  EXPECT_FALSE(high.DenseAt(10));
  EXPECT_EQ(high.SparseFrom(3), 10u);
  // Out of range.
  for (double bad : {-0.1, 1.5, std::nan("")}) {
    SparsifyOptions b = o;
    b.warmup_dense_above = bad;
    EXPECT_FALSE(b.Validate().ok()) << bad;
  }
}

// --remedies: below kRemedyDensity the daemon fills in the floor on k (auto)
// and the warm-up (when asked for) where their flags are unset; a flag that
// is set wins; at 1 % and with `off` nothing changes.
TEST(Remedies, FillInOnlyWhatTheFlagsLeaveUnset) {
  auto defaults = ParseRemedies("auto");
  ASSERT_TRUE(defaults.ok());
  SparsifyOptions d;
  d.density = 0.001;
  const std::vector<std::string> auto_lines = ApplyRemedies(*defaults, &d);
  ASSERT_EQ(auto_lines.size(), 1u);
  EXPECT_TRUE(absl::StrContains(auto_lines[0], "minimum k")) << auto_lines[0];
  EXPECT_EQ(d.warmup_steps, 0u);
  EXPECT_EQ(d.warmup_density, 0.0);
  EXPECT_EQ(d.min_k, kMinK);

  auto all = ParseRemedies("warmup,min_k");
  ASSERT_TRUE(all.ok());
  SparsifyOptions o;
  o.density = 0.001;
  std::vector<std::string> lines = ApplyRemedies(*all, &o);
  ASSERT_EQ(lines.size(), 2u);
  EXPECT_TRUE(absl::StrContains(lines[0], "warm-up")) << lines[0];
  EXPECT_TRUE(absl::StrContains(lines[1], "minimum k")) << lines[1];
  EXPECT_EQ(o.warmup_steps, kWarmupDenseSteps);
  EXPECT_EQ(o.warmup_density, kWarmupStartDensity);
  // 25 % -> 0.1 %: log4(250) = 3.98 stages.
  EXPECT_EQ(o.warmup_decay_steps,
            uint64_t(std::ceil(std::log(250.0) / std::log(4.0) * kWarmupStageSteps)));
  EXPECT_EQ(o.min_k, kMinK);
  EXPECT_TRUE(o.Validate().ok());

  SparsifyOptions mine;
  mine.density = 0.001;
  mine.warmup_steps = 7;  // set by hand: the warm-up is the user's
  mine.min_k = 10;
  EXPECT_TRUE(ApplyRemedies(*all, &mine).empty());
  EXPECT_EQ(mine.warmup_steps, 7u);
  EXPECT_EQ(mine.warmup_density, 0.0);
  EXPECT_EQ(mine.min_k, 10u);

  SparsifyOptions one_percent;
  one_percent.density = 0.01;
  EXPECT_TRUE(ApplyRemedies(*all, &one_percent).empty());
  EXPECT_EQ(one_percent.warmup_steps, 0u);
  EXPECT_EQ(one_percent.min_k, 0u);

  auto off = ParseRemedies("off");
  ASSERT_TRUE(off.ok());
  SparsifyOptions none;
  none.density = 0.0001;
  EXPECT_TRUE(ApplyRemedies(*off, &none).empty());

  auto only = ParseRemedies("min_k");
  ASSERT_TRUE(only.ok());
  SparsifyOptions floor_only;
  floor_only.density = 0.001;
  EXPECT_EQ(ApplyRemedies(*only, &floor_only).size(), 1u);
  EXPECT_EQ(floor_only.warmup_steps, 0u);
  EXPECT_EQ(floor_only.min_k, kMinK);

  // A decay length alone decays nothing: refused, not silently a no-op
  // (and not a way to lose the default warm-up unawares).
  SparsifyOptions decay_only;
  decay_only.density = 0.001;
  decay_only.warmup_decay_steps = 200;
  EXPECT_TRUE(ApplyRemedies(*defaults, &decay_only).size() == 1u);  // min_k only
  const absl::Status refused = decay_only.Validate();
  EXPECT_FALSE(refused.ok());
  EXPECT_TRUE(absl::StrContains(refused.message(), "--warmup_density")) << refused;

  auto bad = ParseRemedies("warmup,clipping");
  ASSERT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "clipping")) << bad.status();
}

TEST(StepBuildUp, TopKAndHardBuildUpMicroDoesNot) {
  const int n = 4;
  const uint64_t d = 40000;
  for (SparsifierKind kind :
       {SparsifierKind::kTopK, SparsifierKind::kHard, SparsifierKind::kMicro}) {
    SparsifyOptions o;
    o.sparsifier = kind;
    o.density = 0.01;
    Cluster cluster(n, n, d, o);
    std::vector<Vec> updates;
    std::vector<StepStats> stats;
    uint64_t overlap_steps = 0;
    for (uint64_t t = 0; t < 10; ++t) {
      for (const auto& s : cluster.Step(MakeGrads(n, d, t, 5), updates, stats)) {
        ASSERT_TRUE(s.ok()) << s;
      }
      ASSERT_GE(stats[0].sum_of_counts, stats[0].selected);
      overlap_steps += stats[0].sum_of_counts > stats[0].selected;
      if (kind == SparsifierKind::kTopK) {
        ASSERT_GT(stats[0].selected, stats[0].budget);  // the union exceeds k
        ASSERT_LE(stats[0].selected, n * stats[0].budget);
      }
    }
    if (kind == SparsifierKind::kMicro) {
      EXPECT_EQ(overlap_steps, 0u);
    } else {
      EXPECT_EQ(overlap_steps, 10u) << SparsifierName(kind);
    }
  }
}

// What the host waits for per step (each wait a round trip to a GPU): the
// readbacks and copies a step needs, none per node: every node's indices
// and values arrive in one host message per round, so the count is the
// same for 2, 3 and 4 nodes.
TEST(StepHostWaits, DoNotGrowWithTheNumberOfNodes) {
  struct Want {
    SparsifierKind sparsifier;
    ControllerKind controller;
    uint64_t waits;  // per step after the first
    const char* what;
  };
  constexpr const char* kValues = "I to the device, the values to the host and their sums back";
  const Want wants[] = {
      {SparsifierKind::kMicro, ControllerKind::kPaper, 4, kValues},
      {SparsifierKind::kMicro, ControllerKind::kHistogram, 4, kValues},
      {SparsifierKind::kTopK, ControllerKind::kPaper, 5, kValues},
      {SparsifierKind::kHard, ControllerKind::kPaper, 4, kValues},
      {SparsifierKind::kDense, ControllerKind::kPaper, 1, "non-finite count"},
  };
  const uint64_t d = 30011;
  for (const Want& want : wants) {
    for (int n : {2, 3, 4}) {
      SparsifyOptions o;
      o.sparsifier = want.sparsifier;
      o.controller = want.controller;
      // Room for every partition (8 k candidates): paper's first thresholds
      // select far more than k, and a step whose pass outgrows the room
      // waits once more, to grow it.
      o.density = 0.1;
      Cluster cluster(n, n, d, o);
      std::vector<Vec> updates;
      std::vector<StepStats> stats;
      for (uint64_t t = 0; t < 4; ++t) {
        for (const auto& s : cluster.Step(MakeGrads(n, d, t, 13), updates, stats)) {
          ASSERT_TRUE(s.ok()) << s;
        }
        if (t == 0) continue;  // the first step of `hist` also samples for its prime
        for (int r = 0; r < n; ++r) {
          ASSERT_EQ(stats[r].rescans, 0);
          EXPECT_EQ(stats[r].host_waits, want.waits)
              << SparsifierName(want.sparsifier) << "/" << ControllerName(want.controller)
              << " (the pass's count, top-k's, " << want.what << "), node " << r << " of " << n
              << ", step " << t;
        }
      }
    }
  }
}

// Nodes whose states are of different steps (each daemon restores its own
// checkpoint) fail the step on every node, naming each node's step, at the
// header exchange: what follows it (partitions, budgets, the controller's
// rounds) would differ between them, and NCCL takes its shape on trust.
TEST(StepStates, NodesAtDifferentStepsFailEveryNode) {
  const int n = 3;
  const uint64_t d = 5003;
  for (const Case c : {Case{SparsifierKind::kMicro, ControllerKind::kPaper},
                       Case{SparsifierKind::kMicro, ControllerKind::kHistogram},
                       Case{SparsifierKind::kTopK, ControllerKind::kPaper}}) {
    Cluster cluster(n, n, d, OptionsOf(c, 0.01));
    std::vector<Vec> updates;
    std::vector<StepStats> stats;
    absl::StatusOr<BucketCheckpoint> saved;
    for (uint64_t t = 0; t < 3; ++t) {
      for (const auto& s : cluster.Step(MakeGrads(n, d, t, 21), updates, stats)) {
        ASSERT_TRUE(s.ok()) << s;
      }
      if (t == 0) saved = cluster.bucket(1).Save();
    }
    ASSERT_TRUE(saved.ok()) << saved.status();
    ASSERT_TRUE(cluster.bucket(1).Load(*saved).ok());  // node 1 back at step 1
    const auto status = cluster.Step(MakeGrads(n, d, 3, 21), updates, stats);
    for (int r = 0; r < n; ++r) {
      ASSERT_EQ(status[r].code(), absl::StatusCode::kFailedPrecondition)
          << ::testing::PrintToString(c) << " node " << r << ": " << status[r];
      const std::string msg(status[r].message());
      EXPECT_TRUE(absl::StrContains(msg, "grads.0")) << msg;
      if (r == 1) {
        EXPECT_TRUE(absl::StrContains(msg, "this node (1) is at step 1")) << msg;
        EXPECT_TRUE(absl::StrContains(msg, "node 0 is at step 3")) << msg;
      } else {
        EXPECT_TRUE(absl::StrContains(msg, "is at step 3")) << msg;
        EXPECT_TRUE(absl::StrContains(msg, "node 1 is at step 1")) << msg;
      }
    }
  }
}

TEST(StepBadInput, InvalidConfigurationIsRefused) {
  auto ops = kernels::CreateCpuSparseOps();
  SparsifyOptions o;
  const JobShape job{4, 0, 4};
  o.momentum = 1.0;
  EXPECT_EQ(BucketState::Create({"b", 100, 0}, job, o, ops.get()).status().code(),
            absl::StatusCode::kInvalidArgument);
  o.momentum = 0.0;
  for (double density : {0.0, -0.5, 1.5, std::nan("")}) {
    o.density = density;
    auto b = BucketState::Create({"b", 100, 0}, job, o, ops.get());
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument);
    EXPECT_TRUE(absl::StrContains(b.status().message(), "density")) << b.status();
  }
  o.density = 1.0;
  EXPECT_TRUE(BucketState::Create({"b", 100, 0}, job, o, ops.get()).ok());
  o.density = 0.01;
  for (JobShape bad :
       {JobShape{0, 0, 1}, JobShape{4, 4, 4}, JobShape{4, -1, 4}, JobShape{4, 0, 3}}) {
    auto b = BucketState::Create({"b", 100, 0}, bad, o, ops.get());
    ASSERT_FALSE(b.ok());
    EXPECT_EQ(b.status().code(), absl::StatusCode::kInvalidArgument) << b.status();
  }
  auto huge = BucketState::Create({"huge", uint64_t{1} << 32, 0}, job, o, ops.get());
  ASSERT_FALSE(huge.ok());
  EXPECT_TRUE(absl::StrContains(huge.status().message(), "2^32")) << huge.status();
  EXPECT_TRUE(absl::StrContains(huge.status().message(), "huge")) << huge.status();
  EXPECT_FALSE(BucketState::Create({"empty", 0, 0}, job, o, ops.get()).ok());
  EXPECT_FALSE(BucketState::Create({"", 10, 0}, job, o, ops.get()).ok());
  EXPECT_TRUE(BucketState::Create({"max", kernels::kMaxBucketElements, 0}, job,
                                  SparsifyOptions{SparsifierKind::kDense}, ops.get())
                  .ok());
}

TEST(StepBadInput, TransportOfAnotherShapeIsRefused) {
  auto ops = kernels::CreateCpuSparseOps();
  auto group = transport::CreateInprocGroup(1);
  auto b = BucketState::Create({"b", 10, 0}, {2, 0, 2}, SparsifyOptions{}, ops.get());
  ASSERT_TRUE(b.ok());
  Vec g(10, 1.0f), u(10);
  auto s = (*b)->Step(g.data(), u.data(), *group[0], absl::Now() + absl::Seconds(5));
  EXPECT_EQ(s.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_EQ((*b)->step(), 0u);
}

// A NaN or Inf on one node fails the step on every node, names the bucket and
// the node, and changes no state: the next good step continues as if the bad
// one never happened.
TEST_P(StepTest, NonFiniteGradientFailsEveryNodeAndChangesNothing) {
  const Case c = GetParam();
  const int n = 3;
  const uint64_t d = 3001;
  SparsifyOptions o;
  o.sparsifier = c.sparsifier;
  o.controller = c.controller;
  o.density = 0.01;
  o.momentum = c.momentum;
  Cluster cluster(n, n, d, o);
  Reference ref(n, n, d, o);
  std::vector<Vec> updates;
  std::vector<StepStats> stats;
  for (uint64_t t = 0; t < 8; ++t) {
    const auto g = MakeGrads(n, d, t, 77);
    if (t == 3 || t == 5) {
      auto bad = g;
      bad[1][d / 2] =
          t == 3 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
      std::vector<Vec> before;
      if (c.sparsifier != SparsifierKind::kDense) {
        for (int r = 0; r < n; ++r) before.push_back(cluster.residual(r));
      }
      const double threshold_before = cluster.bucket(0).pass_threshold();
      const auto status = cluster.Step(bad, updates, stats);
      for (int r = 0; r < n; ++r) {
        ASSERT_FALSE(status[r].ok()) << "node " << r;
        EXPECT_EQ(status[r].code(), absl::StatusCode::kInvalidArgument);
        EXPECT_TRUE(absl::StrContains(status[r].message(), "grads.0")) << status[r];
        EXPECT_TRUE(absl::StrContains(status[r].message(), "node 1")) << status[r];
        if (c.sparsifier != SparsifierKind::kDense) {
          ExpectBitEqual(cluster.residual(r), before[r], "residual after a failed step");
        }
        EXPECT_EQ(cluster.bucket(r).step(), t);
      }
      EXPECT_EQ(cluster.bucket(0).pass_threshold(), threshold_before);
    }
    for (const auto& s : cluster.Step(g, updates, stats)) ASSERT_TRUE(s.ok()) << s;
    uint64_t K;
    const Vec want = ref.Step(g, float(stats[0].threshold), &K);
    for (int r = 0; r < n; ++r) ExpectBitEqual(updates[r], want, "update after recovery");
  }
}

// A NaN during the dense warm-up with momentum correction (whose new
// velocity borrows the residual's buffer) fails the step and changes
// nothing: the velocity as before, the residual zero; the steps after match
// the reference.
TEST(StepWarmUp, NonFiniteDuringTheDenseWarmUpChangesNothing) {
  const int n = 3;
  const uint64_t d = 3001;
  SparsifyOptions o;
  o.density = 0.01;
  o.momentum = 0.9;
  o.warmup_steps = 4;
  Cluster cluster(n, n, d, o);
  Reference ref(n, n, d, o);
  std::vector<Vec> updates;
  std::vector<StepStats> stats;
  for (uint64_t t = 0; t < 8; ++t) {
    const auto g = MakeGrads(n, d, t, 91);
    if (t == 2) {
      auto bad = g;
      bad[2][7] = std::numeric_limits<float>::quiet_NaN();
      std::vector<std::vector<float>> velocity;
      for (int r = 0; r < n; ++r) velocity.push_back(cluster.bucket(r).Save()->velocity);
      const auto status = cluster.Step(bad, updates, stats);
      for (int r = 0; r < n; ++r) {
        ASSERT_FALSE(status[r].ok()) << "node " << r;
        EXPECT_TRUE(absl::StrContains(status[r].message(), "node 2")) << status[r];
        ExpectBitEqual(cluster.bucket(r).Save()->velocity, velocity[r],
                       "velocity after a failed warm-up step");
        ExpectBitEqual(cluster.residual(r), Vec(d, 0.0f), "residual after a failed warm-up step");
        EXPECT_EQ(cluster.bucket(r).step(), t);
      }
    }
    StepLikeTheReference(cluster, ref, g, updates, stats);
    if (::testing::Test::HasFatalFailure()) return;
    EXPECT_EQ(stats[0].dense, t < o.warmup_steps);
  }
}

// A peer that lies (issue J): node 1's transport, wrapped, sends a count
// larger than it can have selected, or indices outside what it selects from.
// Every node fails the step with an error naming node 1, before anything is
// allocated for or indexed with the lie (clean under ASan).
class HostileTransport final : public transport::Forwarding {
 public:
  enum class Lie { kHugeCount, kIndexOutOfBucket, kIndexInAnotherPartition };
  HostileTransport(transport::Transport* inner, Lie lie, uint64_t d, bool hist)
      : Forwarding(inner), lie_(lie), d_(d), hist_(hist) {}
  const char* name() const override { return "hostile"; }
  // The step's one bucket: round 1 is its header, flags and (top-k, hard)
  // its indices; round 2 (hist) starts with the indices above the k-th
  // value's bin.
  absl::Status ExchangeRound(std::string_view mine, std::vector<std::string>* from,
                             const transport::CollectiveOptions& o) override {
    const uint32_t kind = o.tag & 0xFF;
    std::string lied(mine);
    if (armed_ && lie_ == Lie::kHugeCount && kind == uint32_t(transport::TagKind::kRound1)) {
      const uint64_t huge = uint64_t{1} << 40;
      std::memcpy(lied.data(), &huge, sizeof huge);  // the header's count
    }
    const auto indices_in = hist_ ? transport::TagKind::kRound2 : transport::TagKind::kRound1;
    if (armed_ && lie_ != Lie::kHugeCount && kind == uint32_t(indices_in)) {
      uint64_t count = 0;
      size_t at = 0;
      if (hist_) {
        uint32_t above = 0;
        std::memcpy(&above, lied.data(), sizeof above);
        count = above;
        at = sizeof above;
      } else {
        std::memcpy(&count, lied.data(), sizeof count);
        at = sizeof(sparsify::BucketState::Header) + sizeof(uint32_t);
      }
      for (uint64_t j = 0; j < count; ++j) {
        uint32_t i;
        std::memcpy(&i, lied.data() + at + 4 * j, 4);
        if (lie_ == Lie::kIndexOutOfBucket) {
          if (j == count / 2) i = static_cast<uint32_t>(d_ + 7);
        } else {
          i = static_cast<uint32_t>((i + d_ / 2) % d_);
        }
        std::memcpy(lied.data() + at + 4 * j, &i, 4);
      }
    }
    return inner_->ExchangeRound(lied, from, o);
  }
  void Abort(const absl::Status& reason) override { inner_->Abort(reason); }
  void Arm() { armed_ = true; }

 private:
  const Lie lie_;
  const uint64_t d_;
  const bool hist_;  // micro's default controller: indices in round 2
  bool armed_ = false;
};

struct HostileCase {
  SparsifierKind sparsifier;
  HostileTransport::Lie lie;
};

class StepHostilePeer : public ::testing::TestWithParam<HostileCase> {};

TEST_P(StepHostilePeer, FailsTheStepOnEveryNodeNamingThePeer) {
  const HostileCase c = GetParam();
  const int n = 3;
  const uint64_t d = 3001;
  SparsifyOptions o;
  o.sparsifier = c.sparsifier;
  o.density = 0.02;
  auto ops = kernels::CreateCpuSparseOps();
  auto group = transport::CreateInprocGroup(n);
  HostileTransport liar(group[1].get(), c.lie, d, c.sparsifier == SparsifierKind::kMicro);
  std::vector<std::unique_ptr<BucketState>> buckets;
  for (int r = 0; r < n; ++r) {
    auto b = BucketState::Create({"grads.0", d, 3}, {n, r, n}, o, ops.get());
    ASSERT_TRUE(b.ok()) << b.status();
    buckets.push_back(std::move(b).value());
  }
  for (uint64_t t = 0; t < 3; ++t) {
    if (t == 2) liar.Arm();
    const auto g = MakeGrads(n, d, t, 5);
    std::vector<Vec> updates(n, Vec(d));
    std::vector<absl::Status> status(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        transport::Transport& tr = r == 1 ? liar : *group[r];
        auto s =
            buckets[r]->Step(g[r].data(), updates[r].data(), tr, absl::Now() + absl::Seconds(20));
        status[r] = s.status();
      });
    }
    for (auto& th : threads) th.join();
    for (int r = 0; r < n; ++r) {
      if (t < 2) {
        ASSERT_TRUE(status[r].ok()) << "node " << r << " step " << t << ": " << status[r];
        continue;
      }
      EXPECT_EQ(status[r].code(), absl::StatusCode::kDataLoss) << "node " << r << ": " << status[r];
      EXPECT_TRUE(absl::StrContains(status[r].message(), "node 1 ")) << status[r];
      EXPECT_TRUE(absl::StrContains(status[r].message(), "grads.0")) << status[r];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Lies, StepHostilePeer,
    ::testing::Values(
        HostileCase{SparsifierKind::kMicro, HostileTransport::Lie::kHugeCount},
        HostileCase{SparsifierKind::kMicro, HostileTransport::Lie::kIndexOutOfBucket},
        HostileCase{SparsifierKind::kMicro, HostileTransport::Lie::kIndexInAnotherPartition},
        HostileCase{SparsifierKind::kTopK, HostileTransport::Lie::kHugeCount},
        HostileCase{SparsifierKind::kTopK, HostileTransport::Lie::kIndexOutOfBucket},
        HostileCase{SparsifierKind::kHard, HostileTransport::Lie::kIndexOutOfBucket}));

// A transport that fails the step's last collective (the values'
// allreduce, or the dense one) on every node once armed: the step's whole
// selection has run, nothing is left to fail after it.
class FailingValuesTransport final : public transport::Forwarding {
 public:
  explicit FailingValuesTransport(transport::Transport* inner) : Forwarding(inner) {}
  const char* name() const override { return "failing"; }
  absl::Status AllreduceSum(void* data, size_t count, transport::DataType type,
                            const transport::CollectiveOptions& o) override {
    if (Fails(o)) return absl::UnavailableError("link down (test)");
    return inner_->AllreduceSum(data, count, type, o);
  }
  absl::Status ExchangeRound(std::string_view mine, std::vector<std::string>* from,
                             const transport::CollectiveOptions& o) override {
    if (Fails(o)) return absl::UnavailableError("link down (test)");
    return inner_->ExchangeRound(mine, from, o);
  }
  void Abort(const absl::Status& reason) override { inner_->Abort(reason); }
  void Arm() { armed_ = true; }

 private:
  // The values' round (direct or an allreduce), or the dense allreduce.
  bool Fails(const transport::CollectiveOptions& o) {
    const uint32_t kind = o.tag & 0xFF;
    if (!armed_ || (kind != uint32_t(transport::TagKind::kRound3) &&
                    kind != uint32_t(transport::TagKind::kDense))) {
      return false;
    }
    armed_ = false;
    return true;
  }

  bool armed_ = false;
};

class StepRollback : public ::testing::TestWithParam<Case> {};

// The state a step keeps (one residual, one velocity: W's memory cut) is
// written only once every node has agreed the step: a step that fails at
// its very last exchange leaves residual, velocity, threshold and t as they
// were, on every node, and the job goes on with the bits of a job that
// never failed.
TEST_P(StepRollback, AStepFailingAtItsLastExchangeChangesNothing) {
  const Case c = GetParam();
  const int n = 3;
  const uint64_t d = 3001;
  SparsifyOptions o;
  o.sparsifier = c.sparsifier;
  o.controller = c.controller;
  o.density = 0.01;
  o.momentum = c.momentum;
  o.warmup_steps = c.warmup_steps;
  o.clip_norm = c.clip_norm;
  const BucketSpec spec{"grads.0", d, 3, static_cast<kernels::ElementType>(c.wire)};
  auto ops = kernels::CreateCpuSparseOps();
  auto failing_group = transport::CreateInprocGroup(n);
  auto plain_group = transport::CreateInprocGroup(n);
  std::vector<std::unique_ptr<FailingValuesTransport>> failing;
  std::vector<std::unique_ptr<BucketState>> a, b;  // a fails once, b never
  for (int r = 0; r < n; ++r) {
    failing.push_back(std::make_unique<FailingValuesTransport>(failing_group[r].get()));
    for (auto* set : {&a, &b}) {
      auto made = BucketState::Create(spec, {n, r, n}, o, ops.get());
      ASSERT_TRUE(made.ok()) << made.status();
      set->push_back(std::move(made).value());
    }
  }
  auto run = [&](std::vector<std::unique_ptr<BucketState>>& buckets, bool use_failing,
                 const std::vector<Vec>& g, std::vector<Vec>* updates) {
    updates->assign(n, Vec(d));
    std::vector<absl::Status> status(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        transport::Transport& tr = use_failing ? *failing[r] : *plain_group[r];
        status[r] =
            buckets[r]
                ->Step(g[r].data(), (*updates)[r].data(), tr, absl::Now() + absl::Seconds(20))
                .status();
      });
    }
    for (auto& th : threads) th.join();
    return status;
  };
  const uint64_t fail_at = c.warmup_steps > 0 ? 1 : 4;  // in the warm-up when there is one
  for (uint64_t t = 0; t < 8; ++t) {
    const auto g = MakeGrads(n, d, t, 11);
    std::vector<Vec> ua, ub;
    if (t == fail_at) {
      std::vector<BucketCheckpoint> before;
      for (int r = 0; r < n; ++r) {
        failing[r]->Arm();
        auto saved = a[r]->Save();
        ASSERT_TRUE(saved.ok()) << saved.status();
        before.push_back(*saved);
      }
      const auto status = run(a, true, g, &ua);
      for (int r = 0; r < n; ++r) {
        EXPECT_EQ(status[r].code(), absl::StatusCode::kUnavailable) << "node " << r;
        auto after = a[r]->Save();
        ASSERT_TRUE(after.ok()) << after.status();
        EXPECT_EQ(after->step, before[r].step) << "node " << r;
        EXPECT_EQ(after->controller, before[r].controller) << "node " << r;
        ExpectBitEqual(after->residual, before[r].residual, "residual after a failed step");
        ExpectBitEqual(after->velocity, before[r].velocity, "velocity after a failed step");
      }
    }
    for (const auto& st : run(a, true, g, &ua)) ASSERT_TRUE(st.ok()) << st;
    for (const auto& st : run(b, false, g, &ub)) ASSERT_TRUE(st.ok()) << st;
    for (int r = 0; r < n; ++r) ExpectBitEqual(ua[r], ub[r], "update after the failed step");
  }
}

INSTANTIATE_TEST_SUITE_P(
    Sparsifiers, StepRollback,
    ::testing::Values(Case{SparsifierKind::kMicro, ControllerKind::kHistogram},
                      Case{SparsifierKind::kMicro, ControllerKind::kPaper, 0.9},
                      Case{SparsifierKind::kMicro, ControllerKind::kHistogram, 0.9, 3},
                      Case{SparsifierKind::kMicro, ControllerKind::kHistogram, 0.9, 0, 0, 0.05},
                      Case{SparsifierKind::kMicro, ControllerKind::kHistogram, 0.0, 0, 0, 0, 2},
                      Case{SparsifierKind::kTopK, ControllerKind::kHistogram, 0.5},
                      Case{SparsifierKind::kHard, ControllerKind::kHistogram, 0.9}));

// Memory (W): a sparse bucket keeps one residual and, with momentum
// correction, one velocity (before: two of each, the step writing e + g
// into the idle one), beside room for candidates sized by k (before: by its
// largest partition, d / n).
TEST(StepMemory, ABucketKeepsOneResidualAndOneVelocity) {
  const int n = 4;
  const uint64_t d = 1000000;
  auto ops = kernels::CreateCpuSparseOps();
  for (double momentum : {0.0, 0.9}) {
    SCOPED_TRACE(::testing::Message() << "momentum " << momentum);
    SparsifyOptions o;
    o.density = 0.001;
    o.momentum = momentum;
    auto b = BucketState::Create({"grads.0", d, 3}, {n, 0, n}, o, ops.get());
    ASSERT_TRUE(b.ok()) << b.status();
    const uint64_t state = (momentum > 0 ? 2 : 1) * d * sizeof(float);
    // Twice the hist controller's margin of k = 1000.
    const uint64_t candidates = 8000 * (sizeof(uint32_t) + sizeof(float));
    EXPECT_EQ(BucketState::MemoryBytes(d, n, o), state + candidates);
    EXPECT_LE((*b)->AllocatedBytes(), state + candidates + 1024);
    EXPECT_GE((*b)->AllocatedBytes(), state + candidates);
  }
  // A small bucket keeps a floor of room, at most its partition.
  SparsifyOptions o;
  o.density = 0.001;
  EXPECT_EQ(BucketState::MemoryBytes(100000, n, o), 100000 * 4 + 1024 * 8);
  EXPECT_EQ(BucketState::MemoryBytes(2000, n, o), 2000 * 4 + 500 * 8);
}

// Steps of the defaults keep to that room (the controller's lower bound
// keeps a few k candidates); one that selects more than it holds (here the
// hard sparsifier with a threshold below nearly every sum) grows it and
// gives the same bits as the reference.
TEST(StepMemory, RoomForCandidatesGrowsOnlyWhenAStepSelectsMore) {
  const int n = 4;
  const uint64_t d = 400009;
  for (const Case c : {Case{SparsifierKind::kMicro, ControllerKind::kHistogram},
                       Case{SparsifierKind::kHard, ControllerKind::kHistogram}}) {
    SparsifyOptions o = OptionsOf(c, 0.001);
    if (c.sparsifier == SparsifierKind::kHard) o.hard_threshold = 1e-4;
    SCOPED_TRACE(SparsifierName(c.sparsifier));
    Cluster cluster(n, n, d, o);
    Reference ref(n, n, d, o);
    const uint64_t before = cluster.bucket(0).AllocatedBytes();
    std::vector<Vec> updates;
    std::vector<StepStats> stats;
    uint64_t most = 0;
    for (uint64_t t = 0; t < 6; ++t) {
      const auto g = MakeGrads(n, d, t, 11);
      StepLikeTheReference(cluster, ref, g, updates, stats);
      if (::testing::Test::HasFatalFailure()) return;
      for (int r = 0; r < n; ++r) most = std::max(most, stats[r].local_selected);
    }
    // The step's index and value buffers (O(K), K about k = 400) aside.
    const uint64_t after = cluster.bucket(0).AllocatedBytes();
    if (c.sparsifier == SparsifierKind::kMicro) {
      EXPECT_LE(after, before + 64 * Budget(o.density, d));
    } else {
      ASSERT_GT(most, 3200u);  // more than the room it started with (8 k)
      EXPECT_GE(after, before + most * (sizeof(uint32_t) + sizeof(float)));
    }
  }
}

// Through the warm-up's decay (here from 25 % to 0.1 % over 10 steps) the
// candidates' room and the step's index and value buffers follow k down:
// after it the bucket holds what one that never warmed up holds (before:
// the room of the densest step, a quarter of the bucket, and its indices
// and values, for good). The bits match the reference throughout.
TEST(StepMemory, TheWarmUpsDecayGivesItsRoomBack) {
  const int n = 4;
  const uint64_t d = 400009;
  SparsifyOptions o;
  o.density = 0.001;
  o.warmup_density = 0.25;
  o.warmup_decay_steps = 10;
  Cluster cluster(n, n, d, o);
  Reference ref(n, n, d, o);
  std::vector<Vec> updates;
  std::vector<StepStats> stats;
  uint64_t most = 0;
  for (uint64_t t = 0; t < 16; ++t) {
    const auto g = MakeGrads(n, d, t, 23);
    StepLikeTheReference(cluster, ref, g, updates, stats);
    if (::testing::Test::HasFatalFailure()) return;
    most = std::max(most, cluster.bucket(0).AllocatedBytes());
  }
  SparsifyOptions plain = o;
  plain.warmup_density = 0;
  plain.warmup_decay_steps = 0;
  const uint64_t settled = BucketState::MemoryBytes(d, n, plain);
  EXPECT_GT(most, settled + d);  // the densest steps' room: over 1 B an element
  for (int r = 0; r < n; ++r) {
    EXPECT_LE(cluster.bucket(r).AllocatedBytes(), settled + 64 * 1024) << "node " << r;
  }
}

// The CPU backend, with allocations of more than `limit` bytes refused
// while `refuse` is set (everything else passed through), counting the
// bytes it holds: what the CUDA backend would hold in device memory (the
// bucket allocates only through its SparseOps).
class TightOps final : public kernels::SparseOps {
 public:
  explicit TightOps(uint64_t limit) : ops_(kernels::CreateCpuSparseOps()), limit_(limit) {}
  bool refuse = false;
  uint64_t live = 0, peak = 0;
  kernels::Device device() const override { return ops_->device(); }
  const char* name() const override { return "tight"; }
  void* Allocate(size_t bytes) override {
    void* p = refuse && bytes > limit_ ? nullptr : ops_->Allocate(bytes);
    if (p != nullptr) {
      sizes_[p] = bytes;
      live += bytes;
      peak = std::max(peak, live);
    }
    return p;
  }
  void Free(void* p) override {
    if (auto it = sizes_.find(p); it != sizes_.end()) {
      live -= it->second;
      sizes_.erase(it);
    }
    ops_->Free(p);
  }
  using K = kernels::KernelStatus;
  K CopyToHost(void* d, const void* s, size_t b, void* st) override {
    return ops_->CopyToHost(d, s, b, st);
  }
  K CopyToDevice(void* d, const void* s, size_t b, void* st) override {
    return ops_->CopyToDevice(d, s, b, st);
  }
  K Synchronize(void* st) override { return ops_->Synchronize(st); }
  K SynchronizeFor(void* st, double s) override { return ops_->SynchronizeFor(st, s); }
  K FusedAccumulateSelect(const kernels::FusedSelectArgs& a, void* st) override {
    return ops_->FusedAccumulateSelect(a, st);
  }
  K SelectRange(const float* a, uint64_t b, uint64_t e, float t, uint32_t* i, float* v,
                kernels::StepScalars* s, void* st) override {
    return ops_->SelectRange(a, b, e, t, i, v, s, st);
  }
  K TrimBelow(uint32_t* i, float* v, uint64_t c, float t, kernels::StepScalars* s,
              void* st) override {
    return ops_->TrimBelow(i, v, c, t, s, st);
  }
  K LogHistogram(const float* v, uint64_t c, uint32_t sh, uint32_t f, uint32_t n, int64_t* b,
                 void* st) override {
    return ops_->LogHistogram(v, c, sh, f, n, b, st);
  }
  K Momentum(const float* g, const float* vi, float b, float* vo, uint64_t n, void* st) override {
    return ops_->Momentum(g, vi, b, vo, n, st);
  }
  K SumOfSquares(const float* d, uint64_t n, double* r, void* st) override {
    return ops_->SumOfSquares(d, n, r, st);
  }
  K Gather(const float* a, const uint32_t* i, uint64_t c, float* o, void* st) override {
    return ops_->Gather(a, i, c, o, st);
  }
  K GatherSum(const kernels::FusedSelectArgs& a, const uint32_t* i, uint64_t c, float* o,
              void* st) override {
    return ops_->GatherSum(a, i, c, o, st);
  }
  K ScatterAverage(const float* v, const uint32_t* i, uint64_t c, float d, float* o, uint64_t n,
                   bool z, void* st) override {
    return ops_->ScatterAverage(v, i, c, d, o, n, z, st);
  }
  K ZeroAt(float* a, const uint32_t* i, uint64_t c, void* st) override {
    return ops_->ZeroAt(a, i, c, st);
  }
  K CopyFloats(float* d, const float* s, uint64_t c, void* st) override {
    return ops_->CopyFloats(d, s, c, st);
  }
  K ZeroFloats(float* d, uint64_t c, void* st) override { return ops_->ZeroFloats(d, c, st); }
  K CountOutside(const uint32_t* i, uint64_t c, uint64_t b, uint64_t e, kernels::StepScalars* s,
                 void* st) override {
    return ops_->CountOutside(i, c, b, e, s, st);
  }
  K LocalSum(const float* const* in, int n, uint64_t size, float* o, kernels::StepScalars* s,
             void* st) override {
    return ops_->LocalSum(in, n, size, o, s, st);
  }
  K Divide(float* d, uint64_t n, float v, kernels::StepScalars* s, void* st) override {
    return ops_->Divide(d, n, v, s, st);
  }
  K CountNonFinite(const float* d, uint64_t n, kernels::StepScalars* s, void* st) override {
    return ops_->CountNonFinite(d, n, s, st);
  }
  K TopK(const float* a, uint64_t n, uint64_t k, uint32_t* i, float* v, kernels::StepScalars* s,
         void* st) override {
    return ops_->TopK(a, n, k, i, v, s, st);
  }
  K HalfToFloat(const uint16_t* s, kernels::ElementType t, uint64_t c, float* d,
                void* st) override {
    return ops_->HalfToFloat(s, t, c, d, st);
  }
  K FloatToHalf(const float* s, kernels::ElementType t, uint64_t c, uint16_t* d,
                void* st) override {
    return ops_->FloatToHalf(s, t, c, d, st);
  }
  K GatherRounded(float* a, const uint32_t* i, uint64_t c, kernels::ElementType t, uint16_t* o,
                  void* st) override {
    return ops_->GatherRounded(a, i, c, t, o, st);
  }
  K SortUnique(uint32_t* i, uint64_t c, kernels::StepScalars* s, void* st) override {
    return ops_->SortUnique(i, c, s, st);
  }

 private:
  std::unique_ptr<kernels::SparseOps> ops_;
  const uint64_t limit_;
  std::map<void*, size_t> sizes_;
};

// What a bucket holds through its backend (device memory on the CUDA path)
// is what it reports (AllocatedBytes, microctl buckets) but for the hist
// controller's bins, and at no time does it hold a second bucket-sized
// buffer: beyond the residual (and velocity) the peak is the controller's
// first sample (64 Ki pairs) and the room the first steps grow (momentum
// correction's select up to 36 k on a node): 0.59 and 0.65 B an element
// here. 4 nodes, 0.1 %, the daemon's steps (the first alone, then batched).
TEST(StepMemory, TheBackendHoldsWhatTheBucketReports) {
  const int n = 4;
  const uint64_t d = 1000003;
  struct Config {
    double momentum;
    uint64_t warmup_steps;
  };
  // The last: the defaults' dense warm-up with momentum correction, whose
  // new velocity takes the residual's buffer (before: a second velocity, 4 B
  // an element more for the warm-up's steps).
  for (const Config cfg : {Config{0.0, 0}, Config{0.9, 0}, Config{0.9, 3}}) {
    const double momentum = cfg.momentum;
    SCOPED_TRACE(::testing::Message()
                 << "momentum " << momentum << ", " << cfg.warmup_steps << " dense steps");
    SparsifyOptions o;
    o.density = 0.001;
    o.momentum = momentum;
    o.warmup_steps = cfg.warmup_steps;
    auto group = transport::CreateInprocGroup(n);
    std::vector<std::unique_ptr<TightOps>> ops;
    std::vector<std::unique_ptr<BucketState>> buckets;
    for (int r = 0; r < n; ++r) {
      ops.push_back(std::make_unique<TightOps>(0));
      auto b = BucketState::Create({"grads.0", d, 3}, {n, r, n}, o, ops.back().get());
      ASSERT_TRUE(b.ok()) << b.status();
      buckets.push_back(*std::move(b));
    }
    std::vector<std::vector<Vec>> grads;
    for (uint64_t t = 0; t < 8; ++t) grads.push_back(MakeGrads(n, d, t, 17));
    std::vector<absl::Status> failed(n);
    std::vector<std::thread> threads;
    for (int r = 0; r < n; ++r) {
      threads.emplace_back([&, r] {
        Vec update(d);
        for (uint64_t t = 0; t < grads.size() && failed[r].ok(); ++t) {
          const Vec& g = grads[t][r];
          const absl::Time deadline = absl::Now() + absl::Seconds(60);
          if (!BatchStep::Batchable(*buckets[r])) {  // the controller's first step
            failed[r] = buckets[r]->Step(g.data(), update.data(), *group[r], deadline).status();
            continue;
          }
          BatchStep step(*group[r], deadline);
          failed[r] = step.Add(buckets[r].get(), g.data());
          if (failed[r].ok()) failed[r] = step.Run();
          if (failed[r].ok()) failed[r] = step.Finish(0, update.data()).status();
        }
      });
    }
    for (auto& t : threads) t.join();
    for (int r = 0; r < n; ++r) ASSERT_TRUE(failed[r].ok()) << "node " << r << ": " << failed[r];
    const uint64_t state = (momentum > 0 ? 2 : 1) * d * sizeof(float);
    for (int r = 0; r < n; ++r) {
      SCOPED_TRACE(::testing::Message() << "node " << r);
      const uint64_t reported = buckets[r]->AllocatedBytes();
      EXPECT_GE(ops[r]->live, reported);
      EXPECT_LE(ops[r]->live, reported + 16 * 1024);  // the controller's bins
      EXPECT_LE(ops[r]->peak, state + d * 3 / 4);     // (a partition's room: 2 B an element)
    }
  }
}

// A step whose pass outgrows the candidates' room while memory is short
// fails with the bucket named and changes nothing; once memory is back the
// same step succeeds, with the bits of a bucket that never ran short.
TEST(StepMemory, RoomThatCannotGrowFailsTheStepAndTheNextOneGrowsIt) {
  const uint64_t d = 100003;
  SparsifyOptions o;
  o.sparsifier = SparsifierKind::kHard;
  o.hard_threshold = 1e-4;  // nearly every sum: far more than the 1,024 it starts with
  o.density = 0.001;
  TightOps tight(64 << 10);
  auto plenty = kernels::CreateCpuSparseOps();
  auto group = transport::CreateInprocGroup(1);
  auto short_of = BucketState::Create({"grads.0", d, 3}, {1, 0, 1}, o, &tight);
  auto reference = BucketState::Create({"grads.0", d, 3}, {1, 0, 1}, o, plenty.get());
  ASSERT_TRUE(short_of.ok() && reference.ok());
  const Vec g = MakeGrads(1, d, 0, 5)[0];
  Vec update(d), want(d);
  tight.refuse = true;
  auto failed =
      (*short_of)->Step(g.data(), update.data(), *group[0], absl::Now() + absl::Seconds(30));
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), absl::StatusCode::kResourceExhausted) << failed.status();
  EXPECT_TRUE(absl::StrContains(failed.status().message(), "bucket 'grads.0'")) << failed.status();
  EXPECT_EQ((*short_of)->step(), 0u);
  ExpectBitEqual(Vec((*short_of)->residual(), (*short_of)->residual() + d), Vec(d, 0.0f),
                 "residual after the failed step");
  tight.refuse = false;
  auto ok = (*short_of)->Step(g.data(), update.data(), *group[0], absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(ok.ok()) << ok.status();
  auto straight =
      (*reference)->Step(g.data(), want.data(), *group[0], absl::Now() + absl::Seconds(30));
  ASSERT_TRUE(straight.ok()) << straight.status();
  ExpectBitEqual(update, want, "update");
  ExpectBitEqual(Vec((*short_of)->residual(), (*short_of)->residual() + d),
                 Vec((*reference)->residual(), (*reference)->residual() + d), "residual");
}

// A checkpoint of another bucket shape or configuration is refused, naming
// what differs, and the state is left as it was.
TEST(StepCheckpoint, ACheckpointThatDoesNotFitIsRefused) {
  auto ops = kernels::CreateCpuSparseOps();
  auto make = [&](uint64_t d, SparsifierKind kind, ControllerKind controller, double momentum) {
    SparsifyOptions o;
    o.sparsifier = kind;
    o.controller = controller;
    o.momentum = momentum;
    return std::move(BucketState::Create({"w", d, 1}, {1, 0, 1}, o, ops.get())).value();
  };
  auto paper = make(1000, SparsifierKind::kMicro, ControllerKind::kPaper, 0.0);
  const BucketCheckpoint saved = *paper->Save();
  auto other_size = make(999, SparsifierKind::kMicro, ControllerKind::kPaper, 0.0);
  absl::Status s = other_size->Load(saved);
  EXPECT_TRUE(absl::StrContains(s.message(), "residual has 1000 elements, this bucket keeps 999"))
      << s;
  auto with_momentum = make(1000, SparsifierKind::kMicro, ControllerKind::kPaper, 0.9);
  s = with_momentum->Load(saved);
  EXPECT_TRUE(absl::StrContains(s.message(), "velocity")) << s;
  auto hist = make(1000, SparsifierKind::kMicro, ControllerKind::kHistogram, 0.0);
  s = hist->Load(saved);
  EXPECT_TRUE(absl::StrContains(s.message(), "hist controller state")) << s;
  auto topk = make(1000, SparsifierKind::kTopK, ControllerKind::kHistogram, 0.0);
  s = topk->Load(saved);
  EXPECT_TRUE(absl::StrContains(s.message(), "controller")) << s;
  EXPECT_EQ(topk->step(), 0u);
  BucketCheckpoint bad = saved;
  bad.step = 7;
  bad.controller = std::string(8, '\0');  // tau 0
  s = paper->Load(bad);
  EXPECT_TRUE(absl::StrContains(s.message(), "not positive")) << s;
  EXPECT_EQ(paper->step(), 0u);
}

}  // namespace
}  // namespace microd::sparsify
