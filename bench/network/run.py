# SPDX-License-Identifier: Apache-2.0
"""The raw step on an emulated network: 4 nodes, each in a network namespace
of its own (deploy/netlab), links shaped to each rate in turn. Per rate, one
after another on the same lab: what the link actually carries (probe.py),
torch.distributed's Gloo dense allreduce (the baseline), microd dense, micro
1 % and micro 0.1 % (one training process per node, microd-bench-step-client)
and the local floor (`e += g` plus one dense write of the bucket, every node
at once). Every step is timed; the first one is reported apart (it maps the
bucket's state), the rest as a median. microd's data plane is sealed (the
job has a token); --seal-cost measures what that costs: each microd method
with and without --seal=off, side by side, in turns. Needs root.

    /usr/bin/python3 bench/network/run.py --build build --out results/bench/network.json
    /usr/bin/python3 bench/network/run.py --rates 1gbit --size 1000000 --steps 4
    /usr/bin/python3 bench/network/run.py --seal-cost --out results/bench/seal.json
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
NETLAB = os.path.join(ROOT, "deploy", "netlab", "netlab.sh")
PROBE = os.path.join(ROOT, "deploy", "netlab", "probe.py")
PYTHON = "/usr/bin/python3"

# name, daemon flags (None: not through microd)
METHODS = [
    ("gloo", None),
    ("microd-dense", ["--sparsifier=dense"]),
    ("microd-micro-1%", ["--sparsifier=micro", "--density=0.01"]),
    ("microd-micro-0.1%", ["--sparsifier=micro", "--density=0.001", "--remedies=off"]),
    ("floor", None),
]
# Top-k with error feedback, the baseline of sparsification papers (not run
# by default: --methods microd-topk-0.1%,microd-micro-0.1% sets it beside micro).
TOPK = [("microd-topk-0.1%", ["--sparsifier=topk", "--density=0.001", "--remedies=off"])]
# The same microd methods with the data plane in the clear (--seal-cost).
UNSEALED = "-unsealed"
METHODS += [(name + UNSEALED, flags + ["--seal=off"]) for name, flags in METHODS
            if flags is not None]
METHODS += TOPK
# --seal_failure=step (an elastic job): a confirmation round before each
# step commits (not run by default).
METHODS.append(("microd-micro-0.1%-seal-failure-step",
                ["--sparsifier=micro", "--density=0.001", "--remedies=off", "--min_nodes=2",
                 "--seal_failure=step"]))
# What sealing may cost each (issue V's targets: 1 Gbit/s, 50 ms round trip).
SEAL_TARGETS = {"microd-micro-0.1%": 0.03, "microd-micro-1%": 0.05, "microd-dense": 0.10}


def netlab(*args, timeout=120):
    r = subprocess.run([NETLAB, *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"netlab.sh {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout.strip()


class Lab:
    def __init__(self, nodes, rate, delay, env):
        self.nodes = nodes
        self.env = env
        self.name = netlab("up", "--nodes", str(nodes), "--owner", str(os.getpid()),
                           "--rate", rate, "--delay", delay)
        self.addr = [netlab("addr", self.name, str(r)) for r in range(nodes)]
        self.ns = [netlab("ns", self.name, str(r)) for r in range(nodes)]

    def cmd(self, r, args):
        return ["ip", "netns", "exec", self.ns[r], *args]

    def down(self):
        netlab("down", self.name)


def wait_all(procs, timeout, what):
    deadline = time.time() + timeout
    codes = []
    for p in procs:
        left = max(1.0, deadline - time.time())
        try:
            codes.append(p.wait(timeout=left))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise RuntimeError(f"{what}: timed out after {timeout:.0f} s")
    if any(codes):
        raise RuntimeError(f"{what}: exit status {codes}")


def read_steps(paths):
    steps = []
    for p in paths:
        with open(p) as f:
            steps.append(json.load(f)["step_ms"])
    return steps


def summary(steps_per_node):
    """Per step the slowest node (a step is done when every node is), then
    the first step apart and the median of the rest."""
    per_step = [max(s[i] for s in steps_per_node) for i in range(len(steps_per_node[0]))]
    rest = per_step[1:]
    return {"first_ms": per_step[0], "ms": statistics.median(rest) if rest else per_step[0],
            "step_ms": per_step}


def run_probe(lab, work, timeout):
    server = subprocess.Popen(lab.cmd(1, [PYTHON, PROBE, "serve", "--port", "5201",
                                          "--timeout", str(timeout)]),
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        out = subprocess.run(lab.cmd(0, [PYTHON, PROBE, "measure", "--host", lab.addr[1],
                                         "--port", "5201", "--bytes", str(work["probe_bytes"]),
                                         "--pings", "50", "--timeout", str(timeout)]),
                             capture_output=True, text=True, timeout=3 * timeout)
    finally:
        server.kill()
        server.wait()
    if out.returncode != 0:
        raise RuntimeError(f"probe: {out.stderr.strip()}")
    return json.loads(out.stdout)


def run_gloo(lab, args, d):
    outs = [os.path.join(d, f"gloo{r}.json") for r in range(lab.nodes)]
    env = dict(lab.env, GLOO_SOCKET_IFNAME="eth0", OMP_NUM_THREADS="1")
    procs = []
    for r in range(lab.nodes):
        log = open(os.path.join(d, f"gloo{r}.log"), "w")
        procs.append(subprocess.Popen(
            lab.cmd(r, [PYTHON, os.path.join(HERE, "gloo_allreduce.py"), "--rank", str(r),
                        "--world", str(lab.nodes), "--master", f"{lab.addr[0]}:29500",
                        "--size", str(args.size), "--buckets", str(args.buckets),
                        "--steps", str(args.steps), "--out", outs[r]]),
            env=env, stdout=log, stderr=subprocess.STDOUT))
    wait_all(procs, args.timeout, "gloo allreduce")
    return summary(read_steps(outs))


def run_floor(lab, args, d):
    client = os.path.join(args.build, "bench", "microd-bench-step-client")
    outs = [os.path.join(d, f"floor{r}.json") for r in range(lab.nodes)]
    barrier = os.path.join(d, "barrier")
    os.makedirs(barrier, exist_ok=True)
    procs = [subprocess.Popen(lab.cmd(r, [client, "--floor", f"--node={r}", f"--size={args.size}",
                                          f"--steps={args.steps}", f"--out={outs[r]}",
                                          f"--barrier={barrier}", f"--nodes={lab.nodes}"]))
             for r in range(lab.nodes)]
    wait_all(procs, args.timeout, "floor")
    return summary(read_steps(outs))


def run_microd(lab, args, d, flags):
    microd = os.path.join(args.build, "daemon", "microd")
    microctl = os.path.join(args.build, "daemon", "microctl")
    client = os.path.join(args.build, "bench", "microd-bench-step-client")
    daemons = []
    # Node 0 serves the coordinator on its lab address: with a job token.
    token = os.path.join(d, "token")
    with open(token, "w") as f:
        f.write(os.urandom(16).hex() + "\n")
    try:
        for r in range(lab.nodes):
            dargs = [microd, f"--socket={d}/node{r}/sock", f"--nodes={lab.nodes}",
                     f"--node_rank={r}", f"--node_name=node{r}", f"--admin=unix:{d}/admin{r}",
                     f"--token_file={token}", "--timeout_ms=600000", *flags]
            dargs.append(f"--coordinator_listen={lab.addr[0]}:7470" if r == 0
                         else f"--coordinator={lab.addr[0]}:7470")
            log = open(os.path.join(d, f"microd{r}.log"), "w")
            daemons.append(subprocess.Popen(lab.cmd(r, dargs), stdout=log, stderr=subprocess.STDOUT))
        deadline = time.time() + 60
        for r in range(lab.nodes):
            while not os.path.exists(f"{d}/node{r}/sock"):
                if daemons[r].poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"microd of node {r} did not start (see {d}/microd{r}.log)")
                time.sleep(0.1)
        outs = [os.path.join(d, f"steps{r}.json") for r in range(lab.nodes)]
        procs = [subprocess.Popen(lab.cmd(r, [client, f"--socket={d}/node{r}/sock", f"--node={r}",
                                              f"--size={args.size}", f"--buckets={args.buckets}",
                                              f"--steps={args.steps}", f"--out={outs[r]}"]),
                                  stdout=open(os.path.join(d, f"client{r}.log"), "w"),
                                  stderr=subprocess.STDOUT)
                 for r in range(lab.nodes)]
        wait_all(procs, args.timeout, "microd steps")
        result = summary(read_steps(outs))
        # The daemons' own split of the step (node 0), per step.
        st = subprocess.run([microctl, f"--admin=unix:{d}/admin0", "--json", "buckets"],
                            capture_output=True, text=True, timeout=30)
        if st.returncode == 0:
            for b in json.loads(st.stdout).get("buckets", []):
                if b.get("name") != "bucket":
                    continue
                n = max(1, int(b.get("steps", 1)))
                result["split_ms_per_step"] = {
                    k: 1e3 * float(b.get(k + "Seconds", 0)) / n
                    for k in ("negotiate", "localSum", "select", "exchange", "writeback")}
                result["bytes_sent_per_step"] = int(b.get("bytesSent", 0)) / n
                result["selected"] = int(b.get("lastSelected", 0))
                result["rounds_per_step"] = int(b.get("lastRounds", 0))
                result["budget"] = int(b.get("budget", 0))
        return result
    finally:
        for p in daemons:
            p.terminate()
        for p in daemons:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()


def run_one(lab, name, flags, args, d):
    """One method on the lab; its failure as {"error", "logs"}."""
    try:
        if name == "gloo":
            return run_gloo(lab, args, d)
        if name == "floor":
            return run_floor(lab, args, d)
        return run_microd(lab, args, d, flags)
    except RuntimeError as e:
        return {"error": str(e), "logs": d}


def targets(rate_results, rate):
    """The issue's targets, each beside its figure."""
    m = rate_results["methods"]
    out = []

    def ms(name):
        r = m.get(name)
        return r["ms"] if r and "ms" in r else None

    gloo, dense, floor, micro01 = ms("gloo"), ms("microd-dense"), ms("floor"), ms("microd-micro-0.1%")
    if gloo and dense:
        out.append({"what": "microd dense vs Gloo's allreduce (speed)", "value": gloo / dense,
                    "target": ">= 0.95", "met": gloo / dense >= 0.95})
    if rate == "1gbit" and gloo and micro01:
        out.append({"what": "micro 0.1 % faster than Gloo dense", "value": gloo / micro01,
                    "target": ">= 25x", "met": gloo / micro01 >= 25})
    if rate == "1gbit" and floor and micro01:
        out.append({"what": "micro 0.1 % over the local floor", "value": micro01 / floor,
                    "target": "<= 1.25x", "met": micro01 / floor <= 1.25})
    return out


def run_latency(args, env, work):
    """The latency dimension: per link (rate and one-way delay per link
    ingress, so a round trip crosses two), per workload (buckets x floats,
    every bucket submitted at once), Gloo's dense allreduce (one async
    all_reduce per bucket) beside microd, with the rounds of microd's
    step. Returns {config: {"link": ..., "workloads": {w: {method: r}}}}."""
    out = {}
    methods = [m for m in METHODS if m[0] in args.methods.split(",")]
    for config in args.configs.split(","):
        rate, delay = config.split("@")
        print(f"== {args.nodes} nodes, links at {rate}, {delay} each way", flush=True)
        lab = Lab(args.nodes, rate, delay, env)
        cr = {"rate": rate, "delay": delay, "workloads": {}}
        try:
            cr["link"] = run_probe(lab, {"probe_bytes": 50_000_000 if rate.endswith("gbit")
                                         else 5_000_000}, 60)
            print(f"   link: {cr['link']['mb_per_s']:.1f} MB/s, round trip "
                  f"{cr['link']['rtt_ms_median']:.3f} ms (median)", flush=True)
            for workload in args.workloads.split(","):
                nb, size = (int(x) for x in workload.split("x"))
                wr = cr["workloads"][workload] = {}
                for name, flags in methods:
                    d = os.path.join(work, config, workload, name)
                    shutil.rmtree(d, ignore_errors=True)
                    os.makedirs(d)
                    sub = argparse.Namespace(**vars(args))
                    sub.size, sub.buckets = nb * size, nb
                    sub.steps = (args.slow_steps if name in ("gloo", "microd-dense")
                                 else args.steps)
                    r = run_one(lab, name, flags, sub, d)
                    wr[name] = r
                    if "error" in r:
                        print(f"   {workload:>12} {name:<20} FAILED: {r['error']}", flush=True)
                    else:
                        rounds = (f", {r['rounds_per_step']} rounds"
                                  if "rounds_per_step" in r else "")
                        print(f"   {workload:>12} {name:<20} {r['ms']:9.1f} ms/step{rounds}",
                              flush=True)
        finally:
            lab.down()
        out[config] = cr
    return out


def run_seal_cost(args, env, work):
    """Each microd method of SEAL_TARGETS sealed (the default: the job has
    a token) and with --seal=off, in turns (`--repeats` pairs, so that drift
    on this machine falls on both alike), on one link and workload; per
    method the median step of each side over every turn, and the cost."""
    rate, delay = args.configs.split(",")[0].split("@")
    nb, size = (int(x) for x in args.workloads.split(",")[0].split("x"))
    print(f"== the sealed data plane's cost: {args.nodes} nodes, links at {rate}, {delay} each "
          f"way, {nb} x {size} floats", flush=True)
    lab = Lab(args.nodes, rate, delay, env)
    out = {"rate": rate, "delay": delay, "workload": f"{nb}x{size}", "methods": {}}
    try:
        out["link"] = run_probe(lab, {"probe_bytes": 50_000_000}, 60)
        print(f"   link: {out['link']['mb_per_s']:.1f} MB/s, round trip "
              f"{out['link']['rtt_ms_median']:.3f} ms (median)", flush=True)
        flags = dict(METHODS)
        for name, limit in SEAL_TARGETS.items():
            steps = {True: [], False: []}
            errors = []
            for turn in range(args.repeats):
                for sealed in (True, False):
                    method = name if sealed else name + UNSEALED
                    d = os.path.join(work, "seal", method, str(turn))
                    shutil.rmtree(d, ignore_errors=True)
                    os.makedirs(d)
                    sub = argparse.Namespace(**vars(args))
                    sub.size, sub.buckets = nb * size, nb
                    sub.steps = args.slow_steps if name == "microd-dense" else args.steps
                    r = run_one(lab, method, flags[method], sub, d)
                    if "error" in r:
                        errors.append(r)
                        print(f"   {method:<28} FAILED: {r['error']}", flush=True)
                        continue
                    steps[sealed] += r["step_ms"][1:]
                    print(f"   {method:<28} turn {turn}: {r['ms']:9.1f} ms/step", flush=True)
            if errors or not steps[True] or not steps[False]:
                out["methods"][name] = {"error": errors[0]["error"] if errors else "no steps"}
                continue
            sealed_ms = statistics.median(steps[True])
            open_ms = statistics.median(steps[False])
            cost = sealed_ms / open_ms - 1
            out["methods"][name] = {"sealed_ms": sealed_ms, "unsealed_ms": open_ms,
                                    "cost": cost, "target": limit, "met": cost <= limit,
                                    "steps": {"sealed": steps[True], "unsealed": steps[False]}}
            print(f"   {name:<20} sealed {sealed_ms:8.1f} ms, unsealed {open_ms:8.1f} ms: "
                  f"{100 * cost:+.1f} % (target at most {100 * limit:.0f} %) "
                  f"{'met' if cost <= limit else 'MISSED'}", flush=True)
    finally:
        lab.down()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--build", default=os.path.join(ROOT, "build"))
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "bench", "network.json"))
    ap.add_argument("--rates", default="10gbit,1gbit,100mbit")
    ap.add_argument("--delay", default="0.05ms",
                    help="one-way delay per link ingress (a round trip crosses two: 0.05ms "
                         "gives about 0.2 ms with this machine's own latency)")
    ap.add_argument("--nodes", type=int, default=4)
    ap.add_argument("--size", type=int, default=25_557_032)
    ap.add_argument("--buckets", type=int, default=1,
                    help="buckets the elements are split into, all submitted at once")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per method (first apart)")
    ap.add_argument("--slow-steps", type=int, default=5,
                    help="steps of the dense methods at rates below 1 Gbit/s")
    ap.add_argument("--methods", default=",".join(
        m[0] for m in METHODS
        if not m[0].endswith(UNSEALED) and "seal-failure" not in m[0] and m not in TOPK))
    ap.add_argument("--timeout", type=float, default=600, help="seconds per method")
    ap.add_argument("--work", default="", help="per-run files (default: a temporary folder)")
    ap.add_argument("--latency", action="store_true",
                    help="the latency dimension instead: --configs x --workloads")
    ap.add_argument("--configs", default="1gbit@0.05ms,1gbit@5ms,1gbit@25ms,100mbit@25ms",
                    help="--latency: RATE@DELAY, the delay one way per link ingress (a round "
                         "trip crosses two)")
    ap.add_argument("--workloads", default="1x25557032,16x1597315",
                    help="--latency: BUCKETSxFLOATS each")
    ap.add_argument("--seal-cost", action="store_true",
                    help="each microd method sealed and with --seal=off, in turns, on the first "
                         "of --configs (default here 1gbit@25ms) and of --workloads")
    ap.add_argument("--repeats", type=int, default=2, help="--seal-cost: turns of each pair")
    args = ap.parse_args()
    args.build = os.path.abspath(args.build)
    if os.geteuid() != 0:
        sys.exit("bench/network/run.py: the emulated network needs root")
    chosen = [m for m in METHODS if m[0] in args.methods.split(",")]
    env = dict(os.environ, NETLAB_DELAY_BIN=os.path.join(args.build, "deploy", "netlab",
                                                         "microd-netlab-delay"))
    work = args.work or tempfile.mkdtemp(prefix="microd-bench-network-")
    if args.seal_cost:
        if "--configs" not in sys.argv:
            args.configs = "1gbit@25ms"
        results = {"config": {"nodes": args.nodes, "steps": args.steps,
                              "slow_steps": args.slow_steps, "repeats": args.repeats},
                   "seal": run_seal_cost(args, env, work)}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"   written {args.out}")
        return 0 if all("error" not in m for m in results["seal"]["methods"].values()) else 1
    if args.latency:
        results = {"config": {"nodes": args.nodes, "steps": args.steps,
                              "slow_steps": args.slow_steps},
                   "latency": run_latency(args, env, work)}
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
        print(f"   written {args.out}")
        ok = all("error" not in m for c in results["latency"].values()
                 for w in c["workloads"].values() for m in w.values())
        return 0 if ok else 1
    results = {"config": {"nodes": args.nodes, "size": args.size, "buckets": args.buckets,
                          "steps": args.steps, "delay": args.delay}, "rates": {}}
    for rate in args.rates.split(","):
        print(f"== {args.nodes} nodes, links at {rate}, {args.delay} each way", flush=True)
        lab = Lab(args.nodes, rate, args.delay, env)
        rr = {"methods": {}}
        try:
            rr["link"] = run_probe(lab, {"probe_bytes": 200_000_000 if rate.endswith("gbit")
                                         else 20_000_000}, 60)
            print(f"   link: {rr['link']['mb_per_s']:.1f} MB/s, round trip "
                  f"{rr['link']['rtt_ms_median']:.3f} ms (median)", flush=True)
            slow = rate.endswith("mbit") or rate.endswith("kbit")
            for name, flags in chosen:
                d = os.path.join(work, rate, name)
                shutil.rmtree(d, ignore_errors=True)
                os.makedirs(d)
                steps = args.steps
                if slow and name in ("gloo", "microd-dense"):
                    steps = min(steps, args.slow_steps)
                sub = argparse.Namespace(**vars(args))
                sub.steps = steps
                r = run_one(lab, name, flags, sub, d)
                rr["methods"][name] = r
                if "error" in r:
                    print(f"   {name:<20} FAILED: {r['error']}", flush=True)
                else:
                    print(f"   {name:<20} {r['ms']:9.1f} ms/step  (first step {r['first_ms']:.0f} ms)",
                          flush=True)
        finally:
            lab.down()
        rr["targets"] = targets(rr, rate)
        for t in rr["targets"]:
            print(f"   target: {t['what']}: {t['value']:.2f} (target {t['target']}) "
                  f"{'met' if t['met'] else 'MISSED'}", flush=True)
        results["rates"][rate] = rr
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    print(f"   written {args.out}")
    ok = all("error" not in m for r in results["rates"].values() for m in r["methods"].values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
