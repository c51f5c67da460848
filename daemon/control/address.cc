// SPDX-License-Identifier: Apache-2.0
#include "daemon/control/address.h"

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <net/if.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"

namespace microd::control {
namespace {

// Text of an AF_INET / AF_INET6 socket address, or "".
std::string AddressText(const sockaddr* sa) {
  char text[INET6_ADDRSTRLEN] = {0};
  const void* raw = nullptr;
  if (sa->sa_family == AF_INET) raw = &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr;
  if (sa->sa_family == AF_INET6) raw = &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr;
  if (raw == nullptr || inet_ntop(sa->sa_family, raw, text, sizeof text) == nullptr) return "";
  return text;
}

}  // namespace

absl::StatusOr<HostPort> ParseHostPort(const std::string& address) {
  if (absl::StartsWith(address, "unix:")) {
    if (address.size() == 5) return absl::InvalidArgumentError("unix: address without a path");
    return HostPort{address, 0};
  }
  HostPort hp;
  std::string port;
  if (absl::StartsWith(address, "[")) {
    const size_t close = address.find(']');
    if (close == std::string::npos || close + 1 >= address.size() || address[close + 1] != ':') {
      return absl::InvalidArgumentError(
          absl::StrCat("bad address '", address, "' (expected [v6 address]:port)"));
    }
    hp.host = address.substr(1, close - 1);
    port = address.substr(close + 2);
  } else {
    const size_t colon = address.rfind(':');
    if (colon == std::string::npos) {
      return absl::InvalidArgumentError(
          absl::StrCat("bad address '", address, "' (expected host:port)"));
    }
    hp.host = address.substr(0, colon);
    if (hp.host.find(':') != std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          "bad address '", address, "' (an IPv6 address goes in brackets: [::1]:port)"));
    }
    port = address.substr(colon + 1);
  }
  if (!absl::SimpleAtoi(port, &hp.port) || hp.port < 0 || hp.port > 65535) {
    return absl::InvalidArgumentError(
        absl::StrCat("bad port '", port, "' in '", address, "' (0 to 65535)"));
  }
  return hp;
}

std::string JoinHostPort(const std::string& host, int port) {
  if (host.find(':') != std::string::npos) return absl::StrCat("[", host, "]:", port);
  return absl::StrCat(host, ":", port);
}

bool IsWildcardHost(const std::string& host) {
  return host.empty() || host == "*" || host == "0.0.0.0" || host == "::" || host == "[::]";
}

absl::StatusOr<std::string> SelfDialAddress(const std::string& listen, int bound_port) {
  auto hp = ParseHostPort(listen);
  if (!hp.ok()) return hp.status();
  if (absl::StartsWith(hp->host, "unix:")) return hp->host;
  if (IsWildcardHost(hp->host)) {
    return JoinHostPort(hp->host == "::" ? "::1" : "127.0.0.1", bound_port);
  }
  return JoinHostPort(hp->host, bound_port);
}

absl::StatusOr<std::string> LocalAddressToward(const std::string& address) {
  auto hp = ParseHostPort(address);
  if (!hp.ok()) return hp.status();
  if (absl::StartsWith(hp->host, "unix:")) {
    return absl::InvalidArgumentError(
        absl::StrCat("'", address, "' is a unix socket: give --hostname explicitly"));
  }
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  const std::string port = std::to_string(hp->port == 0 ? 9 : hp->port);
  if (const int rc = getaddrinfo(hp->host.c_str(), port.c_str(), &hints, &found); rc != 0) {
    return absl::UnavailableError(
        absl::StrCat("cannot resolve '", hp->host, "': ", gai_strerror(rc)));
  }
  absl::Status last = absl::UnavailableError(absl::StrCat("no address for '", hp->host, "'"));
  for (addrinfo* ai = found; ai != nullptr; ai = ai->ai_next) {
    // A connected UDP socket has the source address of the route; nothing
    // is sent.
    const int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof local;
    if (connect(fd, ai->ai_addr, ai->ai_addrlen) != 0 ||
        getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) != 0) {
      last = absl::UnavailableError(
          absl::StrCat("no route to '", hp->host, "': ", std::strerror(errno)));
      close(fd);
      continue;
    }
    close(fd);
    const std::string ip = AddressText(reinterpret_cast<const sockaddr*>(&local));
    if (ip.empty()) continue;
    freeaddrinfo(found);
    return ip;
  }
  freeaddrinfo(found);
  return last;
}

bool IsLoopbackAddress(const std::string& ip) {
  return absl::StartsWith(ip, "127.") || ip == "::1";
}

std::string PrimaryHostAddress() {
  // This host's (this network namespace's) addresses, in interface order.
  std::vector<std::string> local;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) == 0) {
    for (ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
      if (i->ifa_addr == nullptr || i->ifa_addr->sa_family != AF_INET) continue;
      if ((i->ifa_flags & IFF_UP) == 0 || (i->ifa_flags & IFF_RUNNING) == 0 ||
          (i->ifa_flags & IFF_LOOPBACK) != 0) {
        continue;
      }
      const std::string ip = AddressText(i->ifa_addr);
      if (!ip.empty() && !IsLoopbackAddress(ip)) local.push_back(ip);
    }
    freeifaddrs(list);
  }
  // The host name's address when it is one of them (a name may resolve to
  // an address of another namespace or an old one in /etc/hosts).
  char name[256] = {0};
  if (!local.empty() && gethostname(name, sizeof name - 1) == 0) {
    addrinfo hints{};
    hints.ai_family = AF_INET;
    hints.ai_socktype = SOCK_STREAM;
    addrinfo* found = nullptr;
    if (getaddrinfo(name, nullptr, &hints, &found) == 0) {
      std::string chosen;
      for (addrinfo* ai = found; ai != nullptr && chosen.empty(); ai = ai->ai_next) {
        const std::string ip = AddressText(ai->ai_addr);
        if (std::find(local.begin(), local.end(), ip) != local.end()) chosen = ip;
      }
      freeaddrinfo(found);
      if (!chosen.empty()) return chosen;
    }
  }
  return local.empty() ? "127.0.0.1" : local.front();
}

std::string HostOfGrpcPeer(const std::string& peer) {
  std::string rest;
  if (absl::StartsWith(peer, "ipv4:")) {
    rest = peer.substr(5);
  } else if (absl::StartsWith(peer, "ipv6:")) {
    rest = absl::StrReplaceAll(peer.substr(5), {{"%5B", "["},
                                                {"%5D", "]"},
                                                {"%5b", "["},
                                                {"%5d", "]"},
                                                {"%3A", ":"},
                                                {"%3a", ":"},
                                                {"%25", "%"}});
  } else {
    return "";
  }
  auto hp = ParseHostPort(rest);
  if (!hp.ok() || hp->host.empty()) return "";
  // Only a numeric address: nothing here may need a name lookup.
  in6_addr v6{};
  in_addr v4{};
  const std::string bare = hp->host.substr(0, hp->host.find('%'));
  if (inet_pton(AF_INET, bare.c_str(), &v4) != 1 && inet_pton(AF_INET6, bare.c_str(), &v6) != 1) {
    return "";
  }
  return hp->host;
}

bool IsLocalAddress(const std::string& ip) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  hints.ai_flags = AI_NUMERICHOST;
  addrinfo* found = nullptr;
  if (getaddrinfo(ip.c_str(), "0", &hints, &found) != 0) return false;
  bool local = false;
  for (addrinfo* ai = found; ai != nullptr && !local; ai = ai->ai_next) {
    const int fd = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    local = bind(fd, ai->ai_addr, ai->ai_addrlen) == 0;
    close(fd);
  }
  freeaddrinfo(found);
  return local;
}

absl::StatusOr<DataPlaneAddress> ChooseDataPlaneAddress(const std::string& hostname,
                                                        const std::string& coordinator_listen,
                                                        const std::string& coordinator_address,
                                                        const std::string& observed_host,
                                                        absl::Time deadline) {
  if (!hostname.empty()) return DataPlaneAddress{hostname, "--hostname"};
  auto listen = ParseHostPort(coordinator_listen);
  if (!coordinator_listen.empty() && listen.ok() && IsWildcardHost(listen->host)) {
    return DataPlaneAddress{PrimaryHostAddress(),
                            "this host's address (the coordinator listens on every interface)"};
  }
  if (!observed_host.empty() && IsLocalAddress(observed_host)) {
    // What the coordinator saw is the source address of this node's route
    // to it: no name lookup here (a container network's DNS may answer
    // gRPC's resolver and still fail this process's own lookups).
    return DataPlaneAddress{observed_host,
                            absl::StrCat("the address the coordinator at ", coordinator_address,
                                         " saw this node join from")};
  }
  auto local = LocalAddressToward(coordinator_address);
  for (bool said = false;
       !local.ok() && absl::IsUnavailable(local.status()) && absl::Now() < deadline;) {
    if (!said) {
      MICROD_LOG(Warning, "%s; retrying", std::string(local.status().message()).c_str());
      said = true;
    }
    absl::SleepFor(absl::Milliseconds(250));
    local = LocalAddressToward(coordinator_address);
  }
  if (!local.ok()) {
    return absl::Status(local.status().code(),
                        absl::StrCat("cannot tell this node's address from the route to the "
                                     "coordinator (give --hostname): ",
                                     local.status().message()));
  }
  DataPlaneAddress chosen{*local,
                          absl::StrCat("the route to the coordinator at ", coordinator_address)};
  if (!observed_host.empty()) {
    absl::StrAppend(&chosen.why, "; the coordinator saw this node join from ", observed_host,
                    ", not an address of this host: a NAT in between?");
  }
  return chosen;
}

}  // namespace microd::control
