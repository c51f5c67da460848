#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# make image-test: the image run for real with podman (root). Builds
# microd:test when missing (scripts/image.sh), then checks:
#   1. its size (target <= 120 MB, whatever the base's apt settings);
#   2. `microd --help` exits 0;
#   3. microd-health says SERVING once a daemon serves;
#   4. a 3-node job in containers on a podman network with DNS, inside a
#      network namespace of its own: each node a daemon container (node 0
#      serves the coordinator, found by name), one trainer container per node
#      with --network none and a non-root uid running the Python binding
#      through the socket volume; the dense bucket equals the exact average,
#      the sparse one what the same trainers get from daemons outside
#      containers (deploy/local/launch.sh, the build tree's microd);
#      `microctl status` from inside node 0; `podman stop` ends each daemon
#      with 0 and removes its socket;
#   5. a trainer container killed: the other nodes' trainers get the error
#      naming the failed node;
#   6. a pod per node (podman pod: one network namespace, the socket in a
#      pod-local volume) with the daemon and the trainer as its two
#      containers, the closest this machine gets to the Kubernetes pod: the
#      same job, the same results;
#   7. the Kubernetes manifests' own pod (the four-nodes overlay rendered and
#      translated by tests/deploy/pod_to_podman.py), one podman pod per
#      node named and addressed as the headless Service makes them: the 4
#      example trainers get the average.
# Everything it makes (containers, volumes, network, namespace) is named
# after this run and removed on exit.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
source scripts/podman-env.sh
microd_podman_setup "$ROOT"
IMAGE="${IMAGE:-microd:test}"
TRAINER="${IMAGE%%:*}-trainer:${IMAGE##*:}"
BUILD="${BUILD:-$ROOT/build}"
RUN="mi$$"  # names of this run
NS="microd-img-$$"
NET="microd-img-$$"
WORK=$(mktemp -d /tmp/microd-image-test.XXXXXX)
chmod 0755 "$WORK"
FAILED=0
TAGGED=()
LOGS="${IMAGE_TEST_LOGS:-$BUILD/image-test-logs}"

fail() {
  echo "image-test: FAIL: $*" >&2
  FAILED=1
}
pass() { echo "image-test: ok: $*"; }
# Runs a command every 0.5 s until it succeeds, for up to 60 s (120 tries).
poll_60s() {
  local i
  for i in $(seq 1 120); do
    "$@" >/dev/null 2>&1 && return 0
    sleep 0.5
  done
  return 1
}
# podman in the run's network namespace: the network's bridge, its rules and
# its DNS live there (nsenter, not `ip netns exec`, whose fresh /sys has no
# cgroup mount for runc).
pns() { nsenter --net="/var/run/netns/$NS" podman "$@"; }
# No systemd here: no health-check timers (podman healthcheck run instead).
NOTIMER=(--health-interval=disable)
# The network's DNS server reloads as containers join and may miss a query
# meanwhile; the resolver's default 5 s per try (and this machine's own
# nameserver after it, unreachable in the run's namespace) would stall a
# daemon past the peer timeout. Short tries, a few of them.
DNSOPTS=(--dns-option=timeout:1 --dns-option=attempts:5)
# Even so a lookup can take seconds here: the daemons' peer timeout (a node
# that has not written its rendezvous key by then fails the job) is 20 s.

cleanup() {
  set +e
  local c
  # A failed run keeps every container's log (and podman's) for a look.
  if [[ $FAILED != 0 ]]; then
    rm -rf "$LOGS" && mkdir -p "$LOGS"
    for c in $(podman ps -a --format '{{.Names}}' | grep "^$RUN-"); do podman logs "$c" >"$LOGS/${c#"$RUN-"}.log" 2>&1; done
    cp "$WORK"/*.log "$WORK"/*.trainer* "$LOGS/" 2>/dev/null
    echo "image-test: logs of the failed run in $LOGS" >&2
  fi
  for c in $(podman ps -a --format '{{.Names}}' | grep "^$RUN-"); do podman rm -f -t 0 "$c" >/dev/null 2>&1; done
  for c in $(podman pod ls --format '{{.Name}}' | grep "^$RUN-"); do podman pod rm -f -t 0 "$c" >/dev/null 2>&1; done
  for c in $(podman volume ls --format '{{.Name}}' | grep "^$RUN-"); do podman volume rm -f "$c" >/dev/null 2>&1; done
  for c in "${TAGGED[@]}"; do podman untag "$IMAGE" "$c" >/dev/null 2>&1; done
  nsenter --net="/var/run/netns/$NS" podman network rm -f "$NET" >/dev/null 2>&1
  [[ -z "$(podman ps -q)" ]] && pkill -x aardvark-dns 2>/dev/null
  ip netns del "$NS" 2>/dev/null
  rm -rf "$WORK"
}
trap cleanup EXIT

if ! podman image exists "$IMAGE"; then
  IMAGE="$IMAGE" bash scripts/image.sh
fi

# 1. Size.
size=$(podman image inspect "$IMAGE" --format '{{.Size}}')
mb=$(( size / 1000000 ))
if (( mb <= 120 )); then pass "image size $mb MB (target <= 120 MB)"; else fail "image size $mb MB > 120 MB"; fi

# 2. --help.
if podman run --rm "${NOTIMER[@]}" --network none "$IMAGE" --help >"$WORK/help" 2>&1 && grep -q -- --coordinator_listen "$WORK/help"; then
  pass "microd --help exits 0"
else
  fail "microd --help: $(tail -3 "$WORK/help")"
fi

# 3. Health: SERVING once a one-node daemon serves (bounded wait).
podman run -d "${NOTIMER[@]}" --network none --name "$RUN-health" "$IMAGE" --nodes=1 \
  --coordinator_listen=127.0.0.1:7470 >/dev/null
serving=""
for i in $(seq 1 60); do
  if podman exec "$RUN-health" microd-health --timeout_ms=1000 >/dev/null 2>&1; then serving=$i; break; fi
  sleep 0.5
done
if [[ -n "$serving" ]]; then pass "microd-health SERVING after about $(( serving / 2 )) s"; else fail "microd-health never SERVING"; fi
# The image's own HEALTHCHECK (kept by --format docker), run by hand.
if podman healthcheck run "$RUN-health" >/dev/null 2>&1; then
  pass "the image's HEALTHCHECK: healthy"
else
  fail "the image's HEALTHCHECK: $(podman image inspect "$IMAGE" --format '{{.Config.Healthcheck}}')"
fi
podman rm -f -t 2 "$RUN-health" >/dev/null

# The trainer image: Python and numpy over the runtime image, the binding's
# package beside libmicrod, still uid 10001 (built each run: podman's layer
# cache makes that instant while the image is the same).
{
  cat >"$WORK/Containerfile.trainer" <<EOF
FROM $IMAGE
USER root
RUN apt-get update -qq && apt-get install -y -qq --no-install-recommends python3 python3-numpy \\
    && apt-get clean && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
COPY microd /opt/microd-python/microd
COPY image_trainer.py /usr/local/bin/image_trainer.py
ENV PYTHONPATH=/opt/microd-python
USER 10001:10001
ENTRYPOINT ["python3", "/usr/local/bin/image_trainer.py"]
EOF
  # Its own context (the repository's .dockerignore keeps tests/ out).
  mkdir -p "$WORK/trainer"
  cp -r client/python/microd tests/deploy/image_trainer.py "$WORK/trainer/"
  rm -rf "$WORK/trainer/microd/__pycache__"
  podman build --pull=never --format docker --network host -f "$WORK/Containerfile.trainer" \
    -t "$TRAINER" "$WORK/trainer" >"$WORK/trainer-build.log" 2>&1 || {
    tail -20 "$WORK/trainer-build.log" >&2
    fail "trainer image build"
    exit 1
  }
}

# 4. A 3-node job on a podman network with DNS, in a namespace of this run's.
# podman's one DNS server (aardvark-dns) serves every network from the
# namespace it was started in: one left from an earlier run, in a namespace
# gone since, would answer nothing here. With no container running, it is
# stopped so that this run's first container starts it in this run's namespace.
stop_idle_dns() {
  if [[ -z "$(podman ps -q)" ]]; then pkill -x aardvark-dns 2>/dev/null || true; fi
}
stop_idle_dns
reload_dns() {
  local i
  for i in 1 2; do
    sleep 1
    pkill -HUP -x aardvark-dns 2>/dev/null || true
  done
}
ip netns add "$NS"
ip netns exec "$NS" ip link set lo up
# A subnet of this run's (addresses are given to the manifest's pods below).
SUBNET="10.$(( 100 + $$ % 100 )).$(( ($$ / 100) % 250 ))"
pns network create --subnet "$SUBNET.0/24" "$NET" >/dev/null
# The network's DNS server starts with its first container and learns of
# each later one by a reload signal; a container that joins while it is
# still starting is never learnt, and its queries go unanswered. So a
# placeholder container first, and the nodes once the server listens.
pns run -d "${NOTIMER[@]}" --name "$RUN-dns" --network "$NET" --entrypoint /bin/sleep "$IMAGE" \
  infinity >/dev/null 2>>"$WORK/podman.log"
for i in $(seq 1 50); do
  ip netns exec "$NS" ss -uln 2>/dev/null | grep -q ':53 ' && break
  sleep 0.2
done
sleep 0.5
head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n' >"$WORK/token"
chmod 0644 "$WORK/token"
start_daemons() {  # $1: run label
  local r args
  for r in 0 1 2; do
    podman volume create "$RUN-$1-sock$r" >/dev/null
    args=(--nodes=3 --local_size=1 --node_name="node$r" --token_file=/etc/microd/token
          --peer_timeout_ms=20000 --timeout_ms=30000)
    # Names of this job's own: a record the DNS server keeps of an earlier
    # job's container (a lost reload) must not answer for this one's.
    if [[ $r == 0 ]]; then args+=(--coordinator_listen=0.0.0.0:7470); else args+=(--coordinator="$1-node0:7470"); fi
    pns run -d "${NOTIMER[@]}" "${DNSOPTS[@]}" --name "$RUN-$1-node$r" --network "$NET" \
      --network-alias "$1-node$r" \
      -v "$RUN-$1-sock$r:/run/microd" -v "$WORK/token:/etc/microd/token:ro" \
      "$IMAGE" "${args[@]}" >/dev/null 2>>"$WORK/podman.log"
  done
  # Reload signals that arrive while the DNS server is reloading are lost
  # (aardvark-dns 1.4): more once every container is up.
  reload_dns
  for r in 0 1 2; do
    if ! poll_60s podman exec "$RUN-$1-node$r" microd-health --service=microd --timeout_ms=1000; then
      fail "node $r of '$1' never served"
      local q
      for q in 0 1 2; do podman logs "$RUN-$1-node$q" 2>&1 | grep -v level= | tail -4 | sed "s/^/  node $q: /" >&2; done
      return 1
    fi
  done
}
start_trainers() {  # $1: run label, $2...: trainer arguments
  local label="$1" r
  shift
  for r in 0 1 2; do
    podman run -d "${NOTIMER[@]}" --name "$RUN-$label-trainer$r" --network none --user 10001:10001 \
      -v "$RUN-$label-sock$r:/run/microd" "$TRAINER" "$@" >/dev/null 2>>"$WORK/podman.log"
  done
}
wait_trainers() {  # $1: run label; exit codes in $WORK/$1.codes, output in $WORK/$1.trainerR
  local r
  : >"$WORK/$1.codes"
  for r in 0 1 2; do
    timeout 180 podman wait "$RUN-$1-trainer$r" >>"$WORK/$1.codes" || echo timeout >>"$WORK/$1.codes"
    podman logs "$RUN-$1-trainer$r" >"$WORK/$1.trainer$r" 2>&1
  done
}

if start_daemons job; then
  start_trainers job
  wait_trainers job
  if [[ "$(tr '\n' ' ' <"$WORK/job.codes")" == "0 0 0 " ]]; then
    pass "3 trainers in containers (--network none, uid 10001) finished"
  else
    fail "trainers exited $(tr '\n' ' ' <"$WORK/job.codes"): $(tail -2 "$WORK"/job.trainer*)"
  fi
  # The dense bucket: the exact average, in node order, in fp32.
  PYTHONPATH="$ROOT/client/python" /usr/bin/python3 - "$WORK" <<'EOF' && pass "dense bucket = the exact average on every node" || fail "dense bucket differs from the average"
import hashlib, sys
sys.path.insert(0, "tests/deploy")
from image_trainer import DENSE, STEPS, gradient
work = sys.argv[1]
for step in range(STEPS):
    g = [gradient(r, step, DENSE) for r in range(3)]
    want = hashlib.sha256(((g[0] + g[1] + g[2]) / 3).astype("float32").tobytes()).hexdigest()
    for r in range(3):
        lines = open(f"{work}/job.trainer{r}").read().split("\n")
        assert f"{step} dense {want}" in lines, (r, step)
EOF
  # The sparse bucket: identical on every node, and what daemons outside
  # containers give the same trainers.
  sparse=$(cat "$WORK"/job.trainer* | grep " sparse " | sort -u | wc -l || true)
  if [[ $sparse == 5 ]]; then pass "sparse bucket identical on the 3 nodes"; else fail "sparse bucket: $sparse distinct step results, want 5"; fi
  if [[ -x "$BUILD/daemon/microd" ]]; then
    PYTHONPATH="$ROOT/client/python" MICROD_LIBRARY="$BUILD/client/libmicrod.so" \
      deploy/local/launch.sh --nodes 3 --local 1 --microd "$BUILD/daemon/microd" --logs "$WORK/host" \
      -- /usr/bin/python3 tests/deploy/image_trainer.py >"$WORK/host.out" 2>&1 || true
    host=$(cat "$WORK"/host/*.log 2>/dev/null | grep -E "^[0-9]+ sparse " | sort -u || true)
    cont=$(cat "$WORK"/job.trainer* | grep " sparse " | sort -u || true)
    if [[ -n "$host" && "$host" == "$cont" ]]; then
      pass "sparse bucket = the same trainers on daemons outside containers, bit for bit"
    else
      fail "sparse bucket differs from the run outside containers (see $WORK/host.out)"
    fi
  else
    fail "no $BUILD/daemon/microd for the reference run outside containers (make build first)"
  fi
  # Nodes 1 and 2 take the address the coordinator saw them join from: no
  # name lookup of their own after the join (this network's DNS answers
  # gRPC's resolver yet may fail a process's own lookups for seconds).
  seen=0
  for r in 1 2; do
    ip=$(podman inspect "$RUN-job-node$r" --format '{{range .NetworkSettings.Networks}}{{.IPAddress}}{{end}}')
    log=$(podman logs "$RUN-job-node$r" 2>&1)  # (grep -q on a pipe: SIGPIPE under pipefail)
    if grep -qF "data plane on $ip (the address the coordinator at job-node0:7470 saw" <<<"$log"; then
      seen=$((seen + 1))
    fi
  done
  if [[ $seen == 2 ]]; then
    pass "nodes 1 and 2: data plane on their own address, as the coordinator saw their joins"
  else
    fail "data-plane addresses: $(podman logs "$RUN-job-node1" 2>&1 | grep 'data plane')"
  fi
  # microctl from inside node 0.
  if podman exec "$RUN-job-node0" microctl status >"$WORK/status" 2>&1 \
      && grep -q "running" "$WORK/status" && grep -q "rank 0 of 3" "$WORK/status"; then
    pass "microctl status inside node 0: running, rank 0 of 3"
  else
    fail "microctl status: $(head -3 "$WORK/status")"
  fi
  # podman stop: exit 0, socket removed.
  for r in 0 1 2; do
    pns stop -t 20 "$RUN-job-node$r" >/dev/null
    code=$(podman inspect "$RUN-job-node$r" --format '{{.State.ExitCode}}')
    left=$(podman run --rm "${NOTIMER[@]}" --network none --entrypoint /bin/ls -v "$RUN-job-sock$r:/run/microd" "$IMAGE" -A /run/microd)
    if [[ $code == 0 && -z "$left" ]]; then
      pass "node $r: podman stop -> exit 0, socket removed"
    else
      fail "node $r: podman stop -> exit $code, left in the volume: $left"
    fi
  done
fi

# 5. A trainer killed: the others get the error naming its node.
if start_daemons kill; then
  start_trainers kill --steps-forever
  sleep 3
  podman kill "$RUN-kill-trainer1" >/dev/null
  wait_trainers kill
  named=0
  for r in 0 2; do
    if grep -q "FAILED JobFailedError" "$WORK/kill.trainer$r" && grep -qi "node 1" "$WORK/kill.trainer$r"; then
      named=$((named + 1))
    fi
  done
  if [[ $named == 2 ]]; then
    pass "trainer of node 1 killed: nodes 0 and 2 get JobFailedError naming node 1"
  else
    fail "killed trainer: node 0: $(tail -1 "$WORK/kill.trainer0"); node 2: $(tail -1 "$WORK/kill.trainer2")"
  fi
fi

# The first jobs' containers go (kept for their logs if a check failed).
if (( FAILED == 0 )); then
  for c in $(podman ps -a --format '{{.Names}}' | grep -E "^$RUN-(job|kill)-"); do
    podman rm -f -t 0 "$c" >/dev/null 2>&1
  done
fi

# 6. A pod per node: daemon and trainer share the pod's network namespace
# and a pod-local socket volume; the pods on the run's network, by name.
if (( FAILED == 0 )); then
  pods_ok=1
  for r in 0 1 2; do
    args=(--nodes=3 --local_size=1 --node_name="node$r" --token_file=/etc/microd/token
          --peer_timeout_ms=20000 --timeout_ms=30000)
    if [[ $r == 0 ]]; then args+=(--coordinator_listen=0.0.0.0:7470); else args+=(--coordinator=pod-node0:7470); fi
    podman volume create "$RUN-pod-sock$r" >/dev/null
    if ! pns pod create "${DNSOPTS[@]}" --name "$RUN-pod$r" --network "$NET" --network-alias "pod-node$r" >/dev/null \
        2>>"$WORK/podman.log"; then
      fail "pod create: $(grep -v level= "$WORK/podman.log" | tail -1)"
      pods_ok=0
      break
    fi
    pns run -d "${NOTIMER[@]}" --pod "$RUN-pod$r" --name "$RUN-pod-node$r" \
      -v "$RUN-pod-sock$r:/run/microd" -v "$WORK/token:/etc/microd/token:ro" \
      "$IMAGE" "${args[@]}" >/dev/null 2>>"$WORK/podman.log"
  done
  reload_dns
  for r in 0 1 2; do
    (( pods_ok )) || break
    if ! poll_60s podman exec "$RUN-pod-node$r" microd-health --service=microd --timeout_ms=1000; then
      fail "pod $r: daemon never served"
      for q in 0 1 2; do podman logs "$RUN-pod-node$q" 2>&1 | grep -v level= | tail -3 | sed "s/^/  pod $q: /" >&2; done
      pods_ok=0
    fi
  done
  if (( pods_ok )); then
    for r in 0 1 2; do
      pns run -d "${NOTIMER[@]}" --pod "$RUN-pod$r" --name "$RUN-pod-trainer$r" --user 10001:10001 \
        -v "$RUN-pod-sock$r:/run/microd" "$TRAINER" >/dev/null 2>>"$WORK/podman.log"
    done
    : >"$WORK/pod.codes"
    for r in 0 1 2; do
      timeout 180 podman wait "$RUN-pod-trainer$r" >>"$WORK/pod.codes" || echo timeout >>"$WORK/pod.codes"
      podman logs "$RUN-pod-trainer$r" 2>/dev/null | grep -E "^[0-9]+ (dense|sparse) " >"$WORK/pod.trainer$r" || true
    done
    want=$(cat "$WORK"/job.trainer* | grep -E "^[0-9]+ (dense|sparse) " | sort -u || true)
    got=$(cat "$WORK"/pod.trainer* | sort -u || true)
    if [[ "$(tr '\n' ' ' <"$WORK/pod.codes")" == "0 0 0 " && -n "$want" && "$got" == "$want" ]]; then
      pass "a pod per node (daemon + trainer, pod-local socket volume): the same results, bit for bit"
    else
      fail "pods: trainers exited $(tr '\n' ' ' <"$WORK/pod.codes"), results $( [[ "$got" == "$want" ]] && echo equal || echo differ)"
    fi
  fi
fi

# 7. The Kubernetes manifests' own pod, rendered for the four-nodes overlay
# and run by podman (tests/deploy/pod_to_podman.py: the image, command,
# environment with the Downward API fields filled in, volumes, user, limits;
# any field it cannot translate fails): one pod per node, named and
# addressed as the headless Service makes them, the trainer started once
# the sidecar's startup probe passes, as a native sidecar is.
if (( FAILED == 0 )); then
  for c in $(podman pod ls --format "{{.Name}}" | grep -E "^$RUN-pod"); do podman pod rm -f -t 0 "$c" >/dev/null 2>&1; done
  cp -r deploy/k8s "$WORK/k8s"
  for o in "$WORK"/k8s/overlays/*; do cp "$WORK/token" "$o/token"; done
  mkdir -m 0755 "$WORK/secret-token" && cp "$WORK/token" "$WORK/secret-token/token"
  plan() { /usr/bin/python3 tests/deploy/pod_to_podman.py --k8s "$WORK/k8s" --overlay four-nodes \
             --secret "microd-token=$WORK/secret-token" --prefix "$RUN-k8s" "$@"; }
  nodes=$(plan --node 0 --pod-ip 0 --part nodes)
  # The manifests' image name, given to this image.
  for img in $(plan --node 0 --pod-ip 0 --part image); do podman tag "$IMAGE" "$img"; TAGGED+=("$img"); done
  k8s_ok=1
  for (( r = 0; r < nodes; ++r )); do
    ip="$SUBNET.$(( 20 + r ))"
    while read -r line; do eval "podman $line" >/dev/null; done < <(plan --node $r --pod-ip "$ip" --part volumes)
    if ! eval "pns $(plan --node $r --pod-ip "$ip" --part pod) --network $NET ${DNSOPTS[*]}" >/dev/null 2>>"$WORK/podman.log" \
        || ! eval "pns $(plan --node $r --pod-ip "$ip" --part sidecar)" >/dev/null 2>>"$WORK/podman.log"; then
      fail "manifest pod $r: $(grep -v level= "$WORK/podman.log" | tail -1)"
      k8s_ok=0
      break
    fi
  done
  reload_dns
  for (( r = 0; r < nodes && k8s_ok; ++r )); do
    if ! eval "poll_60s podman $(plan --node $r --pod-ip 0 --part startup)"; then
      fail "manifest pod $r: the sidecar's startup probe never passed"
      for (( q = 0; q < nodes; ++q )); do podman logs "$RUN-k8s-microd$q" 2>&1 | grep -v level= | tail -3 | sed "s/^/  pod $q: /" >&2; done
      k8s_ok=0
    fi
  done
  if (( k8s_ok )); then
    # The declared ports listen on every interface of the pod (coordinator:
    # node 0 only), Admin on no TCP port (its Unix socket).
    ports_ok=0
    for (( r = 0; r < nodes; ++r )); do
      infra=$(podman pod inspect "$RUN-k8s-pod$r" --format '{{.InfraContainerID}}')
      listening=$(nsenter -t "$(podman inspect "$infra" --format '{{.State.Pid}}')" -n ss -ltnH | awk '{print $4}')
      want_ports=$(plan --node $r --pod-ip 0 --part ports | awk -v r=$r '$1 != "coordinator" || r == 0 {print $2}')
      ok=1
      for port in $want_ports; do grep -qxE "(0\.0\.0\.0|\*|\[::\]):$port" <<<"$listening" || ok=0; done
      # Admin on its Unix socket only (the probes that passed used it).
      grep -qE ":7471$" <<<"$listening" && ok=0
      ports_ok=$((ports_ok + ok))
    done
    if [[ $ports_ok == "$nodes" ]]; then
      pass "the manifests' pod: declared ports listening (coordinator on node 0), Admin on no TCP port"
    else
      fail "the manifests' pod ports: $ports_ok of $nodes pods as declared; node $((nodes - 1)): $(tr '\n' ' ' <<<"$listening")"
    fi
    for (( r = 0; r < nodes; ++r )); do
      eval "pns $(plan --node $r --pod-ip "$SUBNET.$(( 20 + r ))" --part trainer)" >/dev/null 2>>"$WORK/podman.log"
    done
    good=0
    want=$(awk -v n="$nodes" 'BEGIN { s = 0; for (r = 1; r <= n; ++r) s += r; printf "%g", s / n }')
    for (( r = 0; r < nodes; ++r )); do
      code=$(timeout 120 podman wait "$RUN-k8s-trainer$r" || echo timeout)
      podman logs "$RUN-k8s-trainer$r" >"$WORK/k8s.trainer$r" 2>&1
      if [[ $code == 0 ]] && grep -qx "rank $r of $nodes: first value of the averaged update $want" "$WORK/k8s.trainer$r"; then
        good=$((good + 1))
      fi
    done
    if [[ $good == "$nodes" ]]; then
      pass "the manifests' pod (four-nodes overlay) in podman: $nodes trainers averaged to $want through their sidecars"
    else
      fail "the manifests' pod: $good of $nodes trainers right: $(tail -q -n1 "$WORK"/k8s.trainer* | tr '\n' ';')"
    fi
  fi
fi

if [[ $FAILED != 0 ]]; then
  echo "image-test: FAILED" >&2
  exit 1
fi
echo "image-test: all checks passed"
