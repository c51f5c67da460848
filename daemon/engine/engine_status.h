// SPDX-License-Identifier: Apache-2.0
// The engine's part of the Admin status (GetStatusResponse, admin.proto):
// batches, the job failure it saw, and every bucket's statistics with their
// per-step histories when the snapshot has them. The job's part is
// control::FillJobStatus (daemon/control/services.h).
#pragma once

#include "daemon/engine/engine.h"
#include "microd/v1/admin.pb.h"

namespace microd::engine {

void FillEngineStatus(const EngineSnapshot& snap, microd::v1::GetStatusResponse* r);

}  // namespace microd::engine
