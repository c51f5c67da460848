# SPDX-License-Identifier: Apache-2.0
"""bf16 and fp16 buffers from Python: registered with numpy or torch dtypes,
averaged bit for bit as the rules say (widened exactly, summed and divided
in fp32, rounded to nearest-even), a dtype that differs between nodes a
MismatchError naming both, and DistributedOptimizer and the DDP hook over a
bf16 model without an fp32 copy of the gradients."""
import threading

import numpy as np
import pytest
import torch

import microd
import microd.torch as mt

NODES = 3


def on_every_node(cluster, work):
    """Runs work(rank, client) in one thread per node; returns the results."""
    results, errors = [None] * cluster.nodes, []

    def run(r):
        try:
            with microd.Client(socket_path=cluster.socket(r)) as c:
                results[r] = work(r, c)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(r,)) for r in range(cluster.nodes)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    if errors:
        raise errors[0]
    return results


def gradient(rank, n, dtype):
    g = torch.Generator().manual_seed(100 + rank)
    return (torch.randn(n, generator=g) * 10 ** torch.randint(-6, 3, (n,), generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dense_half_buffers_average_bit_for_bit(make_cluster, dtype):
    cluster = make_cluster(NODES)
    n = 5000  # below --dense_floor: averaged dense

    def work(r, c):
        buf = c.register("h", n, dtype=dtype)
        assert buf.dtype == str(dtype).replace("torch.", "")
        assert buf.tensor.dtype == dtype and buf.array.nbytes == 2 * n
        out = []
        for step in range(3):
            buf.tensor.copy_(gradient(r + 10 * step, n, dtype))
            c.allreduce(buf, 30000)
            out.append(buf.tensor.clone())
        return out

    got = on_every_node(cluster, work)
    for step in range(3):
        wide = [gradient(r + 10 * step, n, dtype).float() for r in range(NODES)]
        total = wide[0]
        for w in wide[1:]:
            total = total + w  # node order, in fp32
        want = (total / NODES).to(dtype)  # torch rounds to nearest-even
        for r in range(NODES):
            assert torch.equal(got[r][step].view(torch.int16), want.view(torch.int16)), (r, step)


def test_sparse_bf16_buffer_keeps_the_budget_and_agrees_everywhere(make_cluster):
    cluster = make_cluster(2, args=["--density=0.01"])
    n = 100003

    def work(r, c):
        buf = c.register("w", n, dtype="bfloat16")
        for step in range(5):
            buf.tensor.copy_(gradient(r + 10 * step, n, torch.bfloat16))
            c.allreduce(buf, 30000)
        return buf.tensor.clone()

    a, b = on_every_node(cluster, work)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))
    nonzero = int((a != 0).sum())
    assert 0.5 * 0.01 * n <= nonzero <= 2.5 * 0.01 * n, nonzero


def test_dtype_spellings_and_refusals(make_cluster):
    cluster = make_cluster(1)
    with microd.Client(socket_path=cluster.socket(0)) as c:
        assert c.register("a", 10, dtype=np.float16).array.dtype == np.float16
        assert c.register("b", 10, dtype="bfloat16").array.dtype == np.uint16
        assert c.register("c", 10, dtype=torch.float32).array.dtype == np.float32
        assert c.register("d", 10, dtype=torch.half).tensor.dtype == torch.float16
        with pytest.raises(microd.InvalidArgumentError, match="float64"):
            c.register("e", 10, dtype=np.float64)
        with pytest.raises(microd.InvalidArgumentError, match="int8"):
            c.register("f", 10, dtype=torch.int8)


def test_dtype_mismatch_between_nodes_names_both(make_cluster):
    cluster = make_cluster(2)

    def work(r, c):
        buf = c.register("x", 100003, dtype=torch.bfloat16 if r == 0 else torch.float16)
        with pytest.raises(microd.MismatchError) as info:
            c.allreduce(buf, 30000)
        return str(info.value)

    for message in on_every_node(cluster, work):
        assert "'x'" in message and "bfloat16" in message and "float16 x" in message, message


def model(seed):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 300), torch.nn.ReLU(),
                               torch.nn.Linear(300, 10)).to(torch.bfloat16)


def batch(rank, step):
    g = torch.Generator().manual_seed(1000 * rank + step)
    return (torch.randn(32, 64, generator=g).to(torch.bfloat16),
            torch.randint(0, 10, (32,), generator=g))


def test_distributed_optimizer_trains_a_bf16_model_in_bf16_buckets(make_cluster):
    cluster = make_cluster(2, args=["--density=0.05", "--dense_floor=1000"])
    models = [model(0) for _ in range(2)]  # here: torch's seed is global to the threads

    def work(r, c):
        m = models[r]
        opt = mt.DistributedOptimizer(torch.optim.SGD(m.parameters(), lr=0.1),
                                      m.named_parameters(), client=c)
        assert {b.buffer.dtype for b in opt.buckets} == {"bfloat16"}
        for step in range(5):
            x, y = batch(r, step)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(m(x).float(), y).backward()
            opt.step()
        return [p.detach().clone() for p in m.parameters()]

    a, b = on_every_node(cluster, work)
    start = list(model(0).parameters())
    for pa, pb, p0 in zip(a, b, start):
        assert pa.dtype == torch.bfloat16
        assert torch.equal(pa.view(torch.int16), pb.view(torch.int16))  # the same update everywhere
    assert any(not torch.equal(pa, p0) for pa, p0 in zip(a, start))


def test_ddp_hook_passes_bf16_buckets_through(make_cluster):
    cluster = make_cluster(1)
    with microd.Client(socket_path=cluster.socket(0)) as c:
        state = mt.MicrodHookState(client=c)

        class Bucket:  # what DDP hands the hook
            def __init__(self, t):
                self.t = t

            def buffer(self):
                return self.t

            def index(self):
                return 0

        grads = gradient(0, 3000, torch.bfloat16)
        out = mt.comm_hook(state, Bucket(grads.clone())).wait()
        assert out.dtype == torch.bfloat16
        assert torch.equal(out.view(torch.int16), grads.view(torch.int16))  # 1 process: itself
        assert state.buffers[(0, 3000)].dtype == "bfloat16"
