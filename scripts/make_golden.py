#!/usr/bin/env python3
"""Makes the golden-logit fixtures in tests/golden/ with Hugging Face transformers.

The models are kvbridge's own random-weight presets, written by `kvbridge make-model`, with the
RoPE/context fields of config.json changed per variant (weights depend only on tensor names,
shapes and the seed, so src/model/golden_test.cc regenerates each model from the config and
seed stored in its fixture; weights are never committed). Two steps:

    # here (no torch needed): write the models
    python3 scripts/make_golden.py prepare --kvbridge build/bin/kvbridge --models .device/arch/models
    # where torch + transformers are (the device machine, carry [".device/arch"]):
    python3 scripts/make_golden.py run --models .device/arch/models --out OUT
    # -> OUT/golden.tar.gz (one JSON per model: unpack into tests/golden/), OUT/hf_src.tar.gz
    #    (the transformers sources used), OUT/log.txt

Reference ("f64"): each model runs with its class (LlamaForCausalLM, ...) in float64 on CPU with
eager attention. Stock transformers computes three things in fp32 even then: RMSNorm (upcasts
to fp32), the RoPE angles (fp32 inv_freq @ fp32 positions) and the attention softmax
(dtype=torch.float32). The reference replaces exactly those three with float64 versions of the
same formulas: RMSNorm modules get a float64 forward, the rotary module's inv_freq is
recomputed by transformers' own rope init function with torch.float/float32 bound to float64
(checked against the stock fp32 inv_freq: relative difference < 1e-6) and softmax is asked for
float64. The stock outputs are kept as a cross-check ("stock_vs_f64" in each fixture: the
largest |stock - f64| / (1 + max |row|), i.e. transformers' own fp32 error).

Fixture per model: the config.json and seed; the rotary inv_freq (f64 and stock) and attention
scaling; per prompt: token ids, full logit rows at a few positions ("rows") and, at every 4th
position, a digest: sum, sum of squares, sum of |.|, max |.| of the row and its top-4
(id, logit).
"""
import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
import traceback
import types

BOS = 256
TINY_SHAPE = {"max_position_embeddings": 1024}

# (name, preset arch, seed, config.json changes). Prompts longer than the scaled models'
# original_max_position_embeddings / max_position_embeddings where the type needs it.
MODELS = [
    ("llama_tiny_seed1", "llama", 1, {}),
    ("qwen2_tiny_seed2", "qwen2", 2, {}),
    ("qwen3_tiny_seed3", "qwen3", 3, {}),
    ("mistral_tiny_seed4", "mistral", 4, {}),
    # Llama 3.x: bands at orig/high = 16 and orig/low = 64 with theta 1e4 and head_dim 16 put
    # pairs 0 (wavelength 6.3) in the kept band, 1 and 2 (19.9, 62.8) in the smoothed band and
    # 3..7 in the divided band.
    ("llama3rope_tiny_seed5", "llama", 5,
     {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}),
    # Linear, with the legacy "type" key.
    ("linear_tiny_seed6", "llama", 6, {"rope_scaling": {"type": "linear", "factor": 4.0}}),
    # Dynamic NTK in transformers 5 "rope_parameters" form (rope_theta inside). Exact (equal to
    # default RoPE) for every sequence within max_position_embeddings = 128; prompts reach 128.
    ("dynamic_tiny_seed7", "llama", 7,
     {"rope_scaling": None, "rope_theta": None, "max_position_embeddings": 128,
      "rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    # YaRN as Qwen3 documents it (factor 4 over the original context), theta 1e4 so the tiny
    # head_dim has pairs on both sides of the ramp.
    ("yarn_qwen3_tiny_seed8", "qwen3", 8,
     {"rope_theta": 10000.0, "max_position_embeddings": 256,
      "rope_scaling": {"rope_type": "yarn", "factor": 4.0,
                       "original_max_position_embeddings": 64}}),
    # YaRN with every optional key: beta_fast/beta_slow, mscale/mscale_all_dim, truncate false.
    ("yarn_llama_tiny_seed9", "llama", 9,
     {"max_position_embeddings": 256,
      "rope_scaling": {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 32,
                       "beta_fast": 16.0, "beta_slow": 2.0, "mscale": 1.0,
                       "mscale_all_dim": 0.5, "truncate": False}}),
]
CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
           "qwen3": "Qwen3ForCausalLM", "mistral": "MistralForCausalLM"}

PROMPTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog "
    "again, and once more.",
    "kvbridge: disaggregated prefill/decode \u2014 \u2713 \u65e5\u672c\u8a9e. Prefill runs on "
    "one engine, decode on another, and the KV cache moves between them block by block, bitwise "
    "equal to a colocated engine.",
]


def encode(text, limit):
    return ([BOS] + list(text.encode("utf-8")))[:limit]


def row_positions(n):
    picks = [0, 33, 65, n // 2, n - 1]
    return sorted({p for p in picks if 0 <= p < n})


def digest_positions(n):
    return sorted({p for p in range(n) if p % 4 == 3} | {n - 1})


def prepare(args):
    os.makedirs(args.models, exist_ok=True)
    for name, arch, seed, changes in MODELS:
        path = os.path.join(args.models, name)
        subprocess.run([args.kvbridge, "make-model", "--preset", "tiny", "--arch", arch, "--seed",
                        str(seed), "--out", path], check=True)
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        for k, v in changes.items():
            if v is None:
                cfg.pop(k, None)
            else:
                cfg[k] = v
        with open(cfg_path, "w") as f:
            json.dump(cfg, f, indent=2)
            f.write("\n")
        print("prepared", path)


# ---------------------------------------------------------------------------------------------
# The float64 reference (see the module docstring).


def rope_f64(torch, rot, config):
    """transformers' rope init function for `rot`, evaluated with float64 tensors."""
    from transformers import modeling_rope_utils as mru
    rope_type = getattr(rot, "rope_type", "default")
    fn = getattr(rot, "rope_init_fn", None)
    if fn is None:
        fn = mru.ROPE_INIT_FUNCTIONS.get(rope_type)
    if fn is None:
        fn = getattr(type(rot), "compute_default_rope_parameters", None)
    if fn is None:
        fn = getattr(mru, "_compute_default_rope_parameters")
    saved = (torch.float, torch.float32, torch.Tensor.float)
    torch.float = torch.float64
    torch.float32 = torch.float64
    torch.Tensor.float = lambda self, *a, **k: self.to(torch.float64)
    try:
        inv, att = fn(getattr(rot, "config", config), torch.device("cpu"))
    finally:
        torch.float, torch.float32, torch.Tensor.float = saved
    return inv, float(att)


def patch_f64(torch, model, log):
    info = {"rmsnorm_modules": 0}
    for mod in model.modules():
        if type(mod).__name__.endswith("RMSNorm"):
            eps = getattr(mod, "variance_epsilon", None)
            if eps is None:
                eps = mod.eps

            def norm_forward(self, x, _eps=eps):
                x = x.to(torch.float64)
                var = x.pow(2).mean(-1, keepdim=True)
                return self.weight.to(torch.float64) * (x * torch.rsqrt(var + _eps))

            mod.forward = types.MethodType(norm_forward, mod)
            info["rmsnorm_modules"] += 1
    rots = [m for m in model.modules() if type(m).__name__.endswith("RotaryEmbedding")]
    if len(rots) != 1:
        raise RuntimeError("expected one rotary embedding module, found %d" % len(rots))
    rot = rots[0]
    stock_inv = rot.inv_freq.detach().to(torch.float64).clone()
    stock_att = float(getattr(rot, "attention_scaling", 1.0))
    inv, att = rope_f64(torch, rot, model.config)
    info["inv_freq_dtype"] = str(inv.dtype)
    inv = inv.to(torch.float64)
    rel = float(((inv - stock_inv).abs() / stock_inv.abs()).max())
    info["inv_freq_rel_diff_vs_stock"] = rel
    info["attention_scaling_stock"] = stock_att
    info["attention_scaling"] = att
    if rel > 1e-6 or abs(att - stock_att) > 1e-6:
        raise RuntimeError("float64 rope differs from stock: rel %g, att %r vs %r" %
                           (rel, att, stock_att))
    info["inv_freq_f64"] = [float(v) for v in inv.tolist()]
    info["inv_freq_stock"] = [float(v) for v in stock_inv.tolist()]
    info["rope_type"] = getattr(rot, "rope_type", "default")
    rot._kvb_inv = inv
    rot._kvb_att = att

    def rot_forward(self, x, position_ids, *a, **k):
        pos = position_ids.to(torch.float64)
        freqs = pos[..., None] * self._kvb_inv
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self._kvb_att).to(x.dtype), (emb.sin() * self._kvb_att).to(x.dtype)

    rot.forward = types.MethodType(rot_forward, rot)
    return info


class Softmax64:
    """While active, softmax asked for fp32 on float64 input computes in float64."""

    def __init__(self, torch):
        self.torch = torch
        self.orig = torch.nn.functional.softmax

    def __enter__(self):
        orig = self.orig
        f64 = self.torch.float64
        f32 = self.torch.float32

        def softmax(input, dim=None, _stacklevel=3, dtype=None):
            if input.dtype == f64 and dtype == f32:
                dtype = f64
            return orig(input, dim=dim, dtype=dtype)

        self.torch.nn.functional.softmax = softmax
        return self

    def __exit__(self, *exc):
        self.torch.nn.functional.softmax = self.orig


def load(torch, transformers, cls_name, path, tied):
    cls = getattr(transformers, cls_name)
    kw = {"attn_implementation": "eager", "output_loading_info": True}
    try:
        model, info = cls.from_pretrained(path, dtype=torch.float64, **kw)
    except TypeError:
        model, info = cls.from_pretrained(path, torch_dtype=torch.float64, **kw)
    missing = [k for k in info.get("missing_keys", []) if not (tied and k == "lm_head.weight")]
    unexpected = list(info.get("unexpected_keys", []))
    if missing or unexpected:
        raise RuntimeError("weights not loaded as written: missing %s, unexpected %s" %
                           (missing, unexpected))
    model = model.to(torch.float64).eval()
    return model


def digest(torch, row):
    top = torch.topk(row, 4)
    def g(v):
        return float("%.12g" % float(v))
    return {"sum": g(row.sum()), "sumsq": g((row * row).sum()), "abssum": g(row.abs().sum()),
            "absmax": g(row.abs().max()),
            "top": [[int(i), g(v)] for v, i in zip(top.values, top.indices)]}


def run(args):
    import torch
    import transformers
    torch.set_grad_enabled(False)
    out_dir = os.path.join(args.out, "golden")
    os.makedirs(out_dir, exist_ok=True)
    print("transformers", transformers.__version__, "torch", torch.__version__, flush=True)
    failures = 0
    for name, arch, seed, _ in MODELS:
        t0 = time.time()
        try:
            path = os.path.join(args.models, name)
            with open(os.path.join(path, "config.json")) as f:
                cfg = json.load(f)
            cls_name = CLASSES[arch]
            tied = bool(cfg.get("tie_word_embeddings"))
            stock = load(torch, transformers, cls_name, path, tied)
            ref = load(torch, transformers, cls_name, path, tied)
            info = patch_f64(torch, ref, print)
            limit = cfg.get("max_position_embeddings", 2048)
            fixture = {
                "generator": "scripts/make_golden.py",
                "transformers": transformers.__version__,
                "torch": torch.__version__,
                "compute": "float64 on CPU, eager attention; RMSNorm, RoPE angles and softmax "
                           "in float64 (stock transformers: fp32)",
                "model": {"name": name, "arch": arch, "seed": seed, "class": cls_name,
                          "config": cfg},
                "rope": info,
                "prompts": [],
            }
            worst_stock = 0.0
            for text in PROMPTS:
                ids = encode(text, limit)
                x = torch.tensor([ids])
                logits_stock = stock(input_ids=x, use_cache=False).logits[0].to(torch.float64)
                with Softmax64(torch):
                    out = ref(input_ids=x, use_cache=False).logits[0]
                fixture["logits_dtype"] = str(out.dtype)
                out = out.to(torch.float64)
                scale = 1 + out.abs().max(dim=-1).values
                worst_stock = max(worst_stock, float(((logits_stock - out).abs().max(dim=-1).values
                                                      / scale).max()))
                pos = row_positions(len(ids))
                dpos = digest_positions(len(ids))
                fixture["prompts"].append({
                    "text": text,
                    "token_ids": ids,
                    "row_positions": pos,
                    "rows": [["%.10g" % v for v in out[p].tolist()] for p in pos],
                    "digest_positions": dpos,
                    "digests": [digest(torch, out[p]) for p in dpos],
                })
            fixture["stock_vs_f64"] = worst_stock
            if worst_stock > 1e-3:
                raise RuntimeError("stock and float64 outputs differ by %g: patch broken" %
                                   worst_stock)
            if "dynamic" in name:
                # transformers' dynamic NTK rescales once a forward call reaches beyond
                # max_position_embeddings, for the whole call: the logits at a position then
                # depend on how many tokens follow it in the same call.
                # (the shorter call first: a longer one leaves the rescaled frequencies behind)
                fresh = load(torch, transformers, cls_name, path, tied)
                ids = encode(PROMPTS[2] * 2, 10 ** 6)[:limit + 32]
                part = fresh(input_ids=torch.tensor([ids[:limit]]), use_cache=False).logits[0]
                full = fresh(input_ids=torch.tensor([ids]), use_cache=False).logits[0]
                fixture["dynamic_prefix_changes_beyond_max"] = float(
                    (full[:limit].to(torch.float64) - part.to(torch.float64)).abs().max())
            # rows as numbers (strings above keep json from printing 17 digits)
            for p in fixture["prompts"]:
                p["rows"] = [[float(v) for v in r] for r in p["rows"]]
            dest = os.path.join(out_dir, name + ".json")
            with open(dest, "w") as f:
                json.dump(fixture, f, separators=(",", ":"))
                f.write("\n")
            print("wrote %s in %.1f s: stock_vs_f64 %.3g, inv_freq rel %.3g, attention %.6f, "
                  "rmsnorms %d, logits %s" % (dest, time.time() - t0, worst_stock,
                                              info["inv_freq_rel_diff_vs_stock"],
                                              info["attention_scaling"], info["rmsnorm_modules"],
                                              fixture["logits_dtype"]), flush=True)
        except Exception:
            failures += 1
            print("FAILED", name, flush=True)
            traceback.print_exc()
            sys.stdout.flush()
    with tarfile.open(os.path.join(args.out, "golden.tar.gz"), "w:gz") as tar:
        tar.add(out_dir, arcname="golden")
    # The transformers sources this ran (to read what it does, offline).
    import inspect
    import transformers.modeling_rope_utils as mru
    root = os.path.dirname(inspect.getsourcefile(mru))
    with tarfile.open(os.path.join(args.out, "hf_src.tar.gz"), "w:gz") as tar:
        for rel in ["modeling_rope_utils.py", "configuration_utils.py", "masking_utils.py",
                    "integrations/sdpa_attention.py", "modeling_utils.py"] + [
                        "models/%s/%s_%s.py" % (m, kind, m) for m in
                        ["llama", "qwen2", "qwen3", "mistral"] for kind in
                        ["modeling", "configuration"]]:
            full = os.path.join(root, rel)
            if os.path.exists(full):
                tar.add(full, arcname="transformers/" + rel)
    print("done, %d failures" % failures, flush=True)
    return 1 if failures else 0


def main():
    ap = argparse.ArgumentParser()
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--kvbridge", required=True)
    p.add_argument("--models", required=True)
    r = sub.add_parser("run")
    r.add_argument("--models", required=True)
    r.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.cmd == "prepare":
        prepare(args)
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
