// SPDX-License-Identifier: Apache-2.0
// The daemon's Unix sockets (the training processes' and Admin's): where
// they may live and who may connect. A socket file's mode says who may
// connect; its directory, who may replace it.
#pragma once

#include <string>

#include "absl/status/status.h"

namespace microd {

// Makes `path` ready to bind: its directory made (0700, parents 0755) when
// missing; a directory owned by another uid than the daemon's or root is
// refused (its owner could replace the socket with one of their own); a
// stale socket file removed, a live one (connect succeeds with `type`,
// e.g. SOCK_SEQPACKET or SOCK_STREAM) refused. `warning` (optional)
// receives a line to log when the directory is writable by others (they
// could replace the socket too; the client library checks who serves it).
absl::Status PrepareSocketPath(const std::string& path, int type, std::string* warning = nullptr);

// The socket file's access: the daemon's uid only (0600), or also group
// `allow_gid` (0660, the file's group set to it) when it is not negative.
absl::Status RestrictSocket(const std::string& path, int allow_gid);

// The umask under which a socket bound now gets RestrictSocket's mode (so
// that it is never more open, not even before RestrictSocket runs).
int SocketUmask(int allow_gid);

}  // namespace microd
