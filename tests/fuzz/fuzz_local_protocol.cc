// SPDX-License-Identifier: Apache-2.0
// Fuzz target: the daemon's local protocol (daemon/local/local_server.cc)
// as a training process could speak it. One LocalServer for the whole run,
// on a socket of its own, in front of a handler that accepts what a healthy
// engine would (and saves or loads a state file for real, through the
// directory descriptor a STATE message carries). Each input is a
// connection: a sequence of messages, each
//   [1 byte: descriptors to attach (spec % 5) and their kinds][2 bytes: length][bytes]
// sent in order with SCM_RIGHTS, descriptor i of kind (spec >> (2 + i)) & 7:
// a sealed memfd, an unsealed one, a pipe, /dev/null, a scratch directory,
// a sealed hugetlbfs memfd, an empty sealed memfd, a FIFO in the scratch
// directory. Then the connection closes and the run waits (bounded) until
// the server has let it go. Nothing may crash, leak a descriptor or hang.
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "daemon/common/atomic_file.h"
#include "daemon/local/cuda_ipc.h"
#include "daemon/local/local_server.h"
#include "microd/wire.h"
#include "tests/fuzz/input.h"

namespace {

using microd::local::LocalHandler;
using microd::local::LocalServer;
using microd::local::ProcessBuffer;
using microd::local::ProcessInfo;

class AcceptingHandler final : public LocalHandler {
 public:
  absl::StatusOr<ProcessInfo> OnHello(uint64_t, int requested_local_rank, pid_t) override {
    if (requested_local_rank > 3) return absl::InvalidArgumentError("local rank out of range");
    ProcessInfo info;
    info.local_rank = requested_local_rank < 0 ? 0 : requested_local_rank;
    info.local_size = 4;
    return info;
  }
  absl::Status OnRegister(uint64_t, uint32_t, const std::string& name, bool,
                          std::shared_ptr<ProcessBuffer> buffer) override {
    // Touch the mapping end to end, as a step would.
    volatile float sum = 0;
    for (uint64_t i = 0; i < buffer->count(); i += 1024) sum = sum + buffer->data()[i];
    buffer->data()[buffer->count() - 1] = sum;
    return name == "refused" ? absl::InvalidArgumentError("refused") : absl::OkStatus();
  }
  absl::Status OnSubmit(uint64_t client, uint32_t buffer_id, uint64_t ticket,
                        std::optional<uint32_t>) override {
    server->Complete(client, ticket, buffer_id, absl::OkStatus());
    return absl::OkStatus();
  }
  void OnDisconnect(uint64_t, bool, const std::string&) override {}
  // A save writes the file and a load reads it back, as the engine does,
  // relative to the descriptor the process passed.
  absl::Status OnState(uint64_t client, bool save, microd::local::StateDirectory dir,
                       uint64_t ticket) override {
    const std::string name = "microd-state-node0.bin";
    absl::Status s = save ? microd::WriteFileAtomicallyAt(dir.fd.get(), name, {"state"}, name)
                          : microd::ReadRegularFileAt(dir.fd.get(), name, 1 << 20, name).status();
    server->Complete(client, ticket, MICROD_WIRE_NO_BUFFER, s);
    return absl::OkStatus();
  }
  LocalServer* server = nullptr;
};

// The scratch directory STATE messages may carry (made once per run).
const std::string& ScratchDir() {
  static const std::string dir = [] {
    char d[] = "/tmp/microd-fuzz-state-XXXXXX";
    if (mkdtemp(d) == nullptr) std::abort();
    mkfifo((std::string(d) + "/fifo").c_str(), 0600);
    return std::string(d);
  }();
  return dir;
}

int SealedMemfd(unsigned flags, off_t bytes) {
  const int fd = memfd_create("fuzz", MFD_CLOEXEC | MFD_ALLOW_SEALING | flags);
  if (fd >= 0 && ftruncate(fd, bytes) == 0) fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK);
  return fd;
}

int Descriptor(int kind) {
  switch (kind & 7) {
    case 0:
      return SealedMemfd(0, 4096);
    case 1: {
      const int fd = memfd_create("fuzz", MFD_CLOEXEC);
      if (fd >= 0) (void)!ftruncate(fd, 64);
      return fd;
    }
    case 2: {
      int p[2];
      if (pipe2(p, O_CLOEXEC) != 0) return -1;
      close(p[1]);
      return p[0];
    }
    case 3:
      return open("/dev/null", O_RDONLY | O_CLOEXEC);
    case 4:
      return open(ScratchDir().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    case 5: {
      const int fd = SealedMemfd(MFD_HUGETLB, 2 << 20);  // refused at registration
      return fd >= 0 ? fd : SealedMemfd(0, 4096);
    }
    case 6:
      return SealedMemfd(0, 0);
    default:
      return open((ScratchDir() + "/fifo").c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
  }
}

struct Server {
  AcceptingHandler handler;
  std::unique_ptr<LocalServer> server;
  std::string path;
  Server() {
    char dir[] = "/tmp/microd-fuzz-XXXXXX";
    if (mkdtemp(dir) == nullptr) std::abort();
    path = std::string(dir) + "/microd.sock";
    microd::local::LocalServerOptions o;
    o.socket_path = path;
    o.max_buffers_per_client = 8;
    o.max_bytes_per_client = 1 << 20;
    o.hello_timeout = absl::Milliseconds(200);
    // REGISTER_CUDA is answered as by a daemon without CUDA (the field
    // checks before it are the same in every build), without the seconds
    // a CUDA runtime may take to find no GPU.
    o.cuda_registry = []() -> absl::StatusOr<std::unique_ptr<microd::local::CudaIpcRegistry>> {
      return absl::UnimplementedError("no CUDA in this fuzz target");
    };
    auto s = LocalServer::Start(o, &handler);
    if (!s.ok()) std::abort();
    server = std::move(s).value();
    handler.server = server.get();
  }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static Server* s = new Server();
  const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  std::strcpy(addr.sun_path, s->path.c_str());
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0) std::abort();
  // Accepted before anything is sent, so that "let go" below means this
  // connection (the server accepts on its own thread).
  for (int i = 0; i < 10000 && s->server->Clients().empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(100));
  }
  // Messages: [descriptor spec][length, 2 bytes little-endian][body].
  microd::fuzz::Input in(data, size);
  for (int sent = 0; in.left() >= 3 && sent < 64; ++sent) {
    const uint8_t spec = in.Byte();
    size_t len = in.U16();
    const uint8_t* body = in.Span(&len);
    const int nfds = spec % 5;
    std::vector<int> fds;
    for (int i = 0; i < nfds; ++i) fds.push_back(Descriptor(spec >> (2 + i)));
    fds.erase(std::remove(fds.begin(), fds.end(), -1), fds.end());
    char empty = 0;
    iovec iov{len > 0 ? const_cast<uint8_t*>(body) : reinterpret_cast<uint8_t*>(&empty),
              len > 0 ? len : 1};
    alignas(cmsghdr) char control[CMSG_SPACE(4 * sizeof(int))];
    msghdr mh{};
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    if (!fds.empty()) {
      mh.msg_control = control;
      mh.msg_controllen = CMSG_SPACE(fds.size() * sizeof(int));
      cmsghdr* cm = CMSG_FIRSTHDR(&mh);
      cm->cmsg_level = SOL_SOCKET;
      cm->cmsg_type = SCM_RIGHTS;
      cm->cmsg_len = CMSG_LEN(fds.size() * sizeof(int));
      std::memcpy(CMSG_DATA(cm), fds.data(), fds.size() * sizeof(int));
    }
    const ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    for (int f : fds) close(f);
    if (n < 0) break;  // the server dropped us
  }
  close(fd);
  // Bounded wait until the server let the connection go.
  for (int i = 0; i < 10000 && !s->server->Clients().empty(); ++i) {
    std::this_thread::sleep_for(std::chrono::microseconds(500));
  }
  if (!s->server->Clients().empty()) {
    std::fprintf(stderr, "the server kept a closed connection for 5 s\n");
    std::abort();
  }
  return 0;
}
