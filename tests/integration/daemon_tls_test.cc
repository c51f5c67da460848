// SPDX-License-Identifier: Apache-2.0
// The control plane's security: TLS and mutual TLS between the daemons
// (certificates made here with openssl), what is refused (a certificate of
// another CA, plaintext against TLS, a coordinator or Admin port other hosts
// reach without TLS or a token), certificate rotation during a job, and
// gRPC reflection off on the coordinator's port.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/stat.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "gtest/gtest.h"
#include "tests/helper_path.h"
#include "tests/integration/certs.h"
#include "tests/integration/daemon_cluster.h"
#include "tests/integration/netlab.h"
#include "tests/integration/process_util.h"

namespace microd::testing {
namespace {

using std::chrono::seconds;

const std::vector<BucketSpec> kBuckets = {{"small", 1000}, {"big", 100003}};

// One daemon started by hand in `dir` (node `rank` of 2 on loopback); its log
// is dir/node<rank>.log.
pid_t StartNode(const std::string& dir, int rank, int coordinator_port,
                const std::vector<std::string>& extra) {
  std::vector<std::string> args = {HelperPath(MICROD_DAEMON),
                                   absl::StrCat("--socket=", dir, "/s", rank, "/microd.sock"),
                                   "--nodes=2",
                                   absl::StrCat("--node_rank=", rank),
                                   absl::StrCat("--node_name=node", rank),
                                   "--admin=127.0.0.1:0",
                                   "--join_timeout_ms=2000"};  // every use expects a refusal
  if (rank == 0) {
    args.push_back("--coordinator_listen=127.0.0.1:0");
    args.push_back("--coordinator_port_file=" + dir + "/coordinator");
  } else {
    args.push_back(absl::StrCat("--coordinator=127.0.0.1:", coordinator_port));
  }
  args.insert(args.end(), extra.begin(), extra.end());
  return Spawn(args, absl::StrCat(dir, "/node", rank, ".log"));
}

class TlsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    certs_.Ca("ca");
    certs_.Ca("other-ca");
    for (const char* n : {"node0", "node1"}) certs_.Cert(n, "ca", {"127.0.0.1"});
    certs_.Cert("stranger", "other-ca", {"127.0.0.1"});
  }
  void TearDown() override {
    std::error_code ignored;
    if (!HasFailure()) std::filesystem::remove_all(dir_, ignored);
  }
  // Node 0 with mutual TLS (CA "ca"); its coordinator port.
  int StartTlsNode0() {
    node0_ = StartNode(dir_, 0, 0, certs_.Flags("node0", "ca"));
    return ReadPortFile(dir_ + "/coordinator", seconds(20));
  }
  // Node 1 with `extra` fails to join node 0 within its join timeout; its log.
  std::string ExpectNode1Refused(int port, const std::vector<std::string>& extra) {
    const pid_t node1 = StartNode(dir_, 1, port, extra);
    EXPECT_EQ(WaitAll({node1}, seconds(30))[0], 1);
    kill(node0_, SIGTERM);
    WaitAll({node0_}, seconds(20));
    return ReadFile(dir_ + "/node1.log");
  }

  const std::string dir_ = MakeTempDir("tls");
  TestCerts certs_{dir_};
  pid_t node0_ = -1;
};

// With mutual TLS on both nodes the job forms and every step equals the
// reference (loopback; the emulated cluster below does the same across hosts).
TEST_F(TlsTest, MutualTlsJobMatchesTheReference) {
  const int n = 2, L = 2;
  const long steps = 6;
  ClusterOptions o;
  o.env = [&](int r) { return certs_.Env(absl::StrCat("node", r), "ca"); };
  DaemonCluster cluster(n, L, o);
  cluster.StartClients(kBuckets, steps);
  const auto codes = cluster.WaitClients(seconds(120));
  ExpectMatchesReference(cluster, codes, Reference(n, L, kBuckets, steps), n, L, kBuckets, steps);
}

TEST_F(TlsTest, ACertificateOfAnotherCaIsRefusedAtTheHandshake) {
  const int port = StartTlsNode0();
  const std::string log1 = ExpectNode1Refused(port, certs_.Flags("stranger", "ca"));
  EXPECT_TRUE(absl::StrContains(log1, "TLS handshake failed")) << log1;
  const std::string log0 = ReadFile(dir_ + "/node0.log");
  EXPECT_TRUE(absl::StrContains(log0, "Handshake failed")) << log0;
  EXPECT_TRUE(absl::StrContains(log0, "certificate verify failed")) << log0;
}

// Issue X, finding 8: with mutual TLS and no job token, any certificate of
// the CA joined any job (the job id is the client's word). A certificate
// names its job now: one for another job is refused by the coordinator,
// naming both (node 1 holds a token, which this job does not check, so
// that it starts).
TEST_F(TlsTest, ACertificateOfTheCaForAnotherJobIsRefused) {
  certs_.Cert("other-job", "ca", {"127.0.0.1"}, {"other"});
  const int port = StartTlsNode0();
  std::ofstream(dir_ + "/token") << "a token of its own\n";
  std::vector<std::string> flags = certs_.Flags("other-job", "ca");
  flags.push_back("--token_file=" + dir_ + "/token");
  const std::string log1 = ExpectNode1Refused(port, flags);
  EXPECT_TRUE(absl::StrContains(log1, "its certificate is for job(s) 'other', not job 'microd'"))
      << log1;
}

// Without a token, a node whose certificate names no job (or another) does
// not start: the flag and the remedy named.
TEST_F(TlsTest, MutualTlsWithoutATokenNeedsACertificateThatNamesTheJob) {
  certs_.Cert("no-job", "ca", {"127.0.0.1"}, {});
  const pid_t node = StartNode(dir_, 1, 1, certs_.Flags("no-job", "ca"));
  EXPECT_EQ(WaitAll({node}, seconds(30))[0], 1);
  const std::string log = ReadFile(dir_ + "/node1.log");
  EXPECT_TRUE(absl::StrContains(log, "does not name job 'microd'")) << log;
  EXPECT_TRUE(absl::StrContains(log, "URI subjectAltName microd://job/microd")) << log;
}

TEST_F(TlsTest, PlaintextAgainstATlsCoordinatorIsRefused) {
  const int port = StartTlsNode0();
  const std::string log1 = ExpectNode1Refused(port, {});
  EXPECT_TRUE(absl::StrContains(log1, "it uses TLS and this node does not")) << log1;
  EXPECT_TRUE(absl::StrContains(ReadFile(dir_ + "/node0.log"), "Handshake failed"));
}

TEST_F(TlsTest, ANodeThatDoesNotTrustTheCoordinatorsCaIsRefused) {
  const int port = StartTlsNode0();
  std::vector<std::string> flags = certs_.Flags("node1", "other-ca");
  const std::string log1 = ExpectNode1Refused(port, flags);
  EXPECT_TRUE(absl::StrContains(log1, "TLS handshake failed")) << log1;
}

// The certificate files change during a job: new connections get the new
// certificate (read again within seconds) and the job goes on.
TEST_F(TlsTest, CertificateRotationDuringAJobKeepsItRunning) {
  const int n = 2, L = 1;
  ClusterOptions o;
  o.env = [&](int r) { return certs_.Env(absl::StrCat("node", r), "ca"); };
  DaemonCluster cluster(n, L, o);
  const int port = cluster.coordinator_port();
  const std::string before = certs_.ServedSerial(port, "node1", "ca");
  ASSERT_FALSE(before.empty());
  cluster.StartClients(kBuckets, 3);
  ASSERT_EQ(cluster.WaitClients(seconds(60)), std::vector<int>(n * L, 0));
  // A new certificate for node 0, written over the old files.
  certs_.Cert("node0-new", "ca", {"127.0.0.1"});
  std::filesystem::copy_file(certs_.key("node0-new"), certs_.key("node0"),
                             std::filesystem::copy_options::overwrite_existing);
  std::filesystem::copy_file(certs_.pem("node0-new"), certs_.pem("node0"),
                             std::filesystem::copy_options::overwrite_existing);
  std::string after = before;
  for (int i = 0; i < 40 && after == before; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
    after = certs_.ServedSerial(port, "node1", "ca");
  }
  EXPECT_NE(after, before) << "the coordinator still serves the old certificate";
  EXPECT_FALSE(after.empty());
  auto status = cluster.Status(1);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->job_state(), microd::v1::JOB_STATE_RUNNING) << status->failure();
}

// microd started as a new user would on a cluster: the coordinator on every
// interface, no TLS, no token. It used to start and accept anyone.
TEST(Exposure, ANetworkListenWithoutTlsOrATokenIsRefusedAtStart) {
  const std::string dir = MakeTempDir("exposure");
  struct Case {
    std::vector<std::string> flags;
    std::string names;
  };
  std::vector<Case> cases = {
      {{"--coordinator_listen=0.0.0.0:0", "--admin=127.0.0.1:0"}, "--coordinator_listen"},
      {{"--coordinator_listen=127.0.0.1:0", "--admin=0.0.0.0:0"}, "--admin"},
      // A token protects the coordinator, not the Admin service.
      {{"--coordinator_listen=127.0.0.1:0", "--admin=0.0.0.0:0", "--token_file=" + dir + "/t"},
       "--admin"},
  };
  std::ofstream(dir + "/t") << "a token\n";
  // A server certificate alone encrypts but authenticates nobody who
  // connects (before: it counted as protection, the coordinator started
  // on 0.0.0.0 and node 0 then failed its own handshake for want of a CA).
  TestCerts certs(dir);
  certs.Ca("ca");
  certs.Cert("server", "ca", {"127.0.0.1"});
  const std::vector<std::string> server_only = {"--tls_cert=" + certs.pem("server"),
                                                "--tls_key=" + certs.key("server")};
  cases.push_back(
      {{"--coordinator_listen=0.0.0.0:0", "--admin=127.0.0.1:0", server_only[0], server_only[1]},
       "--coordinator_listen"});
  cases.push_back(
      {{"--coordinator_listen=127.0.0.1:0", "--admin=0.0.0.0:0", server_only[0], server_only[1]},
       "--admin"});
  for (size_t i = 0; i < cases.size(); ++i) {
    std::vector<std::string> args = {HelperPath(MICROD_DAEMON),
                                     absl::StrCat("--socket=", dir, "/s", i, "/microd.sock"),
                                     "--nodes=1"};
    args.insert(args.end(), cases[i].flags.begin(), cases[i].flags.end());
    const std::string log = absl::StrCat(dir, "/case", i, ".log");
    EXPECT_EQ(WaitAll({Spawn(args, log)}, seconds(20))[0], 1) << "case " << i;
    const std::string text = ReadFile(log);
    EXPECT_TRUE(absl::StrContains(text, cases[i].names + ": ")) << text;
    EXPECT_TRUE(absl::StrContains(text, "refusing to serve on 0.0.0.0:0")) << text;
    EXPECT_TRUE(absl::StrContains(text, "--insecure")) << text;
    EXPECT_TRUE(absl::StrContains(text, "--tls_ca")) << text;
    if (i >= 3) {
      EXPECT_TRUE(absl::StrContains(text, "authenticates nobody")) << text;
    }
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

// --insecure lets it start, and says so. Run in a network namespace of its
// own (root), so that nothing listens on this machine's interfaces.
TEST(Exposure, InsecureStartsAndWarns) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root for a network namespace of its own";
  const std::string dir = MakeTempDir("insecure");
  const std::string sock = dir + "/s/microd.sock";
  const std::string script =
      absl::StrCat("ip link set lo up && exec ", HelperPath(MICROD_DAEMON), " --socket=", sock,
                   " --nodes=1 --coordinator_listen=0.0.0.0:0 --admin=127.0.0.1:0 --insecure");
  const pid_t pid =
      Spawn({"/usr/bin/unshare", "--net", "--", "/bin/sh", "-c", script}, dir + "/log");
  struct stat st;
  for (int i = 0; i < 200 && stat(sock.c_str(), &st) != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_EQ(stat(sock.c_str(), &st), 0) << ReadFile(dir + "/log");
  kill(pid, SIGTERM);
  EXPECT_EQ(WaitAll({pid}, seconds(20))[0], 0);
  const std::string text = ReadFile(dir + "/log");
  // Logged as a warning (the level on its line), with the address.
  EXPECT_TRUE(absl::StrContains(text, " WARNING ")) << text;
  EXPECT_TRUE(absl::StrContains(text, "] --coordinator_listen 0.0.0.0:0 is reachable")) << text;
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

// An Admin port on an address other hosts reach is served over TLS:
// microctl and microd-health with the TLS flags get the status, without
// them nothing. In a network namespace of its own (root), with an address
// of its own.
TEST_F(TlsTest, AdminOnTheNetworkNeedsTlsAndMicrodCtlSpeaksIt) {
  if (geteuid() != 0) GTEST_SKIP() << "needs root for a network namespace of its own";
  certs_.Cert("admin", "ca", {"127.0.0.1", "10.99.0.1"});
  const std::string daemon_dir =
      HelperPath(MICROD_DAEMON).substr(0, HelperPath(MICROD_DAEMON).rfind('/'));
  const std::string tls =
      absl::StrCat(" --tls_ca=", certs_.pem("ca"), " --tls_cert=", certs_.pem("admin"),
                   " --tls_key=", certs_.key("admin"));
  const std::string script = absl::StrCat(
      "set -e; ip link set lo up; ip addr add 10.99.0.1/32 dev lo; ", HelperPath(MICROD_DAEMON),
      " --socket=", dir_, "/s/microd.sock --nodes=1",
      " --coordinator_listen=127.0.0.1:0 --admin=10.99.0.1:0 --admin_port_file=", dir_, "/admin",
      tls, " > ", dir_, "/daemon.log 2>&1 & d=$!; ", "for i in $(seq 100); do [ -s ", dir_,
      "/admin ] && [ -S ", dir_, "/s/microd.sock ] && break; sleep 0.1; done; a=10.99.0.1:$(cat ",
      dir_, "/admin); ", daemon_dir, "/microctl --admin=$a", tls, " status > ", dir_,
      "/with-tls 2>&1 || echo rc=$? >> ", dir_, "/with-tls; ", daemon_dir,
      "/microctl --admin=$a --timeout_ms=2000 status > ", dir_, "/without 2>&1 || echo rc=$? >> ",
      dir_, "/without; MICROD_TLS_CA=", certs_.pem("ca"), " MICROD_TLS_CERT=", certs_.pem("admin"),
      " MICROD_TLS_KEY=", certs_.key("admin"), " ", daemon_dir,
      "/microd-health --admin=$a --service=microd > ", dir_, "/health 2>&1 || echo rc=$? >> ", dir_,
      "/health; kill $d; wait $d");
  const pid_t pid =
      Spawn({"/usr/bin/unshare", "--net", "--", "/bin/sh", "-c", script}, dir_ + "/script.log");
  EXPECT_EQ(WaitAll({pid}, seconds(60))[0], 0)
      << ReadFile(dir_ + "/script.log") << ReadFile(dir_ + "/daemon.log");
  const std::string with_tls = ReadFile(dir_ + "/with-tls");
  EXPECT_TRUE(absl::StrContains(with_tls, "running")) << with_tls;
  EXPECT_FALSE(absl::StrContains(with_tls, "rc=")) << with_tls;
  const std::string without = ReadFile(dir_ + "/without");
  EXPECT_TRUE(absl::StrContains(without, "rc=1")) << without;
  const std::string health = ReadFile(dir_ + "/health");
  EXPECT_TRUE(absl::StrContains(health, "SERVING")) << health;
  EXPECT_FALSE(absl::StrContains(health, "rc=")) << health;
}

// A reflection request (list the services) as one message on a stream.
grpc::Status ListServices(const std::string& target) {
  grpc::GenericStub stub(grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + seconds(5));
  const std::string list_services("\x3a\x00", 2);  // field 7 (list_services): ""
  grpc::Slice slice(list_services);
  grpc::ByteBuffer request(&slice, 1), response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(&ctx, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
                 grpc::StubOptions(), &request, &response, [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   status = std::move(s);
                   done = true;
                   cv.notify_all();
                 });
  std::unique_lock<std::mutex> lock(mu);
  cv.wait(lock, [&] { return done; });
  return status;
}

TEST(Reflection, OffOnTheCoordinatorPortOnOnAdmin) {
  DaemonCluster cluster(1, 1);
  const grpc::Status coordinator =
      ListServices(absl::StrCat("127.0.0.1:", cluster.coordinator_port()));
  EXPECT_EQ(coordinator.error_code(), grpc::StatusCode::UNIMPLEMENTED)
      << coordinator.error_message();
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  const grpc::Status admin = ListServices(cluster.admin_target(0));
  EXPECT_TRUE(admin.ok()) << admin.error_message();
}

class TlsNetLabTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (const std::string why = NetLab::SkipReason(); !why.empty()) GTEST_SKIP() << why;
  }
};

// 3 nodes on the emulated network, each with its own certificate for its
// own address, no job token: the job forms over mutual TLS and every step
// equals the reference.
TEST_F(TlsNetLabTest, MutualTlsAcrossHostsMatchesTheReference) {
  const int n = 3, L = 1;
  const long steps = 6;
  auto lab = NetLab::Create(n, {"--rate=1gbit"});
  ASSERT_TRUE(lab.ok()) << lab.status();
  const std::string dir = MakeTempDir("tls-lab");
  TestCerts certs(dir);
  certs.Ca("ca");
  for (int r = 0; r < n; ++r) certs.Cert(absl::StrCat("node", r), "ca", {(*lab)->addr(r)});
  ClusterOptions o;
  o.lab = lab->get();
  o.token = false;
  o.env = [&](int r) { return certs.Env(absl::StrCat("node", r), "ca"); };
  DaemonCluster cluster(n, L, o);
  cluster.StartClients(kBuckets, steps);
  const auto codes = cluster.WaitClients(seconds(120));
  ExpectMatchesReference(cluster, codes, Reference(n, L, kBuckets, steps), n, L, kBuckets, steps);
  // Every TCP port microd still listens on once the mesh is up (node 0's
  // coordinator; Gloo's pairs listen only while they connect) is on the
  // node's own address, none on every interface.
  for (int r = 0; r < n; ++r) {
    const std::string out = absl::StrCat(dir, "/listening", r);
    ASSERT_EQ(WaitAll({Spawn((*lab)->InNode(r, {"/usr/bin/ss", "-ltnH"}), out)}, seconds(20))[0],
              0);
    const auto lines = ReadLines(out);
    if (r == 0) {
      EXPECT_FALSE(lines.empty()) << "node 0: its coordinator is not listening";
    }
    for (const std::string& line : lines) {
      EXPECT_TRUE(absl::StrContains(line, " " + (*lab)->addr(r) + ":"))
          << "node " << r << " listens beyond its address: " << line;
    }
  }
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

}  // namespace
}  // namespace microd::testing
