// SPDX-License-Identifier: Apache-2.0
// A node's compression state on disk: microd_state_save writes one file per
// node, <dir>/microd-state-node<rank>.bin, and microd_state_load reads it.
// The file is a frame around a NodeCheckpoint (proto/microd/v1/
// checkpoint.proto):
//
//   "MCRDSTAT" | format (u32, 2) | payload bytes (u64) | key (u32) | payload | tag (32 bytes)
//
// The tag is HMAC-SHA256 of everything before it. Key 1: keyed with the
// job's state key (DeriveStateKey of --state_key_file or the job token), so
// that a file another job saved, or anyone altered, is refused; key 0: a
// job without a secret, keyed with nothing (a checksum: it catches damage,
// not forgery). Written atomically (atomic_file.h): a reader finds the old
// file or the new one; a file whose length or tag does not match is
// refused, never half-loaded.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "daemon/common/atomic_file.h"
#include "daemon/sparsify/bucket.h"
#include "microd/v1/checkpoint.pb.h"

namespace microd::engine {

// The file name of node `rank`'s state.
std::string CheckpointName(int rank);

// The key that authenticates state files, from the job's secret (32 bytes;
// empty for an empty secret: files are then checksummed, not authenticated).
std::string DeriveStateKey(std::string_view secret);

// Writes `c` as `name` in the directory open at `dirfd`; `what` names the
// file in messages.
absl::Status WriteCheckpoint(int dirfd, const std::string& name, const std::string& what,
                             const microd::v1::NodeCheckpoint& c, const std::string& key,
                             FileOwner owner = {});
// Reads what WriteCheckpoint wrote with the same `key`, refusing anything
// but a regular file of at most `max_bytes`.
absl::StatusOr<microd::v1::NodeCheckpoint> ReadCheckpoint(int dirfd, const std::string& name,
                                                          const std::string& what,
                                                          uint64_t max_bytes,
                                                          const std::string& key);

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
