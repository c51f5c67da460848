// A node's compression state on disk: microd_state_save writes one file per
// node, <dir>/microd-state-node<rank>.bin, and microd_state_load reads it.
// The file is a frame around a NodeCheckpoint (proto/microd/v1/
// checkpoint.proto):
//
//   "MCRDSTAT" | format (u32) | payload bytes (u64) | CRC-32 of the payload (u32) | payload
//
// written to a temporary file, flushed and renamed into place, so that a
// reader finds the old file or the new one, never a torn one; a file whose
// length or checksum does not match is refused, never half-loaded.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/sparsify/bucket.h"
#include "microd/v1/checkpoint.pb.h"

namespace microd::engine {

// The file of node `rank` in `dir`.
std::string CheckpointPath(const std::string& dir, int rank);

absl::Status WriteCheckpoint(const std::string& path, const microd::v1::NodeCheckpoint& c);
absl::StatusOr<microd::v1::NodeCheckpoint> ReadCheckpoint(const std::string& path);

// What a job must share with the saved one to load it: every field of
// `want`'s shape (job id, node rank and count, world and local size, the
// options) equal in `saved`; an error naming the first that differs.
absl::Status CheckSameShape(const microd::v1::NodeCheckpoint& saved,
                            const microd::v1::NodeCheckpoint& want, const std::string& path);

microd::v1::CheckpointBucket ToProto(const std::string& name, uint64_t count,
                                     const sparsify::BucketCheckpoint& c);
// The state of bucket `p`, checked against `count` elements.
absl::StatusOr<sparsify::BucketCheckpoint> FromProto(const microd::v1::CheckpointBucket& p);

}  // namespace microd::engine
