// SPDX-License-Identifier: Apache-2.0
// microd-bench-step-client: one training process of the network benchmark
// (bench/network/run.py), written against the C API. Times every step of
// --size elements in --buckets buckets through its node's daemon: before
// each step the processes of all nodes line up with a small-bucket round
// trip, then every bucket is submitted at once and each waited for (what
// DistributedOptimizer and the DDP hook do; submit to the last completion).
// Every step's time goes to --out as JSON, the first one apart (its set-up
// is part of it).
//
// --floor instead times the least a step can cost on this node without any
// network: `e += g` over the bucket plus one dense write of it (the update),
// on the same memory sizes; run by every node at once, it is the floor the
// sparse steps are compared with.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "bench/bench_client.h"
#include "daemon/sim/synthetic.h"
#include "microd/microd.h"

ABSL_FLAG(std::string, socket, "", "the node's microd socket");
ABSL_FLAG(uint64_t, size, 25557032, "elements per step (fp32), over every bucket");
ABSL_FLAG(int, buckets, 1, "buckets the elements are split into (the first ones one larger)");
ABSL_FLAG(int, steps, 8, "steps to time (the first is reported apart)");
ABSL_FLAG(int, node, 0, "this node's rank (seeds its synthetic gradients)");
ABSL_FLAG(int, timeout_ms, 600000, "wait of one step");
ABSL_FLAG(bool, floor, false, "time the local floor instead (no daemon)");
ABSL_FLAG(std::string, out, "", "write the step times (ms) here as JSON");
ABSL_FLAG(std::string, barrier, "",
          "--floor: a folder shared by the nodes' copies; every step starts when all --nodes "
          "copies reached it");
ABSL_FLAG(int, nodes, 1, "--floor: copies meeting at --barrier");

namespace {

using Clock = std::chrono::steady_clock;

double Ms(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double, std::milli>(b - a).count();
}

int Write(const std::vector<double>& ms, const std::string& what) {
  const std::string path = absl::GetFlag(FLAGS_out);
  std::string list =
      absl::StrJoin(ms, ",", [](std::string* o, double v) { absl::StrAppend(o, v); });
  const std::string json =
      absl::StrCat("{\"what\":\"", what, "\",\"size\":", absl::GetFlag(FLAGS_size),
                   ",\"step_ms\":[", list, "]}\n");
  if (path.empty()) {
    std::fputs(json.c_str(), stdout);
    return 0;
  }
  std::ofstream out(path);
  out << json;
  return out ? 0 : 2;
}

// With --barrier: waits until every copy reached step s (one file per copy
// and step in a shared folder; 60 s at most).
bool Barrier(int s) {
  const std::string dir = absl::GetFlag(FLAGS_barrier);
  if (dir.empty()) return true;
  const int n = absl::GetFlag(FLAGS_nodes);
  std::ofstream(absl::StrCat(dir, "/", s, ".", absl::GetFlag(FLAGS_node))) << "\n";
  const auto deadline = Clock::now() + std::chrono::seconds(60);
  while (Clock::now() < deadline) {
    int here = 0;
    for (int r = 0; r < n; ++r) {
      here += std::ifstream(absl::StrCat(dir, "/", s, ".", r)).good() ? 1 : 0;
    }
    if (here == n) return true;
    std::this_thread::sleep_for(std::chrono::microseconds(200));
  }
  std::fprintf(stderr, "step-client: the other copies did not reach step %d in 60 s\n", s);
  return false;
}

// e += g, then one dense write of the bucket (the update), as a step's
// least memory traffic.
int Floor() {
  const uint64_t d = absl::GetFlag(FLAGS_size);
  std::vector<float> e(d, 0.0f), g(d), u(d);
  microd::sim::SyntheticOptions so;
  so.size = d;
  microd::sim::SyntheticGradients stream(so, absl::GetFlag(FLAGS_node));
  stream.Next(g.data());
  std::vector<double> ms;
  for (int s = 0; s < absl::GetFlag(FLAGS_steps); ++s) {
    if (!Barrier(s)) return 3;
    const auto t0 = Clock::now();
    float* __restrict ep = e.data();
    const float* __restrict gp = g.data();
    for (uint64_t i = 0; i < d; ++i) ep[i] += gp[i];
    std::fill(u.begin(), u.end(), 0.0f);
    ms.push_back(Ms(t0, Clock::now()));
  }
  // Keep the passes from being optimised away.
  volatile float sink = e[d / 2] + u[d / 3];
  (void)sink;
  return Write(ms, "floor");
}

int Steps() {
  const uint64_t d = absl::GetFlag(FLAGS_size);
  const int nb = absl::GetFlag(FLAGS_buckets);
  if (nb < 1 || static_cast<uint64_t>(nb) > d) {
    std::fprintf(stderr, "step-client: --buckets must be in [1, --size]\n");
    return 2;
  }
  microd::bench::BenchClient bc;
  if (!microd::bench::ConnectWithBuckets(absl::GetFlag(FLAGS_socket), "step-client", 16,
                                         d / nb + (d % nb != 0 ? 1 : 0), &bc)) {
    return 2;
  }
  microd_client* const c = bc.client;
  // Bucket 0 is the client's "bucket"; the others are registered here.
  std::vector<float*> data = {bc.big};
  std::vector<int32_t> ids = {bc.big_id};
  std::vector<uint64_t> counts = {d / nb + (d % nb != 0 ? 1 : 0)};
  for (int b = 1; b < nb; ++b) {
    const uint64_t count = d / nb + (static_cast<uint64_t>(b) < d % nb ? 1 : 0);
    float* p = nullptr;
    int32_t id = -1;
    if (microd_register_host_buffer(c, absl::StrCat("bucket", b).c_str(), count, &p, &id) !=
        MICROD_OK) {
      std::fprintf(stderr, "step-client: %s\n", microd_last_error(c));
      return 2;
    }
    data.push_back(p);
    ids.push_back(id);
    counts.push_back(count);
  }
  const int32_t small_id = bc.small_id;
  microd::sim::SyntheticOptions so;
  so.size = d;
  microd::sim::SyntheticGradients stream(so, absl::GetFlag(FLAGS_node));
  std::vector<float> g0(d), g1(d);
  stream.Next(g0.data());
  stream.Next(g1.data());
  const int timeout = absl::GetFlag(FLAGS_timeout_ms);
  std::vector<double> ms;
  std::vector<uint64_t> tickets(nb);
  for (int s = 0; s < absl::GetFlag(FLAGS_steps); ++s) {
    const std::vector<float>& g = s % 2 ? g1 : g0;
    uint64_t at = 0;
    for (int b = 0; b < nb; ++b) {
      std::copy(g.begin() + at, g.begin() + at + counts[b], data[b]);
      at += counts[b];
    }
    if (microd_allreduce(c, small_id, timeout) != MICROD_OK) {
      std::fprintf(stderr, "step-client: line-up: %s\n", microd_last_error(c));
      return 3;
    }
    const auto t0 = Clock::now();
    for (int b = 0; b < nb; ++b) {
      if (microd_allreduce_async(c, ids[b], &tickets[b]) != MICROD_OK) {
        std::fprintf(stderr, "step-client: step %d: %s\n", s, microd_last_error(c));
        return 3;
      }
    }
    for (int b = 0; b < nb; ++b) {
      if (microd_wait(c, tickets[b], timeout) != MICROD_OK) {
        std::fprintf(stderr, "step-client: step %d: %s\n", s, microd_last_error(c));
        return 3;
      }
    }
    ms.push_back(Ms(t0, Clock::now()));
  }
  microd_close(c);
  return Write(ms, "microd");
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  if (absl::GetFlag(FLAGS_floor)) return Floor();
  if (absl::GetFlag(FLAGS_socket).empty()) {
    std::fprintf(stderr, "step-client: give --socket (or --floor)\n");
    return 2;
  }
  return Steps();
}
