# SPDX-License-Identifier: Apache-2.0
"""Fixtures for the Python tests: a local cluster of microd daemons."""
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
BUILD = os.environ.get("MICROD_BUILD_DIR", os.path.join(ROOT, "build"))
MICROD = os.path.join(BUILD, "daemon", "microd")
PYTHON = "/usr/bin/python3"
sys.path.insert(0, os.path.join(ROOT, "client", "python"))
os.environ.setdefault("MICROD_LIBRARY", os.path.join(BUILD, "client", "libmicrod.so"))


def _wait_file(path, proc, timeout=30.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            return open(path).read().strip()
        if proc.poll() is not None:
            raise RuntimeError(f"microd exited with {proc.returncode}")
        time.sleep(0.02)
    raise RuntimeError(f"timed out waiting for {path}")


class Cluster:
    """`nodes` daemons on loopback, `local` training processes each. In
    `args`, "{r}" is the node's rank and "{dir}" the cluster's directory."""

    def __init__(self, nodes, local=1, args=()):
        self.nodes, self.local, self.args = nodes, local, args
        self.dir = tempfile.mkdtemp(prefix="microd-py-")
        self.procs = []
        self.coordinator = None
        for r in range(nodes):
            self._spawn(r, r)
        for r in range(nodes):
            _wait_file(f"{self.dir}/admin{r}", self.procs[r])
        self._await_sockets(range(nodes))

    def _spawn(self, r, rank):
        """Node r's daemon, asking for node rank `rank` (-1: any)."""
        cmd = [MICROD, f"--socket={self.socket(r)}", f"--local_size={self.local}",
               f"--nodes={self.nodes}", f"--node_rank={rank}", f"--node_name=node{r}",
               "--admin=127.0.0.1:0", f"--admin_port_file={self.dir}/admin{r}",
               "--peer_timeout_ms=3000", "--timeout_ms=30000",
               *[a.format(r=r, dir=self.dir) for a in self.args]]
        if r == 0:
            cmd += ["--coordinator_listen=127.0.0.1:0",
                    f"--coordinator_port_file={self.dir}/coordinator"]
        else:
            cmd += [f"--coordinator=127.0.0.1:{self.coordinator}"]
        log = open(os.path.join(self.dir, f"microd{r}.log"), "w")
        self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT))
        if r == 0:
            self.coordinator = _wait_file(f"{self.dir}/coordinator", self.procs[0])

    def _await_sockets(self, nodes):
        deadline = time.time() + 30
        while not all(os.path.exists(self.socket(r)) for r in nodes):
            if time.time() > deadline:
                raise RuntimeError("daemons did not open their sockets")
            time.sleep(0.02)

    def add_node(self):
        """One more daemon (node r, the next index), which dials the running
        job's coordinator for any rank: a node joining an elastic job."""
        r = len(self.procs)
        self._spawn(r, -1)
        _wait_file(f"{self.dir}/admin{r}", self.procs[r])
        self._await_sockets([r])
        return r

    def socket(self, r):
        return os.path.join(self.dir, f"node{r}", "microd.sock")

    def daemon_log(self, r):
        """What node r's daemon has written to its log so far."""
        with open(os.path.join(self.dir, f"microd{r}.log"), errors="replace") as f:
            return f.read()

    def env(self, node, local_rank):
        env = dict(os.environ)
        env["MICROD_SOCKET"] = self.socket(node)
        env["MICROD_LOCAL_RANK"] = str(local_rank)
        env["PYTHONPATH"] = os.path.join(ROOT, "client", "python")
        env["OMP_NUM_THREADS"] = "1"
        return env

    def run(self, script, args, timeout=300):
        """Runs one copy of a Python script per training process; returns outputs."""
        procs = []
        for r in range(self.nodes):
            for l in range(self.local):
                rank = r * self.local + l
                procs.append(subprocess.Popen(
                    [PYTHON, script, *[a.format(rank=rank) for a in args]],
                    env=self.env(r, l), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                    text=True))
        outputs = []
        deadline = time.time() + timeout
        for p in procs:
            try:
                out, _ = p.communicate(timeout=max(1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                for q in procs:
                    q.kill()
                raise
            outputs.append((p.returncode, out))
        return outputs

    def stop(self):
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


@pytest.fixture
def make_cluster():
    made = []

    def make(nodes, local=1, args=()):
        c = Cluster(nodes, local, args)
        made.append(c)
        return c

    yield make
    for c in made:
        c.stop()
