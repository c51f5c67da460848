// SPDX-License-Identifier: Apache-2.0
// microd-gpu-info: lists the CUDA devices this build can use, or says why
// there are none (exit status 1). Used by scripts/gpu-check.sh.
#include <cstdio>

#include "kernels/cuda/device_info.h"

int main() {
  std::vector<microd::kernels::cuda::DeviceInfo> devices;
  std::string reason;
  if (!microd::kernels::cuda::ListDevices(&devices, &reason)) {
    std::printf("no usable CUDA device: %s\n", reason.c_str());
    return 1;
  }
  for (const auto& d : devices) {
    std::printf("cuda:%d %s sm_%d%d %.1f GiB\n", d.index, d.name.c_str(), d.major, d.minor,
                d.memory_bytes / 1073741824.0);
  }
  return 0;
}
