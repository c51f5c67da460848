// SPDX-License-Identifier: Apache-2.0
#include "daemon/common/unix_socket.h"

#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"

namespace microd {

absl::Status PrepareSocketPath(const std::string& path, int type, std::string* warning) {
  if (path.empty()) return absl::InvalidArgumentError("no socket path");
  if (path.size() >= sizeof(sockaddr_un::sun_path)) {
    return absl::InvalidArgumentError(absl::StrCat("socket path too long: ", path));
  }
  const std::string dir = path.find('/') == std::string::npos
                              ? "."
                              : (path.rfind('/') == 0 ? "/" : path.substr(0, path.rfind('/')));
  struct stat st;
  if (stat(dir.c_str(), &st) != 0) {
    // Missing parents are created like `mkdir -p`; the socket's own directory
    // is the daemon's, mode 0700.
    for (size_t pos = dir.find('/', 1); pos != std::string::npos; pos = dir.find('/', pos + 1)) {
      const std::string parent = dir.substr(0, pos);
      if (mkdir(parent.c_str(), 0755) != 0 && errno != EEXIST) {
        return absl::PermissionDeniedError(
            absl::StrCat("cannot create directory ", parent, ": ", std::strerror(errno)));
      }
    }
    if (mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
      return absl::PermissionDeniedError(
          absl::StrCat("cannot create socket directory ", dir, ": ", std::strerror(errno)));
    }
  } else if (!S_ISDIR(st.st_mode)) {
    return absl::InvalidArgumentError(absl::StrCat(dir, " is not a directory"));
  } else if (st.st_uid != geteuid() && st.st_uid != 0) {
    return absl::PermissionDeniedError(absl::StrCat(
        "the socket directory ", dir, " belongs to uid ", st.st_uid, ", not to this daemon (uid ",
        geteuid(), ") or root: its owner could replace the socket with one of their own"));
  } else if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0 && (st.st_mode & S_ISVTX) == 0 &&
             warning != nullptr) {
    *warning = absl::StrFormat(
        "the socket directory %s (mode %04o) is writable by others, who could replace %s with "
        "a socket of their own; the client library refuses a server of another uid than its "
        "own, root or $MICROD_DAEMON_UID",
        dir, st.st_mode & 07777, path);
  }
  if (lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return absl::AlreadyExistsError(absl::StrCat(path, " exists and is not a socket"));
    }
    // A socket file: a live daemon, or stale?
    const int probe = socket(AF_UNIX, type | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strcpy(addr.sun_path, path.c_str());
    const bool live =
        probe >= 0 && connect(probe, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
    if (probe >= 0) close(probe);
    if (live) return absl::AlreadyExistsError(absl::StrCat("another microd serves ", path));
    unlink(path.c_str());
  }
  return absl::OkStatus();
}

int SocketUmask(int allow_gid) { return allow_gid >= 0 ? 0117 : 0177; }

absl::Status RestrictSocket(const std::string& path, int allow_gid) {
  if (allow_gid >= 0 && chown(path.c_str(), -1, static_cast<gid_t>(allow_gid)) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("chown ", path, " to gid ", allow_gid, ": ", std::strerror(errno)));
  }
  if (chmod(path.c_str(), allow_gid >= 0 ? 0660 : 0600) != 0) {
    return absl::PermissionDeniedError(absl::StrCat("chmod ", path, ": ", std::strerror(errno)));
  }
  return absl::OkStatus();
}

}  // namespace microd
