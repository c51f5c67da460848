// SPDX-License-Identifier: Apache-2.0
// DaemonConfig's checks: each setting in its range, and where serving is
// allowed. Every error names the flag.
#include <algorithm>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"
#include "daemon/common/status_macros.h"
#include "daemon/control/address.h"
#include "daemon/control/coordinator.h"
#include "daemon/daemon.h"
#include "daemon/transport/link_model.h"
#include "microd/config.h"

namespace microd {

absl::Status FlagError(const std::string& what, const absl::Status& s) {
  return absl::Status(s.code(), absl::StrCat(what, ": ", s.ToString()));
}

// Whether serving on `address` is allowed: only this machine reaches it, or
// whoever connects is authenticated (mutual TLS: a CA the clients'
// certificates must chain to; for the coordinator also a job token), or
// --insecure says the network is trusted. TLS with a server certificate
// alone encrypts but lets anyone in.
absl::Status DaemonConfig::CheckExposure(const std::string& flag, const std::string& address,
                                         bool token_counts) const {
  const bool clients_authenticated = !tls.ca.empty() || (token_counts && !token.empty());
  if (control::IsLocalOnly(address) || clients_authenticated) return absl::OkStatus();
  const std::string tls_alone =
      tls.enabled() ? " (TLS with --tls_cert alone authenticates nobody who connects)" : "";
  if (insecure) {
    MICROD_LOG(Warning,
               "%s %s is reachable from the network without client "
               "authentication%s (--insecure)%s",
               flag.c_str(), address.c_str(), token_counts ? " or a job token" : "",
               tls_alone.c_str());
    return absl::OkStatus();
  }
  return FlagError(
      flag, absl::FailedPreconditionError(absl::StrCat(
                "refusing to serve on ", address,
                ", which other hosts reach, without authenticating who connects", tls_alone,
                ": anyone who reaches it could ",
                token_counts ? "join the job, read its state or end it" : "read the job's state",
                ". Give --tls_ca (mutual TLS: every client presents a certificate it "
                "signed) with --tls_cert and --tls_key",
                token_counts ? ", or --token_file" : "",
                ", listen on loopback, or pass --insecure on a trusted network")));
}

bool DaemonConfig::SealsDataPlane() const {
  if (seal == "on") return true;
  if (seal == "off") return false;
  return transport != "nccl" && (tls.enabled() || !token.empty());
}

absl::Status DaemonConfig::Validate() const {
  if (transport != "gloo" && !(MICROD_HAVE_NCCL && transport == "nccl")) {
    return FlagError(
        "--transport",
        absl::UnimplementedError(absl::StrCat(
            "'", transport, "' is not available in this build (",
            MICROD_HAVE_NCCL ? "gloo or nccl" : "gloo; nccl needs a CUDA build", ")")));
  }
  if (absl::Status s = sparsify.Validate(); !s.ok()) return FlagError("options", s);
  RETURN_IF_ERROR(ValidateShape());
  RETURN_IF_ERROR(ValidateSecurity());
  if (wire_bucket_dtype && transport == "nccl") {
    return FlagError(
        "--wire_dtype",
        absl::InvalidArgumentError("bucket needs --transport=gloo (NCCL takes fp32 buckets)"));
  }
  if (elastic() && transport == "nccl") {
    return FlagError(
        max_nodes > nodes ? "--max_nodes" : "--min_nodes",
        absl::UnimplementedError("elastic membership needs --transport=gloo for now (a new "
                                 "NCCL communicator per epoch is not built yet)"));
  }
  if (cuda_device < 0)
    return FlagError("--cuda_device", absl::InvalidArgumentError("must be >= 0"));
  if (cycle_floats > (uint64_t{1} << 20)) {
    return FlagError("--cycle_floats", absl::InvalidArgumentError("must be at most 1048576"));
  }
  if (data_connections < 0 || data_connections > 16) {
    return FlagError("--data_connections", absl::InvalidArgumentError(absl::StrCat(
                                               "must be in [0, 16], not ", data_connections)));
  }
  if (!link_model.empty()) {
    if (auto m = transport::ParseLinkModel(link_model); !m.ok())
      return FlagError("--link_model", m.status());
  }
  if (gloo_io_nice < 0 || gloo_io_nice > 19) {
    return FlagError("--gloo_io_nice", absl::InvalidArgumentError(
                                           absl::StrCat("must be in [0, 19], not ", gloo_io_nice)));
  }
  if (op_timeout <= absl::ZeroDuration() || peer_timeout <= absl::ZeroDuration() ||
      hello_timeout <= absl::ZeroDuration() || join_timeout <= absl::ZeroDuration()) {
    return FlagError("timeouts", absl::InvalidArgumentError("timeouts must be positive"));
  }
  if (stall_warning_s < 1 || stall_abort_s < 0) {
    return FlagError("--stall_warning_s",
                     absl::InvalidArgumentError("--stall_warning_s must be at least 1 and "
                                                "--stall_abort_s at least 0"));
  }
  if (timeline_steps < 1 || timeline_steps > 100000000 || timeline_every < 1 ||
      !(timeline_flush_s > 0)) {
    return FlagError("--timeline_steps", absl::InvalidArgumentError(
                                             "--timeline_steps must be in [1, 100000000], "
                                             "--timeline_every at least 1 and --timeline_flush_s "
                                             "positive"));
  }
  if (coordinator_only && (coordinator_listen.empty() || !coordinator.empty())) {
    return FlagError(
        "--coordinator_only",
        absl::InvalidArgumentError(
            "serves the coordinator: give --coordinator_listen, and no --coordinator"));
  }
  if (max_processes < 1 || max_buffers_per_process < 1) {
    return FlagError("limits",
                     absl::InvalidArgumentError(
                         "--max_processes and --max_buffers_per_process must be at least 1"));
  }
  return absl::OkStatus();
}

absl::Status DaemonConfig::ValidateShape() const {
  if (local_size < 1 || local_size > control::kMaxLocalSize) {
    return FlagError("--local_size", absl::InvalidArgumentError(absl::StrCat(
                                         "must be in [1, ", control::kMaxLocalSize, "]")));
  }
  if (nodes < 1) return FlagError("--nodes", absl::InvalidArgumentError("must be at least 1"));
  if (min_nodes < 0 || min_nodes > nodes) {
    return FlagError("--min_nodes", absl::InvalidArgumentError(absl::StrCat(
                                        "must be in [0, --nodes=", nodes, "], not ", min_nodes)));
  }
  if (elastic_timeout_s < 0 || elastic_timeout_s > 86400) {
    return FlagError("--elastic_timeout_s", absl::InvalidArgumentError(absl::StrCat(
                                                "must be in [0, 86400], not ", elastic_timeout_s)));
  }
  if (max_nodes != 0 && (max_nodes < nodes || max_nodes > control::kMaxNodes)) {
    return FlagError("--max_nodes", absl::InvalidArgumentError(
                                        absl::StrCat("must be 0 or in [--nodes=", nodes, ", ",
                                                     control::kMaxNodes, "], not ", max_nodes)));
  }
  return absl::OkStatus();
}

absl::Status DaemonConfig::ValidateSecurity() const {
  if (seal != "auto" && seal != "on" && seal != "off") {
    return FlagError("--seal", absl::InvalidArgumentError(
                                   absl::StrCat("must be auto, on or off, not '", seal, "'")));
  }
  if (seal == "on" && transport == "nccl") {
    return FlagError("--seal",
                     absl::UnimplementedError(
                         "the NCCL data plane cannot be sealed (its transfers run on the GPU "
                         "and NCCL has no cipher): use --transport=gloo, or --seal=off"));
  }
  if (seal == "on" && !tls.enabled() && token.empty()) {
    return FlagError("--seal", absl::InvalidArgumentError(
                                   "needs a secret to key the data plane from: TLS on the control "
                                   "plane (--tls_ca, --tls_cert, --tls_key) or a job token "
                                   "(--token_file)"));
  }
  if (seal_failure != "job" && seal_failure != "step") {
    return FlagError("--seal_failure", absl::InvalidArgumentError(absl::StrCat(
                                           "must be job or step, not '", seal_failure, "'")));
  }
  if (seal_failure == "step" && (!elastic() || !SealsDataPlane())) {
    return FlagError(
        "--seal_failure",
        absl::InvalidArgumentError(
            "step needs an elastic job (--min_nodes: its processes take the failed step "
            "again in the next epoch) with a sealed data plane (--seal)"));
  }
  if (absl::Status s = control::CheckTlsFiles(tls, /*server=*/!coordinator_listen.empty());
      !s.ok()) {
    return FlagError("TLS", s);
  }
  if (!tls.cert.empty() && !tls.ca.empty() && token.empty()) {
    // Mutual TLS alone admits the nodes: the certificate must say which job
    // (any certificate of a CA shared by several jobs would join them all).
    auto uris = control::CertificateUris(tls.cert);
    if (!uris.ok()) return FlagError("--tls_cert", uris.status());
    if (std::find(uris->begin(), uris->end(), control::JobUri(job_id)) == uris->end()) {
      return FlagError(
          "--tls_cert",
          absl::InvalidArgumentError(absl::StrCat(
              tls.cert, " does not name job '", job_id,
              "': with mutual TLS and no job token, every node's certificate must name "
              "the job (a URI subjectAltName ",
              control::JobUri(job_id), "), or give the job a token (--token_file)")));
    }
  }
  return absl::OkStatus();
}

}  // namespace microd
