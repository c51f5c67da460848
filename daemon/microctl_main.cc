// SPDX-License-Identifier: Apache-2.0
// microctl: status of a microd daemon over its Admin service.
//   microctl [--admin=host:port] [--json] status|buckets|stalls|history [BUCKET]
//   microctl [--admin=host:port] timeline [--seconds=N] --out=FILE
#include <google/protobuf/util/json_util.h>
#include <grpcpp/grpcpp.h>

#include <cstdio>
#include <fstream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/str_format.h"
#include "daemon/common/command_line.h"
#include "daemon/control/tls_flags.h"
#include "microd/v1/admin.grpc.pb.h"

ABSL_FLAG(std::string, admin, "",
          "daemon Admin address (default $MICROD_ADMIN or unix:/run/microd/admin.sock)");
ABSL_FLAG(bool, json, false, "print JSON instead of a table");
ABSL_FLAG(int, timeout_ms, 5000, "deadline of the call");
ABSL_FLAG(bool, history, false, "with --json: include each bucket's per-step history");
ABSL_FLAG(double, seconds, 10,
          "timeline: record this long, then write the steps of that window (0: what the "
          "daemon keeps with --timeline)");
ABSL_FLAG(std::string, out, "", "timeline: write the trace (Chrome trace-event JSON) to this file");

namespace {

const char* JobStateName(microd::v1::JobState s) {
  switch (s) {
    case microd::v1::JOB_STATE_FORMING:
      return "forming";
    case microd::v1::JOB_STATE_RUNNING:
      return "running";
    case microd::v1::JOB_STATE_FAILED:
      return "FAILED";
    case microd::v1::JOB_STATE_FINISHED:
      return "finished";
    default:
      return "unknown";
  }
}

std::string Bytes(double b) {
  const char* unit[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (b >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  return absl::StrFormat(u == 0 ? "%.0f %s" : "%.1f %s", b, unit[u]);
}

void PrintStatus(const microd::v1::GetStatusResponse& r) {
  std::printf("node        %s (rank %d of %d)%s\n", r.node_name().c_str(), r.node_rank(),
              r.node_count(), r.is_coordinator() ? ", coordinator" : "");
  std::printf("job         %s%s%s\n", JobStateName(r.job_state()), r.failure().empty() ? "" : ": ",
              r.failure().c_str());
  std::printf("world size  %d (%d local)\n", r.world_size(), r.local_size());
  std::printf("sparsifier  %s / %s, density %g, transport %s\n", r.sparsifier().c_str(),
              r.controller().c_str(), r.density(), r.transport().c_str());
  std::printf(
      "remedies    momentum correction %g, warm-up %llu dense steps, density decay "
      "%g -> %g over %llu steps, clipping %g, minimum k %llu\n",
      r.momentum_correction(), static_cast<unsigned long long>(r.warmup_steps()),
      r.warmup_density(), r.density(), static_cast<unsigned long long>(r.warmup_decay_steps()),
      r.clip_norm(), static_cast<unsigned long long>(r.min_k()));
  if (r.warmup_dense_above() > 0) {
    std::printf("            decay steps above density %g run dense\n", r.warmup_dense_above());
  }
  for (const auto& line : r.remedies()) std::printf("            %s\n", line.c_str());
  std::printf("socket      %s\n", r.socket().c_str());
  std::printf("version     %s, up %.0f s, %llu schedule batches run\n", r.version().c_str(),
              r.uptime_seconds(), static_cast<unsigned long long>(r.batches()));
  if (r.min_nodes() > 0 || r.max_nodes() > 0 || r.membership_epoch() > 0) {
    std::printf("membership  epoch %llu", static_cast<unsigned long long>(r.membership_epoch()));
    if (r.min_nodes() > 0) std::printf(", elastic: at least %d nodes", r.min_nodes());
    if (r.max_nodes() > 0) std::printf(", at most %d", r.max_nodes());
    if (r.membership_epoch() > 0) {
      std::printf(", the last change took %.1f s here", r.last_recovery_seconds());
    }
    std::printf("\n");
  }
  for (const auto& c : r.membership_changes()) {
    std::printf("            epoch %llu, %.0f s ago, %d nodes: %s\n",
                static_cast<unsigned long long>(c.epoch()), c.seconds_ago(), c.nodes(),
                c.cause().c_str());
  }
  const std::string sealed =
      r.data_plane_sealed()
          ? absl::StrFormat("sealed, %d transfer(s) refused", r.refused_transfers())
          : std::string("not sealed");
  std::printf("transport   %s of scratch beside the buckets' state; data plane %s\n",
              Bytes(static_cast<double>(r.transport_scratch_bytes())).c_str(), sealed.c_str());
  if (r.response_cache()) {
    std::printf(
        "cache       on, %llu batches agreed between the daemons, %llu bucket steps "
        "reduced by the cycle itself\n",
        static_cast<unsigned long long>(r.cache_batches()),
        static_cast<unsigned long long>(r.cycle_reductions()));
  }
  for (const auto& s : r.stalls()) std::printf("stall       %s\n", s.c_str());
  if (r.processes_size() > 0) {
    std::printf("\n%-11s %8s %8s %12s\n", "local rank", "pid", "buffers", "memory");
    for (const auto& p : r.processes()) {
      std::printf("%-11d %8d %8d %12s\n", p.local_rank(), p.pid(), p.buffers(),
                  Bytes(static_cast<double>(p.bytes())).c_str());
    }
  }
  if (r.nodes_size() > 0) {
    std::printf("\n%-5s %-24s %6s %16s\n", "rank", "node", "local", "last heartbeat");
    for (const auto& n : r.nodes()) {
      std::printf("%-5d %-24s %6d %15.1fs%s\n", n.rank(), n.name().c_str(), n.local_size(),
                  n.seconds_since_heartbeat(), n.left() ? " (left)" : "");
    }
  }
}

// The stall inspector's reports, one per line.
void PrintStalls(const microd::v1::GetStatusResponse& r) {
  for (const auto& s : r.stalls()) std::printf("%s\n", s.c_str());
  if (r.stalls_size() == 0) std::printf("(no stalls)\n");
}

void PrintBuckets(const microd::v1::GetStatusResponse& r) {
  std::printf("%-24s %11s %6s %7s %10s %10s %8s %9s %11s %6s %11s %11s %11s %6s %29s\n", "bucket",
              "elements", "mode", "steps", "K", "k", "CRE", "mean CRE", "threshold", "rounds",
              "sent", "received", "state", "B/elem", "wait/sum/select/xchg/write s");
  for (const auto& b : r.buckets()) {
    std::printf(
        "%-24s %11llu %6s %7llu %10llu %10llu %7.2f%% %8.2f%% %11.4g %6llu %11s %11s %11s %6.2f "
        "%29s\n",
        b.name().c_str(), static_cast<unsigned long long>(b.count()),
        b.dense() ? "dense" : "sparse", static_cast<unsigned long long>(b.steps()),
        static_cast<unsigned long long>(b.last_selected()),
        static_cast<unsigned long long>(b.budget()), 100 * b.last_cre(), 100 * b.mean_cre(),
        b.last_threshold(), static_cast<unsigned long long>(b.last_rounds()),
        Bytes(static_cast<double>(b.bytes_sent())).c_str(),
        Bytes(static_cast<double>(b.bytes_received())).c_str(),
        Bytes(static_cast<double>(b.state_bytes())).c_str(),
        b.count() > 0 ? static_cast<double>(b.state_bytes()) / static_cast<double>(b.count()) : 0.0,
        absl::StrFormat("%.2f/%.2f/%.2f/%.2f/%.2f", b.negotiate_seconds(), b.local_sum_seconds(),
                        b.select_seconds(), b.exchange_seconds(), b.writeback_seconds())
            .c_str());
    if (b.failures() > 0 || b.skipped_steps() > 0) {
      std::printf("%-24s failed steps: %llu, skipped (NaN/Inf): %llu\n", "",
                  static_cast<unsigned long long>(b.failures()),
                  static_cast<unsigned long long>(b.skipped_steps()));
    }
  }
  if (r.buckets_size() == 0) std::printf("(no buckets yet)\n");
}

// Per-step history of every bucket (or of `only`); false if `only` is unknown.
bool PrintHistory(const microd::v1::GetStatusResponse& r, const std::string& only) {
  bool found = false;
  for (const auto& b : r.buckets()) {
    if (!only.empty() && b.name() != only) continue;
    found = true;
    std::printf("%s (%llu elements, last %d sparse steps)\n", b.name().c_str(),
                static_cast<unsigned long long>(b.count()), b.history_size());
    std::printf("%8s %10s %10s %8s %11s %6s\n", "step", "K", "k", "CRE", "threshold", "rounds");
    for (const auto& h : b.history()) {
      std::printf("%8llu %10llu %10llu %7.2f%% %11.4g %6llu\n",
                  static_cast<unsigned long long>(h.step()),
                  static_cast<unsigned long long>(h.selected()),
                  static_cast<unsigned long long>(h.budget()), 100 * h.cre(), h.threshold(),
                  static_cast<unsigned long long>(h.rounds()));
    }
  }
  return found || only.empty();
}

constexpr char kUsage[] =
    "usage: microctl [--admin=host:port] [--json] [--history] status|buckets|stalls|history "
    "[BUCKET]\n"
    "       microctl [--admin=host:port] timeline [--seconds=N] --out=FILE\n";

// The daemon's step timeline into --out: 0 when written.
int Timeline(microd::v1::Admin::Stub* stub, const std::string& address) {
  const std::string out = absl::GetFlag(FLAGS_out);
  const double seconds = absl::GetFlag(FLAGS_seconds);
  if (out.empty() || !(seconds >= 0 && seconds <= 3600)) {
    std::fprintf(stderr, "microctl: timeline needs --out=FILE and --seconds in [0, 3600]\n");
    return 2;
  }
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000) +
                                             absl::GetFlag(FLAGS_timeout_ms)));
  microd::v1::GetTimelineRequest req;
  req.set_seconds(seconds);
  microd::v1::GetTimelineResponse resp;
  if (seconds > 0) std::fprintf(stderr, "microctl: recording %g s of steps...\n", seconds);
  if (grpc::Status s = stub->GetTimeline(&ctx, req, &resp); !s.ok()) {
    std::fprintf(stderr, "microctl: timeline from microd at %s: %s\n", address.c_str(),
                 s.error_message().c_str());
    return 1;
  }
  std::ofstream f(out, std::ios::binary | std::ios::trunc);
  f << resp.trace_json();
  f.close();
  if (!f) {
    std::fprintf(stderr, "microctl: cannot write %s\n", out.c_str());
    return 1;
  }
  std::printf("%llu steps in %s (open in https://ui.perfetto.dev or chrome://tracing)\n",
              static_cast<unsigned long long>(resp.steps()), out.c_str());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(kUsage);
  std::vector<char*> args = microd::ParseCommandLine(argc, argv);
  const std::string command = args.size() > 1 ? args[1] : "status";
  const bool known = command == "status" || command == "buckets" || command == "stalls" ||
                     command == "history" || command == "timeline";
  if (!known || args.size() > (command == "history" ? 3u : 2u)) {
    std::fprintf(stderr, "%s", kUsage);
    return 2;
  }
  const std::string only = args.size() > 2 ? args[2] : "";
  std::string address = absl::GetFlag(FLAGS_admin);
  if (address.empty()) {
    const char* env = std::getenv("MICROD_ADMIN");
    address = env != nullptr && env[0] != '\0' ? env : "unix:/run/microd/admin.sock";
  }
  if (absl::Status t = microd::control::CheckTlsFiles(microd::control::TlsFilesFromFlags(),
                                                      /*server=*/false);
      !t.ok()) {
    std::fprintf(stderr, "microctl: %s\n", std::string(t.message()).c_str());
    return 2;
  }
  auto stub = microd::v1::Admin::NewStub(microd::control::AdminChannel(address));
  if (command == "timeline") return Timeline(stub.get(), address);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() +
                   std::chrono::milliseconds(absl::GetFlag(FLAGS_timeout_ms)));
  microd::v1::GetStatusResponse resp;
  microd::v1::GetStatusRequest req;
  req.set_include_history(command == "history" || absl::GetFlag(FLAGS_history));
  grpc::Status s = stub->GetStatus(&ctx, req, &resp);
  if (!s.ok()) {
    std::fprintf(stderr, "microctl: cannot reach microd at %s: %s\n", address.c_str(),
                 s.error_message().c_str());
    return 1;
  }
  if (absl::GetFlag(FLAGS_json)) {
    std::string json;
    google::protobuf::util::JsonPrintOptions opts;
    opts.add_whitespace = true;
    opts.always_print_primitive_fields = true;
    (void)google::protobuf::util::MessageToJsonString(resp, &json, opts);
    std::printf("%s", json.c_str());
    return 0;
  }
  if (command == "status") {
    PrintStatus(resp);
  } else if (command == "buckets") {
    PrintBuckets(resp);
  } else if (command == "stalls") {
    PrintStalls(resp);
  } else if (!PrintHistory(resp, only)) {
    std::fprintf(stderr, "microctl: no bucket named '%s'\n", only.c_str());
    return 1;
  }
  return 0;
}
