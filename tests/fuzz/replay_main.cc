// SPDX-License-Identifier: Apache-2.0
// Runs a fuzz target without libFuzzer (the builds that make test uses):
// every file of the corpus directories and files given, then, for each,
// --mutations deterministic mutations of it (bytes flipped, inserted,
// deleted, duplicated; seeded by --seed). A crash or an abort fails the
// run; a summary line counts the inputs.
//   microd-fuzz-X [--mutations=N] [--seed=S] CORPUS_DIR_OR_FILE...
#include <dirent.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>
#include <string>
#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size);

namespace {

std::vector<std::string> Files(const std::string& path) {
  struct stat st;
  if (stat(path.c_str(), &st) != 0) {
    std::fprintf(stderr, "replay: cannot read %s\n", path.c_str());
    std::exit(2);
  }
  if (!S_ISDIR(st.st_mode)) return {path};
  std::vector<std::string> out;
  DIR* dir = opendir(path.c_str());
  while (dirent* e = readdir(dir)) {
    if (e->d_name[0] != '.') out.push_back(path + "/" + e->d_name);
  }
  closedir(dir);
  std::sort(out.begin(), out.end());
  return out;
}

void Mutate(std::vector<uint8_t>& b, std::mt19937_64& rng) {
  const int edits = 1 + static_cast<int>(rng() % 4);
  for (int e = 0; e < edits; ++e) {
    const size_t at = b.empty() ? 0 : rng() % b.size();
    switch (rng() % 5) {
      case 0:
        if (!b.empty()) b[at] ^= static_cast<uint8_t>(1u << (rng() % 8));
        break;
      case 1:
        b.insert(b.begin() + at, static_cast<uint8_t>(rng()));
        break;
      case 2:
        if (!b.empty()) b.erase(b.begin() + at, b.begin() + std::min(b.size(), at + 1 + rng() % 8));
        break;
      case 3:
        if (!b.empty()) {
          const size_t len = std::min<size_t>(b.size() - at, 1 + rng() % 16);
          std::vector<uint8_t> chunk(b.begin() + at, b.begin() + at + len);
          b.insert(b.begin() + rng() % (b.size() + 1), chunk.begin(), chunk.end());
        }
        break;
      default:
        if (!b.empty()) b[at] = static_cast<uint8_t>(rng() % 2 ? 0xFF : 0x00);
        break;
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  long mutations = 0;
  uint64_t seed = 1;
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a.rfind("--mutations=", 0) == 0) {
      mutations = std::atol(a.c_str() + 12);
    } else if (a.rfind("--seed=", 0) == 0) {
      seed = std::strtoull(a.c_str() + 7, nullptr, 10);
    } else {
      for (auto& f : Files(a)) inputs.push_back(f);
    }
  }
  if (inputs.empty()) {
    std::fprintf(stderr, "usage: %s [--mutations=N] [--seed=S] CORPUS...\n", argv[0]);
    return 2;
  }
  std::mt19937_64 rng(seed);
  long runs = 0;
  // MICROD_FUZZ_LAST=FILE: each input is written there before it runs, so
  // that the one that failed is at hand.
  const char* last = std::getenv("MICROD_FUZZ_LAST");
  auto run = [&](const std::vector<uint8_t>& b) {
    if (last != nullptr) {
      std::ofstream(last, std::ios::binary)
          .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
    }
    LLVMFuzzerTestOneInput(b.data(), b.size());
    ++runs;
  };
  for (const std::string& f : inputs) {
    std::ifstream in(f, std::ios::binary);
    const std::vector<uint8_t> original((std::istreambuf_iterator<char>(in)),
                                        std::istreambuf_iterator<char>());
    run(original);
    for (long m = 0; m < mutations; ++m) {
      std::vector<uint8_t> b = original;
      Mutate(b, rng);
      run(b);
    }
  }
  std::printf("replay: %ld inputs (%zu corpus files, %ld mutations each), no failure\n", runs,
              inputs.size(), mutations);
  return 0;
}
