// SPDX-License-Identifier: Apache-2.0
// The client library declares the few CUDA driver types and constants it
// uses itself (client/src/cuda_driver.h), so that it builds without CUDA and
// links libc only. Here, in CUDA builds, they are checked against cuda.h and
// the wire format's handle fields against the runtime's handle types.
#include <cuda.h>
#include <cuda_runtime_api.h>

#include "cuda_driver.h"
#include "gtest/gtest.h"
#include "microd/wire.h"

namespace {

#define SAME(ours, theirs) \
  static_assert(static_cast<long>(ours) == static_cast<long>(theirs), #ours " != " #theirs)

SAME(MCU_SUCCESS, CUDA_SUCCESS);
SAME(MCU_ERROR_INVALID_VALUE, CUDA_ERROR_INVALID_VALUE);
SAME(MCU_ERROR_OUT_OF_MEMORY, CUDA_ERROR_OUT_OF_MEMORY);
SAME(MCU_ERROR_NOT_INITIALIZED, CUDA_ERROR_NOT_INITIALIZED);
SAME(MCU_ERROR_DEINITIALIZED, CUDA_ERROR_DEINITIALIZED);
SAME(MCU_ERROR_STUB_LIBRARY, CUDA_ERROR_STUB_LIBRARY);
SAME(MCU_ERROR_DEVICE_UNAVAILABLE, CUDA_ERROR_DEVICE_UNAVAILABLE);
SAME(MCU_ERROR_NO_DEVICE, CUDA_ERROR_NO_DEVICE);
SAME(MCU_ERROR_INVALID_DEVICE, CUDA_ERROR_INVALID_DEVICE);
SAME(MCU_ERROR_INVALID_CONTEXT, CUDA_ERROR_INVALID_CONTEXT);
SAME(MCU_ERROR_INVALID_HANDLE, CUDA_ERROR_INVALID_HANDLE);
SAME(MCU_ERROR_NOT_SUPPORTED, CUDA_ERROR_NOT_SUPPORTED);
SAME(MCU_ERROR_SYSTEM_DRIVER_MISMATCH, CUDA_ERROR_SYSTEM_DRIVER_MISMATCH);
SAME(MCU_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE, CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE);
SAME(MCU_POINTER_ATTRIBUTE_CONTEXT, CU_POINTER_ATTRIBUTE_CONTEXT);
SAME(MCU_POINTER_ATTRIBUTE_MEMORY_TYPE, CU_POINTER_ATTRIBUTE_MEMORY_TYPE);
SAME(MCU_POINTER_ATTRIBUTE_IS_MANAGED, CU_POINTER_ATTRIBUTE_IS_MANAGED);
SAME(MCU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL);
SAME(MCU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE,
     CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE);
SAME(MCU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, CU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE);
SAME(MCU_MEMORYTYPE_DEVICE, CU_MEMORYTYPE_DEVICE);
SAME(MCU_EVENT_DISABLE_TIMING, CU_EVENT_DISABLE_TIMING);
SAME(MCU_EVENT_INTERPROCESS, CU_EVENT_INTERPROCESS);
SAME(MCU_IPC_HANDLE_SIZE, CU_IPC_HANDLE_SIZE);
static_assert(MCU_UUID_SIZE == sizeof(CUuuid));
static_assert(sizeof(CUdeviceptr) == sizeof(unsigned long long));
static_assert(sizeof(CUdevice) == sizeof(int));
static_assert(sizeof(CUresult) == sizeof(int));
// The attributes are read into a zeroed 8-byte slot.
static_assert(sizeof(CUcontext) <= 8 && sizeof(CUmemoryPool) <= 8);

// The wire carries the runtime's handles byte for byte (the daemon opens
// them with the runtime), and they are the driver's.
static_assert(sizeof(microd_wire_register_cuda::mem_handle) == sizeof(cudaIpcMemHandle_t));
static_assert(sizeof(microd_wire_register_cuda::event_handle) == sizeof(cudaIpcEventHandle_t));
static_assert(sizeof(cudaIpcMemHandle_t) == sizeof(CUipcMemHandle));
static_assert(sizeof(cudaIpcEventHandle_t) == sizeof(CUipcEventHandle));
static_assert(sizeof(microd_wire_register_cuda::device_uuid) == sizeof(CUuuid));
static_assert(sizeof(mcuda_buffer::mem_handle) == sizeof(CUipcMemHandle));

TEST(ClientCudaDriverAbi, DeclarationsMatchCudaH) { SUCCEED() << "checked at compile time"; }

}  // namespace
