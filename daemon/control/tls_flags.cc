// SPDX-License-Identifier: Apache-2.0
#include "daemon/control/tls_flags.h"

#include <cstdlib>

#include "absl/flags/flag.h"

ABSL_FLAG(std::string, tls_ca, "",
          "CA bundle (PEM) that signed the daemon's Admin certificate (default $MICROD_TLS_CA)");
ABSL_FLAG(std::string, tls_cert, "",
          "client certificate (PEM) for an Admin port that requires one (default "
          "$MICROD_TLS_CERT)");
ABSL_FLAG(std::string, tls_key, "", "its private key (PEM) (default $MICROD_TLS_KEY)");
ABSL_FLAG(std::string, tls_server_name, "",
          "the name the daemon's certificate carries, when not the address dialed (default "
          "$MICROD_TLS_SERVER_NAME)");

namespace microd::control {
namespace {

std::string FlagOrEnv(const absl::Flag<std::string>& flag, const char* env) {
  std::string v = absl::GetFlag(flag);
  if (!v.empty()) return v;
  const char* e = std::getenv(env);
  return e != nullptr ? e : "";
}

}  // namespace

TlsFiles TlsFilesFromFlags() {
  TlsFiles f;
  f.ca = FlagOrEnv(FLAGS_tls_ca, "MICROD_TLS_CA");
  f.cert = FlagOrEnv(FLAGS_tls_cert, "MICROD_TLS_CERT");
  f.key = FlagOrEnv(FLAGS_tls_key, "MICROD_TLS_KEY");
  f.server_name = FlagOrEnv(FLAGS_tls_server_name, "MICROD_TLS_SERVER_NAME");
  return f;
}

std::shared_ptr<grpc::Channel> AdminChannel(const std::string& address) {
  // The daemon serves Admin in plaintext on loopback and Unix sockets (its
  // TLS flags apply to what the network reaches), so the same variables in
  // a sidecar's environment serve both.
  const TlsFiles f = IsLocalOnly(address) ? TlsFiles{} : TlsFilesFromFlags();
  grpc::ChannelArguments args;
  AddTlsChannelArgs(f, &args);
  args.SetMaxReceiveMessageSize(256 << 20);  // a timeline (GetTimeline) runs to megabytes
  return grpc::CreateCustomChannel(address, ChannelCredentialsFor(f), args);
}

}  // namespace microd::control
