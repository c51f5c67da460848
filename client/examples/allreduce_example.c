// SPDX-License-Identifier: Apache-2.0
/* Averages one buffer through the node's microd: run one copy per training
 * process (MICROD_SOCKET names the daemon's socket). */
#include <stdio.h>

#include "microd/microd.h"

int main(void) {
  microd_options opt;
  microd_options_init(&opt);
  microd_client* c;
  if (microd_connect(&opt, &c) != MICROD_OK) {
    fprintf(stderr, "connect: %s\n", microd_last_error(NULL));
    return 1;
  }
  microd_job_info job;
  microd_job_info_get(c, &job);
  float* grad;
  int32_t buf;
  if (microd_register_host_buffer(c, "example", 1000, &grad, &buf) != MICROD_OK) {
    fprintf(stderr, "register: %s\n", microd_last_error(c));
    return 1;
  }
  for (int i = 0; i < 1000; ++i) grad[i] = (float)(job.rank + 1);
  microd_status s = microd_allreduce(c, buf, 60000);
  if (s != MICROD_OK) {
    fprintf(stderr, "allreduce: %s\n", microd_last_error(c));
    return 1;
  }
  printf("rank %d of %d: first value of the averaged update %g\n", job.rank, job.world_size,
         grad[0]);
  microd_close(c);
  return 0;
}
