// SPDX-License-Identifier: Apache-2.0
// What CUDA devices this process can use. Without a driver or a device this
// reports zero devices and the reason; it never aborts.
#pragma once

#include <string>
#include <vector>

namespace microd::kernels::cuda {

struct DeviceInfo {
  int index = 0;
  std::string name;
  int major = 0;  // compute capability
  int minor = 0;
  size_t memory_bytes = 0;
};

// Fills `devices`; returns false with `reason` set when no device is usable.
bool ListDevices(std::vector<DeviceInfo>* devices, std::string* reason);

}  // namespace microd::kernels::cuda
