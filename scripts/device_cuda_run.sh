#!/usr/bin/env bash
# The whole device run of the cuda_ipc work (issues 10 and 12), on one GPU or across two.
#
# Here, once before the device calls:
#   scripts/device_cuda_run.sh prepare          # copies /usr/src/googletest to .device/googletest
#   scripts/device_cuda_run.sh carry build-gpu  # stripped binaries built here (kvbridge_xfer_bench,
#       cuda_agent_test, cuda_agent_peer, cuda_ipc_peer, transfer_unit_test) + the shared libraries
#       the device image lacks (spdlog, fmt, xxhash, ucx, numa) into .device/carry
# Through the device tool (repo root), carry [".device/googletest", ".device/carry"]:
#   bash scripts/device_cuda_run.sh
#
# Stages (env STAGES, default "env build conformance bench sanitizer"):
#   env          date, GPUs, driver, nvcc, `nvidia-smi topo -m`, cudaDeviceCanAccessPeer both ways
#   build        CUDA-only project tests/gpu/standalone (core, peer, cuda_ipc_bench, GPU tests)
#   conformance  for each "local:peer" GPU pair in PAIRS: cuda_ipc_conformance_test and
#                cuda_ipc_backend_test (built there), cuda_agent_test (carried: the agent over
#                kCuda memory); plus transfer_unit_test's CUDA cases (carried)
#   bench        for each "local:peer[:extra args]" in BENCH: `kvbridge xfer-bench --mem cuda
#                --backend cuda_ipc` (carried; falls back to the standalone cuda_ipc_bench, same
#                code, if the carried binary cannot start); tables to $OUT/table_<local>_<peer>.md
#   sanitizer    compute-sanitizer memcheck of the conformance tests on SAN_PAIR
# Defaults: one GPU -> PAIRS="0:0", BENCH="0:0"; two GPUs -> PAIRS="0:0 1:0 0:1",
# BENCH="0:0 0:1 1:0", SAN_PAIR=1:0 (decode pool + kernels on GPU 1 reading the prefill pool on
# GPU 0). Logs: $OUT/logs.tgz; summary on stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
if [[ "${1:-}" == "prepare" ]]; then
  mkdir -p .device && rm -rf .device/googletest && cp -r /usr/src/googletest .device/googletest
  echo "copied /usr/src/googletest to .device/googletest (carry it)"
  exit 0
fi
if [[ "${1:-}" == "carry" ]]; then
  B=${2:-build-gpu}
  C=.device/carry
  rm -rf "$C" && mkdir -p "$C/bin" "$C/tests" "$C/lib"
  for f in bin/kvbridge_xfer_bench bin/cuda_ipc_peer bin/cuda_agent_peer tests/cuda_agent_test \
           tests/transfer_unit_test; do
    [[ -x "$B/$f" ]] || { echo "missing $B/$f: build it first"; exit 1; }
    objcopy --strip-debug "$B/$f" "$C/$f"
  done
  # Everything but glibc, libstdc++/libgcc (newer on the device image) and the CUDA runtime.
  ldd "$C"/bin/* "$C"/tests/* | awk '/=> \// {print $3}' | sort -u |
    grep -Ev '/(libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s|libcudart)\.so' |
    while read -r l; do cp -L "$l" "$C/lib/"; done
  du -sh "$C"; ls "$C/lib"
  exit 0
fi

OUT=${OUT:-$PWD/out-device}
mkdir -p "$OUT/logs"
L=$OUT/logs
B=${BUILD_DIR:-/tmp/kvb-cuda}
C=$PWD/.device/carry
GT=${GTEST_SOURCE_DIR:-$PWD/.device/googletest}
[[ -d "$GT" ]] || GT=/usr/src/googletest
STAGES=${STAGES:-"env build conformance bench sanitizer"}
NGPU=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if ((NGPU >= 2)); then
  PAIRS=${PAIRS:-"0:0 1:0 0:1"}
  BENCH=${BENCH:-"0:0 0:1 1:0"}
  SAN_PAIR=${SAN_PAIR:-1:0}
else
  PAIRS=${PAIRS:-"0:0"}
  BENCH=${BENCH:-"0:0"}
  SAN_PAIR=${SAN_PAIR:-0:0}
fi
# NVLink multicast stays off (device README): no NVLS in anything we start.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export KVBRIDGE_CUDA_IPC_PEER=$B/bin/cuda_ipc_peer
rc=0
has() { [[ " $STAGES " == *" $1 "* ]]; }
finish() {
  tar czf "$OUT/logs.tgz" -C "$OUT" logs 2>/dev/null && rm -rf "$OUT/logs"
  echo "=== device run rc=$rc"
  exit $rc
}
# Carried binaries run with the carried libraries; "carried_ok" says whether they can start.
CENV=(env "LD_LIBRARY_PATH=$C/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      "KVBRIDGE_CUDA_AGENT_PEER=$C/bin/cuda_agent_peer")
carried_ok=0
if [[ -x "$C/tests/cuda_agent_test" ]] && "${CENV[@]}" "$C/tests/cuda_agent_test" \
     --gtest_list_tests >"$L/carried_start.log" 2>&1; then
  carried_ok=1
else
  echo "=== carried binaries cannot start here (see logs/carried_start.log):"
  tail -3 "$L/carried_start.log" 2>/dev/null
fi

if has env; then
  {
    date -u +"date %Y-%m-%dT%H:%M:%SZ"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv,noheader
    nvcc --version | tail -2
    cmake --version | head -1
    uname -r
    echo "--- nvidia-smi topo -m"
    nvidia-smi topo -m
    echo "--- nvidia-smi nvlink --status (first lines)"
    nvidia-smi nvlink --status 2>&1 | head -8
    echo "--- cudaDeviceCanAccessPeer"
    python3 - <<'PY' 2>&1
import ctypes
rt = None
for name in ("libcudart.so.13", "/usr/local/cuda/lib64/libcudart.so.13",
             "/usr/local/cuda/lib64/libcudart.so", "libcudart.so"):
    try:
        rt = ctypes.CDLL(name); break
    except OSError:
        pass
if rt is None:
    import cupy.cuda.runtime as r  # the runtime's own cudaDeviceCanAccessPeer
    n = r.getDeviceCount()
    for a in range(n):
        for b in range(n):
            if a != b: print(f"cudaDeviceCanAccessPeer({a} -> {b}) = {r.deviceCanAccessPeer(a, b)}")
else:
    n = ctypes.c_int(); rt.cudaGetDeviceCount(ctypes.byref(n))
    for a in range(n.value):
        for b in range(n.value):
            if a != b:
                v = ctypes.c_int(-1); e = rt.cudaDeviceCanAccessPeer(ctypes.byref(v), a, b)
                print(f"cudaDeviceCanAccessPeer({a} -> {b}) = {v.value} (err {e})")
PY
  } 2>&1 | tee "$OUT/env.txt"
fi

if has build; then
  t0=$SECONDS
  if ! { cmake -S tests/gpu/standalone -B "$B" -G Ninja -DGTEST_SOURCE_DIR="$GT" \
           -DCMAKE_BUILD_TYPE=Release && cmake --build "$B" -j"$(nproc)"; } >"$L/build.log" 2>&1; then
    tail -40 "$L/build.log"
    echo "BUILD FAILED"
    rc=1
    finish
  fi
  echo "=== build ok in $((SECONDS - t0))s"
  cuobjdump -sass "$B/cuda_ipc/libkvbridge_cuda_ipc_core.a" >"$L/sass.txt" 2>&1 || true
  echo "SASS: $(grep -c 'LDG.E.*128' "$L/sass.txt") LDG.128, $(grep -c 'STG.E.*128' "$L/sass.txt") STG.128"
fi

run_test() {  # name log timeout cmd...
  local name=$1 log=$2 to=$3
  shift 3
  local t0=$SECONDS
  timeout "$to" "$@" >"$L/$log" 2>&1
  local c=$?
  echo "=== $name rc=$c in $((SECONDS - t0))s: $(grep -E '^\[==========\] .* ran' "$L/$log" | tail -1)" \
       "$(grep -E '^\[  (PASSED|SKIPPED|FAILED) +\] [0-9]+ test' "$L/$log" | tr '\n' ' ' | cut -c1-200)"
  grep -E "Failure|FAILED  \]|error" "$L/$log" | head -8
  ((c == 0)) || rc=1
}

if has conformance; then
  for pair in $PAIRS; do
    lo=${pair%%:*} pe=${pair##*:}
    export KVB_GPU_LOCAL=$lo KVB_GPU_PEER=$pe
    run_test "[$pair] cuda_ipc_conformance_test" "conf_${lo}_${pe}.log" 240 "$B/bin/cuda_ipc_conformance_test"
    run_test "[$pair] cuda_ipc_backend_test" "backend_${lo}_${pe}.log" 120 "$B/bin/cuda_ipc_backend_test"
    if ((carried_ok)); then
      run_test "[$pair] cuda_agent_test" "agent_${lo}_${pe}.log" 180 "${CENV[@]}" \
        "$C/tests/cuda_agent_test"
    fi
  done
  unset KVB_GPU_LOCAL KVB_GPU_PEER
  if ((carried_ok)); then
    run_test "transfer_unit_test (Cuda cases, GPU machine)" unit_cuda.log 60 \
      "${CENV[@]}" "$C/tests/transfer_unit_test" --gtest_filter='*Cuda*'
  fi
fi

if has bench; then
  for spec in $BENCH; do
    IFS=: read -r lo pe extra <<<"$spec"
    t0=$SECONDS
    tbl="$OUT/table_${lo}_${pe}.md"
    # shellcheck disable=SC2086
    if ((carried_ok)); then
      timeout 400 "${CENV[@]}" "KVBRIDGE_CUDA_IPC_PEER=$C/bin/cuda_ipc_peer" \
        "$C/bin/kvbridge_xfer_bench" xfer-bench --mem cuda \
        --backend cuda_ipc --device "$lo" --peer-device "$pe" --out "$tbl" ${extra//,/ } \
        ${BENCH_ARGS:-} >"$L/bench_${lo}_${pe}.log" 2>&1
    else
      timeout 400 "$B/bin/cuda_ipc_bench" --device "$lo" --peer-device "$pe" --out "$tbl" \
        ${extra//,/ } ${BENCH_ARGS:-} >"$L/bench_${lo}_${pe}.log" 2>&1
    fi
    b=$?
    echo "=== bench [$spec] rc=$b in $((SECONDS - t0))s ($( ((carried_ok)) && echo "kvbridge xfer-bench" || echo cuda_ipc_bench))"
    cat "$L/bench_${lo}_${pe}.log"
    ((b == 0)) || rc=1
  done
fi

if has sanitizer; then
  if command -v compute-sanitizer >/dev/null; then
    lo=${SAN_PAIR%%:*} pe=${SAN_PAIR##*:}
    export KVB_GPU_LOCAL=$lo KVB_GPU_PEER=$pe
    # BadHandlesAreRefused makes deliberate invalid CUDA API calls, which memcheck reports.
    san="compute-sanitizer --tool memcheck --target-processes all --error-exitcode 9"
    # shellcheck disable=SC2086
    run_test "[$SAN_PAIR] memcheck cuda_ipc_conformance_test" san_conf.log 240 $san \
      "$B/bin/cuda_ipc_conformance_test" --gtest_filter='-*262144B*:*BadHandlesAreRefused*'
    # shellcheck disable=SC2086
    run_test "[$SAN_PAIR] memcheck cuda_ipc_backend_test" san_backend.log 150 $san \
      "$B/bin/cuda_ipc_backend_test"
    if ((carried_ok)); then
      # shellcheck disable=SC2086
      run_test "[$SAN_PAIR] memcheck cuda_agent_test" san_agent.log 200 \
        "${CENV[@]}" $san "$C/tests/cuda_agent_test" \
        --gtest_filter='-*HostPointerRegisteredAsDeviceMemoryIsRefused*'
    fi
    grep -h "ERROR SUMMARY" "$L"/san_*.log
    unset KVB_GPU_LOCAL KVB_GPU_PEER
  else
    echo "=== sanitizer: compute-sanitizer not on PATH (skipped)"
  fi
fi
finish
