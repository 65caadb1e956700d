#!/usr/bin/env bash
# Multi-host runs on one machine: N network namespaces ("hosts") joined by veth pairs to a
# bridge, each host's link shaped with tc (netem rate and delay when the kernel has netem, a
# token bucket for the rate alone otherwise), and one rank per host over TCP, for every
# combination of the rates and delays given:
#
#   MODE=train (default): `wagma train` with each algorithm of ALGOS; prints one JSON line per
#     combination and algorithm: {"rate", "delay", "shaping", "algo", "samples_per_s",
#     "wait_fraction", "final_metrics"}.
#   MODE=bench: `wagma bench imbalance` (every algorithm on the same compute draws, a model of
#     MODEL floats); prints one JSON line per combination: {"rate", "delay", "shaping", "rows":
#     [{"algo", "samples_per_s", "vs_allreduce", "wait_fraction"}]}.
#   MODE=partition: one elastic `wagma train` (the first algorithm of ALGOS, timeout TIMEOUT
#     [10] s); once rank 0 has evaluated iteration AT [40], hosts SPLIT [HOSTS/2+1] and above
#     move to a bridge of their own, cut off from the others but not from each other. Prints
#     one JSON line per rank: {"rank", "exit", "after_split_s", "error"} (its error, or its
#     last line of stderr), then {"summary": rank 0's summary.json} when rank 0 wrote one.
#
# Needs root and iproute2. The namespaces, veths and bridge are removed on exit, also on
# failure or interruption.
#
# Environment (defaults in brackets): WAGMA [target/release/wagma], MODE [train], HOSTS [4],
# RATES ["1gbit 10gbit"], DELAYS ["0.1ms 5ms"], STEPS [60], PROFILE [paper-resnet],
# TIME_SCALE [0.05], ALGOS ["wagma allreduce-sgd local-sgd d-psgd ad-psgd sgp eager-sgd"],
# MODEL [262144] (bench), TRAIN_ARGS [""] (more `wagma train` options).
set -euo pipefail

WAGMA=${WAGMA:-target/release/wagma}
MODE=${MODE:-train}
HOSTS=${HOSTS:-4}
RATES=${RATES:-"1gbit 10gbit"}
DELAYS=${DELAYS:-"0.1ms 5ms"}
STEPS=${STEPS:-60}
MODEL=${MODEL:-262144}
PROFILE=${PROFILE:-paper-resnet}
TIME_SCALE=${TIME_SCALE:-0.05}
ALGOS=${ALGOS:-"wagma allreduce-sgd local-sgd d-psgd ad-psgd sgp eager-sgd"}
TRAIN_ARGS=${TRAIN_ARGS:-}

WAGMA=$(realpath "$WAGMA")
TAG="wg$$"
NET="10.$(( ($$ % 200) + 20 )).$(( ($$ / 200) % 250 ))"
BRIDGE="${TAG}b"

cleanup() {
  set +e
  for pid in $(jobs -p); do kill "$pid" 2>/dev/null; done
  for i in $(seq 0 $((HOSTS - 1))); do
    ip netns del "${TAG}n$i" 2>/dev/null
    ip link del "${TAG}h$i" 2>/dev/null
  done
  ip link del "$BRIDGE" 2>/dev/null
  ip link del "${BRIDGE}2" 2>/dev/null
}
trap cleanup EXIT INT TERM

ip link add "$BRIDGE" type bridge
ip link set "$BRIDGE" up
for i in $(seq 0 $((HOSTS - 1))); do
  ns="${TAG}n$i"
  ip netns add "$ns"
  ip link add "${TAG}h$i" type veth peer name "${TAG}c$i"
  ip link set "${TAG}c$i" netns "$ns"
  ip link set "${TAG}h$i" master "$BRIDGE"
  ip link set "${TAG}h$i" up
  ip -n "$ns" addr add "$NET.$((i + 1))/24" dev "${TAG}c$i"
  ip -n "$ns" link set "${TAG}c$i" up
  ip -n "$ns" link set lo up
done

shape() { # rate delay -> prints the shaping actually applied
  local rate=$1 delay=$2 how=""
  for i in $(seq 0 $((HOSTS - 1))); do
    if ip netns exec "${TAG}n$i" tc qdisc replace dev "${TAG}c$i" root netem rate "$rate" delay "$delay" 2>/dev/null; then
      how="netem rate $rate delay $delay"
    else
      ip netns exec "${TAG}n$i" tc qdisc replace dev "${TAG}c$i" root tbf rate "$rate" burst 512kb latency 200ms
      how="tbf rate $rate (this kernel has no netem: no added delay)"
    fi
  done
  echo "$how"
}

# Starts `wagma ARGS...` as one rank per host in the background (their pids in `pids`); the
# ranks' outputs land in $out/rank-N.{out,err}.
start_on_hosts() {
  # A fresh random secret, which the ranks inherit through the environment: never on a
  # command line, where other users could read it.
  local -x WAGMA_SECRET
  WAGMA_SECRET=$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')
  local port=$(( 20000 + ($$ % 20000) + RANDOM % 1000 ))
  pids=()
  for i in $(seq 0 $((HOSTS - 1))); do
    ip netns exec "${TAG}n$i" env WAGMA_RANK="$i" WAGMA_WORLD_SIZE="$HOSTS" \
      WAGMA_RENDEZVOUS="$NET.1:$port" WAGMA_BIND="$NET.$((i + 1))" WAGMA_JOB_ID="$TAG" \
      "$WAGMA" "$@" > "$out/rank-$i.out" 2> "$out/rank-$i.err" &
    pids+=($!)
  done
}

# Runs `wagma ARGS...` as one rank per host. Fails, printing the ranks' errors, if one fails.
on_hosts() {
  start_on_hosts "$@"
  local failed=0
  for pid in "${pids[@]}"; do wait "$pid" || failed=1; done
  if [ "$failed" != 0 ]; then
    echo "a rank failed:" >&2
    cat "$out"/rank-*.err >&2
    return 1
  fi
}

# MODE=partition: see the header.
partition_run() {
  local timeout=${TIMEOUT:-10} at=${AT:-40} split=${SPLIT:-$(( HOSTS / 2 + 1 ))}
  local algo=${ALGOS%% *}
  # shellcheck disable=SC2086 # TRAIN_ARGS is a list of options
  start_on_hosts train --transport tcp --algo "$algo" --steps "$STEPS" --eval-every "$at" \
    --elastic --timeout "$timeout" --imbalance "$PROFILE" --time-scale "$TIME_SCALE" \
    --dataset builtin --quiet true --out "$out/run" $TRAIN_ARGS
  local waited=0
  until python3 - "$out/run/progress.jsonl" "$at" <<'PY'
import json, sys
try:
    its = [json.loads(l)["iteration"] for l in open(sys.argv[1]) if l.strip()]
except (OSError, ValueError, KeyError):
    its = []
sys.exit(0 if its and max(its) >= int(sys.argv[2]) else 1)
PY
  do
    sleep 0.2
    waited=$((waited + 1))
    if [ "$waited" -gt 1500 ]; then echo "rank 0 never reached iteration $at" >&2; return 1; fi
  done
  ip link add "${BRIDGE}2" type bridge
  ip link set "${BRIDGE}2" up
  for i in $(seq "$split" $((HOSTS - 1))); do ip link set "${TAG}h$i" master "${BRIDGE}2"; done
  local t_split ends=() codes=() left=$HOSTS
  t_split=$(date +%s.%N)
  # Each rank's end, to a tenth of a second.
  while [ "$left" -gt 0 ]; do
    for i in "${!pids[@]}"; do
      if [ -z "${ends[$i]:-}" ] && ! kill -0 "${pids[$i]}" 2>/dev/null; then
        ends[i]=$(date +%s.%N)
        left=$((left - 1))
      fi
    done
    sleep 0.1
  done
  for i in "${!pids[@]}"; do
    local code=0
    wait "${pids[$i]}" || code=$?
    codes[i]=$code
  done
  for i in "${!pids[@]}"; do
    python3 - "$i" "${codes[$i]}" "${ends[$i]}" "$t_split" "$out/rank-$i.err" <<'PY'
import json, sys
lines = [l for l in open(sys.argv[5]).read().splitlines() if l.strip()]
errors = [l for l in lines if l.startswith("Error")]
print(json.dumps({"rank": int(sys.argv[1]), "exit": int(sys.argv[2]),
                  "after_split_s": round(float(sys.argv[3]) - float(sys.argv[4]), 2),
                  "error": (errors or lines or [""])[-1]}))
PY
  done
  if [ -f "$out/run/summary.json" ]; then
    python3 -c 'import json,sys; print(json.dumps({"summary": json.load(open(sys.argv[1]))}))' "$out/run/summary.json"
  fi
}

out=$(mktemp -d)
if [ "$MODE" = partition ]; then
  partition_run
  rm -rf "$out"
  exit 0
fi
for rate in $RATES; do
  for delay in $DELAYS; do
    how=$(shape "$rate" "$delay")
    if [ "$MODE" = bench ]; then
      # Rank 0 of a job started by its own launcher (here: this script) prints the report.
      on_hosts bench imbalance --json --transport tcp --ranks "$HOSTS" --steps "$STEPS" \
        --model-params "$MODEL" --profile "$PROFILE" --time-scale "$TIME_SCALE" --algos "${ALGOS// /,}"
      python3 - "$out/rank-0.out" "$rate" "$delay" "$how" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
rows = [{"algo": x["algorithm"], "samples_per_s": round(x["samples_per_s"], 1),
         "vs_allreduce": x["vs_allreduce"] and round(x["vs_allreduce"], 3),
         "wait_fraction": round(x["wait_fraction"], 3)} for x in r["rows"]]
print(json.dumps({"rate": sys.argv[2], "delay": sys.argv[3], "shaping": sys.argv[4], "rows": rows}))
PY
    else
      for algo in $ALGOS; do
        # shellcheck disable=SC2086 # TRAIN_ARGS is a list of options
        on_hosts train --transport tcp --algo "$algo" --steps "$STEPS" --eval-every "$STEPS" \
          --imbalance "$PROFILE" --time-scale "$TIME_SCALE" --dataset builtin --quiet true --out "$out/run" $TRAIN_ARGS
        python3 - "$out/run/summary.json" "$rate" "$delay" "$how" <<'PY'
import json, sys
s = json.load(open(sys.argv[1]))
print(json.dumps({"rate": sys.argv[2], "delay": sys.argv[3], "shaping": sys.argv[4], "algo": s["label"],
                  "samples_per_s": round(s["samples_per_s"], 1), "wait_fraction": round(s["wait_fraction"], 3),
                  "final_metrics": s["final_metrics"]}))
PY
        rm -rf "$out/run"
      done
    fi
  done
done
rm -rf "$out"
