// microd: the per-node sidecar. Joins the job through the coordinator (and
// serves it on node 0), connects the data plane, serves the training
// processes of this node on a Unix socket and the Admin service over gRPC.
// Every flag can also come from MICROD_<FLAG> in the environment (the
// command line wins).
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cctype>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/reflection.h"
#include "absl/flags/usage.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/clock.h"
#include "daemon/common/command_line.h"
#include "daemon/common/log.h"
#include "daemon/common/memory_limit.h"
#include "daemon/common/status_macros.h"
#include "daemon/common/unix_socket.h"
#include "daemon/control/address.h"
#include "daemon/control/coordinator.h"
#include "daemon/control/coordinator_client.h"
#include "daemon/control/services.h"
#include "daemon/control/tls.h"
#include "daemon/engine/checkpoint.h"
#include "daemon/engine/engine.h"
#include "daemon/engine/engine_status.h"
#include "daemon/engine/metrics.h"
#include "daemon/engine/timeline.h"
#include "daemon/local/local_server.h"
#include "daemon/transport/gloo/gloo_transport.h"
#include "microd/config.h"
#if MICROD_HAVE_NCCL
#include "daemon/transport/nccl/nccl_transport.h"
#include "kernels/cuda/cuda_ops.h"
#endif

ABSL_FLAG(std::string, socket, "/run/microd/microd.sock", "Unix socket for the training processes");
ABSL_FLAG(int, local_size, 1, "training processes on this node");
ABSL_FLAG(std::string, node_name, "", "this node's name (default: the host name)");
ABSL_FLAG(int, node_rank, -1, "node rank to take (-1: any free one)");
ABSL_FLAG(int, nodes, 1, "nodes in the job (used by the coordinator)");
ABSL_FLAG(std::string, coordinator, "", "address of the coordinator (host:port)");
ABSL_FLAG(std::string, coordinator_listen, "",
          "serve the coordinator on this address (node 0 only)");
ABSL_FLAG(std::string, coordinator_port_file, "",
          "write the coordinator's port to this file once listening");
ABSL_FLAG(std::string, admin, "unix:/run/microd/admin.sock",
          "Admin service address (microctl, health checks): unix:PATH (only this daemon's uid, "
          "and --allow_gid's group, may connect), or host:port (port 0: any; loopback is open "
          "to every local user; another address needs --tls_ca)");
ABSL_FLAG(std::string, admin_port_file, "", "write the Admin port to this file once listening");
ABSL_FLAG(std::string, metrics, "",
          "serve Prometheus metrics at http://HOST:PORT/metrics (empty: off; port 0: any); "
          "plaintext and read-only");
ABSL_FLAG(std::string, metrics_port_file, "", "write the metrics port to this file once listening");
ABSL_FLAG(std::string, timeline, "",
          "keep a timeline of the steps and write it to this file (Chrome trace-event JSON, "
          "for Perfetto or chrome://tracing), rewritten every --timeline_flush_s and at exit "
          "(empty: off; `microctl timeline` captures one from a running daemon either way)");
ABSL_FLAG(uint64_t, timeline_steps, 10000,
          "the timeline keeps the last N bucket steps (about 230 bytes each)");
ABSL_FLAG(uint64_t, timeline_every, 1, "the timeline keeps every Nth step of each bucket");
ABSL_FLAG(double, timeline_flush_s, 5, "how often --timeline's file is rewritten, in seconds");
ABSL_FLAG(std::string, transport, "gloo",
          "data plane: gloo (CPU, TCP; any buffers) or nccl (CUDA builds: the step runs on "
          "--cuda_device and takes only CUDA buffers on it)");
ABSL_FLAG(int, cuda_device, 0, "with --transport=nccl: the CUDA device (ordinal) to reduce on");
ABSL_FLAG(std::string, hostname, "",
          "address peers reach this node's data plane on (default: the address the coordinator "
          "saw this node's join come from, when it is one of this host's, else the local address "
          "of the route to the coordinator; on node 0 with a wildcard --coordinator_listen, this "
          "host's address). Give it when the coordinator is on this host but "
          "other hosts must reach this node (several daemons per host)");
ABSL_FLAG(int, gloo_io_nice, 0,
          "lower the priority of Gloo's network thread by this much (0-19); for several daemons "
          "sharing a few cores (tests, one-machine runs), where that thread's busy-waiting "
          "otherwise costs a scheduler time slice per small collective; leave 0 where training "
          "keeps every core busy");
ABSL_FLAG(int, data_connections, 0,
          "Gloo connections per pair of nodes; large allreduces go in parts over all of them "
          "(0: 4 where a round on the data plane takes 2 ms or more, measured at start, else 1)");
ABSL_FLAG(std::string, sparsifier, "micro", "micro, topk, hard or dense");
ABSL_FLAG(std::string, controller, "hist", "micro threshold controller: hist or paper");
ABSL_FLAG(double, density, 0.01, "target density in (0, 1]");
ABSL_FLAG(double, hard_threshold, 0.0, "hard sparsifier threshold (0: 1/(2 sqrt(k)))");
ABSL_FLAG(double, momentum_correction, 0.0,
          "momentum correction factor (DGC) in [0, 1); 0: off. With it on, the training side "
          "must not apply momentum (microd.torch.DistributedOptimizer switches SGD's off)");
ABSL_FLAG(double, clip_norm, 0.0,
          "local gradient clipping per bucket: scale a node's gradient down to "
          "clip_norm / sqrt(nodes) (0: off)");
ABSL_FLAG(uint64_t, warmup_steps, 0, "the first N steps of every bucket are dense");
ABSL_FLAG(double, warmup_density, 0.0,
          "then decay the density exponentially from this to --density (0: no decay)");
ABSL_FLAG(uint64_t, warmup_decay_steps, 0, "length of the density decay, in steps");
ABSL_FLAG(uint64_t, min_k, 0,
          "a bucket whose budget at --density is below this many values per step is "
          "sparsified at the density that gives it this many (0: off, unless --remedies "
          "sets it)");
ABSL_FLAG(std::string, remedies, "auto",
          "below a density of 0.5 %, the remedies the daemon fills in where their own flags are "
          "unset: auto (warmup and min_k), off, or a comma-separated list of warmup, min_k");
ABSL_FLAG(std::string, nonfinite, "fail",
          "a NaN/Inf in a gradient: fail that step on every node, or skip it (zero update)");
ABSL_FLAG(std::string, wire_dtype, "fp32",
          "the selected values of bf16/fp16 sparse buckets travel as fp32, or as the bucket's "
          "own type (bucket: half the value bytes; what rounding drops stays in the residual; "
          "Gloo transport only)");
ABSL_FLAG(uint64_t, stats_history, 1024,
          "sparse steps kept per bucket for `microctl --history buckets` (0: none)");
ABSL_FLAG(bool, response_cache, true,
          "buckets scheduled once by the coordinator are then agreed between the daemons over "
          "the data plane, without the coordinator (lower latency per step); false: every step "
          "through the coordinator");
ABSL_FLAG(uint64_t, cycle_floats, 4096,
          "with the response cache: small dense buckets (up to this many floats in all) are "
          "reduced by the cycle that agrees on them, one round instead of two (0: off)");
ABSL_FLAG(uint64_t, dense_floor, 65536, "buckets with fewer elements are reduced dense, fused");
ABSL_FLAG(int, timeout_ms, 60000, "deadline of one operation (a step, a report)");
ABSL_FLAG(int, peer_timeout_ms, 10000, "a node silent this long fails the job");
ABSL_FLAG(int, join_timeout_ms, 300000, "how long to wait for all nodes to join");
ABSL_FLAG(std::string, job_id, "microd", "job identifier (all nodes must agree)");
ABSL_FLAG(std::string, token_file, "", "file holding the job token (all nodes must agree)");
ABSL_FLAG(std::string, state_key_file, "",
          "file holding the secret that authenticates saved state (microd_state_save): a state "
          "file made with another secret, or altered, is refused at load (default: the job "
          "token; with neither, state files are checksummed, not authenticated)");
ABSL_FLAG(std::string, tls_cert, "",
          "this node's certificate (PEM): the coordinator's and a non-loopback Admin's TLS "
          "identity on node 0, the client certificate for mutual TLS elsewhere");
ABSL_FLAG(std::string, tls_key, "", "the private key (PEM) of --tls_cert");
ABSL_FLAG(std::string, tls_ca, "",
          "CA bundle (PEM): verifies the coordinator's certificate; on node 0, every node must "
          "present a certificate it signed (mutual TLS)");
ABSL_FLAG(std::string, tls_server_name, "",
          "the name the coordinator's certificate carries, when not the host dialed");
ABSL_FLAG(bool, insecure, false,
          "allow serving the coordinator (or Admin) on an address other hosts reach without "
          "TLS and, for the coordinator, without a job token: trusted networks only");
ABSL_FLAG(int, allow_gid, -1, "also accept training processes of this group id");
ABSL_FLAG(int, max_processes, 256, "training processes connected at once, at most");
ABSL_FLAG(int, max_buffers_per_process, 4096, "buffers one training process may register");
ABSL_FLAG(uint64_t, max_bytes_per_process, 0,
          "bytes of buffers (4 per element: the mapping or the daemon's fp32 copy) one training "
          "process may register (0: the daemon's memory budget, see --max_state_bytes)");
ABSL_FLAG(uint64_t, max_state_bytes, 0,
          "the most this node's bucket state (residuals, velocities, candidates, the local "
          "sum) may take in the daemon's memory; a buffer whose bucket would take it past is "
          "refused at registration, with the numbers (0: 80% of the memory limit of the "
          "daemon's cgroup, or of the machine's memory; no limit with --transport=nccl, whose "
          "state is on the GPU)");
ABSL_FLAG(int, stall_warning_s, 60,
          "a bucket some process submitted and another node or process has not, for this long, "
          "is reported (log, microctl stalls), naming who it waits for");
ABSL_FLAG(int, stall_abort_s, 0, "a stall this long fails the job with that report (0: never)");
ABSL_FLAG(int, hello_timeout_ms, 10000,
          "a connection that says no hello this long after connecting is closed");
ABSL_FLAG(std::string, log_level, "info",
          "messages at this level and above are logged: debug, info, warning or error");
ABSL_FLAG(std::string, log_format, "text",
          "text (a timestamp, the level, node/rank and the source on every line) or json "
          "(one object per line, for log collectors)");

namespace {

// The grpc.health.v1 service name that is SERVING once the node joined the
// job and serves its socket (deploy/README.md, the Kubernetes probes).
constexpr char kHealthService[] = "microd";

// Environment fallbacks: MICROD_<FLAG NAME IN UPPER CASE>, for every flag
// defined in this file (a command-line flag wins over its variable).
bool ApplyEnvironment() {
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!absl::EndsWith(flag->Filename(), "microd_main.cc")) continue;
    const std::string env = "MICROD_" + absl::AsciiStrToUpper(name);
    const char* value = std::getenv(env.c_str());
    if (value == nullptr) continue;
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      MICROD_LOG(Error, "bad value '%s' in %s: %s", value, env.c_str(), error.c_str());
      return false;
    }
  }
  return true;
}
// --log_level and --log_format (or MICROD_LOG_LEVEL, MICROD_LOG_FORMAT).
absl::Status ConfigureLog() {
  auto level = microd::log::ParseLevel(absl::GetFlag(FLAGS_log_level));
  if (!level.ok())
    return absl::InvalidArgumentError(absl::StrCat("--log_level: ", level.status().message()));
  auto format = microd::log::ParseFormat(absl::GetFlag(FLAGS_log_format));
  if (!format.ok())
    return absl::InvalidArgumentError(absl::StrCat("--log_format: ", format.status().message()));
  microd::log::SetLevel(*level);
  microd::log::SetFormat(*format);
  return absl::OkStatus();
}

int g_stop_pipe[2] = {-1, -1};

void OnStopSignal(int sig) {
  const int saved = errno;
  (void)!write(g_stop_pipe[1], &sig, sizeof sig);
  errno = saved;
}

// Reads the stop pipe on its own thread. Before the daemon serves (joining
// the job and the data-plane rendezvous can wait for minutes for the other
// nodes) a stop signal ends the process at once: there is no work to finish
// and no socket yet. Afterwards it hands the signal to Wait(), which runs the
// orderly shutdown.
class StopWatcher {
 public:
  StopWatcher() {
    std::thread([this] {
      int sig = 0;
      while (read(g_stop_pipe[0], &sig, sizeof sig) < 0 && errno == EINTR) {
      }
      absl::MutexLock lock(&mu_);
      if (!serving_) {
        MICROD_LOG(Info, "%s before the job started: exiting",
                   sig == SIGTERM ? "SIGTERM" : "SIGINT");
        std::fflush(stderr);
        std::_Exit(1);
      }
      signal_ = sig;
    }).detach();
  }
  void EnterServing() {
    absl::MutexLock lock(&mu_);
    serving_ = true;
  }
  // Blocks until a stop signal arrives; returns it.
  int Wait() {
    absl::MutexLock lock(&mu_);
    mu_.Await(absl::Condition(
        +[](int* s) { return *s != 0; }, &signal_));
    return signal_;
  }

 private:
  absl::Mutex mu_;
  bool serving_ ABSL_GUARDED_BY(mu_) = false;
  int signal_ ABSL_GUARDED_BY(mu_) = 0;
};

int Fatal(const std::string& what, const absl::Status& s) {
  MICROD_LOG(Error, "%s: %s", what.c_str(), s.ToString().c_str());
  return 1;
}

std::string HostName() {
  char buf[256] = {0};
  if (gethostname(buf, sizeof buf - 1) != 0) return "node";
  return buf;
}

// The address this node's data plane is reached on (--hostname).
// `observed_host`: the address the coordinator saw this node's join come
// from ("" when unknown).
absl::StatusOr<std::string> DataPlaneAddress(const std::string& coordinator_address,
                                             const std::string& observed_host) {
  std::string chosen = absl::GetFlag(FLAGS_hostname);
  std::string why = "--hostname";
  if (chosen.empty()) {
    const std::string listen = absl::GetFlag(FLAGS_coordinator_listen);
    auto listen_hp = microd::control::ParseHostPort(listen);
    if (!listen.empty() && listen_hp.ok() && microd::control::IsWildcardHost(listen_hp->host)) {
      chosen = microd::control::PrimaryHostAddress();
      why = "this host's address (the coordinator listens on every interface)";
    } else if (!observed_host.empty() && microd::control::IsLocalAddress(observed_host)) {
      // What the coordinator saw is the source address of this node's
      // route to it: no name lookup here (a container network's DNS may
      // answer gRPC's resolver and still fail this process's own lookups).
      chosen = observed_host;
      why = absl::StrCat("the address the coordinator at ", coordinator_address,
                         " saw this node join from");
    } else {
      // A name the job's DNS serves may fail to resolve for a moment (a
      // container network or a headless service catching up): retried for
      // up to --join_timeout_ms.
      const absl::Time deadline =
          absl::Now() + absl::Milliseconds(absl::GetFlag(FLAGS_join_timeout_ms));
      auto local = microd::control::LocalAddressToward(coordinator_address);
      for (bool said = false;
           !local.ok() && absl::IsUnavailable(local.status()) && absl::Now() < deadline;) {
        if (!said) {
          MICROD_LOG(Warning, "%s; retrying", std::string(local.status().message()).c_str());
          said = true;
        }
        absl::SleepFor(absl::Milliseconds(250));
        local = microd::control::LocalAddressToward(coordinator_address);
      }
      if (!local.ok()) {
        return absl::Status(local.status().code(),
                            absl::StrCat("cannot tell this node's address from the route to the "
                                         "coordinator (give --hostname): ",
                                         local.status().message()));
      }
      chosen = *local;
      why = absl::StrCat("the route to the coordinator at ", coordinator_address);
      if (!observed_host.empty()) {
        absl::StrAppend(&why, "; the coordinator saw this node join from ", observed_host,
                        ", not an address of this host: a NAT in between?");
      }
    }
  }
  MICROD_LOG(Info, "data plane on %s (%s)", chosen.c_str(), why.c_str());
  return chosen;
}

// A flag's error, as main prints it: "<what>: <status>".
absl::Status Bad(const std::string& what, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.ToString()));
}

// The daemon's configuration, from the flags (and MICROD_* variables).
struct Config {
  microd::sparsify::SparsifyOptions sparsify;
  std::vector<std::string> remedies;  // what --remedies and the flags apply, one line each
  int local_size = 1;
  std::string transport;
  bool response_cache = true;
  absl::Duration op_timeout, peer_timeout;
  std::string token;
  std::string state_secret;  // --state_key_file's, else the token
  std::string node_name;
  microd::control::TlsFiles tls;
  // The daemon's memory budget (--max_state_bytes, or derived from the
  // memory limit) and where it comes from.
  uint64_t memory_budget = 0;
  std::string memory_budget_source;
};

absl::Status ParseSparsify(microd::sparsify::SparsifyOptions* sparsify,
                           std::vector<std::string>* applied) {
  auto sp = microd::sparsify::ParseSparsifier(absl::GetFlag(FLAGS_sparsifier));
  if (!sp.ok()) return Bad("--sparsifier", sp.status());
  auto ct = microd::sparsify::ParseController(absl::GetFlag(FLAGS_controller));
  if (!ct.ok()) return Bad("--controller", ct.status());
  sparsify->sparsifier = *sp;
  sparsify->controller = *ct;
  sparsify->density = absl::GetFlag(FLAGS_density);
  sparsify->hard_threshold = absl::GetFlag(FLAGS_hard_threshold);
  sparsify->clip_norm = absl::GetFlag(FLAGS_clip_norm);
  sparsify->warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  sparsify->warmup_density = absl::GetFlag(FLAGS_warmup_density);
  sparsify->warmup_decay_steps = absl::GetFlag(FLAGS_warmup_decay_steps);
  sparsify->min_k = absl::GetFlag(FLAGS_min_k);
  sparsify->momentum = sparsify->sparsifier == microd::sparsify::SparsifierKind::kDense
                           ? 0.0
                           : absl::GetFlag(FLAGS_momentum_correction);
  if (absl::Status s = sparsify->Validate(); !s.ok()) return Bad("options", s);
  auto remedies = microd::sparsify::ParseRemedies(absl::GetFlag(FLAGS_remedies));
  if (!remedies.ok()) return Bad("--remedies", remedies.status());
  *applied = microd::sparsify::ApplyRemedies(*remedies, sparsify);
  if (sparsify->momentum > 0) {
    applied->push_back(absl::StrFormat(
        "momentum correction %g with momentum factor masking (the velocity is zeroed where "
        "values are sent)",
        sparsify->momentum));
  }
  return absl::OkStatus();
}

// The limits and timeouts: each in its range.
absl::Status CheckRanges() {
  if (absl::GetFlag(FLAGS_nonfinite) != "fail" && absl::GetFlag(FLAGS_nonfinite) != "skip") {
    return Bad("--nonfinite", absl::InvalidArgumentError("must be fail or skip"));
  }
  if (absl::GetFlag(FLAGS_wire_dtype) != "fp32" && absl::GetFlag(FLAGS_wire_dtype) != "bucket") {
    return Bad("--wire_dtype", absl::InvalidArgumentError("must be fp32 or bucket"));
  }
  if (absl::GetFlag(FLAGS_wire_dtype) == "bucket" && absl::GetFlag(FLAGS_transport) == "nccl") {
    return Bad("--wire_dtype", absl::InvalidArgumentError(
                                   "bucket needs --transport=gloo (NCCL takes fp32 buckets)"));
  }
  if (const int l = absl::GetFlag(FLAGS_local_size); l < 1 || l > microd::control::kMaxLocalSize) {
    return Bad("--local_size", absl::InvalidArgumentError(absl::StrCat(
                                   "must be in [1, ", microd::control::kMaxLocalSize, "]")));
  }
  if (absl::GetFlag(FLAGS_cuda_device) < 0) {
    return Bad("--cuda_device", absl::InvalidArgumentError("must be >= 0"));
  }
  if (absl::GetFlag(FLAGS_cycle_floats) > (uint64_t{1} << 20)) {
    return Bad("--cycle_floats", absl::InvalidArgumentError("must be at most 1048576"));
  }
  if (const int c = absl::GetFlag(FLAGS_data_connections); c < 0 || c > 16) {
    return Bad("--data_connections",
               absl::InvalidArgumentError(absl::StrCat("must be in [0, 16], not ", c)));
  }
  if (const int nice = absl::GetFlag(FLAGS_gloo_io_nice); nice < 0 || nice > 19) {
    return Bad("--gloo_io_nice",
               absl::InvalidArgumentError(absl::StrCat("must be in [0, 19], not ", nice)));
  }
  if (absl::GetFlag(FLAGS_timeout_ms) <= 0 || absl::GetFlag(FLAGS_peer_timeout_ms) <= 0 ||
      absl::GetFlag(FLAGS_hello_timeout_ms) <= 0) {
    return Bad("timeouts", absl::InvalidArgumentError("timeouts must be positive"));
  }
  if (absl::GetFlag(FLAGS_stall_warning_s) < 1 || absl::GetFlag(FLAGS_stall_abort_s) < 0) {
    return Bad("--stall_warning_s",
               absl::InvalidArgumentError("--stall_warning_s must be at least 1 and "
                                          "--stall_abort_s at least 0"));
  }
  if (absl::GetFlag(FLAGS_timeline_steps) < 1 || absl::GetFlag(FLAGS_timeline_steps) > 100000000 ||
      absl::GetFlag(FLAGS_timeline_every) < 1 || !(absl::GetFlag(FLAGS_timeline_flush_s) > 0)) {
    return Bad("--timeline_steps",
               absl::InvalidArgumentError("--timeline_steps must be in [1, 100000000], "
                                          "--timeline_every at least 1 and --timeline_flush_s "
                                          "positive"));
  }
  if (absl::GetFlag(FLAGS_max_processes) < 1 || absl::GetFlag(FLAGS_max_buffers_per_process) < 1) {
    return Bad("limits", absl::InvalidArgumentError(
                             "--max_processes and --max_buffers_per_process must be at least 1"));
  }
  return absl::OkStatus();
}

// The secret in `path` (trailing white space dropped; "" for no path).
absl::StatusOr<std::string> ReadSecretFile(const std::string& flag, const std::string& path) {
  if (path.empty()) return std::string();
  std::ifstream in(path);
  if (!in) return Bad(flag, absl::NotFoundError(absl::StrCat("cannot read ", path)));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string secret(absl::StripTrailingAsciiWhitespace(ss.str()));
  if (secret.empty()) return Bad(flag, absl::InvalidArgumentError(absl::StrCat(path, " is empty")));
  return secret;
}

absl::StatusOr<Config> ParseFlags() {
  Config c;
  if (absl::Status s = ParseSparsify(&c.sparsify, &c.remedies); !s.ok()) return s;
  if (absl::Status s = CheckRanges(); !s.ok()) return s;
  c.local_size = absl::GetFlag(FLAGS_local_size);
  c.transport = absl::GetFlag(FLAGS_transport);
  if (c.transport != "gloo" && !(MICROD_HAVE_NCCL && c.transport == "nccl")) {
    return Bad("--transport",
               absl::UnimplementedError(absl::StrCat(
                   "'", c.transport, "' is not available in this build (",
                   MICROD_HAVE_NCCL ? "gloo or nccl" : "gloo; nccl needs a CUDA build", ")")));
  }
  // Over NCCL a cycle would wait for the other nodes inside an NCCL kernel,
  // spinning on the GPU the training shares: the coordinator negotiates.
  c.response_cache = absl::GetFlag(FLAGS_response_cache) && c.transport != "nccl";
  if (absl::GetFlag(FLAGS_response_cache) && !c.response_cache) {
    MICROD_LOG(Info,
               "--transport=nccl: the response cache is off (every step "
               "through the coordinator)");
  }
  c.op_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  c.peer_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_peer_timeout_ms));
  auto token = ReadSecretFile("--token_file", absl::GetFlag(FLAGS_token_file));
  if (!token.ok()) return token.status();
  c.token = *token;
  auto state_secret = ReadSecretFile("--state_key_file", absl::GetFlag(FLAGS_state_key_file));
  if (!state_secret.ok()) return state_secret.status();
  c.state_secret = state_secret->empty() ? c.token : *state_secret;
  if (const uint64_t given = absl::GetFlag(FLAGS_max_state_bytes); given > 0) {
    c.memory_budget = given;
    c.memory_budget_source = "--max_state_bytes";
  } else if (c.transport != "nccl") {
    const microd::MemoryLimit limit = microd::DetectMemoryLimit();
    c.memory_budget = limit.bytes / 10 * 8;
    c.memory_budget_source = absl::StrCat("80% of ", limit.bytes, " bytes, ", limit.source);
  }
  c.node_name = absl::GetFlag(FLAGS_node_name);
  if (c.node_name.empty()) c.node_name = HostName();
  microd::log::SetIdentity(c.node_name, -1);
  c.tls.cert = absl::GetFlag(FLAGS_tls_cert);
  c.tls.key = absl::GetFlag(FLAGS_tls_key);
  c.tls.ca = absl::GetFlag(FLAGS_tls_ca);
  c.tls.server_name = absl::GetFlag(FLAGS_tls_server_name);
  if (absl::Status s = microd::control::CheckTlsFiles(
          c.tls, /*server=*/!absl::GetFlag(FLAGS_coordinator_listen).empty());
      !s.ok()) {
    return Bad("TLS", s);
  }
  return c;
}

// Whether serving on `address` is allowed: only this machine reaches it, or
// whoever connects is authenticated (mutual TLS: a CA the clients'
// certificates must chain to; for the coordinator also a job token), or
// --insecure says the network is trusted. TLS with a server certificate
// alone encrypts but lets anyone in.
absl::Status CheckExposure(const std::string& flag, const std::string& address, const Config& c,
                           bool token_counts) {
  const bool clients_authenticated = !c.tls.ca.empty() || (token_counts && !c.token.empty());
  if (microd::control::IsLocalOnly(address) || clients_authenticated) return absl::OkStatus();
  const std::string tls_alone =
      c.tls.enabled() ? " (TLS with --tls_cert alone authenticates nobody who connects)" : "";
  if (absl::GetFlag(FLAGS_insecure)) {
    MICROD_LOG(Warning,
               "%s %s is reachable from the network without client "
               "authentication%s (--insecure)%s",
               flag.c_str(), address.c_str(), token_counts ? " or a job token" : "",
               tls_alone.c_str());
    return absl::OkStatus();
  }
  return Bad(flag,
             absl::FailedPreconditionError(absl::StrCat(
                 "refusing to serve on ", address,
                 ", which other hosts reach, without authenticating who connects", tls_alone,
                 ": anyone who reaches it could ",
                 token_counts ? "join the job, read its state or end it" : "read the job's state",
                 ". Give --tls_ca (mutual TLS: every client presents a certificate it "
                 "signed) with --tls_cert and --tls_key",
                 token_counts ? ", or --token_file" : "",
                 ", listen on loopback, or pass --insecure on a trusted network")));
}

// The engine's options, from the configuration and the data plane chosen.
microd::engine::EngineOptions EngineOptionsOf(const Config& c) {
  microd::engine::EngineOptions eo;
  eo.job_id = absl::GetFlag(FLAGS_job_id);
  eo.state_key = microd::engine::DeriveStateKey(c.state_secret);
  eo.state_budget = c.memory_budget;
  eo.state_budget_source = c.memory_budget_source;
  eo.local_size = c.local_size;
  eo.sparsify = c.sparsify;
  eo.dense_floor = absl::GetFlag(FLAGS_dense_floor);
  eo.skip_nonfinite = absl::GetFlag(FLAGS_nonfinite) == "skip";
  eo.stats_history = absl::GetFlag(FLAGS_stats_history);
  eo.wire_bucket_dtype = absl::GetFlag(FLAGS_wire_dtype) == "bucket";
  eo.response_cache = c.response_cache;
  eo.cycle_floats = absl::GetFlag(FLAGS_cycle_floats);
  eo.op_timeout = c.op_timeout;
  if (absl::GetFlag(FLAGS_stall_abort_s) > 0) {
    eo.peer_wait =
        absl::Seconds(absl::GetFlag(FLAGS_stall_abort_s)) + c.peer_timeout + c.op_timeout;
  }
  eo.device_resident = c.transport == "nccl";
  eo.device = absl::GetFlag(FLAGS_cuda_device);
  return eo;
}

// One node's daemon: the coordinator (node 0), the Admin service, the
// membership in the job, the data plane, the engine and the local socket.
// Start brings them up in that order; Stop (or any early return: the members
// are declared so) takes them down in the reverse one.
class Daemon {
 public:
  explicit Daemon(Config config) : config_(std::move(config)) {}
  ~Daemon() {
    absl::MutexLock lock(&mu_);
    // The heartbeats' failure callback calls into the engine (a Start that
    // failed half-way has not left the job).
    if (client_ != nullptr) client_->StopHeartbeats();
    engine_.reset();
    local_server_.reset();
  }

  // Every error as main prints it ("<what>: <status>").
  absl::Status Start(StopWatcher* stop);
  void Stop(int sig);

 private:
  absl::Status StartCoordinator();
  absl::Status StartAdmin();
  absl::Status StartMetrics();
  absl::Status StartTimeline();
  // microctl timeline: records for the request's window (or takes what the
  // ring keeps), then answers with the trace.
  grpc::Status Timeline(grpc::ServerContext* ctx, const microd::v1::GetTimelineRequest& req,
                        microd::v1::GetTimelineResponse* resp);
  absl::Status Join();
  absl::Status StartDataPlane(const microd::engine::EngineOptions& eo);
  absl::Status Serve(const microd::engine::EngineOptions& eo);
  // `buckets` (optional): the engine's per-bucket statistics of the same
  // snapshot (the metrics' histograms).
  void FillStatus(const microd::v1::GetStatusRequest& req, microd::v1::GetStatusResponse* r,
                  std::vector<microd::engine::BucketStats>* buckets = nullptr);

  const Config config_;
  const absl::Time started_ = absl::Now();
  std::string coordinator_address_ = absl::GetFlag(FLAGS_coordinator);
  std::unique_ptr<microd::control::Coordinator> coordinator_;
  std::unique_ptr<microd::control::CoordinatorService> coordinator_service_;
  std::unique_ptr<microd::control::ControlServer> coordinator_server_;
  // Destroyed in this order's reverse: the local server before the engine
  // before the transport before the coordinator client. The Admin service,
  // declared after them, stops first.
  microd::control::Membership membership_;
  std::unique_ptr<microd::control::CoordinatorClient> client_;
  std::unique_ptr<microd::transport::Transport> transport_;
  std::unique_ptr<microd::kernels::SparseOps> ops_;
  std::unique_ptr<microd::engine::Engine> engine_;
  std::unique_ptr<microd::local::LocalServer> local_server_;
  absl::Mutex mu_;  // guards the pointers above against the Admin thread
  microd::engine::Timeline timeline_{
      {absl::GetFlag(FLAGS_timeline_steps), absl::GetFlag(FLAGS_timeline_every)}};
  std::unique_ptr<microd::engine::TimelineFile> timeline_file_;
  std::atomic<bool> capturing_{false};  // a timeline capture holds its window
  microd::control::AdminService admin_service_{
      [this](const microd::v1::GetStatusRequest& req, microd::v1::GetStatusResponse* r) {
        FillStatus(req, r);
      },
      [this](grpc::ServerContext* ctx, const microd::v1::GetTimelineRequest& req,
             microd::v1::GetTimelineResponse* resp) { return Timeline(ctx, req, resp); }};
  std::unique_ptr<microd::control::ControlServer> admin_;
  std::unique_ptr<microd::engine::MetricsServer> metrics_;  // stops before the Admin service
};

absl::Status Daemon::StartCoordinator() {
  const std::string listen = absl::GetFlag(FLAGS_coordinator_listen);
  if (!listen.empty()) {
    microd::control::CoordinatorOptions co;
    co.job_id = absl::GetFlag(FLAGS_job_id);
    co.token = config_.token;
    co.expected_nodes = absl::GetFlag(FLAGS_nodes);
    co.peer_timeout = config_.peer_timeout;
    co.stall_warning = absl::Seconds(absl::GetFlag(FLAGS_stall_warning_s));
    co.stall_abort = absl::Seconds(absl::GetFlag(FLAGS_stall_abort_s));
    auto c = microd::control::Coordinator::Create(co);
    if (!c.ok()) return Bad("coordinator", c.status());
    coordinator_ = std::move(c).value();
    coordinator_service_ =
        std::make_unique<microd::control::CoordinatorService>(coordinator_.get());
    RETURN_IF_ERROR(CheckExposure("--coordinator_listen", listen, config_, /*token_counts=*/true));
    microd::control::ControlServerOptions so;
    so.credentials = microd::control::ServerCredentialsFor(config_.tls);
    so.reflection = false;  // nothing to browse on the job's own port
    auto server = microd::control::ControlServer::Start(listen, {coordinator_service_.get()}, so);
    if (!server.ok()) return Bad("coordinator", server.status());
    coordinator_server_ = std::move(server).value();
    if (coordinator_address_.empty()) {
      // Where this node reaches the coordinator it serves: its listen
      // address (on a multi-homed host that may not be loopback).
      auto self = microd::control::SelfDialAddress(listen, coordinator_server_->port());
      if (!self.ok()) return Bad("--coordinator_listen", self.status());
      coordinator_address_ = *self;
    }
    MICROD_LOG(Info, "coordinator listening on %s for %d nodes",
               coordinator_server_->address().c_str(), co.expected_nodes);
    if (const std::string f = absl::GetFlag(FLAGS_coordinator_port_file); !f.empty()) {
      std::ofstream(f) << coordinator_server_->port() << "\n";
    }
  }
  if (coordinator_address_.empty()) {
    return Bad("--coordinator",
               absl::InvalidArgumentError("give --coordinator or --coordinator_listen"));
  }
  return absl::OkStatus();
}

void Daemon::FillStatus(const microd::v1::GetStatusRequest& req, microd::v1::GetStatusResponse* r,
                        std::vector<microd::engine::BucketStats>* buckets) {
  const microd::sparsify::SparsifyOptions& sparsify = config_.sparsify;
  r->set_version(MICROD_VERSION_STRING);
  r->set_node_name(config_.node_name);
  r->set_transport(config_.transport);
  r->set_sparsifier(microd::sparsify::SparsifierName(sparsify.sparsifier));
  r->set_controller(microd::sparsify::ControllerName(sparsify.controller));
  r->set_density(sparsify.density);
  r->set_momentum_correction(sparsify.momentum);
  r->set_warmup_steps(sparsify.warmup_steps);
  r->set_warmup_density(sparsify.warmup_density);
  r->set_warmup_decay_steps(sparsify.warmup_decay_steps);
  r->set_clip_norm(sparsify.clip_norm);
  r->set_min_k(sparsify.min_k);
  for (const std::string& line : config_.remedies) r->add_remedies(line);
  r->set_response_cache(config_.response_cache);
  r->set_local_size(config_.local_size);
  r->set_socket(absl::GetFlag(FLAGS_socket));
  r->set_uptime_seconds(absl::ToDoubleSeconds(absl::Now() - started_));
  r->set_node_rank(-1);
  r->set_job_state(microd::v1::JOB_STATE_FORMING);
  if (coordinator_ != nullptr) microd::control::FillJobStatus(coordinator_->Snapshot(), r);
  absl::MutexLock lock(&mu_);
  if (membership_.session != 0) {
    r->set_node_rank(membership_.node_rank);
    r->set_node_count(membership_.node_count);
    r->set_world_size(membership_.world_size);
    if (coordinator_ == nullptr) r->set_job_state(microd::v1::JOB_STATE_RUNNING);
  }
  if (client_ != nullptr && !client_->job_status().ok()) {
    r->set_job_state(client_->job_status().code() == absl::StatusCode::kFailedPrecondition
                         ? microd::v1::JOB_STATE_FINISHED
                         : microd::v1::JOB_STATE_FAILED);
    if (r->failure().empty()) r->set_failure(std::string(client_->job_status().message()));
  }
  if (client_ != nullptr) {
    for (const std::string& s : client_->stalls()) r->add_stalls(s);
  }
  if (local_server_ != nullptr) {
    for (const auto& c : local_server_->Clients()) {
      auto* p = r->add_processes();
      p->set_local_rank(c.local_rank);
      p->set_pid(c.pid);
      p->set_buffers(c.buffers);
      p->set_bytes(c.bytes);
    }
  }
  if (engine_ != nullptr) {
    microd::engine::EngineSnapshot snapshot = engine_->Snapshot(req.include_history());
    microd::engine::FillEngineStatus(snapshot, r);
    if (buckets != nullptr) *buckets = std::move(snapshot.buckets);
  }
}

absl::Status Daemon::StartAdmin() {
  const std::string address = absl::GetFlag(FLAGS_admin);
  RETURN_IF_ERROR(CheckExposure("--admin", address, config_, /*token_counts=*/false));
  microd::control::ControlServerOptions so;
  so.reflection = true;
  // Status calls are short; a timeline capture holds one thread for its
  // window (one capture at a time). More callers than this are refused.
  so.max_threads = 16;
  // Plaintext where only this machine reaches it (probes, microctl in the
  // pod); TLS where the network does.
  if (!microd::control::IsLocalOnly(address)) {
    so.credentials = microd::control::ServerCredentialsFor(config_.tls);
  }
  const bool unix_socket = absl::StartsWith(address, "unix:");
  const std::string path = unix_socket ? address.substr(5) : "";
  if (unix_socket) {
    std::string warning;
    if (absl::Status s = microd::PrepareSocketPath(path, SOCK_STREAM, &warning); !s.ok()) {
      return Bad("--admin", s);
    }
    if (!warning.empty()) MICROD_LOG(Warning, "%s", warning.c_str());
  } else if (microd::control::IsLocalOnly(address)) {
    MICROD_LOG(Info,
               "--admin %s: every local user can read this daemon's "
               "status and timeline (unix:PATH admits only this uid)",
               address.c_str());
  }
  // gRPC binds with the process's umask: the socket is never more open than
  // RestrictSocket makes it.
  const int allow_gid = absl::GetFlag(FLAGS_allow_gid);
  const mode_t old_umask = unix_socket ? umask(microd::SocketUmask(allow_gid)) : 0;
  auto admin = microd::control::ControlServer::Start(address, {&admin_service_}, so);
  if (unix_socket) umask(old_umask);
  if (!admin.ok()) return Bad("--admin", admin.status());
  if (unix_socket) {
    if (absl::Status s = microd::RestrictSocket(path, allow_gid); !s.ok()) return Bad("--admin", s);
  }
  admin_ = std::move(admin).value();
  // Health: "" is SERVING while the process answers (liveness); "microd"
  // only once this node joined and serves its training processes (startup
  // and readiness: a trainer started earlier would wait for the socket).
  admin_->SetServing(kHealthService, false);
  MICROD_LOG(Info, "admin listening on %s", admin_->address().c_str());
  if (const std::string f = absl::GetFlag(FLAGS_admin_port_file); !f.empty()) {
    std::ofstream(f) << admin_->port() << "\n";
  }
#if MICROD_HAVE_NCCL
  if (config_.transport == "nccl") {
    // Before joining: a node without a usable GPU must not hold the job up.
    std::string why;
    auto gpu_ops = microd::kernels::CreateCudaSparseOps(absl::GetFlag(FLAGS_cuda_device), &why);
    if (gpu_ops == nullptr) {
      return Bad("--transport=nccl",
                 absl::FailedPreconditionError(
                     absl::StrCat("no usable GPU ", absl::GetFlag(FLAGS_cuda_device), ": ", why)));
    }
    absl::MutexLock lock(&mu_);
    ops_ = std::move(gpu_ops);
  }
#endif
  return absl::OkStatus();
}

absl::Status Daemon::StartMetrics() {
  const std::string address = absl::GetFlag(FLAGS_metrics);
  if (address.empty()) return absl::OkStatus();
  auto collector = std::make_shared<microd::engine::MetricsCollector>(
      [this](microd::v1::GetStatusResponse* r, std::vector<microd::engine::BucketStats>* b) {
        FillStatus({}, r, b);
      });
  auto server = microd::engine::MetricsServer::Start(address, std::move(collector));
  if (!server.ok()) return Bad("--metrics", server.status());
  metrics_ = std::move(server).value();
  MICROD_LOG(Info, "metrics on http://%s:%d/metrics", address.substr(0, address.rfind(':')).c_str(),
             metrics_->port());
  if (const std::string f = absl::GetFlag(FLAGS_metrics_port_file); !f.empty()) {
    std::ofstream(f) << metrics_->port() << "\n";
  }
  return absl::OkStatus();
}

absl::Status Daemon::StartTimeline() {
  const std::string path = absl::GetFlag(FLAGS_timeline);
  if (path.empty()) return absl::OkStatus();
  auto file = microd::engine::TimelineFile::Start(
      &timeline_, path, absl::Seconds(absl::GetFlag(FLAGS_timeline_flush_s)));
  if (!file.ok()) return Bad("--timeline", file.status());
  timeline_file_ = std::move(file).value();
  MICROD_LOG(Info, "timeline of the last %llu steps in %s",
             static_cast<unsigned long long>(absl::GetFlag(FLAGS_timeline_steps)), path.c_str());
  return absl::OkStatus();
}

grpc::Status Daemon::Timeline(grpc::ServerContext* ctx, const microd::v1::GetTimelineRequest& req,
                              microd::v1::GetTimelineResponse* resp) {
  absl::Time since = absl::InfinitePast();
  // One capture at a time: each holds a server thread for its window.
  bool capturing = false;
  if (req.seconds() > 0 && !capturing_.compare_exchange_strong(capturing, true)) {
    return grpc::Status(grpc::StatusCode::RESOURCE_EXHAUSTED,
                        "timeline: another capture is running; one at a time");
  }
  struct EndCapture {
    std::atomic<bool>* flag;
    bool active;
    ~EndCapture() {
      if (active) flag->store(false);
    }
  } end_capture{&capturing_, req.seconds() > 0};
  if (req.seconds() > 0) {
    since = absl::Now();
    const absl::Time until = since + absl::Seconds(req.seconds());
    timeline_.Hold();
    // Bounded by the window; a client that gives up (or a shutdown) ends it early.
    while (absl::Now() < until && !ctx->IsCancelled()) {
      absl::SleepFor(std::min(absl::Milliseconds(100), until - absl::Now()));
    }
    timeline_.Release();
    if (ctx->IsCancelled()) return grpc::Status(grpc::StatusCode::CANCELLED, "timeline: cancelled");
  }
  uint64_t steps = 0;
  resp->set_trace_json(timeline_.ChromeJson(since, &steps));
  resp->set_steps(steps);
  return grpc::Status::OK;
}

absl::Status Daemon::Join() {
  microd::control::CoordinatorClientOptions cco;
  cco.address = coordinator_address_;
  cco.job_id = absl::GetFlag(FLAGS_job_id);
  cco.node_name = config_.node_name;
  cco.token = config_.token;
  cco.local_size = config_.local_size;
  cco.requested_rank = absl::GetFlag(FLAGS_node_rank);
  cco.peer_timeout = config_.peer_timeout;
  // Node 0 dials the coordinator it serves like any node; over loopback
  // (a coordinator listening on every interface) with TLS the certificate
  // must name 127.0.0.1 too, or --tls_server_name.
  cco.tls = config_.tls;
  auto created = microd::control::CoordinatorClient::Create(cco);
  if (!created.ok()) return Bad("coordinator client", created.status());
  {
    absl::MutexLock lock(&mu_);
    client_ = std::move(created).value();
  }
  auto joined =
      client_->Join(absl::Now() + absl::Milliseconds(absl::GetFlag(FLAGS_join_timeout_ms)));
  if (!joined.ok()) return Bad("join", joined.status());
  {
    absl::MutexLock lock(&mu_);
    membership_ = *joined;
  }
  microd::log::SetRank(membership_.node_rank);
  MICROD_LOG(Info, "node '%s' is rank %d of %d (world size %d)", config_.node_name.c_str(),
             membership_.node_rank, membership_.node_count, membership_.world_size);
  return absl::OkStatus();
}

absl::Status Daemon::StartDataPlane(const microd::engine::EngineOptions& eo) {
  if (!eo.device_resident) {
    auto data_address = DataPlaneAddress(coordinator_address_, membership_.observed_host);
    if (!data_address.ok()) return Bad("--hostname", data_address.status());
    microd::transport::GlooOptions go;
    go.rank = membership_.node_rank;
    go.size = membership_.node_count;
    go.store = client_.get();
    go.hostname = *data_address;
    go.timeout = config_.op_timeout;
    go.io_nice = absl::GetFlag(FLAGS_gloo_io_nice);
    go.connections = absl::GetFlag(FLAGS_data_connections);
    auto created = microd::transport::CreateGlooTransport(go);
    if (!created.ok()) return Bad("transport", created.status());
    transport_ = std::move(created).value();
    ops_ = microd::kernels::CreateCpuSparseOps();
    if (const microd::transport::LinkModel* m = transport_->link_model();
        m != nullptr && m->ranks > 1) {
      MICROD_LOG(Info,
                 "data plane links (slowest of every node's): a direct round takes "
                 "%.3f ms (%.3f ms posted ahead), a node sends %.1f MB/s; %d connection(s) "
                 "per pair",
                 m->round_seconds * 1e3, m->posted_round_seconds * 1e3, m->bytes_per_second / 1e6,
                 m->connections);
    }
    return absl::OkStatus();
  }
#if MICROD_HAVE_NCCL
  // The GPU path: kernels and collectives on --cuda_device, in place on the
  // processes' CUDA buffers. The kernels queue on the legacy default stream;
  // the transport's own stream is ordered after them.
  microd::transport::NcclOptions no;
  no.rank = membership_.node_rank;
  no.size = membership_.node_count;
  no.device = eo.device;
  no.store = client_.get();
  no.timeout = config_.op_timeout;
  auto created = microd::transport::CreateNcclTransport(no);
  if (!created.ok()) return Bad("transport", created.status());
  transport_ = std::move(created).value();
  MICROD_LOG(Info, "reducing on GPU %d over NCCL (CUDA buffers only)", eo.device);
  return absl::OkStatus();
#else
  return Bad("--transport", absl::UnimplementedError("nccl needs a CUDA build"));
#endif
}

absl::Status Daemon::Serve(const microd::engine::EngineOptions& eo) {
  microd::local::LocalServerOptions lo;
  lo.socket_path = absl::GetFlag(FLAGS_socket);
  lo.allow_gid = absl::GetFlag(FLAGS_allow_gid);
  lo.max_clients = absl::GetFlag(FLAGS_max_processes);
  lo.max_buffers_per_client = absl::GetFlag(FLAGS_max_buffers_per_process);
  lo.max_bytes_per_client = absl::GetFlag(FLAGS_max_bytes_per_process);
  if (lo.max_bytes_per_client == 0) {
    lo.max_bytes_per_client = config_.memory_budget > 0 ? config_.memory_budget : uint64_t{1} << 40;
  }
  lo.hello_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_hello_timeout_ms));
  // A process that reads none of its completions for a whole operation's
  // deadline is not coming back.
  lo.stuck_after = config_.op_timeout;
  lo.cuda_resident_device = eo.device_resident ? eo.device : -1;
  auto server = microd::local::LocalServer::Start(lo, engine_.get());
  if (!server.ok()) return Bad("--socket", server.status());
  {
    absl::MutexLock lock(&mu_);
    local_server_ = std::move(server).value();
  }
  engine_->SetServer(local_server_.get());
  engine_->SetTimeline(&timeline_);
  client_->SetFailureCallback([e = engine_.get()](const absl::Status& s) { e->Fail(s, false); });
  // Buckets waiting for half the warning time go to the stall inspector.
  client_->SetWaitingProvider(
      [e = engine_.get(), at_least = absl::Seconds(absl::GetFlag(FLAGS_stall_warning_s)) / 2] {
        return e->Waiting(at_least);
      });
  engine_->Start();
  admin_->SetServing(kHealthService, true);
  MICROD_LOG(Info, "serving %d local process(es) on %s", config_.local_size,
             lo.socket_path.c_str());
  for (const std::string& line : config_.remedies) {
    MICROD_LOG(Info, "remedy at density %g: %s", config_.sparsify.density, line.c_str());
  }
  if (config_.memory_budget > 0) {
    MICROD_LOG(Info, "the buckets' state may take %llu bytes (%s)",
               static_cast<unsigned long long>(config_.memory_budget),
               config_.memory_budget_source.c_str());
  }
  return absl::OkStatus();
}

absl::Status Daemon::Start(StopWatcher* stop) {
  RETURN_IF_ERROR(StartCoordinator());
  RETURN_IF_ERROR(StartAdmin());
  RETURN_IF_ERROR(StartMetrics());
  RETURN_IF_ERROR(StartTimeline());
  RETURN_IF_ERROR(Join());
  timeline_.SetNode(membership_.node_rank, config_.node_name);
  const microd::engine::EngineOptions eo = EngineOptionsOf(config_);
  RETURN_IF_ERROR(StartDataPlane(eo));
  if (absl::Status s =
          microd::engine::CheckOptionsAgree(*transport_, eo, absl::Now() + config_.op_timeout);
      !s.ok()) {
    return Bad("options", s);
  }
  {
    absl::MutexLock lock(&mu_);
    engine_ = std::make_unique<microd::engine::Engine>(eo, membership_, client_.get(),
                                                       transport_.get(), ops_.get());
  }
  // From here on a stop signal is handled by the orderly shutdown (Stop).
  stop->EnterServing();
  return Serve(eo);
}

void Daemon::Stop(int sig) {
  MICROD_LOG(Info, "%s: shutting down", sig == SIGTERM ? "SIGTERM" : "SIGINT");
  admin_->SetServing(kHealthService, false);
  local_server_->Stop();  // no new work; removes the socket
  engine_->Stop(absl::CancelledError(
      absl::StrCat("microd on node ", membership_.node_rank, " is shutting down")));
  timeline_file_.reset();  // its last write, with every step run
  (void)client_->Leave();
  admin_->Shutdown(absl::Now() + absl::Seconds(1));
  if (const std::string a = absl::GetFlag(FLAGS_admin); absl::StartsWith(a, "unix:")) {
    unlink(a.c_str() + 5);
  }
  if (coordinator_server_ != nullptr) coordinator_server_->Shutdown(absl::Now() + absl::Seconds(1));
}

// SIGTERM/SIGINT only write to a pipe the stop watcher reads (whichever
// thread the kernel delivers them to).
bool InstallStopSignals() {
  if (pipe2(g_stop_pipe, O_CLOEXEC) != 0) return false;
  struct sigaction sa {};
  sa.sa_handler = OnStopSignal;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGTERM, &sa, nullptr);
  sigaction(SIGINT, &sa, nullptr);
  signal(SIGPIPE, SIG_IGN);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "microd: sidecar daemon averaging gradients with MiCRO sparsification.\n"
      "  node 0: microd --coordinator_listen=0.0.0.0:7470 --nodes=4 --local_size=1\n"
      "  others: microd --coordinator=node0:7470 --local_size=1");
  if (!ApplyEnvironment()) return 2;
  microd::ParseCommandLine(argc, argv);
  if (absl::Status s = ConfigureLog(); !s.ok()) {
    std::fprintf(stderr, "microd: %s\n", std::string(s.message()).c_str());
    return 2;
  }
  if (!InstallStopSignals()) return Fatal("pipe", absl::InternalError("pipe2"));
  StopWatcher stop;
  auto config = ParseFlags();
  if (!config.ok()) {
    MICROD_LOG(Error, "%s", std::string(config.status().message()).c_str());
    return 1;
  }
  Daemon daemon(std::move(config).value());
  if (absl::Status s = daemon.Start(&stop); !s.ok()) {
    MICROD_LOG(Error, "%s", std::string(s.message()).c_str());
    return 1;
  }
  daemon.Stop(stop.Wait());
  return 0;
}
