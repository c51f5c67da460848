// SPDX-License-Identifier: Apache-2.0
/* microd-test-client: a training process of the end-to-end tests, written
 * against the C API only (C99). Registers the buckets given as
 * name:count,..., then for each step fills every bucket with its
 * deterministic gradient, submits them all and waits for them all, and
 * writes "step bucket hash" per result to --out. On a failure it writes
 * "FAILED <status> <message>" and exits 3. Options (in this order):
 *   socket buckets steps out [die_at_step] [wait_timeout_ms] [local_rank] [reverse]
 * then any of: "reverse": submit the buckets last first, 2 ms apart (nodes
 * that submit in other orders and at other times); "first=N": the first
 * step's number (a resumed job); "load=DIR": microd_state_load(DIR) before
 * the first step; "save=DIR": microd_state_save(DIR) after the last;
 * "dtype=bf16" or "dtype=fp16": the buckets hold that type (the gradient
 * rounded to it, the hash over its 2-byte elements); "pause_at=N": stop
 * before step N's submissions and sleep until killed; "hold_at=N:PATH":
 * before step N's submissions wait until the file PATH exists (60 s at
 * most, then FAILED); "elastic": on
 * MICROD_ERR_MEMBERSHIP write "EPOCH step epoch rank world_size node_rank
 * node_count" and do the step again (the same gradients: a process keeps
 * the rank it connected with as its gradients' seed). */
#define _POSIX_C_SOURCE 200809L /* nanosleep */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "e2e_grad.h"
#include "microd/microd.h"

#define MAX_BUCKETS 16

/* A half bucket's gradient before rounding; freed at exit on every path (the
 * sanitizer builds report leaks). */
static float* wide = NULL;
static void free_wide(void) { free(wide); }

int main(int argc, char** argv) {
  if (argc < 5) {
    fprintf(stderr,
            "usage: %s socket name:count,... steps out [die_at_step] [timeout_ms] [local_rank]\n",
            argv[0]);
    return 2;
  }
  const char* socket_path = argv[1];
  const long steps = atol(argv[3]);
  FILE* out = fopen(argv[4], "w");
  const long die_at = argc > 5 ? atol(argv[5]) : -1;
  const int timeout_ms = argc > 6 ? atoi(argv[6]) : 60000;
  if (out == NULL) return 2;

  microd_options opt;
  microd_options_init(&opt);
  opt.socket_path = socket_path;
  opt.timeout_ms = 30000;
  if (argc > 7) opt.local_rank = atoi(argv[7]);
  microd_client* c = NULL;
  microd_status s = microd_connect(&opt, &c);
  if (s != MICROD_OK) {
    fprintf(out, "FAILED %d connect: %s\n", (int)s, microd_last_error(NULL));
    fclose(out);
    return 3;
  }
  microd_job_info job;
  microd_job_info_get(c, &job);

  char names[MAX_BUCKETS][128];
  uint64_t counts[MAX_BUCKETS];
  void* data[MAX_BUCKETS];
  int dtype = MICROD_DTYPE_FLOAT32;
  for (int i = 8; i < argc; ++i) {
    if (strcmp(argv[i], "dtype=bf16") == 0) dtype = MICROD_DTYPE_BFLOAT16;
    if (strcmp(argv[i], "dtype=fp16") == 0) dtype = MICROD_DTYPE_FLOAT16;
  }
  microd_buffer_options bopt;
  microd_buffer_options_init(&bopt);
  bopt.dtype = (uint32_t)dtype;
  const size_t elem = dtype == MICROD_DTYPE_FLOAT32 ? sizeof(float) : 2;
  atexit(free_wide);
  int32_t ids[MAX_BUCKETS];
  int nb = 0;
  char spec[1024];
  snprintf(spec, sizeof spec, "%s", argv[2]);
  for (char* tok = strtok(spec, ","); tok != NULL && nb < MAX_BUCKETS; tok = strtok(NULL, ",")) {
    char* colon = strchr(tok, ':');
    if (colon == NULL) return 2;
    *colon = '\0';
    snprintf(names[nb], sizeof names[nb], "%s", tok);
    counts[nb] = strtoull(colon + 1, NULL, 10);
    s = microd_register_typed_buffer(c, names[nb], counts[nb], &bopt, &data[nb], &ids[nb]);
    if (s != MICROD_OK) {
      fprintf(out, "FAILED %d register %s: %s\n", (int)s, names[nb], microd_last_error(c));
      fclose(out);
      microd_close(c); /* a well-behaved process says goodbye */
      return 3;
    }
    ++nb;
  }
  int reverse = 0;
  int elastic = 0;
  long pause_at = -1;
  long hold_at = -1;
  const char* hold_file = NULL;
  long first = 0;
  const char* load_dir = NULL;
  const char* save_dir = NULL;
  for (int i = 8; i < argc; ++i) {
    if (strcmp(argv[i], "reverse") == 0) reverse = 1;
    if (strcmp(argv[i], "elastic") == 0) elastic = 1;
    if (strncmp(argv[i], "pause_at=", 9) == 0) pause_at = atol(argv[i] + 9);
    if (strncmp(argv[i], "first=", 6) == 0) first = atol(argv[i] + 6);
    if (strncmp(argv[i], "hold_at=", 8) == 0) {
      hold_at = atol(argv[i] + 8);
      hold_file = strchr(argv[i], ':');
      if (hold_file == NULL) return 2;
      ++hold_file;
    }
    if (strncmp(argv[i], "load=", 5) == 0) load_dir = argv[i] + 5;
    if (strncmp(argv[i], "save=", 5) == 0) save_dir = argv[i] + 5;
  }
  if (load_dir != NULL && (s = microd_state_load(c, load_dir, timeout_ms)) != MICROD_OK) {
    fprintf(out, "FAILED %d load: %s\n", (int)s, microd_last_error(c));
    fclose(out);
    microd_close(c);
    return 3;
  }
  for (long t = first; t < first + steps; ++t) {
    uint64_t tickets[MAX_BUCKETS];
    int todo[MAX_BUCKETS]; /* the buckets still to submit this step */
    for (int b = 0; b < nb; ++b) todo[b] = 1;
    if (t == pause_at) {
      fflush(out);
      for (;;) pause(); /* until killed */
    }
    if (t == hold_at) {
      fflush(out);
      const struct timespec tick = {0, 20000000};
      int waited = 0;
      while (access(hold_file, F_OK) != 0) {
        if (++waited > 3000) {
          fprintf(out, "FAILED 0 step %ld: %s did not appear within 60 s\n", t, hold_file);
          fclose(out);
          microd_close(c);
          return 3;
        }
        nanosleep(&tick, NULL);
      }
    }
  again:
    for (int i = 0; i < nb; ++i) {
      const int b = reverse ? nb - 1 - i : i;
      if (!todo[b]) continue;
      if (reverse && i > 0) {
        const struct timespec pause = {0, 2000000};
        nanosleep(&pause, NULL);
      }
      if (dtype == MICROD_DTYPE_FLOAT32) {
        e2e_fill((float*)data[b], counts[b], job.rank, b, (uint64_t)t);
      } else {
        float* grown = realloc(wide, counts[b] * sizeof(float));
        if (grown == NULL) return 2;
        wide = grown;
        e2e_fill(wide, counts[b], job.rank, b, (uint64_t)t);
        e2e_narrow(wide, counts[b], dtype, (uint16_t*)data[b]);
      }
      s = microd_allreduce_async(c, ids[b], &tickets[b]);
      if (s != MICROD_OK) {
        fprintf(out, "FAILED %d submit: %s\n", (int)s, microd_last_error(c));
        fclose(out);
        microd_close(c);
        return 3;
      }
    }
    if (t == die_at) raise(SIGKILL);
    int changed = 0;
    for (int b = 0; b < nb; ++b) {
      if (!todo[b]) continue;
      s = microd_wait(c, tickets[b], timeout_ms);
      if (s == MICROD_ERR_MEMBERSHIP && elastic) {
        changed = 1; /* not applied: submitted again below */
        continue;
      }
      if (s != MICROD_OK) {
        fprintf(out, "FAILED %d step %ld bucket %s: %s\n", (int)s, t, names[b],
                microd_last_error(c));
        fclose(out);
        microd_close(c);
        return 3;
      }
      todo[b] = 0;
      fprintf(out, "%ld %d %016llx\n", t, b,
              (unsigned long long)e2e_hash(data[b], counts[b] * elem));
    }
    if (changed) {
      microd_job_info now;
      uint64_t epoch = 0;
      microd_job_info_get(c, &now);
      microd_job_epoch(c, &epoch);
      fprintf(out, "EPOCH %ld %llu %d %d %d %d\n", t, (unsigned long long)epoch, now.rank,
              now.world_size, now.node_rank, now.node_count);
      fflush(out);
      goto again;
    }
    fflush(out);
  }
  if (save_dir != NULL && (s = microd_state_save(c, save_dir, timeout_ms)) != MICROD_OK) {
    fprintf(out, "FAILED %d save: %s\n", (int)s, microd_last_error(c));
    fclose(out);
    microd_close(c);
    return 3;
  }
  fclose(out);
  microd_close(c);
  return 0;
}
