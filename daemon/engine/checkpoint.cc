#include "daemon/engine/checkpoint.h"

#include <zlib.h>

#include <cstring>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "daemon/common/atomic_file.h"

namespace microd::engine {
namespace {

constexpr char kMagic[8] = {'M', 'C', 'R', 'D', 'S', 'T', 'A', 'T'};
constexpr uint32_t kFormat = 1;
constexpr size_t kFrameBytes = sizeof kMagic + 4 + 8 + 4;

uint32_t Crc(const std::string& bytes) {
  uLong crc = crc32(0L, Z_NULL, 0);
  size_t at = 0;
  while (at < bytes.size()) {  // crc32 takes at most 4 GiB - 1 at a time
    const uInt n = static_cast<uInt>(std::min<size_t>(bytes.size() - at, 1u << 30));
    crc = crc32(crc, reinterpret_cast<const Bytef*>(bytes.data() + at), n);
    at += n;
  }
  return static_cast<uint32_t>(crc);
}

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

std::string CheckpointPath(const std::string& dir, int rank) {
  return absl::StrCat(dir, "/microd-state-node", rank, ".bin");
}

absl::Status WriteCheckpoint(const std::string& path, const microd::v1::NodeCheckpoint& c) {
  std::string payload;
  if (!c.SerializeToString(&payload)) return absl::InternalError("cannot encode the state");
  std::string frame(kMagic, sizeof kMagic);
  Put(&frame, kFormat);
  Put(&frame, static_cast<uint64_t>(payload.size()));
  Put(&frame, Crc(payload));
  return WriteFileAtomically(path, {frame, payload});
}

absl::StatusOr<microd::v1::NodeCheckpoint> ReadCheckpoint(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("no state file ", path));
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string all = ss.str();
  if (all.size() < kFrameBytes || std::memcmp(all.data(), kMagic, sizeof kMagic) != 0) {
    return absl::DataLossError(absl::StrCat(path, " is not a microd state file"));
  }
  const uint32_t format = Get<uint32_t>(all, 8);
  if (format != kFormat) {
    return absl::DataLossError(absl::StrCat(path, " has format ", format, "; this microd reads ",
                                            kFormat));
  }
  const uint64_t size = Get<uint64_t>(all, 12);
  const uint32_t crc = Get<uint32_t>(all, 20);
  if (all.size() - kFrameBytes != size) {
    return absl::DataLossError(absl::StrCat(path, " is torn: ", all.size() - kFrameBytes,
                                            " bytes of state where the frame says ", size));
  }
  const std::string payload = all.substr(kFrameBytes);
  if (Crc(payload) != crc) {
    return absl::DataLossError(absl::StrCat(path, " is corrupted: its checksum does not match"));
  }
  microd::v1::NodeCheckpoint c;
  if (!c.ParseFromString(payload)) {
    return absl::DataLossError(absl::StrCat(path, ": the state does not decode"));
  }
  return c;
}

absl::Status CheckSameShape(const microd::v1::NodeCheckpoint& saved,
                            const microd::v1::NodeCheckpoint& want, const std::string& path) {
  auto differs = [&](const std::string& what, const auto& was, const auto& now) {
    return absl::FailedPreconditionError(absl::StrCat(
        "the state in ", path, " was saved with ", what, " ", was, "; this job has ", now));
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
