// SPDX-License-Identifier: Apache-2.0
/* microd-netlab-delay: one-way delay and jitter for the emulated cluster
 * (deploy/netlab/netlab.sh), where the kernel has no netem qdisc.
 *
 * Runs inside a node's network namespace and serves an NFQUEUE queue that
 * the node's ingress rule (mangle PREROUTING) sends packets to: each packet
 * is held for delay +- jitter (uniform, as netem's default) and accepted
 * then. Only metadata is copied to user space (NFQNL_COPY_META; GSO packets
 * stay whole), so the cost is one verdict per packet. Delaying on ingress
 * rather than egress keeps the held packets off the sending socket's
 * accounting (TCP small queues would otherwise throttle a delayed link).
 *
 *   microd-netlab-delay --queue N --config FILE
 *
 * FILE holds "DELAY_US JITTER_US"; SIGHUP reads it again (netlab.sh shape
 * changes the delay of a running job that way). SIGTERM accepts every held
 * packet and exits: nothing is dropped by stopping it. A full hold queue
 * lets packets through at once rather than dropping them.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <linux/netfilter.h> /* NF_ACCEPT */
#include <linux/netlink.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "netlab_nfq.h"

#ifndef SOL_NETLINK
#define SOL_NETLINK 270
#endif

enum { kMaxHeld = 1 << 17 };
static const char kTool[] = "microd-netlab-delay";

struct held {
  uint64_t release_ns;
  uint64_t seq; /* arrival order: equal release times leave in order */
  uint32_t id;
};

static struct held heap[kMaxHeld];
static size_t held_count;
static uint64_t next_seq;
static uint64_t delay_ns, jitter_ns;
static uint64_t rng_state;
static const char* config_path;
static volatile sig_atomic_t reload_requested, stop_requested;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static uint64_t next_random(void) { /* xorshift64* */
  rng_state ^= rng_state >> 12;
  rng_state ^= rng_state << 25;
  rng_state ^= rng_state >> 27;
  return rng_state * 2685821657736338717ull;
}

static int earlier(const struct held* a, const struct held* b) {
  return a->release_ns < b->release_ns || (a->release_ns == b->release_ns && a->seq < b->seq);
}

static void heap_push(struct held h) {
  size_t i = held_count++;
  heap[i] = h;
  while (i > 0) {
    size_t parent = (i - 1) / 2;
    if (!earlier(&heap[i], &heap[parent])) break;
    struct held t = heap[i];
    heap[i] = heap[parent];
    heap[parent] = t;
    i = parent;
  }
}

static struct held heap_pop(void) {
  struct held top = heap[0];
  heap[0] = heap[--held_count];
  size_t i = 0;
  for (;;) {
    size_t l = 2 * i + 1, r = l + 1, m = i;
    if (l < held_count && earlier(&heap[l], &heap[m])) m = l;
    if (r < held_count && earlier(&heap[r], &heap[m])) m = r;
    if (m == i) break;
    struct held t = heap[i];
    heap[i] = heap[m];
    heap[m] = t;
    i = m;
  }
  return top;
}

static int read_config(void) {
  FILE* f = fopen(config_path, "r");
  if (f == NULL) {
    fprintf(stderr, "microd-netlab-delay: cannot read %s: %s\n", config_path, strerror(errno));
    return -1;
  }
  unsigned long long d = 0, j = 0;
  const int got = fscanf(f, "%llu %llu", &d, &j);
  fclose(f);
  if (got != 2 || d > 10000000ull || j > 10000000ull) {
    fprintf(stderr, "microd-netlab-delay: %s must hold 'DELAY_US JITTER_US' (each <= 10 s)\n",
            config_path);
    return -1;
  }
  delay_ns = d * 1000ull;
  jitter_ns = j * 1000ull;
  return 0;
}

static void on_signal(int sig) {
  if (sig == SIGHUP)
    reload_requested = 1;
  else
    stop_requested = 1;
}

static int on_packet(struct nfq_q_handle* qh, struct nfgenmsg* msg, struct nfq_data* nfa,
                     void* data) {
  (void)msg;
  (void)data;
  struct nfqnl_msg_packet_hdr* ph = nfq_get_msg_packet_hdr(nfa);
  if (ph == NULL) return 0;
  const uint32_t id = ntohl(ph->packet_id);
  if (held_count == kMaxHeld) return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
  uint64_t hold = delay_ns;
  if (jitter_ns > 0) {
    const uint64_t span = 2 * jitter_ns + 1;
    const int64_t offset = (int64_t)(next_random() % span) - (int64_t)jitter_ns;
    hold = offset < 0 && (uint64_t)(-offset) > hold ? 0 : (uint64_t)((int64_t)hold + offset);
  }
  struct held h = {now_ns() + hold, next_seq++, id};
  heap_push(h);
  return 0;
}

static void release_due(struct nfq_q_handle* qh, uint64_t now) {
  while (held_count > 0 && heap[0].release_ns <= now) {
    struct held h = heap_pop();
    nfq_set_verdict(qh, h.id, NF_ACCEPT, 0, NULL);
  }
}

static int usage(void) {
  fprintf(stderr, "usage: microd-netlab-delay --queue N --config FILE\n");
  return 2;
}

int main(int argc, char** argv) {
  long queue = -1;
  for (int i = 1; i < argc; ++i) {
    if (strcmp(argv[i], "--queue") == 0 && i + 1 < argc) {
      char* end = NULL;
      queue = strtol(argv[++i], &end, 10);
      if (*end != '\0' || queue < 0 || queue > 65535) return usage();
    } else if (strcmp(argv[i], "--config") == 0 && i + 1 < argc) {
      config_path = argv[++i];
    } else {
      return usage();
    }
  }
  if (queue < 0 || config_path == NULL) return usage();
  if (read_config() != 0) return 1;
  rng_state = now_ns() ^ ((uint64_t)getpid() << 32) ^ 0x9e3779b97f4a7c15ull;

  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGHUP, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);

  /* Metadata only; GSO packets whole (no segmentation for user space); a
   * full kernel queue accepts rather than drops. */
  struct nfq_handle* h = NULL;
  struct nfq_q_handle* qh = NULL;
  if (netlab_nfq_open(kTool, queue, on_packet, NFQNL_COPY_META, 0,
                      NFQA_CFG_F_GSO | NFQA_CFG_F_FAIL_OPEN, kMaxHeld, &h, &qh) != 0) {
    return 1;
  }
  const int fd = nfq_fd(h);
  const int one = 1;
  (void)setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one);

  static char buf[1 << 16];
  while (!stop_requested) {
    if (reload_requested) {
      reload_requested = 0;
      (void)read_config(); /* a bad file keeps the previous values */
    }
    uint64_t now = now_ns();
    release_due(qh, now);
    struct timespec wait = {1, 0};
    if (held_count > 0) {
      const uint64_t left = heap[0].release_ns > now ? heap[0].release_ns - now : 0;
      wait.tv_sec = (time_t)(left / 1000000000ull);
      wait.tv_nsec = (long)(left % 1000000000ull);
    }
    struct pollfd p = {fd, POLLIN, 0};
    const int ready = ppoll(&p, 1, &wait, NULL);
    if (ready < 0 && errno != EINTR) {
      fprintf(stderr, "microd-netlab-delay: ppoll: %s\n", strerror(errno));
      break;
    }
    if (ready <= 0) continue;
    /* Drain what arrived, a bounded batch so that due packets leave on time. */
    if (netlab_nfq_drain(kTool, h, buf, sizeof buf) != 0) stop_requested = 1;
  }
  /* Let every held packet go before leaving. */
  release_due(qh, UINT64_MAX);
  nfq_destroy_queue(qh);
  nfq_close(h);
  return 0;
}
