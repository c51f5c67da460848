# SPDX-License-Identifier: Apache-2.0
"""One training process of the state tests: the demo's CNN through
microd.torch.DistributedOptimizer on deterministic synthetic batches.

    state_worker.py OUT FIRST STEPS [load=DIR] [save=DIR]

Runs steps FIRST .. FIRST+STEPS-1; with load=DIR it first loads the model
(torch.load) and microd's compression state from DIR, with save=DIR it saves
both after the last step. Writes the final parameters to OUT (.npz)."""
import os
import sys

import numpy as np
import torch

import microd.torch as mt

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "examples", "fashion_mnist"))
from train import Net  # noqa: E402  (the demo's model)

out, first, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
opts = dict(a.split("=", 1) for a in sys.argv[4:])
torch.set_num_threads(1)
client = mt.default_client()
rank = client.rank

torch.manual_seed(0)
model = Net()
if "load" in opts:
    model.load_state_dict(torch.load(os.path.join(opts["load"], f"model-{rank}.pt")))
opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model.named_parameters())
if "load" in opts:
    mt.load_state(opts["load"])  # after the optimizer registered its buckets
for t in range(first, first + steps):
    g = torch.Generator().manual_seed(1000 * rank + t)
    x = torch.randn(16, 1, 28, 28, generator=g)
    y = torch.randint(0, 10, (16,), generator=g)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
if "save" in opts:
    os.makedirs(opts["save"], exist_ok=True)
    torch.save(model.state_dict(), os.path.join(opts["save"], f"model-{rank}.pt"))
    mt.save_state(opts["save"])
np.savez(out, *[p.detach().numpy() for p in model.parameters()])
