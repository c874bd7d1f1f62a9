#!/usr/bin/env python3
"""One-time check that tests/tools/jinja_render.py (the reference of chat_template_test) renders
as Hugging Face transformers' apply_chat_template(tokenize=False) does, and that kvbridge's
renders (dumped by the C++ test) agree with both.

  KVBRIDGE_DUMP_CHAT_CASES=cases.json build/tests/model_test --gtest_filter=ChatTemplate.RealTemplatesMatchJinja2
  python3 tests/tools/transformers_check.py cases.json TOKENIZERS_DIR   # needs transformers

TOKENIZERS_DIR holds one folder per model (qwen3/, llama3_1/) with tokenizer.json and
tokenizer_config.json; case names start with the folder name. Prints one line per model and
exits 1 on any difference.
"""
import json
import os
import subprocess
import sys

import transformers
from transformers import AutoTokenizer

SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def load_tokenizer(path):
    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - fall back to the generic fast tokenizer
        print(f"AutoTokenizer({path}) failed ({type(e).__name__}: {e}); using PreTrainedTokenizerFast")
        config = json.load(open(os.path.join(path, "tokenizer_config.json")))
        for key in ("tokenizer_class", "added_tokens_decoder", "auto_map"):
            config.pop(key, None)
        return transformers.PreTrainedTokenizerFast(
            tokenizer_file=os.path.join(path, "tokenizer.json"), **config)


def main():
    cases = json.load(open(sys.argv[1]))
    root = sys.argv[2]
    here = os.path.dirname(os.path.abspath(__file__))
    tokenizers = {}
    failures = 0
    counts = {}
    ref_in = []
    for c in cases:
        model = c["name"].split("/")[0]
        if model not in tokenizers:
            tokenizers[model] = load_tokenizer(os.path.join(root, model))
        ref_in.append({"template": tokenizers[model].chat_template, "context": c["context"]})
    ref = json.loads(subprocess.run([sys.executable, os.path.join(here, "jinja_render.py")],
                                    input=json.dumps(ref_in), capture_output=True, text=True,
                                    check=True).stdout)
    for c, r in zip(cases, ref):
        model = c["name"].split("/")[0]
        ctx = dict(c["context"])
        kwargs = {k: v for k, v in ctx.items()
                  if k not in ("messages", "tools", "documents", "add_generation_prompt")
                  and k not in SPECIAL}
        try:
            hf = tokenizers[model].apply_chat_template(
                ctx["messages"], tools=ctx.get("tools"), documents=ctx.get("documents"), tokenize=False,
                add_generation_prompt=ctx["add_generation_prompt"], **kwargs)
            hf_ok = True
        except Exception as e:  # noqa: BLE001
            hf, hf_ok = f"{type(e).__name__}: {e}", False
        same = (hf_ok == r["ok"] == c["ok"]) and (not hf_ok or hf == r["text"] == c["ours"])
        n, bad = counts.get(model, (0, 0))
        counts[model] = (n + 1, bad + (0 if same else 1))
        if not same:
            failures += 1
            print(f"DIFF {c['name']}:\n  transformers: {hf!r}\n  jinja2: {r!r}\n  kvbridge: {c['ours']!r}")
    for model, (n, bad) in counts.items():
        print(f"{model}: {n} cases, {n - bad} equal (transformers {transformers.__version__}, "
              f"jinja2 {__import__('jinja2').__version__})")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
