// SPDX-License-Identifier: Apache-2.0
// microd-bench-kernels: the fused MiCRO pass against the memory floor of
// error feedback (`e += g`), and exact top-k (the radix select, and the
// nth_element it replaced) against the fused pass, measured in one run on
// the same data (d = 25,557,032 by default, ResNet-50's size; n = 4;
// densities 1 % and 0.1 %). Prints each figure beside its baseline and the
// ratio, and writes JSON. Then a bf16 bucket's passes (its gradient widened,
// the fused pass, the update rounded back) against bf16's own floor,
// `e += widen(g)` over 2-byte gradients.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/strings/str_format.h"
#include "bench/bench_stats.h"
#include "daemon/sim/synthetic.h"
#include "daemon/sparsify/options.h"
#include "kernels/sparse_ops.h"

ABSL_FLAG(uint64_t, size, 25557032, "bucket size d (fp32 elements)");
ABSL_FLAG(int, nodes, 4, "n: the owned partition is d / n");
ABSL_FLAG(int, reps, 9, "repetitions of each memory-bound pass (median reported)");
ABSL_FLAG(int, topk_reps, 3, "repetitions of exact top-k");
ABSL_FLAG(std::string, json, "", "write results as JSON to this file");

namespace {

using Clock = std::chrono::steady_clock;

using microd::bench::Median;

double TimeMs(const std::function<void()>& f) {
  const auto t0 = Clock::now();
  f();
  return std::chrono::duration<double, std::milli>(Clock::now() - t0).count();
}

// The floor: the error-feedback update alone, vectorised as well as the
// compiler can for this processor.
__attribute__((target("avx2"), noinline)) void AddInPlaceAvx2(float* e, const float* g,
                                                              uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) e[i] += g[i];
}
__attribute__((noinline)) void AddInPlace(float* e, const float* g, uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) e[i] += g[i];
}

// bf16's floor: the same update from a 2-byte gradient (widening a bf16 is a
// shift), 10 bytes an element instead of 12.
__attribute__((target("avx2"), noinline)) void AddWidenedBf16Avx2(float* e, const uint16_t* g,
                                                                  uint64_t n) {
  for (uint64_t i = 0; i < n; ++i) {
    const uint32_t u = static_cast<uint32_t>(g[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof f);
    e[i] += f;
  }
}

// The m-th largest magnitude of v[begin, end).
float KthMagnitude(const float* v, uint64_t begin, uint64_t end, uint64_t m) {
  std::vector<float> mag(v + begin, v + end);
  for (float& x : mag) x = std::fabs(x);
  m = std::min<uint64_t>(std::max<uint64_t>(m, 1), mag.size());
  std::nth_element(mag.begin(), mag.begin() + (m - 1), mag.end(), std::greater<float>());
  return mag[m - 1];
}

struct Row {
  std::string name;
  double ms;
  std::string baseline;
  double ratio;
  std::string target;
};

// The CPU backend's exact top-k before issue AA, as the comparison: the
// indices of the k largest |acc[i]|, ties to the lower index, by
// nth_element over every index of the bucket.
void NthElementTopK(const float* acc, uint64_t d, uint64_t k, uint32_t* out) {
  std::vector<uint32_t> order(d);
  for (uint64_t i = 0; i < d; ++i) order[i] = static_cast<uint32_t>(i);
  auto before = [acc](uint32_t x, uint32_t y) {
    const float ax = std::fabs(acc[x]), ay = std::fabs(acc[y]);
    return ax > ay || (ax == ay && x < y);
  };
  if (k < d) std::nth_element(order.begin(), order.begin() + k, order.end(), before);
  std::copy(order.begin(), order.begin() + std::min(k, d), out);
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const uint64_t d = absl::GetFlag(FLAGS_size);
  const int n = absl::GetFlag(FLAGS_nodes);
  const int reps = std::max(1, absl::GetFlag(FLAGS_reps));
  const int topk_reps = std::max(1, absl::GetFlag(FLAGS_topk_reps));
  if (d == 0 || d > microd::kernels::kMaxBucketElements || n < 1) {
    std::fprintf(stderr, "microd-bench-kernels: need 1 <= size < 2^32 and nodes >= 1\n");
    return 2;
  }
  auto ops = microd::kernels::CreateCpuSparseOps();
  auto scalar_ops = microd::kernels::CreateCpuSparseOps(microd::kernels::CpuIsa::kScalar);
  const bool avx2 = microd::kernels::CpuSupports(microd::kernels::CpuIsa::kAvx2);

  // Training-like data: a gradient and a residual built up over a few steps.
  microd::sim::SyntheticOptions so;
  so.size = d;
  microd::sim::SyntheticGradients stream(so, 0);
  auto* g = static_cast<float*>(ops->Allocate(d * 4));
  auto* e = static_cast<float*>(ops->Allocate(d * 4));
  auto* acc = static_cast<float*>(ops->Allocate(d * 4));
  auto* floor_e = static_cast<float*>(ops->Allocate(d * 4));
  // Velocities of momentum correction (0.9): the previous one and the new one.
  auto* vel = static_cast<float*>(ops->Allocate(d * 4));
  auto* vel_out = static_cast<float*>(ops->Allocate(d * 4));
  for (int i = 0; i < 3; ++i) {
    stream.Next(g);
    for (uint64_t j = 0; j < d; ++j) e[j] += 0.5f * g[j];
  }
  stream.Next(g);
  std::copy(e, e + d, floor_e);
  for (uint64_t j = 0; j < d; ++j) acc[j] = e[j] + g[j];
  for (uint64_t j = 0; j < d; ++j) vel[j] = 0.5f * e[j];

  const auto part = microd::sparsify::PartitionRange(d, n, 1);
  std::vector<uint32_t> idx(part.size() + 1);
  std::vector<float> val(part.size() + 1);
  microd::kernels::StepScalars scalars;

  std::printf("microd-bench-kernels: d = %llu, n = %d (owned partition %llu), %s, %d reps\n",
              static_cast<unsigned long long>(d), n, static_cast<unsigned long long>(part.size()),
              ops->name(), reps);

  std::vector<Row> rows;
  std::string json =
      absl::StrFormat("{\"size\":%d,\"nodes\":%d,\"isa\":\"%s\",\"results\":[", d, n, ops->name());
  bool first_json = true;
  for (double density : {0.01, 0.001}) {
    const uint64_t k = microd::sparsify::Budget(density, d);
    // Threshold at this node's share of k (what an exact controller selects
    // with) and at 4x that (the `hist` controller's candidate bound).
    const float thr_k = KthMagnitude(acc, part.begin, part.end, k / n);
    const float thr_4k = KthMagnitude(acc, part.begin, part.end, 4 * k / n);

    auto fused = [&](microd::kernels::SparseOps* o, float thr, float* out) {
      microd::kernels::FusedSelectArgs a{g,        e,   out,        d,          part.begin,
                                         part.end, thr, idx.data(), val.data(), &scalars};
      o->FusedAccumulateSelect(a, nullptr);
    };
    // Momentum correction as a pass of its own, then the fused pass over the
    // new velocity; and folded into the fused pass.
    auto momentum_two_passes = [&](float thr) {
      ops->Momentum(g, vel, 0.9f, vel_out, d, nullptr);
      microd::kernels::FusedSelectArgs a{vel_out,  e,   acc,        d,          part.begin,
                                         part.end, thr, idx.data(), val.data(), &scalars};
      ops->FusedAccumulateSelect(a, nullptr);
    };
    auto momentum_folded = [&](float thr) {
      microd::kernels::FusedSelectArgs a{g,        e,   acc,        d,          part.begin,
                                         part.end, thr, idx.data(), val.data(), &scalars};
      a.velocity_in = vel;
      a.velocity_out = vel_out;
      a.beta = 0.9f;
      ops->FusedAccumulateSelect(a, nullptr);
    };
    std::vector<double> t_floor, t_floor_plain, t_fused_k, t_fused_4k, t_fused_inplace, t_scalar;
    std::vector<double> t_momentum_two, t_momentum_folded;
    uint64_t selected_k = 0, selected_4k = 0;
    for (int r = 0; r < reps + 1; ++r) {  // first round warms up
      const bool keep = r > 0;
      double ms = TimeMs([&] { AddInPlaceAvx2(floor_e, g, d); });
      if (keep) t_floor.push_back(ms);
      ms = TimeMs([&] { fused(ops.get(), thr_k, acc); });
      selected_k = scalars.count;
      if (keep) t_fused_k.push_back(ms);
      ms = TimeMs([&] { fused(ops.get(), thr_4k, acc); });
      selected_4k = scalars.count;
      if (keep) t_fused_4k.push_back(ms);
      ms = TimeMs([&] { AddInPlace(floor_e, g, d); });
      if (keep) t_floor_plain.push_back(ms);
      ms = TimeMs([&] { fused(scalar_ops.get(), thr_k, acc); });
      if (keep) t_scalar.push_back(ms);
      std::copy(e, e + d, floor_e);  // in-place variant works on a copy of e
      ms = TimeMs([&] { fused(ops.get(), thr_k, floor_e); });
      if (keep) t_fused_inplace.push_back(ms);
      ms = TimeMs([&] { momentum_two_passes(thr_k); });
      if (keep) t_momentum_two.push_back(ms);
      ms = TimeMs([&] { momentum_folded(thr_k); });
      if (keep) t_momentum_folded.push_back(ms);
    }
    std::vector<double> t_topk, t_nth;
    {
      std::vector<uint32_t> tidx(k), nidx(k);
      std::vector<float> tval(k);
      for (int r = 0; r < topk_reps; ++r) {
        t_topk.push_back(
            TimeMs([&] { ops->TopK(acc, d, k, tidx.data(), tval.data(), &scalars, nullptr); }));
        t_nth.push_back(TimeMs([&] { NthElementTopK(acc, d, k, nidx.data()); }));
      }
      // The same set both ways (the order is free).
      std::sort(tidx.begin(), tidx.end());
      std::sort(nidx.begin(), nidx.end());
      if (tidx != nidx) {
        std::fprintf(stderr, "microd-bench-kernels: top-k and nth_element chose other sets\n");
        return 1;
      }
    }
    const double floor_ms = Median(t_floor);
    const double fused_k = Median(t_fused_k), fused_4k = Median(t_fused_4k);
    const double topk = Median(t_topk);
    const std::string dens = absl::StrFormat("%g%%", density * 100);
    rows.push_back({"e += g (floor)", floor_ms, "", 1.0, ""});
    rows.push_back({"e += g, baseline x86-64 build", Median(t_floor_plain), "floor",
                    Median(t_floor_plain) / floor_ms, ""});
    rows.push_back({absl::StrFormat("fused pass @%s, %llu selected", dens,
                                    static_cast<unsigned long long>(selected_k)),
                    fused_k, "floor", fused_k / floor_ms, "<= 1.15x"});
    rows.push_back({absl::StrFormat("fused pass @%s hist bound, %llu kept", dens,
                                    static_cast<unsigned long long>(selected_4k)),
                    fused_4k, "floor", fused_4k / floor_ms, "<= 1.15x"});
    rows.push_back({"fused pass in place", Median(t_fused_inplace), "floor",
                    Median(t_fused_inplace) / floor_ms, ""});
    rows.push_back({"fused pass, scalar code path", Median(t_scalar), "floor",
                    Median(t_scalar) / floor_ms, ""});
    const double two = Median(t_momentum_two), folded = Median(t_momentum_folded);
    rows.push_back({"momentum pass, then fused pass", two, "floor", two / floor_ms, ""});
    rows.push_back(
        {"fused pass with momentum folded in", folded, "2 passes", folded / two, "< 1x"});
    rows.push_back(
        {absl::StrFormat("exact top-k (radix select), k=%llu", static_cast<unsigned long long>(k)),
         topk, "fused", topk / fused_k, "<= 4x"});
    rows.push_back({"exact top-k by nth_element (its former kernel)", Median(t_nth), "fused",
                    Median(t_nth) / fused_k, ""});

    std::printf("\n-- density %s (k = %llu)%s\n", dens.c_str(), static_cast<unsigned long long>(k),
                avx2 ? "" : " [no AVX2: scalar path]");
    std::printf("%-46s %10s %8s %10s %10s\n", "pass", "ms", "vs", "ratio", "target");
    for (const Row& row : rows) {
      std::printf("%-46s %10.2f %8s %9.2fx %10s\n", row.name.c_str(), row.ms, row.baseline.c_str(),
                  row.ratio, row.target.c_str());
      absl::StrAppendFormat(&json,
                            "%s{\"density\":%g,\"pass\":\"%s\",\"ms\":%.4f,\"baseline\":\"%s\","
                            "\"ratio\":%.4f,\"target\":\"%s\"}",
                            first_json ? "" : ",", density, row.name, row.ms, row.baseline,
                            row.ratio, row.target);
      first_json = false;
    }
    rows.clear();
  }

  // A bf16 bucket at 1 %: what the daemon runs for it (one local process):
  // the gradient widened into the buffer's fp32 copy, the fused pass, the
  // update rounded back into the 2-byte buffer.
  {
    using microd::kernels::ElementType;
    std::vector<uint16_t> g16(d), u16(d);
    ops->FloatToHalf(g, ElementType::kBFloat16, d, g16.data(), nullptr);
    auto* wide = static_cast<float*>(ops->Allocate(d * 4));
    const uint64_t k = microd::sparsify::Budget(0.01, d);
    const float thr = KthMagnitude(acc, part.begin, part.end, k / n);
    std::vector<double> t_floor32, t_floor16, t_widen, t_fused, t_round;
    for (int r = 0; r < reps + 1; ++r) {
      const bool keep = r > 0;
      double ms = TimeMs([&] { AddInPlaceAvx2(floor_e, g, d); });
      if (keep) t_floor32.push_back(ms);
      ms = TimeMs([&] { AddWidenedBf16Avx2(floor_e, g16.data(), d); });
      if (keep) t_floor16.push_back(ms);
      ms = TimeMs([&] { ops->HalfToFloat(g16.data(), ElementType::kBFloat16, d, wide, nullptr); });
      if (keep) t_widen.push_back(ms);
      ms = TimeMs([&] {
        microd::kernels::FusedSelectArgs a{wide,     e,   acc,        d,          part.begin,
                                           part.end, thr, idx.data(), val.data(), &scalars};
        ops->FusedAccumulateSelect(a, nullptr);
      });
      if (keep) t_fused.push_back(ms);
      ms = TimeMs([&] { ops->FloatToHalf(acc, ElementType::kBFloat16, d, u16.data(), nullptr); });
      if (keep) t_round.push_back(ms);
    }
    const double f32 = Median(t_floor32), f16 = Median(t_floor16);
    const double widen = Median(t_widen), fused = Median(t_fused), round = Median(t_round);
    rows.push_back({"e += g, fp32 gradient (floor)", f32, "", 1.0, ""});
    rows.push_back({"e += widen(g), bf16 gradient (bf16 floor)", f16, "floor", f16 / f32, ""});
    rows.push_back({"widen the bf16 gradient", widen, "bf16 fl", widen / f16, ""});
    rows.push_back({"fused pass @1% on the widened copy", fused, "bf16 fl", fused / f16, ""});
    rows.push_back({"round the update to bf16", round, "bf16 fl", round / f16, ""});
    rows.push_back({"bf16 bucket: widen + fused + round", widen + fused + round, "bf16 fl",
                    (widen + fused + round) / f16, ""});
    std::printf("\n-- a bf16 bucket at density 1%% (k = %llu)\n",
                static_cast<unsigned long long>(k));
    std::printf("%-46s %10s %8s %10s %10s\n", "pass", "ms", "vs", "ratio", "target");
    for (const Row& row : rows) {
      std::printf("%-46s %10.2f %8s %9.2fx %10s\n", row.name.c_str(), row.ms, row.baseline.c_str(),
                  row.ratio, row.target.c_str());
      absl::StrAppendFormat(&json,
                            ",{\"density\":0.01,\"dtype\":\"bfloat16\",\"pass\":\"%s\",\"ms\":%.4f,"
                            "\"baseline\":\"%s\",\"ratio\":%.4f,\"target\":\"%s\"}",
                            row.name, row.ms, row.baseline, row.ratio, row.target);
    }
    ops->Free(wide);
  }
  json += "]}\n";
  const std::string path = absl::GetFlag(FLAGS_json);
  if (!path.empty()) {
    FILE* f = std::fopen(path.c_str(), "w");
    if (f == nullptr || std::fputs(json.c_str(), f) < 0 || std::fclose(f) != 0) {
      std::fprintf(stderr, "microd-bench-kernels: cannot write %s\n", path.c_str());
      return 1;
    }
    std::printf("\nJSON: %s\n", path.c_str());
  }
  for (float* p : {g, e, acc, floor_e, vel, vel_out}) ops->Free(p);
  return 0;
}
