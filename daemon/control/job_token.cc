// SPDX-License-Identifier: Apache-2.0
#include "daemon/control/job_token.h"

#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <openssl/x509v3.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"
#include "daemon/common/crypto.h"

namespace microd::control {
namespace {

// scrypt's cost: 2^15 (32 MiB, about 0.1 s here).
constexpr uint64_t kStretchCost = uint64_t{1} << 15;

std::string Pem(BIO* bio) {
  char* data = nullptr;
  const long len = BIO_get_mem_data(bio, &data);
  return len > 0 ? std::string(data, static_cast<size_t>(len)) : std::string();
}

// The job's certificate: Ed25519 (its signatures are deterministic), every
// field fixed, so every node that holds the token makes the same bytes. It
// is its own issuer and the only root each side trusts.
absl::StatusOr<TlsIdentity> IdentityFrom(const std::string& seed) {
  EVP_PKEY* key = EVP_PKEY_new_raw_private_key(
      EVP_PKEY_ED25519, nullptr, reinterpret_cast<const unsigned char*>(seed.data()), seed.size());
  X509* x = X509_new();
  BIO* key_pem = BIO_new(BIO_s_mem());
  BIO* cert_pem = BIO_new(BIO_s_mem());
  bool ok = key != nullptr && x != nullptr && key_pem != nullptr && cert_pem != nullptr &&
            X509_set_version(x, 2) == 1 && ASN1_INTEGER_set(X509_get_serialNumber(x), 1) == 1 &&
            ASN1_TIME_set_string(X509_getm_notBefore(x), "20000101000000Z") == 1 &&
            ASN1_TIME_set_string(X509_getm_notAfter(x), "99991231235959Z") == 1 &&
            X509_set_pubkey(x, key) == 1;
  X509_NAME* name = ok ? X509_get_subject_name(x) : nullptr;
  ok = ok && name != nullptr &&
       X509_NAME_add_entry_by_txt(name, "CN", MBSTRING_ASC,
                                  reinterpret_cast<const unsigned char*>(kJobTlsName), -1, -1,
                                  0) == 1 &&
       X509_set_issuer_name(x, name) == 1;
  X509V3_CTX v3;
  X509V3_set_ctx_nodb(&v3);
  if (ok) X509V3_set_ctx(&v3, x, x, nullptr, nullptr, 0);
  const std::string san = absl::StrCat("DNS:", kJobTlsName);
  const std::pair<const char*, const char*> extensions[] = {
      {"basicConstraints", "critical,CA:TRUE"},
      {"keyUsage", "critical,digitalSignature,keyCertSign"},
      {"extendedKeyUsage", "serverAuth,clientAuth"},
      {"subjectAltName", san.c_str()},
      {"subjectKeyIdentifier", "hash"},
  };
  for (const auto& [ext_name, value] : extensions) {
    if (!ok) break;
    X509_EXTENSION* ext = X509V3_EXT_conf(nullptr, &v3, ext_name, value);
    ok = ext != nullptr && X509_add_ext(x, ext, -1) == 1;
    X509_EXTENSION_free(ext);
  }
  ok = ok && X509_sign(x, key, nullptr) > 0 &&
       PEM_write_bio_PrivateKey(key_pem, key, nullptr, nullptr, 0, nullptr, nullptr) == 1 &&
       PEM_write_bio_X509(cert_pem, x) == 1;
  TlsIdentity id;
  if (ok) {
    id.key = Pem(key_pem);
    id.cert = Pem(cert_pem);
  }
  BIO_free(cert_pem);
  BIO_free(key_pem);
  X509_free(x);
  EVP_PKEY_free(key);
  if (!ok || id.key.empty() || id.cert.empty()) {
    return absl::InternalError("job token: could not make the job's TLS identity (OpenSSL)");
  }
  return id;
}

}  // namespace

absl::StatusOr<std::shared_ptr<const JobToken>> JobToken::FromToken(absl::string_view token) {
  if (token.empty()) return absl::InvalidArgumentError("job token: empty");
  auto secret = crypto::Scrypt(token, "microd job token v1", kStretchCost);
  if (!secret.ok()) return secret.status();
  std::shared_ptr<JobToken> t(new JobToken());
  auto label = [&](const char* what) { return crypto::Hkdf(*secret, "", what); };
  auto join = label("microd join proof v1");
  auto data_plane = label("microd data plane v1");
  auto tls_seed = label("microd control tls ed25519 v1");
  for (const auto* s : {&join, &data_plane, &tls_seed}) {
    if (!s->ok()) return s->status();
  }
  t->join_key_ = *std::move(join);
  t->data_plane_ = *std::move(data_plane);
  auto id = IdentityFrom(*tls_seed);
  if (!id.ok()) return id.status();
  t->tls_ = *std::move(id);
  return std::shared_ptr<const JobToken>(std::move(t));
}

std::string JobToken::JoinProof(absl::string_view job_id, absl::string_view node_name) const {
  // Lengths first: no two (job, node) pairs share a message.
  auto mac = crypto::HmacSha256(
      join_key_, absl::StrCat(job_id.size(), ":", job_id, ":", node_name.size(), ":", node_name));
  return mac.ok() ? *std::move(mac) : std::string();
}

bool JobToken::Proves(absl::string_view proof, absl::string_view job_id,
                      absl::string_view node_name) const {
  const std::string want = JoinProof(job_id, node_name);
  return !want.empty() && crypto::SameBytes(proof, want);
}

}  // namespace microd::control
