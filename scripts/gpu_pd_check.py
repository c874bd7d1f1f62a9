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
        # Two passes of every request: the answers of both must equal the colocated engine's; the
        # device memory after the second pass must equal that after the first (no per-request
        # growth; the first pass may grow the transfer's scratch pool once).
        mem_first = None
        equal, total = 0, 0
        mism = []
        for rep in range(2):
            for name, body in requests_for(0):
                r_colo = post(colo_url + "/v1/completions", body)
                r_pd = post(proxy + "/v1/completions", body)
                total += 1
                if answer(r_colo) == answer(r_pd):
                    equal += 1
                else:
                    mism.append(f"pass {rep + 1} {name}")
            if rep == 0:
                time.sleep(0.3)
                mem_first = gpu_mem()[0]
        row(f"{kv} {mode}: P/D == colocated bitwise (texts + logprobs + top-2), prompts 1/15/16/17/2000, "
            "n=1 and n=8, two passes", equal == total,
            f"{equal}/{total} equal" + (f"; differ: {mism}" if mism else ""))
        timing(a, kv, mode, colo_url, proxy, roles)
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
        row(f"{kv} {mode}: engines' device memory after the second pass == after the first (MiB)", same,
            f"first {[mem_first.get(p) for p in pids.values()]} end {[mem_end.get(p) for p in pids.values()]}")
    finally:
        stop(up)
        stop(colo)


def prefill_counters(url):
    m = get(url + "/metrics")
    sec = steps = 0.0
    for line in m.splitlines():
        if line.startswith('kvbridge_engine_step_seconds_total{phase="prefill"}'):
            sec = float(line.rsplit(" ", 1)[1])
        if line.startswith('kvbridge_engine_steps_total{phase="prefill"}'):
            steps = float(line.rsplit(" ", 1)[1])
    return sec, steps


def hist(url, name):
    m = get(url + "/metrics")
    return (metric(m, name + "_sum") or 0.0), (metric(m, name + "_count") or 0.0)


TIMING = {}


def timing(a, kv, mode, colo_url, proxy, roles, k=6):
    """The same 2000-token prompts (distinct: no prefix-cache hit), one at a time, max_tokens 1:
    the prefill step time (the prefill engine's step counters: with WRITE the pushes of every layer
    overlap its compute) and the time to the first token, P/D vs colocated, plus the KV
    transfer time (kvbridge_kv_transfer_seconds)."""
    rng = random.Random(99)
    prompts = [[rng.randrange(0, 256) for _ in range(2000)] for _ in range(k)]
    out = {}
    for label, url, engine in (("colocated", colo_url, colo_url), ("pd", proxy, roles["prefill"])):
        s0, n0 = prefill_counters(engine)
        x0 = hist(roles["decode"] if mode == "read" else roles["prefill"], "kvbridge_kv_transfer_seconds") \
            if label == "pd" else (0, 0)
        lat = []
        for ids in prompts:
            t = time.time()
            post(url + "/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0})
            lat.append(time.time() - t)
        s1, n1 = prefill_counters(engine)
        x1 = hist(roles["decode"] if mode == "read" else roles["prefill"], "kvbridge_kv_transfer_seconds") \
            if label == "pd" else (0, 0)
        lat.sort()
        out[label] = {"step_ms": (s1 - s0) / max(n1 - n0, 1) * 1e3, "steps": n1 - n0,
                      "ttft_ms": lat[len(lat) // 2] * 1e3,
                      "xfer_ms": (x1[0] - x0[0]) / max(x1[1] - x0[1], 1) * 1e3}
    TIMING[(kv, mode)] = out
    c, p = out["colocated"], out["pd"]
    row(f"{kv} {mode}: 2000-token prompt alone (median of {k}): prefill step, TTFT, KV transfer",
        p["steps"] > 0,
        f"prefill step colocated {c['step_ms']:.1f} ms, P/D prefill {p['step_ms']:.1f} ms ({p['steps']:.0f} steps); "
        f"max_tokens=1 latency colocated {c['ttft_ms']:.1f} ms, P/D {p['ttft_ms']:.1f} ms "
        f"(+{p['ttft_ms'] - c['ttft_ms']:.1f}); KV transfer {p['xfer_ms']:.2f} ms per request")


def kill_test(a, kv, work, victim="decode"):
    """1p1d started by hand (serve + serve + proxy: `up` would stop everything when one engine
    dies): one engine (`victim`) is SIGKILLed while 2000-token prompts are being READ; its device
    memory must be released (it is gone from nvidia-smi and the device's used memory drops by its
    share — for a killed prefill that needs the decode to close its IPC mapping of the pool), the
    survivor must drain (a prefill's holds end by its lease; a decode's failed READs recompute or
    fail) and keep serving."""
    import threading
    token = "kill-test-token"
    procs = []
    urls = {}
    try:
        per_before, used_before = gpu_mem()
        for role in ("prefill", "decode"):
            pf = os.path.join(work, f"kill-{kv}-{victim}-{role}.port")
            if os.path.exists(pf):
                os.remove(pf)
            cfg = json.dumps({"kv_connector": "KVBridgeConnector",
                              "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
                              "kv_connector_extra_config": {"mode": "read", "lease_ms": int(a.lease_s * 1000)}})
            log = open(os.path.join(work, f"kill-{kv}-{victim}-{role}.log"), "w")
            p = subprocess.Popen([a.kvbridge, "serve", a.model, "--device", "cuda", "--port", "0",
                                  "--port-file", pf, "--gpu-memory-utilization", str(a.share),
                                  "--kv-cache-dtype", kv, "--max-num-seqs", "64", "--cluster-token", token,
                                  "--kv-transfer-config", cfg], stdout=log, stderr=subprocess.STDOUT)
            procs.append(p)
            if not wait_file(pf, p):
                row(f"{kv} kill: {role} starts", False, open(log.name).read()[-300:])
                return
            urls[role] = f"http://127.0.0.1:{int(open(pf).read().strip())}"
        pf = os.path.join(work, f"kill-{kv}-{victim}-proxy.port")
        if os.path.exists(pf):
            os.remove(pf)
        px = subprocess.Popen([a.kvbridge, "proxy", "--port", "0", "--port-file", pf, "--cluster-token", token,
                               "--prefill", urls["prefill"], "--decode", urls["decode"]],
                              stdout=open(os.path.join(work, f"kill-{kv}-{victim}-proxy.log"), "w"),
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
        vi = 1 if victim == "decode" else 0
        dead, surv = procs[vi].pid, procs[1 - vi].pid
        surv_url = urls["prefill" if victim == "decode" else "decode"]
        per0, used0 = gpu_mem()
        rng = random.Random(5)
        errs = []

        def fire(i):
            ids = [rng.randrange(0, 256) for _ in range(2000)]
            try:
                post(proxy + "/v1/completions", {"prompt": ids, "max_tokens": 64, "n": 8,
                                                 "temperature": 0.8, "seed": i}, timeout=60)
            except Exception as e:  # expected: an engine died
                errs.append(str(e)[:80])
        ts = [threading.Thread(target=fire, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        time.sleep(a.kill_after_s)
        os.kill(dead, signal.SIGKILL)
        procs[vi].wait()
        for t in ts:
            t.join(timeout=90)
        time.sleep(1.5)
        per1, used1 = gpu_mem()
        share = per0.get(dead, 0)
        row(f"{kv} kill {victim}: SIGKILLed mid-READ (pid {dead}): its device memory released",
            dead not in per1 and used1 <= used0 - share + 256,
            f"device used {used0} -> {used1} MiB (the {victim} held {share} MiB; before the topology "
            f"{used_before}); survivor {per0.get(surv)} -> {per1.get(surv)} MiB; {len(errs)} of 8 "
            f"requests failed; warm-up {bool(warm.get('choices'))}")
        ok, dt, last = drained([surv_url], timeout=a.lease_s + 10)
        row(f"{kv} kill {victim}: the survivor drains", ok, f"{dt:.1f} s; {last}")
        alive = procs[1 - vi].poll() is None
        try:
            r = post(surv_url + "/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 2})
            serves = bool(r.get("choices"))
        except Exception as e:
            serves = False
            errs.append(repr(e)[:80])
        row(f"{kv} kill {victim}: the survivor still serves", alive and serves, "")
    finally:
        for p in reversed(procs):
            stop(p)


def corrupt_test(a, work):
    """READ with the decode corrupting one byte of the first block it READs (test-only env): the
    P/D logprobs must then differ from the colocated engine's (the comparison can fail)."""
    kv = "bf16"
    colo, colo_url = start_colocated(a, kv, work)
    os.environ["KVBRIDGE_DEBUG_CORRUPT_FIRST_READ_BLOCK"] = "1"
    up = None
    try:
        up, proxy, logdir = start_up(a, kv, "read", os.path.join(work, "corrupt"))
    finally:
        del os.environ["KVBRIDGE_DEBUG_CORRUPT_FIRST_READ_BLOCK"]
    try:
        if proxy is None or colo_url is None:
            row("corrupt: topology starts", False, "")
            return
        rng = random.Random(3)
        differ = 0
        for _ in range(3):
            ids = [rng.randrange(0, 256) for _ in range(200)]
            body = {"prompt": ids, "max_tokens": 4, "temperature": 0, "logprobs": 2}
            differ += answer(post(colo_url + "/v1/completions", body)) != answer(
                post(proxy + "/v1/completions", body))
        row("corrupt: one flipped byte in a READ block changes the P/D logprobs", differ == 3,
            f"{differ}/3 answers differ from colocated")
    finally:
        stop(up)
        stop(colo)


def mixed_test(a, work):
    """A CPU prefill and a GPU decode in one topology: refused with a clear error (no transport
    moves between host and device pools; not staged through host memory). The decode's READ
    fails with the reason and the request is recomputed there (load failure policy recompute)."""
    model = os.path.join(work, "small-qwen2")
    subprocess.run([a.kvbridge, "make-model", "--preset", "small", "--arch", "qwen2", "--seed", "4",
                    "--out", model], check=True, capture_output=True)
    token = "mixed-token"
    procs, urls = [], {}
    try:
        for role, dev in (("prefill", "cpu"), ("decode", "cuda")):
            pf = os.path.join(work, f"mixed-{role}.port")
            if os.path.exists(pf):
                os.remove(pf)
            cfg = json.dumps({"kv_connector": "KVBridgeConnector",
                              "kv_role": "kv_producer" if role == "prefill" else "kv_consumer"})
            cmd = [a.kvbridge, "serve", model, "--device", dev, "--port", "0", "--port-file", pf,
                   "--cluster-token", token, "--kv-transfer-config", cfg]
            if dev == "cuda":
                cmd += ["--gpu-memory-utilization", "0.05"]
            log = open(os.path.join(work, f"mixed-{role}.log"), "w")
            p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
            procs.append(p)
            if not wait_file(pf, p):
                row(f"mixed: {role} ({dev}) starts", False, open(log.name).read()[-300:])
                return
            urls[role] = f"http://127.0.0.1:{int(open(pf).read().strip())}"
        pf = os.path.join(work, "mixed-proxy.port")
        px = subprocess.Popen([a.kvbridge, "proxy", "--port", "0", "--port-file", pf, "--cluster-token", token,
                               "--prefill", urls["prefill"], "--decode", urls["decode"]],
                              stdout=open(os.path.join(work, "mixed-proxy.log"), "w"), stderr=subprocess.STDOUT)
        procs.append(px)
        wait_file(pf, px)
        proxy = f"http://127.0.0.1:{int(open(pf).read().strip())}"
        for _ in range(100):
            try:
                if sum(i["healthy"] for i in json.loads(get(proxy + "/instances"))["instances"]) == 2:
                    break
            except Exception:
                pass
            time.sleep(0.2)
        try:
            r = post(proxy + "/v1/completions", {"prompt": "hello there", "max_tokens": 4}, timeout=60)
            outcome = f"answered ({len(r.get('choices', []))} choice)"
        except Exception as e:
            outcome = f"failed: {str(e)[:80]}"
        time.sleep(0.5)
        lines = [ln.strip()[-220:] for ln in open(os.path.join(work, "mixed-decode.log"))
                 if "CPU engine and a GPU engine" in ln]
        row("mixed: a CPU prefill and a GPU decode refuse each other with a clear error", bool(lines),
            f"request {outcome}; decode log: {lines[:1]}")
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
    ap.add_argument("--mixed", action="store_true", help="a CPU prefill + a GPU decode: refused")
    ap.add_argument("--corrupt", action="store_true", help="a corrupted READ block changes logprobs")
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
    if a.corrupt:
        try:
            corrupt_test(a, a.work)
        except Exception as e:
            row("corrupt: run", False, repr(e)[:300])
    if a.mixed:
        try:
            mixed_test(a, a.work)
        except Exception as e:
            row("mixed: run", False, repr(e)[:300])
    for kv in a.kv.split(","):
        for mode in a.modes.split(","):
            try:
                run_pair(a, kv, mode, a.work)
            except Exception as e:  # a crash of one pair is a failed check, the rest still run
                row(f"{kv} {mode}: run", False, repr(e)[:300])
        if a.kill:
            for victim in ("decode", "prefill"):
                try:
                    kill_test(a, kv, a.work, victim)
                except Exception as e:
                    row(f"{kv} kill {victim}: run", False, repr(e)[:300])
    if a.md:
        with open(a.md, "a") as f:
            f.write("\n".join(ROWS) + "\n")
    print("FAILED: " + ", ".join(FAILED) if FAILED else "all P/D checks passed")
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
