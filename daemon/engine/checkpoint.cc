// SPDX-License-Identifier: Apache-2.0
#include "daemon/engine/checkpoint.h"

#include <openssl/core_names.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>

#include <climits>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace microd::engine {
namespace {

constexpr char kMagic[8] = {'M', 'C', 'R', 'D', 'S', 'T', 'A', 'T'};
constexpr uint32_t kFormat = 2;
constexpr size_t kFrameBytes = sizeof kMagic + 4 + 8 + 4;
constexpr size_t kTagBytes = 32;  // HMAC-SHA256
constexpr uint32_t kUnkeyed = 0, kKeyed = 1;

template <typename T>
void Put(std::string* out, T v) {
  out->append(reinterpret_cast<const char*>(&v), sizeof v);
}

template <typename T>
T Get(const std::string& in, size_t at) {
  T v;
  std::memcpy(&v, in.data() + at, sizeof v);
  return v;
}

// HMAC-SHA256 of the concatenation of `parts` under `key` (OpenSSL).
std::string Hmac(std::string_view key, std::initializer_list<std::string_view> parts) {
  unsigned char out[EVP_MAX_MD_SIZE];
  size_t len = 0;
  EVP_MAC* mac = EVP_MAC_fetch(nullptr, "HMAC", nullptr);
  EVP_MAC_CTX* ctx = mac != nullptr ? EVP_MAC_CTX_new(mac) : nullptr;
  char digest[] = "SHA256";
  OSSL_PARAM params[] = {OSSL_PARAM_construct_utf8_string("digest", digest, 0),
                         OSSL_PARAM_construct_end()};
  // An empty key is a valid HMAC key; OpenSSL wants a non-null pointer for it.
  static const unsigned char kNone = 0;
  bool ok =
      ctx != nullptr &&
      EVP_MAC_init(ctx, key.empty() ? &kNone : reinterpret_cast<const unsigned char*>(key.data()),
                   key.size(), params) == 1;
  for (std::string_view p : parts) {
    ok = ok && EVP_MAC_update(ctx, reinterpret_cast<const unsigned char*>(p.data()), p.size()) == 1;
  }
  ok = ok && EVP_MAC_final(ctx, out, &len, sizeof out) == 1 && len == kTagBytes;
  EVP_MAC_CTX_free(ctx);
  EVP_MAC_free(mac);
  // Without a tag nothing verifies: an empty result matches no file.
  return ok ? std::string(reinterpret_cast<const char*>(out), len) : std::string();
}

std::string Floats(const std::vector<float>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(float));
}

absl::StatusOr<std::vector<float>> FloatsOf(const std::string& bytes, uint64_t count,
                                            const std::string& bucket, const char* what) {
  if (bytes.empty()) return std::vector<float>();
  if (bytes.size() != count * sizeof(float)) {
    return absl::DataLossError(absl::StrCat("bucket '", bucket, "': the ", what, " has ",
                                            bytes.size(), " bytes, not ", count * sizeof(float)));
  }
  std::vector<float> v(count);
  std::memcpy(v.data(), bytes.data(), bytes.size());
  return v;
}

}  // namespace

std::string CheckpointName(int rank) { return absl::StrCat("microd-state-node", rank, ".bin"); }

std::string DeriveStateKey(std::string_view secret) {
  if (secret.empty()) return "";
  return Hmac(secret, {"microd state file key, version 1"});
}

absl::Status WriteCheckpoint(int dirfd, const std::string& name, const std::string& what,
                             const microd::v1::NodeCheckpoint& c, const std::string& key,
                             FileOwner owner) {
  std::string payload;
  if (!c.SerializeToString(&payload)) return absl::InternalError("cannot encode the state");
  std::string frame(kMagic, sizeof kMagic);
  Put(&frame, kFormat);
  Put(&frame, static_cast<uint64_t>(payload.size()));
  Put(&frame, key.empty() ? kUnkeyed : kKeyed);
  const std::string tag = Hmac(key, {frame, payload});
  if (tag.size() != kTagBytes) return absl::InternalError("cannot compute the state's HMAC");
  return WriteFileAtomicallyAt(dirfd, name, {frame, payload, tag}, what, owner);
}

absl::StatusOr<microd::v1::NodeCheckpoint> ReadCheckpoint(int dirfd, const std::string& name,
                                                          const std::string& what,
                                                          uint64_t max_bytes,
                                                          const std::string& key) {
  auto read = ReadRegularFileAt(dirfd, name, max_bytes + kFrameBytes + kTagBytes, what);
  if (!read.ok()) {
    if (absl::IsNotFound(read.status())) {
      return absl::NotFoundError(absl::StrCat("no state file ", what));
    }
    if (absl::IsResourceExhausted(read.status())) {
      return absl::FailedPreconditionError(absl::StrCat(
          read.status().message(), ": this job's state is smaller; not a state file of it"));
    }
    return read.status();
  }
  const std::string& all = *read;
  if (all.size() < kFrameBytes + kTagBytes || std::memcmp(all.data(), kMagic, sizeof kMagic) != 0) {
    return absl::DataLossError(absl::StrCat(what, " is not a microd state file"));
  }
  const uint32_t format = Get<uint32_t>(all, 8);
  if (format != kFormat) {
    return absl::DataLossError(
        absl::StrCat(what, " has format ", format, "; this microd reads ", kFormat));
  }
  const uint64_t size = Get<uint64_t>(all, 12);
  const uint32_t keyed = Get<uint32_t>(all, 20);
  if (all.size() - kFrameBytes - kTagBytes != size) {
    return absl::DataLossError(absl::StrCat(what,
                                            " is torn: ", all.size() - kFrameBytes - kTagBytes,
                                            " bytes of state where the frame says ", size));
  }
  if (keyed != kUnkeyed && keyed != kKeyed) {
    return absl::DataLossError(absl::StrCat(what, " is not a microd state file (key ", keyed, ")"));
  }
  if (keyed == kUnkeyed && !key.empty()) {
    return absl::PermissionDeniedError(absl::StrCat(
        what,
        " was saved by a job without a secret (no --token_file or --state_key_file), so "
        "nothing says who wrote it; this job authenticates its state files and refuses it"));
  }
  if (keyed == kKeyed && key.empty()) {
    return absl::PermissionDeniedError(
        absl::StrCat(what,
                     " was saved by a job with a secret; give this job the same --token_file (or "
                     "--state_key_file) to load it"));
  }
  const std::string_view body(all.data(), kFrameBytes + size);
  const std::string want = Hmac(key, {body});
  if (want.size() != kTagBytes ||
      CRYPTO_memcmp(want.data(), all.data() + kFrameBytes + size, kTagBytes) != 0) {
    if (keyed == kUnkeyed) {
      return absl::DataLossError(absl::StrCat(what, " is corrupted: its checksum does not match"));
    }
    return absl::PermissionDeniedError(absl::StrCat(
        what,
        " is not authenticated by this job's key: another job's file (another token or "
        "--state_key_file), or altered since it was saved"));
  }
  microd::v1::NodeCheckpoint c;
  if (size > static_cast<uint64_t>(INT32_MAX) ||
      !c.ParseFromArray(all.data() + kFrameBytes, static_cast<int>(size))) {
    return absl::DataLossError(absl::StrCat(what, ": the state does not decode"));
  }
  return c;
}

absl::Status CheckSameShape(const microd::v1::NodeCheckpoint& saved,
                            const microd::v1::NodeCheckpoint& want, const std::string& path) {
  auto differs = [&](const std::string& what, const auto& was, const auto& now) {
    return absl::FailedPreconditionError(absl::StrCat("the state in ", path, " was saved with ",
                                                      what, " ", was, "; this job has ", now));
  };
  if (saved.job_id() != want.job_id()) return differs("job id", saved.job_id(), want.job_id());
  if (saved.node_count() != want.node_count()) {
    return differs("node count", saved.node_count(), want.node_count());
  }
  if (saved.node_rank() != want.node_rank()) {
    return differs("node rank", saved.node_rank(), want.node_rank());
  }
  if (saved.world_size() != want.world_size()) {
    return differs("world size", saved.world_size(), want.world_size());
  }
  if (saved.local_size() != want.local_size()) {
    return differs("local size", saved.local_size(), want.local_size());
  }
  for (const auto& [flag, value] : want.options()) {
    auto it = saved.options().find(flag);
    const std::string was = it == saved.options().end() ? "(none)" : it->second;
    if (was != value) return differs(flag, was, value);
  }
  return absl::OkStatus();
}

microd::v1::CheckpointBucket ToProto(const std::string& name, uint64_t count,
                                     const sparsify::BucketCheckpoint& c) {
  microd::v1::CheckpointBucket p;
  p.set_name(name);
  p.set_count(count);
  p.set_step(c.step);
  p.set_residual(Floats(c.residual));
  p.set_velocity(Floats(c.velocity));
  p.set_controller(c.controller);
  return p;
}

absl::StatusOr<sparsify::BucketCheckpoint> FromProto(const microd::v1::CheckpointBucket& p) {
  sparsify::BucketCheckpoint c;
  c.step = p.step();
  auto residual = FloatsOf(p.residual(), p.count(), p.name(), "residual");
  if (!residual.ok()) return residual.status();
  auto velocity = FloatsOf(p.velocity(), p.count(), p.name(), "velocity");
  if (!velocity.ok()) return velocity.status();
  c.residual = std::move(residual).value();
  c.velocity = std::move(velocity).value();
  c.controller = p.controller();
  return c;
}

}  // namespace microd::engine
