// SPDX-License-Identifier: Apache-2.0
// Writes the seed corpora of the fuzz targets (tests/fuzz/corpus/): valid
// conversations of each, which the fuzzers and the replay runs mutate.
//   microd-fuzz-seeds DIR    (writes DIR/local_protocol, DIR/coordinator, DIR/step_inputs)
#include <sys/stat.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <string>
#include <vector>

#include "microd/v1/coordinator.pb.h"
#include "microd/wire.h"

namespace {

using Bytes = std::vector<uint8_t>;

void Write(const std::string& dir, const std::string& name, const Bytes& b) {
  mkdir(dir.c_str(), 0755);
  std::ofstream(dir + "/" + name, std::ios::binary)
      .write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(b.size()));
}

// One framed message of the local-protocol target: descriptor spec, length, bytes.
template <typename T>
void Frame(Bytes& out, uint8_t spec, const T& msg) {
  out.push_back(spec);
  out.push_back(sizeof msg & 0xFF);
  out.push_back(sizeof msg >> 8);
  const uint8_t* p = reinterpret_cast<const uint8_t*>(&msg);
  out.insert(out.end(), p, p + sizeof msg);
}

void LocalProtocol(const std::string& dir) {
  microd_wire_hello hello{};
  microd_wire_header_init(&hello.h, MICROD_MSG_HELLO, sizeof hello);
  hello.local_rank = -1;
  microd_wire_register reg{};
  microd_wire_header_init(&reg.h, MICROD_MSG_REGISTER, sizeof reg);
  reg.buffer_id = 0;
  reg.kind = MICROD_BUFFER_HOST;
  reg.dtype = MICROD_WIRE_DTYPE_FLOAT32;
  reg.count = 1000;
  std::strcpy(reg.name, "w");
  microd_wire_submit sub{};
  microd_wire_header_init(&sub.h, MICROD_MSG_SUBMIT, sizeof sub);
  sub.ticket = 1;
  microd_wire_goodbye bye{};
  microd_wire_header_init(&bye.h, MICROD_MSG_GOODBYE, sizeof bye);
  microd_wire_register_cuda cuda{};
  microd_wire_header_init(&cuda.h, MICROD_MSG_REGISTER_CUDA, sizeof cuda);
  cuda.buffer_id = 1;
  cuda.dtype = MICROD_WIRE_DTYPE_FLOAT32;
  cuda.count = 256;
  cuda.alloc_bytes = 4096;
  std::strcpy(cuda.name, "g");
  // spec: low bits = descriptors (1), kind bits above: 0 = a sealed memfd.
  Bytes full;
  Frame(full, 0, hello);
  Frame(full, 1, reg);
  Frame(full, 0, sub);
  sub.ticket = 2;
  Frame(full, 0, sub);
  Frame(full, 0, bye);
  Write(dir, "hello_register_submit_goodbye", full);
  Bytes with_cuda;
  Frame(with_cuda, 0, hello);
  Frame(with_cuda, 0, cuda);
  Frame(with_cuda, 1, reg);
  Write(dir, "hello_cuda_register", with_cuda);
  Bytes early;
  Frame(early, 0, sub);
  Write(dir, "submit_before_hello", early);
  microd_wire_state state{};
  microd_wire_header_init(&state.h, MICROD_MSG_STATE, sizeof state);
  state.op = MICROD_STATE_SAVE;
  state.ticket = 3;
  std::strcpy(state.dir, "/tmp/microd-fuzz-state");
  // spec 16: one descriptor of kind 4, the scratch directory.
  constexpr uint8_t kDirectory = 16;
  Bytes with_state;
  Frame(with_state, 0, hello);
  Frame(with_state, 1, reg);
  Frame(with_state, kDirectory, state);
  state.op = MICROD_STATE_LOAD;
  state.ticket = 4;
  Frame(with_state, kDirectory, state);
  Frame(with_state, 0, state);  // no descriptor: a protocol error
  Frame(with_state, 0, bye);
  Write(dir, "hello_register_state_save_load", with_state);
}

void Coordinator(const std::string& dir) {
  auto write = [&](const std::string& name, uint8_t method, const google::protobuf::Message& m) {
    Bytes b = {method};
    const std::string s = m.SerializeAsString();
    b.insert(b.end(), s.begin(), s.end());
    Write(dir, name, b);
  };
  microd::v1::ReportRequest report;
  report.set_node_rank(0);
  report.set_seq(1);
  auto* r = report.add_ready();
  r->set_name("w");
  r->set_dtype(microd::v1::DATA_TYPE_FLOAT32);
  r->set_count(1000);
  write("report", 0x80 | 3, report);
  microd::v1::KeySetRequest set;
  set.set_key("gloo/0");
  set.set_value("addr");
  write("keyset", 0x80 | 1, set);
  microd::v1::KeyGetRequest get;
  get.add_keys("gloo/0");
  get.set_timeout_ms(1);
  write("keyget", 0x80 | 2, get);
  microd::v1::HeartbeatRequest hb;
  auto* w = hb.add_waiting();
  w->set_name("w");
  w->set_seconds(70);
  auto* m = w->add_missing();
  m->set_local_rank(1);
  m->set_pid(42);
  write("heartbeat", 0x80 | 5, hb);
  microd::v1::PollRequest poll;
  poll.set_next(0);
  poll.set_timeout_ms(1);
  write("poll", 0x80 | 4, poll);
  microd::v1::JoinRequest join;
  join.set_job_id("job");
  join.set_node_name("n1");
  join.set_local_size(1);
  join.set_timeout_ms(1);
  write("join", 0, join);
  microd::v1::FailRequest fail;
  fail.set_reason("trainer died");
  write("fail", 0x80 | 6, fail);
  microd::v1::LeaveRequest leave;
  write("leave", 0x80 | 7, leave);
}

void StepInputs(const std::string& dir) {
  // [d (8 bytes)][sparsifier (8)][steps (8)] then the lies: all zeros is an
  // honest-looking count of 0; a few shapes of count and index bytes.
  auto u64 = [](Bytes& b, uint64_t v) {
    for (int i = 7; i >= 0; --i) b.push_back(static_cast<uint8_t>(v >> (8 * i)));
  };
  for (uint64_t kind = 0; kind < 4; ++kind) {
    Bytes b;
    u64(b, 2999);  // d = 3000
    u64(b, kind);
    u64(b, 2);  // 3 steps
    for (int i = 0; i < 64; ++i) b.push_back(static_cast<uint8_t>(i * 37));
    Write(dir, "sparsifier" + std::to_string(kind), b);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s DIR\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  mkdir(dir.c_str(), 0755);
  LocalProtocol(dir + "/local_protocol");
  Coordinator(dir + "/coordinator");
  StepInputs(dir + "/step_inputs");
  return 0;
}
