// microd-bench-seal: what sealing a transfer costs on this machine (issue
// V): Seal and Open (AES-256-GCM, seal.h) of one transfer of each size,
// GB/s on one core, beside a plain copy of the same bytes (the floor any
// transfer pays once) and beside what a 1 Gbit/s and a 10 Gbit/s link
// carry. Sizes: a micro step's values at 0.1 % and 1 % of 25.5 M floats
// between 4 nodes, and a dense segment.
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "daemon/transport/seal.h"

ABSL_FLAG(std::vector<std::string>, sizes,
          std::vector<std::string>({"51114", "511140", "25557032"}), "transfer sizes in floats");
ABSL_FLAG(double, seconds, 1.0, "time per measurement");

namespace {

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
  auto keys = microd::transport::SealKeys::Derive(std::string(32, 's'), std::string(32, 'k'),
                                                  "bench", 1, 4);
  if (!keys.ok()) {
    std::fprintf(stderr, "%s\n", std::string(keys.status().message()).c_str());
    return 1;
  }
  const double seconds = absl::GetFlag(FLAGS_seconds);
  std::printf(
      "| transfer | copy GB/s | seal GB/s | open GB/s | 1 Gbit/s link | 10 Gbit/s link |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|\n");
  for (const std::string& s : absl::GetFlag(FLAGS_sizes)) {
    const size_t bytes = std::stoull(s) * sizeof(float);
    std::vector<unsigned char> plain(bytes, 7), sealed(bytes + 16), back(bytes);
    const double copy =
        Rate(bytes, seconds, [&] { std::memcpy(back.data(), plain.data(), bytes); });
    uint64_t seq = 0;
    const double seal = Rate(bytes, seconds, [&] {
      (void)(*keys)->Seal(0, 1, 42, seq++, plain.data(), bytes, sealed.data());
    });
    (void)(*keys)->Seal(0, 1, 42, 0, plain.data(), bytes, sealed.data());
    const double open = Rate(bytes, seconds, [&] {
      if (!(*keys)->Open(0, 1, 42, 0, sealed.data(), sealed.size(), back.data()).ok()) {
        std::fprintf(stderr, "open failed\n");
      }
    });
    std::printf("| %.1f MB | %.2f | %.2f | %.2f | 0.125 GB/s | 1.25 GB/s |\n", bytes / 1e6,
                copy / 1e9, seal / 1e9, open / 1e9);
  }
  return 0;
}
