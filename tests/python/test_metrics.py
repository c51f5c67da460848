# SPDX-License-Identifier: Apache-2.0
"""Prometheus metrics (--metrics): /metrics scraped over HTTP from a running
2-node cluster, in the Prometheus text format, every value checked against
what microctl --json says of the same daemon."""
import json
import math
import re
import socket
import subprocess
import threading
import urllib.request

import numpy as np

import microd
from conftest import BUILD

STEPS = 5
LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$')


def scrape(port):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"].startswith("text/plain")
        text = r.read().decode()
    samples, types = {}, {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            types[name] = kind
            continue
        if not line or line.startswith("#"):
            continue
        m = LINE.match(line)
        assert m, f"not a Prometheus sample line: {line!r}"
        labels = frozenset(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', m.group(2) or ""))
        samples[(m.group(1), labels)] = float(m.group(3))
    return samples, types


def microctl(cluster, r):
    admin = open(f"{cluster.dir}/admin{r}").read().strip()
    out = subprocess.run([f"{BUILD}/daemon/microctl", f"--admin=127.0.0.1:{admin}", "--json",
                          "status"], capture_output=True, text=True, check=True).stdout
    return json.loads(out)


def test_metrics_match_microctl(make_cluster):
    cluster = make_cluster(2, 1, ["--metrics=127.0.0.1:0", "--metrics_port_file={dir}/metrics{r}"])
    errors = []

    def worker(r):
        try:
            with microd.Client(socket_path=cluster.socket(r)) as c:
                big = c.register("big", 100003)
                small = c.register("small", 1000)
                rng = np.random.default_rng(r)
                for _ in range(STEPS):
                    big.array[:] = rng.standard_normal(big.count).astype(np.float32)
                    small.array[:] = 1.0
                    c.allreduce(big, 30000)
                    c.allreduce(small, 30000)
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for r in range(2):
        port = int(open(f"{cluster.dir}/metrics{r}").read())
        samples, types = scrape(port)
        status = microctl(cluster, r)

        def one(name, **labels):
            return samples[(name, frozenset(labels.items()))]

        assert types["microd_bucket_steps_total"] == "counter"
        assert types["microd_bucket_step_seconds"] == "histogram"
        assert types["microd_bucket_cre"] == "histogram"
        assert one("microd_job_state", state="running") == 1
        assert one("microd_job_state", state="failed") == 0
        assert one("microd_nodes") == 2
        assert one("microd_world_size") == 2
        assert one("microd_node_rank") == r
        assert one("microd_stalls") == 0
        assert one("microd_build_info", version=status["version"], transport="gloo",
                   sparsifier="micro", controller="hist") == 1
        assert one("microd_batches_total", kind="schedule") == int(status["batches"])
        assert one("microd_batches_total", kind="cache") == int(status["cacheBatches"])
        assert one("microd_transport_scratch_bytes") == int(status.get("transportScratchBytes", 0))
        by_name = {b["name"]: b for b in status["buckets"]}
        assert set(by_name) == {"big", "small"}
        # The daemon's memory for each: a sparse bucket's residual and
        # more; the small dense one (no momentum correction) keeps nothing.
        assert int(by_name["big"]["stateBytes"]) >= 4 * 100003
        assert int(by_name["small"].get("stateBytes", 0)) == 0
        for name, b in by_name.items():
            assert one("microd_bucket_steps_total", bucket=name) == int(b["steps"]) == STEPS
            assert one("microd_bucket_elements", bucket=name) == int(b["count"])
            assert one("microd_bucket_selected", bucket=name) == int(b["lastSelected"])
            assert one("microd_bucket_budget", bucket=name) == int(b["budget"])
            assert one("microd_bucket_sent_bytes_total", bucket=name) == int(b["bytesSent"])
            assert one("microd_bucket_received_bytes_total", bucket=name) == int(b["bytesReceived"])
            assert one("microd_bucket_state_bytes", bucket=name) == int(b.get("stateBytes", 0))
            assert math.isclose(one("microd_bucket_threshold", bucket=name), b["lastThreshold"],
                                rel_tol=1e-6)
            assert math.isclose(one("microd_bucket_last_cre", bucket=name), b["lastCre"],
                                rel_tol=1e-6)
            assert one("microd_bucket_failures_total", bucket=name, cause="step") == 0
            # Every step observed once per phase; the sums are microctl's time split.
            for phase, field in (("local_sum", "localSumSeconds"), ("exchange", "exchangeSeconds"),
                                 ("write_back", "writebackSeconds"),
                                 ("waiting", "negotiateSeconds")):
                assert one("microd_bucket_step_seconds_count", bucket=name, phase=phase) == STEPS
                assert math.isclose(one("microd_bucket_step_seconds_sum", bucket=name, phase=phase),
                                    b[field], rel_tol=1e-6, abs_tol=1e-9), (name, phase)
                inf = one("microd_bucket_step_seconds_bucket", bucket=name, phase=phase, le="+Inf")
                assert inf == STEPS
        # The sparse bucket's CRE from step 2 on: STEPS - 2 observations.
        assert one("microd_bucket_cre_count", bucket="big") == STEPS - 2
        assert one("microd_bucket_step_seconds_count", bucket="big", phase="selection") == STEPS
        assert one("microd_bucket_cre_count", bucket="small") == 0


def test_idle_connections_do_not_stop_the_scrapes(make_cluster):
    """Connections that send nothing are closed after a short timeout and
    several threads serve: before, one idle connection held the exporter's
    only thread for 30 s and every scrape timed out behind it."""
    cluster = make_cluster(1, 1, ["--metrics=127.0.0.1:0", "--metrics_port_file={dir}/metrics{r}"])
    port = int(open(f"{cluster.dir}/metrics0").read())
    idle = [socket.create_connection(("127.0.0.1", port), timeout=5) for _ in range(8)]
    try:
        samples, _ = scrape(port)  # 10 s timeout
        assert any(name == "microd_nodes" for name, _ in samples)
    finally:
        for s in idle:
            s.close()
