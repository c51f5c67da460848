// SPDX-License-Identifier: Apache-2.0
/* A stand-in for the CUDA driver (libcuda) with the entry points the client
 * library loads (client/src/cuda_driver.c), over host memory, so that the C
 * API's CUDA buffers run end to end without a GPU (MICROD_LIBCUDA names this
 * file). "Device allocations" are host ranges the test declares; an IPC
 * handle carries the allocation's address, an event handle the event's. The
 * answers follow the driver's documented ones (CUDA 13 cuda.h); the values
 * match cuda.h (tests/client/cuda_driver_abi_test.cc checks the client's). */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define FAKE_API __attribute__((visibility("default")))

enum { kSuccess = 0, kInvalidValue = 1, kInvalidContext = 201, kInvalidHandle = 400 };
enum { kContext = 1, kMemoryType = 2, kIsManaged = 8, kOrdinal = 9, kLegacyIpc = 10, kPool = 17 };
#define FAKE_CONTEXT ((void*)0xC0C0)
#define FAKE_BAD_STREAM ((void*)0xBAD)

/* kind: 0 cudaMalloc, 1 stream-ordered pool, 2 managed, 3 virtual memory (not legacy IPC). */
typedef struct {
  uintptr_t base;
  size_t bytes;
  int kind;
} allocation;

typedef struct fake_event {
  int records;
  int destroyed;
  void* last_stream;
} fake_event;

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static allocation allocations[64];
static int nallocations;
static int ctx_depth;

FAKE_API void fake_cuda_add_allocation(void* base, size_t bytes, int kind) {
  pthread_mutex_lock(&mu);
  if (nallocations < 64) allocations[nallocations++] = (allocation){(uintptr_t)base, bytes, kind};
  pthread_mutex_unlock(&mu);
}

FAKE_API int fake_cuda_context_depth(void) { return ctx_depth; }

static const allocation* find(unsigned long long p) {
  for (int i = 0; i < nallocations; ++i) {
    if (p >= allocations[i].base && p < allocations[i].base + allocations[i].bytes) {
      return &allocations[i];
    }
  }
  return NULL;
}

FAKE_API int cuInit(unsigned int flags) { return flags == 0 ? kSuccess : kInvalidValue; }

FAKE_API int cuGetErrorName(int error, const char** name) {
  *name = error == kInvalidValue    ? "CUDA_ERROR_INVALID_VALUE"
          : error == kInvalidHandle ? "CUDA_ERROR_INVALID_HANDLE"
                                    : "CUDA_ERROR_FAKE";
  return kSuccess;
}

FAKE_API int cuPointerGetAttribute(void* data, int attribute, unsigned long long ptr) {
  pthread_mutex_lock(&mu);
  const allocation* a = find(ptr);
  allocation copy = a != NULL ? *a : (allocation){0, 0, 0};
  pthread_mutex_unlock(&mu);
  if (a == NULL) return kInvalidValue; /* pageable host memory: unknown to CUDA */
  switch (attribute) {
    case kContext:
      *(void**)data = FAKE_CONTEXT;
      return kSuccess;
    case kMemoryType:
      *(unsigned int*)data = 2; /* CU_MEMORYTYPE_DEVICE (managed memory too) */
      return kSuccess;
    case kIsManaged:
      *(int*)data = copy.kind == 2;
      return kSuccess;
    case kOrdinal:
      *(int*)data = 0;
      return kSuccess;
    case kLegacyIpc:
      *(int*)data = copy.kind == 0;
      return kSuccess;
    case kPool:
      *(void**)data = copy.kind == 1 ? (void*)0x9001 : NULL;
      return kSuccess;
    default:
      return kInvalidValue;
  }
}

FAKE_API int cuMemGetAddressRange_v2(unsigned long long* base, size_t* size,
                                     unsigned long long ptr) {
  if (ctx_depth == 0) return kInvalidContext;
  pthread_mutex_lock(&mu);
  const allocation* a = find(ptr);
  if (a != NULL) {
    *base = a->base;
    *size = a->bytes;
  }
  pthread_mutex_unlock(&mu);
  return a != NULL ? kSuccess : kInvalidValue;
}

FAKE_API int cuDeviceGet(int* device, int ordinal) {
  if (ordinal != 0) return 101; /* CUDA_ERROR_INVALID_DEVICE */
  *device = 0;
  return kSuccess;
}

FAKE_API int cuDeviceGetUuid_v2(unsigned char* uuid, int device) {
  memcpy(uuid, "FAKE-GPU-0000000", 16);
  return device == 0 ? kSuccess : 101;
}

FAKE_API int cuCtxPushCurrent_v2(void* ctx) {
  if (ctx != FAKE_CONTEXT) return kInvalidContext;
  __atomic_add_fetch(&ctx_depth, 1, __ATOMIC_SEQ_CST);
  return kSuccess;
}

FAKE_API int cuCtxPopCurrent_v2(void** ctx) {
  if (ctx_depth == 0) return kInvalidContext;
  __atomic_sub_fetch(&ctx_depth, 1, __ATOMIC_SEQ_CST);
  if (ctx != NULL) *ctx = FAKE_CONTEXT;
  return kSuccess;
}

FAKE_API int cuIpcGetMemHandle(unsigned char* handle, unsigned long long ptr) {
  if (ctx_depth == 0) return kInvalidContext;
  pthread_mutex_lock(&mu);
  const allocation* a = find(ptr);
  const int ok = a != NULL && a->base == ptr && a->kind == 0;
  pthread_mutex_unlock(&mu);
  if (!ok) return kInvalidValue;
  memset(handle, 0, 64);
  memcpy(handle, &ptr, sizeof ptr);
  return kSuccess;
}

FAKE_API int cuEventCreate(void** event, unsigned int flags) {
  if (ctx_depth == 0) return kInvalidContext;
  if (flags != 6) return kInvalidValue; /* interprocess events must disable timing */
  *event = calloc(1, sizeof(fake_event));
  return *event != NULL ? kSuccess : 2;
}

FAKE_API int cuIpcGetEventHandle(unsigned char* handle, void* event) {
  memset(handle, 0, 64);
  memcpy(handle, &event, sizeof event);
  return kSuccess;
}

FAKE_API int cuEventRecord(void* event, void* stream) {
  if (ctx_depth == 0) return kInvalidContext;
  if (stream == FAKE_BAD_STREAM) return kInvalidHandle;
  fake_event* e = event;
  if (e->destroyed) return kInvalidHandle;
  __atomic_add_fetch(&e->records, 1, __ATOMIC_SEQ_CST);
  e->last_stream = stream;
  return kSuccess;
}

/* Kept allocated so that the test can look at it afterwards. */
FAKE_API int cuEventDestroy_v2(void* event) {
  ((fake_event*)event)->destroyed = 1;
  return kSuccess;
}
