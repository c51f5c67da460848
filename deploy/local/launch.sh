#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# Starts a local microd cluster on this machine and runs a training program
# under it: N daemons (node 0 also serves the coordinator, ports chosen free),
# L copies of the program per node with MICROD_SOCKET / MICROD_LOCAL_RANK set.
# Logs go to one file per process. Everything is stopped when the program
# copies finish, on Ctrl-C, or on any error; the exit status is the first
# failing copy's. With more processes than cores the daemons get
# --gloo_io_nice=19 (unless MICROD_GLOO_IO_NICE is set).
#
#   deploy/local/launch.sh [--nodes N] [--local L] [--logs DIR] [--microd PATH]
#                          [--daemon-arg ARG]... [--show-first]
#                          [--net-rate R] [--net-delay D] [--net-loss P] [--netlab LAB]
#                          -- PROGRAM [ARGS...]
# --show-first also shows the first copy's output (node 0, local rank 0).
# --net-*: on an emulated network instead of loopback (deploy/netlab, root):
# every node, its daemon and its program copies in a network namespace of its
# own with its own address, links shaped as given (100mbit, 1gbit; 0.1ms;
# 1%), the lab removed at the end; --netlab LAB uses a lab made with
# `netlab.sh up`. The copies also get MICROD_NODE_ADDR (their node's address),
# MICROD_MASTER_ADDR (node 0's) and GLOO_SOCKET_IFNAME=eth0 for a framework's
# own rendezvous; MICROD_ADMIN is then a unix: address.
set -euo pipefail

NODES=4
LOCAL=1
LOGS=""
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
MICROD=${MICROD_BIN:-$ROOT/build/daemon/microd}
DAEMON_ARGS=()
SHOW_FIRST=0
NET_SHAPE=()
NETLAB=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) NODES=$2; shift 2 ;;
    --local) LOCAL=$2; shift 2 ;;
    --logs) LOGS=$2; shift 2 ;;
    --microd) MICROD=$2; shift 2 ;;
    --daemon-arg) DAEMON_ARGS+=("$2"); shift 2 ;;
    --nodes=*) NODES=${1#*=}; shift ;;
    --local=*) LOCAL=${1#*=}; shift ;;
    --logs=*) LOGS=${1#*=}; shift ;;
    --microd=*) MICROD=${1#*=}; shift ;;
    --daemon-arg=*) DAEMON_ARGS+=("${1#*=}"); shift ;;
    --show-first) SHOW_FIRST=1; shift ;;
    --net-rate|--net-delay|--net-loss) NET_SHAPE+=("--${1#--net-}" "$2"); shift 2 ;;
    --net-rate=*|--net-delay=*|--net-loss=*) o=${1%%=*}; NET_SHAPE+=("--${o#--net-}" "${1#*=}"); shift ;;
    --netlab) NETLAB=$2; shift 2 ;;
    --netlab=*) NETLAB=${1#*=}; shift ;;
    --) shift; break ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "launch.sh: unknown option $1 (see --help)" >&2; exit 2 ;;
  esac
done
[[ $# -gt 0 ]] || { echo "launch.sh: no program given after --" >&2; exit 2; }
[[ "$NODES" =~ ^[1-9][0-9]*$ && "$LOCAL" =~ ^[1-9][0-9]*$ ]] || {
  echo "launch.sh: --nodes and --local must be positive integers" >&2; exit 2; }
[[ -x "$MICROD" ]] || { echo "launch.sh: no microd at $MICROD (build first)" >&2; exit 2; }

NETLAB_SH=$ROOT/deploy/netlab/netlab.sh
OWN_LAB=0
if [[ ${#NET_SHAPE[@]} -gt 0 && -z "$NETLAB" ]]; then
  NETLAB=$("$NETLAB_SH" up --nodes "$NODES" --owner $$ "${NET_SHAPE[@]}") || {
    echo "launch.sh: could not make the emulated network (see above)" >&2; exit 1; }
  OWN_LAB=1
elif [[ -n "$NETLAB" && ${#NET_SHAPE[@]} -gt 0 ]]; then
  "$NETLAB_SH" shape "$NETLAB" all "${NET_SHAPE[@]}" || exit 1
fi
ADDR=()
NS=()
if [[ -n "$NETLAB" ]]; then
  for ((r = 0; r < NODES; r++)); do
    ADDR+=("$("$NETLAB_SH" addr "$NETLAB" "$r")") || {
      echo "launch.sh: lab $NETLAB has no node $r (--nodes $NODES)" >&2; exit 2; }
    NS+=("$("$NETLAB_SH" ns "$NETLAB" "$r")")
  done
fi
# The command prefix that runs something in node r's namespace (nothing on
# loopback); it execs, so $! is the program's own pid.
in_node() {
  IN_NODE=(env)
  [[ -n "$NETLAB" ]] && IN_NODE=(ip netns exec "${NS[$1]}")
  return 0
}

RUN=$(mktemp -d "${TMPDIR:-/tmp}/microd-local-XXXXXX")
[[ -n "$LOGS" ]] || LOGS=$RUN/logs
mkdir -p "$LOGS"
DAEMONS=()
PROGRAMS=()

cleanup() {
  local code=$?
  for p in "${PROGRAMS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${DAEMONS[@]}"; do kill -TERM "$p" 2>/dev/null || true; done
  for _ in $(seq 50); do
    local alive=0
    for p in "${DAEMONS[@]}"; do kill -0 "$p" 2>/dev/null && alive=1; done
    [[ $alive -eq 0 ]] && break
    sleep 0.1
  done
  for p in "${DAEMONS[@]}"; do kill -KILL "$p" 2>/dev/null || true; done
  rm -rf "$RUN/sock"
  [[ $OWN_LAB -eq 1 ]] && "$NETLAB_SH" down "$NETLAB"
  exit $code
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_file() {  # wait_file PATH: until it holds a port, 30 s at most
  for _ in $(seq 300); do
    [[ -s "$1" ]] && { cat "$1"; return 0; }
    sleep 0.1
  done
  echo "launch.sh: timed out waiting for $1 (see $LOGS)" >&2
  return 1
}

# All nodes share this machine: with more processes (daemons and programs)
# than cores, Gloo's network thread busy-waiting would cost each small
# collective a scheduler slice; lower its priority (microd --gloo_io_nice)
# unless the environment or a --daemon-arg says otherwise.
NICE_ARGS=()
if [[ -z "${MICROD_GLOO_IO_NICE:-}" ]] && (( NODES * (LOCAL + 1) > $(nproc) )); then
  NICE_ARGS=("--gloo_io_nice=19")
fi

if [[ -n "$NETLAB" ]]; then
  # Node 0 serves the coordinator on its lab address: with a job token.
  (umask 077; head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$RUN/token")
fi
for ((r = 0; r < NODES; r++)); do
  args=("--socket=$RUN/sock/node$r/microd.sock" "--local_size=$LOCAL" "--nodes=$NODES"
        "--node_rank=$r" "--node_name=node$r" "${NICE_ARGS[@]}")
  if [[ -n "$NETLAB" ]]; then
    args+=("--admin=unix:$RUN/admin$r.sock" "--token_file=$RUN/token")
    host=${ADDR[0]}
  else
    args+=("--admin=127.0.0.1:0" "--admin_port_file=$RUN/admin$r")
    host=127.0.0.1
  fi
  if [[ $r -eq 0 ]]; then
    args+=("--coordinator_listen=$host:0" "--coordinator_port_file=$RUN/coordinator")
  else
    args+=("--coordinator=$host:$COORDINATOR_PORT")
  fi
  in_node "$r"
  "${IN_NODE[@]}" "$MICROD" "${args[@]}" "${DAEMON_ARGS[@]}" > "$LOGS/microd-node$r.log" 2>&1 &
  DAEMONS+=($!)
  [[ $r -eq 0 ]] && COORDINATOR_PORT=$(wait_file "$RUN/coordinator")
done
ADMINS=()
for ((r = 0; r < NODES; r++)); do
  if [[ -n "$NETLAB" ]]; then
    ADMINS+=("unix:$RUN/admin$r.sock")
  else
    ADMINS+=("127.0.0.1:$(wait_file "$RUN/admin$r")")
  fi
done
# Serving once the socket exists; a daemon that exited instead is an error.
for ((r = 0; r < NODES; r++)); do
  for _ in $(seq 600); do
    [[ -S "$RUN/sock/node$r/microd.sock" ]] && break
    if ! kill -0 "${DAEMONS[$r]}" 2>/dev/null; then
      echo "launch.sh: microd of node $r exited:" >&2
      tail -n 5 "$LOGS/microd-node$r.log" >&2
      exit 1
    fi
    sleep 0.1
  done
  [[ -S "$RUN/sock/node$r/microd.sock" ]] || {
    echo "launch.sh: node $r never opened its socket (see $LOGS)" >&2; exit 1; }
done
if [[ -n "$NETLAB" ]]; then
  echo "launch.sh: $NODES daemons up on emulated network $NETLAB (${ADDR[*]}; admin ${ADMINS[*]}; logs in $LOGS)" >&2
else
  echo "launch.sh: $NODES daemons up (admin ${ADMINS[*]}; logs in $LOGS)" >&2
fi

for ((r = 0; r < NODES; r++)); do
  envs=()
  if [[ -n "$NETLAB" ]]; then
    envs=("MICROD_NODE_ADDR=${ADDR[$r]}" "MICROD_MASTER_ADDR=${ADDR[0]}"
          "GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-eth0}")
  fi
  for ((l = 0; l < LOCAL; l++)); do
    log="$LOGS/program-node$r-local$l.log"
    in_node "$r"
    run=("${IN_NODE[@]}" env "${envs[@]}" MICROD_SOCKET="$RUN/sock/node$r/microd.sock"
         MICROD_LOCAL_RANK="$l" MICROD_ADMIN="${ADMINS[$r]}" "$@")
    if [[ $SHOW_FIRST -eq 1 && $r -eq 0 && $l -eq 0 ]]; then
      "${run[@]}" > >(tee "$log" >&2) 2>&1 &
    else
      "${run[@]}" > "$log" 2>&1 &
    fi
    PROGRAMS+=($!)
  done
done

status=0
for p in "${PROGRAMS[@]}"; do
  code=0
  wait "$p" || code=$?
  [[ $status -eq 0 && $code -ne 0 ]] && status=$code
done
PROGRAMS=()
if [[ $status -ne 0 ]]; then
  echo "launch.sh: a program copy failed (status $status); logs in $LOGS" >&2
fi
exit $status
