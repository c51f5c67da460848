// SPDX-License-Identifier: Apache-2.0
// The job token as microd uses it: proved, never sent.
//
// The token is stretched once per process (scrypt, n = 2^15: about 0.1 s
// and 32 MiB, so that each guess at a weak token costs as much offline)
// into the job's secret; everything the token keys comes from that secret
// by HKDF, each with a label of its own:
// - the control plane's TLS when no certificate is given: an Ed25519 key
//   and a self-signed certificate that every node derives alike, which each
//   side presents and trusts alone (mutual TLS the job brings up by
//   itself). Whoever lacks the token cannot complete a handshake; a capture
//   of one holds neither the token nor the key (TLS 1.3 encrypts the
//   certificates, and its key exchange is ephemeral);
// - the join's proof of possession (HMAC over the job id and the node
//   name), which only ever travels inside TLS;
// - the data plane's keying material, which each epoch's salt (a secret the
//   coordinator hands out over that TLS) completes.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace microd::control {

// A TLS identity held in memory (PEM).
struct TlsIdentity {
  std::string key;
  std::string cert;
};
// The name the job's own certificate carries (and every client expects).
inline constexpr char kJobTlsName[] = "microd.job";

class JobToken {
 public:
  static absl::StatusOr<std::shared_ptr<const JobToken>> FromToken(absl::string_view token);

  // The proof a node joining job `job_id` as `node_name` sends.
  std::string JoinProof(absl::string_view job_id, absl::string_view node_name) const;
  // Whether `proof` is that proof (in constant time).
  bool Proves(absl::string_view proof, absl::string_view job_id, absl::string_view node_name) const;

  // The job's own TLS identity (key and certificate, PEM).
  const TlsIdentity& tls() const { return tls_; }

  // What the data plane's keys come from, with each epoch's salt.
  const std::string& data_plane_secret() const { return data_plane_; }

 private:
  JobToken() = default;

  std::string join_key_;
  std::string data_plane_;
  TlsIdentity tls_;
};

// A certificate names the job it was issued for with a URI subjectAltName
// kJobUriPrefix + job id. With mutual TLS and no job token the certificate
// is what admits a node, so it must name the job (the job id a client
// sends is only its word); a certificate that names other jobs only is
// refused whatever else the node proves.
inline constexpr char kJobUriPrefix[] = "microd://job/";
inline std::string JobUri(absl::string_view job_id) {
  return std::string(kJobUriPrefix) + std::string(job_id);
}

}  // namespace microd::control
