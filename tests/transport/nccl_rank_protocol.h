// SPDX-License-Identifier: Apache-2.0
// The NCCL contract test runs each rank in its own process (NCCL refuses two
// ranks of one communicator on one GPU in one process or host): the test
// holds a proxy Transport per rank that forwards every call over a socket to
// a worker process (nccl_rank_worker.cc) running the real NCCL transport.
// This is the little wire format between them, and a file-based
// KeyValueStore through which the workers exchange the ncclUniqueId.
#pragma once

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "absl/time/time.h"
#include "daemon/rendezvous/kv_store.h"

namespace microd::transport::testing {

// Inherited descriptors of a worker: requests/responses, and aborts.
constexpr int kWorkerCallFd = 3;
constexpr int kWorkerAbortFd = 4;

enum class WorkerOp : uint32_t {
  kReady = 0,  // response only: the transport was created (or not)
  kAllgather = 1,
  kAllgatherV = 2,
  kAllreduce = 3,
  kBarrier = 4,
  kExit = 5,
};

constexpr uint32_t kNullIn = 1;       // pass nullptr as the input buffer
constexpr uint32_t kNullOut = 2;      // pass nullptr as the output buffer
constexpr uint32_t kShapeAgreed = 4;  // CollectiveOptions::shape_agreed

struct WorkerRequest {
  uint32_t op = 0;
  uint32_t tag = 0;
  int64_t deadline_unix_ns = 0;  // INT64_MAX: infinite
  uint64_t a = 0;                // bytes (Allgather) or count (AllreduceSum)
  uint32_t type = 0;             // DataType of AllreduceSum
  uint32_t flags = 0;            // kNullIn | kNullOut | kShapeAgreed
  uint64_t num_sizes = 0;        // AllgatherV: recv_bytes entries that follow
  uint64_t payload_bytes = 0;    // input bytes that follow the sizes
};

struct WorkerResponse {
  int32_t code = 0;  // absl::StatusCode
  uint32_t message_bytes = 0;
  uint64_t payload_bytes = 0;  // output bytes after the message
  uint64_t host_waits = 0;     // the worker's Transport::host_waits() after the call
};

inline bool WriteAll(int fd, const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::write(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

inline bool ReadAll(int fd, void* data, size_t bytes) {
  char* p = static_cast<char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::read(fd, p, bytes);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
  }
  return true;
}

inline int64_t ToWireDeadline(absl::Time t) {
  return t == absl::InfiniteFuture() ? INT64_MAX : absl::ToUnixNanos(t);
}
inline absl::Time FromWireDeadline(int64_t ns) {
  return ns == INT64_MAX ? absl::InfiniteFuture() : absl::FromUnixNanos(ns);
}

inline bool WriteResponse(int fd, const absl::Status& s, const void* payload, size_t bytes,
                          uint64_t host_waits = 0) {
  WorkerResponse r;
  r.code = static_cast<int32_t>(s.code());
  r.host_waits = host_waits;
  const std::string msg(s.message());
  r.message_bytes = static_cast<uint32_t>(msg.size());
  r.payload_bytes = bytes;
  return WriteAll(fd, &r, sizeof r) && WriteAll(fd, msg.data(), msg.size()) &&
         (bytes == 0 || WriteAll(fd, payload, bytes));
}

// Keys are files in one directory; Get polls until they exist.
class FileKeyValueStore final : public rendezvous::KeyValueStore {
 public:
  explicit FileKeyValueStore(std::string dir) : dir_(std::move(dir)) {}

  absl::Status Set(const std::string& key, const std::string& value) override {
    const std::string path = Path(key);
    const std::string tmp = path + ".tmp";
    FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) return absl::UnavailableError(absl::StrCat("cannot write ", tmp));
    const bool ok = std::fwrite(value.data(), 1, value.size(), f) == value.size();
    if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
      return absl::UnavailableError(absl::StrCat("cannot write ", path));
    }
    return absl::OkStatus();
  }

  absl::StatusOr<std::vector<std::string>> Get(absl::Span<const std::string> keys,
                                               absl::Time deadline) override {
    std::vector<std::string> out;
    for (const std::string& key : keys) {
      for (;;) {
        FILE* f = std::fopen(Path(key).c_str(), "rb");
        if (f != nullptr) {
          std::string v;
          char buf[4096];
          size_t n;
          while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) v.append(buf, n);
          std::fclose(f);
          out.push_back(std::move(v));
          break;
        }
        if (absl::Now() >= deadline) {
          return absl::DeadlineExceededError(absl::StrCat("key '", key, "' not set in time"));
        }
        absl::SleepFor(absl::Milliseconds(5));
      }
    }
    return out;
  }

 private:
  std::string Path(const std::string& key) const {
    std::string name = key;
    for (char& c : name) {
      if (c == '/') c = '_';
    }
    return dir_ + "/" + name;
  }
  const std::string dir_;
};

}  // namespace microd::transport::testing
