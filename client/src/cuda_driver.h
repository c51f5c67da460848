// SPDX-License-Identifier: Apache-2.0
/* CUDA buffers on the client side: the CUDA driver API loaded with dlopen the
 * first time a CUDA buffer is registered, so that the library links libc
 * only and a process without CUDA never loads it. Private to the library.
 *
 * The driver (libcuda.so.1, or the file $MICROD_LIBCUDA names) rather than
 * the runtime: its ABI is stable across CUDA versions and it is the one
 * library every CUDA process has, whatever runtime the framework bundles.
 * The few types and constants used are declared here (values of cuda.h,
 * CUDA 11.3 or newer); tests/client/cuda_driver_abi_test.cc checks them
 * against cuda.h in CUDA builds. */
#ifndef MICROD_CLIENT_CUDA_DRIVER_H_
#define MICROD_CLIENT_CUDA_DRIVER_H_

#include <stddef.h>
#include <stdint.h>

#include "microd/microd.h"

/* cuda.h values (checked by tests/client/cuda_driver_abi_test.cc). */
enum {
  MCU_SUCCESS = 0,
  MCU_ERROR_INVALID_VALUE = 1,
  MCU_ERROR_OUT_OF_MEMORY = 2,
  MCU_ERROR_NOT_INITIALIZED = 3,
  MCU_ERROR_DEINITIALIZED = 4,
  MCU_ERROR_STUB_LIBRARY = 34,
  MCU_ERROR_DEVICE_UNAVAILABLE = 46,
  MCU_ERROR_NO_DEVICE = 100,
  MCU_ERROR_INVALID_DEVICE = 101,
  MCU_ERROR_INVALID_CONTEXT = 201,
  MCU_ERROR_INVALID_HANDLE = 400,
  MCU_ERROR_NOT_SUPPORTED = 801,
  MCU_ERROR_SYSTEM_DRIVER_MISMATCH = 803,
  MCU_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE = 804,

  MCU_POINTER_ATTRIBUTE_CONTEXT = 1,
  MCU_POINTER_ATTRIBUTE_MEMORY_TYPE = 2,
  MCU_POINTER_ATTRIBUTE_IS_MANAGED = 8,
  MCU_POINTER_ATTRIBUTE_DEVICE_ORDINAL = 9,
  MCU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE = 10,
  MCU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE = 17,

  MCU_MEMORYTYPE_DEVICE = 2,
  MCU_EVENT_DISABLE_TIMING = 2,
  MCU_EVENT_INTERPROCESS = 4,
  MCU_IPC_HANDLE_SIZE = 64,
  MCU_UUID_SIZE = 16
};

/* What a registered CUDA buffer keeps: its allocation's context, its ready
 * event and what REGISTER_CUDA sends. */
typedef struct mcuda_buffer {
  void* context; /* CUcontext of the allocation (the primary context for cudaMalloc) */
  void* event;   /* CUevent: interprocess, without timing */
  int device_ordinal;
  unsigned char device_uuid[MCU_UUID_SIZE];
  unsigned char mem_handle[MCU_IPC_HANDLE_SIZE];
  unsigned char event_handle[MCU_IPC_HANDLE_SIZE];
  uint64_t alloc_bytes; /* the whole allocation */
  uint64_t offset;      /* of the buffer in it */
} mcuda_buffer;

/* Loads the driver when needed, checks that `ptr` holds `count` fp32 elements
 * of device memory legacy CUDA IPC can share, and creates the buffer's ready
 * event and both IPC handles. Returns MICROD_OK, or a status with the reason
 * written to err (errlen bytes): MICROD_ERR_UNSUPPORTED without a usable
 * driver or for memory IPC cannot share (stream-ordered pools, virtual
 * memory allocations), MICROD_ERR_INVALID_ARGUMENT for memory that is not
 * device memory or too small. Thread-safe. */
microd_status mcuda_prepare(const void* ptr, uint64_t count, mcuda_buffer* out, char* err,
                            size_t errlen);

/* Records the buffer's ready event on `stream` (CUstream; NULL: the legacy
 * default stream). Does not wait for the GPU. Thread-safe. */
microd_status mcuda_record(const mcuda_buffer* buffer, void* stream, char* err, size_t errlen);

/* Destroys the ready event (the buffer's context must still exist). */
void mcuda_release(mcuda_buffer* buffer);

#endif /* MICROD_CLIENT_CUDA_DRIVER_H_ */
