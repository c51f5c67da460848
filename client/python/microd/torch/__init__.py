# SPDX-License-Identifier: Apache-2.0
"""PyTorch integration: a Horovod-like DistributedOptimizer, parameter
broadcast, and a communication hook for DistributedDataParallel.

    import microd.torch as mt
    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05),
                                  model.named_parameters())
    mt.broadcast_parameters(model.state_dict(), root_rank=0)
    ...
    loss.backward()      # buckets are submitted as backward produces them
    opt.step()           # waits for the averaged (sparsified) gradients

    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(mt.MicrodHookState(), mt.comm_hook)
    mt.apply_momentum_correction(optimizer)   # if the daemon corrects momentum

Elastic jobs (nodes lost and joining): microd.torch.elastic.
"""
import concurrent.futures
import sys
import threading
import warnings

import torch

import microd

__all__ = ["DistributedOptimizer", "broadcast_parameters", "MicrodHookState", "comm_hook",
           "default_client", "apply_momentum_correction", "save_state", "load_state"]

_default = None
_default_lock = threading.Lock()


def default_client():
    """One Client per process, connected on first use ($MICROD_SOCKET)."""
    global _default
    with _default_lock:
        if _default is None:
            _default = microd.Client()
        return _default


def apply_momentum_correction(optimizer, client=None):
    """With the daemon's momentum correction on (--momentum_correction B), the
    daemon accumulates the velocity; an optimizer applying momentum again
    would square it. Sets the momentum of every param group to 0 (saying so
    once on rank 0) and returns True if it changed anything. Does nothing
    when the option is off. DistributedOptimizer calls it itself; DDP hook
    users call it on their optimizer."""
    client = client or default_client()
    beta = client.momentum_correction
    if beta <= 0:
        return False
    switched = False
    for group in optimizer.param_groups:
        if group.get("momentum", 0) > 0:
            if abs(group["momentum"] - beta) > 1e-6:
                warnings.warn(f"microd: the optimizer's momentum {group['momentum']} differs "
                              f"from the daemon's momentum correction {beta}; using the daemon's")
            group["momentum"] = 0.0
            switched = True
    if switched and client.rank == 0:
        print(f"microd: momentum correction {beta:g} is on in the daemon: the optimizer "
              f"now runs without momentum", file=sys.stderr)
    return switched


_HALF_OR_FLOAT = (torch.float32, torch.bfloat16, torch.float16)


class _Bucket:
    def __init__(self, client, name, params):
        self.params = params
        self.offsets = []
        total = 0
        for p in params:
            self.offsets.append(total)
            total += p.numel()
        # The parameters' dtype (one per bucket): bf16/fp16 gradients go to the
        # daemon as they are, which steps in fp32 and rounds the update back.
        self.buffer = client.register(name, total, dtype=params[0].dtype)
        self.flat = self.buffer.tensor
        self.ready = set()
        self.ticket = None

    def slice(self, i):
        p = self.params[i]
        return self.flat[self.offsets[i]:self.offsets[i] + p.numel()].view_as(p)


def save_state(directory, client=None, timeout_ms=600000):
    """microd's compression state (residuals, velocities, thresholds, step
    counters) into `directory`, beside torch.save of the model and optimizer:
    call it on every process at the same point, after optimizer.step()."""
    (client or default_client()).save_state(directory, timeout_ms)


def load_state(directory, client=None, timeout_ms=600000):
    """Loads what save_state wrote: on every process, after the
    DistributedOptimizer is made (it registers its buckets) and before the
    first step, next to loading the model and optimizer. The steps then
    continue exactly as if the job had not stopped."""
    (client or default_client()).load_state(directory, timeout_ms)


class DistributedOptimizer:
    """Wraps an optimizer: gradients are grouped into buckets in registered
    shared memory (in reverse parameter order, about the order backward
    produces them), each bucket is submitted to microd as soon as backward
    has produced all of its gradients, and step() waits for them, writes the
    averaged sparse update into .grad and runs the wrapped optimizer."""

    def __init__(self, optimizer, named_parameters, client=None, bucket_cap_mb=25,
                 timeout_ms=600000, prefix="grads"):
        self.optimizer = optimizer
        self.client = client or default_client()
        self.timeout_ms = timeout_ms
        apply_momentum_correction(optimizer, self.client)
        named = [(n, p) for n, p in named_parameters if p.requires_grad]
        if not named:
            raise ValueError("DistributedOptimizer: no parameters that require gradients")
        for n, p in named:
            if p.dtype not in _HALF_OR_FLOAT:
                raise ValueError(f"DistributedOptimizer: parameter {n} is {p.dtype}; microd "
                                 f"buckets are float32, bfloat16 or float16")
        cap = max(1, int(bucket_cap_mb * 1024 * 1024 / 4))
        groups, current, size = [], [], 0
        for _, p in reversed(named):
            # A bucket holds one dtype: a new one starts where the dtype changes.
            if current and (size + p.numel() > cap or p.dtype != current[0].dtype):
                groups.append(current)
                current, size = [], 0
            current.append(p)
            size += p.numel()
        groups.append(current)
        self.buckets = [_Bucket(self.client, f"{prefix}.{i}", g) for i, g in enumerate(groups)]
        self._where = {}
        for b in self.buckets:
            for i, p in enumerate(b.params):
                self._where[p] = (b, i)
                p.register_hook(self._make_hook(p))
        self._lock = threading.Lock()

    def _make_hook(self, p):
        def hook(grad):
            b, i = self._where[p]
            b.slice(i).copy_(grad)
            with self._lock:
                b.ready.add(i)
                if len(b.ready) == len(b.params) and b.ticket is None:
                    b.ticket = self.client.allreduce_async(b.buffer)
            return grad
        return hook

    def synchronize(self):
        """Submits what backward did not (parameters without gradients count
        as zero), waits for every bucket and writes the updates into .grad."""
        for b in self.buckets:
            with self._lock:
                if b.ticket is None:
                    for i in range(len(b.params)):
                        if i not in b.ready:
                            b.slice(i).zero_()
                    b.ticket = self.client.allreduce_async(b.buffer)
        # Every ticket is waited for, even after one failed (a change of
        # membership answers each of them): none is left in flight.
        first_error = None
        try:
            for b in self.buckets:
                try:
                    self.client.wait(b.ticket, self.timeout_ms)
                except microd.MembershipChangedError as e:
                    first_error = first_error or e
        finally:
            for b in self.buckets:
                b.ticket = None
                b.ready.clear()
        if first_error is not None:
            raise first_error
        for b in self.buckets:
            for i, p in enumerate(b.params):
                if p.grad is None:
                    p.grad = b.slice(i).clone()
                else:
                    p.grad.copy_(b.slice(i))

    def step(self, closure=None):
        self.synchronize()
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none=False):
        return self.optimizer.zero_grad(set_to_none=set_to_none)

    def __getattr__(self, name):
        return getattr(self.optimizer, name)

    def state_dict(self):
        return self.optimizer.state_dict()

    def load_state_dict(self, state):
        return self.optimizer.load_state_dict(state)


# Words (two bytes each, sent as floats) per allreduce of broadcast_parameters.
BROADCAST_CHUNK = 1 << 22


def broadcast_parameters(params, root_rank=0, client=None, timeout_ms=600000):
    """Makes every process hold root_rank's values of `params` (a state_dict
    or an iterable of (name, tensor)): every tensor, whatever its dtype
    (floating, integer, bool), ends with the root's exact bits everywhere.

    The daemons average, so the bits travel as integers an average cannot
    bend: the tensors' bytes as 16-bit words, each word a float in
    [0, 65535] that only the root contributes (others add zeros). The average
    times W is that word within 2^-7, and rounding gives it back exactly."""
    client = client or default_client()
    items = sorted(params.items()) if isinstance(params, dict) else sorted(params)
    tensors = [t for _, t in items if torch.is_tensor(t) and t.numel() > 0]
    raw = [t.detach().contiguous().reshape(-1).view(torch.uint8) for t in tensors]
    nbytes = sum(r.numel() for r in raw)
    if nbytes == 0:
        return
    words = (nbytes + 1) // 2
    packed = torch.zeros(2 * words, dtype=torch.uint8)
    if client.rank == root_rank:
        torch.cat(raw, out=packed[:nbytes])
    # Through one buffer of at most BROADCAST_CHUNK words, reused chunk by
    # chunk: the daemon's memory for it stays bounded whatever the model.
    chunk = min(words, BROADCAST_CHUNK)
    name = f"microd.broadcast.{chunk}"
    buf = client.buffers.get(name) or client.register(name, chunk, dense=True)
    flat = buf.tensor
    halves = packed.view(torch.int16)
    back = torch.empty(words, dtype=torch.int16)
    for start in range(0, words, chunk):
        n = min(chunk, words - start)
        if client.rank == root_rank:
            flat[:n].copy_(halves[start:start + n].to(torch.int32).bitwise_and(0xFFFF))
        else:
            flat[:n].zero_()
        flat[n:].zero_()
        client.allreduce(buf, timeout_ms)
        got = torch.round(flat[:n] * client.world_size).to(torch.int32)
        back[start:start + n] = torch.where(got > 32767, got - 65536, got).to(torch.int16)
    back = back.view(torch.uint8)
    offset = 0
    with torch.no_grad():
        for t, r in zip(tensors, raw):
            n = r.numel()
            t.copy_(back[offset:offset + n].clone().view(t.dtype).view_as(t))
            offset += n


class MicrodHookState:
    """State of comm_hook: the client and one registered buffer per DDP bucket."""

    def __init__(self, client=None, prefix="ddp", timeout_ms=600000):
        self.client = client or default_client()
        self.prefix = prefix
        self.timeout_ms = timeout_ms
        self.buffers = {}
        self.waiter = concurrent.futures.ThreadPoolExecutor(max_workers=1,
                                                            thread_name_prefix="microd-hook")


def comm_hook(state, bucket):
    """DistributedDataParallel communication hook: averages the bucket through
    microd (sparsified as the daemons are configured) and returns a future of
    the averaged tensor."""
    tensor = bucket.buffer() if hasattr(bucket, "buffer") else bucket.get_tensor()
    # DDP may rebuild its buckets after the first iteration: key by size too.
    key = (bucket.index(), tensor.numel())
    buf = state.buffers.get(key)
    if buf is None:
        name = f"{state.prefix}.{key[0]}.{key[1]}"
        if tensor.is_cuda:
            # A float32 buffer of the daemon's on the bucket's GPU (CUDA IPC:
            # the update is written into it in place; bf16/fp16 CUDA buffers
            # are not taken yet, so a half bucket goes through fp32 here).
            flat = torch.empty(key[1], dtype=torch.float32, device=tensor.device)
            buf = state.client.register_cuda(name, flat)
        else:
            # In the bucket's own dtype: a bf16/fp16 bucket is not widened here.
            buf = state.client.register(name, key[1], dtype=tensor.dtype)
        state.buffers[key] = buf
    flat = buf.tensor
    # On the current stream for a CUDA bucket: the submission below makes the
    # daemon wait for this copy (and for the backward pass before it).
    flat.copy_(tensor.detach().reshape(-1))
    ticket = state.client.allreduce_async(buf)
    fut = torch.futures.Future()

    def wait():
        try:
            state.client.wait(ticket, state.timeout_ms)
            # DDP copies the result into the gradients itself: hand it the
            # shared buffer (rewritten only by this bucket's next step).
            out = flat.view_as(tensor)
            fut.set_result(out if out.dtype == tensor.dtype else out.to(tensor.dtype))
        except Exception as e:  # delivered to DDP through the future
            fut.set_exception(e)

    state.waiter.submit(wait)
    return fut
