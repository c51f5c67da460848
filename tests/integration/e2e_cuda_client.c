// SPDX-License-Identifier: Apache-2.0
/* microd-test-cuda-client: the training process of the GPU end-to-end test.
 * Arguments as microd-test-client (e2e_client.c), then a mode:
 *   socket buckets steps out die_at timeout_ms local_rank mode
 * mode "cuda": every bucket lives in one cudaMalloc allocation, at offsets
 *   (none at 0); each step the gradient is poisoned with NaN, then uploaded,
 *   both on a non-blocking stream, and submitted with
 *   microd_allreduce_cuda_async on that stream without synchronising: the
 *   daemon must wait for the ready event to read the right bytes.
 * mode "legacy": the same on the legacy default stream, submitted with
 *   microd_allreduce_async.
 * mode "host": host buffers, as microd-test-client.
 * Writes "step bucket hash" per result (the hash of the update read back from
 * the device); on a failure "FAILED <status> <message>" and exit 3. */
#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "e2e_grad.h"
#include "microd/microd.h"

#define MAX_BUCKETS 16

static int failed(FILE* out, microd_client* c, int status, const char* what, const char* message) {
  fprintf(out, "FAILED %d %s: %s\n", status, what, message);
  fclose(out);
  if (c != NULL) microd_close(c);
  return 3;
}

#define CHECK_CUDA(call)                                                             \
  do {                                                                               \
    cudaError_t e_ = (call);                                                         \
    if (e_ != cudaSuccess) return failed(out, c, 11, #call, cudaGetErrorString(e_)); \
  } while (0)

int main(int argc, char** argv) {
  if (argc < 9) {
    fprintf(stderr,
            "usage: %s socket name:count,... steps out die_at timeout_ms local_rank "
            "cuda|legacy|host\n",
            argv[0]);
    return 2;
  }
  FILE* out = fopen(argv[4], "w");
  if (out == NULL) return 2;
  const long steps = atol(argv[3]);
  const int timeout_ms = atoi(argv[6]);
  const char* mode = argv[8];
  const int cuda = strcmp(mode, "host") != 0;
  const int legacy = strcmp(mode, "legacy") == 0;
  microd_client* c = NULL;

  microd_options opt;
  microd_options_init(&opt);
  opt.socket_path = argv[1];
  opt.timeout_ms = 30000;
  opt.local_rank = atoi(argv[7]);
  microd_status s = microd_connect(&opt, &c);
  if (s != MICROD_OK) return failed(out, NULL, s, "connect", microd_last_error(NULL));
  microd_job_info job;
  microd_job_info_get(c, &job);

  char names[MAX_BUCKETS][128];
  uint64_t counts[MAX_BUCKETS], offsets[MAX_BUCKETS];
  int nb = 0;
  uint64_t total = 0;
  char spec[1024];
  snprintf(spec, sizeof spec, "%s", argv[2]);
  for (char* tok = strtok(spec, ","); tok != NULL && nb < MAX_BUCKETS; tok = strtok(NULL, ",")) {
    char* colon = strchr(tok, ':');
    if (colon == NULL) return 2;
    *colon = '\0';
    snprintf(names[nb], sizeof names[nb], "%s", tok);
    counts[nb] = strtoull(colon + 1, NULL, 10);
    /* Buckets start 256-byte aligned, after a gap of 256 bytes (none at 0). */
    total = (total + 63) / 64 * 64 + 64;
    offsets[nb] = total;
    total += counts[nb];
    ++nb;
  }

  float* device = NULL;
  float* upload = NULL; /* pinned: the asynchronous uploads read it */
  float* download = NULL;
  cudaStream_t stream = NULL;
  float* host[MAX_BUCKETS] = {0};
  int32_t ids[MAX_BUCKETS];
  if (cuda) {
    CHECK_CUDA(cudaSetDevice(0));
    CHECK_CUDA(cudaMalloc((void**)&device, (total + 64) * sizeof(float)));
    CHECK_CUDA(cudaMallocHost((void**)&upload, total * sizeof(float)));
    download = malloc(total * sizeof(float));
    if (download == NULL) return failed(out, c, 8, "malloc", "out of memory");
    if (!legacy) CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  }
  for (int b = 0; b < nb; ++b) {
    s = cuda ? microd_register_cuda_buffer(c, names[b], device + offsets[b], counts[b], NULL,
                                           &ids[b])
             : microd_register_host_buffer(c, names[b], counts[b], &host[b], &ids[b]);
    if (s != MICROD_OK) return failed(out, c, s, names[b], microd_last_error(c));
  }
  for (long t = 0; t < steps; ++t) {
    uint64_t tickets[MAX_BUCKETS];
    for (int b = 0; b < nb; ++b) {
      if (!cuda) {
        e2e_fill(host[b], counts[b], job.rank, b, (uint64_t)t);
        s = microd_allreduce_async(c, ids[b], &tickets[b]);
      } else {
        float* dst = device + offsets[b];
        const size_t bytes = counts[b] * sizeof(float);
        e2e_fill(upload + offsets[b], counts[b], job.rank, b, (uint64_t)t);
        CHECK_CUDA(cudaMemsetAsync(dst, 0xFF, bytes, stream)); /* NaN until the upload lands */
        CHECK_CUDA(
            cudaMemcpyAsync(dst, upload + offsets[b], bytes, cudaMemcpyHostToDevice, stream));
        s = legacy ? microd_allreduce_async(c, ids[b], &tickets[b])
                   : microd_allreduce_cuda_async(c, ids[b], stream, &tickets[b]);
      }
      if (s != MICROD_OK) return failed(out, c, s, "submit", microd_last_error(c));
    }
    for (int b = 0; b < nb; ++b) {
      s = microd_wait(c, tickets[b], timeout_ms);
      if (s != MICROD_OK) {
        char what[160];
        snprintf(what, sizeof what, "step %ld bucket %s", t, names[b]);
        return failed(out, c, s, what, microd_last_error(c));
      }
      const float* update = host[b];
      if (cuda) {
        CHECK_CUDA(cudaMemcpy(download + offsets[b], device + offsets[b], counts[b] * sizeof(float),
                              cudaMemcpyDeviceToHost));
        update = download + offsets[b];
      }
      fprintf(out, "%ld %d %016llx\n", t, b,
              (unsigned long long)e2e_hash(update, counts[b] * sizeof(float)));
    }
    fflush(out);
  }
  fclose(out);
  microd_close(c); /* before the CUDA context goes */
  if (cuda) {
    if (stream != NULL) cudaStreamDestroy(stream);
    cudaFreeHost(upload);
    cudaFree(device);
    free(download);
  }
  return 0;
}
