# SPDX-License-Identifier: Apache-2.0
"""One training process of the PyTorch tests.

    torch_worker.py MODE OUT [STEPS] [DENSITY]
MODE: ddp-gloo (plain DDP, Gloo allreduce), ddp-microd (DDP + microd.torch.comm_hook),
optimizer (microd.torch.DistributedOptimizer), train (a short real training run),
broadcast (microd.torch.broadcast_parameters of every dtype).
Writes the final parameters (and, for `optimizer`, each step's local gradient
and received update) to OUT as .npz."""
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

import microd
import microd.torch as mt

mode, out = sys.argv[1], sys.argv[2]
steps = int(sys.argv[3]) if len(sys.argv) > 3 else 5
torch.set_num_threads(1)

client = mt.default_client()
rank, world = client.rank, client.world_size


def model_and_data(seed_data):
    torch.manual_seed(0)  # same initial model everywhere
    model = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(1000 + seed_data)
    x = torch.randn(steps * 16, 20, generator=g)
    y = torch.randint(0, 4, (steps * 16,), generator=g)
    return model, x, y


if mode in ("ddp-gloo", "ddp-microd"):
    store = dist.FileStore(os.environ["TEST_STORE"], world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    model, x, y = model_and_data(rank)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    if mode == "ddp-microd":
        ddp.register_comm_hook(mt.MicrodHookState(client), mt.comm_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    for s in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(ddp(x[s * 16:(s + 1) * 16]), y[s * 16:(s + 1) * 16])
        loss.backward()
        opt.step()
    np.savez(out, *[p.detach().numpy() for p in model.parameters()])
    dist.destroy_process_group()
elif mode == "optimizer":
    model, x, y = model_and_data(rank)
    mt.broadcast_parameters(model.state_dict(), root_rank=0)
    # With momentum correction in the daemon, the optimizer must switch its own off.
    momentum = 0.9 if client.momentum_correction > 0 else 0.0
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1, momentum=momentum),
                                  model.named_parameters())
    grads, updates = [], []
    for s in range(steps):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[s * 16:(s + 1) * 16]), y[s * 16:(s + 1) * 16])
        loss.backward()
        bucket = opt.buckets[0]
        grads.append(torch.cat([p.grad.reshape(-1) for p in bucket.params]).numpy().copy())
        opt.step()
        updates.append(torch.cat([p.grad.reshape(-1) for p in bucket.params]).numpy().copy())
    np.savez(out, grads=np.stack(grads), updates=np.stack(updates),
             sgd_momentum=np.array(opt.param_groups[0]["momentum"]),
             daemon_momentum=np.array(client.momentum_correction),
             params=np.concatenate([p.detach().reshape(-1).numpy() for p in model.parameters()]))
elif mode == "train":
    # A learnable problem: 8 Gaussian blobs in 32 dimensions, each process its own shard.
    torch.manual_seed(0)
    centers = torch.randn(8, 32) * 2
    g = torch.Generator().manual_seed(rank)
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    mt.broadcast_parameters(model.state_dict())
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                                  model.named_parameters())
    losses = []
    for s in range(steps):
        yb = torch.randint(0, 8, (32,), generator=g)
        xb = centers[yb] + torch.randn(32, 32, generator=g)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(xb), yb)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    np.savez(out, losses=np.array(losses))
elif mode == "broadcast":
    # Every rank holds different values of every dtype a state_dict holds;
    # after the broadcast each must hold the root's bits (saved as raw bytes).
    root = world - 1
    g = torch.Generator().manual_seed(100 + rank)
    state = {"w32": torch.randn(1000, generator=g) * 3.7,
             "w64": torch.randn(257, generator=g, dtype=torch.float64) / 3,
             "wbf16": torch.randn(65, generator=g).to(torch.bfloat16),
             "steps": torch.tensor([rank * 1000003 + 7], dtype=torch.int64),
             "mask": torch.rand(9, generator=g) > 0.5,
             "empty": torch.zeros(0)}
    before = {k: v.clone() for k, v in state.items()}
    mt.BROADCAST_CHUNK = 300  # ~6,200 bytes: 11 chunks through one 300-word buffer
    mt.broadcast_parameters(state, root_rank=root)

    def raw(t):
        return t.contiguous().reshape(-1).view(torch.uint8).numpy().copy()
    np.savez(out, **{f"after_{k}": raw(v) for k, v in state.items()},
             **{f"before_{k}": raw(v) for k, v in before.items()}, root=np.array(root))
else:
    sys.exit(f"unknown mode {mode}")
client.close()
