# SPDX-License-Identifier: Apache-2.0
"""The ctypes binding: statuses map to exceptions, buffers are zero-copy
views, and a dead daemon gives a clear error instead of a hang."""
import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

import microd
from conftest import BUILD, PYTHON


def test_every_status_has_its_exception_class():
    for status in microd.Status:
        if status == microd.Status.OK:
            continue
        err = microd._error(int(status), b"message")
        assert isinstance(err, microd.MicrodError)
        assert err.status == status
        assert err.message == "message"
        assert type(err) is not microd.MicrodError
    assert isinstance(microd._error(5, b"x"), microd.JobFailedError)
    assert isinstance(microd._error(4, b"x"), microd.MismatchError)


def test_no_daemon_is_unavailable_quickly():
    start = time.time()
    with pytest.raises(microd.UnavailableError) as info:
        microd.Client(socket_path="/nonexistent/microd.sock", timeout_ms=200)
    assert time.time() - start < 3
    assert "/nonexistent/microd.sock" in str(info.value)


def test_register_allreduce_and_errors(make_cluster):
    cluster = make_cluster(1)
    with microd.Client(socket_path=cluster.socket(0)) as c:
        assert (c.rank, c.world_size, c.local_size) == (0, 1, 1)
        with pytest.raises(microd.InvalidArgumentError):
            c.register("empty", 0)
        with pytest.raises(microd.InvalidArgumentError):
            c.register("huge", 1 << 32)
        buf = c.register("w", 1000)
        with pytest.raises(microd.InvalidArgumentError):
            c.register("w", 1000)
        buf.array[:] = np.arange(1000, dtype=np.float32)
        c.allreduce(buf, 30000)
        np.testing.assert_array_equal(buf.array, np.arange(1000, dtype=np.float32))
        # The torch view shares the memory; an attribute, as CudaBuffer.tensor.
        t = buf.tensor
        assert buf.tensor is t
        t[0] = 42.0
        assert buf.array[0] == 42.0
        buf.array[5] = math.nan
        with pytest.raises(microd.NonFiniteError) as info:
            c.allreduce(buf, 30000)
        assert "'w'" in str(info.value)
        buf.array[5] = 1.0
        c.allreduce(buf, 30000)


def test_nonfinite_skip_gives_a_zero_update_and_is_counted(make_cluster):
    cluster = make_cluster(2, 1, ["--nonfinite=skip"])
    # Two processes, one per node, in threads of this test (one client each).
    import threading
    results = {}

    def worker(r):
        with microd.Client(socket_path=cluster.socket(r)) as c:
            buf = c.register("w", 100)
            # A first step through the coordinator; the later ones are agreed
            # in the response cache's cycles (this small dense bucket rides
            # in them, except from the node that sees the NaN).
            buf.array[:] = float(r + 1)
            c.allreduce(buf, 30000)
            results[(r, "first")] = buf.array.copy()
            buf.array[:] = 1.0
            if r == 1:
                buf.array[7] = math.nan
            c.allreduce(buf, 30000)  # no exception: skipped
            results[r] = buf.array.copy()
            buf.array[:] = float(r)
            c.allreduce(buf, 30000)  # the next step runs normally
            results[(r, "next")] = buf.array.copy()

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for r in range(2):
        np.testing.assert_array_equal(results[(r, "first")], np.full(100, 1.5, np.float32))
        np.testing.assert_array_equal(results[r], np.zeros(100, np.float32))
        np.testing.assert_array_equal(results[(r, "next")], np.full(100, 0.5, np.float32))
    admin = open(f"{cluster.dir}/admin0").read().strip()
    out = subprocess.run([f"{BUILD}/daemon/microctl", f"--admin=127.0.0.1:{admin}", "--json",
                          "buckets"], capture_output=True, text=True, check=True).stdout
    bucket = json.loads(out)["buckets"][0]
    assert bucket["skippedSteps"] == "1"
    assert bucket["steps"] == "2"
    # The last step rode in the cycle; the NaN step took the fused path.
    status = json.loads(subprocess.run([f"{BUILD}/daemon/microctl", f"--admin=127.0.0.1:{admin}",
                                        "--json", "status"], capture_output=True, text=True,
                                       check=True).stdout)
    assert status["cycleReductions"] == "1"


def test_waiting_time_shows_which_node_was_late(make_cluster):
    """microctl's per-bucket waiting time (ready on this node until its step
    starts) is the time a node spent waiting for the others: the node whose
    process submitted a second late barely waits, the other waits that second."""
    cluster = make_cluster(2, 1)
    import threading

    def worker(r):
        with microd.Client(socket_path=cluster.socket(r)) as c:
            buf = c.register("w", 100)
            if r == 1:
                time.sleep(1.0)
            c.allreduce(buf, 30000)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    waits = []
    for r in range(2):
        admin = open(f"{cluster.dir}/admin{r}").read().strip()
        out = subprocess.run([f"{BUILD}/daemon/microctl", f"--admin=127.0.0.1:{admin}", "--json",
                              "buckets"], capture_output=True, text=True, check=True).stdout
        bucket = json.loads(out)["buckets"][0]
        assert bucket["steps"] == "1"
        waits.append(float(bucket.get("negotiateSeconds", 0)))
    assert waits[0] >= 0.8, waits
    assert waits[1] < 0.5, waits


FAKE_LIBCUDA = os.path.join(BUILD, "tests", "libmicrod-test-fake-libcuda.so")


def test_cuda_buffers_are_checked_and_reach_the_daemon(make_cluster, monkeypatch):
    """register_cuda without a GPU, over the stand-in CUDA driver the C tests
    use: what is not float32 CUDA memory is refused before the C library,
    a missing driver is named, and a device allocation reaches the daemon,
    which answers for itself (no GPU here); the name stays free and host
    buffers take no stream."""
    import ctypes
    import torch
    cluster = make_cluster(1)
    with microd.Client(socket_path=cluster.socket(0)) as c:
        with pytest.raises(microd.InvalidArgumentError, match="not a CUDA device"):
            c.register_cuda("g", torch.zeros(8))
        with pytest.raises(microd.InvalidArgumentError, match="CUDA tensor or a device pointer"):
            c.register_cuda("g", np.zeros(8, np.float32))
        with pytest.raises(microd.InvalidArgumentError, match="positive element count"):
            c.register_cuda("g", 0x1000)
        monkeypatch.setenv("MICROD_LIBCUDA", "/nonexistent/libcuda.so.1")
        with pytest.raises(microd.UnsupportedError, match="/nonexistent/libcuda.so.1"):
            c.register_cuda("g", 0x1000, count=8)
        monkeypatch.setenv("MICROD_LIBCUDA", FAKE_LIBCUDA)
        fake = ctypes.CDLL(FAKE_LIBCUDA)
        memory = np.zeros(64, np.float32)
        fake.fake_cuda_add_allocation(ctypes.c_void_p(memory.ctypes.data),
                                      ctypes.c_size_t(memory.nbytes), 0)
        with pytest.raises(microd.UnsupportedError) as info:
            c.register_cuda("g", memory.ctypes.data, count=64)
        # The daemon's own reason (a CPU build, or no usable GPU) comes back.
        assert "this microd cannot take CUDA buffers" in info.value.message, info.value.message
        assert "'g'" in info.value.message
        assert "g" not in c.buffers
        buf = c.register("g", 8)  # nothing was registered under the name
        with pytest.raises(microd.InvalidArgumentError, match="host buffer"):
            c.allreduce_async(buf, stream=1)
        buf.array[:] = 3.0
        c.allreduce(buf, 20000)
        np.testing.assert_array_equal(buf.array, np.full(8, 3.0, np.float32))


def test_dead_daemon_is_a_clear_error_not_a_hang(make_cluster):
    cluster = make_cluster(1)
    c = microd.Client(socket_path=cluster.socket(0))
    buf = c.register("w", 100)
    c.allreduce(buf, 30000)
    cluster.procs[0].kill()
    cluster.procs[0].wait()
    start = time.time()
    with pytest.raises(microd.UnavailableError) as info:
        c.allreduce(buf, 30000)
    assert time.time() - start < 5
    assert "daemon" in str(info.value)
    c.close()
    with pytest.raises(microd.ClosedError):
        c.allreduce(buf)


ELASTIC_TRAINER = r"""
import sys, time
import microd
c = microd.Client(timeout_ms=30000)
buf = c.register("g", 100000)
seed, pause_at, changes, step = c.rank, int(sys.argv[1]), [], 0
while step < 8:
    if seed == 2 and step == pause_at:
        print("PAUSED", flush=True)
        time.sleep(600)
    buf.array[:] = seed + 1 + step
    try:
        c.allreduce(buf, 60000)
    except microd.MembershipChangedError as e:
        changes.append((step, e.epoch, e.rank, e.world_size, c.epoch, c.rank, c.world_size))
        continue  # the same step again, in the new membership
    step += 1
print("CHANGES", changes, flush=True)
"""


def test_an_elastic_job_goes_on_without_a_lost_node(make_cluster, tmp_path):
    # 3 nodes, at least 2: node 2 is lost before step 4 (its trainer stops,
    # then its daemon is killed); the others' step 4 raises
    # MembershipChangedError with their place in epoch 1, and they finish.
    cluster = make_cluster(3, args=("--min_nodes=2",))
    script = tmp_path / "elastic.py"
    script.write_text(ELASTIC_TRAINER)
    procs = [subprocess.Popen([sys.executable, str(script), "4"], env=cluster.env(r, 0),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for r in range(3)]
    assert procs[2].stdout.readline().strip() == "PAUSED"
    cluster.procs[2].kill()
    procs[2].kill()
    procs[2].wait()
    for r in (0, 1):
        out, _ = procs[r].communicate(timeout=60)
        assert procs[r].returncode == 0, out
        assert f"CHANGES [(4, 1, {r}, 2, 1, {r}, 2)]" in out, out


def test_microctl_history_lists_every_sparse_step(make_cluster):
    cluster = make_cluster(1, args=("--dense_floor=16", "--density=0.1", "--stats_history=3"))
    c = microd.Client(socket_path=cluster.socket(0))
    buf = c.register("grads", 1000)
    for step in range(5):
        buf.array[:] = np.arange(1000, dtype=np.float32) + step
        c.allreduce(buf, 30000)
    admin = open(f"{cluster.dir}/admin0").read().strip()
    microctl = [f"{BUILD}/daemon/microctl", f"--admin=127.0.0.1:{admin}"]
    out = subprocess.run(microctl + ["history", "grads"], capture_output=True, text=True,
                         check=True).stdout
    lines = out.splitlines()
    assert lines[0].startswith("grads (1000 elements, last 3 sparse steps)")
    # The last 3 of the 5 steps (0-based), each with K and k = 100.
    assert [line.split()[0] for line in lines[2:]] == ["2", "3", "4"]
    assert all(line.split()[2] == "100" for line in lines[2:])
    data = json.loads(subprocess.run(microctl + ["--json", "--history", "buckets"],
                                     capture_output=True, text=True, check=True).stdout)
    assert [h["step"] for h in data["buckets"][0]["history"]] == ["2", "3", "4"]
    plain = json.loads(subprocess.run(microctl + ["--json", "buckets"], capture_output=True,
                                      text=True, check=True).stdout)
    assert plain["buckets"][0]["history"] == []  # only when asked for
    missing = subprocess.run(microctl + ["history", "nope"], capture_output=True, text=True)
    assert missing.returncode == 1 and "no bucket named 'nope'" in missing.stderr
    c.close()


def test_timeout_error_is_microds_and_the_builtin():
    """Issue L: microd.TimeoutError shadowed the built-in; MicrodTimeoutError
    is both a MicrodError and a built-in TimeoutError (the old name stays)."""
    import builtins
    assert issubclass(microd.MicrodTimeoutError, microd.MicrodError)
    assert issubclass(microd.MicrodTimeoutError, builtins.TimeoutError)
    assert microd.TimeoutError is microd.MicrodTimeoutError
    assert "TimeoutError" not in microd.__all__
