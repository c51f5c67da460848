// Files a reader finds whole or not at all: written to a temporary file
// beside the target, flushed and renamed into place.
#pragma once

#include <initializer_list>
#include <string>
#include <string_view>

#include "absl/status/status.h"

namespace microd {

// Writes the concatenation of `parts` to `path` (mode 0600). PermissionDenied
// when the temporary file cannot be made, ResourceExhausted when writing,
// flushing or renaming fails; the temporary file is removed on failure.
absl::Status WriteFileAtomically(const std::string& path,
                                 std::initializer_list<std::string_view> parts);

}  // namespace microd
