#!/usr/bin/env python3
"""A real Prometheus scrapes `kvbridge up 1p1d` (issue 24).

`kvbridge up 1p1d --prometheus-config FILE` writes the scrape config (the proxy's HTTP service
discovery finds the engines); Debian's `prometheus` runs on a free port with it at a 1 s scrape
interval; `kvbridge bench` drives a little load; then, through Prometheus' HTTP query API:
every target is up and scraped samples, `vllm:` and `kvbridge_` series exist, a PromQL rate and
a histogram_quantile are plausible, and every query of deploy/grafana/kvbridge.json returns data
(a series that cannot move in a fault-free run, e.g. lease expiries, must exist at 0).

Exit 77 (CTest SKIP_RETURN_CODE) with the reason when the prometheus binary is absent.

  tests/integration/prometheus_test.py --kvbridge build/bin/kvbridge --source-dir .
"""
import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request

SKIP = 77


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def get(url, timeout=5):
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.status, r.read().decode()


def query(prom, expr):
    url = prom + "/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    _, body = get(url)
    j = json.loads(body)
    if j.get("status") != "success":
        raise AssertionError(f"query {expr!r} failed: {body}")
    return j["data"]["result"]


def wait_for(what, fn, timeout):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        try:
            v = fn()
            if v:
                return v
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last = e
        time.sleep(0.25)
    raise AssertionError(f"timed out waiting for {what} (last error: {last})")


def dashboard_queries(path):
    """Every target expression of the Grafana dashboard, with its variables substituted."""
    with open(path) as f:
        dash = json.load(f)
    exprs = []

    def walk(panels):
        for p in panels:
            walk(p.get("panels", []))
            for t in p.get("targets", []):
                if t.get("expr"):
                    exprs.append((p.get("title", "?"), t["expr"]))

    walk(dash.get("panels", []))
    subst = {"$__rate_interval": "30s", "$__interval": "1s", "$__range": "5m"}
    out = []
    for title, e in exprs:
        for k, v in subst.items():
            e = e.replace(k, v)
        # Template variables ($model_name, $instance, ...): match anything.
        e = re.sub(r'=~?"\$\{?\w+\}?"', '=~".*"', e)
        out.append((title, e))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvbridge", required=True)
    ap.add_argument("--source-dir", required=True)
    args = ap.parse_args()
    t_start = time.monotonic()
    prom_bin = shutil.which("prometheus")
    if prom_bin is None:
        print("SKIP: no prometheus binary on PATH (Debian package `prometheus`, "
              "scripts/install-deps.sh installs it)")
        return SKIP
    kvb = os.path.abspath(args.kvbridge)
    dashboard = os.path.join(args.source_dir, "deploy", "grafana", "kvbridge.json")
    tmp = tempfile.mkdtemp(prefix="kvb_prom_")
    procs = []
    ok = False
    try:
        model = os.path.join(tmp, "tiny")
        subprocess.run([kvb, "make-model", "--preset", "tiny", "--seed", "0", "--out", model],
                       check=True, stdout=subprocess.DEVNULL)
        cfg = os.path.join(tmp, "prometheus.yml")
        up_log = open(os.path.join(tmp, "up.out"), "w+")
        up = subprocess.Popen(
            [kvb, "up", "1p1d", "--port", "0", "--model", model, "--log-dir",
             os.path.join(tmp, "logs"), "--prometheus-config", cfg,
             "--prometheus-scrape-interval", "1", "--ready-timeout", "40"],
            stdout=up_log, stderr=subprocess.STDOUT)
        procs.append(up)

        def up_ready():
            if up.poll() is not None:
                up_log.seek(0)
                raise SystemExit(f"kvbridge up exited {up.returncode}:\n{up_log.read()}")
            up_log.seek(0)
            text = up_log.read()
            m = re.search(r"OpenAI API: http://([0-9.]+:\d+)/", text)
            return m.group(1) if m and "Prometheus config:" in text else None

        proxy = wait_for("kvbridge up ready", up_ready, 45)
        with open(cfg) as f:
            print(f"--- {cfg}\n{f.read()}---")
        prom_port = free_port()
        prom = f"http://127.0.0.1:{prom_port}"
        prom_log = open(os.path.join(tmp, "prometheus.log"), "w")
        procs.append(subprocess.Popen(
            [prom_bin, f"--config.file={cfg}", f"--storage.tsdb.path={tmp}/tsdb",
             f"--web.listen-address=127.0.0.1:{prom_port}", "--log.level=warn"],
            stdout=prom_log, stderr=subprocess.STDOUT))
        wait_for("prometheus ready", lambda: get(prom + "/-/ready")[0] == 200, 20)

        def all_up():
            r = query(prom, "up")
            return len(r) == 3 and all(x["value"][1] == "1" for x in r)

        wait_for("3 targets up (proxy, prefill, decode)", all_up, 15)
        print(f"targets up after {time.monotonic() - t_start:.1f} s")

        bench = subprocess.run(
            [kvb, "bench", "--host", "http://" + proxy, "--samples", "12", "--batches", "2,4",
             "--input-tokens", "48", "--output-tokens", "8", "--stream", "--json",
             "--check-drain"], capture_output=True, text=True, timeout=60)
        if bench.returncode != 0:
            raise AssertionError(f"bench failed ({bench.returncode}):\n{bench.stdout}\n"
                                 f"{bench.stderr}")
        # Scrapes after the load (1 s interval): the counters' last values are in.
        time.sleep(2.5)

        failures = []

        def check(name, cond, detail=""):
            print(("ok   " if cond else "FAIL ") + name + (f"  ({detail})" if detail else ""))
            if not cond:
                failures.append(name)

        r = query(prom, "up")
        check("every target up", len(r) == 3 and all(x["value"][1] == "1" for x in r),
              ", ".join(f'{x["metric"].get("role")}={x["value"][1]}' for x in r))
        roles = sorted(x["metric"].get("role", "") for x in r)
        check("targets: proxy, prefill, decode", roles == ["decode", "prefill", "proxy"],
              str(roles))
        r = query(prom, "scrape_samples_scraped")
        check("scrape_samples_scraped > 0 for every target",
              len(r) == 3 and all(float(x["value"][1]) > 0 for x in r),
              ", ".join(f'{x["metric"].get("role")}={x["value"][1]}' for x in r))
        for prefix in ("vllm:", "kvbridge_"):
            n = query(prom, f'count({{__name__=~"{prefix}.+"}})')
            check(f"{prefix}* series exist", bool(n) and float(n[0]["value"][1]) > 0,
                  n[0]["value"][1] if n else "none")
        r = query(prom, "sum(rate(vllm:generation_tokens_total[30s]))")
        rate = float(r[0]["value"][1]) if r else 0
        check("rate(vllm:generation_tokens_total) > 0", rate > 0, f"{rate:.1f} tok/s")
        r = query(prom, "histogram_quantile(0.5, sum by (le) "
                        "(rate(vllm:e2e_request_latency_seconds_bucket{role=\"decode\"}[30s])))")
        q = float(r[0]["value"][1]) if r else float("nan")
        check("histogram_quantile(0.5, vllm:e2e_request_latency_seconds) in (0, 60] s",
              0 < q <= 60, f"{q:.3f} s")
        r = query(prom, 'sum(vllm:request_success_total{finished_reason=~"length|stop"})')
        n = float(r[0]["value"][1]) if r else 0
        # 24 client requests (n = 1): each is one prefill sequence and one decode sequence.
        check("vllm:request_success_total{length|stop} = 2 x 24", n == 48, f"{n:g}")

        # One streamed request with its own X-Request-Id: echoed, its timing comment kept out
        # of the stream, its timeline's phases adding up to its latency.
        xrid = "kvb-prom-test-1"
        body = json.dumps({"prompt": "a timeline, please", "max_tokens": 8,
                           "stream": True}).encode()
        rq = urllib.request.Request("http://" + proxy + "/v1/completions", data=body,
                                    headers={"Content-Type": "application/json",
                                             "X-Request-Id": xrid})
        t = time.monotonic()
        with urllib.request.urlopen(rq, timeout=30) as resp:
            echoed = resp.headers.get("X-Request-Id")
            text = resp.read().decode()
        client_ms = (time.monotonic() - t) * 1000
        check("X-Request-Id echoed to the client", echoed == xrid, str(echoed))
        check("the stream ends with [DONE], no kvbridge-timing comment",
              text.rstrip().endswith("data: [DONE]") and "kvbridge-timing" not in text)
        _, tl_text = get(f"http://{proxy}/v1/requests/{xrid}/timeline")
        tl = json.loads(tl_text)
        print("timeline:", json.dumps({k: tl[k] for k in ("latency_ms", "sum_ms", "clamped_ms",
                                                          "transfer", "spans")}))
        for p in tl["phases"]:
            print(f'  {p["phase"]:<20} {p["start_ms"]:9.3f} ms  +{p["ms"]:8.3f} ms')
        phases = {p["phase"]: p["ms"] for p in tl["phases"]}
        want = ["proxy_queue", "prefill_http_in", "prefill_tokenize", "prefill_queue",
                "prefill_compute", "prefill_http_out", "proxy_relay", "decode_http_in",
                "decode_tokenize", "decode_queue", "transfer", "hold_valid_reply",
                "first_decode_token", "decode", "decode_http_out", "proxy_respond"]
        check("timeline has every READ phase, in order", list(phases) == want, str(list(phases)))
        check("phases add up to the proxy's latency (within 0.01 ms)",
              abs(sum(phases.values()) - tl["latency_ms"]) <= 0.01,
              f'{sum(phases.values()):.3f} vs {tl["latency_ms"]:.3f} ms')
        check("engine times fit their legs (clamped <= 1 ms)", tl["clamped_ms"] <= 1.0,
              f'{tl["clamped_ms"]} ms')
        # The proxy's clock starts after it read the request and stops at its last write: inside
        # the client's (1 ms for the two clocks' reads).
        check("the proxy's latency lies within the client's (by <= 100 ms)",
              -1 <= client_ms - tl["latency_ms"] <= 100,
              f'client {client_ms:.1f} ms, proxy {tl["latency_ms"]:.1f} ms')
        tr = tl.get("transfer", {})
        check("transfer: bytes, blocks, backend, GB/s",
              tr.get("bytes", 0) > 0 and tr.get("blocks", 0) > 0 and tr.get("backend")
              and tr.get("gbps", 0) > 0, json.dumps(tr))
        check("hold span and release", any(s["span"] == "hold" for s in tl["spans"])
              and "release_ms" in tl)
        legs = tl["legs"]
        check("X-Request-Id reached both legs (the engines' request ids carry it)",
              len(legs) == 2 and all(xrid in l.get("engine", {}).get("request_id", "")
                                     for l in legs),
              ", ".join(l.get("engine", {}).get("request_id", "?") for l in legs))
        st, _ = get(f'http://{proxy}/v1/requests/{tl["transfer_id"]}/timeline')
        check("timeline found by transfer_id too", st == 200)
        time.sleep(1.5)  # the phase histograms of that request are scraped

        if os.path.exists(dashboard):
            qs = dashboard_queries(dashboard)
            check("dashboard has queries", len(qs) > 0, f"{len(qs)}")
            for title, e in qs:
                res = query(prom, e)
                check(f"dashboard [{title}] {e}", len(res) > 0,
                      f"{len(res)} series" if res else "no data")
        else:
            check(f"dashboard {dashboard} exists", False)

        print(f"prometheus_test: {len(failures)} failure(s), "
              f"{time.monotonic() - t_start:.1f} s")
        ok = not failures
        return 0 if ok else 1
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(procs):
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
        if ok:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"logs kept in {tmp}")


if __name__ == "__main__":
    sys.exit(main())
