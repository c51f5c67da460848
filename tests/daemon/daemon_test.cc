// SPDX-License-Identifier: Apache-2.0
// The daemon as a library: its configuration checked field by field, and two
// nodes started in this process serving training processes through the C
// client, with no flag, environment or subprocess involved.
#include "daemon/daemon.h"

#include <stdlib.h>
#include <unistd.h>

#include <cmath>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"
#include "microd/microd.h"

namespace microd {
namespace {

void ExpectRefused(const DaemonConfig& c, const std::string& flag) {
  const absl::Status s = c.Validate();
  EXPECT_FALSE(s.ok()) << flag;
  EXPECT_TRUE(absl::StartsWith(s.message(), flag)) << s;
  EXPECT_FALSE(Daemon::Create(c).ok()) << flag;
}

TEST(DaemonConfigTest, TheDefaultsAreValid) { EXPECT_TRUE(DaemonConfig().Validate().ok()); }

// --seal=auto seals wherever the control plane has a secret to key the
// data plane from (TLS or a job token), and never the NCCL data plane.
TEST(DaemonConfigTest, SealAutoSealsWithTlsOrAToken) {
  DaemonConfig c;
  EXPECT_FALSE(c.SealsDataPlane());
  c.token = "the job's token";
  EXPECT_TRUE(c.SealsDataPlane());
  c.seal = "off";
  EXPECT_FALSE(c.SealsDataPlane());
  c = {};
  c.tls.ca = "/ca.pem";
  EXPECT_TRUE(c.SealsDataPlane());
  c.transport = "nccl";
  EXPECT_FALSE(c.SealsDataPlane());
  c = {};
  c.seal = "on";
  c.token = "the job's token";
  EXPECT_TRUE(c.SealsDataPlane());
  EXPECT_TRUE(c.Validate().ok()) << c.Validate();
}

TEST(DaemonConfigTest, EachBadSettingIsRefusedNamingItsFlag) {
  DaemonConfig c;
  c.local_size = 0;
  ExpectRefused(c, "--local_size");
  c = {};
  c.transport = "rdma";
  ExpectRefused(c, "--transport");
  c = {};
  c.data_connections = 17;
  ExpectRefused(c, "--data_connections");
  c = {};
  c.gloo_io_nice = 20;
  ExpectRefused(c, "--gloo_io_nice");
  c = {};
  c.seal = "yes";
  ExpectRefused(c, "--seal");
  c = {};
  c.seal = "on";  // nothing to key the data plane from
  ExpectRefused(c, "--seal");
  c = {};
  c.seal_failure = "node";
  ExpectRefused(c, "--seal_failure");
  c = {};
  c.seal_failure = "step";  // not elastic, not sealed
  ExpectRefused(c, "--seal_failure");
  c.nodes = 3;
  c.min_nodes = 2;  // elastic, still not sealed
  ExpectRefused(c, "--seal_failure");
  c.token = "the job's token";
  EXPECT_TRUE(c.Validate().ok()) << c.Validate();
  for (const char* bad : {"round_ms=1", "round_ms=1,mb_per_s=0", "round_ms=1,mb_per_s=x",
                          "round_ms=1,posted_ms=2,mb_per_s=100", "fast"}) {
    c = {};
    c.link_model = bad;
    ExpectRefused(c, "--link_model");
  }
  c = {};
  c.cycle_floats = (uint64_t{1} << 20) + 1;
  ExpectRefused(c, "--cycle_floats");
  c = {};
  c.op_timeout = absl::ZeroDuration();
  ExpectRefused(c, "timeouts");
  c = {};
  c.stall_warning_s = 0;
  ExpectRefused(c, "--stall_warning_s");
  c = {};
  c.timeline_every = 0;
  ExpectRefused(c, "--timeline_steps");
  c = {};
  c.max_processes = 0;
  ExpectRefused(c, "limits");
  c = {};
  c.sparsify.density = 0;
  ExpectRefused(c, "options");
  c = {};
  c.tls.cert = "/nonexistent/cert.pem";
  ExpectRefused(c, "TLS");
}

TEST(DaemonConfigTest, CreateFillsInWhatTheConfigurationLeavesToTheDaemon) {
  DaemonConfig c;
  c.sparsify.density = 0.001;  // below 0.5 %: the remedies apply
  c.sparsify.momentum = 0.9;
  c.token = "secret";
  c.max_state_bytes = 12345;
  auto d = Daemon::Create(c);
  ASSERT_TRUE(d.ok()) << d.status();
  EXPECT_FALSE((*d)->config().node_name.empty());       // the host name
  EXPECT_EQ((*d)->config().state_secret, "secret");     // the token
  EXPECT_EQ((*d)->config().sparsify.warmup_steps, 0u);  // no warm-up by default
  EXPECT_GT((*d)->config().sparsify.min_k, 0u);         // the floor on k
  ASSERT_EQ((*d)->remedies().size(), 2u);               // min_k, momentum
  EXPECT_TRUE(absl::StrContains((*d)->remedies()[1], "momentum correction 0.9"));
  EXPECT_EQ((*d)->node_rank(), -1);  // not started
  // The warm-up when asked for.
  DaemonConfig warm = c;
  warm.remedies = *sparsify::ParseRemedies("warmup,min_k");
  auto w = Daemon::Create(warm);
  ASSERT_TRUE(w.ok()) << w.status();
  EXPECT_GT((*w)->config().sparsify.warmup_steps, 0u);
  ASSERT_EQ((*w)->remedies().size(), 3u);  // warm-up, min_k, momentum
  // --warmup_dense_above marks the decay's dense steps: without a decay it
  // would do nothing, and is refused.
  DaemonConfig above = c;
  above.sparsify.warmup_dense_above = 0.01;
  const auto refused = Daemon::Create(above);
  ASSERT_FALSE(refused.ok());
  EXPECT_TRUE(absl::StartsWith(refused.status().message(), "--warmup_dense_above"))
      << refused.status();
  above.remedies = warm.remedies;
  EXPECT_TRUE(Daemon::Create(above).ok());
  // A dense job has no velocity to correct.
  c.sparsify.sparsifier = sparsify::SparsifierKind::kDense;
  auto dense = Daemon::Create(c);
  ASSERT_TRUE(dense.ok()) << dense.status();
  EXPECT_EQ((*dense)->config().sparsify.momentum, 0.0);
}

class TempDir {
 public:
  TempDir() {
    std::string t = "/tmp/microd-daemon-test.XXXXXX";
    path_ = mkdtemp(t.data());
  }
  ~TempDir() { (void)!system(("rm -rf '" + path_ + "'").c_str()); }
  std::string operator/(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// The port in `file` once it is written, or 0 after `deadline`.
int WaitForPort(const std::string& file, absl::Time deadline) {
  while (absl::Now() < deadline) {
    int port = 0;
    std::ifstream in(file);
    if (in >> port && port > 0) return port;
    absl::SleepFor(absl::Milliseconds(20));
  }
  return 0;
}

// One training process: registers `name` with `count` floats, submits
// `grad`, returns the update.
std::vector<float> Train(const std::string& socket, const std::string& name,
                         const std::vector<float>& grad, std::string* error) {
  microd_options o;
  microd_options_init(&o);
  o.socket_path = socket.c_str();
  o.timeout_ms = 30000;
  microd_client* c = nullptr;
  if (microd_connect(&o, &c) != MICROD_OK) {
    *error = microd_last_error(nullptr);
    return {};
  }
  float* data = nullptr;
  int32_t id = -1;
  std::vector<float> out;
  if (microd_register_host_buffer(c, name.c_str(), grad.size(), &data, &id) != MICROD_OK ||
      (std::copy(grad.begin(), grad.end(), data), microd_allreduce(c, id, 30000)) != MICROD_OK) {
    *error = microd_last_error(c);
  } else {
    out.assign(data, data + grad.size());
  }
  microd_close(c);
  return out;
}

TEST(DaemonTest, TwoNodesInOneProcessAverageTheirProcessesGradients) {
  TempDir dir;
  DaemonConfig c[2];
  for (int r = 0; r < 2; ++r) {
    c[r].job_id = "in-process";
    c[r].node_name = absl::StrCat("node", r);
    c[r].node_rank = r;
    c[r].nodes = 2;
    c[r].socket = dir / absl::StrCat("microd", r, ".sock");
    c[r].admin = "unix:" + (dir / absl::StrCat("admin", r, ".sock"));
    c[r].sparsify.density = 0.01;
    c[r].join_timeout = absl::Seconds(60);
  }
  c[0].coordinator_listen = "127.0.0.1:0";
  c[0].coordinator_port_file = dir / "coordinator.port";
  std::unique_ptr<Daemon> d[2];
  for (int r = 0; r < 2; ++r) {
    auto created = Daemon::Create(c[r]);
    ASSERT_TRUE(created.ok()) << created.status();
    d[r] = *std::move(created);
  }
  absl::Status started[2];
  std::thread node0([&] { started[0] = d[0]->Start(); });
  const int port = WaitForPort(c[0].coordinator_port_file, absl::Now() + absl::Seconds(30));
  ASSERT_GT(port, 0) << "node 0 did not write its coordinator port";
  // Node 1 dials it: its own configuration, made before node 0's port was known.
  auto node1_config = c[1];
  node1_config.coordinator = absl::StrCat("127.0.0.1:", port);
  auto created = Daemon::Create(node1_config);
  ASSERT_TRUE(created.ok()) << created.status();
  d[1] = *std::move(created);
  std::thread node1([&] { started[1] = d[1]->Start(); });
  node0.join();
  node1.join();
  ASSERT_TRUE(started[0].ok()) << started[0];
  ASSERT_TRUE(started[1].ok()) << started[1];
  EXPECT_EQ(d[0]->node_rank(), 0);
  EXPECT_EQ(d[1]->node_rank(), 1);
  EXPECT_GT(d[0]->coordinator_port(), 0);
  EXPECT_EQ(d[1]->coordinator_port(), 0);

  // A dense bucket (below --dense_floor) and a sparse one.
  for (const uint64_t d_size : {uint64_t{1000}, uint64_t{200000}}) {
    SCOPED_TRACE(testing::Message() << "d=" << d_size);
    std::vector<float> g[2];
    for (int r = 0; r < 2; ++r) {
      g[r].resize(d_size);
      for (uint64_t i = 0; i < d_size; ++i) {
        g[r][i] = std::sin(0.37f * float(i) + float(r)) * (i % 97 == 0 ? 10.0f : 0.01f);
      }
    }
    std::vector<float> u[2];
    std::string error[2];
    const std::string name = absl::StrCat("bucket", d_size);
    std::thread p1([&] { u[1] = Train(c[1].socket, name, g[1], &error[1]); });
    u[0] = Train(c[0].socket, name, g[0], &error[0]);
    p1.join();
    ASSERT_TRUE(error[0].empty()) << error[0];
    ASSERT_TRUE(error[1].empty()) << error[1];
    ASSERT_EQ(u[0], u[1]) << "the nodes' updates differ";
    uint64_t selected = 0;
    for (uint64_t i = 0; i < d_size; ++i) {
      if (u[0][i] == 0.0f) continue;
      ++selected;
      // Each value sent is the average of the two gradients (no residual yet).
      ASSERT_EQ(u[0][i], (g[0][i] + g[1][i]) / 2.0f) << "element " << i;
    }
    if (d_size < c[0].dense_floor) {
      EXPECT_EQ(selected, d_size);
    } else {
      // About 1 % (the large elements, every 97th, are 1 %), far from all.
      EXPECT_GT(selected, d_size / 200);
      EXPECT_LT(selected, d_size / 20);
    }
  }
  d[1]->Stop("test over");
  d[0]->Stop("test over");
  d[0]->Stop("again");  // idempotent
  EXPECT_NE(access(c[0].socket.c_str(), F_OK), 0) << "the socket is removed at Stop";
}

// A daemon that cannot join (no coordinator answers) fails Start with the
// reason, and is destroyed cleanly without Stop.
TEST(DaemonTest, AStartThatCannotJoinFailsAndCleansUp) {
  TempDir dir;
  DaemonConfig c;
  c.nodes = 2;
  c.coordinator = "127.0.0.1:1";  // nothing listens there
  c.socket = dir / "microd.sock";
  c.admin = "unix:" + (dir / "admin.sock");
  c.join_timeout = absl::Seconds(2);
  auto d = Daemon::Create(c);
  ASSERT_TRUE(d.ok()) << d.status();
  const absl::Status s = (*d)->Start();
  EXPECT_FALSE(s.ok());
  EXPECT_TRUE(absl::StartsWith(s.message(), "join")) << s;
  EXPECT_EQ((*d)->node_rank(), -1);
}

}  // namespace
}  // namespace microd
