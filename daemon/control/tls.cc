// SPDX-License-Identifier: Apache-2.0
#include "daemon/control/tls.h"

#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <grpcpp/support/channel_arguments.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>
#include <unistd.h>

#include <cstdio>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "daemon/control/address.h"

namespace microd::control {
namespace {

using grpc::experimental::FileWatcherCertificateProvider;

absl::Status Readable(const std::string& path, const char* flag) {
  if (path.empty() || access(path.c_str(), R_OK) == 0) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(flag, ": cannot read ", path));
}

std::shared_ptr<grpc::experimental::CertificateProviderInterface> Provider(const TlsFiles& f) {
  if (!f.files()) {
    // The job's own: its certificate is the only root, and the identity.
    return std::make_shared<grpc::experimental::StaticDataCertificateProvider>(
        f.job->cert,
        std::vector<grpc::experimental::IdentityKeyCertPair>{{f.job->key, f.job->cert}});
  }
  const auto refresh = static_cast<unsigned>(std::max<int64_t>(1, absl::ToInt64Seconds(f.refresh)));
  return std::make_shared<FileWatcherCertificateProvider>(f.key, f.cert, f.ca, refresh);
}

}  // namespace

absl::StatusOr<std::vector<std::string>> CertificateUris(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (f == nullptr) return absl::InvalidArgumentError(absl::StrCat("cannot read ", path));
  X509* cert = PEM_read_X509(f, nullptr, nullptr, nullptr);
  std::fclose(f);
  if (cert == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(path, " holds no PEM certificate"));
  }
  std::vector<std::string> uris;
  auto* names =
      static_cast<GENERAL_NAMES*>(X509_get_ext_d2i(cert, NID_subject_alt_name, nullptr, nullptr));
  for (int i = 0; names != nullptr && i < sk_GENERAL_NAME_num(names); ++i) {
    const GENERAL_NAME* name = sk_GENERAL_NAME_value(names, i);
    if (name->type != GEN_URI) continue;
    const ASN1_IA5STRING* uri = name->d.uniformResourceIdentifier;
    uris.emplace_back(reinterpret_cast<const char*>(ASN1_STRING_get0_data(uri)),
                      static_cast<size_t>(ASN1_STRING_length(uri)));
  }
  GENERAL_NAMES_free(names);
  X509_free(cert);
  return uris;
}

absl::Status CheckTlsFiles(const TlsFiles& f, bool server) {
  if (!f.files()) return absl::OkStatus();
  if (f.cert.empty() != f.key.empty()) {
    return absl::InvalidArgumentError("--tls_cert and --tls_key go together");
  }
  if (server && f.cert.empty()) {
    return absl::InvalidArgumentError(
        "a TLS server needs its certificate and key (--tls_cert, --tls_key)");
  }
  if (absl::Status s = Readable(f.cert, "--tls_cert"); !s.ok()) return s;
  if (absl::Status s = Readable(f.key, "--tls_key"); !s.ok()) return s;
  return Readable(f.ca, "--tls_ca");
}

std::shared_ptr<grpc::ServerCredentials> ServerCredentialsFor(const TlsFiles& f) {
  if (!f.enabled()) return grpc::InsecureServerCredentials();
  grpc::experimental::TlsServerCredentialsOptions o(Provider(f));
  o.watch_identity_key_cert_pairs();
  if (!f.ca.empty() || !f.files()) {
    o.watch_root_certs();
    o.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    o.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(o);
}

std::shared_ptr<grpc::ChannelCredentials> ChannelCredentialsFor(const TlsFiles& f) {
  if (!f.enabled()) return grpc::InsecureChannelCredentials();
  grpc::experimental::TlsChannelCredentialsOptions o;
  o.set_certificate_provider(Provider(f));
  if (!f.ca.empty() || !f.files()) o.watch_root_certs();  // else the system's roots
  if (!f.cert.empty() || !f.files()) o.watch_identity_key_cert_pairs();
  o.set_verify_server_certs(true);
  return grpc::experimental::TlsCredentials(o);
}

void AddTlsChannelArgs(const TlsFiles& f, grpc::ChannelArguments* args) {
  if (f.files() && !f.server_name.empty()) args->SetSslTargetNameOverride(f.server_name);
  if (!f.files() && f.job != nullptr) args->SetSslTargetNameOverride(kJobTlsName);
}

bool IsLocalOnly(const std::string& address) {
  if (absl::StartsWith(address, "unix:")) return true;
  auto hp = ParseHostPort(address);
  if (!hp.ok()) return false;
  return hp->host == "localhost" || IsLoopbackAddress(hp->host);
}

}  // namespace microd::control
