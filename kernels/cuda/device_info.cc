// SPDX-License-Identifier: Apache-2.0
#include "kernels/cuda/device_info.h"

#include <cuda_runtime_api.h>

namespace microd::kernels::cuda {

bool ListDevices(std::vector<DeviceInfo>* devices, std::string* reason) {
  devices->clear();
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    // e.g. "CUDA driver version is insufficient" on a machine without a GPU.
    *reason = cudaGetErrorString(err);
    return false;
  }
  if (count == 0) {
    *reason = "no CUDA device";
    return false;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if (cudaGetDeviceProperties(&prop, i) != cudaSuccess) continue;
    devices->push_back({i, prop.name, prop.major, prop.minor, prop.totalGlobalMem});
  }
  return true;
}

}  // namespace microd::kernels::cuda
