# SPDX-License-Identifier: Apache-2.0
"""A training process of `make image-test`, run in a trainer container with no
network: it reaches its node's daemon only through the socket volume. Fills
a dense and a sparse bucket with deterministic values, averages them for
STEPS steps and prints one line per step and bucket: step, bucket, sha256 of
the result's bytes. With "--steps-forever" it keeps stepping until the job
fails, then prints the error (the killed-trainer check)."""
import hashlib
import sys

import numpy as np

import microd

STEPS = 5
DENSE, SPARSE = 5000, 100003


def gradient(rank, step, n):
    rng = np.random.default_rng(1000 * rank + step)
    return (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 1, n)).astype(np.float32)


def main():
    forever = "--steps-forever" in sys.argv
    with microd.Client() as c:
        dense = c.register("dense", DENSE)
        sparse = c.register("sparse", SPARSE)
        step = 0
        while forever or step < STEPS:
            for name, buf in (("dense", dense), ("sparse", sparse)):
                buf.array[:] = gradient(c.rank, step, buf.count)
                try:
                    c.allreduce(buf, 60000)
                except microd.MicrodError as e:
                    print(f"FAILED {type(e).__name__}: {e}", flush=True)
                    return 3
                print(step, name, hashlib.sha256(buf.array.tobytes()).hexdigest(), flush=True)
            step += 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
