// SPDX-License-Identifier: Apache-2.0
// Fuzz target: the Coordinator's requests as they arrive over gRPC. The
// input's first byte picks the method, the rest is its serialized request
// (anything that does not parse is dropped, as gRPC would). A coordinator
// of one node per input; half of the requests carry that node's real
// session, so that they get past the membership check. Waits are clamped
// to milliseconds. Nothing may crash, hang or grow without bound.
#include <google/protobuf/stubs/logging.h>
#include <grpcpp/grpcpp.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <memory>

#include "daemon/control/coordinator.h"
#include "daemon/control/services.h"
#include "microd/v1/coordinator.grpc.pb.h"

namespace {

// Waits of at most 5 ms (0 would mean the server's longest wait for a poll);
// negative values stay, to be refused.
template <typename Request>
void Clamp(Request* req) {
  if (req->timeout_ms() >= 0) req->set_timeout_ms(std::clamp<int64_t>(req->timeout_ms(), 1, 5));
}

template <typename Request>
bool Parse(const uint8_t* data, size_t size, Request* req) {
  return req->ParseFromArray(data, static_cast<int>(size));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace microd;
  // Protobuf's complaints about invalid UTF-8 are expected here.
  static const bool quiet = [] {
    google::protobuf::SetLogHandler(nullptr);
    return true;
  }();
  (void)quiet;
  if (size < 2) return 0;
  control::CoordinatorOptions o;
  o.job_id = "job";
  o.expected_nodes = 1;
  o.peer_timeout = absl::Seconds(10);
  auto coordinator = control::Coordinator::Create(o);
  if (!coordinator.ok()) return 0;
  control::CoordinatorService service(coordinator->get());
  auto joined = (*coordinator)->Join("job", "n0", 1, "", -1, absl::Now() + absl::Seconds(1));
  if (!joined.ok()) return 0;
  const uint64_t session = joined->session;
  const uint8_t method = data[0];
  const bool real_session = (method & 0x80) != 0;
  data += 1;
  size -= 1;
  grpc::ServerContext ctx;
  auto fix = [&](auto* req) {
    if (real_session) req->set_session(session);
  };
  switch (method & 0x7) {
    case 0: {
      v1::JoinRequest req;
      v1::JoinResponse resp;
      if (!Parse(data, size, &req)) return 0;
      Clamp(&req);
      service.Join(&ctx, &req, &resp);
      break;
    }
    case 1: {
      v1::KeySetRequest req;
      v1::KeySetResponse resp;
      if (!Parse(data, size, &req)) return 0;
      fix(&req);
      service.KeySet(&ctx, &req, &resp);
      break;
    }
    case 2: {
      v1::KeyGetRequest req;
      v1::KeyGetResponse resp;
      if (!Parse(data, size, &req)) return 0;
      fix(&req);
      if (req.timeout_ms() > 5) req.set_timeout_ms(5);  // 0 here: no wait
      service.KeyGet(&ctx, &req, &resp);
      break;
    }
    case 3: {
      v1::ReportRequest req;
      v1::ReportResponse resp;
      if (!Parse(data, size, &req)) return 0;
      fix(&req);
      service.Report(&ctx, &req, &resp);
      // And a poll for whatever it scheduled.
      v1::PollRequest poll;
      v1::PollResponse batches;
      poll.set_session(req.session());
      poll.set_node_rank(req.node_rank());
      poll.set_timeout_ms(1);
      service.Poll(&ctx, &poll, &batches);
      break;
    }
    case 4: {
      v1::PollRequest req;
      v1::PollResponse resp;
      if (!Parse(data, size, &req)) return 0;
      fix(&req);
      Clamp(&req);
      service.Poll(&ctx, &req, &resp);
      break;
    }
    case 5: {
      v1::HeartbeatRequest req;
      v1::HeartbeatResponse resp;
      if (!Parse(data, size, &req)) return 0;
      fix(&req);
      service.Heartbeat(&ctx, &req, &resp);
      break;
    }
    case 6: {
      v1::FailRequest req;
      v1::FailResponse resp;
      if (!Parse(data, size, &req)) return 0;
      fix(&req);
      service.Fail(&ctx, &req, &resp);
      break;
    }
    case 7: {
      v1::LeaveRequest req;
      v1::LeaveResponse resp;
      if (!Parse(data, size, &req)) return 0;
      fix(&req);
      service.Leave(&ctx, &req, &resp);
      break;
    }
  }
  // The job's state stays readable whatever happened.
  (void)(*coordinator)->Snapshot();
  return 0;
}
