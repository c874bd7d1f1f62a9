#!/usr/bin/env bash
# The main job (README quick start, first command), once built: a 1p3d READ-mode P/D topology
# with prefix caching off, driven by `kvbridge bench --best-of-n 8` over several concurrency
# levels with the drain check after every batch, then stopped. Exit 0 only when every request
# succeeded, every instance drained, and no lease expired / no notification was ignored.
# Env: PORT (proxy, default 10001), LOG_DIR, MODEL_DIR, PREFILL_KV_BLOCKS, SAMPLES, BATCHES.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=build/bin/kvbridge
PORT=${PORT:-10001}
LOG_DIR=${LOG_DIR:-$(mktemp -d /tmp/kvbridge-main-XXXXXX)}
MODEL_DIR=${MODEL_DIR:-models/small}
PREFILL_KV_BLOCKS=${PREFILL_KV_BLOCKS:-64}
SAMPLES=${SAMPLES:-32}
BATCHES=${BATCHES:-1,4,8}
PROMPTS=()
if [[ -f ../shared/data/mt_bench/prompts.jsonl ]]; then
  PROMPTS=(--prompts ../shared/data/mt_bench/prompts.jsonl)
else
  echo "main job: ../shared/data/mt_bench/prompts.jsonl not found; bench builds its own prompts"
fi
mkdir -p "$LOG_DIR"
echo "main job: kvbridge up 1p3d (READ mode, prefix caching off, prefill pool $PREFILL_KV_BLOCKS blocks); logs in $LOG_DIR"
"$BIN" up 1p3d --port "$PORT" --mode read --model "$MODEL_DIR" --log-dir "$LOG_DIR" \
  --no-prefix-caching --prefill-kv-blocks "$PREFILL_KV_BLOCKS" >"$LOG_DIR/up.out" 2>&1 &
UP_PID=$!
cleanup() {
  if kill -0 "$UP_PID" 2>/dev/null; then
    kill -TERM "$UP_PID" 2>/dev/null || true
    wait "$UP_PID" 2>/dev/null || true
  fi
}
trap cleanup EXIT
for _ in $(seq 1 600); do
  grep -q "ready in" "$LOG_DIR/up.out" 2>/dev/null && break
  if ! kill -0 "$UP_PID" 2>/dev/null; then
    echo "main job: kvbridge up exited before ready:"; cat "$LOG_DIR/up.out"; exit 1
  fi
  sleep 0.5
done
cat "$LOG_DIR/up.out"
grep -q "ready in" "$LOG_DIR/up.out" || { echo "main job: topology not ready after 300 s"; exit 1; }
# Watch the prefill's pool while the bench runs: peak held blocks vs pool size, and how many
# times the run cycles the pool (prompt blocks allocated / pool blocks). A leak must bite.
python3 - "$PORT" "$LOG_DIR/pool.txt" <<'PY' &
import json, sys, time, urllib.request
port, out = sys.argv[1], sys.argv[2]
def get(url):
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()
def metric(text, name):
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1]); found = True
    return total if found else None
inst = json.loads(get(f"http://127.0.0.1:{port}/instances"))
items = inst.get("instances", inst) if isinstance(inst, dict) else inst
prefill = [i["url"] for i in items if i.get("role") == "prefill"][0].rstrip("/")
peak, total, tokens0 = 0.0, None, None
while True:
    try:
        m = get(prefill + "/metrics")
    except Exception:
        break
    held = metric(m, "kvbridge_kv_blocks_held_for_transfer") or 0.0
    total = metric(m, "kvbridge_kv_blocks_total") or total
    tokens = metric(m, "kvbridge_prompt_tokens_total") or 0.0
    peak = max(peak, held)
    with open(out, "w") as f:
        f.write(f"{peak} {total} {tokens}\n")
    time.sleep(0.05)
PY
MON_PID=$!
set +e
"$BIN" bench --host "http://127.0.0.1:$PORT" "${PROMPTS[@]}" --samples "$SAMPLES" \
  --batches "$BATCHES" --best-of-n 8 --input-tokens 256 --output-tokens 24 --check-drain --drain-timeout 5
rc=$?
set -e
kill "$MON_PID" 2>/dev/null || true
wait "$MON_PID" 2>/dev/null || true
if [[ -s "$LOG_DIR/pool.txt" ]]; then
  read -r PEAK TOTAL TOKENS <"$LOG_DIR/pool.txt"
  python3 - "$PEAK" "$TOTAL" "$TOKENS" <<'PY' || rc=1
import sys
peak, total, tokens = map(float, sys.argv[1:])
cycles = tokens / 16.0 / total
print(f"main job: prefill pool {total:.0f} blocks; peak held {peak:.0f} ({peak/total:.0%}); "
      f"prompt blocks allocated {tokens/16:.0f} = {cycles:.1f} x the pool")
if peak < total / 2 or cycles < 10:
    print("main job: FAIL: the run must hold >= half the prefill pool at peak and cycle it >= 10 times")
    sys.exit(1)
PY
fi
cleanup
trap - EXIT
tail -n 2 "$LOG_DIR/up.out"
if ((rc == 0)); then echo "main job: PASS"; else echo "main job: FAIL (bench exit $rc; logs in $LOG_DIR)"; fi
exit $rc
