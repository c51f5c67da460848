// SPDX-License-Identifier: Apache-2.0
// Files the daemon writes and reads where someone else may have put things:
// written whole or not at all (a temporary file of an unpredictable name,
// made with O_EXCL|O_NOFOLLOW beside the target, flushed and renamed into
// place: a symbolic link planted at any name is replaced, never followed),
// and read only from a regular file, without following a link or blocking
// on a FIFO, up to a size the caller gives.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace microd {

// Who a new file should belong to (applied where the daemon may change
// owners, i.e. runs as root); -1: the daemon's own.
struct FileOwner {
  uid_t uid = static_cast<uid_t>(-1);
  gid_t gid = static_cast<gid_t>(-1);
};

// Writes the concatenation of `parts` to `name` in the directory open at
// `dirfd` (mode 0600). PermissionDenied when the temporary file cannot be
// made, ResourceExhausted when writing, flushing or renaming fails; the
// temporary file is removed on failure. `what`: the target's name in
// messages (e.g. its path).
absl::Status WriteFileAtomicallyAt(int dirfd, const std::string& name,
                                   std::initializer_list<std::string_view> parts,
                                   const std::string& what, FileOwner owner = {});

// The same for a path (its directory opened first).
absl::Status WriteFileAtomically(const std::string& path,
                                 std::initializer_list<std::string_view> parts);

// The bytes of the regular file `name` in the directory open at `dirfd`,
// at most `max_bytes` of them. NotFound when there is none; FailedPrecondition
// for a symbolic link, a FIFO, a device or a directory (never opened for
// reading, never waited on); ResourceExhausted past `max_bytes` (before
// anything is read).
absl::StatusOr<std::string> ReadRegularFileAt(int dirfd, const std::string& name,
                                              uint64_t max_bytes, const std::string& what);

}  // namespace microd
