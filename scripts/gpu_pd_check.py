#!/usr/bin/env python3
"""P/D between GPU engines over cuda_ipc (issue 20), on the GPU machine (stdlib only).

    python3 scripts/gpu_pd_check.py --kvbridge build/bin/kvbridge --work /tmp/w [--md out.md]
        [--model qwen2.5-0.5b] [--kv bf16,fp8] [--modes read,write] [--kill]

For each KV dtype and mode: a colocated GPU engine (`serve MODEL --device cuda`) and `kvbridge up
1p1d --device cuda` (prefill and decode: each its own process on the same GPU, each its share of
it) on the same model (a preset: random weights generated on the GPU). Every prompt of 1, 15,
16, 17 and 2000 tokens (token-id lists), n=1 greedy and n=8 sampled (seed), logprobs 2: the P/D
answer through the proxy must equal the colocated one bitwise (texts, tokens, logprobs,
top-logprobs as JSON). Then: KV bytes moved (the decode's kvbridge_kv_transfer_bytes_total, READ;
the prefill's, WRITE), both engines drained (kvbridge_kv_blocks_active and _held_for_transfer 0),
no lease expired, and each engine's device memory (nvidia-smi, per process) the same after the
run as after its first request. --kill: decode killed mid-READ (SIGKILL while long prompts
load): the prefill drains (lease), the GPU memory of the killed process is back
(cudaMemGetInfo via nvidia-smi's used memory).
One markdown row per check to --md; exit 1 when a check fails.
"""
import argparse
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import urllib.request

ROWS = []
FAILED = []


def row(check, ok, detail=""):
    ROWS.append(f"| pd: {check} | {'ok' if ok else 'FAILED'} | | {detail} |")
    print(ROWS[-1], flush=True)
    if not ok:
        FAILED.append(check)


def post(url, body, timeout=300):
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def metric(text, name):
    total, found = 0.0, False
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            total += float(line.rsplit(" ", 1)[1])
            found = True
    return total if found else None


def gpu_mem():
    """pid -> used MiB for every compute process, and the device's used MiB."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory",
                          "--format=csv,noheader,nounits"], capture_output=True, text=True).stdout
    per = {}
    for line in out.splitlines():
        try:
            p, m = [x.strip() for x in line.split(",")]
            per[int(p)] = int(m)
        except ValueError:
            pass
    used = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True).stdout.split()
    return per, int(used[0]) if used else -1


def wait_file(path, proc, seconds=300):
    for _ in range(seconds * 10):
        if os.path.exists(path) and open(path).read().strip():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.1)
    return False


def start_colocated(a, kv, work):
    pf = os.path.join(work, f"colo-{kv}.port")
    if os.path.exists(pf):
        os.remove(pf)
    log = open(os.path.join(work, f"colo-{kv}.log"), "w")
    p = subprocess.Popen([a.kvbridge, "serve", a.model, "--device", "cuda", "--port", "0",
                          "--port-file", pf, "--gpu-memory-utilization", str(a.share),
                          "--kv-cache-dtype", kv, "--max-num-seqs", "64"],
                         stdout=log, stderr=subprocess.STDOUT)
    if not wait_file(pf, p):
        return p, None
    return p, f"http://127.0.0.1:{int(open(pf).read().strip())}"


def start_up(a, kv, mode, work, topology="1p1d"):
    logdir = os.path.join(work, f"up-{topology}-{kv}-{mode}")
    os.makedirs(logdir, exist_ok=True)
    out = open(os.path.join(logdir, "up.out"), "w")
    cmd = [a.kvbridge, "up", topology, "--device", "cuda", "--model", a.model, "--port", "0",
           "--mode", mode, "--log-dir", logdir, "--gpu-memory-utilization", str(a.share),
           f"--engine-arg=--kv-cache-dtype={kv}", "--engine-arg=--max-num-seqs=64"]
    p = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    for _ in range(3000):
        txt = open(os.path.join(logdir, "up.out")).read()
        m = re.search(r"OpenAI API: http://([0-9.]+:[0-9]+)/v1/completions", txt)
        if m:
            return p, "http://" + m.group(1), logdir
        if p.poll() is not None:
            break
        time.sleep(0.1)
    return p, None, logdir


def instances(proxy):
    j = json.loads(get(proxy + "/instances"))
    return {i["role"]: i["url"].rstrip("/") for i in j["instances"]}, j["instances"]


def engine_pids(logdir):
    txt = open(os.path.join(logdir, "up.out")).read()
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^\s+(\S+)\s+\S+\s+pid (\d+)", txt, re.M)}


def stop(p):
    if p is None or p.poll() is not None:
        return
    p.terminate()  # up stops its children on SIGTERM
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def drained(urls, timeout=10.0):
    t0 = time.time()
    last = {}
    while time.time() - t0 < timeout:
        ok = True
        for u in urls:
            m = get(u + "/metrics")
            act = metric(m, "kvbridge_kv_blocks_active")
            held = metric(m, "kvbridge_kv_blocks_held_for_transfer")
            exp = metric(m, "kvbridge_kv_lease_expired_total") or 0.0
            last[u] = (act, held, exp)
            ok = ok and act == 0 and held == 0
        if ok:
            return True, time.time() - t0, last
        time.sleep(0.05)
    return False, timeout, last


def requests_for(vocab, seed=11):
    rng = random.Random(seed)
    reqs = []
    for length in (1, 15, 16, 17, 2000):
        ids = [rng.randrange(0, 256) for _ in range(length)]  # bytes: valid in every preset
        reqs.append((f"{length} tokens n=1 greedy", {"prompt": ids, "max_tokens": 8, "temperature": 0,
                                                   "logprobs": 2}))
        reqs.append((f"{length} tokens n=8 sampled", {"prompt": ids, "max_tokens": 8, "n": 8,
                                                    "temperature": 0.8, "seed": 7, "logprobs": 2}))
    return reqs


def answer(resp):
    return [(c["index"], c["text"], c.get("logprobs"), c.get("finish_reason"))
            for c in sorted(resp["choices"], key=lambda c: c["index"])]


def run_pair(a, kv, mode, work):
    colo, colo_url = start_colocated(a, kv, work)
    up = None
    try:
        if colo_url is None:
            row(f"{kv} {mode}: colocated engine starts", False,
                open(os.path.join(work, f"colo-{kv}.log")).read()[-300:])
            return
        up, proxy, logdir = start_up(a, kv, mode, work)
        if proxy is None:
            row(f"{kv} {mode}: up 1p1d --device cuda ready", False,
                open(os.path.join(logdir, "up.out")).read()[-400:])
            return
        roles, _ = instances(proxy)
        pids = engine_pids(logdir)
        row(f"{kv} {mode}: up 1p1d --device cuda ready", True, f"proxy {proxy}, engines {pids}")
        mem_first = None
        equal, total = 0, 0
        mism = []
        for name, body in requests_for(0):
            r_colo = post(colo_url + "/v1/completions", body)
            r_pd = post(proxy + "/v1/completions", body)
            total += 1
            if answer(r_colo) == answer(r_pd):
                equal += 1
            else:
                mism.append(name)
            if mem_first is None:
                time.sleep(0.3)
                mem_first = gpu_mem()[0]
        row(f"{kv} {mode}: P/D == colocated bitwise (texts + logprobs + top-2), prompts 1/15/16/17/2000, "
            "n=1 and n=8", equal == total, f"{equal}/{total} equal" + (f"; differ: {mism}" if mism else ""))
        side = roles.get("decode") if mode == "read" else roles.get("prefill")
        moved = metric(get(side + "/metrics"), "kvbridge_kv_transfer_bytes_total") or 0
        backend_lines = []
        for f in sorted(os.listdir(logdir)):
            if f.endswith(".log"):
                backend_lines += [ln.strip()[-90:] for ln in open(os.path.join(logdir, f))
                                  if "via cuda_ipc" in ln or "registering the GPU" in ln]
        row(f"{kv} {mode}: KV moved over cuda_ipc", moved > 0 and any("via cuda_ipc" in b for b in backend_lines),
            f"{moved / 1e6:.1f} MB {'READ by the decode' if mode == 'read' else 'WRITTEN by the prefill'}; "
            f"{backend_lines[:1]}")
        ok, dt, last = drained(list(roles.values()) + [colo_url])
        row(f"{kv} {mode}: drained (blocks active/held 0, no lease expired)",
            ok and all(v[2] == 0 for v in last.values()), f"{dt:.2f} s; {last}")
        time.sleep(0.3)
        mem_end = gpu_mem()[0]
        same = all(mem_end.get(p) == mem_first.get(p) for p in pids.values() if p in mem_first)
        row(f"{kv} {mode}: engines' device memory after the run == after the first request (MiB)", same,
            f"first {[mem_first.get(p) for p in pids.values()]} end {[mem_end.get(p) for p in pids.values()]}")
    finally:
        stop(up)
        stop(colo)


def kill_test(a, kv, work):
    """1p1d started by hand (serve + serve + proxy: `up` would stop everything when one engine
    dies): the decode is SIGKILLed while 2000-token prompts are being READ; its device memory must
    be released (it is gone from nvidia-smi), the prefill must drain (its holds end by the READ
    notifications it got, or its lease), and the prefill keeps serving."""
    import threading
    token = "kill-test-token"
    procs = []
    urls = {}
    try:
        per_before, used_before = gpu_mem()
        for role in ("prefill", "decode"):
            pf = os.path.join(work, f"kill-{kv}-{role}.port")
            if os.path.exists(pf):
                os.remove(pf)
            cfg = json.dumps({"kv_connector": "KVBridgeConnector",
                              "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                              "kv_connector_extra_config": {"mode": "read", "lease_ms": int(a.lease_s * 1000)}})
            log = open(os.path.join(work, f"kill-{kv}-{role}.log"), "w")
            p = subprocess.Popen([a.kvbridge, "serve", a.model, "--device", "cuda", "--port", "0",
                                  "--port-file", pf, "--gpu-memory-utilization", str(a.share),
                                  "--kv-cache-dtype", kv, "--max-num-seqs", "64", "--cluster-token", token,
                                  "--kv-transfer-config", cfg], stdout=log, stderr=subprocess.STDOUT)
            procs.append(p)
            if not wait_file(pf, p):
                row(f"{kv} kill: {role} starts", False, open(log.name).read()[-300:])
                return
            urls[role] = f"http://127.0.0.1:{int(open(pf).read().strip())}"
        pf = os.path.join(work, f"kill-{kv}-proxy.port")
        if os.path.exists(pf):
            os.remove(pf)
        px = subprocess.Popen([a.kvbridge, "proxy", "--port", "0", "--port-file", pf, "--cluster-token", token,
                               "--prefill", urls["prefill"], "--decode", urls["decode"]],
                              stdout=open(os.path.join(work, f"kill-{kv}-proxy.log"), "w"),
                              stderr=subprocess.STDOUT)
        procs.append(px)
        wait_file(pf, px)
        proxy = f"http://127.0.0.1:{int(open(pf).read().strip())}"
        for _ in range(100):
            try:
                j = json.loads(get(proxy + "/instances"))
                if sum(i["healthy"] for i in j["instances"]) == 2:
                    break
            except Exception:
                pass
            time.sleep(0.2)
        warm = post(proxy + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
        dec = procs[1].pid
        per0, used0 = gpu_mem()
        rng = random.Random(5)
        errs = []

        def fire(i):
            ids = [rng.randrange(0, 256) for _ in range(2000)]
            try:
                post(proxy + "/v1/completions", {"prompt": ids, "max_tokens": 64, "n": 8,
                                                 "temperature": 0.8, "seed": i}, timeout=60)
            except Exception as e:  # expected: the decode died
                errs.append(str(e)[:80])
        ts = [threading.Thread(target=fire, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        time.sleep(a.kill_after_s)
        os.kill(dec, signal.SIGKILL)
        procs[1].wait()
        for t in ts:
            t.join(timeout=90)
        time.sleep(1.0)
        per1, used1 = gpu_mem()
        row(f"{kv} kill: decode (pid {dec}) SIGKILLed mid-READ: its device memory released",
            dec not in per1 and used1 < used0,
            f"device used {used0} -> {used1} MiB (the decode held {per0.get(dec)} MiB; before the "
            f"topology {used_before}); prefill {per0.get(procs[0].pid)} -> {per1.get(procs[0].pid)} MiB; "
            f"{len(errs)} of 8 requests failed; warm-up {bool(warm.get('choices'))}")
        ok, dt, last = drained([urls["prefill"]], timeout=a.lease_s + 10)
        row(f"{kv} kill: the prefill drains after the decode died", ok, f"{dt:.1f} s; {last}")
        alive = procs[0].poll() is None
        try:
            r = post(urls["prefill"] + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
            serves = bool(r.get("choices"))
        except Exception as e:
            serves = False
            errs.append(repr(e)[:80])
        row(f"{kv} kill: the prefill survives and still serves", alive and serves, "")
    finally:
        for p in reversed(procs):
            stop(p)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvbridge", required=True)
    ap.add_argument("--work", required=True)
    ap.add_argument("--md")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--kv", default="bf16,fp8")
    ap.add_argument("--modes", default="read,write")
    ap.add_argument("--share", type=float, default=0.1, help="each engine's --gpu-memory-utilization")
    ap.add_argument("--kill", action="store_true")
    ap.add_argument("--lease-s", type=float, default=10, help="the kill test's prefill lease")
    ap.add_argument("--kill-after-s", type=float, default=0.5)
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    # A CPU engine and a GPU engine refuse each other: serve with --device cuda and transport tcp.
    bad = subprocess.run([a.kvbridge, "serve", a.model, "--device", "cuda", "--port", "0",
                          "--gpu-memory-utilization", "0.05", "--kv-transfer-config",
                          '{"kv_connector":"KVBridgeConnector","kv_role":"kv_both",'
                          '"kv_connector_extra_config":{"transport":"tcp"}}'],
                         capture_output=True, text=True, timeout=120)
    row("GPU engine with transport tcp refused", bad.returncode != 0 and "device memory" in bad.stderr,
        bad.stderr.strip().splitlines()[-1][:200] if bad.stderr.strip() else f"rc {bad.returncode}")
    for kv in a.kv.split(","):
        for mode in a.modes.split(","):
            try:
                run_pair(a, kv, mode, a.work)
            except Exception as e:  # a crash of one pair is a failed check, the rest still run
                row(f"{kv} {mode}: run", False, repr(e)[:300])
        if a.kill:
            try:
                kill_test(a, kv, a.work)
            except Exception as e:
                row(f"{kv} kill: run", False, repr(e)[:300])
    if a.md:
        with open(a.md, "a") as f:
            f.write("\n".join(ROWS) + "\n")
    print("FAILED: " + ", ".join(FAILED) if FAILED else "all P/D checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
