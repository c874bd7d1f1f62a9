// Reference tokenization for kvbridge's tokenizer tests: Hugging Face's @huggingface/tokenizers.
//
//   node tests/tools/hf_tokenize.mjs < request.json > answer.json
//   request: {"dir": "<dir with tokenizer.json [+ tokenizer_config.json]>",
//             "texts": ["..."], "decode": [[ids...], ...]}
//   answer:  {"encode": [{"with": [ids], "without": [ids]}, ...],
//             "decode": [{"skip": "text", "keep": "text"}, ...]}
//   or, for {"requests": [request, ...]}: {"answers": [answer, ...]}
// "with"/"without": encode(text, {add_special_tokens: true/false}); "skip"/"keep": decode(ids,
// {skip_special_tokens: true/false}) without transformers' clean_up_tokenization_spaces (as the
// Rust `tokenizers` decode). The package is found in $KVBRIDGE_NPM_TOOLS/node_modules (set by
// the test) or next to this script.
import { readFileSync, existsSync } from "node:fs";
import { createRequire } from "node:module";
import path from "node:path";
import { pathToFileURL, fileURLToPath } from "node:url";

const here = path.dirname(fileURLToPath(import.meta.url));
const roots = [process.env.KVBRIDGE_NPM_TOOLS, here].filter(Boolean).map((r) => path.resolve(r));
let mod = null;
for (const root of roots) {
  const req = createRequire(path.join(root, "package.json"));
  try {
    const m = await import(pathToFileURL(req.resolve("@huggingface/tokenizers")).href);
    mod = m.Tokenizer ? m : m.default;
    break;
  } catch (e) {
    // try the next root
  }
}
if (mod === null) {
  process.stderr.write(
    "hf_tokenize: @huggingface/tokenizers not found (looked in " + roots.join(", ") +
      "); run: npm ci --prefix <build>/npm-tools (scripts/test.sh does)\n");
  process.exit(3);
}
function answer(request) {
  const tj = JSON.parse(readFileSync(path.join(request.dir, "tokenizer.json"), "utf8"));
  const cfgPath = path.join(request.dir, "tokenizer_config.json");
  const cfg = existsSync(cfgPath) ? JSON.parse(readFileSync(cfgPath, "utf8")) : {};
  const tok = new mod.Tokenizer(tj, cfg);
  const out = { encode: [], decode: [] };
  for (const text of request.texts ?? []) {
    out.encode.push({
      with: tok.encode(text, { add_special_tokens: true }).ids,
      without: tok.encode(text, { add_special_tokens: false }).ids,
    });
  }
  for (const ids of request.decode ?? []) {
    const dec = (skip) =>
      ids.length === 0
        ? ""
        : tok.decode(ids, { skip_special_tokens: skip, clean_up_tokenization_spaces: false });
    out.decode.push({ skip: dec(true), keep: dec(false) });
  }
  return out;
}

const request = JSON.parse(readFileSync(0, "utf8"));
const result = request.requests ? { answers: request.requests.map(answer) } : answer(request);
process.stdout.write(JSON.stringify(result));
