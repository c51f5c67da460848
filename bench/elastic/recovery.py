"""How long an elastic job takes to go on without a lost node: 3 daemons on
loopback with --min_nodes=2, one training process each stepping a 1 M-float
bucket; node 2's process stops before step K and its daemon is killed
(SIGKILL). Printed for each peer timeout: the time from the kill to the
survivors' first step completed in the new epoch, beside the target (the
peer timeout + 2 s), and each daemon's own account of the change
(last_recovery_seconds: from the first sign to the new epoch running).

    /usr/bin/python3 bench/elastic/recovery.py --build build --peer-timeouts 3000,10000
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
PYTHON = "/usr/bin/python3"

TRAINER = r"""
import sys, time
import microd
c = microd.Client(timeout_ms=30000)
buf = c.register("g", 1 << 20)
seed, stop_at, step = c.rank, int(sys.argv[1]), 0
while step < stop_at + 5:
    if seed == 2 and step == stop_at:
        print("PAUSED", flush=True)
        time.sleep(3600)
    buf.array[:] = seed + 1 + step
    try:
        c.allreduce(buf, 120000)
    except microd.MembershipChangedError:
        print("CHANGED", time.time(), flush=True)
        continue
    if step == stop_at:
        print("NEXT", time.time(), flush=True)
    step += 1
"""


def wait_file(path, timeout=30):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if os.path.exists(path) and os.path.getsize(path) > 0:
            return open(path).read().strip()
        time.sleep(0.02)
    raise SystemExit(f"recovery.py: timed out waiting for {path}")


def one(build, peer_timeout_ms, stop_at=10):
    d = tempfile.mkdtemp(prefix="microd-elastic-")
    daemons, trainers = [], []
    try:
        coordinator = None
        for r in range(3):
            cmd = [os.path.join(build, "daemon", "microd"), f"--socket={d}/node{r}/microd.sock",
                   "--nodes=3", "--min_nodes=2", f"--node_rank={r}", f"--node_name=node{r}",
                   "--admin=127.0.0.1:0", f"--admin_port_file={d}/admin{r}",
                   f"--peer_timeout_ms={peer_timeout_ms}", "--timeout_ms=60000"]
            cmd += ([f"--coordinator_listen=127.0.0.1:0", f"--coordinator_port_file={d}/coord"]
                    if r == 0 else [f"--coordinator=127.0.0.1:{coordinator}"])
            daemons.append(subprocess.Popen(cmd, stdout=open(f"{d}/microd{r}.log", "w"),
                                            stderr=subprocess.STDOUT))
            if r == 0:
                coordinator = wait_file(f"{d}/coord")
        for r in range(3):
            wait_file(f"{d}/admin{r}")
        with open(f"{d}/trainer.py", "w") as f:
            f.write(TRAINER)
        for r in range(3):
            env = dict(os.environ, MICROD_SOCKET=f"{d}/node{r}/microd.sock",
                       PYTHONPATH=os.path.join(ROOT, "client", "python"),
                       MICROD_LIBRARY=os.path.join(build, "client", "libmicrod.so"))
            trainers.append(subprocess.Popen([PYTHON, f"{d}/trainer.py", str(stop_at)], env=env,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                             text=True))
        line = trainers[2].stdout.readline().strip()
        if line != "PAUSED":
            raise SystemExit(f"recovery.py: node 2's trainer said {line!r}")
        time.sleep(0.5)  # the others submit step K and wait for node 2
        killed = time.time()
        daemons[2].kill()
        trainers[2].kill()
        next_at = []
        for r in (0, 1):
            out, _ = trainers[r].communicate(timeout=peer_timeout_ms / 1000 + 60)
            if trainers[r].returncode != 0:
                raise SystemExit(f"recovery.py: node {r}'s trainer failed:\n{out}")
            next_at += [float(l.split()[1]) for l in out.splitlines() if l.startswith("NEXT")]
        status = []
        for r in (0, 1):
            port = open(f"{d}/admin{r}").read().strip()
            out = subprocess.run([os.path.join(build, "daemon", "microctl"),
                                  f"--admin=127.0.0.1:{port}", "--json", "status"],
                                 capture_output=True, text=True, timeout=10).stdout
            status.append(json.loads(out).get("lastRecoverySeconds", 0.0))
        return max(next_at) - killed, status
    finally:
        for p in trainers + daemons:
            if p.poll() is None:
                p.kill()
        shutil.rmtree(d, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--peer-timeouts", default="3000,10000", help="ms, comma-separated")
    args = ap.parse_args()
    print("| peer timeout | kill to the next step completed | target (peer timeout + 2 s) | "
          "met | each survivor's own account |")
    print("|---:|---:|---:|---|---|")
    for p in (int(x) for x in args.peer_timeouts.split(",")):
        took, own = one(args.build, p)
        target = p / 1000 + 2
        print(f"| {p / 1000:g} s | {took:.2f} s | {target:g} s | "
              f"{'yes' if took <= target else 'MISSED'} | "
              f"{', '.join(f'{x:.2f} s' for x in own)} |", flush=True)


if __name__ == "__main__":
    sys.exit(main())
