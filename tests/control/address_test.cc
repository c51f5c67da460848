// SPDX-License-Identifier: Apache-2.0
// Addresses of a multi-host job (daemon/control/address.h).
#include "daemon/control/address.h"

#include <arpa/inet.h>

#include "absl/strings/match.h"
#include "absl/time/clock.h"
#include "gtest/gtest.h"

namespace microd::control {
namespace {

TEST(Address, ParsesHostPortForms) {
  auto a = ParseHostPort("10.77.0.1:7000");
  ASSERT_TRUE(a.ok()) << a.status();
  EXPECT_EQ(a->host, "10.77.0.1");
  EXPECT_EQ(a->port, 7000);
  auto b = ParseHostPort("[fd00::1]:0");
  ASSERT_TRUE(b.ok()) << b.status();
  EXPECT_EQ(b->host, "fd00::1");
  EXPECT_EQ(b->port, 0);
  auto c = ParseHostPort("node-0.microd:7470");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->host, "node-0.microd");
  auto u = ParseHostPort("unix:/run/microd/admin.sock");
  ASSERT_TRUE(u.ok());
  EXPECT_EQ(u->host, "unix:/run/microd/admin.sock");
}

TEST(Address, RefusesMalformedAddressesSayingWhy) {
  for (const char* bad : {"10.0.0.1", "10.0.0.1:", "10.0.0.1:70000", "10.0.0.1:-1", "host:port",
                          "fd00::1:7000", "[fd00::1]7000", "[fd00::1", "unix:"}) {
    auto r = ParseHostPort(bad);
    EXPECT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_NE(ParseHostPort("fd00::1:7000").status().message().find("brackets"), std::string::npos);
}

TEST(Address, NodeZeroDialsTheAddressItListensOn) {
  // A specific address: that address (a multi-homed host listening on one
  // interface does not listen on loopback).
  EXPECT_EQ(*SelfDialAddress("10.77.0.1:7000", 7000), "10.77.0.1:7000");
  EXPECT_EQ(*SelfDialAddress("10.77.0.1:0", 41234), "10.77.0.1:41234");
  EXPECT_EQ(*SelfDialAddress("[fd00::1]:0", 5), "[fd00::1]:5");
  EXPECT_EQ(*SelfDialAddress("node-0:7470", 7470), "node-0:7470");
  // Every interface: loopback.
  EXPECT_EQ(*SelfDialAddress("0.0.0.0:7000", 7000), "127.0.0.1:7000");
  EXPECT_EQ(*SelfDialAddress("[::]:0", 9), "[::1]:9");
  EXPECT_EQ(*SelfDialAddress(":7000", 7000), "127.0.0.1:7000");
  EXPECT_FALSE(SelfDialAddress("nonsense", 1).ok());
}

TEST(Address, WildcardHosts) {
  for (const char* w : {"", "*", "0.0.0.0", "::"}) EXPECT_TRUE(IsWildcardHost(w)) << w;
  for (const char* s : {"127.0.0.1", "10.0.0.1", "localhost", "::1"}) {
    EXPECT_FALSE(IsWildcardHost(s)) << s;
  }
  EXPECT_EQ(JoinHostPort("fd00::1", 7), "[fd00::1]:7");
  EXPECT_EQ(JoinHostPort("10.0.0.1", 7), "10.0.0.1:7");
}

TEST(Address, LocalAddressTowardIsTheRoutesSource) {
  auto lo = LocalAddressToward("127.0.0.1:7000");
  ASSERT_TRUE(lo.ok()) << lo.status();
  EXPECT_EQ(*lo, "127.0.0.1");
  EXPECT_TRUE(IsLoopbackAddress(*lo));
  auto bad = LocalAddressToward("no-such-host.invalid:7000");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("no-such-host.invalid"), std::string::npos) << bad.status();
  EXPECT_FALSE(LocalAddressToward("unix:/tmp/x").ok());
}

TEST(Address, HostOfAGrpcPeer) {
  EXPECT_EQ(HostOfGrpcPeer("ipv4:10.89.0.7:41234"), "10.89.0.7");
  EXPECT_EQ(HostOfGrpcPeer("ipv6:[fd00::7]:41234"), "fd00::7");
  EXPECT_EQ(HostOfGrpcPeer("ipv6:%5Bfd00::7%5D:41234"), "fd00::7");
  EXPECT_EQ(HostOfGrpcPeer("ipv6:%5Bfe80::1%25eth0%5D:1"), "fe80::1%eth0");
  // Anything else names no address (and is never looked up).
  for (const char* s : {"unix:/run/microd/x.sock", "", "ipv4:", "ipv4:10.0.0.1", "ipv4:host:5",
                        "ipv6:[zz::1]:5", "dns:node0:7470", "ipv4:10.0.0.1:99999"}) {
    EXPECT_EQ(HostOfGrpcPeer(s), "") << s;
  }
}

TEST(Address, LocalAddressesAreThoseOfThisHost) {
  EXPECT_TRUE(IsLocalAddress("127.0.0.1"));
  EXPECT_TRUE(IsLocalAddress(PrimaryHostAddress()));
  // TEST-NET-1 (RFC 5737) is nobody's address; a name is not an address.
  EXPECT_FALSE(IsLocalAddress("192.0.2.77"));
  EXPECT_FALSE(IsLocalAddress("localhost"));
  EXPECT_FALSE(IsLocalAddress(""));
}

TEST(Address, PrimaryHostAddressIsAnIpv4Address) {
  const std::string ip = PrimaryHostAddress();
  in_addr parsed{};
  EXPECT_EQ(inet_pton(AF_INET, ip.c_str(), &parsed), 1) << ip;
}

}  // namespace
// The data plane's address: --hostname first, then this host's address for
// a wildcard coordinator, then where the coordinator saw the node come from,
// then the route to the coordinator; each says why it was chosen.
TEST(Address, TheDataPlaneAddressIsChosenInOrderSayingWhy) {
  const absl::Time soon = absl::Now() + absl::Seconds(1);
  auto given =
      ChooseDataPlaneAddress("10.1.2.3", "0.0.0.0:7470", "127.0.0.1:7470", "127.0.0.1", soon);
  ASSERT_TRUE(given.ok()) << given.status();
  EXPECT_EQ(given->address, "10.1.2.3");
  EXPECT_EQ(given->why, "--hostname");
  auto wildcard = ChooseDataPlaneAddress("", "0.0.0.0:7470", "127.0.0.1:7470", "", soon);
  ASSERT_TRUE(wildcard.ok()) << wildcard.status();
  EXPECT_EQ(wildcard->address, PrimaryHostAddress());
  EXPECT_TRUE(absl::StrContains(wildcard->why, "every interface")) << wildcard->why;
  auto observed = ChooseDataPlaneAddress("", "127.0.0.1:7470", "127.0.0.1:7470", "127.0.0.1", soon);
  ASSERT_TRUE(observed.ok()) << observed.status();
  EXPECT_EQ(observed->address, "127.0.0.1");
  EXPECT_TRUE(absl::StrContains(observed->why, "saw this node join from")) << observed->why;
  // Not an address of this host (a NAT in between): the route decides, and says so.
  auto routed = ChooseDataPlaneAddress("", "", "127.0.0.1:7470", "203.0.113.9", soon);
  ASSERT_TRUE(routed.ok()) << routed.status();
  EXPECT_EQ(routed->address, "127.0.0.1");
  EXPECT_TRUE(absl::StrContains(routed->why, "a NAT in between?")) << routed->why;
  auto bad = ChooseDataPlaneAddress("", "", "no-such-host.invalid:7470", "", absl::Now());
  EXPECT_FALSE(bad.ok());
  EXPECT_TRUE(absl::StrContains(bad.status().message(), "give --hostname")) << bad.status();
}

}  // namespace microd::control
