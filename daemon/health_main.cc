// SPDX-License-Identifier: Apache-2.0
// microd-health: asks a daemon's Admin port for grpc.health.v1.Health/Check,
// for a container health probe (Docker HEALTHCHECK, a Kubernetes exec probe)
// where the kubelet's native gRPC probe is not available.
//   microd-health [--admin=host:port] [--service=NAME] [--timeout_ms=N]
// Exit status: 0 SERVING, 1 any other answer (NOT_SERVING, SERVICE_UNKNOWN),
// 2 no answer (nothing listening, deadline, bad arguments).
// The request and response are encoded by hand (one string field, one enum
// field): the health proto's generated code is not part of Debian's gRPC.
#include <grpcpp/generic/generic_stub.h>
#include <grpcpp/grpcpp.h>

#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "daemon/common/command_line.h"
#include "daemon/control/tls_flags.h"

ABSL_FLAG(std::string, admin, "",
          "daemon Admin address (default $MICROD_ADMIN or unix:/run/microd/admin.sock)");
ABSL_FLAG(std::string, service, "", "health service name (\"\": the whole server)");
ABSL_FLAG(int, timeout_ms, 3000, "deadline of the check");

namespace {

const char* StatusName(int v) {
  switch (v) {
    case 0:
      return "UNKNOWN";
    case 1:
      return "SERVING";
    case 2:
      return "NOT_SERVING";
    case 3:
      return "SERVICE_UNKNOWN";
    default:
      return "unrecognised";
  }
}

// HealthCheckRequest { string service = 1; }
std::string EncodeRequest(const std::string& service) {
  std::string out;
  if (service.empty()) return out;
  out.push_back('\x0a');
  size_t n = service.size();
  while (n >= 0x80) {
    out.push_back(static_cast<char>((n & 0x7f) | 0x80));
    n >>= 7;
  }
  out.push_back(static_cast<char>(n));
  return out + service;
}

// HealthCheckResponse { ServingStatus status = 1; }: the last field 1 wins,
// absent means UNKNOWN (0). Returns -1 on anything malformed.
int DecodeResponse(const std::string& bytes) {
  int status = 0;
  size_t i = 0;
  while (i < bytes.size()) {
    const unsigned char key = static_cast<unsigned char>(bytes[i++]);
    if ((key & 7) != 0) return -1;  // only varint fields are expected
    uint64_t v = 0;
    int shift = 0;
    for (;;) {
      if (i >= bytes.size() || shift > 63) return -1;
      const unsigned char b = static_cast<unsigned char>(bytes[i++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      shift += 7;
      if ((b & 0x80) == 0) break;
    }
    if ((key >> 3) == 1) status = static_cast<int>(v);
  }
  return status;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "microd-health: grpc.health.v1 check of a microd Admin port.\n"
      "  exit 0 SERVING, 1 another answer, 2 no answer");
  std::vector<char*> rest = microd::ParseCommandLine(argc, argv);
  if (rest.size() > 1) {
    std::fprintf(stderr, "microd-health: unexpected argument '%s'\n", rest[1]);
    return 2;
  }
  std::string address = absl::GetFlag(FLAGS_admin);
  if (address.empty()) {
    const char* env = std::getenv("MICROD_ADMIN");
    address = env != nullptr && *env != '\0' ? env : "unix:/run/microd/admin.sock";
  }
  const int timeout_ms = absl::GetFlag(FLAGS_timeout_ms);
  if (timeout_ms <= 0) {
    std::fprintf(stderr, "microd-health: --timeout_ms must be positive\n");
    return 2;
  }

  if (absl::Status t = microd::control::CheckTlsFiles(microd::control::TlsFilesFromFlags(),
                                                      /*server=*/false);
      !t.ok()) {
    std::fprintf(stderr, "microd-health: %s\n", std::string(t.message()).c_str());
    return 2;
  }
  auto channel = microd::control::AdminChannel(address);
  grpc::GenericStub stub(channel);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  const std::string request_bytes = EncodeRequest(absl::GetFlag(FLAGS_service));
  grpc::Slice slice(request_bytes);
  grpc::ByteBuffer request(&slice, 1);
  grpc::ByteBuffer response;
  std::mutex mu;
  std::condition_variable cv;
  bool done = false;
  grpc::Status status;
  stub.UnaryCall(&ctx, "/grpc.health.v1.Health/Check", grpc::StubOptions(), &request, &response,
                 [&](grpc::Status s) {
                   std::lock_guard<std::mutex> lock(mu);
                   status = std::move(s);
                   done = true;
                   cv.notify_all();
                 });
  {
    // The call itself carries the deadline; this wait only guards against a
    // callback that never comes.
    std::unique_lock<std::mutex> lock(mu);
    if (!cv.wait_for(lock, std::chrono::milliseconds(timeout_ms) + std::chrono::seconds(5),
                     [&] { return done; })) {
      std::fprintf(stderr, "microd-health: %s: no answer\n", address.c_str());
      ctx.TryCancel();
      cv.wait(lock, [&] { return done; });
      return 2;
    }
  }
  if (!status.ok()) {
    std::fprintf(stderr, "microd-health: %s: %s\n", address.c_str(),
                 status.error_message().c_str());
    return status.error_code() == grpc::StatusCode::NOT_FOUND ? 1 : 2;
  }
  std::vector<grpc::Slice> slices;
  if (!response.Dump(&slices).ok()) {
    std::fprintf(stderr, "microd-health: %s: unreadable answer\n", address.c_str());
    return 2;
  }
  std::string bytes;
  for (const auto& s : slices) bytes.append(reinterpret_cast<const char*>(s.begin()), s.size());
  const int serving = DecodeResponse(bytes);
  if (serving < 0) {
    std::fprintf(stderr, "microd-health: %s: malformed answer\n", address.c_str());
    return 2;
  }
  std::printf("%s: %s\n", address.c_str(), StatusName(serving));
  return serving == 1 ? 0 : 1;
}
