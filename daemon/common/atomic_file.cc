// SPDX-License-Identifier: Apache-2.0
#include "daemon/common/atomic_file.h"

#include <fcntl.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "daemon/common/unique_fd.h"

namespace microd {
namespace {

// ".tmp." and 16 random hex digits: no other process can tell the name
// in advance (a planted link at it is refused by O_EXCL anyway).
std::string TemporaryName(const std::string& name) {
  uint64_t r = 0;
  if (getrandom(&r, sizeof r, 0) != static_cast<ssize_t>(sizeof r)) {
    r = static_cast<uint64_t>(getpid()) * 0x9E3779B97F4A7C15ull ^
        static_cast<uint64_t>(reinterpret_cast<uintptr_t>(&r));
  }
  return absl::StrFormat("%s.tmp.%016x", name, r);
}

bool WriteAll(int fd, std::string_view bytes) {
  size_t at = 0;
  while (at < bytes.size()) {
    const ssize_t n = write(fd, bytes.data() + at, bytes.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    at += static_cast<size_t>(n);
  }
  return true;
}

}  // namespace

absl::Status WriteFileAtomicallyAt(int dirfd, const std::string& name,
                                   std::initializer_list<std::string_view> parts,
                                   const std::string& what, FileOwner owner) {
  if (name.empty() || name.find('/') != std::string::npos) {
    return absl::InvalidArgumentError(absl::StrCat("'", name, "' is not a file name"));
  }
  std::string tmp;
  UniqueFd fd;
  for (int attempt = 0; attempt < 8 && !fd.valid(); ++attempt) {
    tmp = TemporaryName(name);
    fd.reset(
        openat(dirfd, tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0600));
    if (!fd.valid() && errno != EEXIST) break;
  }
  if (!fd.valid()) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot write ", what, ": ", std::strerror(errno)));
  }
  if ((owner.uid != static_cast<uid_t>(-1) || owner.gid != static_cast<gid_t>(-1)) &&
      geteuid() == 0 && fchown(fd.get(), owner.uid, owner.gid) != 0) {
    const std::string why = std::strerror(errno);
    unlinkat(dirfd, tmp.c_str(), 0);
    return absl::PermissionDeniedError(
        absl::StrCat("cannot give ", what, " to uid ", owner.uid, ": ", why));
  }
  bool ok = true;
  for (std::string_view part : parts) ok = ok && WriteAll(fd.get(), part);
  const int saved_errno = errno;
  ok = ok && fsync(fd.get()) == 0;
  fd.reset();
  if (!ok || renameat(dirfd, tmp.c_str(), dirfd, name.c_str()) != 0) {
    const std::string why = std::strerror(ok ? errno : saved_errno);
    unlinkat(dirfd, tmp.c_str(), 0);
    return absl::ResourceExhaustedError(absl::StrCat("cannot write ", what, ": ", why));
  }
  (void)fsync(dirfd);  // the rename itself (best effort: not every file system can)
  return absl::OkStatus();
}

absl::Status WriteFileAtomically(const std::string& path,
                                 std::initializer_list<std::string_view> parts) {
  const size_t slash = path.rfind('/');
  const std::string dir =
      slash == std::string::npos ? "." : (slash == 0 ? "/" : path.substr(0, slash));
  const std::string name = slash == std::string::npos ? path : path.substr(slash + 1);
  UniqueFd dirfd(open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (!dirfd.valid()) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot write ", path, ": ", dir, ": ", std::strerror(errno)));
  }
  return WriteFileAtomicallyAt(dirfd.get(), name, parts, path);
}

absl::StatusOr<std::string> ReadRegularFileAt(int dirfd, const std::string& name,
                                              uint64_t max_bytes, const std::string& what) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer.
  UniqueFd fd(openat(dirfd, name.c_str(), O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC));
  if (!fd.valid()) {
    if (errno == ENOENT) return absl::NotFoundError(absl::StrCat("no file ", what));
    if (errno == ELOOP) {
      return absl::FailedPreconditionError(absl::StrCat(what, " is a symbolic link: not followed"));
    }
    return absl::PermissionDeniedError(
        absl::StrCat("cannot read ", what, ": ", std::strerror(errno)));
  }
  struct stat st;
  if (fstat(fd.get(), &st) != 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot read ", what, ": ", std::strerror(errno)));
  }
  if (!S_ISREG(st.st_mode)) {
    return absl::FailedPreconditionError(absl::StrCat(what, " is not a regular file"));
  }
  if (static_cast<uint64_t>(st.st_size) > max_bytes) {
    return absl::ResourceExhaustedError(absl::StrCat(
        what, " has ", st.st_size, " bytes, more than the ", max_bytes, " it can hold"));
  }
  std::string bytes(static_cast<size_t>(st.st_size), '\0');
  size_t at = 0;
  while (at < bytes.size()) {
    const ssize_t n = read(fd.get(), bytes.data() + at, bytes.size() - at);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      return absl::DataLossError(absl::StrCat("cannot read ", what, ": ", std::strerror(errno)));
    }
    if (n == 0) break;  // shrunk since fstat: the caller's frame check says it is torn
    at += static_cast<size_t>(n);
  }
  char extra;
  if (at == bytes.size() && read(fd.get(), &extra, 1) > 0) {
    return absl::DataLossError(absl::StrCat(what, " grew while it was read"));
  }
  bytes.resize(at);
  return bytes;
}

}  // namespace microd
