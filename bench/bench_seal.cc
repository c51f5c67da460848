// SPDX-License-Identifier: Apache-2.0
// microd-bench-seal: what sealing the data plane costs on this machine
// (issues V, X): the record layer's AES-256-GCM (record/codec.h), records
// of its largest payload sealed and opened back to back, GB/s on one core,
// beside a plain copy of the same bytes (the floor any transfer pays once)
// and beside what a 1 Gbit/s and a 10 Gbit/s link carry.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "daemon/transport/gloo/record/codec.h"

ABSL_FLAG(std::vector<std::string>, sizes,
          std::vector<std::string>({"51114", "511140", "25557032"}), "transfer sizes in floats");
ABSL_FLAG(double, seconds, 1.0, "time per measurement");

namespace {

using microd::transport::record::kHeaderBytes;
using microd::transport::record::kLengthBytes;
using microd::transport::record::kMaxPayload;
using microd::transport::record::kTagBytes;
using microd::transport::record::RecordCipher;

// Runs `f` until `seconds` passed; bytes per second over `bytes` a call.
template <typename F>
double Rate(size_t bytes, double seconds, F f) {
  const auto start = std::chrono::steady_clock::now();
  size_t calls = 0;
  double took = 0;
  do {
    f();
    ++calls;
    took = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  } while (took < seconds);
  return static_cast<double>(bytes) * calls / took;
}

}  // namespace

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  const std::string key(32, 'k');
  auto seal = RecordCipher::Create(key);
  if (!seal.ok()) {
    std::fprintf(stderr, "%s\n", std::string(seal.status().message()).c_str());
    return 1;
  }
  const double seconds = absl::GetFlag(FLAGS_seconds);
  std::printf(
      "| transfer | copy GB/s | seal GB/s | open GB/s | 1 Gbit/s link | 10 Gbit/s link |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|\n");
  unsigned char length[kLengthBytes] = {}, header[kHeaderBytes] = {};
  for (const std::string& s : absl::GetFlag(FLAGS_sizes)) {
    const size_t bytes = std::stoull(s) * sizeof(float);
    const size_t records = (bytes + kMaxPayload - 1) / kMaxPayload;
    std::vector<unsigned char> plain(bytes, 7), back(bytes);
    std::vector<unsigned char> wire(records * (kHeaderBytes + kMaxPayload + kTagBytes));
    const double copy =
        Rate(bytes, seconds, [&] { std::memcpy(back.data(), plain.data(), bytes); });
    // Every record of the transfer, as a connection seals them.
    auto seal_all = [&](RecordCipher& c) {
      for (size_t i = 0; i < records; ++i) {
        const size_t at = i * kMaxPayload, n = std::min(kMaxPayload, bytes - at);
        (void)c.Seal(length, header, plain.data() + at, n,
                     wire.data() + i * (kHeaderBytes + kMaxPayload + kTagBytes));
      }
    };
    const double sealed = Rate(bytes, seconds, [&] { seal_all(**seal); });
    // Opened as the receiver does: into a record-sized buffer, then the
    // payload copied into place (nothing is written before it verifies).
    std::vector<unsigned char> opened(kHeaderBytes + kMaxPayload);
    bool ok = true;
    const double open = Rate(bytes, seconds, [&] {
      auto tx = *RecordCipher::Create(key);
      auto rx = *RecordCipher::Create(key);
      seal_all(*tx);
      for (size_t i = 0; i < records; ++i) {
        const size_t at = i * kMaxPayload, n = std::min(kMaxPayload, bytes - at);
        ok &= rx->Open(length, wire.data() + i * (kHeaderBytes + kMaxPayload + kTagBytes),
                       kHeaderBytes + n + kTagBytes, opened.data());
        std::memcpy(back.data() + at, opened.data() + kHeaderBytes, n);
      }
    });
    if (!ok) std::fprintf(stderr, "a record did not open\n");
    // The open column's calls sealed too: what opening alone costs.
    const double open_alone = 1.0 / (1.0 / open - 1.0 / sealed);
    std::printf("| %.1f MB | %.2f | %.2f | %.2f | 0.125 GB/s | 1.25 GB/s |\n", bytes / 1e6,
                copy / 1e9, sealed / 1e9, open_alone / 1e9);
  }
  return 0;
}
