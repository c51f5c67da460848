// SPDX-License-Identifier: Apache-2.0
// A benchmark's training process (C API): connects to its node's daemon and
// registers two buckets, a small one that lines the processes of all nodes
// up before each timed step and the large one that is timed.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>

#include "microd/microd.h"

namespace microd::bench {

struct BenchClient {
  microd_client* client = nullptr;
  float* small = nullptr;
  float* big = nullptr;
  int32_t small_id = -1;
  int32_t big_id = -1;
};

// False (the daemon's reason on stderr, prefixed with `who`) when it fails.
inline bool ConnectWithBuckets(const std::string& socket, const char* who, uint64_t small_count,
                               uint64_t big_count, BenchClient* out) {
  microd_options o;
  microd_options_init(&o);
  o.socket_path = socket.c_str();
  o.timeout_ms = 120000;
  if (microd_connect(&o, &out->client) != MICROD_OK) {
    std::fprintf(stderr, "%s: %s\n", who, microd_last_error(nullptr));
    return false;
  }
  if (microd_register_host_buffer(out->client, "small", small_count, &out->small, &out->small_id) !=
          MICROD_OK ||
      microd_register_host_buffer(out->client, "bucket", big_count, &out->big, &out->big_id) !=
          MICROD_OK) {
    std::fprintf(stderr, "%s: %s\n", who, microd_last_error(out->client));
    return false;
  }
  return true;
}

}  // namespace microd::bench
