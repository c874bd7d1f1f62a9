#!/usr/bin/env bash
# The GPU main job (issue 20): the seed's workload on one GPU — `kvbridge up 1p3d --device cuda`
# (READ mode over cuda_ipc, prefix caching off, fp8 KV, qwen2.5-7b with random weights generated
# on the GPU) driven by `kvbridge bench --best-of-n 8 --input-tokens 2048 --output-tokens 80`
# over BATCHES with the drain check after every batch; then the same load on 4 colocated GPU
# engines behind `kvbridge proxy --colocated --routing round-robin`, same GPU, same run. Prints
# one table (requests/s, latency p50/p90, output tokens/s, TTFT p50/p99, drained) per topology.
# Exit 0 only when both runs succeeded (no request error, every instance drained after every
# batch, no lease expired, no notification ignored).
#
#   KVB=build/bin/kvbridge scripts/gpu_main_job.sh            # on a machine with a GPU
#
# Env: KVB (the binary), MODEL (qwen2.5-7b: a preset, or a model directory), KV (fp8), BATCHES
# (1,8,16,32), SAMPLES (per batch, 32), OUT (where the JSON, table and logs go), TOPOLOGIES
# ("pd colocated"), SHARE (each engine's --gpu-memory-utilization, 0.22), MAX_SEQS (each
# engine's --max-num-seqs, 256: 32 requests x n=8).
set -uo pipefail
KVB=${KVB:-build/bin/kvbridge}
MODEL=${MODEL:-qwen2.5-7b}
KV=${KV:-fp8}
BATCHES=${BATCHES:-1,8,16,32}
SAMPLES=${SAMPLES:-32}
OUT=${OUT:-$(mktemp -d /tmp/kvb-gpu-main-XXXXXX)}
TOPOLOGIES=${TOPOLOGIES:-"pd colocated"}
SHARE=${SHARE:-0.22}
MAX_SEQS=${MAX_SEQS:-256}
mkdir -p "$OUT"
[[ -x $KVB ]] || { echo "gpu main job: no kvbridge at $KVB" >&2; exit 2; }

# Prompts longer than 2148 byte tokens (bench truncates each to --input-tokens +-100): the
# synthetic ones are 150-350 words, too short for a byte tokenizer.
python3 - "$OUT/prompts.jsonl" <<'PY'
import json, random, sys
words = ("the cache block engine prefill decode token river mountain quiet bright signal number "
         "garden window silver answer question history science music travel morning ocean").split()
rng = random.Random(20)
with open(sys.argv[1], "w") as f:
    for i in range(64):
        p = f"Request {i}: " + " ".join(rng.choice(words) for _ in range(700))
        f.write(json.dumps({"model_input": p}) + "\n")
PY
BENCH=(bench --prompts "$OUT/prompts.jsonl" --samples "$SAMPLES" --batches "$BATCHES" --best-of-n 8
  --input-tokens 2048 --output-tokens 80 --stream --check-drain --drain-timeout 10 --seed 1 --json)
free_port() {
  python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'
}
PIDS=()
cleanup() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null; done
  for p in "${PIDS[@]}"; do wait "$p" 2>/dev/null; done
  PIDS=()
}
trap cleanup EXIT
rc=0
gpu_used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }

if [[ " $TOPOLOGIES " == *" pd "* ]]; then
  L=$OUT/pd
  mkdir -p "$L"
  echo "gpu main job: up 1p3d --device cuda ($MODEL, $KV KV, READ, prefix caching off); GPU used $(gpu_used) MiB"
  t0=$SECONDS
  "$KVB" up 1p3d --device cuda --model "$MODEL" --port 0 --mode read --log-dir "$L" \
    --no-prefix-caching --gpu-memory-utilization "$SHARE" "--engine-arg=--kv-cache-dtype=$KV" \
    "--engine-arg=--max-num-seqs=$MAX_SEQS" >"$L/up.out" 2>&1 &
  UP=$!
  PIDS+=($UP)
  for _ in $(seq 1 1200); do
    grep -q "ready in" "$L/up.out" 2>/dev/null && break
    kill -0 $UP 2>/dev/null || break
    sleep 0.25
  done
  cat "$L/up.out"
  PROXY=$(sed -n 's|^OpenAI API: http://\([0-9.:]*\)/v1/completions.*|\1|p' "$L/up.out")
  if [[ -z $PROXY ]]; then
    echo "gpu main job: up 1p3d not ready"; rc=1
  else
    echo "gpu main job: ready after $((SECONDS - t0)) s; GPU used $(gpu_used) MiB"
    "$KVB" "${BENCH[@]}" --host "http://$PROXY" >"$OUT/pd.json" 2>"$L/bench.log" || rc=1
    tail -3 "$L/bench.log"
  fi
  kill -TERM $UP 2>/dev/null
  wait $UP 2>/dev/null
  PIDS=()
  sleep 1
  echo "gpu main job: after 1p3d stopped: GPU used $(gpu_used) MiB"
fi

if [[ " $TOPOLOGIES " == *" colocated "* ]]; then
  L=$OUT/colocated
  mkdir -p "$L"
  URLS=()
  for i in 0 1 2 3; do
    p=$(free_port)
    "$KVB" serve "$MODEL" --device cuda --port "$p" --gpu-memory-utilization "$SHARE" \
      --kv-cache-dtype "$KV" --no-enable-prefix-caching --max-num-seqs "$MAX_SEQS" >"$L/engine-$i.log" 2>&1 &
    PIDS+=($!)
    URLS+=("http://127.0.0.1:$p")
  done
  for u in "${URLS[@]}"; do
    for _ in $(seq 1 600); do
      python3 -c 'import sys, urllib.request; urllib.request.urlopen(sys.argv[1], timeout=1)' \
        "$u/health" 2>/dev/null && break
      sleep 0.25
    done
  done
  pp=$(free_port)
  DEC=()
  for u in "${URLS[@]}"; do DEC+=(--decode "$u"); done
  "$KVB" proxy --port "$pp" --colocated --routing round-robin "${DEC[@]}" >"$L/proxy.log" 2>&1 &
  PIDS+=($!)
  for _ in $(seq 1 200); do
    python3 - "http://127.0.0.1:$pp" <<'PY' 2>/dev/null && break
import json, sys, urllib.request
j = json.load(urllib.request.urlopen(sys.argv[1] + "/instances", timeout=1))
sys.exit(0 if sum(i["healthy"] for i in j["instances"]) == 4 else 1)
PY
    sleep 0.25
  done
  echo "gpu main job: 4 colocated engines + round-robin proxy up; GPU used $(gpu_used) MiB"
  "$KVB" "${BENCH[@]}" --host "http://127.0.0.1:$pp" >"$OUT/colocated.json" 2>"$L/bench.log" || rc=1
  tail -3 "$L/bench.log"
  cleanup
fi

python3 - "$OUT" $TOPOLOGIES <<'PY' | tee "$OUT/table.md"
import json, os, sys
out, tops = sys.argv[1], sys.argv[2:]
print("| topology | conc | requests | errors | req/s | latency p50 s | p90 s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | drained |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|")
for t in tops:
    path = os.path.join(out, t + ".json")
    if not os.path.exists(path) or os.path.getsize(path) == 0:
        print(f"| {t} | no result | | | | | | | | | | |")
        continue
    j = json.load(open(path))
    name = "1p3d P/D (cuda_ipc READ)" if t == "pd" else "4 colocated, round-robin"
    for b in j["batches"]:
        # (-1: the counter is not exported: a colocated engine has no connector)
        dr = all(d["drained"] for d in b["drains"]) and all(
            d["lease_expired_total"] <= 0 and d["notifications_ignored_total"] <= 0 for d in b["drains"])
        print(f"| {name} | {b['concurrency']} | {b['requests']} | {b['errors']} | {b['requests_per_s']:.2f} | "
              f"{b['latency_s']['p50']:.2f} | {b['latency_s']['p90']:.2f} | {b['output_tokens_per_s']:.0f} | "
              f"{b['ttft_s']['p50'] * 1e3:.0f} | {b['ttft_s']['p99'] * 1e3:.0f} | {b['tpot_s']['p50'] * 1e3:.1f} | "
              f"{'yes' if dr else 'NO'} ({len(b['drains'])} instances) |")
PY
if ((rc == 0)); then echo "gpu main job: PASS"; else echo "gpu main job: FAIL (logs in $OUT)"; fi
exit $rc
