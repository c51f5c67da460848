// SPDX-License-Identifier: Apache-2.0
// Addresses of a multi-host job: what node 0 dials to reach the coordinator
// it serves, and which local address a node's data plane is reached on.
// Nothing here assumes that the nodes share a machine.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"

namespace microd::control {

struct HostPort {
  std::string host;  // without brackets for IPv6 literals
  int port = 0;
};

// Splits "host:port", "[v6]:port" or "unix:PATH" (host "unix:PATH", port 0).
// A missing or out-of-range port is an error.
absl::StatusOr<HostPort> ParseHostPort(const std::string& address);

// "host:port", with brackets around an IPv6 literal.
std::string JoinHostPort(const std::string& host, int port);

// True for the addresses that mean "every interface" (0.0.0.0, ::, "", *).
bool IsWildcardHost(const std::string& host);

// The address node 0 dials to reach the coordinator it serves on `listen`
// (the address as given, on the port actually bound): the host itself when
// it is a specific address (a multi-homed host listening on one interface is
// not listening on loopback), loopback for a wildcard.
absl::StatusOr<std::string> SelfDialAddress(const std::string& listen, int bound_port);

// The local IP address this host uses to reach `address` ("host:port"; the
// name is resolved): the source address of the route towards it. That is
// the address peers on the same network reach this node on. Sends nothing.
absl::StatusOr<std::string> LocalAddressToward(const std::string& address);

// This host's address for peers on other hosts, for a node that cannot tell
// it from a route (node 0 serving the coordinator on every interface): the
// host name's address if an interface that is up has it, else the first
// non-loopback address of such an interface, else 127.0.0.1 (a host alone).
std::string PrimaryHostAddress();

// True for 127.0.0.0/8 and ::1.
bool IsLoopbackAddress(const std::string& ip);

// The IP address in a gRPC peer string ("ipv4:10.0.0.7:41234",
// "ipv6:[fd00::7]:41234", brackets possibly %-encoded), or "" for any other
// kind of peer (unix sockets) or a string not of that form.
std::string HostOfGrpcPeer(const std::string& peer);

// True when `ip` is an address of this host (this network namespace): a
// socket can be bound to it.
bool IsLocalAddress(const std::string& ip);

// The address this node's data plane is reached on, and why it was chosen
// (for the log).
struct DataPlaneAddress {
  std::string address;
  std::string why;
};
// `hostname` when given; else on a node serving the coordinator on every
// interface (`coordinator_listen` a wildcard) this host's address; else
// `observed_host` (where the coordinator saw this node's join come from)
// when it is one of this host's; else the source address of the route to
// `coordinator_address`, its name retried until `deadline` (a job's DNS may
// catch up late).
absl::StatusOr<DataPlaneAddress> ChooseDataPlaneAddress(const std::string& hostname,
                                                        const std::string& coordinator_listen,
                                                        const std::string& coordinator_address,
                                                        const std::string& observed_host,
                                                        absl::Time deadline);

}  // namespace microd::control
