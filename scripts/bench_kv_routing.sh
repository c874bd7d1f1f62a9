#!/usr/bin/env bash
# Multi-turn MT-bench on `kvbridge up 2p2d`, KV-aware routing against round-robin, with the
# P/D skip off in both arms and then on in both (docs/proxy.md "KV-aware routing"). Each arm gets
# a fresh topology (cold caches), the same conversations (greedy, fixed answer length).
#
#   scripts/bench_kv_routing.sh [KVBRIDGE] [MODEL_DIR] [CONVERSATIONS] [CONCURRENCY] \
#       [ANSWER_TOKENS] [SKIP_THRESHOLD]
# defaults: build/bin/kvbridge, the `up` default model, 80, 8, 64, 64. Prints each arm's
# per-turn table, then the turn-2 ratios kv-aware / round-robin.
# Environment: DECODE_KV_ROLE=kv_both gives every arm decodes that kv-aware routing may also send
# prefill legs (`up --decode-kv-role`; default kv_consumer); SKIP_ARMS=0 runs the two skip-off
# arms only.
set -euo pipefail
BIN=${1:-build/bin/kvbridge}
MODEL=${2:-}
CONV=${3:-80}
CONC=${4:-8}
ANSWER=${5:-64}
SKIP=${6:-64}
PROMPTS=${PROMPTS:-$(dirname "$0")/../../shared/data/mt_bench/question.jsonl}
OUT=$(mktemp -d /tmp/kvb-kvroute-bench-XXXXXX)

run_arm() {  # name routing skip
  local name=$1 routing=$2 skip=$3 log="$OUT/$1.up.log"
  local args=(up 2p2d --port 0 --log-dir "$OUT/$name" --routing "$routing" --pd-skip-threshold "$skip"
    --decode-kv-role "${DECODE_KV_ROLE:-kv_consumer}")
  [[ -n "$MODEL" ]] && args+=(--model "$MODEL")
  "$BIN" "${args[@]}" >"$log" 2>&1 &
  local up=$!
  for _ in $(seq 600); do grep -q "ready in" "$log" && break; sleep 0.2; done
  local url
  url=$(grep -oE "proxy +http://127.0.0.1:[0-9]+" "$log" | grep -oE "http://.*")
  "$BIN" bench --host "$url" --multi-turn --prompts "$PROMPTS" --conversations "$CONV" \
    --concurrency "$CONC" --answer-tokens "$ANSWER" --json >"$OUT/$name.json"
  kill -TERM "$up"
  wait "$up" || true
  echo "== $name (routing $routing, --pd-skip-threshold $skip)"
  echo "== $name: computed by instance per turn"
  jq -c '.turns[] | {turn, computed_by_instance}' "$OUT/$name.json"
  jq -r '.turns[] | "turn \(.turn): requests \(.requests) errors \(.errors) ttft_p50 \(.ttft_p50_s*1000|floor) ms ttft_p90 \(.ttft_p90_s*1000|floor) ms prompt_tokens \(.prompt_tokens) computed \(.prompt_tokens_computed) hit_rate \(.cache_hit_rate*1000|floor/1000)"' "$OUT/$name.json"
}

ratio() {  # a b field
  jq -n --slurpfile a "$OUT/$1.json" --slurpfile b "$OUT/$2.json" \
    "(\$a[0].turns[1].$3 / \$b[0].turns[1].$3) * 1000 | floor / 1000"
}

run_arm kv-noskip kv-aware -1
run_arm rr-noskip round-robin -1
if [[ "${SKIP_ARMS:-1}" != 0 ]]; then
  run_arm kv-skip kv-aware "$SKIP"
  run_arm rr-skip round-robin "$SKIP"
fi
echo "== turn 2, kv-aware / round-robin (decodes ${DECODE_KV_ROLE:-kv_consumer})"
echo "skip off: prompt tokens computed $(ratio kv-noskip rr-noskip prompt_tokens_computed), TTFT p50 $(ratio kv-noskip rr-noskip ttft_p50_s)"
if [[ "${SKIP_ARMS:-1}" != 0 ]]; then
  echo "skip on:  prompt tokens computed $(ratio kv-skip rr-skip prompt_tokens_computed), TTFT p50 $(ratio kv-skip rr-skip ttft_p50_s)"
fi
echo "(JSON and logs in $OUT)"
