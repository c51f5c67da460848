// SPDX-License-Identifier: Apache-2.0
// A transport that forwards every call to another: the base of the tests'
// transports that lie, fail or count (a subclass overrides the calls it
// alters).
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "daemon/transport/transport.h"

namespace microd::transport {

class Forwarding : public Transport {
 public:
  explicit Forwarding(Transport* inner) : inner_(inner) {}
  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  const char* name() const override { return "forwarding"; }
  absl::Status Allgather(const void* in, size_t bytes, void* out,
                         const CollectiveOptions& o) override {
    return inner_->Allgather(in, bytes, out, o);
  }
  absl::Status AllgatherV(const void* in, absl::Span<const size_t> recv_bytes, void* out,
                          const CollectiveOptions& o) override {
    return inner_->AllgatherV(in, recv_bytes, out, o);
  }
  absl::Status AllreduceSum(void* data, size_t count, DataType type,
                            const CollectiveOptions& o) override {
    return inner_->AllreduceSum(data, count, type, o);
  }
  absl::Status Barrier(const CollectiveOptions& o) override { return inner_->Barrier(o); }
  absl::Status ExchangeRound(std::string_view mine, std::vector<std::string>* from,
                             const CollectiveOptions& o) override {
    return inner_->ExchangeRound(mine, from, o);
  }
  void Abort(const absl::Status& reason) override { inner_->Abort(reason); }

 protected:
  Transport* const inner_;
};

}  // namespace microd::transport
