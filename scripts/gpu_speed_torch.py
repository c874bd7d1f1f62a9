#!/usr/bin/env python3
"""The torch / transformers baselines of the GPU speed figures (issue 19), on the same GPU in the
same device run as cuda_speed_bench (scripts/device_gpu_speed_run.sh). Sections (--sections):

  matmul     torch.matmul(x, w.t()) bf16 (cuBLAS) on qwen2.5-7b's shapes at M = 1, 16, 128, 2048,
             weights rotating over >= 512 MB of copies as in our bench; and an 8192^3 product
  sdpa       torch scaled_dot_product_attention (flash where it runs): decode rows at context
             --ctx (q [B,28,1,128] against K/V [B,4,ctx,128], GQA) and a causal prefill of ctx
  hf         transformers Qwen2ForCausalLM with qwen2.5-7b's config, random bf16 weights on the
             GPU: (a) generate() eager, default dynamic cache: prefill tokens/s of a ctx-token
             prompt and decode step time at each batch; (b) --compile: static cache +
             torch.compile (default mode), batch 1
Weights are torch's own random init (values do not change the timings); the config is the
preset's (random_model.cc). Prints markdown tables; --md appends them to a file.
"""
import argparse
import json
import statistics
import sys
import time

import torch

CFG = dict(hidden=3584, inter=18944, layers=28, heads=28, kv_heads=4, head_dim=128, vocab=152064)


def cuda_ms(fn, reps=20, warm=2):
    ts = []
    for r in range(reps + warm):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn(r)
        b.record()
        b.synchronize()
        if r >= warm:
            ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def matmul(out):
    h, im, q, kv = CFG["hidden"], CFG["inter"], CFG["heads"] * CFG["head_dim"], CFG["kv_heads"] * CFG["head_dim"]
    shapes = [("qkv_proj", q + 2 * kv, h), ("o_proj", h, q), ("gate_up_proj", 2 * im, h),
              ("down_proj", h, im), ("lm_head", CFG["vocab"], h)]
    out("\n### Matmul: torch.matmul (cuBLAS) bf16, same shapes\n")
    out("| shape (N x K) | M | torch us | TFLOP/s | weight GB/s |")
    out("|---|---|---|---|---|")
    res = {}
    for name, n, k in shapes:
        copies = max(1, (512 << 20) // (n * k * 2) + 1)
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.05 for _ in range(copies)]
        for m in (1, 16, 128, 2048):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t = cuda_ms(lambda r: torch.matmul(x, ws[r % copies].t()))
            res[f"{name}_m{m}_us"] = t * 1e3
            out(f"| {name} ({n} x {k}) | {m} | {t*1e3:.1f} | {2*m*n*k/(t*1e-3)/1e12:.1f} | "
                f"{n*k*2/(t*1e-3)/1e9:.0f} |")
        del ws
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t = cuda_ms(lambda r: torch.matmul(a, b), reps=10, warm=3)
    res["peak_8192_TFLOPs"] = 2 * 8192 ** 3 / (t * 1e-3) / 1e12
    out(f"\ntorch.matmul 8192 x 8192 x 8192 bf16 (random): {res['peak_8192_TFLOPs']:.0f} TFLOP/s "
        f"({t:.2f} ms)\n")
    return res


def sdpa(out, ctx, batches):
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    nh, nkv, hd = CFG["heads"], CFG["kv_heads"], CFG["head_dim"]
    out(f"\n### Attention: torch SDPA bf16, one layer (q heads {nh}, KV heads {nkv}, head_dim {hd})\n")
    out("| case | backend | torch us | KV bytes read | GB/s |")
    out("|---|---|---|---|---|")
    res = {}
    cases = [(f"decode batch {b}, context {ctx}", b, 1, False) for b in batches]
    cases.append((f"prefill {ctx} tokens (causal)", 1, ctx, True))
    for name, b, lq, causal in cases:
        q = torch.randn(b, nh, lq, hd, device="cuda", dtype=torch.bfloat16)
        k = torch.randn(b, nkv, ctx, hd, device="cuda", dtype=torch.bfloat16)
        v = torch.randn(b, nkv, ctx, hd, device="cuda", dtype=torch.bfloat16)
        done = False
        for label, backends, gqa in (("flash, GQA", [SDPBackend.FLASH_ATTENTION], True),
                                     ("cuDNN, GQA", [SDPBackend.CUDNN_ATTENTION], True),
                                     ("efficient, GQA", [SDPBackend.EFFICIENT_ATTENTION], True),
                                     ("flash, K/V repeated to 28 heads", [SDPBackend.FLASH_ATTENTION], False)):
            try:
                kk, vv = (k, v) if gqa else (k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1))
                with sdpa_kernel(backends):
                    t = cuda_ms(lambda r: F.scaled_dot_product_attention(q, kk, vv, is_causal=causal, enable_gqa=gqa))
                done = True
                break
            except Exception as e:  # noqa: BLE001 - try the next backend
                last = str(e).splitlines()[0][:120]
        if not done:
            out(f"| {name} | none ran ({last}) | | | |")
            continue
        bytes_ = b * ctx * 2 * nkv * hd * 2
        res[f"sdpa_{'prefill' if causal else 'decode_b%d' % b}_us"] = t * 1e3
        out(f"| {name} | {label} | {t*1e3:.1f} | {bytes_/1e6:.1f} MB | {bytes_/(t*1e-3)/1e9:.0f} |")
    return res


def hf(out, ctx, batches, compile_):
    import transformers
    from transformers import Qwen2Config, Qwen2ForCausalLM
    cfg = Qwen2Config(hidden_size=CFG["hidden"], intermediate_size=CFG["inter"],
                      num_hidden_layers=CFG["layers"], num_attention_heads=CFG["heads"],
                      num_key_value_heads=CFG["kv_heads"], vocab_size=CFG["vocab"],
                      max_position_embeddings=32768, rope_theta=1e6, rms_norm_eps=1e-6,
                      tie_word_embeddings=False, torch_dtype="bfloat16")
    t0 = time.time()
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
    torch.cuda.synchronize()
    out(f"\n### transformers {transformers.__version__} (torch {torch.__version__}), "
        f"Qwen2ForCausalLM with qwen2.5-7b's config, random bf16 weights "
        f"({sum(p.numel() for p in model.parameters())/1e9:.2f} B params, built in {time.time()-t0:.0f} s), "
        f"attn_implementation={model.config._attn_implementation}\n")
    res = {}
    gen = torch.Generator(device="cuda").manual_seed(1)

    def run(b, new, **kw):
        ids = torch.randint(0, CFG["vocab"], (b, ctx), device="cuda", generator=gen)
        torch.cuda.synchronize()
        a = time.time()
        with torch.no_grad():
            o = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                               min_new_tokens=new, do_sample=False, pad_token_id=0, **kw)
        torch.cuda.synchronize()
        assert o.shape[1] == ctx + new, o.shape
        return time.time() - a

    if not compile_:
        out("(a) `generate`, eager, default dynamic cache, greedy; prefill = generate(max_new_tokens=1); "
            "decode step = (generate(1 + N) - generate(1)) / N\n")
        out("| batch | prefill s (prompt " + str(ctx) + ") | prefill tokens/s | N | decode step ms | decode tokens/s |")
        out("|---|---|---|---|---|---|")
        run(1, 2)  # warm-up
        for b in batches:
            n = 32 if b <= 32 else 16
            try:
                p = min(run(b, 1) for _ in range(2))
                full = run(b, 1 + n)
            except torch.cuda.OutOfMemoryError as e:
                out(f"| {b} | OOM: {str(e)[:80]} | | | | |")
                break
            step = (full - p) / n
            res[f"hf_eager_b{b}_prefill_s"] = p
            res[f"hf_eager_b{b}_step_ms"] = step * 1e3
            out(f"| {b} | {p:.3f} | {b*ctx/p:.0f} | {n} | {step*1e3:.2f} | {b/step:.0f} |")
    else:
        # mode="reduce-overhead" (CUDA graphs) fails inside generate() with transformers 5.17 /
        # torch 2.11 ("accessing tensor output of CUDAGraphs that has been overwritten", seen on
        # the H200 2026-12-01): the default inductor mode, no CUDA graphs.
        out("(b) `generate` with a static cache and torch.compile(fullgraph=True) (default mode; "
            "reduce-overhead's CUDA graphs fail inside generate here), batch 1\n")
        model.generation_config.cache_implementation = "static"
        model.forward = torch.compile(model.forward, fullgraph=True)
        a = time.time()
        run(1, 3)
        run(1, 3)
        out(f"compile + warm-up: {time.time()-a:.0f} s\n")
        p = min(run(1, 1) for _ in range(2))
        n = 64
        full = run(1, 1 + n)
        step = (full - p) / n
        res["hf_compiled_b1_step_ms"] = step * 1e3
        res["hf_compiled_b1_prefill_s"] = p
        out("| batch | prefill s | prefill tokens/s | N | decode step ms | decode tokens/s |")
        out("|---|---|---|---|---|---|")
        out(f"| 1 | {p:.3f} | {ctx/p:.0f} | {n} | {step*1e3:.2f} | {1/step:.0f} |")
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="matmul,sdpa,hf")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--compile", action="store_true")
    ap.add_argument("--md")
    ap.add_argument("--json")
    a = ap.parse_args()
    lines = []

    def out(s):
        print(s, flush=True)
        lines.append(s)

    batches = [int(x) for x in a.batches.split(",")]
    res = {"gpu": torch.cuda.get_device_name(0)}
    secs = a.sections.split(",")
    try:
        if "matmul" in secs:
            res.update(matmul(out))
        if "sdpa" in secs:
            res.update(sdpa(out, a.ctx, batches))
        if "hf" in secs:
            res.update(hf(out, a.ctx, batches, a.compile))
    finally:
        if a.md:
            with open(a.md, "a") as f:
                f.write("\n".join(lines) + "\n")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
