// SPDX-License-Identifier: Apache-2.0
// A process's buffers: REGISTER (shared memory) and REGISTER_CUDA (an IPC
// handle) taken or refused within the process's room (local_server.h).
#include <fcntl.h>
#include <linux/magic.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <unistd.h>

#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"
#include "daemon/common/log.h"
#include "daemon/common/status_map.h"
#include "daemon/local/cuda_ipc.h"
#include "daemon/local/local_server.h"
#include "kernels/element_type.h"
#include "microd/wire.h"

namespace microd::local {
namespace {

constexpr uint64_t kMaxElements = 0xFFFFFFFFull;

// A register message's name; empty when it is empty or not terminated.
std::string WireName(const char (&name)[MICROD_WIRE_NAME_BYTES]) {
  const size_t len = strnlen(name, MICROD_WIRE_NAME_BYTES);
  return len == MICROD_WIRE_NAME_BYTES ? std::string() : std::string(name, len);
}

}  // namespace

static_assert(MICROD_WIRE_NAME_BYTES == 128, "local_server.h declares RegisterName with 128");
std::string LocalServer::RegisterName(uint64_t id,
                                      const char (&wire_name)[MICROD_WIRE_NAME_BYTES]) {
  const std::string name = WireName(wire_name);
  if (name.empty()) {
    Refuse(id, static_cast<int>(ClientStatus::kProtocol), "buffer name empty or not terminated");
  }
  return name;
}

bool LocalServer::HandleRegister(uint64_t id, Client& c, const ::microd_wire_register& r,
                                 const std::vector<int>& fds) {
  const int kProtocol = static_cast<int>(ClientStatus::kProtocol);
  auto answer = [&](const absl::Status& s) { return AnswerRegister(c, r.buffer_id, s); };
  const std::string name = RegisterName(id, r.name);
  if (name.empty()) return false;
  if (r.kind == MICROD_BUFFER_CUDA) {
    return answer(WithClientStatus(
        absl::UnimplementedError(absl::StrCat(
            "buffer '", name,
            "': CUDA buffers are registered with REGISTER_CUDA (microd_register_cuda_buffer), "
            "not REGISTER")),
        ClientStatus::kUnsupported));
  }
  const bool half = r.dtype == MICROD_WIRE_DTYPE_BFLOAT16 || r.dtype == MICROD_WIRE_DTYPE_FLOAT16;
  if (r.kind != MICROD_BUFFER_HOST || (r.dtype != MICROD_WIRE_DTYPE_FLOAT32 && !half) ||
      (r.flags & ~1u) != 0) {
    Refuse(id, kProtocol,
           absl::StrCat("buffer '", name, "': unknown kind ", r.kind, ", dtype ", r.dtype,
                        " or flags ", r.flags));
    return false;
  }
  if (fds.size() != 1) {
    Refuse(id, kProtocol, absl::StrCat("register of '", name, "' must carry one memfd"));
    return false;
  }
  const uint64_t bytes = r.count * (half ? sizeof(uint16_t) : sizeof(float));
  if (absl::Status room = CheckRoom(c, r.buffer_id, name, r.count); !room.ok()) return answer(room);
  struct stat st;
  const int seals = fcntl(fds[0], F_GET_SEALS);
  if (fstat(fds[0], &st) != 0 || !S_ISREG(st.st_mode) ||
      static_cast<uint64_t>(st.st_size) < bytes || seals < 0 || (seals & F_SEAL_SHRINK) == 0) {
    return answer(absl::InvalidArgumentError(
        absl::StrCat("buffer '", name, "': the descriptor must be a memfd of at least ", bytes,
                     " bytes sealed against shrinking")));
  }
  // Only shared memory (tmpfs, what memfd_create makes by default): pages of a
  // hugetlbfs memfd punched out after registration would SIGBUS the daemon
  // at its next touch of the buffer.
  struct statfs fs {};
  if (fstatfs(fds[0], &fs) != 0 || fs.f_type != TMPFS_MAGIC) {
    return answer(absl::InvalidArgumentError(
        absl::StrCat("buffer '", name,
                     "': the memfd must be plain shared memory (memfd_create without "
                     "MFD_HUGETLB)",
                     fs.f_type == HUGETLBFS_MAGIC ? ", not hugetlbfs" : "")));
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
  if (p == MAP_FAILED) {
    return answer(WithClientStatus(absl::ResourceExhaustedError(absl::StrCat(
                                       "buffer '", name, "': mmap: ", std::strerror(errno))),
                                   ClientStatus::kResource));
  }
  if (half) {
    // The fp32 copy the step works on (counted by CheckRoom: 4 bytes an element).
    auto* staging = static_cast<float*>(std::malloc(r.count * sizeof(float)));
    if (staging == nullptr) {
      munmap(p, bytes);
      return answer(WithClientStatus(
          absl::ResourceExhaustedError(absl::StrCat("buffer '", name, "': no memory for its ",
                                                    r.count * sizeof(float), "-byte fp32 copy")),
          ClientStatus::kResource));
    }
    return AcceptBuffer(id, c, r.buffer_id, name, (r.flags & 1u) != 0, bytes,
                        std::make_shared<ProcessBuffer>(static_cast<uint16_t*>(p), r.dtype, staging,
                                                        r.count, bytes));
  }
  return AcceptBuffer(id, c, r.buffer_id, name, (r.flags & 1u) != 0, bytes,
                      std::make_shared<ProcessBuffer>(static_cast<float*>(p), r.count, bytes));
}

absl::Status LocalServer::CheckRoom(const Client& c, uint32_t buffer_id, const std::string& name,
                                    uint64_t count) const {
  if (count == 0 || count > kMaxElements) {
    return absl::InvalidArgumentError(
        absl::StrCat("buffer '", name, "': element count ", count, " out of range [1, 2^32)"));
  }
  const uint64_t bytes = count * sizeof(float);
  if (c.buffers.count(buffer_id) != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("buffer id ", buffer_id, " is already registered"));
  }
  if (static_cast<int>(c.buffers.size()) >= options_.max_buffers_per_client ||
      c.bytes + bytes > options_.max_bytes_per_client) {
    return WithClientStatus(
        absl::ResourceExhaustedError(absl::StrCat(
            "buffer '", name, "' of ", count, " elements: over the per-process limit (",
            options_.max_buffers_per_client, " buffers, ", options_.max_bytes_per_client,
            " bytes at 4 an element; this process has ", c.buffers.size(), " and ", c.bytes,
            "): --max_buffers_per_process, "
            "--max_bytes_per_process")),
        ClientStatus::kResource);
  }
  return absl::OkStatus();
}

bool LocalServer::AcceptBuffer(uint64_t id, Client& c, uint32_t buffer_id, const std::string& name,
                               bool dense, uint64_t bytes, std::shared_ptr<ProcessBuffer> buffer) {
  absl::Status s = handler_->OnRegister(id, buffer_id, name, dense, std::move(buffer));
  if (s.ok()) {
    absl::MutexLock lock(&mu_);
    c.buffers[buffer_id] = bytes;
    c.bytes += bytes;
  }
  return AnswerRegister(c, buffer_id, s);
}

// Answers a REGISTER or REGISTER_CUDA with `s`; the client stays connected.
bool LocalServer::AnswerRegister(Client& c, uint32_t buffer_id, const absl::Status& s) {
  microd_wire_register_ack ack{};
  microd_wire_header_init(&ack.h, MICROD_MSG_REGISTER_ACK, sizeof ack);
  ack.buffer_id = buffer_id;
  ack.status = static_cast<int32_t>(ToClientStatus(s));
  CopyMessage(ack.message, std::string(s.message()));
  absl::MutexLock lock(&mu_);
  Send(c, &ack, sizeof ack);  // a failure: Reap() drops it
  return true;
}

bool LocalServer::HandleRegisterCuda(uint64_t id, Client& c, const microd_wire_register_cuda& r) {
  const int kProtocol = static_cast<int>(ClientStatus::kProtocol);
  auto answer = [&](const absl::Status& s) { return AnswerRegister(c, r.buffer_id, s); };
  const std::string name = RegisterName(id, r.name);
  if (name.empty()) return false;
  if ((r.dtype != MICROD_WIRE_DTYPE_FLOAT32 && r.dtype != MICROD_WIRE_DTYPE_BFLOAT16 &&
       r.dtype != MICROD_WIRE_DTYPE_FLOAT16) ||
      (r.flags & ~1u) != 0) {
    Refuse(id, kProtocol,
           absl::StrCat("buffer '", name, "': unknown dtype ", r.dtype, " or flags ", r.flags));
    return false;
  }
  if (r.dtype != MICROD_WIRE_DTYPE_FLOAT32) {
    return answer(
        WithClientStatus(absl::UnimplementedError(absl::StrCat(
                             "buffer '", name,
                             "': bf16/fp16 CUDA buffers are not supported yet (host buffers "
                             "are); register a float32 CUDA buffer")),
                         ClientStatus::kUnsupported));
  }
  // The fields are checked here, before anything CUDA, so that a bad request
  // gets the same answer from every build. The daemon's staging copy counts
  // against the process's limit.
  if (absl::Status room = CheckRoom(c, r.buffer_id, name, r.count); !room.ok()) return answer(room);
  const uint64_t bytes = r.count * sizeof(float);
  if (r.offset % sizeof(float) != 0 || r.offset > r.alloc_bytes ||
      bytes > r.alloc_bytes - r.offset) {
    return answer(absl::InvalidArgumentError(
        absl::StrCat("buffer '", name, "': ", bytes, " bytes at offset ", r.offset,
                     " do not fit an allocation of ", r.alloc_bytes,
                     " bytes (or the offset is not a multiple of 4)")));
  }
  if (cuda_ == nullptr && cuda_unavailable_.empty()) {
    auto registry = options_.cuda_registry ? options_.cuda_registry()
                                           : CreateCudaIpcRegistry(options_.cuda_resident_device);
    if (registry.ok()) {
      cuda_ = std::move(registry).value();
    } else {
      cuda_unavailable_ = std::string(registry.status().message());
      MICROD_LOG(Warning, "CUDA buffers unavailable: %s", cuda_unavailable_.c_str());
    }
  }
  if (cuda_ == nullptr) {
    return answer(WithClientStatus(
        absl::UnimplementedError(absl::StrCat(
            "buffer '", name, "': this microd cannot take CUDA buffers: ", cuda_unavailable_)),
        ClientStatus::kUnsupported));
  }
  CudaIpcRequest req;
  req.client = id;
  req.pid = c.pid;
  req.name = name;
  req.count = r.count;
  req.client_device = r.device_ordinal;
  std::memcpy(req.device_uuid.data(), r.device_uuid, req.device_uuid.size());
  std::memcpy(req.mem_handle.data(), r.mem_handle, req.mem_handle.size());
  req.alloc_bytes = r.alloc_bytes;
  req.offset = r.offset;
  std::memcpy(req.event_handle.data(), r.event_handle, req.event_handle.size());
  auto device = cuda_->Open(req);
  if (!device.ok()) return answer(device.status());
  return AcceptBuffer(id, c, r.buffer_id, name, (r.flags & 1u) != 0, bytes,
                      std::make_shared<ProcessBuffer>(std::move(device).value()));
}

}  // namespace microd::local
