// SPDX-License-Identifier: Apache-2.0
// CUDA buffers through the daemons (issue G, "Buffers"): training processes
// register cudaMalloc'd memory through the C API and the results equal the
// CPU path's bit for bit (the reference of daemon_cluster.h, and host
// buffers fed the same gradients); memory legacy CUDA IPC cannot share is
// refused with a clear error and the process goes on. Skipped, with CUDA's
// reason, where no GPU is usable (scripts/gpu-check.sh counts a skip as a
// failure). Nothing touches CUDA before a test body runs.
#include <cuda_runtime_api.h>

#include <chrono>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "gtest/gtest.h"
#include "microd/microd.h"
#include "tests/integration/daemon_cluster.h"
#include "tests/integration/process_util.h"
#include "tests/transport/nccl_test_env.h"

namespace microd::testing {
namespace {

bool GpuUsable(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    *why = cudaGetErrorString(e);  // e.g. "CUDA driver version is insufficient ..."
    return false;
  }
  if (n == 0) {
    *why = "no CUDA device";
    return false;
  }
  return true;
}

#define REQUIRE_GPU()                                                         \
  do {                                                                        \
    std::string why_;                                                         \
    if (!GpuUsable(&why_)) GTEST_SKIP() << "no usable CUDA device: " << why_; \
  } while (0)

#define ASSERT_CUDA(call)                                                  \
  do {                                                                     \
    const cudaError_t e_ = (call);                                         \
    ASSERT_EQ(e_, cudaSuccess) << #call << ": " << cudaGetErrorString(e_); \
  } while (0)

// n daemons x L processes; mode(node, local) is the client's mode (cuda,
// legacy or host): every update equals the reference's.
// `nccl`: the daemons reduce on the GPU over NCCL (--transport=nccl), each
// with its own NCCL_HOSTID (NCCL refuses two ranks of one communicator on one
// GPU of one host). With 2 nodes every element's sum has two terms, so
// NCCL's summation order cannot change a bit and the CPU reference holds.
void RunAndCompare(int n, int L, const std::function<std::string(int, int)>& mode,
                   bool nccl = false) {
  SCOPED_TRACE(absl::StrCat(n, " daemons x ", L, " processes", nccl ? " over NCCL" : ""));
  const std::vector<BucketSpec> buckets = {{"embed", 1000}, {"conv", 70001}, {"fc", 200003}};
  const long steps = 20;
  std::vector<std::string> flags;
  std::function<std::vector<std::string>(int)> env;
  if (nccl) {
    flags = {"--transport=nccl", "--cuda_device=0"};
    env = [](int r) { return NcclLoopbackVariables(absl::StrCat("microd-test-", r)); };
  }
  DaemonCluster cluster(n, L, flags, env);
  cluster.StartClients(buckets, steps, -1, -1, -1,
                       [&](int r, int l) { return std::vector<std::string>{mode(r, l)}; });
  const auto codes = cluster.WaitClients(std::chrono::seconds(240));
  ExpectMatchesReference(cluster, codes, Reference(n, L, buckets, steps), n, L, buckets, steps);
  if (::testing::Test::HasFatalFailure()) return;
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->job_state(), microd::v1::JOB_STATE_RUNNING);
  for (const auto& b : status->buckets()) {
    EXPECT_EQ(b.steps(), static_cast<uint64_t>(steps)) << b.name();
  }
}

TEST(DaemonCuda, TwoDaemonsWithCudaBuffersEqualTheCpuPath) {
  REQUIRE_GPU();
  RunAndCompare(2, 1, [](int, int) { return "cuda"; });
}

// The GPU path end to end: selection in CUDA kernels and the exchange over
// NCCL, in place on the processes' buffers (device-resident engine).
TEST(DaemonCuda, NcclDaemonsReduceInPlaceAndEqualTheCpuPath) {
  REQUIRE_GPU();
  RunAndCompare(
      2, 1, [](int, int) { return "cuda"; }, /*nccl=*/true);
  RunAndCompare(
      2, 2, [](int, int l) { return l == 0 ? "cuda" : "legacy"; }, /*nccl=*/true);
}

TEST(DaemonCuda, LegacyDefaultStreamSubmissionsEqualTheCpuPath) {
  REQUIRE_GPU();
  RunAndCompare(2, 1, [](int, int) { return "legacy"; });
}

TEST(DaemonCuda, CudaAndHostProcessesOnOneNodeEqualTheCpuPath) {
  REQUIRE_GPU();
  RunAndCompare(2, 2, [](int, int l) { return l == 0 ? "cuda" : "host"; });
}

class Connection {
 public:
  explicit Connection(const std::string& socket) {
    microd_options o;
    microd_options_init(&o);
    o.socket_path = socket.c_str();
    o.timeout_ms = 20000;
    status_ = microd_connect(&o, &c_);
  }
  ~Connection() { microd_close(c_); }
  microd_status status() const { return status_; }
  microd_client* get() const { return c_; }

 private:
  microd_client* c_ = nullptr;
  microd_status status_;
};

// Host buckets and CUDA buckets fed the same gradients get the same bits, in
// this process: sparse (above the dense floor) and dense, the CUDA ones at
// offsets inside one allocation, uploaded on a non-blocking stream and
// submitted without synchronising; with `slow`, behind a long queue of work.
void StepAndCompare(microd_client* c, const std::vector<int32_t>& host_ids,
                    const std::vector<float*>& host, const std::vector<int32_t>& cuda_ids,
                    const std::vector<float*>& device, const std::vector<float*>& upload,
                    const std::vector<uint64_t>& counts, uint64_t step, cudaStream_t stream,
                    float* slow, size_t slow_bytes) {
  std::vector<uint64_t> tickets;
  if (slow != nullptr) {
    // Tens of milliseconds of work ahead of the uploads on the same stream.
    for (int i = 0; i < 256; ++i) ASSERT_CUDA(cudaMemsetAsync(slow, i, slow_bytes, stream));
  }
  for (size_t b = 0; b < counts.size(); ++b) {
    const size_t bytes = counts[b] * sizeof(float);
    e2e_fill(host[b], counts[b], 0, static_cast<int>(b), step);
    std::memcpy(upload[b], host[b], bytes);  // pinned: read by the asynchronous upload
    ASSERT_CUDA(cudaMemsetAsync(device[b], 0xFF, bytes, stream));  // NaN until the upload lands
    ASSERT_CUDA(cudaMemcpyAsync(device[b], upload[b], bytes, cudaMemcpyHostToDevice, stream));
    uint64_t t = 0;
    ASSERT_EQ(microd_allreduce_cuda_async(c, cuda_ids[b], stream, &t), MICROD_OK)
        << microd_last_error(c);
    tickets.push_back(t);
    ASSERT_EQ(microd_allreduce_async(c, host_ids[b], &t), MICROD_OK) << microd_last_error(c);
    tickets.push_back(t);
  }
  for (uint64_t t : tickets) ASSERT_EQ(microd_wait(c, t, 30000), MICROD_OK) << microd_last_error(c);
  for (size_t b = 0; b < counts.size(); ++b) {
    std::vector<float> got(counts[b]);
    ASSERT_CUDA(
        cudaMemcpy(got.data(), device[b], counts[b] * sizeof(float), cudaMemcpyDeviceToHost));
    ASSERT_EQ(std::memcmp(got.data(), host[b], counts[b] * sizeof(float)), 0)
        << "bucket " << b << " step " << step
        << ": the CUDA buffer's update differs from the host buffer's";
  }
}

TEST(DaemonCuda, InProcessCudaBuffersMatchHostBuffersAndBadMemoryIsRefused) {
  REQUIRE_GPU();
  DaemonCluster cluster(1, 1);
  ASSERT_CUDA(cudaSetDevice(0));
  const std::vector<uint64_t> counts = {100003, 1000};  // sparse, dense
  float* alloc = nullptr;
  ASSERT_CUDA(
      cudaMalloc(reinterpret_cast<void**>(&alloc), (counts[0] + counts[1] + 256) * sizeof(float)));
  std::vector<float*> upload(2);
  for (int b = 0; b < 2; ++b)
    ASSERT_CUDA(cudaMallocHost(reinterpret_cast<void**>(&upload[b]), counts[b] * sizeof(float)));
  cudaStream_t stream = nullptr;
  ASSERT_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  const size_t slow_bytes = size_t{256} << 20;
  float* slow = nullptr;
  ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&slow), slow_bytes));

  for (int session = 0; session < 2; ++session) {
    SCOPED_TRACE(absl::StrCat("session ", session));
    // The second session registers the same names again (after the first
    // one's close), in a fresh allocation: the daemon closed the old mapping
    // and opens the new one.
    if (session == 1) {
      ASSERT_CUDA(cudaFree(alloc));
      ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&alloc),
                             (counts[0] + counts[1] + 256) * sizeof(float)));
    }
    std::vector<float*> dev = {alloc + 64, alloc + 64 + counts[0] + 64};
    Connection conn(cluster.socket(0));
    ASSERT_EQ(conn.status(), MICROD_OK) << microd_last_error(nullptr);
    microd_client* c = conn.get();
    std::vector<int32_t> host_ids(2), cuda_ids(2);
    std::vector<float*> host(2);
    for (int b = 0; b < 2; ++b) {
      ASSERT_EQ(microd_register_host_buffer(c, absl::StrCat("host", b).c_str(), counts[b], &host[b],
                                            &host_ids[b]),
                MICROD_OK)
          << microd_last_error(c);
      ASSERT_EQ(microd_register_cuda_buffer(c, absl::StrCat("cuda", b).c_str(), dev[b], counts[b],
                                            nullptr, &cuda_ids[b]),
                MICROD_OK)
          << microd_last_error(c);
    }
    for (uint64_t t = 0; t < 4; ++t) {
      StepAndCompare(c, host_ids, host, cuda_ids, dev, upload, counts, session * 4 + t, stream,
                     t == 2 ? slow : nullptr, slow_bytes);
      if (HasFatalFailure()) return;
    }
    if (session == 1) break;

    // Refused, each with its reason; the process goes on.
    int32_t id = -1;
    std::vector<float> pageable(1024);
    EXPECT_EQ(microd_register_cuda_buffer(c, "x", pageable.data(), 1024, nullptr, &id),
              MICROD_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(microd_last_error(c), "cudaMalloc")) << microd_last_error(c);
    float* pinned = nullptr;
    ASSERT_CUDA(cudaMallocHost(reinterpret_cast<void**>(&pinned), 4096));
    EXPECT_EQ(microd_register_cuda_buffer(c, "x", pinned, 1024, nullptr, &id),
              MICROD_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(microd_last_error(c), "not device memory"))
        << microd_last_error(c);
    ASSERT_CUDA(cudaFreeHost(pinned));
    float* managed = nullptr;
    ASSERT_CUDA(cudaMallocManaged(reinterpret_cast<void**>(&managed), 4096));
    EXPECT_EQ(microd_register_cuda_buffer(c, "x", managed, 1024, nullptr, &id),
              MICROD_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(microd_last_error(c), "managed")) << microd_last_error(c);
    ASSERT_CUDA(cudaFree(managed));
    float* small = nullptr;
    ASSERT_CUDA(cudaMalloc(reinterpret_cast<void**>(&small), 4096));
    EXPECT_EQ(microd_register_cuda_buffer(c, "x", small + 512, uint64_t{1} << 20, nullptr, &id),
              MICROD_ERR_INVALID_ARGUMENT);
    EXPECT_TRUE(absl::StrContains(microd_last_error(c), "past the end")) << microd_last_error(c);
    ASSERT_CUDA(cudaFree(small));
    int pools = 0;
    ASSERT_CUDA(cudaDeviceGetAttribute(&pools, cudaDevAttrMemoryPoolsSupported, 0));
    if (pools) {
      float* pooled = nullptr;
      ASSERT_CUDA(cudaMallocAsync(reinterpret_cast<void**>(&pooled), 4096, stream));
      ASSERT_CUDA(cudaStreamSynchronize(stream));
      EXPECT_EQ(microd_register_cuda_buffer(c, "x", pooled, 1024, nullptr, &id),
                MICROD_ERR_UNSUPPORTED);
      EXPECT_TRUE(absl::StrContains(microd_last_error(c), "cudaMallocAsync"))
          << microd_last_error(c);
      ASSERT_CUDA(cudaFreeAsync(pooled, stream));
      ASSERT_CUDA(cudaStreamSynchronize(stream));
    }
    EXPECT_EQ(id, -1);
    EXPECT_EQ(microd_register_cuda_buffer(c, "cuda0", dev[0], counts[0], nullptr, &id),
              MICROD_ERR_INVALID_ARGUMENT);  // already registered
    // Still serving this process.
    StepAndCompare(c, host_ids, host, cuda_ids, dev, upload, counts, 100, stream, nullptr, 0);
    if (HasFatalFailure()) return;
  }
  auto status = cluster.Status(0);
  ASSERT_TRUE(status.ok()) << status.status();
  EXPECT_EQ(status->job_state(), microd::v1::JOB_STATE_RUNNING) << status->failure();
  ASSERT_CUDA(cudaFree(slow));
  ASSERT_CUDA(cudaFree(alloc));
  for (float* u : upload) ASSERT_CUDA(cudaFreeHost(u));
  ASSERT_CUDA(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace microd::testing
