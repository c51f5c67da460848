// SPDX-License-Identifier: Apache-2.0
// microd-test-step-worker: one node of a multi-process test. Joins the
// coordinator, connects Gloo through its key-value store, runs the step of a
// bucket on its synthetic stream and writes one line per step (or FAILED and
// the error) to --out. Exit status: 0 done, 3 a step failed, 2 set-up failed.
#include <csignal>
#include <cstdio>
#include <fstream>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "daemon/control/coordinator_client.h"
#include "daemon/transport/gloo/gloo_transport.h"
#include "tests/integration/step_record.h"

ABSL_FLAG(std::string, coordinator, "", "coordinator address");
ABSL_FLAG(std::string, token, "secret", "job token");
ABSL_FLAG(int, rank, 0, "node rank to request");
ABSL_FLAG(std::string, sparsifier, "micro", "sparsifier");
ABSL_FLAG(std::string, controller, "hist", "controller");
ABSL_FLAG(double, density, 0.01, "density");
ABSL_FLAG(uint64_t, size, 20011, "bucket size");
ABSL_FLAG(uint64_t, steps, 25, "steps");
ABSL_FLAG(uint64_t, seed, 3, "stream seed");
ABSL_FLAG(int, die_at_step, -1, "SIGKILL itself at the start of this step");
ABSL_FLAG(int, peer_timeout_ms, 10000, "peer timeout");
ABSL_FLAG(std::string, out, "", "output file");

int main(int argc, char** argv) {
  absl::ParseCommandLine(argc, argv);
  std::ofstream out(absl::GetFlag(FLAGS_out));
  auto fail = [&](int code, const absl::Status& s) {
    out << "FAILED " << s << "\n";
    out.close();
    std::fprintf(stderr, "step worker %d: %s\n", absl::GetFlag(FLAGS_rank), s.ToString().c_str());
    return code;
  };
  const int rank = absl::GetFlag(FLAGS_rank);
  microd::control::CoordinatorClientOptions co;
  co.address = absl::GetFlag(FLAGS_coordinator);
  co.job_id = "job";
  co.node_name = "node" + std::to_string(rank);
  auto token = microd::control::JobToken::FromToken(absl::GetFlag(FLAGS_token));
  if (!token.ok()) return fail(2, token.status());
  co.token_proof = (*token)->JoinProof(co.job_id, co.node_name);
  co.requested_rank = rank;
  co.peer_timeout = absl::Milliseconds(absl::GetFlag(FLAGS_peer_timeout_ms));
  auto client = microd::control::CoordinatorClient::Create(co);
  if (!client.ok()) return fail(2, client.status());
  auto m = (*client)->Join(absl::Now() + absl::Seconds(60));
  if (!m.ok()) return fail(2, m.status());

  microd::transport::GlooOptions go;
  go.rank = m->node_rank;
  go.size = m->node_count;
  go.store = client->get();
  go.timeout = absl::Seconds(60);
  auto transport = microd::transport::CreateGlooTransport(go);
  if (!transport.ok()) return fail(2, transport.status());
  microd::transport::Transport* t = transport->get();
  // A failed job ends pending collectives; a finished one (a node left
  // cleanly after its last step) does not.
  (*client)->SetFailureCallback([t](const absl::Status& s) {
    if (s.code() != absl::StatusCode::kFailedPrecondition) t->Abort(s);
  });

  microd::sparsify::SparsifyOptions so;
  auto sp = microd::sparsify::ParseSparsifier(absl::GetFlag(FLAGS_sparsifier));
  auto ct = microd::sparsify::ParseController(absl::GetFlag(FLAGS_controller));
  if (!sp.ok()) return fail(2, sp.status());
  if (!ct.ok()) return fail(2, ct.status());
  so.sparsifier = *sp;
  so.controller = *ct;
  so.density = absl::GetFlag(FLAGS_density);
  auto ops = microd::kernels::CreateCpuSparseOps();
  auto bucket = microd::sparsify::BucketState::Create({"grads", absl::GetFlag(FLAGS_size), 1},
                                                      {m->node_count, m->node_rank, m->world_size},
                                                      so, ops.get());
  if (!bucket.ok()) return fail(2, bucket.status());

  microd::sim::SyntheticOptions stream;
  stream.size = absl::GetFlag(FLAGS_size);
  stream.seed = absl::GetFlag(FLAGS_seed);
  const int die_at = absl::GetFlag(FLAGS_die_at_step);
  std::vector<microd::testing::StepRecord> records;
  absl::Status s = microd::testing::RunAndRecord(
      **bucket, *t, stream, m->node_rank, absl::GetFlag(FLAGS_steps), absl::Seconds(60),
      [&](uint64_t step) {
        if (static_cast<int>(step) == die_at) raise(SIGKILL);
      },
      &records);
  for (const auto& r : records) out << r.ToLine() << "\n";
  if (!s.ok()) return fail(3, s);
  out.close();
  (void)(*client)->Leave();
  return 0;
}
