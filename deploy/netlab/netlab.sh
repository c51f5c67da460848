#!/usr/bin/env bash
# SPDX-License-Identifier: Apache-2.0
# netlab: an emulated cluster on one machine. N nodes, each in a network
# namespace of its own with its own address on a bridge that lives in a
# namespace of its own too: nothing in the machine's own namespace changes.
# Every node's link can be shaped (rate, one-way delay, jitter, loss), cut
# and partitioned while a job runs. Needs root, iproute2 and iptables.
#
#   netlab.sh check                        can labs be made here? (exit 0, or why not)
#   netlab.sh up [--nodes N] [--name NAME] [--owner PID] [SHAPE...]
#                                          makes a lab, prints its name; with --owner
#                                          it is removed once that process is gone
#   netlab.sh down NAME                    stops every process in it, removes it
#   netlab.sh shape NAME NODE|all SHAPE... changes links while a job runs
#   netlab.sh cut NAME NODE                the node's link carries nothing (silence,
#                                          not an error: as a pulled cable looks to peers)
#   netlab.sh partition NAME GROUP GROUP.. e.g. "0 1,2,3": nodes of different groups
#                                          no longer hear each other
#   netlab.sh heal NAME                    undoes cuts and partitions
#   netlab.sh addr NAME NODE               the node's address
#   netlab.sh ns NAME NODE                 the node's namespace (ip netns exec NS ...)
#   netlab.sh exec NAME NODE -- CMD...     runs CMD in the node's namespace
#   netlab.sh list                         labs on this machine
#   netlab.sh show NAME                    nodes, addresses, shaping, cuts
#   netlab.sh tamper NAME NODE --log FILE -- OPTIONS...
#                                          an attacker on the path into NODE
#                                          (microd-netlab-tamper: flips or replays)
#   netlab.sh capture NAME FILE|--stop     tcpdump of the switch's TCP packets
#
# SHAPE: --rate R (tc units: 100mbit, 1gbit, 10gbit; "none": unshaped),
#        --delay D and --jitter J (one way, per link: 100us, 0.1ms, 20ms),
#        --loss P (percent: 1 or 1%). Rate is applied both ways on a node's
#        link (tc tbf on each end of its veth); delay, jitter and loss on
#        the packets entering the node (so a round trip between two nodes
#        has both nodes' delays). This kernel's tc has no netem: delay and
#        jitter come from microd-netlab-delay on an NFQUEUE queue, loss from
#        iptables' statistic match.
#
# Names (mdl + 6 hex digits) and subnets (10.A.B.0/24) are unique per lab,
# so parallel tests never collide. Everything a lab made is removed by
# `down` (and by the --owner watcher, and by the ERR trap when `up` fails).
set -euo pipefail

NETLAB_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
STATE_ROOT=${NETLAB_STATE:-/run/microd-netlab}
MAX_NODES=64

die() { echo "netlab: $*" >&2; exit 1; }

iptables_cmd() {
  if command -v iptables-legacy >/dev/null 2>&1; then echo iptables-legacy
  elif command -v iptables >/dev/null 2>&1; then echo iptables
  else return 1; fi
}

helper_bin() {  # helper_bin NAME ENV_OVERRIDE: a helper built beside this script
  local candidates=("$2" "$NETLAB_DIR/../../build/deploy/netlab/$1"
                    "$(command -v "$1" 2>/dev/null || true)")
  for c in "${candidates[@]}"; do
    [[ -n "$c" && -x "$c" ]] && { echo "$c"; return 0; }
  done
  return 1
}
delay_bin() { helper_bin microd-netlab-delay "${NETLAB_DELAY_BIN:-}"; }
# The tamper helper's directory is the delay helper's unless told otherwise.
tamper_bin() {
  helper_bin microd-netlab-tamper \
    "${NETLAB_TAMPER_BIN:-${NETLAB_DELAY_BIN:+$(dirname "$NETLAB_DELAY_BIN")/microd-netlab-tamper}}"
}

# Why labs cannot be made here, or nothing.
why_not() {
  [[ $(id -u) -eq 0 ]] || { echo "needs root (network namespaces, veth, tc)"; return; }
  command -v ip >/dev/null || { echo "no 'ip' (Debian package iproute2)"; return; }
  command -v tc >/dev/null || { echo "no 'tc' (Debian package iproute2)"; return; }
  iptables_cmd >/dev/null || { echo "no iptables (Debian package iptables)"; return; }
  local probe="mdlprobe$$"
  if ! ip netns add "$probe" 2>/dev/null; then
    echo "cannot create a network namespace (ip netns add failed)"; return
  fi
  local err=""
  ip -n "$probe" link add probe0 type veth peer name probe1 2>/dev/null || err="cannot create a veth pair"
  [[ -z "$err" ]] && { ip -n "$probe" link add probebr type bridge 2>/dev/null || err="no bridge support"; }
  if [[ -z "$err" ]]; then
    ip -n "$probe" link set probe0 up 2>/dev/null || true
    tc -n "$probe" qdisc add dev probe0 root tbf rate 1gbit burst 128kb latency 20ms 2>/dev/null ||
      err="tc tbf is not available"
  fi
  ip netns del "$probe" 2>/dev/null || true
  [[ -n "$err" ]] && echo "$err"
  return 0
}

require_lab() {
  [[ -f "$STATE_ROOT/$1/nodes" ]] || die "no lab named '$1' (netlab.sh list)"
}
nodes_of() { cat "$STATE_ROOT/$1/nodes"; }
ns_of() { echo "$1-n$2"; }
br_of() { echo "$1-br"; }
addr_of() { echo "$(cat "$STATE_ROOT/$1/subnet").$(($2 + 1))"; }
check_node() {
  local n; n=$(nodes_of "$1")
  [[ "$2" =~ ^[0-9]+$ && "$2" -lt "$n" ]] || die "node '$2' is not in [0, $n) of lab $1"
}

# Microseconds from 100us / 0.1ms / 20ms / 1s / 0.
to_us() {
  local v=$1
  [[ "$v" =~ ^([0-9]+(\.[0-9]+)?)(us|ms|s)?$ ]] || die "bad time '$v' (e.g. 100us, 0.1ms, 20ms)"
  local num=${BASH_REMATCH[1]} unit=${BASH_REMATCH[3]:-ms}
  awk -v n="$num" -v u="$unit" 'BEGIN {
    f = (u == "us") ? 1 : (u == "ms") ? 1000 : 1000000; printf "%d\n", n * f + 0.5 }'
}
# Probability in [0, 1] from 1 / 1% / 0.5%.
to_probability() {
  local v=${1%\%}
  [[ "$v" =~ ^[0-9]+(\.[0-9]+)?$ ]] || die "bad loss '$1' (percent, e.g. 1 or 0.5%)"
  awk -v p="$v" 'BEGIN { if (p > 100) exit 1; printf "%.6f\n", p / 100 }' ||
    die "loss '$1' is over 100 %"
}
# Bytes per second from a tc rate (100mbit, 1gbit, 10gbit, 500kbit).
rate_bytes() {
  [[ "$1" =~ ^([0-9]+(\.[0-9]+)?)(kbit|mbit|gbit|bit)$ ]] ||
    die "bad rate '$1' (e.g. 100mbit, 1gbit, 10gbit, or none)"
  awk -v n="${BASH_REMATCH[1]}" -v u="${BASH_REMATCH[3]}" 'BEGIN {
    f = (u == "gbit") ? 1e9 : (u == "mbit") ? 1e6 : (u == "kbit") ? 1e3 : 1;
    printf "%d\n", n * f / 8 }'
}

# tbf on one device: burst of 1 ms worth (at least 64 KiB: whole GSO
# packets). The queue: on a node's own uplink (its NIC) 100 ms worth (at
# least 1 MiB), so that the host does not drop its own packets (a real NIC
# pushes back instead: several connections sending at once would otherwise
# lose packets before they leave the host); on the bridge's port towards a
# node (a switch's buffer, where traffic of several senders meets) 20 ms
# worth (at least 256 KiB).
apply_rate() {  # apply_rate NS DEV RATE QUEUE_MS
  local ns=$1 dev=$2 rate=$3 queue_ms=$4
  if [[ "$rate" == none ]]; then
    tc -n "$ns" qdisc del dev "$dev" root 2>/dev/null || true
    return
  fi
  local bps burst limit
  bps=$(rate_bytes "$rate")
  burst=$(( bps / 1000 > 65536 ? bps / 1000 : 65536 ))
  local floor=$(( queue_ms >= 100 ? 1048576 : 262144 ))
  limit=$(( bps * queue_ms / 1000 > floor ? bps * queue_ms / 1000 : floor ))
  tc -n "$ns" qdisc replace dev "$dev" root tbf rate "$rate" burst "$burst" limit "$limit"
}

# The node's ingress chain: partition drops first (chain NETLAB_PART, kept
# by shape), then random loss, then the delay queue.
apply_ingress() {  # apply_ingress LAB NODE
  local lab=$1 r=$2 ns ipt state
  ns=$(ns_of "$lab" "$r")
  ipt=$(iptables_cmd)
  state=$STATE_ROOT/$lab/node$r
  local loss delay_us jitter_us
  loss=$(cat "$state/loss") delay_us=$(cat "$state/delay_us") jitter_us=$(cat "$state/jitter_us")
  local want_delay=0
  [[ "$delay_us" -gt 0 || "$jitter_us" -gt 0 ]] && want_delay=1
  echo "$delay_us $jitter_us" > "$state/delay.conf"
  # The helper first (or told of the new values), then the rules.
  if [[ $want_delay -eq 1 ]]; then
    if [[ -f "$state/delay.pid" ]] && kill -0 "$(cat "$state/delay.pid")" 2>/dev/null; then
      kill -HUP "$(cat "$state/delay.pid")"
    else
      local bin
      bin=$(delay_bin) || die "delay and jitter need microd-netlab-delay (build it: make build)"
      ip netns exec "$ns" nice -n -10 "$bin" --queue 0 --config "$state/delay.conf" \
        > "$state/delay.log" 2>&1 &
      echo $! > "$state/delay.pid"
      # Bound to the queue before the rule sends packets there.
      local bound=0
      for _ in $(seq 50); do
        ip netns exec "$ns" grep -qs '^ *0 ' /proc/net/netfilter/nfnetlink_queue && { bound=1; break; }
        kill -0 "$(cat "$state/delay.pid")" 2>/dev/null || break
        sleep 0.05
      done
      [[ $bound -eq 1 ]] || die "microd-netlab-delay did not start on node $r: $(cat "$state/delay.log")"
    fi
  fi
  ip netns exec "$ns" "$ipt" -t mangle -F NETLAB
  ip netns exec "$ns" "$ipt" -t mangle -A NETLAB -j NETLAB_PART
  if [[ "$loss" != "0.000000" ]]; then
    ip netns exec "$ns" "$ipt" -t mangle -A NETLAB -m statistic --mode random \
      --probability "$loss" -j DROP
  fi
  if [[ $want_delay -eq 1 ]]; then
    ip netns exec "$ns" "$ipt" -t mangle -A NETLAB -j NFQUEUE --queue-num 0 --queue-bypass
  elif [[ -f "$state/delay.pid" ]]; then
    kill -TERM "$(cat "$state/delay.pid")" 2>/dev/null || true
    rm -f "$state/delay.pid"
  fi
}

# shape LAB NODE|all [--rate R] [--delay D] [--jitter J] [--loss P]
cmd_shape() {
  local lab=$1 which=$2
  shift 2
  require_lab "$lab"
  local rate="" delay="" jitter="" loss=""
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --rate) rate=$2; shift 2 ;;
      --delay) delay=$(to_us "$2"); shift 2 ;;
      --jitter) jitter=$(to_us "$2"); shift 2 ;;
      --loss) loss=$(to_probability "$2"); shift 2 ;;
      --rate=*) rate=${1#*=}; shift ;;
      --delay=*) delay=$(to_us "${1#*=}"); shift ;;
      --jitter=*) jitter=$(to_us "${1#*=}"); shift ;;
      --loss=*) loss=$(to_probability "${1#*=}"); shift ;;
      *) die "shape: unknown option '$1'" ;;
    esac
  done
  [[ -z "$rate" || "$rate" == none ]] || rate_bytes "$rate" > /dev/null
  local nodes list=()
  nodes=$(nodes_of "$lab")
  if [[ "$which" == all ]]; then list=($(seq 0 $((nodes - 1))))
  else check_node "$lab" "$which"; list=("$which"); fi
  for r in "${list[@]}"; do
    local state=$STATE_ROOT/$lab/node$r
    [[ -n "$rate" ]] && echo "$rate" > "$state/rate"
    [[ -n "$delay" ]] && echo "$delay" > "$state/delay_us"
    [[ -n "$jitter" ]] && echo "$jitter" > "$state/jitter_us"
    [[ -n "$loss" ]] && echo "$loss" > "$state/loss"
    if [[ -n "$rate" ]]; then
      apply_rate "$(ns_of "$lab" "$r")" eth0 "$rate" 100
      apply_rate "$(br_of "$lab")" "p$r" "$rate" 20
    fi
    apply_ingress "$lab" "$r"
  done
}

kill_in_ns() {  # kill_in_ns NS: TERM, up to 5 s, then KILL
  local ns=$1 pids
  pids=$(ip netns pids "$ns" 2>/dev/null || true)
  [[ -z "$pids" ]] && return 0
  kill -TERM $pids 2>/dev/null || true
  for _ in $(seq 50); do
    pids=$(ip netns pids "$ns" 2>/dev/null || true)
    [[ -z "$pids" ]] && return 0
    sleep 0.1
  done
  kill -KILL $pids 2>/dev/null || true
  sleep 0.1
}

cmd_down() {
  local lab=$1
  [[ "$lab" =~ ^mdl[0-9a-f]{6}$ ]] || die "'$lab' is not a lab name (mdl + 6 hex digits)"
  local dir=$STATE_ROOT/$lab
  if [[ -f "$dir/watcher.pid" ]]; then
    local w; w=$(cat "$dir/watcher.pid")
    [[ "$w" != "${NETLAB_WATCHER_SELF:-}" ]] && kill "$w" 2>/dev/null || true
  fi
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep -E "^$lab-(br|n[0-9]+)$" || true); do
    kill_in_ns "$ns"
    ip netns del "$ns" 2>/dev/null || true
  done
  rm -rf "$dir"
}

new_name() {
  for _ in $(seq 20); do
    local name
    name="mdl$(od -An -N3 -tx1 /dev/urandom | tr -d ' \n')"
    if [[ ! -e "$STATE_ROOT/$name" ]] && ! ip netns list 2>/dev/null | grep -q "^$name-"; then
      echo "$name"; return 0
    fi
  done
  die "could not find a free lab name"
}

new_subnet() {
  local used
  used=$(cat "$STATE_ROOT"/*/subnet 2>/dev/null || true)
  for _ in $(seq 100); do
    local s="10.$((64 + RANDOM % 64)).$((RANDOM % 256))"
    grep -qx "$s" <<< "$used" || { echo "$s"; return 0; }
  done
  die "could not find a free subnet"
}

cmd_up() {
  local nodes=4 name="" owner="" shape=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --nodes) nodes=$2; shift 2 ;;
      --nodes=*) nodes=${1#*=}; shift ;;
      --name) name=$2; shift 2 ;;
      --name=*) name=${1#*=}; shift ;;
      --owner) owner=$2; shift 2 ;;
      --owner=*) owner=${1#*=}; shift ;;
      --rate|--delay|--jitter|--loss) shape+=("$1" "$2"); shift 2 ;;
      --rate=*|--delay=*|--jitter=*|--loss=*) shape+=("$1"); shift ;;
      *) die "up: unknown option '$1'" ;;
    esac
  done
  [[ "$nodes" =~ ^[0-9]+$ && "$nodes" -ge 1 && "$nodes" -le $MAX_NODES ]] ||
    die "--nodes must be in [1, $MAX_NODES]"
  [[ -z "$owner" || "$owner" =~ ^[0-9]+$ ]] || die "--owner must be a pid"
  local why; why=$(why_not)
  [[ -z "$why" ]] || die "cannot make a lab here: $why"
  mkdir -p "$STATE_ROOT"
  # Serialise name and subnet choice between labs made at once.
  exec 9> "$STATE_ROOT/.lock"
  flock -w 30 9 || die "could not lock $STATE_ROOT/.lock"
  if [[ -z "$name" ]]; then name=$(new_name)
  else
    [[ "$name" =~ ^mdl[0-9a-f]{6}$ ]] || die "--name must be mdl + 6 hex digits"
    [[ ! -e "$STATE_ROOT/$name" ]] || die "a lab named $name exists"
  fi
  local subnet; subnet=$(new_subnet)
  local dir=$STATE_ROOT/$name
  mkdir -p "$dir"
  echo "$subnet" > "$dir/subnet"
  flock -u 9
  UP_NAME=$name UP_DONE=0
  trap netlab_up_exit EXIT
  trap 'exit 130' INT TERM
  echo "$nodes" > "$dir/nodes"
  local ipt; ipt=$(iptables_cmd)
  local br; br=$(br_of "$name")
  ip netns add "$br"
  ip -n "$br" link set lo up
  ip -n "$br" link add br0 type bridge stp_state 0
  ip -n "$br" link set br0 up
  for ((r = 0; r < nodes; r++)); do
    local ns; ns=$(ns_of "$name" "$r")
    ip netns add "$ns"
    ip -n "$ns" link set lo up
    ip -n "$br" link add "p$r" type veth peer name eth0 netns "$ns"
    ip -n "$br" link set "p$r" master br0
    ip -n "$br" link set "p$r" up
    ip netns exec "$ns" sysctl -qw net.ipv6.conf.all.disable_ipv6=1 2>/dev/null || true
    ip -n "$ns" addr add "$subnet.$((r + 1))/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip netns exec "$ns" "$ipt" -t mangle -N NETLAB
    ip netns exec "$ns" "$ipt" -t mangle -N NETLAB_PART
    ip netns exec "$ns" "$ipt" -t mangle -A PREROUTING -i eth0 -j NETLAB
    mkdir -p "$dir/node$r"
    echo none > "$dir/node$r/rate"
    echo 0 > "$dir/node$r/delay_us"
    echo 0 > "$dir/node$r/jitter_us"
    echo 0.000000 > "$dir/node$r/loss"
  done
  cmd_shape "$name" all "${shape[@]}"
  # Wait until every port forwards (a port starts in a learning state).
  for ((r = 0; r < nodes; r++)); do
    for _ in $(seq 100); do
      bridge -n "$br" link show dev "p$r" | grep -q "state forwarding" && break
      sleep 0.05
    done
  done
  if [[ -n "$owner" ]]; then
    # Removes the lab once the owner is gone (a test that crashed), checking
    # every second for at most a day.
    NETLAB_WATCHER_SELF="" setsid bash -c '
      for _ in $(seq 86400); do kill -0 '"$owner"' 2>/dev/null || break; sleep 1; done
      NETLAB_WATCHER_SELF=$$ "'"$NETLAB_DIR/netlab.sh"'" down '"$name"'
    ' < /dev/null > /dev/null 2>&1 &
    echo $! > "$dir/watcher.pid"
  fi
  UP_DONE=1
  echo "$name"
}

# On a failed or interrupted `up`: remove what was made.
netlab_up_exit() {
  local code=$?
  if [[ "${UP_DONE:-1}" -eq 0 ]]; then
    echo "netlab: making lab $UP_NAME failed; removing what was made" >&2
    cmd_down "$UP_NAME" || true
    [[ $code -eq 0 ]] && code=1
  fi
  exit $code
}

cmd_cut() {
  local lab=$1 r=$2
  require_lab "$lab"; check_node "$lab" "$r"
  bridge -n "$(br_of "$lab")" link set dev "p$r" state 0
  touch "$STATE_ROOT/$lab/node$r/cut"
}

cmd_partition() {
  local lab=$1
  shift
  require_lab "$lab"
  [[ $# -ge 2 ]] || die "partition: give at least two groups, e.g. '0 1,2,3'"
  local nodes; nodes=$(nodes_of "$lab")
  local -a group_of
  for ((r = 0; r < nodes; r++)); do group_of[$r]=-1; done
  local g=0
  for grp in "$@"; do
    IFS=, read -ra members <<< "$grp"
    for m in "${members[@]}"; do
      check_node "$lab" "$m"
      [[ ${group_of[$m]} -eq -1 ]] || die "partition: node $m is in two groups"
      group_of[$m]=$g
    done
    g=$((g + 1))
  done
  local ipt; ipt=$(iptables_cmd)
  for ((r = 0; r < nodes; r++)); do
    [[ ${group_of[$r]} -ge 0 ]] || continue
    local ns; ns=$(ns_of "$lab" "$r")
    for ((q = 0; q < nodes; q++)); do
      [[ $q -ne $r && ${group_of[$q]} -ge 0 && ${group_of[$q]} -ne ${group_of[$r]} ]] || continue
      ip netns exec "$ns" "$ipt" -t mangle -A NETLAB_PART -s "$(addr_of "$lab" "$q")" -j DROP
    done
    touch "$STATE_ROOT/$lab/node$r/partitioned"
  done
}

cmd_heal() {
  local lab=$1
  require_lab "$lab"
  local nodes ipt; nodes=$(nodes_of "$lab"); ipt=$(iptables_cmd)
  for ((r = 0; r < nodes; r++)); do
    ip netns exec "$(ns_of "$lab" "$r")" "$ipt" -t mangle -F NETLAB_PART
    if [[ -f "$STATE_ROOT/$lab/node$r/cut" ]]; then
      bridge -n "$(br_of "$lab")" link set dev "p$r" state 3
    fi
    rm -f "$STATE_ROOT/$lab/node$r/cut" "$STATE_ROOT/$lab/node$r/partitioned"
  done
}

# tamper NAME NODE --log FILE -- HELPER_OPTIONS...: an attacker on the path of
# the packets entering NODE (microd-netlab-tamper on NFQUEUE queue 1, ahead
# of the shaping chain); what it did goes to FILE. Stays until `down`.
cmd_tamper() {
  local lab=$1 r=$2 log=""
  shift 2
  [[ "${1:-}" == "--log" && $# -ge 3 && "$3" == "--" ]] || die "usage: tamper NAME NODE --log FILE -- OPTIONS..."
  log=$2
  shift 3
  require_lab "$lab"; check_node "$lab" "$r"
  local ns bin ipt state pid
  ns=$(ns_of "$lab" "$r") ipt=$(iptables_cmd) state=$STATE_ROOT/$lab/node$r
  bin=$(tamper_bin) || die "tamper needs microd-netlab-tamper (build it: make build)"
  [[ ! -f "$state/tamper.pid" ]] || die "node $r already has a tamper helper"
  ip netns exec "$ns" "$bin" --queue 1 "$@" > "$log" 2>&1 &
  pid=$!
  echo "$pid" > "$state/tamper.pid"
  local bound=0
  for _ in $(seq 50); do
    ip netns exec "$ns" grep -qs '^ *1 ' /proc/net/netfilter/nfnetlink_queue && { bound=1; break; }
    kill -0 "$pid" 2>/dev/null || break
    sleep 0.05
  done
  [[ $bound -eq 1 ]] || die "microd-netlab-tamper did not start on node $r: $(cat "$log")"
  ip netns exec "$ns" "$ipt" -t mangle -I PREROUTING 1 -i eth0 -p tcp \
    -j NFQUEUE --queue-num 1 --queue-bypass
}

# capture NAME FILE: every TCP packet crossing the lab's switch (tcpdump on
# its bridge, in the bridge's namespace) into FILE (pcap); capture NAME
# --stop ends it, the file complete.
cmd_capture() {
  local lab=$1 what=$2
  require_lab "$lab"
  local dir=$STATE_ROOT/$lab
  if [[ "$what" == "--stop" ]]; then
    [[ -f "$dir/capture.pid" ]] || die "no capture running in $lab"
    local pid; pid=$(cat "$dir/capture.pid")
    kill -INT "$pid" 2>/dev/null || true
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    rm -f "$dir/capture.pid"
    return 0
  fi
  command -v tcpdump >/dev/null || die "capture needs tcpdump (scripts/install-deps.sh)"
  [[ ! -f "$dir/capture.pid" ]] || die "a capture already runs in $lab"
  ip netns exec "$(br_of "$lab")" tcpdump -i br0 -U -n -s 0 -w "$what" tcp \
    > "$dir/capture.log" 2>&1 &
  echo $! > "$dir/capture.pid"
  # Listening once it said so (at most 5 s).
  for _ in $(seq 50); do
    grep -qs "listening on" "$dir/capture.log" && return 0
    kill -0 "$(cat "$dir/capture.pid")" 2>/dev/null || break
    sleep 0.1
  done
  die "tcpdump did not start: $(cat "$dir/capture.log")"
}

cmd_show() {
  local lab=$1
  require_lab "$lab"
  local nodes; nodes=$(nodes_of "$lab")
  echo "lab $lab: $nodes nodes on $(cat "$STATE_ROOT/$lab/subnet").0/24"
  for ((r = 0; r < nodes; r++)); do
    local s=$STATE_ROOT/$lab/node$r flags=""
    [[ -f "$s/cut" ]] && flags+=" CUT"
    [[ -f "$s/partitioned" ]] && flags+=" PARTITIONED"
    printf "  node %d  %-15s ns %-12s rate %-7s delay %sus jitter %sus loss %s%s\n" "$r" \
      "$(addr_of "$lab" "$r")" "$(ns_of "$lab" "$r")" "$(cat "$s/rate")" "$(cat "$s/delay_us")" \
      "$(cat "$s/jitter_us")" "$(cat "$s/loss")" "$flags"
  done
}

[[ $# -gt 0 ]] || { sed -n '2,40p' "$0"; exit 2; }
cmd=$1
shift
case "$cmd" in
  check)
    why=$(why_not)
    [[ -z "$why" ]] || { echo "netlab: cannot make a lab here: $why" >&2; exit 1; }
    delay_bin > /dev/null || echo "netlab: note: no microd-netlab-delay built: labs without delay only" >&2
    echo "netlab: labs can be made here"
    ;;
  up) cmd_up "$@" ;;
  down) [[ $# -eq 1 ]] || die "usage: down NAME"; cmd_down "$1" ;;
  shape) [[ $# -ge 2 ]] || die "usage: shape NAME NODE|all SHAPE..."; cmd_shape "$@" ;;
  cut) [[ $# -eq 2 ]] || die "usage: cut NAME NODE"; cmd_cut "$@" ;;
  partition) cmd_partition "$@" ;;
  heal) [[ $# -eq 1 ]] || die "usage: heal NAME"; cmd_heal "$1" ;;
  addr) [[ $# -eq 2 ]] || die "usage: addr NAME NODE"; require_lab "$1"; check_node "$1" "$2"
        addr_of "$1" "$2" ;;
  ns) [[ $# -eq 2 ]] || die "usage: ns NAME NODE"; require_lab "$1"; check_node "$1" "$2"
      ns_of "$1" "$2" ;;
  exec)
    [[ $# -ge 4 && "$3" == "--" ]] || die "usage: exec NAME NODE -- CMD..."
    require_lab "$1"; check_node "$1" "$2"
    ns=$(ns_of "$1" "$2"); shift 3
    exec ip netns exec "$ns" "$@"
    ;;
  list) ls "$STATE_ROOT" 2>/dev/null | grep -E '^mdl[0-9a-f]{6}$' || true ;;
  show) [[ $# -eq 1 ]] || die "usage: show NAME"; cmd_show "$1" ;;
  tamper) [[ $# -ge 5 ]] || die "usage: tamper NAME NODE --log FILE -- OPTIONS..."; cmd_tamper "$@" ;;
  capture) [[ $# -eq 2 ]] || die "usage: capture NAME FILE|--stop"; cmd_capture "$@" ;;
  -h|--help|help) sed -n '2,40p' "$0" ;;
  *) die "unknown command '$cmd' (netlab.sh --help)" ;;
esac
