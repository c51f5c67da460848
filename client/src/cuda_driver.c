// SPDX-License-Identifier: Apache-2.0
/* The CUDA driver, loaded on demand (see cuda_driver.h). */
#define _GNU_SOURCE
#include "cuda_driver.h"

#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEFAULT_LIBCUDA "libcuda.so.1"

typedef int mcu_result;
typedef unsigned long long mcu_deviceptr;
typedef int mcu_device;
typedef struct {
  unsigned char bytes[MCU_UUID_SIZE];
} mcu_uuid;
typedef struct {
  unsigned char bytes[MCU_IPC_HANDLE_SIZE];
} mcu_ipc_handle;

/* The entry points, by their exported names (cuda.h maps several of its
 * names to the _v2 symbols). Set once under g_mu, before `ready`. */
static struct {
  int ready;
  mcu_result (*init)(unsigned int);
  mcu_result (*get_error_name)(mcu_result, const char**);
  mcu_result (*pointer_get_attribute)(void*, int, mcu_deviceptr);
  mcu_result (*mem_get_address_range)(mcu_deviceptr*, size_t*, mcu_deviceptr);
  mcu_result (*device_get)(mcu_device*, int);
  mcu_result (*device_get_uuid)(mcu_uuid*, mcu_device);
  mcu_result (*ctx_push)(void*);
  mcu_result (*ctx_pop)(void**);
  mcu_result (*ipc_get_mem_handle)(mcu_ipc_handle*, mcu_deviceptr);
  mcu_result (*event_create)(void**, unsigned int);
  mcu_result (*event_destroy)(void*);
  mcu_result (*event_record)(void*, void*);
  mcu_result (*ipc_get_event_handle)(mcu_ipc_handle*, void*);
} g;
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;

static const char* result_name(mcu_result r) {
  const char* s = NULL;
  if (g.get_error_name != NULL && g.get_error_name(r, &s) == MCU_SUCCESS && s != NULL) return s;
  /* The driver could not name it (the toolkit's stub library names nothing). */
  switch (r) {
    case MCU_ERROR_STUB_LIBRARY:
      return "CUDA_ERROR_STUB_LIBRARY (the CUDA toolkit's stub libcuda, not an NVIDIA driver)";
    case MCU_ERROR_NO_DEVICE:
      return "CUDA_ERROR_NO_DEVICE";
    case MCU_ERROR_SYSTEM_DRIVER_MISMATCH:
      return "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH";
    case MCU_ERROR_NOT_INITIALIZED:
      return "CUDA_ERROR_NOT_INITIALIZED";
    default:
      return "unknown CUDA error";
  }
}

/* The status a failed driver call maps to. */
static microd_status status_of(mcu_result r) {
  switch (r) {
    case MCU_ERROR_OUT_OF_MEMORY:
      return MICROD_ERR_RESOURCE;
    case MCU_ERROR_INVALID_VALUE:
    case MCU_ERROR_INVALID_HANDLE:
    case MCU_ERROR_INVALID_CONTEXT:
    case MCU_ERROR_INVALID_DEVICE:
      return MICROD_ERR_INVALID_ARGUMENT;
    case MCU_ERROR_NOT_INITIALIZED:
    case MCU_ERROR_DEINITIALIZED:
    case MCU_ERROR_STUB_LIBRARY:
    case MCU_ERROR_DEVICE_UNAVAILABLE:
    case MCU_ERROR_NO_DEVICE:
    case MCU_ERROR_NOT_SUPPORTED:
    case MCU_ERROR_SYSTEM_DRIVER_MISMATCH:
    case MCU_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE:
      return MICROD_ERR_UNSUPPORTED;
    default:
      return MICROD_ERR_INTERNAL;
  }
}

static microd_status driver_error(mcu_result r, const char* call, char* err, size_t errlen) {
  snprintf(err, errlen, "%s failed: %s (CUDA error %d)", call, result_name(r), r);
  return status_of(r);
}

/* Loads and initialises the driver unless done. A failure is not cached: a
 * later call tries again (the environment may have changed). */
static microd_status load(char* err, size_t errlen) {
  pthread_mutex_lock(&g_mu);
  if (g.ready) {
    pthread_mutex_unlock(&g_mu);
    return MICROD_OK;
  }
  const char* path = getenv("MICROD_LIBCUDA");
  if (path == NULL || path[0] == '\0') path = DEFAULT_LIBCUDA;
  void* lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
  if (lib == NULL) {
    const char* why = dlerror();
    snprintf(err, errlen,
             "CUDA buffers need the NVIDIA driver in this process, but %s cannot be loaded: %s",
             path, why != NULL ? why : "unknown error");
    pthread_mutex_unlock(&g_mu);
    return MICROD_ERR_UNSUPPORTED;
  }
  /* The driver stays loaded even when a symbol is missing or cuInit fails:
   * unloading a driver library is not something it promises to survive. */
  const char* missing = NULL;
#define MCU_SYM(field, name)                                \
  do {                                                      \
    g.field = (__typeof__(g.field))dlsym(lib, name);        \
    if (g.field == NULL && missing == NULL) missing = name; \
  } while (0)
  MCU_SYM(init, "cuInit");
  MCU_SYM(get_error_name, "cuGetErrorName");
  MCU_SYM(pointer_get_attribute, "cuPointerGetAttribute");
  MCU_SYM(mem_get_address_range, "cuMemGetAddressRange_v2");
  MCU_SYM(device_get, "cuDeviceGet");
  MCU_SYM(ctx_push, "cuCtxPushCurrent_v2");
  MCU_SYM(ctx_pop, "cuCtxPopCurrent_v2");
  MCU_SYM(ipc_get_mem_handle, "cuIpcGetMemHandle");
  MCU_SYM(event_create, "cuEventCreate");
  MCU_SYM(event_destroy, "cuEventDestroy_v2");
  MCU_SYM(event_record, "cuEventRecord");
  MCU_SYM(ipc_get_event_handle, "cuIpcGetEventHandle");
  /* The MIG-aware UUID (CUDA 11.4+); the daemon compares both versions. */
  g.device_get_uuid = (__typeof__(g.device_get_uuid))dlsym(lib, "cuDeviceGetUuid_v2");
  if (g.device_get_uuid == NULL) MCU_SYM(device_get_uuid, "cuDeviceGetUuid");
#undef MCU_SYM
  if (missing != NULL) {
    snprintf(err, errlen, "the CUDA driver %s has no %s (too old: CUDA 11.3 or newer is needed)",
             path, missing);
    g.get_error_name = NULL;
    pthread_mutex_unlock(&g_mu);
    return MICROD_ERR_UNSUPPORTED;
  }
  const mcu_result r = g.init(0);
  if (r != MCU_SUCCESS) {
    snprintf(err, errlen, "CUDA buffers need a usable GPU, but cuInit failed: %s (CUDA error %d)",
             result_name(r), r);
    pthread_mutex_unlock(&g_mu);
    return MICROD_ERR_UNSUPPORTED;
  }
  g.ready = 1;
  pthread_mutex_unlock(&g_mu);
  return MICROD_OK;
}

/* One pointer attribute into a zeroed 8-byte slot (the attributes used are
 * ints, booleans (int) or handles; x86-64 and aarch64 are little-endian). */
static mcu_result attribute(int attr, mcu_deviceptr p, uint64_t* value) {
  *value = 0;
  return g.pointer_get_attribute(value, attr, p);
}

/* Whether CUDA IPC can share the allocation `ptr` is in: device memory from
 * cudaMalloc, not managed, not from a stream-ordered pool, legacy-IPC
 * capable. */
static microd_status check_shareable(const void* ptr, char* err, size_t errlen) {
  const mcu_deviceptr p = (mcu_deviceptr)(uintptr_t)ptr;
  uint64_t v = 0;
  mcu_result r = attribute(MCU_POINTER_ATTRIBUTE_MEMORY_TYPE, p, &v);
  if (r != MCU_SUCCESS) {
    snprintf(err, errlen,
             "%p is not memory CUDA knows (cuPointerGetAttribute: %s): CUDA buffers are device "
             "memory from cudaMalloc",
             ptr, result_name(r));
    return MICROD_ERR_INVALID_ARGUMENT;
  }
  const uint64_t memory_type = v;
  if (attribute(MCU_POINTER_ATTRIBUTE_IS_MANAGED, p, &v) == MCU_SUCCESS && (v & 0xFFFFFFFFu) != 0) {
    snprintf(err, errlen,
             "%p is managed memory (cudaMallocManaged), which CUDA IPC cannot share: allocate the "
             "buffer with cudaMalloc",
             ptr);
    return MICROD_ERR_INVALID_ARGUMENT;
  }
  if ((memory_type & 0xFFFFFFFFu) != MCU_MEMORYTYPE_DEVICE) {
    snprintf(err, errlen,
             "%p is not device memory (CUDA memory type %u): CUDA buffers are device memory from "
             "cudaMalloc; host gradients go in microd_register_typed_buffer's shared memory",
             ptr, (unsigned)(memory_type & 0xFFFFFFFFu));
    return MICROD_ERR_INVALID_ARGUMENT;
  }
  /* Legacy IPC handles cover cudaMalloc allocations only. Drivers that do
   * not know an attribute answer an error: that check is then skipped and
   * cuIpcGetMemHandle has the last word. */
  if (attribute(MCU_POINTER_ATTRIBUTE_MEMPOOL_HANDLE, p, &v) == MCU_SUCCESS && v != 0) {
    snprintf(err, errlen,
             "%p comes from a stream-ordered memory pool (cudaMallocAsync), which legacy CUDA IPC "
             "cannot share (pool export is not supported yet): allocate the buffer with cudaMalloc "
             "(PyTorch: do not use PYTORCH_CUDA_ALLOC_CONF=backend:cudaMallocAsync)",
             ptr);
    return MICROD_ERR_UNSUPPORTED;
  }
  if (attribute(MCU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE, p, &v) == MCU_SUCCESS &&
      (v & 0xFFFFFFFFu) == 0) {
    snprintf(err, errlen,
             "%p is in an allocation legacy CUDA IPC cannot share (a stream-ordered pool, "
             "cudaMallocAsync, or a cuMemCreate/virtual-memory allocation, e.g. PyTorch's "
             "expandable_segments:True): "
             "allocate the buffer with cudaMalloc",
             ptr);
    return MICROD_ERR_UNSUPPORTED;
  }
  return MICROD_OK;
}

microd_status mcuda_prepare(const void* ptr, uint64_t count, mcuda_buffer* out, char* err,
                            size_t errlen) {
  memset(out, 0, sizeof *out);
  microd_status s = load(err, errlen);
  if (s != MICROD_OK) return s;
  const mcu_deviceptr p = (mcu_deviceptr)(uintptr_t)ptr;
  s = check_shareable(ptr, err, errlen);
  if (s != MICROD_OK) return s;
  uint64_t v = 0;
  mcu_result r = attribute(MCU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p, &v);
  if (r != MCU_SUCCESS)
    return driver_error(r, "cuPointerGetAttribute(DEVICE_ORDINAL)", err, errlen);
  const int ordinal = (int)(int32_t)(uint32_t)(v & 0xFFFFFFFFu);
  mcu_device dev = 0;
  r = g.device_get(&dev, ordinal);
  if (r != MCU_SUCCESS) return driver_error(r, "cuDeviceGet", err, errlen);
  mcu_uuid uuid;
  memset(&uuid, 0, sizeof uuid);
  r = g.device_get_uuid(&uuid, dev);
  if (r != MCU_SUCCESS) return driver_error(r, "cuDeviceGetUuid", err, errlen);
  r = attribute(MCU_POINTER_ATTRIBUTE_CONTEXT, p, &v);
  if (r != MCU_SUCCESS) return driver_error(r, "cuPointerGetAttribute(CONTEXT)", err, errlen);
  void* ctx = (void*)(uintptr_t)v;
  if (ctx == NULL) {
    snprintf(err, errlen, "%p has no CUDA context (not a cudaMalloc allocation)", ptr);
    return MICROD_ERR_UNSUPPORTED;
  }

  /* Everything below runs in the allocation's context, popped on every path. */
  r = g.ctx_push(ctx);
  if (r != MCU_SUCCESS) return driver_error(r, "cuCtxPushCurrent", err, errlen);
  void* event = NULL;
  mcu_deviceptr base = 0;
  size_t size = 0;
  mcu_ipc_handle mem_handle, event_handle;
  memset(&mem_handle, 0, sizeof mem_handle);
  memset(&event_handle, 0, sizeof event_handle);
  const uint64_t bytes = count * sizeof(float);
  r = g.mem_get_address_range(&base, &size, p);
  if (r != MCU_SUCCESS) {
    s = driver_error(r, "cuMemGetAddressRange", err, errlen);
  } else if (p - base > size || bytes > size - (p - base)) {
    snprintf(err, errlen,
             "%llu elements at %p run past the end of their allocation (%zu bytes from %p)",
             (unsigned long long)count, ptr, size, (void*)(uintptr_t)base);
    s = MICROD_ERR_INVALID_ARGUMENT;
  } else if ((r = g.ipc_get_mem_handle(&mem_handle, base)) != MCU_SUCCESS) {
    s = driver_error(r, "cuIpcGetMemHandle", err, errlen);
  } else if ((r = g.event_create(&event, MCU_EVENT_DISABLE_TIMING | MCU_EVENT_INTERPROCESS)) !=
             MCU_SUCCESS) {
    event = NULL;
    s = driver_error(r, "cuEventCreate(interprocess)", err, errlen);
  } else if ((r = g.ipc_get_event_handle(&event_handle, event)) != MCU_SUCCESS) {
    s = driver_error(r, "cuIpcGetEventHandle", err, errlen);
  }
  if (s != MICROD_OK && event != NULL) {
    (void)g.event_destroy(event);
    event = NULL;
  }
  void* popped = NULL;
  (void)g.ctx_pop(&popped);
  if (s != MICROD_OK) return s;

  out->context = ctx;
  out->event = event;
  out->device_ordinal = ordinal;
  memcpy(out->device_uuid, uuid.bytes, sizeof out->device_uuid);
  memcpy(out->mem_handle, mem_handle.bytes, sizeof out->mem_handle);
  memcpy(out->event_handle, event_handle.bytes, sizeof out->event_handle);
  out->alloc_bytes = size;
  out->offset = p - base;
  return MICROD_OK;
}

microd_status mcuda_record(const mcuda_buffer* buffer, void* stream, char* err, size_t errlen) {
  microd_status s = load(err, errlen);
  if (s != MICROD_OK) return s;
  mcu_result r = g.ctx_push(buffer->context);
  if (r != MCU_SUCCESS) return driver_error(r, "cuCtxPushCurrent", err, errlen);
  r = g.event_record(buffer->event, stream);
  if (r != MCU_SUCCESS) {
    snprintf(err, errlen,
             "cuEventRecord of the ready event on stream %p failed: %s (CUDA error %d); the stream "
             "must belong to the buffer's device",
             stream, result_name(r), r);
    s = status_of(r);
  }
  void* popped = NULL;
  (void)g.ctx_pop(&popped);
  return s;
}

void mcuda_release(mcuda_buffer* buffer) {
  if (buffer->event == NULL) return;
  char err[64];
  if (load(err, sizeof err) == MICROD_OK && g.ctx_push(buffer->context) == MCU_SUCCESS) {
    (void)g.event_destroy(buffer->event);
    void* popped = NULL;
    (void)g.ctx_pop(&popped);
  }
  buffer->event = NULL;
}
