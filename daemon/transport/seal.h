// Sealed transfers between daemons (issue V): authenticated encryption of
// what one node sends another, AES-256-GCM (OpenSSL, AES-NI where the CPU
// has it), with a key per direction of an epoch's data plane.
//
// Keys: from the epoch's secret (handed out over the authenticated control
// plane), HKDF-SHA256 with the job id and the epoch as salt gives each
// sender a key; each direction (sender, receiver) gets its own key from it
// (HKDF again), made on first use. `kAll` as the receiver: a blob that every
// node reads (one that Gloo's ring allgather forwards unchanged).
//
// Nonces: the direction's transfer number (`sequence`), which the receiver
// expects in the order the schedule makes transfers (every node runs the
// same collectives in the same order): a transfer replayed, reordered or
// sent to another receiver does not open. A data plane's numbers start
// again with each data plane, so one SealKeys serves one data plane: a
// data plane is never connected twice in one epoch (the engine connects
// the next epoch's, whose salt is fresh, when one does not connect), so
// no nonce repeats under a key. The tag (the collective's, which
// names the bucket slot and phase), the epoch, both nodes and the sequence
// are authenticated data too. Nothing of a transfer that does not verify is
// written out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"

namespace microd::transport {

class SealKeys {
 public:
  // The GCM tag each sealed transfer carries after its bytes.
  static constexpr size_t kOverhead = 16;
  // A receiver meaning "every node" (a blob forwarded as it is).
  static constexpr int kAll = -1;

  // An epoch's salt: exactly this many bytes (random, fresh per epoch).
  static constexpr size_t kSaltBytes = 32;

  // Keys of `epoch` from its `salt` (kSaltBytes, or refused: keys that
  // depended on the job's secret alone would repeat from one run of a job
  // to the next, and with them the nonces) and the job's `secret` (the
  // token's data-plane secret; empty where TLS with certificates alone
  // keeps the salt secret).
  static absl::StatusOr<std::unique_ptr<SealKeys>> Derive(absl::string_view salt,
                                                          absl::string_view secret,
                                                          absl::string_view job_id, uint64_t epoch,
                                                          int nodes);

  // Seals `size` bytes of `plain` from `sender` to `receiver` as that
  // direction's `sequence`-th transfer of collective `tag`: writes
  // size + kOverhead bytes to `out` (which may be `plain`, in place).
  absl::Status Seal(int sender, int receiver, uint32_t tag, uint64_t sequence, const void* plain,
                    size_t size, void* out) const;
  // Opens what Seal made (`sealed_size` bytes, its tag last) into `out`
  // (sealed_size - kOverhead bytes; may be `sealed`). A transfer that does
  // not verify: DataLoss naming the link (`reader`: the node that read it,
  // named where `receiver` is kAll), and `out` left as it was.
  absl::Status Open(int sender, int receiver, uint32_t tag, uint64_t sequence, const void* sealed,
                    size_t sealed_size, void* out, int reader = kAll) const;

  uint64_t epoch() const { return epoch_; }

 private:
  SealKeys(std::string job_id, uint64_t epoch, int nodes)
      : job_id_(std::move(job_id)), epoch_(epoch), nodes_(nodes) {}
  // The direction's key (made on first use).
  absl::StatusOr<std::string> DirectionKey(int sender, int receiver) const;
  absl::Status CheckLink(int sender, int receiver) const;
  std::string Aad(int sender, int receiver, uint32_t tag, uint64_t sequence) const;

  const std::string job_id_;
  const uint64_t epoch_;
  const int nodes_;
  std::string master_;  // the HKDF output every sender's key comes from
  mutable absl::Mutex mu_;
  mutable std::map<std::pair<int, int>, std::string> keys_ ABSL_GUARDED_BY(mu_);
};

}  // namespace microd::transport
