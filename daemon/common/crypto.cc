// SPDX-License-Identifier: Apache-2.0
#include "daemon/common/crypto.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/kdf.h>
#include <sys/random.h>

#include <cerrno>
#include <cstring>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace microd::crypto {
namespace {

OSSL_PARAM Octets(const char* name, absl::string_view bytes) {
  return OSSL_PARAM_construct_octet_string(name, const_cast<char*>(bytes.data()), bytes.size());
}

// One derivation of OpenSSL's EVP_KDF `name` with `params`.
absl::StatusOr<std::string> Derive(const char* name, OSSL_PARAM* params, size_t bytes) {
  EVP_KDF* kdf = EVP_KDF_fetch(nullptr, name, nullptr);
  EVP_KDF_CTX* ctx = kdf != nullptr ? EVP_KDF_CTX_new(kdf) : nullptr;
  EVP_KDF_free(kdf);
  if (ctx == nullptr) return absl::InternalError(absl::StrCat("crypto: OpenSSL has no ", name));
  std::string out(bytes, '\0');
  const bool ok =
      EVP_KDF_derive(ctx, reinterpret_cast<unsigned char*>(out.data()), out.size(), params) == 1;
  EVP_KDF_CTX_free(ctx);
  if (!ok) return absl::InternalError(absl::StrCat("crypto: ", name, " failed"));
  return out;
}

}  // namespace

absl::StatusOr<std::string> Hkdf(absl::string_view key, absl::string_view salt,
                                 absl::string_view info, size_t bytes) {
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_KDF_PARAM_DIGEST, digest, 0),
                         Octets(OSSL_KDF_PARAM_KEY, key), Octets(OSSL_KDF_PARAM_SALT, salt),
                         Octets(OSSL_KDF_PARAM_INFO, info), OSSL_PARAM_construct_end()};
  return Derive("HKDF", params, bytes);
}

absl::StatusOr<std::string> Scrypt(absl::string_view secret, absl::string_view salt, uint64_t n,
                                   size_t bytes) {
  uint64_t cost = n;
  uint32_t r = 8, p = 1;
  // OpenSSL's default memory cap (32 MiB) is below what n = 2^15 needs.
  uint64_t max_mem = n * 128 * r * 2 + (uint64_t{1} << 20);
  OSSL_PARAM params[] = {Octets(OSSL_KDF_PARAM_PASSWORD, secret),
                         Octets(OSSL_KDF_PARAM_SALT, salt),
                         OSSL_PARAM_construct_uint64(OSSL_KDF_PARAM_SCRYPT_N, &cost),
                         OSSL_PARAM_construct_uint32(OSSL_KDF_PARAM_SCRYPT_R, &r),
                         OSSL_PARAM_construct_uint32(OSSL_KDF_PARAM_SCRYPT_P, &p),
                         OSSL_PARAM_construct_uint64(OSSL_KDF_PARAM_SCRYPT_MAXMEM, &max_mem),
                         OSSL_PARAM_construct_end()};
  return Derive("SCRYPT", params, bytes);
}

absl::StatusOr<std::string> HmacSha256(absl::string_view key, absl::string_view message) {
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  EVP_MAC_CTX* ctx = mac != nullptr ? EVP_MAC_CTX_new(mac) : nullptr;
  EVP_MAC_free(mac);
  if (ctx == nullptr) return absl::InternalError("crypto: OpenSSL has no HMAC");
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string(OSSL_MAC_PARAM_DIGEST, digest, 0),
                         OSSL_PARAM_construct_end()};
  // An empty key is a valid HMAC key; OpenSSL wants a non-null pointer for it.
  static const unsigned char kNone = 0;
  std::string out(32, '\0');
  size_t len = 0;
  const bool ok =
      EVP_MAC_init(ctx, key.empty() ? &kNone : reinterpret_cast<const unsigned char*>(key.data()),
                   key.size(), params) == 1 &&
      EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(message.data()), message.size()) ==
          1 &&
      EVP_MAC_final(ctx, reinterpret_cast<unsigned char*>(out.data()), &len, out.size()) == 1 &&
      len == out.size();
  EVP_MAC_CTX_free(ctx);
  if (!ok) return absl::InternalError("crypto: HMAC failed");
  return out;
}

absl::StatusOr<std::string> RandomBytes(size_t bytes) {
  std::string out(bytes, '\0');
  size_t got = 0;
  // Bounded: getrandom blocks only before the kernel's pool is seeded, and
  // returns short only when interrupted.
  for (int tries = 0; got < out.size() && tries < 100; ++tries) {
    const ssize_t n = getrandom(out.data() + got, out.size() - got, 0);
    if (n > 0) got += static_cast<size_t>(n);
  }
  if (got < out.size()) {
    return absl::InternalError(absl::StrCat("crypto: getrandom failed: ", strerror(errno)));
  }
  return out;
}

bool SameBytes(absl::string_view a, absl::string_view b) {
  if (a.size() != b.size()) return false;
  return a.empty() || CRYPTO_memcmp(a.data(), b.data(), a.size()) == 0;
}

}  // namespace microd::crypto
