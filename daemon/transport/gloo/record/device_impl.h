// SPDX-License-Identifier: Apache-2.0
// The device behind device.h's factory: its listening socket, the
// handshakes of the connections it accepts, and the registry of pairs they
// may join. Internal to the device.
#pragma once

#include <sys/socket.h>

#include <atomic>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/transport/gloo/record/codec.h"
#include "daemon/transport/gloo/record/device.h"
#include "daemon/transport/gloo/record/loop.h"

namespace microd::transport::record {

class PairImpl;

class DeviceImpl final : public Device,
                         public std::enable_shared_from_this<DeviceImpl>,
                         private Loop::Handler {
 public:
  static absl::StatusOr<std::shared_ptr<DeviceImpl>> Create(const DeviceOptions& options);
  ~DeviceImpl() override;

  std::string str() const override;
  const std::string& getPCIBusID() const override;
  std::shared_ptr<::gloo::transport::Context> createContext(int rank, int size) override;
  uint64_t refused_records() const override { return refused_records_.load(); }
  uint64_t refused_connections() const override { return refused_connections_.load(); }
  void StopListening() override;

  const DeviceOptions& options() const { return options_; }
  Loop& loop() { return *loop_; }
  bool sealed() const { return static_cast<bool>(options_.link_secret); }
  void CountRefusedRecord() { ++refused_records_; }

  // A new pair's address (this device's, a fresh id and ticket), and the
  // pair registered under its id until Unregister.
  absl::StatusOr<PairAddress> NewAddress();
  void Register(PairImpl* pair);
  void Unregister(PairImpl* pair);
  // Refusals are logged at most once a second.
  void Refused(const std::string& from, const std::string& why);

 private:
  struct Handshake;
  explicit DeviceImpl(const DeviceOptions& options);
  // The listening socket is readable: accept what waits.
  void OnEvents(uint32_t events) override;
  void OnHandshake(Handshake* h, uint32_t events);
  // Verifies a Hello against the pair it names; the pair's Reply.
  absl::Status Answer(Handshake* h);
  absl::Status Finish(Handshake* h);
  // Ends a handshake (its socket closed unless handed to a pair).
  void Drop(Handshake* h, bool close_fd);
  // The loop's tick: handshakes past their deadline end.
  void Tick();

  const DeviceOptions options_;
  std::unique_ptr<Loop> loop_;
  sockaddr_storage local_{};
  socklen_t local_len_ = 0;
  std::string local_text_;

  absl::Mutex mu_;
  int listen_fd_ ABSL_GUARDED_BY(mu_) = -1;
  uint64_t listen_registration_ ABSL_GUARDED_BY(mu_) = 0;
  std::map<uint64_t, PairImpl*> pairs_ ABSL_GUARDED_BY(mu_);
  std::map<Handshake*, std::unique_ptr<Handshake>> handshakes_ ABSL_GUARDED_BY(mu_);
  std::vector<std::unique_ptr<Handshake>> ended_ ABSL_GUARDED_BY(mu_);

  std::atomic<uint64_t> refused_records_{0};
  std::atomic<uint64_t> refused_connections_{0};
  absl::Mutex log_mu_;
  absl::Time last_log_ ABSL_GUARDED_BY(log_mu_) = absl::InfinitePast();
  uint64_t unlogged_ ABSL_GUARDED_BY(log_mu_) = 0;
};

}  // namespace microd::transport::record
