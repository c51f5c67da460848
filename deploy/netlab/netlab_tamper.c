// SPDX-License-Identifier: Apache-2.0
/* microd-netlab-tamper: an attacker on the path of a node's link, for the
 * sealed data plane's tests (deploy/netlab/netlab.sh tamper).
 *
 * Runs inside a node's network namespace and serves an NFQUEUE queue that
 * netlab.sh sends the node's incoming TCP packets to. Packets carrying
 * fewer than --min-payload bytes (other than --payload bytes, if given), or
 * to or from a --skip-port (the coordinator's: the control plane is TLS's
 * to protect), pass untouched.
 * Of the others, once --after-ms have passed since the start:
 *
 *   --mode flip    the first one gets one byte, in the middle of its
 *                  payload (or byte --at-byte K of it: with
 *                  --whole-messages, 0-3 are a record's length and 4-35
 *                  its header, the framing), inverted; then everything
 *                  passes;
 *   --mode replay  the first one of each connection and length is kept
 *                  (64 at most); the first later one (at least --gap-ms
 *                  after the kept one) of a kept connection and length
 *                  whose bytes differ gets the kept bytes instead:
 *                  bytes of an earlier transfer, captured on the wire, in
 *                  place of a later one's. Then everything passes.
 *
 * --whole-messages: only packets that hold exactly one whole record of the
 * data plane's framing (its first 4 bytes, little-endian, are the length of
 * the rest): a record replayed whole, length and all, rather than bytes
 * spliced into the middle of one.
 *
 * The TCP checksum is computed again, as an attacker on the path would.
 * What was done goes to standard output, one line:
 *   "flipped SRC:PORT -> DST:PORT payload N byte K" or
 *   "replayed SRC:PORT -> DST:PORT payload N from T ms before".
 *
 *   microd-netlab-tamper --queue N --mode flip|replay [--min-payload B]
 *                        [--payload B] [--skip-port P]... [--after-ms T] [--gap-ms G]
 *                        [--whole-messages] [--at-byte K]
 *
 * SIGTERM ends it (netlab.sh down); its rule lets packets through then
 * (--queue-bypass).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <linux/netfilter.h> /* NF_ACCEPT */
#include <netinet/ip.h>
#include <netinet/tcp.h>
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

enum { kMaxSkip = 16, kMaxPacket = 1 << 16, kMaxKept = 64 };
static const char kTool[] = "microd-netlab-tamper";

static int mode_replay, whole_messages;
static long min_payload = 512;
static long exact_payload = 0; /* --payload: only packets of this many bytes */
static long at_byte = -1;      /* flip: -1, the middle */
static long skip_ports[kMaxSkip];
static int skip_count;
static uint64_t start_ns, after_ns, gap_ns;
static int done;
static volatile sig_atomic_t stop_requested;

/* The kept packets (replay): the first of each connection and length, up
 * to kMaxKept (the first pick alone may be of a size its connection never
 * sends again, and the attack would never come). */
struct kept_packet {
  uint32_t src, dst;
  uint16_t sport, dport;
  size_t len;
  uint64_t ns;
  unsigned char payload[kMaxPacket];
};
static struct kept_packet kept[kMaxKept];
static int kept_count;

static uint64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

static void on_signal(int sig) {
  (void)sig;
  stop_requested = 1;
}

static uint32_t sum16(const unsigned char* p, size_t n, uint32_t sum) {
  for (size_t i = 0; i + 1 < n; i += 2) sum += (uint32_t)(p[i] << 8 | p[i + 1]);
  if (n & 1) sum += (uint32_t)(p[n - 1] << 8);
  return sum;
}

/* The TCP checksum of the segment (header and payload) of an IPv4 packet. */
static void tcp_checksum(unsigned char* ip, size_t ihl, size_t total) {
  unsigned char* tcp = ip + ihl;
  const size_t len = total - ihl;
  tcp[16] = tcp[17] = 0;
  uint32_t sum = sum16(ip + 12, 8, 0); /* source and destination addresses */
  sum += IPPROTO_TCP;
  sum += (uint32_t)len;
  sum = sum16(tcp, len, sum);
  while (sum >> 16) sum = (sum & 0xffff) + (sum >> 16);
  const uint16_t c = (uint16_t)~sum;
  tcp[16] = (unsigned char)(c >> 8);
  tcp[17] = (unsigned char)(c & 0xff);
}

static int skipped_port(uint16_t port) {
  for (int i = 0; i < skip_count; ++i) {
    if (skip_ports[i] == port) return 1;
  }
  return 0;
}

static void print_link(const char* what, uint32_t src, uint16_t sport, uint32_t dst,
                       uint16_t dport) {
  char s[INET_ADDRSTRLEN], d[INET_ADDRSTRLEN];
  struct in_addr a = {src}, b = {dst};
  inet_ntop(AF_INET, &a, s, sizeof s);
  inet_ntop(AF_INET, &b, d, sizeof d);
  printf("%s %s:%u -> %s:%u", what, s, sport, d, dport);
}

static int on_packet(struct nfq_q_handle* qh, struct nfgenmsg* msg, struct nfq_data* nfa,
                     void* data) {
  (void)msg;
  (void)data;
  struct nfqnl_msg_packet_hdr* ph = nfq_get_msg_packet_hdr(nfa);
  if (ph == NULL) return 0;
  const uint32_t id = ntohl(ph->packet_id);
  unsigned char* pkt = NULL;
  const int total = nfq_get_payload(nfa, &pkt);
  if (done || total < (int)sizeof(struct iphdr) || now_ns() - start_ns < after_ns) {
    return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
  }
  const size_t ihl = (size_t)(pkt[0] & 0x0f) * 4;
  if ((pkt[0] >> 4) != 4 || pkt[9] != IPPROTO_TCP || ihl + 20 > (size_t)total) {
    return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
  }
  const unsigned char* tcp = pkt + ihl;
  const size_t doff = (size_t)(tcp[12] >> 4) * 4;
  if (ihl + doff > (size_t)total) return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
  const size_t len = (size_t)total - ihl - doff;
  const uint16_t sport = (uint16_t)(tcp[0] << 8 | tcp[1]);
  const uint16_t dport = (uint16_t)(tcp[2] << 8 | tcp[3]);
  if ((exact_payload > 0 ? (long)len != exact_payload : (long)len < min_payload) ||
      skipped_port(sport) || skipped_port(dport)) {
    return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
  }
  if (whole_messages) {
    uint64_t framed = 0;
    for (int i = 3; i >= 0; --i) framed = framed << 8 | pkt[ihl + doff + (size_t)i];
    if (len < 4 || framed + 4 != len) return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
  }
  uint32_t src, dst;
  memcpy(&src, pkt + 12, 4);
  memcpy(&dst, pkt + 16, 4);
  unsigned char* payload = pkt + ihl + doff;
  if (!mode_replay) {
    const size_t at = at_byte >= 0 ? (size_t)at_byte : len / 2;
    if (at >= len) return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
    payload[at] ^= 0xff;
    tcp_checksum(pkt, ihl, (size_t)total);
    done = 1;
    print_link("flipped", src, sport, dst, dport);
    printf(" payload %zu byte %zu\n", len, at);
    fflush(stdout);
    return nfq_set_verdict(qh, id, NF_ACCEPT, (uint32_t)total, pkt);
  }
  struct kept_packet* k = NULL;
  for (int i = 0; i < kept_count && k == NULL; ++i) {
    struct kept_packet* c = &kept[i];
    if (c->src == src && c->dst == dst && c->sport == sport && c->dport == dport && c->len == len) {
      k = c;
    }
  }
  if (k == NULL) {
    if (kept_count < kMaxKept) {
      k = &kept[kept_count++];
      k->src = src, k->dst = dst, k->sport = sport, k->dport = dport, k->len = len;
      memcpy(k->payload, payload, len);
      k->ns = now_ns();
    }
    return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
  }
  if (now_ns() - k->ns < gap_ns || memcmp(payload, k->payload, len) == 0) {
    return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
  }
  memcpy(payload, k->payload, len);
  tcp_checksum(pkt, ihl, (size_t)total);
  done = 1;
  print_link("replayed", src, sport, dst, dport);
  printf(" payload %zu from %llu ms before\n", len,
         (unsigned long long)((now_ns() - k->ns) / 1000000ull));
  fflush(stdout);
  return nfq_set_verdict(qh, id, NF_ACCEPT, (uint32_t)total, pkt);
}

static int usage(void) {
  fprintf(stderr,
          "usage: microd-netlab-tamper --queue N --mode flip|replay [--min-payload B] "
          "[--payload B] [--skip-port P]... [--after-ms T] [--gap-ms G] [--whole-messages] "
          "[--at-byte K]\n");
  return 2;
}

static int number(const char* s, long lo, long hi, long* out) {
  char* end = NULL;
  errno = 0;
  const long v = strtol(s, &end, 10);
  if (errno != 0 || *end != '\0' || v < lo || v > hi) return -1;
  *out = v;
  return 0;
}

int main(int argc, char** argv) {
  long queue = -1, after_ms = 0, gap_ms = 50;
  const char* mode = NULL;
  for (int i = 1; i < argc; ++i) {
    const int has = i + 1 < argc;
    if (strcmp(argv[i], "--queue") == 0 && has) {
      if (number(argv[++i], 0, 65535, &queue) != 0) return usage();
    } else if (strcmp(argv[i], "--mode") == 0 && has) {
      mode = argv[++i];
    } else if (strcmp(argv[i], "--min-payload") == 0 && has) {
      if (number(argv[++i], 1, 65535, &min_payload) != 0) return usage();
    } else if (strcmp(argv[i], "--payload") == 0 && has) {
      if (number(argv[++i], 1, 65535, &exact_payload) != 0) return usage();
    } else if (strcmp(argv[i], "--skip-port") == 0 && has && skip_count < kMaxSkip) {
      if (number(argv[++i], 1, 65535, &skip_ports[skip_count++]) != 0) return usage();
    } else if (strcmp(argv[i], "--after-ms") == 0 && has) {
      if (number(argv[++i], 0, 86400000, &after_ms) != 0) return usage();
    } else if (strcmp(argv[i], "--whole-messages") == 0) {
      whole_messages = 1;
    } else if (strcmp(argv[i], "--at-byte") == 0 && has) {
      if (number(argv[++i], 0, 65535, &at_byte) != 0) return usage();
    } else if (strcmp(argv[i], "--gap-ms") == 0 && has) {
      if (number(argv[++i], 0, 86400000, &gap_ms) != 0) return usage();
    } else {
      return usage();
    }
  }
  if (queue < 0 || mode == NULL) return usage();
  if (strcmp(mode, "replay") == 0) {
    mode_replay = 1;
  } else if (strcmp(mode, "flip") != 0) {
    return usage();
  }
  start_ns = now_ns();
  after_ns = (uint64_t)after_ms * 1000000ull;
  gap_ns = (uint64_t)gap_ms * 1000000ull;

  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGTERM, &sa, NULL);
  sigaction(SIGINT, &sa, NULL);

  /* Whole packets as they are on the wire (no GSO: segmented first). */
  struct nfq_handle* h = NULL;
  struct nfq_q_handle* qh = NULL;
  if (netlab_nfq_open(kTool, queue, on_packet, NFQNL_COPY_PACKET, kMaxPacket, NFQA_CFG_F_FAIL_OPEN,
                      0, &h, &qh) != 0) {
    return 1;
  }
  const int fd = nfq_fd(h);
  static char buf[kMaxPacket + 4096];
  while (!stop_requested) {
    struct pollfd p = {fd, POLLIN, 0};
    const int ready = poll(&p, 1, 1000);
    if (ready < 0 && errno != EINTR) {
      fprintf(stderr, "%s: poll: %s\n", kTool, strerror(errno));
      break;
    }
    if (ready <= 0) continue;
    if (netlab_nfq_drain(kTool, h, buf, sizeof buf) != 0) stop_requested = 1;
  }
  nfq_destroy_queue(qh);
  nfq_close(h);
  return 0;
}
