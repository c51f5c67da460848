// SPDX-License-Identifier: Apache-2.0
/* microd client library: hands gradient buffers of a training process to the
 * node's microd daemon and waits for their averaged, sparsified update.
 *
 * Linked into frameworks: depends on libc only. Every function is
 * thread-safe on a given handle unless it says otherwise. Statuses are
 * returned, never raised; microd_last_error() gives the message of the last
 * failure on a handle.
 *
 *   microd_options opt;
 *   microd_options_init(&opt);             // socket from MICROD_SOCKET
 *   microd_client* c;
 *   if (microd_connect(&opt, &c) != MICROD_OK) ...
 *   float* grads; int32_t buf;
 *   microd_register_host_buffer(c, "layer1", n, &grads, &buf);
 *   ... write gradients into grads ...
 *   microd_allreduce(c, buf, 60000);       // grads now holds the update
 *   microd_close(c);
 */
#ifndef MICROD_MICROD_H_
#define MICROD_MICROD_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(MICROD_BUILDING_LIBRARY)
#define MICROD_API __attribute__((visibility("default")))
#else
#define MICROD_API
#endif

#define MICROD_VERSION_MAJOR 0
#define MICROD_VERSION_MINOR 1
#define MICROD_VERSION_PATCH 0
#define MICROD_VERSION_CODE \
  (MICROD_VERSION_MAJOR * 10000 + MICROD_VERSION_MINOR * 100 + MICROD_VERSION_PATCH)

/* Result of every call. 0 is success; values are only ever appended. */
typedef enum microd_status {
  MICROD_OK = 0,
  MICROD_ERR_INVALID_ARGUMENT = 1, /* a bad argument; nothing was changed */
  MICROD_ERR_UNAVAILABLE = 2,      /* the daemon cannot be reached or went away */
  MICROD_ERR_TIMEOUT = 3,          /* the deadline passed; the operation may still complete */
  MICROD_ERR_MISMATCH = 4,         /* buffers of one name differ between processes or nodes */
  MICROD_ERR_JOB_FAILED = 5,       /* a node or process of the job failed; nothing more runs */
  MICROD_ERR_UNSUPPORTED = 6,      /* not available here (e.g. CUDA buffers without CUDA) */
  MICROD_ERR_PROTOCOL = 7,         /* malformed message between library and daemon */
  MICROD_ERR_RESOURCE = 8,         /* out of memory or over a daemon limit */
  MICROD_ERR_PERMISSION = 9,       /* the daemon refused this process, or it the daemon (uid/gid) */
  MICROD_ERR_NONFINITE = 10,       /* NaN or Inf in a gradient; the step was not applied */
  MICROD_ERR_INTERNAL = 11,        /* a bug: please report the message */
  MICROD_ERR_CLOSED = 12,          /* the handle was closed */
  /* An elastic job's membership changed (nodes lost): this step was not
   * applied on any node. The buffer's contents are unspecified: read
   * microd_job_info_get again (rank and world size may have changed),
   * write the gradient again and submit it again. */
  MICROD_ERR_MEMBERSHIP = 13
} microd_status;

/* Opaque connection to the daemon. */
typedef struct microd_client microd_client;

/* Connection options. Set struct_size = sizeof(microd_options) (done by
 * microd_options_init) so that fields can be appended compatibly. */
typedef struct microd_options {
  size_t struct_size;
  const char* socket_path; /* NULL: $MICROD_SOCKET, else /run/microd/microd.sock */
  int32_t local_rank;      /* -1: $MICROD_LOCAL_RANK / $LOCAL_RANK, else any free one */
  int32_t timeout_ms;      /* how long microd_connect waits for the daemon; <= 0: 60000 */
} microd_options;

typedef struct microd_job_info {
  int32_t rank;       /* global rank: node offset + local rank */
  int32_t world_size; /* training processes in the job */
  int32_t local_rank;
  int32_t local_size;
  int32_t node_rank;
  int32_t node_count;
} microd_job_info;

/* Library version as MICROD_VERSION_CODE. Never blocks. */
MICROD_API int microd_version(void);

/* Static description of a status ("MICROD_ERR_TIMEOUT: ..."). Never NULL. */
MICROD_API const char* microd_status_string(microd_status status);

/* Fills defaults. Never blocks. */
MICROD_API void microd_options_init(microd_options* options);

/* Connects to the daemon and introduces this process, retrying until the
 * daemon's socket appears or options->timeout_ms passes. The process
 * serving the socket must run as this process's uid, as root, or as the uid
 * in $MICROD_DAEMON_UID (MICROD_ERR_PERMISSION otherwise: nothing is sent to
 * it). Blocks. On success
 * *out owns a handle to pass to microd_close. On failure *out is NULL and
 * the reason is returned (microd_last_error(NULL) gives its message). */
MICROD_API microd_status microd_connect(const microd_options* options, microd_client** out);

/* Message of the last failed call on `client` (or of the last failed
 * microd_connect in this thread when client is NULL). The pointer stays
 * valid until the next call on the handle. Never NULL. */
MICROD_API const char* microd_last_error(const microd_client* client);

/* The daemon's momentum correction factor (0: off). When it is on, the
 * daemon accumulates momentum itself and the training process must apply
 * plain SGD without momentum. Never blocks. */
MICROD_API microd_status microd_momentum_correction(const microd_client* client, float* beta);

/* Job shape as the daemon reported it at connect. Never blocks. */
MICROD_API microd_status microd_job_info_get(const microd_client* client, microd_job_info* out);
/* The job's membership epoch as this process last heard it: 0 as the job
 * formed, one more at each change (MICROD_ERR_MEMBERSHIP). Never blocks. */
MICROD_API microd_status microd_job_epoch(const microd_client* client, uint64_t* epoch);

/* Per-buffer options. Set struct_size = sizeof(microd_buffer_options)
 * (microd_buffer_options_init does) so that fields can be appended. */
/* always reduce this buffer dense: its exact average (no sparsification, no
 * momentum correction: it may hold what is no gradient) */
#define MICROD_BUFFER_DENSE 1u

/* A buffer's element type. The daemon works in fp32 whatever it is: it
 * widens a bf16/fp16 gradient exactly, keeps the residual in fp32, and
 * writes the update back rounded to nearest (ties to even). */
typedef enum microd_dtype {
  MICROD_DTYPE_FLOAT32 = 1,
  MICROD_DTYPE_BFLOAT16 = 2, /* 2 bytes: the top half of an fp32 */
  MICROD_DTYPE_FLOAT16 = 3   /* 2 bytes: IEEE binary16 */
} microd_dtype;

typedef struct microd_buffer_options {
  size_t struct_size;
  uint32_t flags; /* MICROD_BUFFER_* */
  uint32_t dtype; /* microd_dtype; 0 is MICROD_DTYPE_FLOAT32. Every process
                     registers a name with the same dtype. */
} microd_buffer_options;

/* Fills defaults (no flags, fp32). Never blocks. */
MICROD_API void microd_buffer_options_init(microd_buffer_options* options);

/* Allocates `count` fp32 elements in shared memory, registers them with the
 * daemon under `name` (every process of the job registers the same names with
 * the same counts) and returns the buffer to fill in *data and its id in
 * *buffer_id. The memory belongs to the library until microd_close. Blocks
 * until the daemon acknowledged. The short form of
 * microd_register_typed_buffer (no options, fp32), kept for the common case. */
MICROD_API microd_status microd_register_host_buffer(microd_client* client, const char* name,
                                                     uint64_t count, float** data,
                                                     int32_t* buffer_id);

/* microd_register_host_buffer with options (NULL: defaults, fp32): the
 * flags (MICROD_BUFFER_DENSE) and any dtype. *data receives `count` elements
 * of options->dtype (fp32: float; bf16 and fp16: 2 bytes each, e.g. uint16_t
 * bits, C's _Float16, a torch.bfloat16/float16 tensor over the memory).
 * Every process registers a name with the same count, flags and dtype (a
 * difference is MICROD_ERR_MISMATCH, naming the dtypes). Blocks. */
MICROD_API microd_status microd_register_typed_buffer(microd_client* client, const char* name,
                                                      uint64_t count,
                                                      const microd_buffer_options* options,
                                                      void** data, int32_t* buffer_id);

/* Registers `count` fp32 elements of GPU memory at `device_ptr` under `name`:
 * memory from cudaMalloc, or a piece of such an allocation (e.g. a PyTorch
 * tensor of the caching allocator). The daemon maps the allocation with CUDA
 * IPC (once per process and allocation) and writes the update into it in
 * place; *buffer_id is the id to submit. Every process of the job registers
 * a name with the same count and flags; one process may use a CUDA buffer
 * where another uses a host buffer. Blocks until the daemon acknowledged.
 *
 * The first call loads the CUDA driver (libcuda.so.1, or the file
 * $MICROD_LIBCUDA names) with dlopen; nothing else in this library uses CUDA.
 * Refused with a message:
 * - MICROD_ERR_UNSUPPORTED: no usable CUDA driver or GPU in this process; a
 *   daemon without CUDA (a CPU build, no usable GPU, or a GPU it cannot see:
 *   trainer and daemon must see the same GPUs); memory legacy CUDA IPC cannot
 *   share: stream-ordered pools (cudaMallocAsync, PyTorch's
 *   backend:cudaMallocAsync) and virtual-memory allocations (cuMemCreate,
 *   PyTorch's expandable_segments:True).
 * - MICROD_ERR_INVALID_ARGUMENT: not device memory (host or managed memory),
 *   not 4-byte aligned, or `count` elements run past the allocation's end.
 * The memory must stay allocated until microd_close, and microd_close must
 * come before the buffer's CUDA context goes (cudaDeviceReset, process exit). */
MICROD_API microd_status microd_register_cuda_buffer(microd_client* client, const char* name,
                                                     void* device_ptr, uint64_t count,
                                                     const microd_buffer_options* options,
                                                     int32_t* buffer_id);

/* Submits the buffer's current contents for averaging and returns at once
 * with a ticket. Do not touch the buffer until microd_wait reports the
 * ticket done: the update is then in the buffer. After a failure (e.g.
 * MICROD_ERR_NONFINITE) on a node with several processes, local rank 0's
 * buffer may hold their sum rather than its own gradient (the daemon sums
 * them there). One submission per buffer may be pending at a time. A CUDA
 * buffer is submitted as by microd_allreduce_cuda_async with the legacy
 * default stream. */
MICROD_API microd_status microd_allreduce_async(microd_client* client, int32_t buffer_id,
                                                uint64_t* ticket);

/* microd_allreduce_async for a CUDA buffer whose gradient is produced on
 * `cuda_stream` (a cudaStream_t or CUstream of the buffer's device; NULL: the
 * legacy default stream, which waits for the work of every blocking stream
 * of the device, but not for streams created with cudaStreamNonBlocking, such
 * as PyTorch's side streams). The library records the buffer's ready event on
 * that stream and the daemon reads the buffer only once the work queued there
 * before this call is done: no synchronisation is needed before submitting.
 * When microd_wait reports the ticket done, the update is in device memory
 * and work queued afterwards sees it. For a host buffer, cuda_stream must be
 * NULL. Never waits for the GPU. */
MICROD_API microd_status microd_allreduce_cuda_async(microd_client* client, int32_t buffer_id,
                                                     void* cuda_stream, uint64_t* ticket);

/* Waits until the ticket completes or timeout_ms passes (< 0: no limit;
 * 0: poll). Returns the operation's status. Blocks. */
MICROD_API microd_status microd_wait(microd_client* client, uint64_t ticket, int32_t timeout_ms);

/* microd_allreduce_async followed by microd_wait. Blocks. */
MICROD_API microd_status microd_allreduce(microd_client* client, int32_t buffer_id,
                                          int32_t timeout_ms);

/* Saves the daemons' compression state of the job (every bucket's residual,
 * momentum-correction velocity, threshold state and step counter) into the
 * directory `dir` (made if missing), one file per node, written atomically
 * with a checksum: put it next to the model's checkpoint. Collective: every
 * process of the job calls it at the same point, after waiting for its
 * allreduces; it returns once this node's file is written. Blocks at most
 * timeout_ms (< 0: no limit). */
MICROD_API microd_status microd_state_save(microd_client* client, const char* dir,
                                           int32_t timeout_ms);

/* Loads what microd_state_save wrote, after registering every buffer and
 * before the first allreduce of the resumed job; the steps then continue
 * exactly as if the job had not stopped. Refused (MICROD_ERR_MISMATCH,
 * nothing loaded) when the job differs from the saved one (nodes, processes,
 * buckets, sizes, sparsifier options) or a file is torn or corrupted (the
 * message names what). Collective, like microd_state_save. */
MICROD_API microd_status microd_state_load(microd_client* client, const char* dir,
                                           int32_t timeout_ms);

/* Says goodbye, unmaps the buffers (CUDA buffers: destroys their ready
 * events, except those of submissions still in flight, which the daemon may
 * still wait on; the daemon then closes its mappings) and frees the handle
 * (NULL is a no-op).
 * Pending tickets are abandoned. No other thread may use the handle during
 * or after this call. */
MICROD_API microd_status microd_close(microd_client* client);

#ifdef __cplusplus
}
#endif

#endif /* MICROD_MICROD_H_ */
