// SPDX-License-Identifier: Apache-2.0
// microd's flags onto a DaemonConfig, and the MICROD_* variables of every
// flag, wherever it is defined (the variables once worked only for flags in
// the file holding main()).
#include "daemon/flags.h"

#include <stdlib.h>

#include <string>

#include "absl/flags/reflection.h"
#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "gtest/gtest.h"

namespace microd {
namespace {

TEST(FlagsTest, TheDefaultsMakeTheDefaultConfiguration) {
  absl::FlagSaver saver;
  auto c = DaemonConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  const DaemonConfig want;
  EXPECT_EQ(c->socket, want.socket);
  EXPECT_EQ(c->admin, want.admin);
  EXPECT_EQ(c->sparsify.density, want.sparsify.density);
  EXPECT_EQ(c->op_timeout, want.op_timeout);
  EXPECT_EQ(c->join_timeout, want.join_timeout);
  EXPECT_EQ(c->dense_floor, want.dense_floor);
  EXPECT_EQ(c->max_processes, want.max_processes);
}

TEST(FlagsTest, EveryFlagHasItsEnvironmentVariable) {
  absl::FlagSaver saver;
  int flags = 0;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    if (!absl::StrContains(flag->Filename(), "daemon/")) continue;
    ++flags;
    // Its own default, given through the variable, parses.
    const std::string env = "MICROD_" + absl::AsciiStrToUpper(name);
    setenv(env.c_str(), flag->DefaultValue().c_str(), 1);
  }
  EXPECT_GT(flags, 50);
  EXPECT_TRUE(ApplyEnvironment().ok());
  setenv("MICROD_DENSITY", "0.25", 1);
  setenv("MICROD_NODE_NAME", "from-env", 1);
  setenv("MICROD_TIMEOUT_MS", "1234", 1);
  setenv("MICROD_NONFINITE", "skip", 1);
  ASSERT_TRUE(ApplyEnvironment().ok());
  auto c = DaemonConfigFromFlags();
  ASSERT_TRUE(c.ok()) << c.status();
  EXPECT_EQ(c->sparsify.density, 0.25);
  EXPECT_EQ(c->node_name, "from-env");
  EXPECT_EQ(c->op_timeout, absl::Milliseconds(1234));
  EXPECT_TRUE(c->skip_nonfinite);
  // A bad value names its variable.
  setenv("MICROD_DENSE_FLOOR", "lots", 1);
  const absl::Status bad = ApplyEnvironment();
  EXPECT_TRUE(absl::StrContains(bad.message(), "MICROD_DENSE_FLOOR")) << bad;
  for (const auto& [name, flag] : absl::GetAllFlags()) {
    unsetenv(("MICROD_" + absl::AsciiStrToUpper(name)).c_str());
  }
}

TEST(FlagsTest, AFlagsBadValueIsNamed) {
  absl::FlagSaver saver;
  std::string error;
  ASSERT_TRUE(absl::FindCommandLineFlag("nonfinite")->ParseFrom("maybe", &error)) << error;
  auto c = DaemonConfigFromFlags();
  EXPECT_FALSE(c.ok());
  EXPECT_TRUE(absl::StartsWith(c.status().message(), "--nonfinite")) << c.status();
  ASSERT_TRUE(absl::FindCommandLineFlag("nonfinite")->ParseFrom("fail", &error)) << error;
  ASSERT_TRUE(absl::FindCommandLineFlag("local_size")->ParseFrom("0", &error)) << error;
  c = DaemonConfigFromFlags();
  EXPECT_TRUE(absl::StartsWith(c.status().message(), "--local_size")) << c.status();
}

}  // namespace
}  // namespace microd
