"""One training process of the elastic tests: microd.torch.elastic.run over a
small MLP with DistributedOptimizer (SGD with momentum, so the optimizer's
state matters), the model's initial values different on every process (the
sync must hand rank 0's to all).

    elastic_worker.py STEPS [pause_at=N] [hold_at=N:FILE]

pause_at: stop before step N and sleep until killed (a node to lose);
hold_at: wait before step N until FILE exists (60 s at most).
Prints "START epoch rank world_size" once the optimizer is made, "STEP t
world_size hash" after each committed step (hash: the parameters' bytes),
"RESET world_size" from the reset callback, and "DONE step resets" at
the end."""
import hashlib
import os
import sys
import time

import torch

import microd.torch as mt
from microd.torch import elastic

steps = int(sys.argv[1])
options = dict(a.split("=", 1) for a in sys.argv[2:])
pause_at = int(options.get("pause_at", -1))
hold_at, hold_file = -1, None
if "hold_at" in options:
    at, hold_file = options["hold_at"].split(":", 1)
    hold_at = int(at)
torch.set_num_threads(1)

client = mt.default_client()
torch.manual_seed(100 + os.getpid())  # every process starts from other values
model = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                              model.named_parameters())
print("START", client.epoch, client.rank, client.world_size, flush=True)
state = elastic.TorchState(model, opt, step=0)
state.register_reset_callbacks([lambda world_size: print("RESET", world_size, flush=True)])


def params_hash():
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    return h.hexdigest()[:16]


@elastic.run
def train(state):
    while state.step < steps:
        if state.step == pause_at:
            print("PAUSED", flush=True)
            time.sleep(600)
        if state.step == hold_at:
            for _ in range(3000):
                if os.path.exists(hold_file):
                    break
                time.sleep(0.02)
        # This process's batch of the step: its rank and the step pick it.
        g = torch.Generator().manual_seed(1000 * state.step + state.rank)
        x = torch.randn(8, 12, generator=g)
        y = torch.randint(0, 3, (8,), generator=g)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        state.step += 1
        state.commit()  # a change rolls back to here: the next step
        print("STEP", state.step - 1, state.world_size, params_hash(), flush=True)


train(state)
print("DONE", state.step, state.resets, flush=True)
client.close()
