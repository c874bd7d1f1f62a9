#!/usr/bin/env python3
"""Writes tests/data/hf_tokenizers_fixture.json with Hugging Face's Python `tokenizers` (Rust),
and measures its encode throughput (docs/model.md "Tokenizers").

  python3 tests/tools/hf_python_fixture.py TOKENIZERS_DIR PROMPTS_JSONL DATA_DIR OUT_JSON \
      [--bench-seconds S]

TOKENIZERS_DIR holds qwen3/ llama3_1/ llama2/ (tokenizer.json + tokenizer_config.json);
DATA_DIR holds tokenizer_cases.json and tokenizer_variants.json (tests/data). The fixture has,
for the three tokenizers and every variant: the ids of each text with and without special
tokens, and the decode (both skip settings) of the ids of each text and of random id
sequences; plus what transformers.AutoTokenizer gives for the three tokenizers (compared, not
used by the test). Run where `tokenizers` is installed (the GPU machine); prints the bench
lines on stdout.
"""
import json
import os
import random
import sys
import time
import traceback

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import tokenizers  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

BASES = ["qwen3", "llama3_1", "llama2"]


def expand_texts(cases):
    texts = list(cases["texts"])
    for r in cases["repeats"]:
        texts.append(r[0] * r[1] + (r[2] if len(r) > 2 else ""))
    return texts


def variant_json(base_json, patch):
    j = json.loads(json.dumps(base_json))
    for k, v in patch.items():
        if k == "model":
            j["model"].update(v)
        elif k == "added_tokens_extra":
            j["added_tokens"] = j.get("added_tokens", []) + v
        else:
            j[k] = v
    return j


def random_ids(rng, vocab_size, count):
    seqs = []
    for _ in range(count):
        n = 1 + rng.randrange(12)
        ids = []
        for _ in range(n):
            r = rng.randrange(10)
            if r < 6:
                ids.append(rng.randrange(vocab_size))
            elif r < 9:
                ids.append(rng.randrange(300))
            else:
                ids.append(vocab_size - 1 - rng.randrange(30))
        seqs.append(ids)
    return seqs


def main():
    tok_dir, prompts_path, data_dir, out_path = sys.argv[1:5]
    bench_seconds = 3.0
    if "--bench-seconds" in sys.argv:
        bench_seconds = float(sys.argv[sys.argv.index("--bench-seconds") + 1])
    cases = json.load(open(os.path.join(data_dir, "tokenizer_cases.json"), encoding="utf-8"))
    variants = json.load(open(os.path.join(data_dir, "tokenizer_variants.json"), encoding="utf-8"))
    prompts = [json.loads(l)["model_input"] for l in open(prompts_path, encoding="utf-8") if l.strip()]
    texts = expand_texts(cases)
    fixture = {"tokenizers_version": tokenizers.__version__, "encode": [], "decode": [],
               "errors": [], "transformers": {}}
    rng = random.Random(1234)
    base_json = {}
    loaded = {}
    for name in BASES:
        path = os.path.join(tok_dir, name, "tokenizer.json")
        base_json[name] = json.load(open(path, encoding="utf-8"))
        loaded[name] = Tokenizer.from_file(path)

    def run(name, tok, run_texts, n_random):
        for t in run_texts:
            try:
                w = tok.encode(t, add_special_tokens=True).ids
                wo = tok.encode(t, add_special_tokens=False).ids
                fixture["encode"].append({"tok": name, "text": t, "with": w, "without": wo})
                fixture["decode"].append({"tok": name, "ids": w,
                                          "skip": tok.decode(w, skip_special_tokens=True),
                                          "keep": tok.decode(w, skip_special_tokens=False)})
            except Exception as e:  # noqa: BLE001
                fixture["errors"].append({"tok": name, "text": t, "error": repr(e)})
        vocab_size = tok.get_vocab_size(with_added_tokens=True)
        for ids in random_ids(rng, vocab_size, n_random):
            try:
                fixture["decode"].append({"tok": name, "ids": ids,
                                          "skip": tok.decode(ids, skip_special_tokens=True),
                                          "keep": tok.decode(ids, skip_special_tokens=False)})
            except Exception as e:  # noqa: BLE001
                fixture["errors"].append({"tok": name, "ids": ids, "error": repr(e)})

    for name in BASES:
        run(name, loaded[name], texts + prompts[:24], 150)
    short = [t for t in texts if len(t) <= 600] + cases["variant_texts"]
    for v in variants["variants"]:
        try:
            tok = Tokenizer.from_str(json.dumps(variant_json(base_json[v["base"]], v["patch"])))
        except Exception as e:  # noqa: BLE001
            fixture["errors"].append({"tok": v["name"], "error": "load: " + repr(e)})
            continue
        run(v["name"], tok, short, 40)

    # transformers.AutoTokenizer on the same texts (reported, not a test input).
    try:
        import transformers
        from transformers import AutoTokenizer
        fixture["transformers_version"] = transformers.__version__
        for name in BASES:
            info = {"checked": 0, "encode_mismatches": [], "decode_mismatches": 0}
            try:
                at = AutoTokenizer.from_pretrained(os.path.join(tok_dir, name))
                info["class"] = type(at).__name__
                for t in texts + prompts:
                    ours = loaded[name].encode(t, add_special_tokens=True).ids
                    theirs = list(at(t, add_special_tokens=True)["input_ids"])
                    info["checked"] += 1
                    if ours != theirs and len(info["encode_mismatches"]) < 5:
                        info["encode_mismatches"].append({"text": t, "tokenizers": ours,
                                                          "transformers": theirs})
                    if at.decode(ours, skip_special_tokens=True) != loaded[name].decode(
                            ours, skip_special_tokens=True):
                        info["decode_mismatches"] += 1
            except Exception:  # noqa: BLE001
                info["error"] = traceback.format_exc()[-2000:]
            fixture["transformers"][name] = info
    except Exception:  # noqa: BLE001
        fixture["transformers"]["error"] = traceback.format_exc()[-2000:]

    with open(out_path, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, separators=(",", ":"))
    print("fixture: %d encodes, %d decodes, %d errors" % (
        len(fixture["encode"]), len(fixture["decode"]), len(fixture["errors"])), flush=True)

    # Throughput, one thread: encode() per prompt, and encode_batch (RAYON_NUM_THREADS=1).
    total = sum(len(p.encode("utf-8")) for p in prompts)
    for name in BASES:
        tok = loaded[name]
        n_tokens = sum(len(tok.encode(p, add_special_tokens=False).ids) for p in prompts)
        for mode in ("encode", "encode_batch"):
            rounds = 0
            t0 = time.perf_counter()
            c0 = time.process_time()
            while time.perf_counter() - t0 < bench_seconds:
                if mode == "encode":
                    for p in prompts:
                        tok.encode(p, add_special_tokens=False)
                else:
                    tok.encode_batch(prompts, add_special_tokens=False)
                rounds += 1
            wall = time.perf_counter() - t0
            cpu = time.process_time() - c0
            print("python-tokenizers %s %s %s prompts=%d bytes=%d tokens=%d rounds=%d MB/s=%.2f "
                  "cpu_MB/s=%.2f" % (tokenizers.__version__, mode, name, len(prompts), total,
                                     n_tokens, rounds, total * rounds / wall / 1e6,
                                     total * rounds / cpu / 1e6), flush=True)


if __name__ == "__main__":
    main()
