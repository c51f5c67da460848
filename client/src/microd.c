// SPDX-License-Identifier: Apache-2.0
/* microd client library (libc only). See include/microd/microd.h. */
#define _GNU_SOURCE
#include "microd/microd.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "cuda_driver.h"
#include "microd/wire.h"

#define CLIENT_MAGIC 0x6d636c69u /* "mcli" */
#define DEFAULT_SOCKET "/run/microd/microd.sock"
#define DEFAULT_TIMEOUT_MS 60000
#define READ_SLICE_MS 20
/* How long a timed-out wait waits for the daemon's account of it. */
#define WAITING_ANSWER_MS 1000
/* Room for an error message: a timed-out wait's carries the daemon's account. */
#define ERROR_BYTES 1280
#define MAX_BUCKET_ELEMENTS 0xFFFFFFFFull

typedef struct buffer {
  char name[MICROD_WIRE_NAME_BYTES];
  float* data; /* host: the shared memory; CUDA: the device pointer */
  uint64_t count;
  size_t bytes; /* of the shared memory mapping (host buffers) */
  int pending;  /* a submission is in flight */
  int is_cuda;
  mcuda_buffer cuda; /* CUDA buffers: the ready event and the allocation's context */
} buffer;

typedef struct ticket_entry {
  uint64_t ticket;
  int32_t buffer_id;
  int done;
  microd_status status;
  char message[MICROD_WIRE_MESSAGE_BYTES];
} ticket_entry;

struct microd_client {
  uint32_t magic;
  int fd;
  pthread_mutex_t mu;      /* guards everything below */
  pthread_mutex_t read_mu; /* one thread reads the socket at a time */
  microd_job_info info;
  uint64_t epoch;        /* the membership epoch of `info` */
  uint32_t changes_seen; /* MEMBERSHIP messages read (sent with each SUBMIT) */
  float momentum_correction;
  uint32_t daemon_caps; /* MICROD_WIRE_CAP_* of the hello answer */
  buffer* buffers;
  int32_t nbuffers, buffers_cap;
  ticket_entry* tickets;
  size_t ntickets, tickets_cap;
  uint64_t next_ticket;
  /* The last REGISTER_ACK, handed from the reader to the registering thread. */
  int have_register_ack;
  microd_wire_register_ack register_ack;
  microd_status broken; /* MICROD_OK while the connection is usable */
  char broken_message[MICROD_WIRE_MESSAGE_BYTES];
  /* WAITING_ANSWERs read, and the text of the last one. */
  uint64_t waiting_answers;
  char waiting_text[MICROD_WIRE_WAITING_BYTES];
  char last_error[ERROR_BYTES];
};

static __thread char tls_error[ERROR_BYTES];

static int64_t now_ms(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* Records the message of a failure on the handle (or thread) and returns it. */
static microd_status fail(microd_client* c, microd_status status, const char* fmt, ...) {
  char* dst = c != NULL ? c->last_error : tls_error;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(dst, ERROR_BYTES, fmt, ap);
  va_end(ap);
  return status;
}

/* dst has MICROD_WIRE_MESSAGE_BYTES; src is NUL-terminated. */
static void copy_message(char* dst, const char* src) {
  snprintf(dst, MICROD_WIRE_MESSAGE_BYTES, "%s", src);
}

static int valid_status(int32_t s) { return s >= MICROD_OK && s <= MICROD_ERR_MEMBERSHIP; }

/* Marks the connection unusable; every later call returns `status`. */
static void break_connection(microd_client* c, microd_status status, const char* message) {
  if (c->broken == MICROD_OK) {
    c->broken = status;
    copy_message(c->broken_message, message);
  }
}

static ticket_entry* find_ticket(microd_client* c, uint64_t ticket) {
  for (size_t i = 0; i < c->ntickets; ++i) {
    if (c->tickets[i].ticket == ticket) return &c->tickets[i];
  }
  return NULL;
}

/* Reads at most one message within timeout_ms and dispatches it. Called with
 * read_mu held, mu not held. */
static void read_one(microd_client* c, int timeout_ms) {
  struct pollfd p = {c->fd, POLLIN, 0};
  int r = poll(&p, 1, timeout_ms);
  if (r <= 0) return;
  union {
    microd_wire_header h;
    microd_wire_hello_ack hello;
    microd_wire_register_ack reg;
    microd_wire_completion done;
    microd_wire_error err;
    microd_wire_membership membership;
    microd_wire_waiting_answer waiting;
    char bytes[MICROD_WIRE_MAX_BYTES + 1];
  } m;
  ssize_t n;
  do {
    n = recv(c->fd, &m, sizeof m, 0);
  } while (n < 0 && errno == EINTR);
  pthread_mutex_lock(&c->mu);
  if (n <= 0) {
    break_connection(
        c, MICROD_ERR_UNAVAILABLE,
        n == 0 ? "the daemon closed the connection" : "reading from the daemon failed");
  } else if ((size_t)n < sizeof(microd_wire_header) || m.h.magic != MICROD_WIRE_MAGIC ||
             m.h.version != MICROD_WIRE_VERSION || m.h.length != (uint32_t)n) {
    break_connection(c, MICROD_ERR_PROTOCOL, "malformed message from the daemon");
  } else if (m.h.type == MICROD_MSG_COMPLETION && n == sizeof(microd_wire_completion)) {
    ticket_entry* t = find_ticket(c, m.done.ticket);
    m.done.message[MICROD_WIRE_MESSAGE_BYTES - 1] = '\0';
    if (t != NULL && !t->done) {
      t->done = 1;
      t->status = valid_status(m.done.status) ? (microd_status)m.done.status : MICROD_ERR_PROTOCOL;
      copy_message(t->message, m.done.message);
      if (t->buffer_id >= 0 && t->buffer_id < c->nbuffers) c->buffers[t->buffer_id].pending = 0;
    }
  } else if (m.h.type == MICROD_MSG_MEMBERSHIP && n == sizeof(microd_wire_membership)) {
    const microd_wire_membership* mm = &m.membership;
    if (mm->node_count < 1 || mm->node_rank < 0 || mm->node_rank >= mm->node_count ||
        mm->local_rank < 0 || mm->local_rank >= mm->local_size || mm->rank < 0 ||
        mm->rank >= mm->world_size || mm->world_size < mm->node_count || mm->epoch < c->epoch) {
      break_connection(c, MICROD_ERR_PROTOCOL, "malformed membership message from the daemon");
    } else {
      c->epoch = mm->epoch;
      ++c->changes_seen;
      c->info.rank = mm->rank;
      c->info.world_size = mm->world_size;
      c->info.local_rank = mm->local_rank;
      c->info.local_size = mm->local_size;
      c->info.node_rank = mm->node_rank;
      c->info.node_count = mm->node_count;
    }
  } else if (m.h.type == MICROD_MSG_WAITING_ANSWER && n == sizeof(microd_wire_waiting_answer)) {
    m.waiting.text[MICROD_WIRE_WAITING_BYTES - 1] = '\0';
    snprintf(c->waiting_text, sizeof c->waiting_text, "%s", m.waiting.text);
    ++c->waiting_answers;
  } else if (m.h.type == MICROD_MSG_REGISTER_ACK && n == sizeof(microd_wire_register_ack)) {
    c->register_ack = m.reg;
    c->have_register_ack = 1;
  } else if (m.h.type == MICROD_MSG_ERROR && n == sizeof(microd_wire_error)) {
    m.err.message[MICROD_WIRE_MESSAGE_BYTES - 1] = '\0';
    break_connection(c,
                     valid_status(m.err.status) ? (microd_status)m.err.status : MICROD_ERR_PROTOCOL,
                     m.err.message);
  } else {
    break_connection(c, MICROD_ERR_PROTOCOL, "unexpected message from the daemon");
  }
  pthread_mutex_unlock(&c->mu);
}

static int check_handle(const microd_client* c) { return c != NULL && c->magic == CLIENT_MAGIC; }

int microd_version(void) { return MICROD_VERSION_CODE; }

const char* microd_status_string(microd_status status) {
  switch (status) {
    case MICROD_OK:
      return "MICROD_OK";
    case MICROD_ERR_INVALID_ARGUMENT:
      return "MICROD_ERR_INVALID_ARGUMENT: bad argument";
    case MICROD_ERR_UNAVAILABLE:
      return "MICROD_ERR_UNAVAILABLE: daemon not reachable";
    case MICROD_ERR_TIMEOUT:
      return "MICROD_ERR_TIMEOUT: deadline passed";
    case MICROD_ERR_MISMATCH:
      return "MICROD_ERR_MISMATCH: buffers differ between processes";
    case MICROD_ERR_JOB_FAILED:
      return "MICROD_ERR_JOB_FAILED: the job failed";
    case MICROD_ERR_UNSUPPORTED:
      return "MICROD_ERR_UNSUPPORTED: not supported by this build";
    case MICROD_ERR_PROTOCOL:
      return "MICROD_ERR_PROTOCOL: malformed message";
    case MICROD_ERR_RESOURCE:
      return "MICROD_ERR_RESOURCE: out of memory or over a limit";
    case MICROD_ERR_PERMISSION:
      return "MICROD_ERR_PERMISSION: refused by the daemon";
    case MICROD_ERR_NONFINITE:
      return "MICROD_ERR_NONFINITE: NaN or Inf in a gradient";
    case MICROD_ERR_INTERNAL:
      return "MICROD_ERR_INTERNAL: internal error";
    case MICROD_ERR_CLOSED:
      return "MICROD_ERR_CLOSED: handle closed";
    case MICROD_ERR_MEMBERSHIP:
      return "MICROD_ERR_MEMBERSHIP: the job's membership changed; submit again";
  }
  return "MICROD_ERR_UNKNOWN: unknown status";
}

void microd_options_init(microd_options* options) {
  if (options == NULL) return;
  memset(options, 0, sizeof *options);
  options->struct_size = sizeof *options;
  options->socket_path = NULL;
  options->local_rank = -1;
  options->timeout_ms = DEFAULT_TIMEOUT_MS;
}

const char* microd_last_error(const microd_client* client) {
  if (client == NULL) return tls_error;
  if (!check_handle(client)) return "invalid or closed microd_client handle";
  return client->last_error;
}

/* The options in effect: the caller's, then the environment, then the
 * defaults. */
static microd_status resolve_options(const microd_options* options, microd_options* o) {
  microd_options_init(o);
  if (options != NULL) {
    if (options->struct_size < offsetof(microd_options, timeout_ms) + sizeof(int32_t) ||
        options->struct_size > 4096) {
      return fail(NULL, MICROD_ERR_INVALID_ARGUMENT,
                  "options->struct_size is %zu: call microd_options_init first",
                  options->struct_size);
    }
    o->socket_path = options->socket_path;
    o->local_rank = options->local_rank;
    o->timeout_ms = options->timeout_ms;
  }
  if (o->socket_path == NULL) o->socket_path = getenv("MICROD_SOCKET");
  if (o->socket_path == NULL || o->socket_path[0] == '\0') o->socket_path = DEFAULT_SOCKET;
  if (o->local_rank < 0) {
    const char* env = getenv("MICROD_LOCAL_RANK");
    if (env == NULL) env = getenv("LOCAL_RANK");
    if (env != NULL && env[0] != '\0') {
      char* end = NULL;
      long v = strtol(env, &end, 10);
      if (*end != '\0' || v < 0 || v > 65535) {
        return fail(NULL, MICROD_ERR_INVALID_ARGUMENT, "bad local rank '%s' in the environment",
                    env);
      }
      o->local_rank = (int32_t)v;
    }
  }
  if (o->timeout_ms <= 0) o->timeout_ms = DEFAULT_TIMEOUT_MS;
  return MICROD_OK;
}

/* Whether the process serving the socket may be handed this process's
 * buffers: it runs as this process's uid, as root, or as the uid in
 * $MICROD_DAEMON_UID (a sidecar of another uid). Anyone who can write the
 * socket's directory could otherwise serve a socket of their own there and
 * receive the trainer's memory. */
static microd_status check_daemon(int fd, const char* path) {
  struct ucred cred;
  socklen_t len = sizeof cred;
  if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return fail(NULL, MICROD_ERR_UNAVAILABLE, "cannot tell who serves %s: %s", path,
                strerror(errno));
  }
  if (cred.uid == geteuid() || cred.uid == 0) return MICROD_OK;
  const char* env = getenv("MICROD_DAEMON_UID");
  if (env != NULL && env[0] != '\0') {
    char* end = NULL;
    const unsigned long v = strtoul(env, &end, 10);
    if (*end != '\0' || v > 0xFFFFFFFEul) {
      return fail(NULL, MICROD_ERR_INVALID_ARGUMENT, "bad uid '%s' in MICROD_DAEMON_UID", env);
    }
    if ((uid_t)v == cred.uid) return MICROD_OK;
  }
  return fail(NULL, MICROD_ERR_PERMISSION,
              "the process serving %s (pid %d) runs as uid %u, not this process's uid %u, root "
              "or $MICROD_DAEMON_UID: not handing it this process's buffers",
              path, (int)cred.pid, (unsigned)cred.uid, (unsigned)geteuid());
}

/* Connects to the daemon's socket, retrying while it is not there yet (a
 * sidecar starting beside the trainer) until the deadline. */
static microd_status connect_socket(const char* path, int64_t deadline, int* out_fd) {
  struct sockaddr_un addr;
  memset(&addr, 0, sizeof addr);
  addr.sun_family = AF_UNIX;
  if (strlen(path) >= sizeof addr.sun_path) {
    return fail(NULL, MICROD_ERR_INVALID_ARGUMENT, "socket path too long: %s", path);
  }
  strcpy(addr.sun_path, path);
  for (;;) {
    const int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0) return fail(NULL, MICROD_ERR_RESOURCE, "socket: %s", strerror(errno));
    if (connect(fd, (struct sockaddr*)&addr, sizeof addr) == 0) {
      const microd_status s = check_daemon(fd, path);
      if (s != MICROD_OK) {
        close(fd);
        return s;
      }
      *out_fd = fd;
      return MICROD_OK;
    }
    const int err = errno;
    close(fd);
    if ((err != ENOENT && err != ECONNREFUSED && err != EAGAIN) || now_ms() >= deadline) {
      return fail(NULL, MICROD_ERR_UNAVAILABLE, "cannot connect to microd at %s: %s", path,
                  strerror(err));
    }
    usleep(10000);
  }
}

/* Says hello and reads the daemon's answer into `ack`. */
static microd_status say_hello(int fd, const microd_options* o, int64_t deadline,
                               microd_wire_hello_ack* ack) {
  microd_wire_hello hello;
  memset(&hello, 0, sizeof hello);
  microd_wire_header_init(&hello.h, MICROD_MSG_HELLO, sizeof hello);
  /* This library follows membership changes, and says how many it has read. */
  hello.h.reserved = MICROD_WIRE_CAP_MEMBERSHIP | MICROD_WIRE_CAP_FENCE;
  hello.local_rank = o->local_rank;
  hello.pid = (uint32_t)getpid();
  /* A daemon that refuses this process answers with an ERROR and closes at
   * once: the hello may fail to send, but the answer is still there to read. */
  const int hello_errno = microd_wire_send(fd, &hello, sizeof hello, -1) != 0 ? errno : 0;
  ssize_t n = -1;
  for (;;) {
    int left = hello_errno != 0 ? 100 : (int)(deadline - now_ms());
    struct pollfd p = {fd, POLLIN, 0};
    if (left <= 0 || poll(&p, 1, left) <= 0) {
      if (hello_errno != 0) {
        return fail(NULL, MICROD_ERR_UNAVAILABLE, "sending hello: %s", strerror(hello_errno));
      }
      return fail(NULL, MICROD_ERR_TIMEOUT, "no answer from microd at %s", o->socket_path);
    }
    n = recv(fd, ack, sizeof *ack, 0);
    if (n < 0 && errno == EINTR) continue;
    break;
  }
  if (n <= 0 && hello_errno != 0) {
    return fail(NULL, MICROD_ERR_UNAVAILABLE, "sending hello: %s", strerror(hello_errno));
  }
  if (n == (ssize_t)sizeof(microd_wire_error) && ack->h.type == MICROD_MSG_ERROR) {
    microd_wire_error* e = (microd_wire_error*)ack;
    e->message[MICROD_WIRE_MESSAGE_BYTES - 1] = '\0';
    return fail(NULL, valid_status(e->status) ? (microd_status)e->status : MICROD_ERR_PROTOCOL,
                "microd refused the connection: %s", e->message);
  }
  if (n != (ssize_t)sizeof *ack || ack->h.magic != MICROD_WIRE_MAGIC ||
      ack->h.version != MICROD_WIRE_VERSION || ack->h.type != MICROD_MSG_HELLO_ACK ||
      ack->h.length != sizeof *ack) {
    return fail(NULL, MICROD_ERR_PROTOCOL, "malformed answer from microd at %s", o->socket_path);
  }
  ack->message[MICROD_WIRE_MESSAGE_BYTES - 1] = '\0';
  if (ack->status != MICROD_OK) {
    return fail(NULL, valid_status(ack->status) ? (microd_status)ack->status : MICROD_ERR_PROTOCOL,
                "microd refused the connection: %s", ack->message);
  }
  return MICROD_OK;
}

microd_status microd_connect(const microd_options* options, microd_client** out) {
  tls_error[0] = '\0';
  if (out == NULL) return fail(NULL, MICROD_ERR_INVALID_ARGUMENT, "out is NULL");
  *out = NULL;
  microd_options o;
  microd_status st = resolve_options(options, &o);
  if (st != MICROD_OK) return st;
  const int64_t deadline = now_ms() + o.timeout_ms;
  int fd = -1;
  st = connect_socket(o.socket_path, deadline, &fd);
  if (st != MICROD_OK) return st;
  microd_wire_hello_ack ack;
  st = say_hello(fd, &o, deadline, &ack);
  if (st != MICROD_OK) {
    close(fd);
    return st;
  }
  microd_client* c = calloc(1, sizeof *c);
  if (c == NULL) {
    close(fd);
    return fail(NULL, MICROD_ERR_RESOURCE, "out of memory");
  }
  c->magic = CLIENT_MAGIC;
  c->fd = fd;
  pthread_mutex_init(&c->mu, NULL);
  pthread_mutex_init(&c->read_mu, NULL);
  c->info.rank = ack.rank;
  c->info.world_size = ack.world_size;
  c->info.local_rank = ack.local_rank;
  c->info.local_size = ack.local_size;
  c->info.node_rank = ack.node_rank;
  c->info.node_count = ack.node_count;
  c->momentum_correction = ack.momentum_correction;
  c->daemon_caps = ack.h.reserved;
  *out = c;
  return MICROD_OK;
}

microd_status microd_job_info_get(const microd_client* client, microd_job_info* out) {
  if (!check_handle(client)) return fail(NULL, MICROD_ERR_INVALID_ARGUMENT, "invalid handle");
  if (out == NULL) return MICROD_ERR_INVALID_ARGUMENT;
  /* The reader updates it on a MEMBERSHIP message. */
  microd_client* c = (microd_client*)client;
  pthread_mutex_lock(&c->mu);
  *out = c->info;
  pthread_mutex_unlock(&c->mu);
  return MICROD_OK;
}

microd_status microd_job_epoch(const microd_client* client, uint64_t* epoch) {
  if (!check_handle(client)) return fail(NULL, MICROD_ERR_INVALID_ARGUMENT, "invalid handle");
  if (epoch == NULL) return MICROD_ERR_INVALID_ARGUMENT;
  microd_client* c = (microd_client*)client;
  pthread_mutex_lock(&c->mu);
  *epoch = c->epoch;
  pthread_mutex_unlock(&c->mu);
  return MICROD_OK;
}

void microd_buffer_options_init(microd_buffer_options* options) {
  if (options == NULL) return;
  memset(options, 0, sizeof *options);
  options->struct_size = sizeof *options;
}

_Static_assert((int)MICROD_DTYPE_FLOAT32 == (int)MICROD_WIRE_DTYPE_FLOAT32 &&
                   (int)MICROD_DTYPE_BFLOAT16 == (int)MICROD_WIRE_DTYPE_BFLOAT16 &&
                   (int)MICROD_DTYPE_FLOAT16 == (int)MICROD_WIRE_DTYPE_FLOAT16,
               "the API's dtypes are the wire's");

microd_status microd_momentum_correction(const microd_client* client, float* beta) {
  if (!check_handle(client)) return fail(NULL, MICROD_ERR_INVALID_ARGUMENT, "invalid handle");
  if (beta == NULL) return MICROD_ERR_INVALID_ARGUMENT;
  *beta = client->momentum_correction;
  return MICROD_OK;
}

microd_status microd_register_host_buffer(microd_client* c, const char* name, uint64_t count,
                                          float** data, int32_t* buffer_id) {
  return microd_register_typed_buffer(c, name, count, NULL, (void**)data, buffer_id);
}

/* Checks what every registration takes; fills *flags and *name_len. */
static microd_status check_register_args(microd_client* c, const char* name, uint64_t count,
                                         const microd_buffer_options* options,
                                         const int32_t* buffer_id, uint32_t* flags, uint32_t* dtype,
                                         size_t* name_len) {
  *flags = 0;
  *dtype = MICROD_DTYPE_FLOAT32;
  if (options != NULL) {
    if (options->struct_size < offsetof(microd_buffer_options, flags) + sizeof(uint32_t) ||
        options->struct_size > 4096) {
      return fail(c, MICROD_ERR_INVALID_ARGUMENT,
                  "options->struct_size is %zu: call microd_buffer_options_init first",
                  options->struct_size);
    }
    if ((options->flags & ~MICROD_BUFFER_DENSE) != 0) {
      return fail(c, MICROD_ERR_INVALID_ARGUMENT, "unknown buffer flags 0x%x", options->flags);
    }
    *flags = options->flags;
    if (options->struct_size >= offsetof(microd_buffer_options, dtype) + sizeof(uint32_t) &&
        options->dtype != 0) {
      if (options->dtype != MICROD_DTYPE_FLOAT32 && options->dtype != MICROD_DTYPE_BFLOAT16 &&
          options->dtype != MICROD_DTYPE_FLOAT16) {
        return fail(c, MICROD_ERR_INVALID_ARGUMENT,
                    "unknown dtype %u (MICROD_DTYPE_FLOAT32, _BFLOAT16 or _FLOAT16)",
                    options->dtype);
      }
      *dtype = options->dtype;
    }
  }
  if (name == NULL || buffer_id == NULL) {
    return fail(c, MICROD_ERR_INVALID_ARGUMENT, "name and buffer_id must not be NULL");
  }
  *name_len = strnlen(name, MICROD_WIRE_NAME_BYTES);
  if (*name_len == 0 || *name_len >= MICROD_WIRE_NAME_BYTES) {
    return fail(c, MICROD_ERR_INVALID_ARGUMENT, "buffer name must have 1 to %d bytes",
                MICROD_WIRE_NAME_BYTES - 1);
  }
  if (count == 0 || count > MAX_BUCKET_ELEMENTS) {
    return fail(c, MICROD_ERR_INVALID_ARGUMENT, "buffer '%s': count %llu out of range [1, 2^32)",
                name, (unsigned long long)count);
  }
  return MICROD_OK;
}

/* Refuses a broken connection or a name already registered; with `grow`,
 * makes room for one more buffer. Called with mu held. */
static microd_status check_new_buffer(microd_client* c, const char* name, int grow) {
  if (c->broken != MICROD_OK) return fail(c, c->broken, "%s", c->broken_message);
  for (int32_t i = 0; i < c->nbuffers; ++i) {
    if (strcmp(c->buffers[i].name, name) == 0) {
      return fail(c, MICROD_ERR_INVALID_ARGUMENT, "buffer '%s' is already registered", name);
    }
  }
  if (grow && c->nbuffers == c->buffers_cap) {
    int32_t cap = c->buffers_cap ? 2 * c->buffers_cap : 16;
    buffer* b = realloc(c->buffers, (size_t)cap * sizeof *b);
    if (b == NULL) return fail(c, MICROD_ERR_RESOURCE, "out of memory");
    c->buffers = b;
    c->buffers_cap = cap;
  }
  return MICROD_OK;
}

/* Sends a register message (`*id_field` is set to the new buffer's id; a
 * descriptor goes with it when pass_fd >= 0), waits for the daemon's answer
 * and on success adds `b` under that id. Blocks; takes read_mu and mu. */
static microd_status register_with_daemon(microd_client* c, void* msg, size_t len,
                                          uint32_t* id_field, int pass_fd, const buffer* b,
                                          int32_t* buffer_id) {
  pthread_mutex_lock(&c->read_mu);
  pthread_mutex_lock(&c->mu);
  /* Checked again here: another thread may have registered meanwhile. */
  microd_status status = check_new_buffer(c, b->name, 1);
  if (status != MICROD_OK) {
    pthread_mutex_unlock(&c->mu);
    pthread_mutex_unlock(&c->read_mu);
    return status;
  }
  const int32_t id = c->nbuffers;
  *id_field = (uint32_t)id;
  c->have_register_ack = 0;
  const int sent = microd_wire_send(c->fd, msg, len, pass_fd);
  pthread_mutex_unlock(&c->mu);
  if (sent != 0) {
    pthread_mutex_lock(&c->mu);
    break_connection(c, MICROD_ERR_UNAVAILABLE, "sending to the daemon failed");
    status = fail(c, c->broken, "%s", c->broken_message);
    pthread_mutex_unlock(&c->mu);
  } else {
    const int64_t deadline = now_ms() + DEFAULT_TIMEOUT_MS;
    for (;;) {
      pthread_mutex_lock(&c->mu);
      const int have = c->have_register_ack;
      const microd_status broken = c->broken;
      pthread_mutex_unlock(&c->mu);
      if (have || broken != MICROD_OK) break;
      if (now_ms() >= deadline) {
        status = fail(c, MICROD_ERR_TIMEOUT, "no answer to registering '%s'", b->name);
        break;
      }
      read_one(c, READ_SLICE_MS);
    }
    pthread_mutex_lock(&c->mu);
    if (status == MICROD_OK) {
      if (c->broken != MICROD_OK) {
        status = fail(c, c->broken, "%s", c->broken_message);
      } else if (c->register_ack.buffer_id != (uint32_t)id) {
        break_connection(c, MICROD_ERR_PROTOCOL, "register answer for another buffer");
        status = fail(c, MICROD_ERR_PROTOCOL, "register answer for another buffer");
      } else if (c->register_ack.status != MICROD_OK) {
        c->register_ack.message[MICROD_WIRE_MESSAGE_BYTES - 1] = '\0';
        status = fail(c,
                      valid_status(c->register_ack.status) ? (microd_status)c->register_ack.status
                                                           : MICROD_ERR_PROTOCOL,
                      "%s", c->register_ack.message);
      }
    }
    if (status == MICROD_OK) {
      c->buffers[id] = *b;
      c->nbuffers++;
      *buffer_id = id;
    }
    pthread_mutex_unlock(&c->mu);
  }
  pthread_mutex_unlock(&c->read_mu);
  return status;
}

microd_status microd_register_typed_buffer(microd_client* c, const char* name, uint64_t count,
                                           const microd_buffer_options* options, void** data,
                                           int32_t* buffer_id) {
  if (!check_handle(c)) return fail(NULL, MICROD_ERR_INVALID_ARGUMENT, "invalid handle");
  uint32_t flags = 0, dtype = MICROD_DTYPE_FLOAT32;
  size_t name_len = 0;
  microd_status status =
      check_register_args(c, name, count, options, buffer_id, &flags, &dtype, &name_len);
  if (status != MICROD_OK) return status;
  if (data == NULL) return fail(c, MICROD_ERR_INVALID_ARGUMENT, "data must not be NULL");
  pthread_mutex_lock(&c->mu);
  status = check_new_buffer(c, name, 0);
  pthread_mutex_unlock(&c->mu);
  if (status != MICROD_OK) return status;

  const size_t bytes = (size_t)count * (dtype == MICROD_DTYPE_FLOAT32 ? sizeof(float) : 2);
  char memfd_name[MICROD_WIRE_NAME_BYTES + 8];
  snprintf(memfd_name, sizeof memfd_name, "microd:%s", name);
  int mfd = memfd_create(memfd_name, MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (mfd < 0) return fail(c, MICROD_ERR_RESOURCE, "memfd_create: %s", strerror(errno));
  /* Sealed size: neither side can shrink the buffer under the other. */
  if (ftruncate(mfd, (off_t)bytes) != 0 ||
      fcntl(mfd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    microd_status s =
        fail(c, MICROD_ERR_RESOURCE, "shared memory of %zu bytes: %s", bytes, strerror(errno));
    close(mfd);
    return s;
  }
  void* mem = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, mfd, 0);
  if (mem == MAP_FAILED) {
    microd_status s = fail(c, MICROD_ERR_RESOURCE, "mmap: %s", strerror(errno));
    close(mfd);
    return s;
  }

  microd_wire_register reg;
  memset(&reg, 0, sizeof reg);
  microd_wire_header_init(&reg.h, MICROD_MSG_REGISTER, sizeof reg);
  reg.kind = MICROD_BUFFER_HOST;
  reg.dtype = dtype; /* microd_dtype's values are the wire's */
  reg.flags = flags;
  reg.count = count;
  memcpy(reg.name, name, name_len);
  buffer b;
  memset(&b, 0, sizeof b);
  memcpy(b.name, name, name_len);
  b.data = mem;
  b.count = count;
  b.bytes = bytes;
  status = register_with_daemon(c, &reg, sizeof reg, &reg.buffer_id, mfd, &b, buffer_id);
  close(mfd); /* the daemon holds its own copy (or refused it) */
  if (status == MICROD_OK) {
    *data = mem;
  } else {
    munmap(mem, bytes);
  }
  return status;
}

microd_status microd_register_cuda_buffer(microd_client* c, const char* name, void* device_ptr,
                                          uint64_t count, const microd_buffer_options* options,
                                          int32_t* buffer_id) {
  if (!check_handle(c)) return fail(NULL, MICROD_ERR_INVALID_ARGUMENT, "invalid handle");
  uint32_t flags = 0, dtype = MICROD_DTYPE_FLOAT32;
  size_t name_len = 0;
  microd_status status =
      check_register_args(c, name, count, options, buffer_id, &flags, &dtype, &name_len);
  if (status != MICROD_OK) return status;
  if (dtype != MICROD_DTYPE_FLOAT32) {
    return fail(c, MICROD_ERR_UNSUPPORTED,
                "buffer '%s': bf16/fp16 CUDA buffers are not supported yet (host buffers are); "
                "register a float32 CUDA buffer",
                name);
  }
  if (device_ptr == NULL) {
    return fail(c, MICROD_ERR_INVALID_ARGUMENT, "buffer '%s': device_ptr is NULL", name);
  }
  if ((uintptr_t)device_ptr % sizeof(float) != 0) {
    return fail(c, MICROD_ERR_INVALID_ARGUMENT,
                "buffer '%s': device_ptr %p is not aligned to 4 bytes", name, device_ptr);
  }
  pthread_mutex_lock(&c->mu);
  status = check_new_buffer(c, name, 0);
  const uint32_t caps = c->daemon_caps;
  pthread_mutex_unlock(&c->mu);
  if (status != MICROD_OK) return status;
  if ((caps & MICROD_WIRE_CAP_REGISTER_CUDA) == 0) {
    return fail(c, MICROD_ERR_UNSUPPORTED,
                "buffer '%s': this microd predates CUDA buffers (its hello answer does not offer "
                "them): update the daemon",
                name);
  }
  mcuda_buffer cu;
  char err[400];
  status = mcuda_prepare(device_ptr, count, &cu, err, sizeof err);
  if (status != MICROD_OK) return fail(c, status, "buffer '%s': %s", name, err);

  microd_wire_register_cuda reg;
  memset(&reg, 0, sizeof reg);
  microd_wire_header_init(&reg.h, MICROD_MSG_REGISTER_CUDA, sizeof reg);
  reg.dtype = MICROD_WIRE_DTYPE_FLOAT32;
  reg.flags = flags;
  reg.device_ordinal = cu.device_ordinal;
  reg.count = count;
  memcpy(reg.name, name, name_len);
  memcpy(reg.device_uuid, cu.device_uuid, sizeof reg.device_uuid);
  memcpy(reg.mem_handle, cu.mem_handle, sizeof reg.mem_handle);
  reg.alloc_bytes = cu.alloc_bytes;
  reg.offset = cu.offset;
  memcpy(reg.event_handle, cu.event_handle, sizeof reg.event_handle);
  buffer b;
  memset(&b, 0, sizeof b);
  memcpy(b.name, name, name_len);
  b.data = (float*)device_ptr;
  b.count = count;
  b.is_cuda = 1;
  b.cuda = cu;
  status = register_with_daemon(c, &reg, sizeof reg, &reg.buffer_id, -1, &b, buffer_id);
  if (status != MICROD_OK) mcuda_release(&cu);
  return status;
}

/* Room for one more ticket entry. Called with mu held. */
static microd_status reserve_ticket(microd_client* c) {
  if (c->ntickets < c->tickets_cap) return MICROD_OK;
  size_t cap = c->tickets_cap ? 2 * c->tickets_cap : 16;
  ticket_entry* t = realloc(c->tickets, cap * sizeof *t);
  if (t == NULL) return fail(c, MICROD_ERR_RESOURCE, "out of memory");
  c->tickets = t;
  c->tickets_cap = cap;
  return MICROD_OK;
}

/* Submits a buffer; a CUDA buffer's ready event is recorded on `stream` first. */
static microd_status submit(microd_client* c, int32_t buffer_id, void* stream, uint64_t* ticket) {
  if (!check_handle(c)) return fail(NULL, MICROD_ERR_INVALID_ARGUMENT, "invalid handle");
  if (ticket == NULL) return fail(c, MICROD_ERR_INVALID_ARGUMENT, "ticket is NULL");
  pthread_mutex_lock(&c->mu);
  microd_status status = MICROD_OK;
  if (c->broken != MICROD_OK) {
    status = fail(c, c->broken, "%s", c->broken_message);
  } else if (buffer_id < 0 || buffer_id >= c->nbuffers) {
    status = fail(c, MICROD_ERR_INVALID_ARGUMENT, "unknown buffer id %d", buffer_id);
  } else if (c->buffers[buffer_id].pending) {
    status = fail(c, MICROD_ERR_INVALID_ARGUMENT,
                  "buffer '%s' already has a submission in flight: wait for it first",
                  c->buffers[buffer_id].name);
  } else if (!c->buffers[buffer_id].is_cuda && stream != NULL) {
    status = fail(c, MICROD_ERR_INVALID_ARGUMENT,
                  "buffer '%s' is a host buffer: submit it without a CUDA stream",
                  c->buffers[buffer_id].name);
  } else {
    status = reserve_ticket(c);
  }
  if (status == MICROD_OK && c->buffers[buffer_id].is_cuda) {
    /* The daemon reads the buffer once this event completed. */
    char err[400];
    status = mcuda_record(&c->buffers[buffer_id].cuda, stream, err, sizeof err);
    if (status != MICROD_OK) {
      status = fail(c, status, "buffer '%s': %s", c->buffers[buffer_id].name, err);
    }
  }
  if (status == MICROD_OK) {
    microd_wire_submit sub;
    memset(&sub, 0, sizeof sub);
    microd_wire_header_init(&sub.h, MICROD_MSG_SUBMIT, sizeof sub);
    sub.buffer_id = (uint32_t)buffer_id;
    sub.reserved = c->changes_seen;
    sub.ticket = ++c->next_ticket;
    if (microd_wire_send(c->fd, &sub, sizeof sub, -1) != 0) {
      break_connection(c, MICROD_ERR_UNAVAILABLE, "sending to the daemon failed");
      status = fail(c, c->broken, "%s", c->broken_message);
    } else {
      ticket_entry* t = &c->tickets[c->ntickets++];
      memset(t, 0, sizeof *t);
      t->ticket = sub.ticket;
      t->buffer_id = buffer_id;
      c->buffers[buffer_id].pending = 1;
      *ticket = sub.ticket;
    }
  }
  pthread_mutex_unlock(&c->mu);
  return status;
}

microd_status microd_allreduce_async(microd_client* c, int32_t buffer_id, uint64_t* ticket) {
  return submit(c, buffer_id, NULL, ticket);
}

microd_status microd_allreduce_cuda_async(microd_client* c, int32_t buffer_id, void* cuda_stream,
                                          uint64_t* ticket) {
  return submit(c, buffer_id, cuda_stream, ticket);
}

/* A wait that timed out: the error names the ticket's bucket and, from a
 * daemon that can say (MICROD_WIRE_CAP_WAITING), what the bucket waits for:
 * local processes, nodes or a step in flight. */
static microd_status timed_out(microd_client* c, uint64_t ticket, int32_t timeout_ms) {
  char name[MICROD_WIRE_NAME_BYTES] = "?";
  char why[MICROD_WIRE_WAITING_BYTES] = "";
  pthread_mutex_lock(&c->mu);
  const ticket_entry* t = find_ticket(c, ticket);
  const int32_t id = t != NULL ? t->buffer_id : -1;
  if (id >= 0 && id < c->nbuffers) snprintf(name, sizeof name, "%s", c->buffers[id].name);
  int ask = id >= 0 && (c->daemon_caps & MICROD_WIRE_CAP_WAITING) != 0 && c->broken == MICROD_OK;
  const uint64_t before = c->waiting_answers;
  if (ask) {
    microd_wire_waiting w;
    memset(&w, 0, sizeof w);
    microd_wire_header_init(&w.h, MICROD_MSG_WAITING, sizeof w);
    w.buffer_id = (uint32_t)id;
    ask = microd_wire_send(c->fd, &w, sizeof w, -1) == 0;
  }
  pthread_mutex_unlock(&c->mu);
  const int64_t until = now_ms() + WAITING_ANSWER_MS;
  while (ask) {
    pthread_mutex_lock(&c->mu);
    const int got = c->waiting_answers != before;
    if (got) snprintf(why, sizeof why, "%s", c->waiting_text);
    const int over = got || c->broken != MICROD_OK;
    pthread_mutex_unlock(&c->mu);
    const int64_t left = until - now_ms();
    if (over || left <= 0) break;
    pthread_mutex_lock(&c->read_mu);
    read_one(c, (int)(left < READ_SLICE_MS ? left : READ_SLICE_MS));
    pthread_mutex_unlock(&c->read_mu);
  }
  return fail(c, MICROD_ERR_TIMEOUT, "ticket %llu (bucket '%s') not complete after %d ms%s%s",
              (unsigned long long)ticket, name, timeout_ms, why[0] != '\0' ? ": " : "", why);
}

microd_status microd_wait(microd_client* c, uint64_t ticket, int32_t timeout_ms) {
  if (!check_handle(c)) return fail(NULL, MICROD_ERR_INVALID_ARGUMENT, "invalid handle");
  const int64_t deadline = timeout_ms < 0 ? INT64_MAX : now_ms() + timeout_ms;
  for (;;) {
    pthread_mutex_lock(&c->mu);
    ticket_entry* t = find_ticket(c, ticket);
    if (t == NULL) {
      pthread_mutex_unlock(&c->mu);
      return fail(c, MICROD_ERR_INVALID_ARGUMENT, "unknown ticket %llu",
                  (unsigned long long)ticket);
    }
    if (t->done) {
      microd_status s = t->status;
      if (s != MICROD_OK) fail(c, s, "%s", t->message);
      *t = c->tickets[--c->ntickets];
      pthread_mutex_unlock(&c->mu);
      return s;
    }
    if (c->broken != MICROD_OK) {
      microd_status s = fail(c, c->broken, "%s", c->broken_message);
      if (t->buffer_id >= 0) c->buffers[t->buffer_id].pending = 0;
      *t = c->tickets[--c->ntickets];
      pthread_mutex_unlock(&c->mu);
      return s;
    }
    pthread_mutex_unlock(&c->mu);
    const int64_t left = deadline - now_ms();
    if (left <= 0) return timed_out(c, ticket, timeout_ms);
    pthread_mutex_lock(&c->read_mu);
    read_one(c, (int)(left < READ_SLICE_MS ? left : READ_SLICE_MS));
    pthread_mutex_unlock(&c->read_mu);
  }
}

microd_status microd_allreduce(microd_client* c, int32_t buffer_id, int32_t timeout_ms) {
  uint64_t ticket = 0;
  microd_status s = microd_allreduce_async(c, buffer_id, &ticket);
  if (s != MICROD_OK) return s;
  return microd_wait(c, ticket, timeout_ms);
}

/* Sends a STATE request and waits for its completion. */
static microd_status state_op(microd_client* c, uint32_t op, const char* dir, int32_t timeout_ms) {
  if (!check_handle(c)) return fail(NULL, MICROD_ERR_INVALID_ARGUMENT, "invalid handle");
  if (dir == NULL || dir[0] == '\0') {
    return fail(c, MICROD_ERR_INVALID_ARGUMENT, "the state directory is empty");
  }
  if (strlen(dir) >= MICROD_WIRE_PATH_BYTES) {
    return fail(c, MICROD_ERR_INVALID_ARGUMENT, "the state directory is longer than %d bytes",
                MICROD_WIRE_PATH_BYTES - 1);
  }
  /* The daemon works in the directory this process opens, never by its
   * path: it writes and reads only where this process can itself. */
  if (op == MICROD_STATE_SAVE && mkdir(dir, 0700) != 0 && errno != EEXIST) {
    return fail(c, MICROD_ERR_INVALID_ARGUMENT, "cannot make the state directory %s: %s", dir,
                strerror(errno));
  }
  const int dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dirfd < 0) {
    return fail(c, errno == ENOENT ? MICROD_ERR_INVALID_ARGUMENT : MICROD_ERR_PERMISSION,
                "cannot open the state directory %s: %s", dir, strerror(errno));
  }
  pthread_mutex_lock(&c->mu);
  microd_status status = MICROD_OK;
  if (c->broken != MICROD_OK) {
    status = fail(c, c->broken, "%s", c->broken_message);
  } else {
    status = reserve_ticket(c);
  }
  uint64_t ticket = 0;
  if (status == MICROD_OK) {
    microd_wire_state m;
    memset(&m, 0, sizeof m);
    microd_wire_header_init(&m.h, MICROD_MSG_STATE, sizeof m);
    m.op = op;
    m.ticket = ticket = ++c->next_ticket;
    memcpy(m.dir, dir, strlen(dir));
    if (microd_wire_send(c->fd, &m, sizeof m, dirfd) != 0) {
      break_connection(c, MICROD_ERR_UNAVAILABLE, "sending to the daemon failed");
      status = fail(c, c->broken, "%s", c->broken_message);
    } else {
      ticket_entry* t = &c->tickets[c->ntickets++];
      memset(t, 0, sizeof *t);
      t->ticket = ticket;
      t->buffer_id = -1; /* no buffer */
    }
  }
  pthread_mutex_unlock(&c->mu);
  close(dirfd);
  if (status != MICROD_OK) return status;
  return microd_wait(c, ticket, timeout_ms);
}

microd_status microd_state_save(microd_client* c, const char* dir, int32_t timeout_ms) {
  return state_op(c, MICROD_STATE_SAVE, dir, timeout_ms);
}

microd_status microd_state_load(microd_client* c, const char* dir, int32_t timeout_ms) {
  return state_op(c, MICROD_STATE_LOAD, dir, timeout_ms);
}

microd_status microd_close(microd_client* c) {
  if (c == NULL) return MICROD_OK;
  if (!check_handle(c)) return fail(NULL, MICROD_ERR_INVALID_ARGUMENT, "invalid handle");
  microd_wire_goodbye bye;
  memset(&bye, 0, sizeof bye);
  microd_wire_header_init(&bye.h, MICROD_MSG_GOODBYE, sizeof bye);
  if (c->broken == MICROD_OK) (void)microd_wire_send(c->fd, &bye, sizeof bye, -1);
  close(c->fd);
  for (int32_t i = 0; i < c->nbuffers; ++i) {
    if (c->buffers[i].is_cuda) {
      /* The daemon may still wait on the ready event of a pending submission,
       * and using an imported event whose original is gone is undefined:
       * such an event is left to the context's end. */
      if (!c->buffers[i].pending) mcuda_release(&c->buffers[i].cuda);
    } else {
      munmap(c->buffers[i].data, c->buffers[i].bytes);
    }
  }
  free(c->buffers);
  free(c->tickets);
  pthread_mutex_destroy(&c->mu);
  pthread_mutex_destroy(&c->read_mu);
  c->magic = 0;
  free(c);
  return MICROD_OK;
}
