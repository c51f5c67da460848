// SPDX-License-Identifier: Apache-2.0
// One node's daemon as a library: everything `microd` runs, built from a
// DaemonConfig instead of the command line, so that a test (or an embedding
// program) can start several nodes in one process. microd_main.cc maps the
// flags onto a DaemonConfig (daemon/flags.h) and runs one Daemon.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/control/tls.h"
#include "daemon/sparsify/options.h"

namespace microd {

// Every setting of a daemon, with the flags' defaults. The flag of each
// field is its name with a leading "--" (durations: `_ms` or `_s`).
struct DaemonConfig {
  // The job and this node.
  std::string job_id = "microd";
  std::string node_name;  // "": the host name
  int node_rank = -1;     // -1: any free one
  int nodes = 1;          // used by the coordinator
  // Elastic membership: while at least this many nodes remain, the job goes
  // on without a lost node (0, or `nodes`: not elastic).
  int min_nodes = 0;
  // ...and while fewer than this many take part, a node may join the
  // running job (0: --nodes).
  int max_nodes = 0;
  // Below min_nodes, how long the job waits for nodes to join (0: it fails).
  int elastic_timeout_s = 600;
  // Serve the coordinator (and the Admin service) only: no training, no
  // data plane; every training node dials it (--coordinator).
  bool coordinator_only = false;
  bool elastic() const { return (min_nodes > 0 && min_nodes < nodes) || max_nodes > nodes; }
  int local_size = 1;
  std::string coordinator;         // host:port of the coordinator
  std::string coordinator_listen;  // serve the coordinator here (node 0)
  std::string coordinator_port_file;

  // Where the daemon serves.
  std::string socket = "/run/microd/microd.sock";
  std::string admin = "unix:/run/microd/admin.sock";
  std::string admin_port_file;
  std::string metrics;  // "": off
  std::string metrics_port_file;
  std::string timeline;  // "": no file
  uint64_t timeline_steps = 10000;
  uint64_t timeline_every = 1;
  double timeline_flush_s = 5;

  // The data plane.
  std::string transport = "gloo";  // or nccl (CUDA builds)
  // Sealed transfers between daemons: "auto" (on where the control plane
  // has TLS or a job token to key them from), "on", "off".
  std::string seal = "auto";
  // A sealed transfer that fails verification fails the job ("job"), or
  // the step on every node ("step": elastic jobs; the next epoch has the
  // same members, fresh keys and connections).
  std::string seal_failure = "job";
  int cuda_device = 0;
  std::string hostname;  // "": chosen (control::ChooseDataPlaneAddress)
  int gloo_io_nice = 0;
  int data_connections = 0;  // 0: chosen from the links
  std::string link_model;    // "": measured at start (transport::ParseLinkModel)

  // The algorithm. `sparsify` as the flags give it; Daemon::Create applies
  // `remedies` to it.
  sparsify::SparsifyOptions sparsify;
  sparsify::RemedySet remedies;
  bool skip_nonfinite = false;     // --nonfinite=skip
  bool wire_bucket_dtype = false;  // --wire_dtype=bucket
  uint64_t stats_history = 1024;
  bool response_cache = true;
  uint64_t cycle_floats = 4096;
  uint64_t dense_floor = 65536;

  // Deadlines.
  absl::Duration op_timeout = absl::Seconds(60);
  absl::Duration peer_timeout = absl::Seconds(10);
  absl::Duration join_timeout = absl::Minutes(5);
  absl::Duration hello_timeout = absl::Seconds(10);
  int stall_warning_s = 60;
  int stall_abort_s = 0;

  // Security: the secrets themselves (the flags name files holding them).
  std::string token;
  std::string state_secret;  // "": the token
  control::TlsFiles tls;
  bool insecure = false;
  int allow_gid = -1;

  // Limits.
  int max_processes = 256;
  int max_buffers_per_process = 4096;
  uint64_t max_bytes_per_process = 0;  // 0: the memory budget
  uint64_t max_state_bytes = 0;        // 0: derived from the memory limit

  // Each setting in its range; the error names the flag.
  absl::Status Validate() const;
  // Validate's parts: the job's shape (nodes, processes, elastic bounds),
  // and its security (--seal, --seal_failure, TLS and the certificate).
  absl::Status ValidateShape() const;
  absl::Status ValidateSecurity() const;
  // Whether this node seals its data plane (--seal, resolved).
  bool SealsDataPlane() const;
  // Whether serving on `address` (the flag `flag`) is allowed: only this
  // machine reaches it, or whoever connects is authenticated (mutual TLS;
  // a job token where `token_counts`), or --insecure (a warning then).
  absl::Status CheckExposure(const std::string& flag, const std::string& address,
                             bool token_counts) const;
};

// An error as main prints it: "<what>: <status>".
absl::Status FlagError(const std::string& what, const absl::Status& s);

class DaemonImpl;

// One node's daemon: the coordinator (node 0), the Admin service, the
// membership in the job, the data plane, the engine and the local socket.
// Start brings them up in that order; Stop (or destruction) takes them down
// in the reverse one.
class Daemon {
 public:
  // Checks the configuration and fills in what it leaves to the daemon (the
  // node name, the remedies, the memory budget). Starts nothing.
  static absl::StatusOr<std::unique_ptr<Daemon>> Create(DaemonConfig config);
  ~Daemon();
  Daemon(const Daemon&) = delete;
  Daemon& operator=(const Daemon&) = delete;

  // Serves the coordinator (node 0) and the Admin service, joins the job
  // (waiting up to join_timeout for the other nodes), connects the data
  // plane and serves the local socket. `serving` is called once the engine
  // runs, before the socket opens. Errors read "<what>: <status>".
  absl::Status Start(const std::function<void()>& serving = nullptr);
  // The orderly shutdown: no new work, the steps in flight end, the node
  // leaves the job. `why` goes to the log. Idempotent.
  void Stop(const std::string& why);

  // The configuration after Create (remedies applied, defaults filled in).
  const DaemonConfig& config() const;
  // What --remedies and the flags apply, one line each.
  const std::vector<std::string>& remedies() const;
  // The ports bound (after Start; 0 for what is not served).
  int coordinator_port() const;
  int admin_port() const;
  int metrics_port() const;
  // This node's rank in the job (after Start; -1 before).
  int node_rank() const;

 private:
  explicit Daemon(std::unique_ptr<DaemonImpl> impl);
  std::unique_ptr<DaemonImpl> impl_;
};

}  // namespace microd
