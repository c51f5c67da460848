#include "daemon/common/atomic_file.h"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "absl/strings/str_cat.h"

namespace microd {

absl::Status WriteFileAtomically(const std::string& path,
                                 std::initializer_list<std::string_view> parts) {
  const std::string tmp = absl::StrCat(path, ".tmp.", getpid());
  const int fd = open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) {
    return absl::PermissionDeniedError(
        absl::StrCat("cannot write ", tmp, ": ", std::strerror(errno)));
  }
  bool ok = true;
  for (std::string_view part : parts) {
    size_t at = 0;
    while (ok && at < part.size()) {
      const ssize_t n = write(fd, part.data() + at, part.size() - at);
      if (n < 0 && errno == EINTR) continue;
      ok = n > 0;
      if (ok) at += static_cast<size_t>(n);
    }
  }
  const int saved_errno = errno;
  ok = ok && fsync(fd) == 0;
  close(fd);
  if (!ok || rename(tmp.c_str(), path.c_str()) != 0) {
    const std::string why = std::strerror(ok ? errno : saved_errno);
    unlink(tmp.c_str());
    return absl::ResourceExhaustedError(absl::StrCat("cannot write ", path, ": ", why));
  }
  return absl::OkStatus();
}

}  // namespace microd
