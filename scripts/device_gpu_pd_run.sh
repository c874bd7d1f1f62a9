#!/usr/bin/env bash
# The device run of P/D between GPU engines (issue 20) and the weightless 7B preset (issue 18):
# one call does it all.
#
# Here, after building with CUDA ON (build/: kvbridge, cuda_model_test):
#   scripts/device_gpu_pd_run.sh carry build      # binaries + scripts + libraries -> .device/gpu
# Through the device tool (repo root of the checkout that travels), carry [".device/gpu"]:
#   bash .device/gpu/device_gpu_pd_run.sh
#
# Stages (env STAGES, default "env tests preset pd main"):
#   env     GPU, driver
#   tests   cuda_model_test (invariance, the layer callback, memory) — the forward pass changed
#   preset  `generate qwen2.5-7b --device cuda` and `serve qwen2.5-7b --device cuda` with no model
#           directory: one completion (shape), the process's host RSS (no host weights) and
#           device memory
#   pd      gpu_pd_check.py: up 1p1d --device cuda vs colocated, bitwise, READ and WRITE, bf16
#           and fp8 KV, drained, prefill step time and TTFT of a 2000-token prompt; the kill
#           tests (decode / prefill killed mid-READ) and a CPU+GPU topology refused (PD_ARGS,
#           default "--kill --mixed")
#   main    gpu_main_job.sh: up 1p3d --device cuda on qwen2.5-7b fp8 vs 4 colocated engines
#           (MAIN_BATCHES, MAIN_SAMPLES)
# Results: $OUT/summary.md, $OUT/main_table.md, $OUT/logs.tgz.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
if [[ "${1:-}" == "carry" ]]; then
  B=${2:-build}
  C=.device/gpu
  rm -rf "$C" && mkdir -p "$C/bin" "$C/lib"
  for f in tests/cuda_model_test bin/kvbridge; do
    if [[ -x "$B/$f" ]]; then objcopy --strip-debug "$B/$f" "$C/bin/$(basename "$f")"; else
      echo "note: $B/$f not built, not carried"; fi
  done
  cp scripts/device_gpu_pd_run.sh scripts/gpu_pd_check.py scripts/gpu_main_job.sh "$C/"
  ldd "$C"/bin/* | awk '/=> \// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libcudart)\.so' |
    while read -r l; do cp -L "$l" "$C/lib/"; done
  tar czf "$C/lib.tgz" -C "$C" lib && rm -rf "$C/lib"
  du -sh "$C"
  exit 0
fi

OUT=${OUT:-$PWD/out-device}
L=$OUT/logs
mkdir -p "$L"
C=$HERE
if [[ -f "$C/lib.tgz" ]]; then
  mkdir -p /tmp/kvb_gpu && tar xzf "$C/lib.tgz" -C /tmp/kvb_gpu
  export LD_LIBRARY_PATH=/tmp/kvb_gpu/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi
STAGES=${STAGES:-"env tests preset pd main"}
PD_ARGS=${PD_ARGS:-"--kill --mixed --corrupt"}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1
KVB=$C/bin/kvbridge
S=$OUT/summary.md
rc=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
finish() {
  tar czf "$OUT/logs.tgz" -C "$OUT" logs 2>/dev/null && rm -rf "$L"
  echo "=== device run rc=$rc"
  exit $rc
}
echo "| check | result | time | detail |" >>"$S"
echo "|---|---|---|---|" >>"$S"

if has env; then
  {
    date -u +"date %Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,memory.used --format=csv,noheader
  } 2>&1 | tee "$OUT/env.txt"
fi

if has tests; then
  t0=$SECONDS
  timeout "${TESTS_TIMEOUT:-400}" "$C/bin/cuda_model_test" >"$L/cuda_model_test.log" 2>&1
  c=$?
  echo "| cuda_model_test (all) | rc=$c | $((SECONDS - t0)) s | $(grep -E '^\[  (PASSED|FAILED) +\]' "$L/cuda_model_test.log" | tr '\n' ' ') |" | tee -a "$S"
  grep -E "FAILED  \]|Failure" "$L/cuda_model_test.log" | head
  ((c == 0)) || rc=1
fi

if has preset; then
  t0=$SECONDS
  timeout 120 "$KVB" generate qwen2.5-7b --device cuda --prompt "The quick brown fox" --max-tokens 8 \
    --kv-dtype bf16 >"$L/generate7b.out" 2>"$L/generate7b.err"
  c=$?
  echo "| generate qwen2.5-7b --device cuda (no model dir) | rc=$c | $((SECONDS - t0)) s | $(tail -1 "$L/generate7b.err" | cut -c1-300) |" | tee -a "$S"
  ((c == 0)) || rc=1
  python3 - "$KVB" "$L" "$S" <<'PY' || rc=1
import json, os, subprocess, sys, time, urllib.request
kvb, logdir, summary = sys.argv[1:]
pf = "/tmp/kvb_7b.port"
if os.path.exists(pf):
    os.remove(pf)
t0 = time.time()
used0 = int(subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                           capture_output=True, text=True).stdout.split()[0])
p = subprocess.Popen([kvb, "serve", "qwen2.5-7b", "--device", "cuda", "--port", "0", "--port-file", pf,
                      "--gpu-memory-utilization", "0.3", "--kv-cache-dtype", "fp8"],
                     stdout=open(os.path.join(logdir, "serve7b.log"), "w"), stderr=subprocess.STDOUT)
rows, ok = [], True
try:
    for _ in range(1200):
        if os.path.exists(pf) and open(pf).read().strip():
            break
        if p.poll() is not None:
            break
        time.sleep(0.1)
    port = int(open(pf).read().strip())
    ready = time.time() - t0
    body = {"prompt": "The quick brown fox", "max_tokens": 16, "temperature": 0, "logprobs": 1}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    t1 = time.time()
    r = json.loads(urllib.request.urlopen(req, timeout=120).read())
    dt = time.time() - t1
    ch = r["choices"][0]
    shape = (r["object"] == "text_completion" and len(r["choices"]) == 1 and
             r["usage"]["completion_tokens"] == 16 and len(ch["logprobs"]["token_logprobs"]) == 16 and
             r["usage"]["prompt_tokens"] > 0)
    rss = [l for l in open(f"/proc/{p.pid}/status") if l.startswith(("VmRSS", "VmHWM"))]
    rss_mb = {l.split(":")[0]: int(l.split()[1]) / 1024 for l in rss}
    q = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                       capture_output=True, text=True).stdout
    dev = [l for l in q.splitlines() if l.split(",")[0].strip() == str(p.pid)]
    m = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    wb = [l for l in m.splitlines() if l.startswith("kvbridge_model_weight_bytes")]
    host_ok = rss_mb.get("VmHWM", 1e9) < 4096  # no 15 GB of host weights
    ok = shape and host_ok
    eng = [l.strip()[-160:] for l in open(os.path.join(logdir, "serve7b.log")) if "engine: GPU" in l]
    rows.append(f"| serve qwen2.5-7b --device cuda (no model dir, fp8 KV, 0.3 share) | {'ok' if ok else 'FAILED'} | "
                f"ready {ready:.1f} s, 16 tokens in {dt:.2f} s | shape {'ok' if shape else 'BAD'}; "
                f"{ch['text']!r}; usage {r['usage']}; host RSS {rss_mb.get('VmRSS', 0):.0f} MiB (peak "
                f"{rss_mb.get('VmHWM', 0):.0f}); device {dev[0].split(',')[1].strip() if dev else '?'} MiB "
                f"(GPU used before {used0} MiB); {wb}; {eng} |")
except Exception as e:
    ok = False
    rows.append(f"| serve qwen2.5-7b --device cuda | FAILED | | {e!r}: {open(os.path.join(logdir, 'serve7b.log')).read()[-400:]} |")
finally:
    p.terminate()
    p.wait(timeout=30)
print("\n".join(rows))
open(summary, "a").write("\n".join(rows) + "\n")
sys.exit(0 if ok else 1)
PY
fi

if has pd; then
  t0=$SECONDS
  # shellcheck disable=SC2086
  timeout "${PD_TIMEOUT:-420}" python3 "$C/gpu_pd_check.py" --kvbridge "$KVB" --work /tmp/kvb_pd --md "$S" $PD_ARGS \
    >"$L/pd.log" 2>&1 || rc=1
  tail -40 "$L/pd.log"
  echo "(pd stage: $((SECONDS - t0)) s)"
  mkdir -p "$L/pd" && cp -r /tmp/kvb_pd/* "$L/pd/" 2>/dev/null
fi

if has main; then
  t0=$SECONDS
  KVB=$KVB OUT=/tmp/kvb_main BATCHES=${MAIN_BATCHES:-1,8,16,32} SAMPLES=${MAIN_SAMPLES:-32} \
    timeout "${MAIN_TIMEOUT:-560}" bash "$C/gpu_main_job.sh" >"$L/main.log" 2>&1 || rc=1
  tail -30 "$L/main.log"
  cp /tmp/kvb_main/table.md "$OUT/main_table.md" 2>/dev/null
  mkdir -p "$L/main" && cp -r /tmp/kvb_main/*.json /tmp/kvb_main/pd /tmp/kvb_main/colocated "$L/main/" 2>/dev/null
  echo "(main stage: $((SECONDS - t0)) s)"
fi
cat "$S"
finish
