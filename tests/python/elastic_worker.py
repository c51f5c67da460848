# SPDX-License-Identifier: Apache-2.0
"""One training process of the elastic tests: microd.torch.elastic.run with
DistributedOptimizer (SGD with momentum, so the optimizer's state matters).

    elastic_worker.py STEPS [model=mlp|cnn] [pause_at=N] [hold_at=N:FILE] [save_at=N:DIR] [seed=S]

model=mlp (default): a small MLP on random data, its initial values
different on every process (the sync must hand rank 0's to all);
model=cnn: the demo's Fashion-MNIST CNN, each process on its shard of the
training set (rank::world_size, cut again at each change, each step's
batch drawn from the step and the rank), the learning rate decaying
linearly to 0, and rank 0 prints "ACCURACY a" on the test set at the end.
pause_at: stop before step N and sleep until killed (a node to lose);
hold_at: wait before step N until FILE exists (60 s at most);
save_at: microd.torch.save_state(DIR) before step N (prints "SAVED N").
Prints "START epoch rank world_size" once the optimizer is made, "STEP t
world_size hash" after each committed step (hash: the parameters' bytes),
"RESET world_size" from the reset callback, and "DONE step resets" at
the end."""
import hashlib
import os
import sys
import time

import torch
import torch.nn.functional as F

import microd.torch as mt
from microd.torch import elastic

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
steps = int(sys.argv[1])
options = dict(a.split("=", 1) for a in sys.argv[2:])
pause_at = int(options.get("pause_at", -1))
hold_at, hold_file = -1, None
if "hold_at" in options:
    at, hold_file = options["hold_at"].split(":", 1)
    hold_at = int(at)
save_at, save_dir = -1, None
if "save_at" in options:
    at, save_dir = options["save_at"].split(":", 1)
    save_at = int(at)
cnn = options.get("model", "mlp") == "cnn"
seed = int(options.get("seed", 0))
torch.set_num_threads(1)

client = mt.default_client()
if cnn:
    sys.path.insert(0, os.path.join(ROOT, "examples", "fashion_mnist"))
    from train import Net, evaluate, load  # the demo's model and data
    torch.manual_seed(seed)
    model = Net()
    train_x, train_y = load("train")
    lr, batch = 0.05, 32
else:
    torch.manual_seed(100 + os.getpid())  # every process starts from other values
    model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(),
                                torch.nn.Linear(16, 3))
    lr, batch = 0.05, 8
opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9),
                              model.named_parameters())
print("START", client.epoch, client.rank, client.world_size, flush=True)
state = elastic.TorchState(model, opt, step=0)
state.register_reset_callbacks([lambda world_size: print("RESET", world_size, flush=True)])


def params_hash():
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


def batch_of(step, rank, world):
    """This process's batch of the step: its rank and the step pick it."""
    g = torch.Generator().manual_seed(1000003 * seed + 1000 * step + rank)
    if not cnn:
        return torch.randn(batch, 12, generator=g), torch.randint(0, 3, (batch,), generator=g)
    shard = torch.arange(rank, len(train_x), world)
    idx = shard[torch.randint(0, len(shard), (batch,), generator=g)]
    return train_x[idx], train_y[idx]


@elastic.run
def train(state):
    while state.step < steps:
        if state.step == save_at:
            mt.save_state(save_dir)
            print("SAVED", state.step, flush=True)
        if state.step == pause_at:
            print("PAUSED", flush=True)
            time.sleep(600)
        if state.step == hold_at:
            for _ in range(3000):
                if os.path.exists(hold_file):
                    break
                time.sleep(0.02)
        x, y = batch_of(state.step, state.rank, state.world_size)
        if cnn:
            # Decays linearly to 0: the final accuracy varies less from run to run.
            for group in opt.param_groups:
                group["lr"] = lr * (1 - state.step / steps)
        opt.zero_grad()
        F.cross_entropy(model(x), y).backward()
        opt.step()
        state.step += 1
        state.commit()  # a change rolls back to here: the next step
        print("STEP", state.step - 1, state.world_size, params_hash(), flush=True)


train(state)
if cnn and client.rank == 0:
    accuracy, _ = evaluate(model, *load("t10k"))
    print("ACCURACY", accuracy, flush=True)
print("DONE", state.step, state.resets, flush=True)
client.close()
