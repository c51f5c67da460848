# SPDX-License-Identifier: Apache-2.0
"""One rank of the baseline: torch.distributed's Gloo allreduce of D fp32
elements in B tensors (one async all_reduce per tensor, all issued and
then waited for, as DDP does with its buckets), every step timed after a
barrier. Run one per node (in its namespace) by bench/network/run.py; rank 0
hosts the TCP store.

    gloo_allreduce.py --rank R --world N --master ADDR:PORT --size D [--buckets B] --steps S --out FILE
"""
import argparse
import json
import time

import torch
import torch.distributed as dist


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world", type=int, required=True)
    p.add_argument("--master", required=True)
    p.add_argument("--size", type=int, default=25_557_032)
    p.add_argument("--buckets", type=int, default=1)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--out", required=True)
    p.add_argument("--timeout", type=float, default=600)
    a = p.parse_args()
    host, port = a.master.rsplit(":", 1)
    import datetime
    dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=a.rank,
                            world_size=a.world, timeout=datetime.timedelta(seconds=a.timeout))
    torch.manual_seed(a.rank)
    sizes = [a.size // a.buckets + (1 if b < a.size % a.buckets else 0) for b in range(a.buckets)]
    tensors = [torch.randn(s, dtype=torch.float32) for s in sizes]
    ms = []
    for _ in range(a.steps):
        dist.barrier()
        t0 = time.monotonic()
        works = [dist.all_reduce(t, async_op=True) for t in tensors]
        for w, t in zip(works, tensors):
            w.wait()
            t.div_(a.world)  # averaging, as DDP does
        ms.append((time.monotonic() - t0) * 1e3)
    dist.destroy_process_group()
    with open(a.out, "w") as f:
        json.dump({"what": "gloo", "size": a.size, "step_ms": ms}, f)


if __name__ == "__main__":
    main()
