// SPDX-License-Identifier: Apache-2.0
// Small helpers for absl::Status plumbing inside the daemon (our abseil
// predates its own macros).
#pragma once

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MICROD_CONCAT_INNER_(a, b) a##b
#define MICROD_CONCAT_(a, b) MICROD_CONCAT_INNER_(a, b)

// Returns from the current function when `expr` is not OK.
#define RETURN_IF_ERROR(expr)                        \
  do {                                               \
    ::absl::Status microd_status_ = (expr);          \
    if (!microd_status_.ok()) return microd_status_; \
  } while (0)

// `lhs = value of expr`, or returns its status.
#define ASSIGN_OR_RETURN(lhs, expr) \
  ASSIGN_OR_RETURN_IMPL_(MICROD_CONCAT_(microd_statusor_, __LINE__), lhs, expr)
#define ASSIGN_OR_RETURN_IMPL_(tmp, lhs, expr) \
  auto tmp = (expr);                           \
  if (!tmp.ok()) return tmp.status();          \
  lhs = std::move(tmp).value()
