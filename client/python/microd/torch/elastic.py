# SPDX-License-Identifier: Apache-2.0
"""Elastic training, in the style of Horovod Elastic: a job whose nodes can
be lost (--min_nodes) and can join (--max_nodes) while it runs.

    import microd.torch as mt
    from microd.torch import elastic

    opt = mt.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                  model.named_parameters())
    state = elastic.TorchState(model, opt, epoch=0, batch=0)
    state.register_reset_callbacks([lambda world_size: set_lr(0.1 * world_size)])

    @elastic.run
    def train(state):
        while state.epoch < epochs:
            while state.batch < batches:
                ...                  # forward, backward of batch state.batch
                opt.step()
                state.batch += 1
                state.commit()       # what a change of membership rolls back to
            state.epoch, state.batch = state.epoch + 1, 0

    train(state)

What happens at a change: every process of the job learns of it on its next
step, which raises microd.MembershipChangedError (the daemons answer it so,
and apply none of it). run() then rolls the state back to the last commit
(restore), calls the reset callbacks with the new world size, makes every
process hold rank 0's model, optimizer state and extras (sync), and calls
the training function again. A process of a node that joins does the sync
first, with the others, and starts where they are. Rank 0 is node 0's first
process, which an elastic job never loses.
"""
import copy
import functools
import inspect
import io

import torch

import microd
from microd.torch import broadcast_parameters, default_client

__all__ = ["State", "ObjectState", "TorchState", "run"]


class State:
    """What a change of membership rolls back to and hands to new members.
    Subclasses say what: save() (commit), restore() and sync()."""

    def __init__(self, client=None):
        self.client = client or default_client()
        self._reset_callbacks = []
        #: Changes of membership this process went through in run().
        self.resets = 0

    @property
    def rank(self):
        return self.client.rank

    @property
    def world_size(self):
        return self.client.world_size

    def register_reset_callbacks(self, callbacks):
        """Each is called after a change of membership, before the sync, with
        the new world size (or with nothing, if it takes no argument): to
        scale the learning rate, to re-cut a data sampler (state.rank)."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self):
        self.resets += 1
        for callback in self._reset_callbacks:
            try:
                takes_one = bool(inspect.signature(callback).parameters)
            except (TypeError, ValueError):  # a builtin without a signature
                takes_one = True
            if takes_one:
                callback(self.world_size)
            else:
                callback()

    def commit(self):
        """Marks the state to go back to (call it after optimizer.step())."""
        self.save()

    def save(self):
        raise NotImplementedError

    def restore(self):
        raise NotImplementedError

    def sync(self):
        raise NotImplementedError


def _padded(n):
    """A power of two at least n (and 256): few sizes, few broadcast buffers."""
    size = 256
    while size < n:
        size *= 2
    return size


def _broadcast_object(obj, client, root_rank=0):
    """Rank root_rank's `obj` on every process (torch.save's bytes, sent by
    broadcast_parameters: first their length, then the bytes, padded)."""
    length = torch.zeros(1, dtype=torch.int64)
    if client.rank == root_rank:
        out = io.BytesIO()
        torch.save(obj, out)
        data = out.getvalue()
        length[0] = len(data)
    broadcast_parameters([("length", length)], root_rank, client)
    n = int(length.item())
    payload = torch.zeros(_padded(n), dtype=torch.uint8)
    if client.rank == root_rank:
        payload[:n] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    broadcast_parameters([("payload", payload)], root_rank, client)
    if client.rank == root_rank:
        return obj
    return torch.load(io.BytesIO(payload[:n].numpy().tobytes()), weights_only=False)


class ObjectState(State):
    """Picklable values (epoch, batch, ...) as attributes, kept across
    changes: commit() copies them, restore() takes the copy back, sync()
    hands rank 0's to every process."""

    def __init__(self, client=None, **extras):
        super().__init__(client)
        self._names = list(extras)
        for name, value in extras.items():
            setattr(self, name, value)
        self._saved = {}
        ObjectState.save(self)

    def _extras(self):
        return {name: getattr(self, name) for name in self._names}

    def save(self):
        self._saved = copy.deepcopy(self._extras())

    def restore(self):
        for name, value in copy.deepcopy(self._saved).items():
            setattr(self, name, value)

    def sync(self):
        for name, value in _broadcast_object(self._extras(), self.client).items():
            setattr(self, name, value)
        ObjectState.save(self)


class TorchState(ObjectState):
    """A model, an optimizer (DistributedOptimizer or a plain one) and extras."""

    def __init__(self, model=None, optimizer=None, client=None, **extras):
        self.model, self.optimizer = model, optimizer
        self._model_saved = self._optimizer_saved = None
        super().__init__(client, **extras)
        TorchState.save(self)

    def save(self):
        ObjectState.save(self)
        if self.model is not None:
            self._model_saved = copy.deepcopy(self.model.state_dict())
        if self.optimizer is not None:
            self._optimizer_saved = copy.deepcopy(self.optimizer.state_dict())

    def restore(self):
        ObjectState.restore(self)
        if self.model is not None:
            self.model.load_state_dict(self._model_saved)
        if self.optimizer is not None:
            self.optimizer.load_state_dict(self._optimizer_saved)

    def sync(self):
        """Every process takes rank 0's model, optimizer state and extras, and
        commits them."""
        if self.model is not None:
            broadcast_parameters(self.model.state_dict(), 0, self.client)
        if self.optimizer is not None:
            state = _broadcast_object(self.optimizer.state_dict(), self.client)
            if self.rank != 0:
                self.optimizer.load_state_dict(state)
        ObjectState.sync(self)
        TorchState.save(self)


def run(func):
    """Runs func(state, ...) to its end across changes of membership: syncs
    first (every process holds rank 0's state), and after each change rolls
    back to the last commit, calls the reset callbacks, syncs again and
    calls func again. Errors other than a change end it, as they would
    without it."""

    @functools.wraps(func)
    def wrapper(state, *args, **kwargs):
        while True:
            try:
                state.sync()
                return func(state, *args, **kwargs)
            except microd.MembershipChangedError:
                state.restore()
                state.on_reset()

    return wrapper
