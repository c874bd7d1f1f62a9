#!/usr/bin/env python3
"""Makes the golden-logit fixtures in tests/golden/ with Hugging Face transformers.

The models are kvbridge's own random-weight presets, written by `kvbridge make-model` (weights
are never committed; the test regenerates them with the same preset/arch/seed):

    build/bin/kvbridge make-model --preset tiny --arch llama --seed 1 --out .device/golden_models/llama_tiny_seed1
    build/bin/kvbridge make-model --preset tiny --arch qwen2 --seed 2 --out .device/golden_models/qwen2_tiny_seed2
    python3 scripts/make_golden.py --models .device/golden_models --out tests/golden

(run where torch + transformers are installed; here, on the device machine with
carry [".device"]). Each model is loaded with LlamaForCausalLM / Qwen2ForCausalLM in float64
(bf16 weights upcast exactly, eager attention) and the logits of a few positions of a few
byte-tokenized prompts are saved. src/model/golden_test.cc asserts
|ours - hf| <= 1e-4 * max(1, |hf|) for every saved logit.
"""
import argparse
import json
import os

import torch
import transformers

MODELS = [
    # (directory name, arch, preset, seed, class name)
    ("llama_tiny_seed1", "llama", "tiny", 1, "LlamaForCausalLM"),
    ("qwen2_tiny_seed2", "qwen2", "tiny", 2, "Qwen2ForCausalLM"),
]
PROMPTS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog.",
    "kvbridge: disaggregated prefill/decode — ✓ 日本語",
]
BOS = 256


def encode(text):
    return [BOS] + list(text.encode("utf-8"))


def positions_for(n):
    picks = [0, 1, 15, 16, 17, 31, 32, 33, n // 2, n - 2, n - 1]
    return sorted({p for p in picks if 0 <= p < n})


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.set_grad_enabled(False)
    for dirname, arch, preset, seed, cls_name in MODELS:
        path = os.path.join(args.models, dirname)
        cls = getattr(transformers, cls_name)
        model = cls.from_pretrained(path, torch_dtype=torch.float64, attn_implementation="eager")
        model.eval()
        fixture = {
            "generator": "scripts/make_golden.py",
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "compute_dtype": "float64",
            "model": {"preset": preset, "arch": arch, "seed": seed, "class": cls_name},
            "tolerance": "|ours - hf| <= 1e-4 * max(1, |hf|)",
            "prompts": [],
        }
        for text in PROMPTS:
            ids = encode(text)
            out = model(input_ids=torch.tensor([ids]), use_cache=False)
            logits = out.logits[0]
            pos = positions_for(len(ids))
            fixture["prompts"].append({
                "text": text,
                "token_ids": ids,
                "positions": pos,
                "logits": [[float("%.9g" % v) for v in logits[p].tolist()] for p in pos],
            })
        dest = os.path.join(args.out, dirname + ".json")
        with open(dest, "w") as f:
            json.dump(fixture, f, separators=(",", ":"))
            f.write("\n")
        print("wrote", dest, "max |logit|", float(logits.abs().max()))


if __name__ == "__main__":
    main()
