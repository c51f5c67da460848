# SPDX-License-Identifier: Apache-2.0
"""deploy/netlab/netlab.sh: the emulated cluster does what it says.

Namespaces, addresses and clean-up; rate, delay and loss measured through
the links with deploy/netlab/probe.py; cuts and partitions; bad input. Needs
root (network namespaces): skipped, and reported so, without it.
"""
import json
import os
import pathlib
import re
import subprocess
import sys
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
NETLAB = str(ROOT / "deploy" / "netlab" / "netlab.sh")
PROBE = str(ROOT / "deploy" / "netlab" / "probe.py")
PY = sys.executable

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")


def netlab(*args, check=True, timeout=60):
    r = subprocess.run([NETLAB, *args], capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"netlab.sh {' '.join(args)} failed ({r.returncode}): {r.stderr}")
    return r


def namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def of_lab(name):
    """The namespaces of one lab (other tests may make labs at the same time)."""
    return {ns for ns in namespaces() if ns.startswith(name + "-")}


def root_links():
    out = subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout
    return sorted(line.split(":")[1].strip() for line in out.splitlines())


@pytest.fixture
def lab():
    made = []

    def make(*args):
        name = netlab("up", "--owner", str(os.getpid()), *args).stdout.strip()
        made.append(name)
        return name

    yield make
    for name in made:
        netlab("down", name, check=False)


def in_node(name, node, *cmd, timeout=60, check=True):
    return subprocess.run([NETLAB, "exec", name, str(node), "--", *cmd], capture_output=True,
                          text=True, timeout=timeout, check=check)


def probe(name, a, b, nbytes=1000, pings=20, timeout=10.0, port=5201):
    """Round trip and throughput from node a to node b (None when nothing got through)."""
    server = subprocess.Popen([NETLAB, "exec", name, str(b), "--", PY, PROBE, "serve", "--port",
                               str(port), "--timeout", str(timeout)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        addr = netlab("addr", name, str(b)).stdout.strip()
        r = in_node(name, a, PY, PROBE, "measure", "--host", addr, "--port", str(port),
                    "--bytes", str(nbytes), "--pings", str(pings), "--timeout", str(timeout),
                    timeout=3 * timeout + 30, check=False)
        return json.loads(r.stdout) if r.returncode == 0 else None
    finally:
        server.kill()
        server.wait()


def test_up_makes_its_own_namespaces_and_down_removes_them(lab):
    before_links = root_links()
    a = lab("--nodes", "3")
    b = lab("--nodes", "2")
    assert a != b
    assert of_lab(a) == {f"{a}-br", f"{a}-n0", f"{a}-n1", f"{a}-n2"}
    assert of_lab(b) == {f"{b}-br", f"{b}-n0", f"{b}-n1"}
    addrs_a = [netlab("addr", a, str(r)).stdout.strip() for r in range(3)]
    addrs_b = [netlab("addr", b, str(r)).stdout.strip() for r in range(2)]
    assert len(set(addrs_a)) == 3
    # Different subnets per lab, so that two runs never share an address.
    assert {x.rsplit(".", 1)[0] for x in addrs_a}.isdisjoint({x.rsplit(".", 1)[0] for x in addrs_b})
    # Each node has exactly its own address on its link.
    shown = in_node(a, 1, "ip", "-4", "-o", "addr", "show", "dev", "eth0").stdout
    assert f"inet {addrs_a[1]}/24" in shown
    # Nothing in the machine's own namespace changed.
    assert root_links() == before_links
    assert probe(a, 0, 2) is not None
    netlab("down", a)
    netlab("down", b)
    assert not of_lab(a) and not of_lab(b)
    listed = netlab("list").stdout.split()
    assert a not in listed and b not in listed


def test_a_lab_whose_owner_died_is_removed():
    owner = subprocess.Popen(["sleep", "60"])
    name = netlab("up", "--nodes", "2", "--owner", str(owner.pid)).stdout.strip()
    assert f"{name}-n0" in namespaces()
    owner.kill()
    owner.wait()
    for _ in range(100):
        if not any(ns.startswith(name) for ns in namespaces()):
            break
        time.sleep(0.1)
    assert not any(ns.startswith(name) for ns in namespaces())
    assert name not in netlab("list").stdout.split()


def test_down_stops_the_processes_running_in_the_lab(lab):
    name = lab("--nodes", "2")
    proc = subprocess.Popen([NETLAB, "exec", name, "1", "--", "sleep", "60"])
    time.sleep(0.3)
    netlab("down", name)
    assert proc.wait(timeout=10) != 0


def test_rate_limits_what_a_link_carries(lab):
    name = lab("--nodes", "2", "--rate", "100mbit")
    r = probe(name, 0, 1, nbytes=10_000_000, timeout=30)
    assert r is not None
    # 100 Mbit/s is 12.5 MB/s: 10 MB cannot take much less than 0.8 s.
    assert r["mb_per_s"] < 12.5 * 1.15, r
    # Faster once changed while the lab runs.
    netlab("shape", name, "all", "--rate", "1gbit")
    fast = probe(name, 0, 1, nbytes=20_000_000, timeout=30)
    assert fast is not None and fast["mb_per_s"] > 2 * r["mb_per_s"], (r, fast)
    assert fast["mb_per_s"] < 125 * 1.15, fast


def test_delay_is_one_way_per_link_and_changes_while_running(lab):
    name = lab("--nodes", "2", "--delay", "5ms")
    r = probe(name, 0, 1, pings=20)
    assert r is not None
    # Each node's ingress adds 5 ms: a round trip has both.
    assert r["rtt_ms_median"] >= 9.5, r
    netlab("shape", name, "1", "--delay", "0")
    r = probe(name, 0, 1, pings=20)
    assert 4.5 <= r["rtt_ms_median"] < 9.5, r
    netlab("shape", name, "all", "--delay", "0", "--jitter", "0")
    r = probe(name, 0, 1, pings=20)
    assert r["rtt_ms_median"] < 4.5, r


UDP_SINK = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind(("0.0.0.0", 5300)); s.settimeout(3)
n = 0
try:
    while True:
        s.recv(100); n += 1
except socket.timeout:
    pass
print(n)
"""
UDP_SOURCE = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(2000):
    s.sendto(b"x", (sys.argv[1], 5300))
    if i % 100 == 0: time.sleep(0.001)
"""


def test_loss_drops_that_share_of_the_packets(lab):
    name = lab("--nodes", "2", "--loss", "30%")
    sink = subprocess.Popen([NETLAB, "exec", name, "1", "--", PY, "-c", UDP_SINK],
                            stdout=subprocess.PIPE, text=True)
    time.sleep(0.5)
    in_node(name, 0, PY, "-c", UDP_SOURCE, netlab("addr", name, "1").stdout.strip())
    got = int(sink.communicate(timeout=30)[0])
    # 2,000 datagrams, 30 % lost: about 1,400 arrive (the bounds are > 10 sigma).
    assert 1100 < got < 1700, got


def test_cut_and_partition_silence_links_until_healed(lab):
    name = lab("--nodes", "3")
    assert probe(name, 0, 1) is not None
    netlab("cut", name, "1")
    assert probe(name, 0, 1, timeout=2) is None
    assert probe(name, 2, 0) is not None  # the others still talk
    assert "CUT" in netlab("show", name).stdout
    netlab("heal", name)
    assert probe(name, 0, 1) is not None
    netlab("partition", name, "0", "1,2")
    assert probe(name, 0, 2, timeout=2) is None
    assert probe(name, 1, 0, timeout=2) is None
    assert probe(name, 1, 2) is not None
    netlab("heal", name)
    assert probe(name, 2, 0) is not None


def test_bad_input_is_an_error_and_leaves_nothing_behind():
    r = netlab("up", "--nodes", "2", "--rate", "fast", check=False)
    assert r.returncode != 0 and "bad rate 'fast'" in r.stderr
    # The lab it had begun is gone (namespaces and state).
    failed = re.search(r"making lab (mdl[0-9a-f]{6}) failed", r.stderr)
    assert failed, r.stderr
    assert not of_lab(failed.group(1))
    assert failed.group(1) not in netlab("list").stdout.split()
    r = netlab("up", "--nodes", "0", check=False)
    assert r.returncode != 0 and "--nodes" in r.stderr
    r = netlab("shape", "mdl000000", "all", "--rate", "1gbit", check=False)
    assert r.returncode != 0 and "no lab named" in r.stderr
    r = netlab("down", "../etc", check=False)
    assert r.returncode != 0 and "not a lab name" in r.stderr
    r = netlab("frobnicate", check=False)
    assert r.returncode != 0 and "unknown command" in r.stderr


def test_node_out_of_range_is_an_error(lab):
    name = lab("--nodes", "2")
    r = netlab("cut", name, "2", check=False)
    assert r.returncode != 0 and "not in [0, 2)" in r.stderr
    r = netlab("shape", name, "all", "--delay", "soon", check=False)
    assert r.returncode != 0 and "bad time 'soon'" in r.stderr


def test_launcher_runs_every_node_in_its_own_namespace():
    """deploy/local/launch.sh --net-rate: daemons and program copies in their
    nodes' namespaces, each copy on its node's address, the job done, and the
    lab it made gone afterwards."""
    build = pathlib.Path(os.environ.get("MICROD_BUILD_DIR", ROOT / "build"))
    script = ('echo "addr $(ip -4 -o addr show dev eth0 | awk \'{print $4}\') '
              'node $MICROD_NODE_ADDR master $MICROD_MASTER_ADDR"; exec "$0"')
    logs = pathlib.Path(subprocess.run(["mktemp", "-d"], capture_output=True, text=True,
                                       check=True).stdout.strip())
    r = subprocess.run([str(ROOT / "deploy" / "local" / "launch.sh"), "--nodes", "3", "--local", "2",
                        "--net-rate", "1gbit", "--net-delay=0.1ms", "--logs", str(logs),
                        "--microd", str(build / "daemon" / "microd"), "--", "sh", "-c", script,
                        str(build / "client" / "microd-example")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "daemons up on emulated network" in r.stderr
    masters = set()
    for node in range(3):
        for local in range(2):
            out = (logs / f"program-node{node}-local{local}.log").read_text()
            first = out.splitlines()[0].split()
            assert first[1] == first[3] + "/24", out  # eth0 carries the node's own address
            masters.add(first[5])
            # 6 processes, ranks 0..5 contribute rank + 1: the average is 3.5.
            assert "first value of the averaged update 3.5" in out, out
    assert len(masters) == 1
    daemon0 = (logs / "microd-node0.log").read_text()
    assert f"data plane on {masters.pop()} " in daemon0, daemon0
    made = re.search(r"emulated network (mdl[0-9a-f]{6})", r.stderr).group(1)
    assert not of_lab(made)  # the lab the launcher made is gone
