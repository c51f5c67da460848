// SPDX-License-Identifier: Apache-2.0
// The few cryptographic primitives microd builds on, over OpenSSL 3: HKDF
// and HMAC with SHA-256, scrypt, random bytes and a comparison whose time
// does not depend on where two strings differ. Nothing here logs a key.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace microd::crypto {

// HKDF-SHA256 (RFC 5869) of `key` with `salt` and `info`: `bytes` bytes.
absl::StatusOr<std::string> Hkdf(absl::string_view key, absl::string_view salt,
                                 absl::string_view info, size_t bytes = 32);

// HMAC-SHA256 of `message` under `key` (32 bytes).
absl::StatusOr<std::string> HmacSha256(absl::string_view key, absl::string_view message);

// scrypt (RFC 7914) of `secret` with `salt`, cost `n` (a power of two), r = 8,
// p = 1: `bytes` bytes. Memory: 1 KiB x n.
absl::StatusOr<std::string> Scrypt(absl::string_view secret, absl::string_view salt, uint64_t n,
                                   size_t bytes = 32);

// `bytes` bytes from the kernel's random source (getrandom).
absl::StatusOr<std::string> RandomBytes(size_t bytes);

// Whether `a` and `b` are equal, in a time that depends only on their lengths.
bool SameBytes(absl::string_view a, absl::string_view b);

}  // namespace microd::crypto
