// SPDX-License-Identifier: Apache-2.0
// Transport security of the control plane (the coordinator and Admin
// services): TLS, and mutual TLS when a CA is given. Certificates are read
// from files and read again when they change (gRPC's file-watcher provider:
// a rotation needs no restart). Without files, the coordinator's TLS may be
// the job's own (job_token.h): one identity, derived from the job token,
// that each side presents and trusts alone.
//
// Server: --tls_cert and --tls_key (PEM) are its identity; with --tls_ca,
// every client must present a certificate signed by that CA.
// Client: --tls_ca verifies the server's certificate (which must name the
// address dialed, or --tls_server_name); --tls_cert/--tls_key, when given,
// are the client's certificate for mutual TLS.
#pragma once

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/control/job_token.h"

namespace microd::control {

struct TlsFiles {
  std::string cert;  // PEM certificate chain
  std::string key;   // PEM private key
  std::string ca;    // PEM CA bundle
  // The name the server's certificate must carry (default: the host dialed).
  std::string server_name;
  // How often the files are checked for a change.
  absl::Duration refresh = absl::Seconds(2);

  // The job's own TLS (no file given): this identity presented and
  // trusted alone, client certificates required.
  std::shared_ptr<const TlsIdentity> job;

  bool files() const { return !cert.empty() || !key.empty() || !ca.empty(); }
  bool enabled() const { return files() || job != nullptr; }
  bool mutual() const { return (!ca.empty() && !cert.empty()) || (!files() && job != nullptr); }
};

// The files exist and are readable, cert and key go together, and a server
// has its identity; an error naming the flag otherwise.
absl::Status CheckTlsFiles(const TlsFiles& files, bool server);

// TLS server credentials (client certificates required with a CA), or
// plaintext when no file is given.
std::shared_ptr<grpc::ServerCredentials> ServerCredentialsFor(const TlsFiles& files);

// TLS channel credentials, or plaintext when no file is given.
std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsFor(const TlsFiles& files);

// Channel arguments for `files` (the server name override), added to `args`.
void AddTlsChannelArgs(const TlsFiles& files, grpc::ChannelArguments* args);

// The URI subjectAltNames of the first certificate of PEM file `path`
// (where a certificate names its job: job_token.h, JobUri).
absl::StatusOr<std::vector<std::string>> CertificateUris(const std::string& path);

// Whether `address` ("host:port", "unix:PATH") can be reached only from
// this machine: loopback or a Unix socket. A wildcard or another address is
// reachable from the network.
bool IsLocalOnly(const std::string& address);

}  // namespace microd::control
