// SPDX-License-Identifier: Apache-2.0
// The C API as a C++ program sees it: the header compiles as C++, every
// status has a string, bad arguments are refused with a message, and a dead
// daemon gives a clear error rather than a hang.
#include <signal.h>
#include <stdlib.h>
#include <sys/wait.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <string>

#include "absl/strings/match.h"
#include "gtest/gtest.h"
#include "microd/microd.h"
#include "tests/integration/process_util.h"

namespace {

using microd::testing::MakeTempDir;
using microd::testing::ReadPortFile;
using microd::testing::Spawn;

// A daemon of a one-node job serving `local_size` processes on dir's
// socket (dir/microd.sock), once it is up.
pid_t StartDaemon(const std::string& dir, int local_size = 1) {
  const pid_t daemon =
      Spawn({MICROD_DAEMON, "--socket=" + dir + "/microd.sock", "--nodes=1",
             "--local_size=" + std::to_string(local_size), "--coordinator_listen=127.0.0.1:0",
             "--admin=127.0.0.1:0", "--admin_port_file=" + dir + "/admin"},
            dir + "/daemon.log");
  EXPECT_GT(ReadPortFile(dir + "/admin", std::chrono::seconds(20)), 0);
  return daemon;
}

TEST(ClientApi, VersionAndStatusStrings) {
  EXPECT_EQ(microd_version(), MICROD_VERSION_CODE);
  const char* names[] = {"MICROD_OK",
                         "MICROD_ERR_INVALID_ARGUMENT",
                         "MICROD_ERR_UNAVAILABLE",
                         "MICROD_ERR_TIMEOUT",
                         "MICROD_ERR_MISMATCH",
                         "MICROD_ERR_JOB_FAILED",
                         "MICROD_ERR_UNSUPPORTED",
                         "MICROD_ERR_PROTOCOL",
                         "MICROD_ERR_RESOURCE",
                         "MICROD_ERR_PERMISSION",
                         "MICROD_ERR_NONFINITE",
                         "MICROD_ERR_INTERNAL",
                         "MICROD_ERR_CLOSED",
                         "MICROD_ERR_MEMBERSHIP"};
  for (int s = 0; s <= MICROD_ERR_MEMBERSHIP; ++s) {
    EXPECT_TRUE(absl::StartsWith(microd_status_string(static_cast<microd_status>(s)), names[s]))
        << s;
  }
  EXPECT_TRUE(absl::StartsWith(microd_status_string(static_cast<microd_status>(999)),
                               "MICROD_ERR_UNKNOWN"));
}

TEST(ClientApi, BadArgumentsAreRefusedWithAMessage) {
  microd_options o;
  microd_options_init(&o);
  EXPECT_EQ(o.struct_size, sizeof(microd_options));
  EXPECT_EQ(microd_connect(&o, nullptr), MICROD_ERR_INVALID_ARGUMENT);
  o.struct_size = 3;
  microd_client* c = reinterpret_cast<microd_client*>(0x1);
  EXPECT_EQ(microd_connect(&o, &c), MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(c, nullptr);
  EXPECT_TRUE(absl::StrContains(microd_last_error(nullptr), "struct_size"));
  // Calls on a null handle never crash.
  float* data;
  int32_t id;
  uint64_t ticket;
  microd_job_info info;
  EXPECT_EQ(microd_register_host_buffer(nullptr, "x", 1, &data, &id), MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(microd_allreduce_async(nullptr, 0, &ticket), MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(microd_wait(nullptr, 1, 0), MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(microd_job_info_get(nullptr, &info), MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(microd_register_cuda_buffer(nullptr, "x", &info, 1, nullptr, &id),
            MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(microd_allreduce_cuda_async(nullptr, 0, nullptr, &ticket), MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(microd_close(nullptr), MICROD_OK);
}

TEST(ClientApi, NoDaemonIsUnavailableWithinTheTimeout) {
  microd_options o;
  microd_options_init(&o);
  o.socket_path = "/nonexistent/microd.sock";
  o.timeout_ms = 200;
  microd_client* c = nullptr;
  const auto start = std::chrono::steady_clock::now();
  EXPECT_EQ(microd_connect(&o, &c), MICROD_ERR_UNAVAILABLE);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_TRUE(absl::StrContains(microd_last_error(nullptr), "/nonexistent/microd.sock"));
}

TEST(ClientApi, ArgumentChecksAndADeadDaemon) {
  const std::string dir = MakeTempDir("client");
  const std::string sock = dir + "/microd.sock";
  const pid_t daemon = StartDaemon(dir);
  microd_options o;
  microd_options_init(&o);
  o.socket_path = sock.c_str();
  o.timeout_ms = 20000;
  microd_client* c = nullptr;
  ASSERT_EQ(microd_connect(&o, &c), MICROD_OK) << microd_last_error(nullptr);
  microd_job_info info;
  ASSERT_EQ(microd_job_info_get(c, &info), MICROD_OK);
  EXPECT_EQ(info.world_size, 1);
  EXPECT_EQ(info.rank, 0);

  float* data = nullptr;
  int32_t id = -1;
  EXPECT_EQ(microd_register_host_buffer(c, "", 10, &data, &id), MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(microd_register_host_buffer(c, "w", 0, &data, &id), MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(microd_register_host_buffer(c, "w", uint64_t{1} << 32, &data, &id),
            MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "2^32"));
  ASSERT_EQ(microd_register_host_buffer(c, "w", 1000, &data, &id), MICROD_OK)
      << microd_last_error(c);
  EXPECT_EQ(microd_register_host_buffer(c, "w", 1000, &data, &id), MICROD_ERR_INVALID_ARGUMENT);
  for (int i = 0; i < 1000; ++i) data[i] = 2.0f;
  ASSERT_EQ(microd_allreduce(c, id, 20000), MICROD_OK) << microd_last_error(c);
  EXPECT_EQ(data[0], 2.0f);  // one process: the average is itself
  uint64_t t1, t2;
  ASSERT_EQ(microd_allreduce_async(c, id, &t1), MICROD_OK);
  EXPECT_EQ(microd_allreduce_async(c, id, &t2), MICROD_ERR_INVALID_ARGUMENT);  // one at a time
  EXPECT_EQ(microd_wait(c, t1, 20000), MICROD_OK);
  EXPECT_EQ(microd_wait(c, 12345, 0), MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(microd_allreduce_async(c, 77, &t2), MICROD_ERR_INVALID_ARGUMENT);

  // NaN in the gradient: that step fails, the next one works.
  data[3] = std::numeric_limits<float>::quiet_NaN();
  EXPECT_EQ(microd_allreduce(c, id, 20000), MICROD_ERR_NONFINITE);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "'w'")) << microd_last_error(c);
  for (int i = 0; i < 1000; ++i) data[i] = 1.0f;
  EXPECT_EQ(microd_allreduce(c, id, 20000), MICROD_OK) << microd_last_error(c);

  // The daemon dies: a clear error, quickly.
  kill(daemon, SIGKILL);
  waitpid(daemon, nullptr, 0);
  const auto start = std::chrono::steady_clock::now();
  const microd_status s = microd_allreduce(c, id, 20000);
  EXPECT_TRUE(s == MICROD_ERR_UNAVAILABLE) << microd_status_string(s);
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::seconds(2));
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "daemon")) << microd_last_error(c);
  EXPECT_EQ(microd_close(c), MICROD_OK);
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

// A wait that times out says which bucket it waited for (a trainer may
// wait on several at once) and what for; before, only the ticket's number.
// The node's second process never connects.
TEST(ClientApi, AWaitThatTimesOutNamesTheBucket) {
  const std::string dir = MakeTempDir("client");
  const std::string sock = dir + "/microd.sock";
  const pid_t daemon = StartDaemon(dir, 2);
  microd_options o;
  microd_options_init(&o);
  o.socket_path = sock.c_str();
  o.local_rank = 0;
  o.timeout_ms = 20000;
  microd_client* c = nullptr;
  ASSERT_EQ(microd_connect(&o, &c), MICROD_OK) << microd_last_error(nullptr);
  float* data = nullptr;
  int32_t id = -1;
  ASSERT_EQ(microd_register_host_buffer(c, "fc.weight", 1000, &data, &id), MICROD_OK)
      << microd_last_error(c);
  EXPECT_EQ(microd_allreduce(c, id, 300), MICROD_ERR_TIMEOUT);
  // And, from the daemon, what it waits for: the node's other process.
  EXPECT_TRUE(absl::StrContains(microd_last_error(c),
                                "(bucket 'fc.weight') not complete after 300 ms: bucket "
                                "'fc.weight' was submitted on node 0"))
      << microd_last_error(c);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c),
                                "waiting for local process(es) 1 (not connected) to submit it"))
      << microd_last_error(c);
  EXPECT_EQ(microd_close(c), MICROD_OK);
  kill(daemon, SIGTERM);
  waitpid(daemon, nullptr, 0);
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

// CUDA buffers where CUDA is not usable: a clear UNSUPPORTED, nothing else
// changes and the handle keeps working. Runs without a GPU (a driver that
// cannot load is what a machine without one has; the CUDA toolkit's stub
// driver, where the build found one, is a driver without a GPU).
TEST(ClientApi, CudaBufferWithoutUsableCudaIsUnsupported) {
  const std::string dir = MakeTempDir("client-cuda");
  const std::string sock = dir + "/microd.sock";
  const pid_t daemon = StartDaemon(dir);
  microd_options o;
  microd_options_init(&o);
  o.socket_path = sock.c_str();
  o.timeout_ms = 20000;
  microd_client* c = nullptr;
  ASSERT_EQ(microd_connect(&o, &c), MICROD_OK) << microd_last_error(nullptr);

  alignas(16) float not_device_memory[8] = {};
  int32_t id = -1;
  // Argument checks come first, whatever CUDA can do here.
  EXPECT_EQ(microd_register_cuda_buffer(c, "g", nullptr, 8, nullptr, &id),
            MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "NULL")) << microd_last_error(c);
  EXPECT_EQ(microd_register_cuda_buffer(c, "g", reinterpret_cast<char*>(not_device_memory) + 2, 4,
                                        nullptr, &id),
            MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "aligned")) << microd_last_error(c);
  EXPECT_EQ(microd_register_cuda_buffer(c, "g", not_device_memory, 0, nullptr, &id),
            MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(microd_register_cuda_buffer(c, "", not_device_memory, 8, nullptr, &id),
            MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_EQ(microd_register_cuda_buffer(c, "g", not_device_memory, 8, nullptr, nullptr),
            MICROD_ERR_INVALID_ARGUMENT);

  ASSERT_EQ(setenv("MICROD_LIBCUDA", "/nonexistent/libcuda.so.1", 1), 0);
  EXPECT_EQ(microd_register_cuda_buffer(c, "g", not_device_memory, 8, nullptr, &id),
            MICROD_ERR_UNSUPPORTED);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "/nonexistent/libcuda.so.1"))
      << microd_last_error(c);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "'g'")) << microd_last_error(c);
  EXPECT_EQ(id, -1);
#ifdef MICROD_CUDA_STUB_LIBCUDA
  ASSERT_EQ(setenv("MICROD_LIBCUDA", MICROD_CUDA_STUB_LIBCUDA, 1), 0);
  EXPECT_EQ(microd_register_cuda_buffer(c, "g", not_device_memory, 8, nullptr, &id),
            MICROD_ERR_UNSUPPORTED);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "cuInit")) << microd_last_error(c);
  EXPECT_EQ(id, -1);
#endif
  unsetenv("MICROD_LIBCUDA");

  // Nothing was registered: the name is free and the handle works.
  float* data = nullptr;
  ASSERT_EQ(microd_register_host_buffer(c, "g", 100, &data, &id), MICROD_OK)
      << microd_last_error(c);
  for (int i = 0; i < 100; ++i) data[i] = 3.0f;
  uint64_t ticket = 0;
  // A host buffer takes no CUDA stream; without one it submits as usual.
  EXPECT_EQ(microd_allreduce_cuda_async(c, id, reinterpret_cast<void*>(0x1), &ticket),
            MICROD_ERR_INVALID_ARGUMENT);
  EXPECT_TRUE(absl::StrContains(microd_last_error(c), "host buffer")) << microd_last_error(c);
  ASSERT_EQ(microd_allreduce_cuda_async(c, id, nullptr, &ticket), MICROD_OK)
      << microd_last_error(c);
  EXPECT_EQ(microd_wait(c, ticket, 20000), MICROD_OK) << microd_last_error(c);
  EXPECT_EQ(data[0], 3.0f);
  EXPECT_EQ(microd_close(c), MICROD_OK);
  kill(daemon, SIGTERM);
  waitpid(daemon, nullptr, 0);
  std::error_code ignored;
  std::filesystem::remove_all(dir, ignored);
}

}  // namespace
