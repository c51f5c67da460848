# SPDX-License-Identifier: Apache-2.0
"""The step timeline (--timeline=FILE, microctl timeline): Chrome trace-event
JSON from a running 2-node cluster; every bucket step one "step" span on its
bucket's track with the phases nested inside it, in order, never
overlapping; as many steps as were run, with the K each step selected."""
import json
import subprocess
import threading
import time

import numpy as np

import microd
from conftest import BUILD

MICROCTL = f"{BUILD}/daemon/microctl"
EPS = 1.0  # microseconds
PHASES = ["waiting", "local_sum", "selection", "exchange", "write_back"]


def run_steps(cluster, steps, buckets=(("big", 100003), ("small", 1000)), stop=None):
    """Every node's process runs `steps` steps, or with `stop` (an Event) on
    until it is set. The processes stop after the same step: the first to
    see `stop` fixes it at one past the most any has completed (they run in
    lockstep, at most one apart), which every one of them can still reach;
    each stopping at its own first look would leave one waiting for a peer
    that had left."""
    errors = []
    progress = [0] * cluster.nodes
    last = []  # [the step every process stops after], set once
    lock = threading.Lock()

    def more(s):
        if s < steps:
            return True
        if stop is None:
            return False
        with lock:
            if not last and stop.is_set():
                last.append(max(progress) + 1)
            return not last or s < last[0]

    def worker(r):
        try:
            with microd.Client(socket_path=cluster.socket(r)) as c:
                bufs = [c.register(name, n) for name, n in buckets]
                rng = np.random.default_rng(r)
                s = 0
                while more(s):
                    for b in bufs:
                        b.array[:] = rng.standard_normal(b.count).astype(np.float32)
                        c.allreduce(b, 30000)
                    s += 1
                    with lock:
                        progress[r] = s
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(cluster.nodes)]
    for t in threads:
        t.start()
    return threads, errors


def join(threads, errors):
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors


def admin(cluster, r):
    return "--admin=127.0.0.1:" + open(f"{cluster.dir}/admin{r}").read().strip()


def tracks(trace, rank):
    """{bucket: [(step span, [phase spans])]} of node `rank`, checking the
    structure on the way: spans nest in their step, phases in order, no
    overlaps on a track."""
    events = trace["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events
             if e["ph"] == "M" and e["name"] == "thread_name"}
    process = [e for e in events if e["ph"] == "M" and e["name"] == "process_name"]
    assert process and process[0]["pid"] == rank
    assert process[0]["args"]["name"].startswith(f"microd node {rank}")
    by_track = {}
    for e in events:
        if e["ph"] != "X":
            continue
        assert e["pid"] == rank
        assert e["dur"] >= 0
        by_track.setdefault(e["tid"], []).append(e)
    out = {}
    for tid, spans in by_track.items():
        steps = []
        # Trace-event order: a step, then its phases.
        for e in spans:
            if e["name"] == "step":
                steps.append((e, []))
            else:
                assert e["name"] in PHASES, e
                steps[-1][1].append(e)
        previous_end = -1.0
        for step, phases in steps:
            begin, end = step["ts"], step["ts"] + step["dur"]
            assert begin >= previous_end - EPS, "steps of one track overlap"
            previous_end = end
            order = [PHASES.index(p["name"]) for p in phases]
            assert order == sorted(order) and len(set(order)) == len(order), order
            cursor = begin
            for p in phases:
                assert p["ts"] >= cursor - EPS, (step, p)  # in order, no overlap
                cursor = p["ts"] + p["dur"]
                assert cursor <= end + EPS, (step, p)  # nested in the step
        out[names[tid]] = steps
    return out


def test_timeline_file_counts_every_step(make_cluster):
    steps = 6
    cluster = make_cluster(2, 1, ["--timeline={dir}/timeline{r}.json", "--timeline_flush_s=0.2",
                                  "--stats_history=100"])
    join(*run_steps(cluster, steps))
    history = {}
    for r in range(2):
        out = subprocess.run([MICROCTL, admin(cluster, r), "--json", "--history", "status"],
                             capture_output=True, text=True, check=True).stdout
        history[r] = {b["name"]: b for b in json.loads(out)["buckets"]}
    cluster.stop()  # the file's last write
    for r in range(2):
        trace = json.load(open(f"{cluster.dir}/timeline{r}.json"))
        assert trace["otherData"]["node_rank"] == r
        assert trace["otherData"]["steps_recorded"] == 2 * steps
        assert trace["otherData"]["steps_overwritten"] == 0
        assert trace["otherData"]["record_ns_per_step"] > 0
        by_bucket = tracks(trace, r)
        assert set(by_bucket) == {"big", "small"}
        for name, spans in by_bucket.items():
            assert [s["args"]["step"] for s, _ in spans] == list(range(steps))
            assert len(spans) == int(history[r][name]["steps"]) == steps
        # The sparse bucket: every phase; K and CRE as microctl's history has them.
        want = {int(h["step"]): h for h in history[r]["big"]["history"]}
        for step, phases in by_bucket["big"]:
            assert step["cat"] == "sparse"
            assert [p["name"] for p in phases] == PHASES
            h = want[step["args"]["step"]]
            assert step["args"]["K"] == int(h["selected"])
            assert abs(step["args"]["threshold"] - h["threshold"]) <= 1e-5 * h["threshold"]
            assert step["args"]["k"] == int(h["budget"])
            assert abs(step["args"]["cre"] - h["cre"]) <= 1e-5 * max(1.0, h["cre"])
        # The dense bucket (fused or in the cycle): no selection.
        for step, phases in by_bucket["small"]:
            assert step["cat"] == "dense"
            assert step["args"]["elements"] == 1000
            assert [p["name"] for p in phases] == ["waiting", "local_sum", "exchange",
                                                    "write_back"]


def test_timeline_ring_keeps_the_last_sampled_steps(make_cluster):
    cluster = make_cluster(1, 1, ["--timeline={dir}/timeline.json", "--timeline_steps=4",
                                  "--timeline_every=2"])
    join(*run_steps(cluster, 10, buckets=(("big", 100003),)))
    cluster.stop()
    trace = json.load(open(f"{cluster.dir}/timeline.json"))
    # Steps 0, 2, 4, 6, 8 sampled; the ring keeps the last four.
    assert trace["otherData"]["steps_recorded"] == 5
    assert trace["otherData"]["steps_overwritten"] == 1
    assert [s["args"]["step"] for s, _ in tracks(trace, 0)["big"]] == [2, 4, 6, 8]


def test_microctl_timeline_captures_a_window(make_cluster, tmp_path):
    cluster = make_cluster(2, 1)  # no --timeline: nothing is recorded outside a capture
    out = tmp_path / "trace.json"
    nothing = subprocess.run([MICROCTL, admin(cluster, 1), "timeline", "--seconds=0",
                              f"--out={out}"], capture_output=True, text=True)
    assert nothing.returncode == 0, nothing.stderr
    assert "0 steps" in nothing.stdout
    stop = threading.Event()
    threads, errors = run_steps(cluster, 1, stop=stop)
    try:
        time.sleep(0.5)
        begin = time.time()
        got = subprocess.run([MICROCTL, admin(cluster, 1), "timeline", "--seconds=1.5",
                              f"--out={out}"], capture_output=True, text=True, timeout=60)
        end = time.time()
    finally:
        stop.set()
        join(threads, errors)
    assert got.returncode == 0, got.stderr
    trace = json.load(open(out))
    by_bucket = tracks(trace, 1)
    assert set(by_bucket) == {"big", "small"}
    n = sum(len(v) for v in by_bucket.values())
    assert f"{n} steps in {out}" in got.stdout
    for spans in by_bucket.values():
        for step, _ in spans:  # every step began inside the window
            assert begin - 0.1 <= step["ts"] / 1e6 <= end + 0.1
        numbers = [s["args"]["step"] for s, _ in spans]
        assert numbers == list(range(numbers[0], numbers[0] + len(numbers)))


def test_microctl_timeline_refuses_bad_requests(make_cluster):
    cluster = make_cluster(1, 1)
    no_out = subprocess.run([MICROCTL, admin(cluster, 0), "timeline"], capture_output=True,
                            text=True)
    assert no_out.returncode == 2 and "--out" in no_out.stderr
    too_long = subprocess.run([MICROCTL, admin(cluster, 0), "timeline", "--seconds=4000",
                               "--out=/dev/null"], capture_output=True, text=True)
    assert too_long.returncode == 2 and "--seconds" in too_long.stderr


def test_timeline_file_that_cannot_be_written_stops_the_daemon():
    got = subprocess.run([f"{BUILD}/daemon/microd", "--nodes=1",
                          "--coordinator_listen=127.0.0.1:0", "--admin=127.0.0.1:0",
                          "--socket=/tmp/microd-timeline-test.sock",
                          "--timeline=/nonexistent/dir/trace.json"],
                         capture_output=True, text=True, timeout=30)
    assert got.returncode == 1
    assert "--timeline" in got.stderr and "/nonexistent/dir/trace.json" in got.stderr
