// SPDX-License-Identifier: Apache-2.0
// The CUDA backend of kernels/sparse_ops.h. Only the factory is public; it is
// built only when CUDA is found (MICROD_HAVE_CUDA).
//
// Differences from the CPU backend a caller can see (each one checked by
// tests/kernels/cuda_ops_test.cc against the CPU backend):
// - Every call is queued on `stream` (a cudaStream_t, nullptr = the legacy
//   default stream) and returns before the work is done, except Allocate,
//   Free, CopyToHost, CopyToDevice, Synchronize and SumOfSquares, which block.
//   StepScalars live in device memory: read them with CopyToHost.
// - Selected pairs come out in an unspecified order (blocks claim output
//   slots with atomics); the set, the values and the counts equal the CPU's.
//   TrimBelow keeps the order, as the interface says.
// - SumOfSquares sums per thread, then per block, then the block partials in
//   a fixed order: deterministic on one device, but not in the CPU's index
//   order; the relative difference is of the order of 1e-15 * sqrt(size) on
//   typical data (tested with a relative tolerance of 1e-12).
// - ScatterAverage cannot refuse an out-of-range index without a host
//   synchronisation: it skips such indices (never writes out of bounds) and
//   returns kOk, where the CPU returns kInvalidArgument.
// - Calls that need scratch memory (TrimBelow, TopK, SortUnique,
//   SumOfSquares) keep one growable scratch area per stream; growing it
//   synchronises the device once.
// - A CUDA error is reported as kDeviceError and printed once to stderr with
//   the call that failed (the interface carries no message).
#pragma once

#include <memory>
#include <string>

#include "kernels/sparse_ops.h"

namespace microd::kernels {

// Creates the CUDA backend on device `device`. Returns nullptr and sets
// `reason` (when not null) when no usable device exists: no driver (CUDA
// reports e.g. "CUDA driver version is insufficient"), no device, or `device`
// out of range. Never aborts.
std::unique_ptr<SparseOps> CreateCudaSparseOps(int device, std::string* reason);

}  // namespace microd::kernels
