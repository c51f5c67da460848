// SPDX-License-Identifier: Apache-2.0
// The daemon's side of the local protocol (client/wire/microd/wire.h): a
// SOCK_SEQPACKET Unix socket for the training processes of this node, peers
// checked with SO_PEERCRED, host buffers mapped from the memfds they send,
// CUDA buffers opened from their IPC handles (CUDA builds, cuda_ipc.h).
// Every message is validated; a malformed one gets an ERROR reply and only
// that client is disconnected. The server thread never blocks on a client:
// what a client's socket cannot take yet waits in that client's outbox and
// goes out when the socket is writable, so a trainer busy elsewhere may
// read its completions late. A client is dropped, with that reason, only
// when it truly stops reading (its oldest unread message older than
// `stuck_after`, or more queued than it could ever have in flight) or never
// says hello (`hello_timeout`).
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/common/unique_fd.h"

struct microd_wire_hello;  // client/wire/microd/wire.h
struct microd_wire_state;
struct microd_wire_register;
struct microd_wire_register_cuda;
struct microd_wire_submit;
struct microd_wire_waiting;

namespace microd::local {

class CudaIpcRegistry;

// The GPU side of a CUDA buffer (daemon/local/cuda/). An engine on the CPU
// computes on a host copy of it (staging()) and moves the bytes with the copy
// calls; an engine on the GPU (device-resident) waits for the ready event and
// computes on mapped() in place. All calls on the engine thread; at most one
// copy is in flight per buffer.
class DeviceMemory {
 public:
  virtual ~DeviceMemory() = default;
  // The process's memory mapped into the daemon: count() floats on the GPU
  // of ordinal() (the daemon's CUDA ordinal), in its primary context.
  virtual float* mapped() const = 0;
  virtual int ordinal() const = 0;
  // Waits until the process's ready event completed (what BeginCopyIn waits
  // for first), without copying. Same deadline and abandon rules.
  virtual absl::Status WaitReady(absl::Time deadline, const std::function<bool()>& abandoned) = 0;
  // count() floats of host memory the copies go through (null where the
  // registry was made without staging, for a device-resident engine).
  virtual float* staging() const = 0;
  virtual uint64_t count() const = 0;
  // Waits until the process's ready event completed (the client records it
  // before every submit), then queues the copy device -> staging(). Blocks
  // until `deadline` at most: DeadlineExceeded when the event did not fire;
  // Aborted, without queueing, as soon as `abandoned()` says the step is
  // moot (e.g. the job failed because the process died).
  virtual absl::Status BeginCopyIn(absl::Time deadline, const std::function<bool()>& abandoned) = 0;
  // Queues the copy staging() -> device.
  virtual absl::Status BeginCopyOut() = 0;
  // Waits until the queued copy is done (the bytes are then in place for
  // every process). Blocks until `deadline` at most.
  virtual absl::Status Finish(absl::Time deadline) = 0;
  // "GPU 0, 4096 bytes at offset 256 of an allocation of process 1234".
  virtual std::string Describe() const = 0;
};

// A training process's buffer as the engine sees it, host memory or CUDA
// memory: data() is host memory to read the gradient from and write the
// update into. A host buffer is the process's memfd mapped into the daemon
// (unmapped when the last reference goes; the engine may hold one while a
// step runs); for a CUDA buffer data() is the daemon's staging copy of the
// device memory, moved (or used in place) through device().
//
// A bf16 or fp16 host buffer (dtype MICROD_WIRE_DTYPE_BFLOAT16 / _FLOAT16) keeps
// the process's 2-byte elements at half() and a daemon-owned fp32 copy at
// data() that the step works on: widened before the step, rounded back
// after it (the engine's step memory does both).
class ProcessBuffer {
 public:
  ProcessBuffer(float* data, uint64_t count, size_t mapped_bytes)
      : data_(data), count_(count), mapped_bytes_(mapped_bytes) {}
  // A half-precision host buffer: the mapping at `half`, and `staging`
  // (count floats from malloc, owned from here on).
  ProcessBuffer(uint16_t* half, uint32_t dtype, float* staging, uint64_t count, size_t mapped_bytes)
      : data_(staging), count_(count), mapped_bytes_(mapped_bytes), half_(half), dtype_(dtype) {}
  explicit ProcessBuffer(std::unique_ptr<DeviceMemory> device)
      : data_(device->staging()),
        count_(device->count()),
        mapped_bytes_(0),
        device_(std::move(device)) {}
  ~ProcessBuffer();
  ProcessBuffer(const ProcessBuffer&) = delete;
  ProcessBuffer& operator=(const ProcessBuffer&) = delete;
  float* data() const { return data_; }
  uint64_t count() const { return count_; }
  // The process's elements of a bf16/fp16 buffer; null for fp32 and CUDA ones.
  uint16_t* half() const { return half_; }
  uint32_t dtype() const { return dtype_; }  // MICROD_WIRE_DTYPE_*
  // Null for host buffers.
  DeviceMemory* device() const { return device_.get(); }

 private:
  float* const data_;
  const uint64_t count_;
  const size_t mapped_bytes_;  // 0: not a mapping of ours
  const std::unique_ptr<DeviceMemory> device_;
  uint16_t* const half_ = nullptr;
  const uint32_t dtype_ = 1;  // MICROD_WIRE_DTYPE_FLOAT32
};

struct ProcessInfo {
  int local_rank = 0;
  int local_size = 1;
  int node_rank = 0;
  int node_count = 1;
  int rank = 0;
  int world_size = 1;
  float momentum_correction = 0.0f;
  uint64_t epoch = 0;  // the job's membership epoch
};

// The directory of a state request. The process that asks opens it and
// passes the descriptor, so that the daemon writes and reads only where that
// process itself can (and never follows a path it could change meanwhile):
// the file names are fixed, the descriptor is the directory.
struct StateDirectory {
  std::string path;  // as the process named it (messages only)
  UniqueFd fd;
  dev_t dev = 0;  // the directory's identity: processes naming one directory
  ino_t ino = 0;  // differently ask for the same
  uid_t uid = 0;  // the process that asked
  gid_t gid = 0;
};

// What the server asks of the engine. Called on the server thread; must not block.
class LocalHandler {
 public:
  virtual ~LocalHandler() = default;
  virtual absl::StatusOr<ProcessInfo> OnHello(uint64_t client, int requested_local_rank,
                                              pid_t pid) = 0;
  // `dense`: the process asked for this buffer to be reduced without sparsification.
  virtual absl::Status OnRegister(uint64_t client, uint32_t buffer_id, const std::string& name,
                                  bool dense, std::shared_ptr<ProcessBuffer> buffer) = 0;
  // An error completes the ticket at once with that status. `changes_seen`:
  // the changes of membership the process had read when it submitted (a
  // client with MICROD_WIRE_CAP_FENCE), or none.
  virtual absl::Status OnSubmit(uint64_t client, uint32_t buffer_id, uint64_t ticket,
                                std::optional<uint32_t> changes_seen) = 0;
  // `clean`: the process said goodbye; otherwise it vanished or misbehaved.
  virtual void OnDisconnect(uint64_t client, bool clean, const std::string& why) = 0;
  // Save (or load) the compression state in `dir`, answered later through
  // Complete(ticket) (buffer id MICROD_WIRE_NO_BUFFER); an error answers it
  // at once. The server checked that `dir` is a directory and, for a save,
  // that the asking process may write it.
  virtual absl::Status OnState(uint64_t client, bool save, StateDirectory dir, uint64_t ticket) {
    return absl::UnimplementedError("this daemon keeps no compression state");
  }
  // What the client's buffer waits for, in words (a trainer's wait timed
  // out): the local processes, nodes or step it waits for.
  virtual std::string OnWaiting(uint64_t client, uint32_t buffer_id) {
    return "the daemon cannot say";
  }
};

struct LocalServerOptions {
  std::string socket_path;
  int allow_gid = -1;  // also accept peers of this group (socket mode 0660)
  // Processes that said hello, at most; connections waiting for their hello
  // count apart (as many again at most), so they never take a place.
  int max_clients = 256;
  int max_buffers_per_client = 4096;
  uint64_t max_bytes_per_client = uint64_t{1} << 40;
  // A connection that sent no HELLO this long after it connected is dropped.
  absl::Duration hello_timeout = absl::Seconds(10);
  // A client whose oldest unread message waited this long is dropped.
  absl::Duration stuck_after = absl::Seconds(60);
  // Where CUDA buffers are opened, made at the first REGISTER_CUDA (tests
  // inject a fake; unset: CreateCudaIpcRegistry() of cuda_ipc.h).
  std::function<absl::StatusOr<std::unique_ptr<CudaIpcRegistry>>()> cuda_registry;
  // Passed to CreateCudaIpcRegistry: the GPU of a device-resident engine
  // (-1: none; buffers on any GPU, staged through host memory).
  int cuda_resident_device = -1;
};

struct ClientSnapshot {
  uint64_t id = 0;
  pid_t pid = 0;
  uid_t uid = 0;
  int local_rank = -1;
  int buffers = 0;
  uint64_t bytes = 0;
  size_t queued = 0;  // messages waiting in its outbox
};

// `src` into a wire message's text field: cut to fit, always terminated.
void CopyMessage(char* dst, const std::string& src);

class LocalServer {
 public:
  // Creates the socket (its directory 0700 if missing; a stale socket is
  // replaced, a live one is an error) and starts the server thread.
  static absl::StatusOr<std::unique_ptr<LocalServer>> Start(const LocalServerOptions& options,
                                                            LocalHandler* handler);
  ~LocalServer();

  // Sends a completion to a client (thread-safe; dropped if the client left).
  // MICROD_ERR_MEMBERSHIP goes as MICROD_ERR_JOB_FAILED to a client whose
  // hello did not say it follows membership changes.
  void Complete(uint64_t client, uint64_t ticket, uint32_t buffer_id, const absl::Status& status);
  // Tells a client its place in the job's membership epoch `epoch` (an
  // elastic job's change; `what` says what changed), before its pending
  // submissions complete with MICROD_ERR_MEMBERSHIP. Nothing for a client
  // that did not say it follows such changes. Thread-safe.
  void NotifyMembership(uint64_t client, uint64_t epoch, const ProcessInfo& info,
                        const std::string& what);
  // Stops serving, closes every connection and removes the socket file.
  void Stop();
  std::vector<ClientSnapshot> Clients() const;
  const std::string& socket_path() const { return options_.socket_path; }

 private:
  struct Client {
    int fd = -1;
    pid_t pid = 0;
    uid_t uid = 0;
    gid_t gid = 0;
    std::vector<gid_t> groups;  // supplementary (SO_PEERGROUPS)
    bool greeted = false;
    uint32_t caps = 0;  // MICROD_WIRE_CAP_* of its hello
    int local_rank = -1;
    std::map<uint32_t, uint64_t> buffers;  // id -> bytes
    uint64_t bytes = 0;
    absl::Time connected_at;
    // Messages the socket could not take yet, oldest first, and when the
    // oldest was queued.
    std::deque<std::string> outbox;
    absl::Time outbox_since;
    std::string broken;  // why a send failed (the server thread then drops it)
  };

  LocalServer(LocalServerOptions options, LocalHandler* handler);
  void Loop();
  void Accept();
  // Handles one message; false when the client must be dropped.
  bool HandleMessage(uint64_t id, Client& c);
  // One handler per message type, after HandleMessage's framing checks;
  // false when the client was dropped.
  bool HandleHello(uint64_t id, Client& c, const ::microd_wire_hello& hello);
  // REGISTER: validates, maps the memfd and answers.
  bool HandleRegister(uint64_t id, Client& c, const ::microd_wire_register& r,
                      const std::vector<int>& fds);
  // REGISTER_CUDA: validates, opens the allocation and answers.
  bool HandleRegisterCuda(uint64_t id, Client& c, const ::microd_wire_register_cuda& r);
  bool HandleSubmit(uint64_t id, Client& c, const ::microd_wire_submit& submit);
  // WAITING: the handler's account of what a buffer waits for.
  bool HandleWaiting(uint64_t id, Client& c, const ::microd_wire_waiting& w);
  // STATE: validates, checks the directory's descriptor and hands it on.
  bool HandleState(uint64_t id, const Client& c, const ::microd_wire_state& state,
                   std::vector<int>& fds);
  // A register message's buffer name; empty (and the client refused) when
  // it is empty or not terminated.
  std::string RegisterName(uint64_t id, const char (&wire_name)[128]);
  // Both registers: the element count is in range, the buffer id is new
  // and the process has room for `count` floats...
  absl::Status CheckRoom(const Client& c, uint32_t buffer_id, const std::string& name,
                         uint64_t count) const;
  // ...and then the engine takes it (and the process's account with it).
  bool AcceptBuffer(uint64_t id, Client& c, uint32_t buffer_id, const std::string& name, bool dense,
                    uint64_t bytes, std::shared_ptr<ProcessBuffer> buffer);
  bool AnswerRegister(Client& c, uint32_t buffer_id, const absl::Status& s);
  void Drop(uint64_t id, bool clean, const std::string& why);
  // Sends an ERROR message (best effort) and drops the client.
  void Refuse(uint64_t id, int status, const std::string& why);
  // Sends a message, or queues it behind the ones already waiting; false
  // when the connection is broken or the outbox is over its bound (the
  // server thread then drops the client).
  bool Send(Client& c, const void* msg, size_t len) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Sends what the outbox holds until the socket is full.
  void Flush(Client& c) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Drops clients that broke, stopped reading or never said hello.
  void Reap();
  void Wake();

  const LocalServerOptions options_;
  LocalHandler* const handler_;
  int listen_fd_ = -1;
  int wake_fd_ = -1;  // eventfd: stop, or an outbox to watch
  std::atomic<bool> stopping_{false};
  uint64_t next_id_ = 1;
  mutable absl::Mutex mu_;  // guards clients_ (sends happen from other threads)
  std::map<uint64_t, Client> clients_ ABSL_GUARDED_BY(mu_);
  std::thread thread_;
  bool stopped_ = false;
  // CUDA buffers: created at the first REGISTER_CUDA (so that a CPU-only job
  // never initialises CUDA); server thread only, except that Drop() may run
  // from Stop() after the thread ended.
  std::unique_ptr<CudaIpcRegistry> cuda_;
  std::string cuda_unavailable_;  // why there is no registry, once tried
};

}  // namespace microd::local
