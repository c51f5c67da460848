// SPDX-License-Identifier: Apache-2.0
/* What the netlab's NFQUEUE helpers (microd-netlab-delay, -tamper) share:
 * binding a queue, and draining what arrived. Header-only (static), C99. */
#ifndef MICROD_NETLAB_NFQ_H
#define MICROD_NETLAB_NFQ_H

#include <errno.h>
#include <libnetfilter_queue/libnetfilter_queue.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

/* Binds queue `queue` to `cb`, copying `mode` (`range` bytes) of each
 * packet, with the queue flags `flags` (where the kernel has them), a
 * queue of `maxlen` packets (0: the default) and an 8 MiB socket buffer.
 * 0, or -1 after saying why on stderr as `tool`. */
static int netlab_nfq_open(const char* tool, long queue, nfq_callback* cb, uint8_t mode,
                           uint32_t range, uint32_t flags, uint32_t maxlen, struct nfq_handle** h,
                           struct nfq_q_handle** qh) {
  *h = nfq_open();
  if (*h == NULL) {
    fprintf(stderr, "%s: nfq_open: %s\n", tool, strerror(errno));
    return -1;
  }
  *qh = nfq_create_queue(*h, (uint16_t)queue, cb, NULL);
  if (*qh == NULL) {
    fprintf(stderr, "%s: cannot bind queue %ld: %s\n", tool, queue, strerror(errno));
    nfq_close(*h);
    return -1;
  }
  if (nfq_set_mode(*qh, mode, range) < 0 || (maxlen > 0 && nfq_set_queue_maxlen(*qh, maxlen) < 0)) {
    fprintf(stderr, "%s: cannot configure queue %ld\n", tool, queue);
    nfq_destroy_queue(*qh);
    nfq_close(*h);
    return -1;
  }
  /* Older kernels lack the flags: fine. */
  (void)nfq_set_queue_flags(*qh, flags, flags);
  nfnl_rcvbufsiz(nfq_nfnlh(*h), 8 << 20);
  return 0;
}

/* Hands what arrived on `h` to its callback, a bounded batch (256) so that
 * the caller's own deadlines are kept. -1 after saying why on stderr as
 * `tool` when the queue failed for good, else 0. */
static int netlab_nfq_drain(const char* tool, struct nfq_handle* h, char* buf, size_t size) {
  const int fd = nfq_fd(h);
  for (int i = 0; i < 256; ++i) {
    const ssize_t got = recv(fd, buf, size, MSG_DONTWAIT);
    if (got < 0) {
      if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR && errno != ENOBUFS) {
        fprintf(stderr, "%s: recv: %s\n", tool, strerror(errno));
        return -1;
      }
      return 0;
    }
    nfq_handle_packet(h, buf, (int)got);
  }
  return 0;
}

#endif /* MICROD_NETLAB_NFQ_H */
