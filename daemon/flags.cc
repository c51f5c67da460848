// SPDX-License-Identifier: Apache-2.0
#include "daemon/flags.h"

#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"
#include "daemon/common/status_macros.h"

ABSL_FLAG(std::string, socket, "/run/microd/microd.sock", "Unix socket for the training processes");
ABSL_FLAG(int, local_size, 1, "training processes on this node");
ABSL_FLAG(std::string, node_name, "", "this node's name (default: the host name)");
ABSL_FLAG(int, node_rank, -1, "node rank to take (-1: any free one)");
ABSL_FLAG(int, nodes, 1, "nodes in the job (used by the coordinator)");
ABSL_FLAG(int, min_nodes, 0,
          "elastic membership: while at least this many nodes remain, a node lost past the "
          "peer timeout leaves the job instead of failing it; the others go on as a job of "
          "their number, with MICROD_ERR_MEMBERSHIP for the step in flight (0, or --nodes: "
          "not elastic; every node must give the same)");
ABSL_FLAG(int, max_nodes, 0,
          "elastic membership: while fewer than this many nodes take part, a node started later "
          "(a replacement) joins the running job at the next step; the others' step in flight "
          "is answered MICROD_ERR_MEMBERSHIP (0: --nodes; every node must give the same)");
ABSL_FLAG(int, elastic_timeout_s, 600,
          "elastic membership: a job left with fewer than --min_nodes nodes runs nothing and "
          "waits this long for nodes to join, then fails naming what it waited for (0: it fails "
          "at once; read by the coordinator, node 0)");
ABSL_FLAG(std::string, coordinator, "", "address of the coordinator (host:port)");
ABSL_FLAG(bool, coordinator_only, false,
          "serve the coordinator (--coordinator_listen) and the Admin service only, for "
          "--nodes training nodes that all dial it: an elastic job may then lose any of them, "
          "node 0 included");
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
ABSL_FLAG(std::string, seal, "auto",
          "authenticate and encrypt every transfer between daemons (AES-256-GCM, keys fresh per "
          "epoch from the control plane): auto (on with TLS or --token_file), on, or off");
ABSL_FLAG(std::string, seal_failure, "job",
          "a sealed transfer that fails verification fails the job (job), or the step on every "
          "node (step: an elastic job goes on in its next epoch, keyed afresh; one round a step "
          "more)");
ABSL_FLAG(int, data_connections, 0,
          "Gloo connections per pair of nodes; large allreduces go in parts over all of them "
          "(0: 4 where a round on the data plane takes 2 ms or more, measured at start, else 1)");
ABSL_FLAG(std::string, link_model, "",
          "the data plane's links as round_ms=R,posted_ms=P,mb_per_s=B instead of measured at "
          "start: a direct round's time, the same with its receives posted ahead, a node's "
          "sending rate; the schedules of the exchanges follow from them (\"\": measured)");
ABSL_FLAG(std::string, sparsifier, "micro", "micro, topk, hard or dense");
ABSL_FLAG(std::string, controller, "hist", "micro threshold controller: hist or paper");
ABSL_FLAG(double, density, 0.01, "target density in (0, 1]");
ABSL_FLAG(double, hard_threshold, 0.0, "hard sparsifier threshold (0: 1/(2 sqrt(k)))");
ABSL_FLAG(double, momentum_correction, 0.0,
          "momentum correction factor (DGC) in [0, 1); 0: off. With it on, the daemon applies "
          "momentum to every gradient bucket (dense ones and dense warm-up steps: momentum SGD "
          "on the average; not buffers registered dense, averaged exactly) and the training "
          "side must not (microd.torch.DistributedOptimizer switches SGD's off)");
ABSL_FLAG(double, clip_norm, 0.0,
          "local gradient clipping per bucket: scale a node's gradient down to "
          "clip_norm / sqrt(nodes) (0: off)");
ABSL_FLAG(uint64_t, warmup_steps, 0, "the first N steps of every bucket are dense");
ABSL_FLAG(double, warmup_density, 0.0,
          "then decay the density exponentially from this to --density (0: no decay)");
ABSL_FLAG(uint64_t, warmup_decay_steps, 0, "length of the density decay, in steps");
ABSL_FLAG(double, warmup_dense_above, 0.0,
          "during the density decay, steps whose density is above this run dense: the daemon's "
          "memory stays at the residual plus a fixed tile instead of growing with the density "
          "(a dense step's bytes on the wire instead; 0: off)");
ABSL_FLAG(uint64_t, min_k, 0,
          "a bucket whose budget at --density is below this many values per step is "
          "sparsified at the density that gives it this many (0: off, unless --remedies "
          "sets it)");
ABSL_FLAG(std::string, remedies, "auto",
          "below a density of 0.5 %, the remedies the daemon fills in where their own flags are "
          "unset: auto (min_k), off, or a comma-separated list of warmup (a DGC warm-up), "
          "min_k");
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
          "the most this node's bucket state (residuals, velocities, candidates) may take in "
          "the daemon's memory; a buffer whose bucket would take it past is "
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

namespace microd {
namespace {

// The secret in `path` (trailing white space dropped; "" for no path).
absl::StatusOr<std::string> ReadSecretFile(const std::string& flag, const std::string& path) {
  if (path.empty()) return std::string();
  std::ifstream in(path);
  if (!in) return FlagError(flag, absl::NotFoundError(absl::StrCat("cannot read ", path)));
  std::stringstream ss;
  ss << in.rdbuf();
  std::string secret(absl::StripTrailingAsciiWhitespace(ss.str()));
  if (secret.empty())
    return FlagError(flag, absl::InvalidArgumentError(absl::StrCat(path, " is empty")));
  return secret;
}

absl::Status ReadSparsify(DaemonConfig* c) {
  auto sp = sparsify::ParseSparsifier(absl::GetFlag(FLAGS_sparsifier));
  if (!sp.ok()) return FlagError("--sparsifier", sp.status());
  auto ct = sparsify::ParseController(absl::GetFlag(FLAGS_controller));
  if (!ct.ok()) return FlagError("--controller", ct.status());
  auto remedies = sparsify::ParseRemedies(absl::GetFlag(FLAGS_remedies));
  if (!remedies.ok()) return FlagError("--remedies", remedies.status());
  sparsify::SparsifyOptions& o = c->sparsify;
  o.sparsifier = *sp;
  o.controller = *ct;
  o.density = absl::GetFlag(FLAGS_density);
  o.hard_threshold = absl::GetFlag(FLAGS_hard_threshold);
  o.clip_norm = absl::GetFlag(FLAGS_clip_norm);
  o.warmup_steps = absl::GetFlag(FLAGS_warmup_steps);
  o.warmup_density = absl::GetFlag(FLAGS_warmup_density);
  o.warmup_decay_steps = absl::GetFlag(FLAGS_warmup_decay_steps);
  o.warmup_dense_above = absl::GetFlag(FLAGS_warmup_dense_above);
  o.min_k = absl::GetFlag(FLAGS_min_k);
  // A dense job has no velocity to correct.
  o.momentum = o.sparsifier == sparsify::SparsifierKind::kDense
                   ? 0.0
                   : absl::GetFlag(FLAGS_momentum_correction);
  c->remedies = *remedies;
  const std::string nonfinite = absl::GetFlag(FLAGS_nonfinite);
  if (nonfinite != "fail" && nonfinite != "skip") {
    return FlagError("--nonfinite", absl::InvalidArgumentError("must be fail or skip"));
  }
  c->skip_nonfinite = nonfinite == "skip";
  const std::string wire = absl::GetFlag(FLAGS_wire_dtype);
  if (wire != "fp32" && wire != "bucket") {
    return FlagError("--wire_dtype", absl::InvalidArgumentError("must be fp32 or bucket"));
  }
  c->wire_bucket_dtype = wire == "bucket";
  c->stats_history = absl::GetFlag(FLAGS_stats_history);
  c->response_cache = absl::GetFlag(FLAGS_response_cache);
  c->cycle_floats = absl::GetFlag(FLAGS_cycle_floats);
  c->dense_floor = absl::GetFlag(FLAGS_dense_floor);
  return absl::OkStatus();
}

}  // namespace

absl::Status ApplyEnvironment() {
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (absl::StrContains(flag->Filename(), "absl/")) continue;  // --flagfile, --help, ...
    const std::string env = "MICROD_" + absl::AsciiStrToUpper(name);
    const char* value = std::getenv(env.c_str());
    if (value == nullptr) continue;
    std::string error;
    if (!flag->ParseFrom(value, &error)) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad value '", value, "' in ", env, ": ", error));
    }
  }
  return absl::OkStatus();
}

absl::Status ConfigureLog() {
  auto level = log::ParseLevel(absl::GetFlag(FLAGS_log_level));
  if (!level.ok()) return FlagError("--log_level", level.status());
  auto format = log::ParseFormat(absl::GetFlag(FLAGS_log_format));
  if (!format.ok()) return FlagError("--log_format", format.status());
  log::SetLevel(*level);
  log::SetFormat(*format);
  return absl::OkStatus();
}

absl::StatusOr<DaemonConfig> DaemonConfigFromFlags() {
  DaemonConfig c;
  RETURN_IF_ERROR(ReadSparsify(&c));
  c.job_id = absl::GetFlag(FLAGS_job_id);
  c.node_name = absl::GetFlag(FLAGS_node_name);
  c.node_rank = absl::GetFlag(FLAGS_node_rank);
  c.nodes = absl::GetFlag(FLAGS_nodes);
  c.min_nodes = absl::GetFlag(FLAGS_min_nodes);
  c.max_nodes = absl::GetFlag(FLAGS_max_nodes);
  c.elastic_timeout_s = absl::GetFlag(FLAGS_elastic_timeout_s);
  c.local_size = absl::GetFlag(FLAGS_local_size);
  c.coordinator = absl::GetFlag(FLAGS_coordinator);
  c.coordinator_listen = absl::GetFlag(FLAGS_coordinator_listen);
  c.coordinator_only = absl::GetFlag(FLAGS_coordinator_only);
  c.coordinator_port_file = absl::GetFlag(FLAGS_coordinator_port_file);
  c.socket = absl::GetFlag(FLAGS_socket);
  c.admin = absl::GetFlag(FLAGS_admin);
  c.admin_port_file = absl::GetFlag(FLAGS_admin_port_file);
  c.metrics = absl::GetFlag(FLAGS_metrics);
  c.metrics_port_file = absl::GetFlag(FLAGS_metrics_port_file);
  c.timeline = absl::GetFlag(FLAGS_timeline);
  c.timeline_steps = absl::GetFlag(FLAGS_timeline_steps);
  c.timeline_every = absl::GetFlag(FLAGS_timeline_every);
  c.timeline_flush_s = absl::GetFlag(FLAGS_timeline_flush_s);
  c.transport = absl::GetFlag(FLAGS_transport);
  c.cuda_device = absl::GetFlag(FLAGS_cuda_device);
  c.hostname = absl::GetFlag(FLAGS_hostname);
  c.gloo_io_nice = absl::GetFlag(FLAGS_gloo_io_nice);
  c.data_connections = absl::GetFlag(FLAGS_data_connections);
  c.seal = absl::GetFlag(FLAGS_seal);
  c.seal_failure = absl::GetFlag(FLAGS_seal_failure);
  c.link_model = absl::GetFlag(FLAGS_link_model);
  c.op_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_timeout_ms));
  c.peer_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_peer_timeout_ms));
  c.join_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_join_timeout_ms));
  c.hello_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_hello_timeout_ms));
  c.stall_warning_s = absl::GetFlag(FLAGS_stall_warning_s);
  c.stall_abort_s = absl::GetFlag(FLAGS_stall_abort_s);
  ASSIGN_OR_RETURN(c.token, ReadSecretFile("--token_file", absl::GetFlag(FLAGS_token_file)));
  ASSIGN_OR_RETURN(c.state_secret,
                   ReadSecretFile("--state_key_file", absl::GetFlag(FLAGS_state_key_file)));
  c.tls.cert = absl::GetFlag(FLAGS_tls_cert);
  c.tls.key = absl::GetFlag(FLAGS_tls_key);
  c.tls.ca = absl::GetFlag(FLAGS_tls_ca);
  c.tls.server_name = absl::GetFlag(FLAGS_tls_server_name);
  c.insecure = absl::GetFlag(FLAGS_insecure);
  c.allow_gid = absl::GetFlag(FLAGS_allow_gid);
  c.max_processes = absl::GetFlag(FLAGS_max_processes);
  c.max_buffers_per_process = absl::GetFlag(FLAGS_max_buffers_per_process);
  c.max_bytes_per_process = absl::GetFlag(FLAGS_max_bytes_per_process);
  c.max_state_bytes = absl::GetFlag(FLAGS_max_state_bytes);
  RETURN_IF_ERROR(c.Validate());
  return c;
}

}  // namespace microd
