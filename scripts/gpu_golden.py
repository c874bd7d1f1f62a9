#!/usr/bin/env python3
"""Golden logits of the GPU forward pass against Hugging Face transformers on the same GPU.

    python3 scripts/gpu_golden.py --model DIR --logits DIR --label NAME [--md OUT.md]

DIR/--logits holds what `cuda_model_test --gtest_filter=*GoldenExport` wrote (KVB_GOLDEN_MODEL,
KVB_GOLDEN_OUT): prompts.txt (token ids, one prompt a line) and [prompts][vocab] float32
last-token logits: gpu_bf16.f32 / gpu_fp32.f32 (kvbridge on the GPU, KV cache bf16 / fp32)
and cpu_bf16.f32 / cpu_fp32.f32 (kvbridge's CPU forward). transformers runs the same weights
on the GPU in float32 and in bfloat16 (eager attention). One markdown row per (reference,
ours): max |ours - ref| over all logits, max |ref|, their ratio, argmax agreement.
"""
import argparse
import os

import numpy as np
import torch
import transformers


def load(model_dir, dtype):
    cls = transformers.AutoModelForCausalLM
    try:
        m = cls.from_pretrained(model_dir, dtype=dtype, attn_implementation="eager")
    except TypeError:
        m = cls.from_pretrained(model_dir, torch_dtype=dtype, attn_implementation="eager")
    return m.cuda().eval()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--logits", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--md")
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    prompts = [[int(t) for t in line.split()] for line in open(os.path.join(a.logits, "prompts.txt"))
               if line.strip()]
    ours = {}
    for name in ("gpu_bf16", "gpu_fp32", "cpu_bf16", "cpu_fp32"):
        p = os.path.join(a.logits, name + ".f32")
        if os.path.exists(p):
            ours[name] = np.fromfile(p, dtype=np.float32).reshape(len(prompts), -1)
    rows = []
    refs = {}
    for tname, dtype in (("hf_fp32", torch.float32), ("hf_bf16", torch.bfloat16)):
        model = load(a.model, dtype)
        out = []
        for ids in prompts:
            x = torch.tensor([ids], device="cuda")
            out.append(model(x).logits[0, -1].float().cpu().numpy())
        refs[tname] = np.stack(out)
        del model
        torch.cuda.empty_cache()
    pairs = [(r, o) for r in refs for o in ours] + [("cpu_fp32", "gpu_fp32"), ("cpu_bf16", "gpu_bf16"),
                                                   ("hf_fp32", "hf_bf16")]
    allv = dict(refs, **ours)
    for r, o in pairs:
        if r not in allv or o not in allv:
            continue
        ref, got = allv[r], allv[o]
        d = float(np.max(np.abs(got.astype(np.float64) - ref)))
        mx = float(np.max(np.abs(ref)))
        am = int(np.sum(np.argmax(got, 1) == np.argmax(ref, 1)))
        rows.append(f"| {a.label} | {r} | {o} | {d:.4g} | {mx:.4g} | {d / mx:.3g} | {am}/{len(prompts)} |")
    head = ("| model | reference | ours | max abs diff | max abs ref | ratio | argmax same |\n"
            "|---|---|---|---|---|---|---|")
    text = head + "\n" + "\n".join(rows)
    print(f"prompts: {[len(p) for p in prompts]} tokens; transformers {transformers.__version__}, "
          f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(text)
    if a.md:
        with open(a.md, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
