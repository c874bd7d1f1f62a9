#!/usr/bin/env python3
"""Plots `kvbridge bench --json` reports (docs/bench.md "Plots").

One figure, four panels, for one or two runs side by side (e.g. P/D vs colocated):
latency percentiles vs concurrency, the TTFT CDF (streamed runs), the mean time per request of
each P/D phase (stacked; from the proxy's kvbridge_proxy_phase_seconds), and output throughput
vs concurrency.

  scripts/plot_bench.py --run "1p1d (P/D)=pd.json" --run "2 colocated=colo.json" --out bench.png

Needs matplotlib (Debian: python3-matplotlib, which scripts/install-deps.sh installs).
"""
import argparse
import json
import sys

try:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
except ImportError:
    sys.exit("plot_bench.py needs matplotlib (apt-get install python3-matplotlib)")

# Timeline phases (src/proxy/timeline.cc) in request order, READ then WRITE then colocated; the
# stack follows this order and merges the http/proxy bookkeeping phases into "proxy + HTTP".
PHASE_ORDER = [
    "prefill_queue", "prefill_compute", "decode_queue", "transfer", "hold_valid_reply", "kv_wait",
    "queue", "prefill", "first_decode_token", "decode",
]
OVERHEAD = {
    "proxy_queue", "prefill_http_in", "prefill_tokenize", "prefill_http_out", "proxy_relay",
    "decode_http_in", "decode_tokenize", "decode_http_out", "proxy_respond", "http_in",
    "tokenize", "http_out",
}


def load(spec):
    label, _, path = spec.partition("=")
    if not path:
        label, path = spec, spec
    with open(path) as f:
        report = json.load(f)
    return label, report["batches"]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--run", action="append", required=True,
                    help="LABEL=FILE.json (kvbridge bench --json); give one or two")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--title", default="kvbridge bench")
    ap.add_argument("--dpi", type=int, default=80)
    args = ap.parse_args()
    runs = [load(r) for r in args.run]
    if len(runs) > 2:
        sys.exit("at most two runs")
    colors = ["tab:blue", "tab:orange"]
    fig, ax = plt.subplots(2, 2, figsize=(11, 7.5))
    (a_lat, a_cdf), (a_ph, a_tp) = ax

    for i, (label, batches) in enumerate(runs):
        conc = [b["concurrency"] for b in batches]
        for q, style in (("p50", "-"), ("p90", "--"), ("p95", ":")):
            a_lat.plot(conc, [b["latency_s"][q] for b in batches], style, marker="o",
                       color=colors[i], label=f"{label} {q}")
    a_lat.set_xlabel("concurrency")
    a_lat.set_ylabel("request latency (s)")
    a_lat.set_title("Latency percentiles vs concurrency")
    a_lat.grid(alpha=0.3)
    a_lat.legend(fontsize=7)

    any_ttft = False
    for i, (label, batches) in enumerate(runs):
        for j, b in enumerate(batches):
            xs = sorted(1000 * t for t in b.get("ttfts_s", []))
            if not xs:
                continue
            any_ttft = True
            ys = [(k + 1) / len(xs) for k in range(len(xs))]
            a_cdf.step(xs, ys, where="post", color=colors[i],
                       alpha=0.35 + 0.65 * (j + 1) / len(batches),
                       label=f'{label} c={b["concurrency"]}')
    a_cdf.set_xlabel("TTFT (ms)")
    a_cdf.set_ylabel("fraction of requests")
    a_cdf.set_title("TTFT CDF" + ("" if any_ttft else " (no streamed run)"))
    a_cdf.grid(alpha=0.3)
    if any_ttft:
        a_cdf.legend(fontsize=7)

    # Stacked mean phase times: one bar per (concurrency, run).
    all_conc = sorted({b["concurrency"] for _, bs in runs for b in bs})
    width = 0.8 / len(runs)
    phases = [p for p in PHASE_ORDER
              if any(p in b.get("phase_mean_s", {}) for _, bs in runs for b in bs)]
    cmap = plt.get_cmap("tab10")
    pcolor = {p: cmap(k % 10) for k, p in enumerate(phases + ["proxy + HTTP"])}
    drawn = set()
    for i, (label, batches) in enumerate(runs):
        by_c = {b["concurrency"]: b.get("phase_mean_s", {}) for b in batches}
        for x, c in enumerate(all_conc):
            pm = by_c.get(c, {})
            bottom = 0.0
            stack = [(p, pm.get(p, 0.0)) for p in phases]
            stack.append(("proxy + HTTP", sum(v for k, v in pm.items() if k in OVERHEAD)))
            for p, v in stack:
                if v <= 0:
                    continue
                a_ph.bar(x + (i - (len(runs) - 1) / 2) * width, 1000 * v, width * 0.9,
                         bottom=bottom, color=pcolor[p], edgecolor="white", linewidth=0.3,
                         label=p if p not in drawn else None)
                drawn.add(p)
                bottom += 1000 * v
    a_ph.set_xticks(range(len(all_conc)))
    a_ph.set_xticklabels([f"c={c}" for c in all_conc])
    a_ph.set_ylabel("mean ms per request")
    a_ph.set_title("Per-phase breakdown (" + " | ".join(l for l, _ in runs) + ")")
    a_ph.grid(axis="y", alpha=0.3)
    if drawn:
        a_ph.legend(fontsize=6, ncol=2)

    for i, (label, batches) in enumerate(runs):
        by_c = {b["concurrency"]: b for b in batches}
        xs = [x + (i - (len(runs) - 1) / 2) * width for x, c in enumerate(all_conc) if c in by_c]
        ys = [by_c[c]["output_tokens_per_s"] for c in all_conc if c in by_c]
        a_tp.bar(xs, ys, width * 0.9, color=colors[i], label=label)
    a_tp.set_xticks(range(len(all_conc)))
    a_tp.set_xticklabels([f"c={c}" for c in all_conc])
    a_tp.set_ylabel("output tokens / s")
    a_tp.set_title("Throughput vs concurrency")
    a_tp.grid(axis="y", alpha=0.3)
    a_tp.legend(fontsize=7)

    fig.suptitle(args.title)
    fig.tight_layout()
    fig.savefig(args.out, dpi=args.dpi)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
