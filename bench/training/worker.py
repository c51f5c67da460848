# SPDX-License-Identifier: Apache-2.0
"""One training process of the step comparison (bench/training/run.py starts
four): the same model, data, seed and steps for every method.

    method ddp       DistributedDataParallel, Gloo allreduce (dense)
           fp16      DDP + fp16_compress_hook
           powersgd  DDP + powerSGD_hook (--powersgd-rank)
           microd    DDP + microd.torch.comm_hook, through this node's daemon
           local     no communication at all: the compute floor of a step
                     with the same number of processes sharing the machine

Writes OUT_DIR/rank<R>.json: per-step times and losses, bytes this process
(and for microd its daemon) wrote to sockets over the timed steps, and on
rank 0 the loss on a fixed test subset after the last step plus, for microd,
the daemon's per-bucket statistics with their per-step history."""
import argparse
import gzip
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

DATA = "/usr/share/datasets/fashion-mnist"


def load(kind, limit=None):
    with gzip.open(os.path.join(DATA, f"{kind}-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 784)
    with gzip.open(os.path.join(DATA, f"{kind}-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    if limit:
        images, labels = images[:limit], labels[:limit]
    x = (torch.from_numpy(images.astype(np.float32) / 255.0) - 0.2860) / 0.3530
    return x, torch.from_numpy(labels.astype(np.int64))


def mlp(width):
    """784 -> width -> width -> width*5/16 -> 10; width 4096 gives 25.3 M parameters."""
    third = max(1, width * 5 // 16)
    return nn.Sequential(nn.Linear(784, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
                         nn.Linear(width, third), nn.ReLU(), nn.Linear(third, 10))


def wchar(pid="self"):
    """Bytes this process passed to write-family calls (Gloo's socket writes)."""
    try:
        with open(f"/proc/{pid}/io") as f:
            for line in f:
                if line.startswith("wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def daemon_pid(socket_path):
    """The pid of the microd serving socket_path (same user), or None."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
        except OSError:
            continue
        if argv and os.path.basename(argv[0]) == b"microd" and \
                f"--socket={socket_path}".encode() in argv:
            return int(entry)
    return None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", required=True, choices=["ddp", "fp16", "powersgd", "microd", "local"])
    ap.add_argument("--powersgd-rank", type=int, default=1)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the timings")
    ap.add_argument("--batch", type=int, default=32, help="per process")
    ap.add_argument("--lr", type=float, default=0.02)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--port", type=int, required=True, help="TCP rendezvous port of rank 0")
    ap.add_argument("--master", default=os.environ.get("MICROD_MASTER_ADDR", "127.0.0.1"),
                    help="rank 0's address (on an emulated network: node 0's)")
    ap.add_argument("--budget", type=float, default=0,
                    help="time-to-accuracy: train for this many seconds (not --steps), "
                         "evaluating the test accuracy every --eval-every seconds")
    ap.add_argument("--eval-every", type=float, default=20)
    ap.add_argument("--target-accuracy", type=float, default=0,
                    help="with --budget: stop as soon as an evaluation reaches this test "
                         "accuracy (the budget then bounds the run)")
    ap.add_argument("--eval-size", type=int, default=2000)
    ap.add_argument("--microctl", default=os.environ.get("MICROCTL", ""))
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)

    client = None
    if args.method == "microd":
        import microd.torch as mt
        client = mt.default_client()
        rank, world = client.rank, client.world_size
    else:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://{args.master}:{args.port}", rank=rank,
                            world_size=world, timeout=__import__("datetime").timedelta(seconds=300))

    torch.manual_seed(0)
    net = mlp(args.width)
    model = net if args.method == "local" else DDP(net)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum)
    if args.method == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
        model.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif args.method == "powersgd":
        from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook
        state = powerSGD_hook.PowerSGDState(process_group=None,
                                            matrix_approximation_rank=args.powersgd_rank,
                                            start_powerSGD_iter=2)
        def serialized(state, bucket):
            # PyTorch 1.13's hook issues its later collectives from future
            # callbacks, whose order differs between ranks over Gloo: with
            # more than one bucket the ranks deadlocked here. Running each
            # bucket's hook to completion keeps the order the same everywhere.
            fut = powerSGD_hook.powerSGD_hook(state, bucket)
            fut.wait()
            return fut
        model.register_comm_hook(state, serialized)
    elif args.method == "microd":
        mt.apply_momentum_correction(opt, client)
        model.register_comm_hook(mt.MicrodHookState(client), mt.comm_hook)

    x, y = load("train")
    xs, ys = x[rank::world], y[rank::world]
    g = torch.Generator().manual_seed(1234 + rank)
    daemon = daemon_pid(os.environ.get("MICROD_SOCKET", "")) if client else None
    record = {"rank": rank, "world_size": world, "method": args.method,
              "parameters": sum(p.numel() for p in model.parameters()),
              "step_seconds": [], "loss": []}
    if args.budget > 0:
        record["curve"] = []  # [training seconds, step, test accuracy] (rank 0)
        xt, yt = load("t10k", limit=args.eval_size)
    w0 = d0 = None
    trained = 0.0  # seconds of training so far (evaluations excluded)
    next_eval = 0.0
    stop = torch.zeros(1)
    step = 0
    while True:
        if args.budget > 0:
            # Rank 0 evaluates on a schedule of training time and decides
            # when the budget is spent; every rank stops at the same step.
            done = rank == 0 and trained >= args.budget
            if rank == 0 and (trained >= next_eval or done) and \
                    (not record["curve"] or record["curve"][-1][1] != step):
                e0 = time.perf_counter()
                with torch.no_grad():
                    acc = (net(xt).argmax(1) == yt).float().mean().item()
                record["curve"].append([trained, step, acc])
                record["eval_seconds"] = record.get("eval_seconds", 0) + time.perf_counter() - e0
                next_eval += args.eval_every
                if 0 < args.target_accuracy <= acc and "reached" not in record:
                    record["reached"] = [trained, step]  # training seconds, steps
                    done = True
            stop[0] = 1.0 if done else 0.0
            dist.broadcast(stop, 0)
            if stop[0] > 0:
                break
        elif step >= args.steps:
            break
        if step == args.warmup:
            w0, d0 = wchar(), wchar(daemon) if daemon else -1
        idx = torch.randint(0, len(xs), (args.batch,), generator=g)
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = F.cross_entropy(model(xs[idx]), ys[idx])
        loss.backward()
        opt.step()
        record["step_seconds"].append(time.perf_counter() - t0)
        trained += record["step_seconds"][-1]
        record["loss"].append(loss.item())
        step += 1
        if not np.isfinite(record["loss"][-1]):
            record["diverged_at"] = step - 1
            break
    if w0 is None:  # stopped within the warm-up
        w0, d0 = wchar(), wchar(daemon) if daemon else -1
    timed = max(1, len(record["step_seconds"]) - args.warmup)
    record["socket_bytes_per_step"] = (wchar() - w0) / timed
    if daemon:
        record["daemon_socket_bytes_per_step"] = (wchar(daemon) - d0) / timed
    if rank == 0:
        xt, yt = load("t10k", limit=2000)
        with torch.no_grad():
            record["test_loss"] = F.cross_entropy(net(xt), yt).item()
        if client and args.microctl:
            out = subprocess.run([args.microctl, "--json", "--history", "buckets"],
                                 capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                record["daemon_buckets"] = json.loads(out.stdout).get("buckets", [])
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(record, f)
    dist.barrier()
    if client:
        client.close()
    # Every rank has written its results and passed the barrier. PyTorch 1.13
    # sometimes hangs tearing down Gloo after the fp16 hook; the figures are
    # out, so leave without the teardown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
