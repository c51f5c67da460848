# SPDX-License-Identifier: Apache-2.0
"""Fashion-MNIST training through microd, one copy per training process
(started by deploy/local/launch.sh, which sets MICROD_SOCKET / MICROD_ADMIN).

    /usr/bin/python3 train.py --epochs 3 --out results/micro.json --label micro

Every process trains on its shard with microd.torch.DistributedOptimizer;
rank 0 evaluates on the test set, shows a progress bar, samples the daemon's
statistics (density, threshold, bytes) and writes the run's JSON."""
import argparse
import gzip
import json
import os
import subprocess
import sys
import time

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

try:
    import microd.torch as mt
except ModuleNotFoundError:  # run from the repository, the package not installed
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                    "client", "python"))
    import microd.torch as mt

DATA = "/usr/share/datasets/fashion-mnist"


def load(kind):
    with gzip.open(os.path.join(DATA, f"{kind}-images-idx3-ubyte.gz")) as f:
        images = np.frombuffer(f.read(), np.uint8, offset=16).reshape(-1, 1, 28, 28)
    with gzip.open(os.path.join(DATA, f"{kind}-labels-idx1-ubyte.gz")) as f:
        labels = np.frombuffer(f.read(), np.uint8, offset=8)
    x = torch.from_numpy(images.astype(np.float32) / 255.0)
    x = (x - 0.2860) / 0.3530
    return x, torch.from_numpy(labels.astype(np.int64))


class Net(nn.Module):
    """A small CNN (147,146 parameters)."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 5)
        self.conv2 = nn.Conv2d(16, 32, 5)
        self.fc1 = nn.Linear(32 * 4 * 4, 256)
        self.fc2 = nn.Linear(256, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


def evaluate(model, x, y):
    model.eval()
    correct, loss = 0, 0.0
    with torch.no_grad():
        for i in range(0, len(x), 1000):
            out = model(x[i:i + 1000])
            loss += F.cross_entropy(out, y[i:i + 1000], reduction="sum").item()
            correct += (out.argmax(1) == y[i:i + 1000]).sum().item()
    model.train()
    return correct / len(x), loss / len(x)


def daemon_stats(microctl):
    """The daemon's per-bucket statistics (this node), or {} if unavailable."""
    try:
        out = subprocess.run([microctl, "--json", "buckets"], capture_output=True, text=True,
                             timeout=10, check=True).stdout
        # the model's largest bucket (not microd's own, such as the broadcast's)
        buckets = [b for b in json.loads(out).get("buckets", [])
                   if not b.get("name", "").startswith("microd.")]
        return max(buckets, key=lambda b: int(b.get("count", 0))) if buckets else {}
    except Exception:
        return {}


def bar(done, total, width=30):
    filled = int(width * done / max(1, total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=float, default=3)
    ap.add_argument("--steps", type=int, default=0, help="train this many steps (overrides --epochs)")
    ap.add_argument("--model", choices=["cnn", "mlp"], default="cnn")
    ap.add_argument("--width", type=int, default=4096, help="--model mlp: its width")
    ap.add_argument("--seed", type=int, default=0, help="initial weights and data order")
    ap.add_argument("--batch", type=int, default=32, help="per process")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--momentum", type=float, default=0.9)
    ap.add_argument("--evals", type=int, default=6, help="test-set evaluations over the run")
    ap.add_argument("--label", default="run")
    ap.add_argument("--out", required=True)
    ap.add_argument("--microctl", default=os.environ.get("MICROCTL", "build/daemon/microctl"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(args.seed)

    client = mt.default_client()
    rank, world = client.rank, client.world_size
    x, y = load("train")
    xs, ys = x[rank::world], y[rank::world]
    if args.model == "cnn":
        model = Net()
    else:  # the training benchmark's MLP, on the images flattened
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..",
                                        "bench", "training"))
        from worker import mlp
        model = nn.Sequential(nn.Flatten(), mlp(args.width))
    mt.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr,
                                                  momentum=args.momentum),
                                  model.named_parameters())
    steps_per_epoch = len(xs) // args.batch
    total = args.steps or int(args.epochs * steps_per_epoch)
    eval_at = set(int(total * (i + 1) / args.evals) for i in range(args.evals))
    if rank == 0:
        xt, yt = load("t10k")
    g = torch.Generator().manual_seed(1234 + 1000 * args.seed + rank)
    record = {"label": args.label, "world_size": world, "steps": total, "seed": args.seed,
              "model": args.model, "parameters": sum(p.numel() for p in model.parameters()),
              "loss": [],
              "eval": [], "samples": [], "step_seconds": []}
    order = torch.randperm(len(xs), generator=g)
    start = time.time()
    for step in range(1, total + 1):
        i = (step - 1) % steps_per_epoch
        if i == 0 and step > 1:
            order = torch.randperm(len(xs), generator=g)
        idx = order[i * args.batch:(i + 1) * args.batch]
        t0 = time.time()
        opt.zero_grad()
        loss = F.cross_entropy(model(xs[idx]), ys[idx])
        loss.backward()
        opt.step()
        record["step_seconds"].append(time.time() - t0)
        record["loss"].append(loss.item())
        if rank != 0:
            continue
        if step % 20 == 0 or step == total:
            s = daemon_stats(args.microctl)
            if s:
                record["samples"].append({
                    "step": step, "selected": int(s.get("lastSelected", 0)),
                    "budget": int(s.get("budget", 0)), "count": int(s.get("count", 0)),
                    "threshold": float(s.get("lastThreshold", 0.0)),
                    "cre": float(s.get("lastCre", 0.0))})
            avg = float(np.mean(record["loss"][-50:]))
            print(f"\r{args.label:>6} {bar(step, total)} step {step}/{total} loss {avg:.3f} "
                  f"{time.time() - start:5.0f}s", end="", file=sys.stderr, flush=True)
        if step in eval_at:
            acc, tl = evaluate(model, xt, yt)
            record["eval"].append({"step": step, "accuracy": acc, "loss": tl})
    if rank == 0:
        print(file=sys.stderr)
        s = daemon_stats(args.microctl)
        steps_done = max(1, int(s.get("steps", 1)))
        record["daemon"] = {
            "mean_cre": float(s.get("meanCre", 0.0)),
            "bytes_sent_per_step": int(s.get("bytesSent", 0)) / steps_done,
            "bytes_received_per_step": int(s.get("bytesReceived", 0)) / steps_done,
            "dense": bool(s.get("dense", False)), "count": int(s.get("count", 0))}
        record["final_accuracy"] = record["eval"][-1]["accuracy"]
        record["final_test_loss"] = record["eval"][-1]["loss"]
        record["seconds"] = time.time() - start
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f)
    client.close()


if __name__ == "__main__":
    main()
