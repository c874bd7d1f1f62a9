// Encode throughput of @huggingface/tokenizers (MB/s, one thread) on a prompts JSONL file, for
// comparison with kvbridge's tokenizer_bench (docs/model.md "Tokenizers").
//   node tests/tools/hf_bench.mjs DIR PROMPTS.jsonl [SECONDS=3]
import { readFileSync, existsSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { pathToFileURL, fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const root = path.resolve(process.env.KVBRIDGE_NPM_TOOLS ?? here);
const req = createRequire(path.join(root, "package.json"));
const m = await import(pathToFileURL(req.resolve("@huggingface/tokenizers")).href);
const mod = m.Tokenizer ? m : m.default;
const [dir, promptsFile, secondsArg] = process.argv.slice(2);
const seconds = Number(secondsArg ?? 3);
const prompts = readFileSync(promptsFile, "utf8").split("\n").filter((l) => l.length)
  .map((l) => JSON.parse(l).model_input);
const bytes = prompts.reduce((a, p) => a + Buffer.byteLength(p, "utf8"), 0);
const t0 = performance.now();
const tj = JSON.parse(readFileSync(path.join(dir, "tokenizer.json"), "utf8"));
const cfgPath = path.join(dir, "tokenizer_config.json");
const cfg = existsSync(cfgPath) ? JSON.parse(readFileSync(cfgPath, "utf8")) : {};
const tok = new mod.Tokenizer(tj, cfg);
const loadMs = performance.now() - t0;
let tokens = 0;
for (const p of prompts) tokens += tok.encode(p, { add_special_tokens: false }).ids.length;
let rounds = 0;
const start = performance.now();
let elapsed = 0;
while (elapsed < seconds) {
  for (const p of prompts) tok.encode(p, { add_special_tokens: false });
  ++rounds;
  elapsed = (performance.now() - start) / 1000;
}
console.log(`${dir} prompts=${prompts.length} bytes=${bytes} load_ms=${loadMs.toFixed(0)} ` +
  `tokens=${tokens} rounds=${rounds} MB/s=${(bytes * rounds / elapsed / 1e6).toFixed(2)}`);
