// SPDX-License-Identifier: Apache-2.0
/* The local protocol between the client library and the daemon: versioned,
 * fixed-layout messages over a SOCK_SEQPACKET Unix socket, one message per
 * packet; host buffers travel as memfd file descriptors (SCM_RIGHTS). Both
 * sides validate every field. Shared by client/src (C) and daemon/local (C++).
 */
#ifndef MICROD_CLIENT_WIRE_H_
#define MICROD_CLIENT_WIRE_H_

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#define MICROD_WIRE_MAGIC 0x4452434Du /* "MCRD" */
#define MICROD_WIRE_VERSION 1
#define MICROD_WIRE_NAME_BYTES 128    /* bucket names, NUL-terminated */
#define MICROD_WIRE_MESSAGE_BYTES 256 /* error text, NUL-terminated */
#define MICROD_WIRE_MAX_BYTES 1024    /* no message is larger */
#define MICROD_WIRE_PATH_BYTES 768    /* directory of a STATE message, NUL-terminated */

enum microd_wire_type {
  MICROD_MSG_HELLO = 1,          /* client -> daemon */
  MICROD_MSG_HELLO_ACK = 2,      /* daemon -> client */
  MICROD_MSG_REGISTER = 3,       /* client -> daemon, with the memfd */
  MICROD_MSG_REGISTER_ACK = 4,   /* daemon -> client */
  MICROD_MSG_SUBMIT = 5,         /* client -> daemon */
  MICROD_MSG_COMPLETION = 6,     /* daemon -> client */
  MICROD_MSG_ERROR = 7,          /* daemon -> client, then the daemon disconnects */
  MICROD_MSG_GOODBYE = 8,        /* client -> daemon */
  MICROD_MSG_REGISTER_CUDA = 9,  /* client -> daemon, answered with REGISTER_ACK */
  MICROD_MSG_STATE = 10,         /* client -> daemon, answered with a COMPLETION */
  MICROD_MSG_MEMBERSHIP = 11,    /* daemon -> client (one with MICROD_WIRE_CAP_MEMBERSHIP) */
  MICROD_MSG_WAITING = 12,       /* client -> daemon (one with MICROD_WIRE_CAP_WAITING) */
  MICROD_MSG_WAITING_ANSWER = 13 /* daemon -> client */
};

/* Capabilities: in a HELLO_ACK the header's `reserved` field carries these
 * bits (daemons that predate them send 0). A client sends REGISTER_CUDA only
 * to a daemon whose hello answer has MICROD_WIRE_CAP_REGISTER_CUDA; that
 * daemon answers it, with MICROD_ERR_UNSUPPORTED where it has no CUDA (a CPU
 * build, or no usable GPU), never by dropping the connection. */
#define MICROD_WIRE_CAP_REGISTER_CUDA 1u
/* A daemon with this bit in its HELLO_ACK answers a WAITING message (what
 * one of the client's buffers waits for) with a WAITING_ANSWER. The client
 * asks when a wait for a completion times out, and says it in its error. */
#define MICROD_WIRE_CAP_WAITING 8u
/* In a HELLO the header's `reserved` field carries the client's bits: with
 * MICROD_WIRE_CAP_MEMBERSHIP the client understands MEMBERSHIP messages and
 * the status MICROD_ERR_MEMBERSHIP. An elastic job's daemon sends such a
 * client a MEMBERSHIP when the job's membership changes, before completing
 * its pending submissions with MICROD_ERR_MEMBERSHIP; a client without the
 * bit gets MICROD_ERR_JOB_FAILED for them instead (it could not follow). */
#define MICROD_WIRE_CAP_MEMBERSHIP 2u
/* With MICROD_WIRE_CAP_FENCE too (in HELLO), the client puts in each SUBMIT's
 * `reserved` the number of MEMBERSHIP messages it has read. The daemon
 * answers a submission made before the client read every change of
 * membership it had at the time MICROD_ERR_MEMBERSHIP (after the MEMBERSHIP
 * message): no gradient of a process that has not heard of a change goes
 * into a step of the new epoch. A daemon whose job is past epoch 0 sends
 * such a client a MEMBERSHIP right after the HELLO_ACK, which it need not
 * count as a change (the client reads it as its epoch). */
#define MICROD_WIRE_CAP_FENCE 4u

enum microd_wire_buffer_kind { MICROD_BUFFER_HOST = 1, MICROD_BUFFER_CUDA = 2 };
/* The values of microd.h's MICROD_DTYPE_* (there: the buffer options). */
enum microd_wire_dtype {
  MICROD_WIRE_DTYPE_FLOAT32 = 1,
  MICROD_WIRE_DTYPE_BFLOAT16 = 2,
  MICROD_WIRE_DTYPE_FLOAT16 = 3
};

typedef struct microd_wire_header {
  uint32_t magic;
  uint16_t version;
  uint16_t type;
  uint32_t length;   /* whole message, header included; must equal the packet size */
  uint32_t reserved; /* 0; in HELLO_ACK: MICROD_WIRE_CAP_* bits */
} microd_wire_header;

typedef struct microd_wire_hello {
  microd_wire_header h;
  int32_t local_rank; /* -1: any */
  uint32_t pid;
} microd_wire_hello;

typedef struct microd_wire_hello_ack {
  microd_wire_header h;
  int32_t status;
  int32_t local_rank;
  int32_t local_size;
  int32_t node_rank;
  int32_t node_count;
  int32_t rank;
  int32_t world_size;
  float momentum_correction; /* > 0: the daemon applies momentum; the trainer must not */
  char message[MICROD_WIRE_MESSAGE_BYTES];
} microd_wire_hello_ack;

typedef struct microd_wire_register {
  microd_wire_header h;
  uint32_t buffer_id;
  uint32_t kind;  /* microd_wire_buffer_kind */
  uint32_t dtype; /* microd_wire_dtype */
  uint32_t flags; /* MICROD_BUFFER_* flags of microd.h */
  uint64_t count; /* elements */
  char name[MICROD_WIRE_NAME_BYTES];
  /* Unused (zero): CUDA buffers are registered with REGISTER_CUDA, which has
   * room for the ready event and the GPU's identity. A REGISTER of kind CUDA
   * is answered MICROD_ERR_UNSUPPORTED. */
  uint8_t cuda_ipc_handle[64];
  uint64_t cuda_offset;
} microd_wire_register;

/* A buffer in the GPU memory of the training process (no descriptor). The
 * daemon opens the allocation's IPC handle once per process and allocation
 * and works on the bytes [offset, offset + 4 * count) of it. Before every
 * SUBMIT of this buffer the client records the event behind event_handle on
 * the stream that produced the gradient; the daemon reads the buffer only
 * once that event completed, and answers the SUBMIT only once the update is
 * in the buffer (its copies done). */
typedef struct microd_wire_register_cuda {
  microd_wire_header h;
  uint32_t buffer_id;
  uint32_t dtype;         /* microd_wire_dtype */
  uint32_t flags;         /* MICROD_BUFFER_* flags of microd.h */
  int32_t device_ordinal; /* the GPU's ordinal in the client (for messages only) */
  uint64_t count;         /* elements */
  char name[MICROD_WIRE_NAME_BYTES];
  uint8_t device_uuid[16];  /* the GPU (cuDeviceGetUuid_v2): ordinals differ between processes */
  uint8_t mem_handle[64];   /* cudaIpcMemHandle_t of the whole allocation */
  uint64_t alloc_bytes;     /* the allocation's size */
  uint64_t offset;          /* the buffer's byte offset in the allocation */
  uint8_t event_handle[64]; /* cudaIpcEventHandle_t of the buffer's ready event */
} microd_wire_register_cuda;

typedef struct microd_wire_register_ack {
  microd_wire_header h;
  uint32_t buffer_id;
  int32_t status;
  char message[MICROD_WIRE_MESSAGE_BYTES];
} microd_wire_register_ack;

typedef struct microd_wire_submit {
  microd_wire_header h;
  uint32_t buffer_id;
  uint32_t reserved; /* 0; with MICROD_WIRE_CAP_FENCE: MEMBERSHIP messages read */
  uint64_t ticket;
} microd_wire_submit;

typedef struct microd_wire_completion {
  microd_wire_header h;
  uint64_t ticket;
  uint32_t buffer_id;
  int32_t status;
  char message[MICROD_WIRE_MESSAGE_BYTES];
} microd_wire_completion;

typedef struct microd_wire_error {
  microd_wire_header h;
  int32_t status;
  uint32_t reserved;
  char message[MICROD_WIRE_MESSAGE_BYTES];
} microd_wire_error;

/* Save or load the daemon's compression state (microd_state_save/_load):
 * answered with a COMPLETION of `ticket` (buffer_id MICROD_WIRE_NO_BUFFER)
 * once every local process asked the same and the node's file is written or
 * read. */
enum microd_wire_state_op { MICROD_STATE_SAVE = 1, MICROD_STATE_LOAD = 2 };
#define MICROD_WIRE_NO_BUFFER 0xFFFFFFFFu
typedef struct microd_wire_state {
  microd_wire_header h;
  uint32_t op; /* microd_wire_state_op */
  uint32_t reserved;
  uint64_t ticket;
  char dir[MICROD_WIRE_PATH_BYTES];
} microd_wire_state;

/* The process's place in the job's new membership epoch. */
typedef struct microd_wire_membership {
  microd_wire_header h;
  uint64_t epoch;
  int32_t rank;
  int32_t world_size;
  int32_t local_rank;
  int32_t local_size;
  int32_t node_rank;
  int32_t node_count;
  char message[MICROD_WIRE_MESSAGE_BYTES]; /* what changed */
} microd_wire_membership;

/* What a submitted buffer waits for: the local processes that did not
 * submit it, the nodes where it is not ready (as the coordinator last heard
 * them), or the step it is in. */
#define MICROD_WIRE_WAITING_BYTES 768
typedef struct microd_wire_waiting {
  microd_wire_header h;
  uint32_t buffer_id;
  uint32_t reserved;
} microd_wire_waiting;
typedef struct microd_wire_waiting_answer {
  microd_wire_header h;
  uint32_t buffer_id;
  uint32_t reserved;
  char text[MICROD_WIRE_WAITING_BYTES]; /* NUL-terminated */
} microd_wire_waiting_answer;

typedef struct microd_wire_goodbye {
  microd_wire_header h;
} microd_wire_goodbye;

/* Sends one message, with the descriptor `pass_fd` attached when it is not
 * negative (SCM_RIGHTS). 0 on success, -1 otherwise (errno says why). */
static inline int microd_wire_send(int sock, const void* msg, size_t len, int pass_fd) {
  struct iovec iov;
  struct msghdr mh;
  union {
    char bytes[CMSG_SPACE(sizeof(int))];
    struct cmsghdr align;
  } control;
  ssize_t n;
  iov.iov_base = (void*)msg;
  iov.iov_len = len;
  memset(&mh, 0, sizeof mh);
  mh.msg_iov = &iov;
  mh.msg_iovlen = 1;
  if (pass_fd >= 0) {
    struct cmsghdr* cm;
    memset(&control, 0, sizeof control);
    mh.msg_control = control.bytes;
    mh.msg_controllen = sizeof control.bytes;
    cm = CMSG_FIRSTHDR(&mh);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    memcpy(CMSG_DATA(cm), &pass_fd, sizeof(int));
  }
  do {
    n = sendmsg(sock, &mh, MSG_NOSIGNAL);
  } while (n < 0 && errno == EINTR);
  return n == (ssize_t)len ? 0 : -1;
}

/* Fills the header of a message of `type`, `length` bytes in all. */
static inline void microd_wire_header_init(microd_wire_header* h, uint16_t type, uint32_t length) {
  h->magic = MICROD_WIRE_MAGIC;
  h->version = MICROD_WIRE_VERSION;
  h->type = type;
  h->length = length;
  h->reserved = 0;
}

#ifdef __cplusplus
static_assert(sizeof(microd_wire_header) == 16, "wire layout");
static_assert(sizeof(microd_wire_register) == 240, "wire layout");
static_assert(sizeof(microd_wire_completion) == 288, "wire layout");
static_assert(sizeof(microd_wire_register_cuda) == 328, "wire layout");
static_assert(sizeof(microd_wire_state) == 800, "wire layout");
static_assert(sizeof(microd_wire_waiting_answer) == 792, "wire layout");
#else
_Static_assert(sizeof(microd_wire_header) == 16, "wire layout");
_Static_assert(sizeof(microd_wire_register) == 240, "wire layout");
_Static_assert(sizeof(microd_wire_completion) == 288, "wire layout");
_Static_assert(sizeof(microd_wire_register_cuda) == 328, "wire layout");
_Static_assert(sizeof(microd_wire_state) == 800, "wire layout");
_Static_assert(sizeof(microd_wire_waiting_answer) == 792, "wire layout");
#endif

#endif /* MICROD_CLIENT_WIRE_H_ */
