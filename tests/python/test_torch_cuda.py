# SPDX-License-Identifier: Apache-2.0
"""CUDA tensors through the daemons: Client.register_cuda and comm_hook on
CUDA buckets. Needs a GPU that the daemons can use; without one every test
here is skipped with that reason (scripts/gpu-check.sh runs this file on a
GPU machine and counts a skip as a failure)."""
import threading

import numpy as np
import pytest
import torch

import microd
import microd.torch as mt

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="no CUDA device for torch: run scripts/gpu-check.sh on a machine with a GPU")


def run_ranks(n, body):
    """body(r) for r in range(n), each in a thread of its own (one client each)."""
    errors = []

    def guarded(r):
        try:
            body(r)
        except BaseException as e:  # reported below, with the rank
            errors.append((r, e))

    threads = [threading.Thread(target=guarded, args=(r,)) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not any(t.is_alive() for t in threads), "a rank hung"
    assert not errors, errors


def test_cuda_tensor_is_averaged_in_place(make_cluster):
    cluster = make_cluster(2, 1, ["--sparsifier=dense"])
    out = {}

    def rank(r):
        with microd.Client(socket_path=cluster.socket(r)) as c:
            t = torch.zeros(100_000, device="cuda")
            buf = c.register_cuda("w", t)
            for step in range(3):
                t.fill_(float((r + 1) * (step + 1)))  # queued on the current stream
                c.allreduce(buf, 60000)
                out[(r, step)] = t.cpu().numpy()

    run_ranks(2, rank)
    for step in range(3):
        want = np.full(100_000, 1.5 * (step + 1), np.float32)
        for r in range(2):
            np.testing.assert_array_equal(out[(r, step)], want)


class _Bucket:
    """What comm_hook reads of DDP's GradBucket."""

    def __init__(self, tensor, index=0):
        self._tensor = tensor
        self._index = index

    def buffer(self):
        return self._tensor

    def index(self):
        return self._index


def test_comm_hook_on_cuda_buckets_equals_host_buckets(make_cluster):
    """The same gradients through the hook as CUDA buckets and as host buckets
    (two hook states, so two sets of daemon buckets): bit for bit the same
    sparsified averages, step after step."""
    cluster = make_cluster(2, 1, ["--sparsifier=micro", "--density=0.01"])
    d = 200_000
    out = {}

    def rank(r):
        with microd.Client(socket_path=cluster.socket(r)) as c:
            on_gpu = mt.MicrodHookState(c, prefix="gpu")
            on_host = mt.MicrodHookState(c, prefix="host")
            g = torch.Generator().manual_seed(7 + r)
            for step in range(4):
                grad = torch.randn(d, generator=g)
                got_gpu = mt.comm_hook(on_gpu, _Bucket(grad.cuda())).wait()
                got_host = mt.comm_hook(on_host, _Bucket(grad.clone())).wait()
                assert got_gpu.is_cuda and not got_host.is_cuda
                out[(r, step)] = (got_gpu.cpu().numpy(), got_host.numpy().copy())

    run_ranks(2, rank)
    for step in range(4):
        for r in range(2):
            gpu, host = out[(r, step)]
            np.testing.assert_array_equal(gpu, host)
            assert np.count_nonzero(host) > 0
        np.testing.assert_array_equal(out[(0, step)][0], out[(1, step)][0])
