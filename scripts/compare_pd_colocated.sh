#!/usr/bin/env bash
# compare_pd_colocated.sh — 1p1d (P/D) vs 2 colocated engines behind a round-robin proxy, same
# workload, each engine pinned to its own core with taskset. Prints throughput and TTFT/TPOT side
# by side. A FUNCTIONAL comparison on a small machine, not a performance claim: on 2 cores the
# proxy and the load generator share the engines' cores.
#
#   scripts/compare_pd_colocated.sh            # defaults below; BUILD=build, model small-seed0
#   BATCHES=4,8 SAMPLES=24 N=4 scripts/compare_pd_colocated.sh
#
# Knobs (environment): BUILD (build dir with bin/kvbridge), MODEL (model dir; made with
# `make-model --preset small --seed 0` when absent), BATCHES, SAMPLES, N (sent as n),
# INPUT_TOKENS, OUTPUT_TOKENS, CPUS ("0 1": the cores for engine A and engine B), KEEP_LOGS=1.
# Both runs: prefix caching off, fp32 KV, one model thread per engine (--model-threads 1, since
# taskset does not change what the engine sees as hardware concurrency), `kvbridge bench --stream
# --check-drain` (so TTFT/TPOT are measured and every instance must drain after each batch).
# Exit status: 0 when both runs succeed (no request error, drained), else 1.
set -euo pipefail

BUILD=${BUILD:-build}
KVB=${KVB:-$BUILD/bin/kvbridge}
MODEL=${MODEL:-$HOME/.cache/kvbridge/models/small-seed0}
BATCHES=${BATCHES:-2,4,8}
SAMPLES=${SAMPLES:-24}
N=${N:-4}
INPUT_TOKENS=${INPUT_TOKENS:-200}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-24}
read -r CPU_A CPU_B <<<"${CPUS:-0 1}"

[[ -x $KVB ]] || { echo "no kvbridge binary at $KVB (set BUILD=...)" >&2; exit 2; }
command -v taskset >/dev/null || { echo "taskset (util-linux) is needed" >&2; exit 2; }
command -v python3 >/dev/null || { echo "python3 is needed for the table" >&2; exit 2; }

WORK=$(mktemp -d /tmp/kvb-compare-XXXXXX)
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null || true; done
  PIDS=()
}
trap 'cleanup; [[ ${KEEP_LOGS:-0} == 1 ]] || rm -rf "$WORK"' EXIT

free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
wait_proxy() {  # proxy base url, instances expected healthy: the proxy probes each second
  for _ in $(seq 1 300); do
    if python3 - "$1" "$2" <<'EOF' 2>/dev/null; then return 0; fi
import json, sys, urllib.request
j = json.load(urllib.request.urlopen(sys.argv[1] + "/instances", timeout=1))
sys.exit(0 if sum(i["healthy"] for i in j["instances"]) == int(sys.argv[2]) else 1)
EOF
    sleep 0.2
  done
  echo "proxy $1 does not list $2 healthy instances; logs in $WORK" >&2
  KEEP_LOGS=1
  exit 1
}
wait_http() {  # url, what
  for _ in $(seq 1 600); do
    if python3 - "$1" <<'EOF' 2>/dev/null; then return 0; fi
import sys, urllib.request
urllib.request.urlopen(sys.argv[1], timeout=1).read()
EOF
    sleep 0.2
  done
  echo "$2 did not come up ($1); logs in $WORK" >&2
  KEEP_LOGS=1
  exit 1
}

if [[ ! -f $MODEL/config.json ]]; then
  echo "making the model in $MODEL"
  mkdir -p "$(dirname "$MODEL")"
  "$KVB" make-model --preset small --seed 0 --out "$MODEL" >"$WORK/make-model.log" 2>&1
fi

TOKEN=$(python3 -c 'import secrets; print(secrets.token_hex(16))')
ENGINE_ARGS=(--no-enable-prefix-caching --model-threads 1)
BENCH_ARGS=(--batches "$BATCHES" --samples "$SAMPLES" --best-of-n "$N" --input-tokens "$INPUT_TOKENS"
  --output-tokens "$OUTPUT_TOKENS" --stream --drain-timeout 5 --seed 1 --json)

run_topology() {  # name: pd | colocated
  local name=$1 pa pb pp url_a url_b
  pa=$(free_port); pb=$(free_port); pp=$(free_port)
  url_a=http://127.0.0.1:$pa; url_b=http://127.0.0.1:$pb
  if [[ $name == pd ]]; then
    local cfg='{"kv_connector":"KVBridgeConnector","kv_role":"%s","kv_connector_extra_config":{"mode":"read","transport":"auto"}}'
    # shellcheck disable=SC2059
    taskset -c "$CPU_A" "$KVB" serve "$MODEL" --port "$pa" "${ENGINE_ARGS[@]}" --cluster-token "$TOKEN" \
      --kv-transfer-config "$(printf "$cfg" kv_producer)" >"$WORK/$name-prefill.log" 2>&1 &
    PIDS+=($!)
    # shellcheck disable=SC2059
    taskset -c "$CPU_B" "$KVB" serve "$MODEL" --port "$pb" "${ENGINE_ARGS[@]}" --cluster-token "$TOKEN" \
      --kv-transfer-config "$(printf "$cfg" kv_consumer)" >"$WORK/$name-decode.log" 2>&1 &
    PIDS+=($!)
  else
    taskset -c "$CPU_A" "$KVB" serve "$MODEL" --port "$pa" "${ENGINE_ARGS[@]}" >"$WORK/$name-a.log" 2>&1 &
    PIDS+=($!)
    taskset -c "$CPU_B" "$KVB" serve "$MODEL" --port "$pb" "${ENGINE_ARGS[@]}" >"$WORK/$name-b.log" 2>&1 &
    PIDS+=($!)
  fi
  wait_http "$url_a/health" "$name engine A"
  wait_http "$url_b/health" "$name engine B"
  # The proxy starts once the engines answer, so its first health probes find them up.
  if [[ $name == pd ]]; then
    "$KVB" proxy --port "$pp" --cluster-token "$TOKEN" --prefill "$url_a" --decode "$url_b" \
      >"$WORK/$name-proxy.log" 2>&1 &
  else
    "$KVB" proxy --port "$pp" --colocated --routing round-robin --decode "$url_a" --decode "$url_b" \
      >"$WORK/$name-proxy.log" 2>&1 &
  fi
  PIDS+=($!)
  wait_http "http://127.0.0.1:$pp/health" "$name proxy"
  wait_proxy "http://127.0.0.1:$pp" 2
  echo "== $name: bench (${BATCHES} concurrency, $SAMPLES requests each, n=$N)" >&2
  local rc=0
  "$KVB" bench --host "http://127.0.0.1:$pp" "${BENCH_ARGS[@]}" --check-drain "$url_a" "$url_b" \
    >"$WORK/$name.json" 2>"$WORK/$name-bench.log" || rc=$?
  cleanup
  return $rc
}

rc=0
run_topology pd || rc=1
run_topology colocated || rc=1
# JSON_OUT=DIR keeps both bench reports (pd.json, colocated.json) for scripts/plot_bench.py.
if [[ -n ${JSON_OUT:-} ]]; then
  mkdir -p "$JSON_OUT"
  cp "$WORK/pd.json" "$WORK/colocated.json" "$JSON_OUT/" 2>/dev/null || true
fi

python3 - "$WORK/pd.json" "$WORK/colocated.json" <<'EOF'
import json, sys
runs = []
for path, label in zip(sys.argv[1:], ["1p1d (P/D)", "2 colocated"]):
    try:
        runs.append((label, json.load(open(path))))
    except Exception as e:
        print(f"{label}: no report ({e})")
        sys.exit(0)
print("functional comparison on this machine (each engine pinned to one core; proxy + bench share them)")
hdr = f"{'topology':<13}{'conc':>5}{'errors':>7}{'req/s':>8}{'tok/s':>8}{'lat_p50_s':>10}" \
      f"{'ttft_p50_ms':>12}{'ttft_p99_ms':>12}{'tpot_p50_ms':>12}{'tpot_p99_ms':>12}{'drained':>8}"
print(hdr)
by_conc = {}
for label, r in runs:
    for b in r["batches"]:
        by_conc.setdefault(b["concurrency"], []).append((label, b))
for conc in sorted(by_conc):
    for label, b in by_conc[conc]:
        drained = all(d["drained"] and not d["error"] for d in b["drains"])
        print(f"{label:<13}{conc:>5}{b['errors']:>7}{b['requests_per_s']:>8.2f}"
              f"{b['output_tokens_per_s']:>8.1f}{b['latency_s']['p50']:>10.3f}"
              f"{1e3*b['ttft_s']['p50']:>12.1f}{1e3*b['ttft_s']['p99']:>12.1f}"
              f"{1e3*b['tpot_s']['p50']:>12.2f}{1e3*b['tpot_s']['p99']:>12.2f}{str(drained):>8}")
for label, r in runs:
    print(f"{label}: {'OK' if r['ok'] else 'FAILED'}")
EOF
exit $rc
