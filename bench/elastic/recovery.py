# SPDX-License-Identifier: Apache-2.0
"""How long an elastic job takes to go on without a lost node, and to take
in a new one, on an emulated network (deploy/netlab; needs root): 3 nodes
in namespaces of their own with links of the given round trip, --min_nodes=2
--max_nodes=3, one training process each stepping a 1 M-float bucket with
20 ms of "compute" per step. Node 2's process stops and its daemon is killed
(SIGKILL); then a new node's daemon is started in a fourth namespace and its
process steps with the others. Printed for each round trip and peer
timeout, beside the targets: from the kill to the survivors' next step
completed (target: the peer timeout + 2 s), with each survivor's own account
(last_recovery_seconds: from the first sign to the new epoch running), and
from the new daemon's start to its process's first step completed (target:
5 s).

    /usr/bin/python3 bench/elastic/recovery.py --build build --rtts 0,10,50 --peer-timeouts 3000,10000
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
NETLAB = os.path.join(ROOT, "deploy", "netlab", "netlab.sh")
PYTHON = "/usr/bin/python3"

TRAINER = r"""
import os, sys, time
import microd
c = microd.Client(timeout_ms=30000)
buf = c.register("g", 1 << 20)
pause_at, stop_file, step, first = int(sys.argv[1]), sys.argv[2], 0, True
while not os.path.exists(stop_file):
    if step == pause_at:
        print("PAUSED", flush=True)
        time.sleep(3600)
    time.sleep(0.02)  # the step's compute
    buf.array[:] = c.rank + 1 + step
    try:
        c.allreduce(buf, 120000)
    except microd.MembershipChangedError:
        print("CHANGED", time.time(), flush=True)
        continue
    print("STEP", step, time.time(), flush=True)
    step += 1
"""


def netlab(*args):
    r = subprocess.run([NETLAB, *args], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise SystemExit(f"recovery.py: netlab.sh {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout.strip()


def wait_for(predicate, timeout, what):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise SystemExit(f"recovery.py: timed out waiting for {what}")


def one(build, rtt_ms, peer_timeout_ms, pause_at=20):
    d = tempfile.mkdtemp(prefix="microd-elastic-")
    os.chmod(d, 0o755)
    shape = ["--delay", f"{rtt_ms / 2:g}ms"] if rtt_ms > 0 else []
    lab = netlab("up", "--nodes", "4", "--owner", str(os.getpid()), "--rate", "1gbit", *shape)
    addr = [netlab("addr", lab, str(r)) for r in range(4)]
    ns = [netlab("ns", lab, str(r)) for r in range(4)]
    daemons, trainers, outs = {}, {}, {}
    token, stop = f"{d}/token", f"{d}/stop"
    with open(token, "w") as f:
        f.write(os.urandom(16).hex() + "\n")
    with open(f"{d}/trainer.py", "w") as f:
        f.write(TRAINER)

    def daemon(r):
        cmd = [os.path.join(build, "daemon", "microd"), f"--socket={d}/node{r}/microd.sock",
               "--nodes=3", "--min_nodes=2", "--max_nodes=3", f"--node_name=node{r}",
               f"--node_rank={r if r < 3 else -1}", f"--admin=unix:{d}/admin{r}",
               f"--token_file={token}", f"--peer_timeout_ms={peer_timeout_ms}",
               "--timeout_ms=60000"]
        cmd.append(f"--coordinator_listen={addr[0]}:7470" if r == 0
                   else f"--coordinator={addr[0]}:7470")
        daemons[r] = subprocess.Popen(["ip", "netns", "exec", ns[r], *cmd],
                                      stdout=open(f"{d}/microd{r}.log", "w"),
                                      stderr=subprocess.STDOUT)

    def trainer(r):
        env = dict(os.environ, MICROD_SOCKET=f"{d}/node{r}/microd.sock",
                   PYTHONPATH=os.path.join(ROOT, "client", "python"),
                   MICROD_LIBRARY=os.path.join(build, "client", "libmicrod.so"))
        outs[r] = f"{d}/trainer{r}.out"
        trainers[r] = subprocess.Popen(
            ["ip", "netns", "exec", ns[r], PYTHON, f"{d}/trainer.py",
             str(pause_at if r == 2 else -1), stop], env=env, stdout=open(outs[r], "w"),
            stderr=subprocess.STDOUT)

    def lines(r, word):
        with open(outs[r]) as f:
            return [line.split() for line in f if line.startswith(word)]

    try:
        for r in range(3):
            daemon(r)
        wait_for(lambda: all(os.path.exists(f"{d}/node{r}/microd.sock") for r in range(3)), 60,
                 "the daemons' sockets")
        for r in range(3):
            trainer(r)
        wait_for(lambda: lines(2, "PAUSED"), 120, "node 2's pause")
        time.sleep(0.5)  # the others submit their next step and wait for node 2
        killed = time.time()
        daemons[2].kill()
        trainers[2].kill()
        after = lambda r: [float(s[2]) for s in lines(r, "STEP") if float(s[2]) > killed]
        wait_for(lambda: after(0) and after(1), peer_timeout_ms / 1000 + 60, "the survivors")
        recovered = max(after(0)[0], after(1)[0]) - killed
        own = []
        for r in (0, 1):
            out = subprocess.run([os.path.join(build, "daemon", "microctl"),
                                  f"--admin=unix:{d}/admin{r}", "--json", "status"],
                                 capture_output=True, text=True, timeout=10).stdout
            own.append(json.loads(out).get("lastRecoverySeconds", 0.0))
        # A new node: its daemon, then its process at once (a pod's sidecar
        # and trainer).
        started = time.time()
        daemon(3)
        wait_for(lambda: os.path.exists(f"{d}/node3/microd.sock"), 60, "the new daemon")
        trainer(3)
        wait_for(lambda: lines(3, "STEP"), 60, "the new node's first step")
        joined = float(lines(3, "STEP")[0][2]) - started
        open(stop, "w").close()
        for r in (0, 1, 3):
            trainers[r].wait(timeout=60)
        return recovered, own, joined
    finally:
        for p in list(trainers.values()) + list(daemons.values()):
            if p.poll() is None:
                p.kill()
        netlab("down", lab)
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--rtts", default="0,10,50", help="round trips in ms, comma-separated")
    ap.add_argument("--peer-timeouts", default="3000,10000", help="ms, comma-separated")
    args = ap.parse_args()
    print("| round trip | peer timeout | kill to the next step | target (timeout + 2 s) | met | "
          "each survivor's own account | new daemon to its first step | target | met |")
    print("|---:|---:|---:|---:|---|---|---:|---:|---|")
    for rtt in (float(x) for x in args.rtts.split(",")):
        for p in (int(x) for x in args.peer_timeouts.split(",")):
            took, own, joined = one(args.build, rtt, p)
            target = p / 1000 + 2
            print(f"| {rtt:g} ms | {p / 1000:g} s | {took:.2f} s | {target:g} s | "
                  f"{'yes' if took <= target else 'MISSED'} | "
                  f"{', '.join(f'{x:.2f} s' for x in own)} | {joined:.2f} s | 5 s | "
                  f"{'yes' if joined <= 5 else 'MISSED'} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
