// SPDX-License-Identifier: Apache-2.0
// NCCL backend of transport.h (GPU). Only the factory is public; built only
// when CUDA and NCCL are found (MICROD_HAVE_NCCL).
//
// Semantics beyond transport.h's contract:
// - Buffers may be device memory (used in place by NCCL) or host memory
//   (staged through device and pinned host buffers of the transport: one
//   copy each way), so the small host-side headers and histograms of a step
//   go through the same object as the device-side index and value arrays.
// - Every collective is first checked: the ranks exchange a 32-byte
//   descriptor (kind, tag, sizes, call number) with one small allgather and
//   the collective runs only when all agree; a mismatch is kInvalidArgument
//   and breaks the transport. NCCL itself cannot detect a mismatch (it
//   would hang or mix data). `check_collectives = false` saves that round
//   for every call, CollectiveOptions::shape_agreed for one.
// - Work runs on `stream` after what the caller queued there earlier; each
//   call returns only once its work on the stream is complete.
// - Waits poll ncclCommGetAsyncError and a CUDA event until the deadline;
//   on a deadline, an NCCL error or Abort the communicator is aborted
//   (ncclCommAbort) and every later call fails at once with that status.
// - NCCL refuses two ranks of one communicator on one GPU in one host:
//   ranks must be separate devices, or (tests) separate processes with
//   distinct NCCL_HOSTID values, which makes NCCL treat them as hosts.
#pragma once

#include <memory>
#include <string>

#include "absl/status/statusor.h"
#include "absl/time/time.h"
#include "daemon/rendezvous/kv_store.h"
#include "daemon/transport/transport.h"

namespace microd::transport {

struct NcclOptions {
  int rank = 0;
  int size = 1;
  // CUDA device of this rank.
  int device = 0;
  // Rendezvous medium for the ncclUniqueId (the coordinator's key-value
  // store); must outlive the transport's creation. Rank 0 sets
  // "<prefix>/unique_id", the others wait for it.
  rendezvous::KeyValueStore* store = nullptr;
  // Keys are prefixed with this, so several groups can rendezvous at once; a
  // prefix must not be reused for a second group.
  std::string prefix = "nccl";
  // cudaStream_t for the collectives (usually the kernels' stream); nullptr:
  // the transport creates its own blocking stream, ordered after the work the
  // caller queued on the legacy default stream (as SparseOps calls with
  // stream nullptr are); work on other streams must be finished by the caller.
  void* stream = nullptr;
  // Bound for creating the communicator, and for calls made without a deadline.
  absl::Duration timeout = absl::Seconds(60);
  bool check_collectives = true;
};

// Creates the communicator (non-blocking init, polled until every rank has
// joined or the timeout). kFailedPrecondition when no usable GPU exists.
absl::StatusOr<std::unique_ptr<Transport>> CreateNcclTransport(const NcclOptions& options);

}  // namespace microd::transport
