// The Hugging Face tokenizer kind against Hugging Face's own implementations, to the id:
//  - @huggingface/tokenizers (npm), run by tests/tools/hf_tokenize.mjs in the same test, on
//    every MT-bench prompt and a table of hard cases, with and without special tokens, and the
//    decode of those ids and of random ids (both skip settings);
//  - fixtures written by the Python `tokenizers` (tests/data/hf_tokenizers_fixture.json).
// Needs ../shared/data/tokenizers (skips, saying so, when absent) and node with the npm package
// (installed by scripts/test.sh: npm ci --prefix build/npm-tools); a missing node or package
// FAILS.
#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>

#include "kvbridge/model/config.h"
#include "kvbridge/model/tokenizer.h"
#include "model/hf_internal.h"
#include "model/tokenizer_backend.h"

namespace kvbridge {
namespace {

namespace fs = std::filesystem;
using Json = nlohmann::json;

// Sanitizer builds (scripts/test.sh's ASan+UBSan stage, Debug) load the 11 MB tokenizer files
// several times slower: there the variant checks keep to the small (Llama 2) base.
#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitizerBuild = true;
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
constexpr bool kSanitizerBuild = true;
#else
constexpr bool kSanitizerBuild = false;
#endif
#else
constexpr bool kSanitizerBuild = false;
#endif

fs::path SourceDir() {
  const char* s = std::getenv("KVBRIDGE_SOURCE_DIR");
  return s != nullptr ? fs::path(s) : fs::path(".");
}

fs::path SharedDir() { return SourceDir() / ".." / "shared"; }

fs::path TokenizerDir(const std::string& name) {
  return SharedDir() / "data" / "tokenizers" / name;
}

// Tokenizers are loaded once per process (the Qwen3 file is 11 MB of JSON).
const Tokenizer& Load(const std::string& name) {
  static std::map<std::string, Tokenizer> cache;
  auto it = cache.find(name);
  if (it == cache.end()) {
    auto t = Tokenizer::Load(TokenizerDir(name).string(), ModelConfig{});
    if (!t.ok()) {
      ADD_FAILURE() << name << ": " << t.status().ToString();
      std::abort();
    }
    it = cache.emplace(name, std::move(*t)).first;
  }
  return it->second;
}

std::vector<std::string> MtBenchPrompts() {
  std::vector<std::string> out;
  std::ifstream in(SharedDir() / "data" / "mt_bench" / "prompts.jsonl");
  std::string line;
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    out.push_back(Json::parse(line)["model_input"].get<std::string>());
  }
  return out;
}

Json ReadJson(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream ss;
  ss << in.rdbuf();
  return Json::parse(ss.str());
}

// tests/data/tokenizer_cases.json: the hard cases (texts, then the repeats expanded).
Json CasesJson() { return ReadJson(SourceDir() / "tests" / "data" / "tokenizer_cases.json"); }

std::vector<std::string> HardCases() {
  const Json cases = CasesJson();
  std::vector<std::string> t = cases["texts"].get<std::vector<std::string>>();
  for (const auto& r : cases["repeats"]) {
    std::string s;
    for (int i = 0; i < r[1].get<int>(); ++i) s += r[0].get<std::string>();
    if (r.size() > 2) s += r[2].get<std::string>();
    t.push_back(s);
  }
  return t;
}

struct Reference {
  std::vector<std::vector<int32_t>> with, without;
  std::vector<std::string> skip, keep;
};

fs::path NpmToolsDir() {
  if (const char* e = std::getenv("KVBRIDGE_NPM_TOOLS")) return e;
  if (const char* b = std::getenv("KVBRIDGE_BIN")) {
    const fs::path p = fs::path(b).parent_path().parent_path() / "npm-tools";
    if (fs::exists(p / "node_modules")) return p;
  }
  return SourceDir() / "build" / "npm-tools";
}

// Runs tests/tools/hf_tokenize.mjs on a request; a null Json (and a test failure) when it
// cannot run.
Json RunNode(const Json& req, const std::string& tag) {
  const fs::path tmp = fs::temp_directory_path() /
                       ("kvb_hf_req_" + std::to_string(::getpid()) + "_" + tag + ".json");
  {
    std::ofstream out(tmp, std::ios::binary);
    out << req.dump();
  }
  const std::string cmd = "KVBRIDGE_NPM_TOOLS='" + NpmToolsDir().string() + "' node '" +
                          (SourceDir() / "tests" / "tools" / "hf_tokenize.mjs").string() + "' < '" +
                          tmp.string() + "' 2>&1";
  std::string output;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    ADD_FAILURE() << "cannot run: " << cmd;
    return Json();
  }
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) output.append(buf, n);
  const int rc = pclose(p);
  fs::remove(tmp);
  if (rc != 0) {
    ADD_FAILURE() << "the reference tokenizer did not run (node and the npm package "
                     "@huggingface/tokenizers are needed: scripts/test.sh installs them with "
                     "`npm ci --prefix build/npm-tools`): "
                  << cmd << "\n"
                  << output.substr(0, 2000);
    return Json();
  }
  Json ans = Json::parse(output, nullptr, false);
  if (ans.is_discarded()) {
    ADD_FAILURE() << "reference output is not JSON: " << output.substr(0, 2000);
    return Json();
  }
  return ans;
}

Reference ToReference(const Json& ans) {
  Reference ref;
  if (!ans.is_object()) return ref;
  for (const auto& e : ans["encode"]) {
    ref.with.push_back(e["with"].get<std::vector<int32_t>>());
    ref.without.push_back(e["without"].get<std::vector<int32_t>>());
  }
  for (const auto& d : ans["decode"]) {
    ref.skip.push_back(d["skip"].get<std::string>());
    ref.keep.push_back(d["keep"].get<std::string>());
  }
  return ref;
}

// The reference's ids of `texts` and decode of `decode` for tokenizer directory `dir`.
Reference RunReference(const fs::path& dir, const std::vector<std::string>& texts,
                       const std::vector<std::vector<int32_t>>& decode) {
  Json req = {{"dir", dir.string()}, {"texts", texts}, {"decode", decode}};
  return ToReference(RunNode(req, dir.filename().string()));
}

Reference RunReference(const std::string& name, const std::vector<std::string>& texts,
                       const std::vector<std::vector<int32_t>>& decode) {
  return RunReference(TokenizerDir(name), texts, decode);
}

std::string Printable(const std::string& s) {
  std::string out;
  for (unsigned char c : s.substr(0, 120)) {
    if (c == '\n') {
      out += "\\n";
    } else if (c < 0x20) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02x", c);
      out += b;
    } else {
      out.push_back(static_cast<char>(c));
    }
  }
  return out;
}

class HfTokenizerRef : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (!fs::exists(TokenizerDir(GetParam()) / "tokenizer.json")) {
      GTEST_SKIP() << "no " << TokenizerDir(GetParam()) << " (../shared absent)";
    }
  }
};

// Ids equal to the reference for every text, both add_special_tokens settings; the decode of
// those ids equal to the reference's, both skip settings.
TEST_P(HfTokenizerRef, EncodeDecodeEqualsReference) {
  const Tokenizer& tok = Load(GetParam());
  EXPECT_EQ(tok.kind(), Tokenizer::Kind::kHuggingFace);
  std::vector<std::string> texts = HardCases();
  const auto prompts = MtBenchPrompts();
  ASSERT_FALSE(prompts.empty());
  texts.insert(texts.end(), prompts.begin(), prompts.end());
  std::vector<std::vector<int32_t>> ours_with, ours_without;
  for (const auto& t : texts) {
    auto w = tok.Encode(t, true);
    auto wo = tok.Encode(t, false);
    ASSERT_TRUE(w.ok()) << w.status().ToString();
    ASSERT_TRUE(wo.ok()) << wo.status().ToString();
    ours_with.push_back(*w);
    ours_without.push_back(*wo);
  }
  const Reference ref = RunReference(GetParam(), texts, ours_with);
  ASSERT_EQ(ref.with.size(), texts.size());
  int bad = 0;
  for (size_t i = 0; i < texts.size(); ++i) {
    EXPECT_EQ(ours_with[i], ref.with[i]) << "text #" << i << " \"" << Printable(texts[i]) << "\"";
    EXPECT_EQ(ours_without[i], ref.without[i])
        << "text #" << i << " \"" << Printable(texts[i]) << "\"";
    EXPECT_EQ(tok.Decode(ours_with[i], true), ref.skip[i]) << "decode of text #" << i;
    EXPECT_EQ(tok.Decode(ours_with[i], false), ref.keep[i]) << "decode of text #" << i;
    if (ours_with[i] != ref.with[i]) ++bad;
  }
  EXPECT_EQ(bad, 0);
}

// True when `ids` hold a run of byte-fallback tokens ("<0xNN>") that is not valid UTF-8: Rust's
// ByteFallback decoder writes one U+FFFD per byte of such a run, the npm package decodes the run
// lossily (fewer U+FFFD). The Python fixtures check those sequences instead.
bool HasInvalidByteRun(const Tokenizer& tok, const std::vector<int32_t>& ids) {
  std::string run;
  auto invalid = [&] {
    if (run.empty()) return false;
    return !model_internal::hf::IsValidUtf8(run);
  };
  for (int32_t id : ids) {
    auto t = tok.IdToToken(id);
    if (t && t->size() == 6 && t->starts_with("<0x") && (*t)[5] == '>' && !tok.IsSpecial(id)) {
      run.push_back(static_cast<char>(std::stoi(t->substr(3, 2), nullptr, 16)));
      continue;
    }
    if (invalid()) return true;
    run.clear();
  }
  return invalid();
}

// Random id sequences (the whole id range, special ids included) decode as the reference's.
TEST_P(HfTokenizerRef, DecodeRandomIdsEqualsReference) {
  const Tokenizer& tok = Load(GetParam());
  std::mt19937 rng(42);
  std::vector<std::vector<int32_t>> seqs;
  for (int i = 0; i < 300; ++i) {
    std::vector<int32_t> ids(1 + rng() % 12);
    for (auto& id : ids) {
      const uint32_t r = rng() % 10;
      // Mostly ordinary ids, some low ids (bytes, byte-fallback tokens), some specials.
      id = r < 6   ? static_cast<int32_t>(rng() % static_cast<uint32_t>(tok.vocab_size()))
           : r < 9 ? static_cast<int32_t>(rng() % 300)
                   : static_cast<int32_t>(tok.vocab_size() - 1 - rng() % 30);
    }
    seqs.push_back(ids);
  }
  const Reference ref = RunReference(GetParam(), {}, seqs);
  ASSERT_EQ(ref.skip.size(), seqs.size());
  int compared = 0;
  for (size_t i = 0; i < seqs.size(); ++i) {
    if (HasInvalidByteRun(tok, seqs[i])) continue;
    ++compared;
    EXPECT_EQ(tok.Decode(seqs[i], true), ref.skip[i]) << "ids " << Json(seqs[i]).dump();
    EXPECT_EQ(tok.Decode(seqs[i], false), ref.keep[i]) << "ids " << Json(seqs[i]).dump();
  }
  EXPECT_GT(compared, 100);
}

// Streaming: the deltas concatenate to the one-shot decode, over random id sequences and over
// the ids of the hard cases, both skip settings.
TEST_P(HfTokenizerRef, StreamingDeltasConcatenateToDecode) {
  const Tokenizer& tok = Load(GetParam());
  std::mt19937 rng(7);
  std::vector<std::vector<int32_t>> seqs;
  for (const auto& t : HardCases()) seqs.push_back(*tok.Encode(t, true));
  for (int i = 0; i < 300; ++i) {
    std::vector<int32_t> ids(1 + rng() % 40);
    for (auto& id : ids) {
      const uint32_t r = rng() % 10;
      id = r < 5   ? static_cast<int32_t>(rng() % static_cast<uint32_t>(tok.vocab_size()))
           : r < 9 ? static_cast<int32_t>(rng() % 300)
                   : static_cast<int32_t>(tok.vocab_size() - 1 - rng() % 30);
    }
    seqs.push_back(ids);
  }
  for (bool skip : {true, false}) {
    for (size_t i = 0; i < seqs.size(); ++i) {
      IncrementalDecoder stream(tok, skip);
      std::string text;
      for (int32_t id : seqs[i]) text += stream.Push(id);
      text += stream.Finish();
      EXPECT_EQ(text, tok.Decode(seqs[i], skip)) << "sequence #" << i << " skip " << skip;
    }
  }
}

// Streams that stop inside a multi-byte character (byte-level BPE) and inside a byte-fallback
// run (Llama 2): every prefix of the ids streams to the one-shot decode of that prefix, and no
// delta before Finish holds U+FFFD or half a character.
TEST_P(HfTokenizerRef, StreamingStopsInsideCharactersAndByteRuns) {
  const Tokenizer& tok = Load(GetParam());
  for (const std::string text : {"x\U00013000\U0001F9EC y \u6f22\u5b57", "\U00013000"}) {
    const std::vector<int32_t> ids = *tok.Encode(text, false);
    ASSERT_GE(ids.size(), 2u) << "expected the rare characters to take several tokens";
    bool stops_inside = false;  // some prefix ends inside a character / byte run
    for (size_t n = 1; n <= ids.size(); ++n) {
      const std::span<const int32_t> prefix(ids.data(), n);
      stops_inside |= model_internal::EndsInIncompleteUtf8(tok.Decode(prefix, true));
      IncrementalDecoder stream(tok, true);
      std::string text_so_far;
      for (int32_t id : prefix) {
        const std::string delta = stream.Push(id);
        EXPECT_EQ(delta.find("\xEF\xBF\xBD"), std::string::npos) << "prefix " << n;
        EXPECT_FALSE(model_internal::EndsInIncompleteUtf8(delta)) << "prefix " << n;
        text_so_far += delta;
      }
      text_so_far += stream.Finish();
      EXPECT_EQ(text_so_far, tok.Decode(prefix, true)) << "prefix " << n;
    }
    EXPECT_TRUE(stops_inside);
  }
}

// ---- Variants: the shared files with other components (tests/data/tokenizer_variants.json) ----

struct Variant {
  std::string name, base;
  std::string json;         // the variant's tokenizer.json text
  std::string config_json;  // the base's tokenizer_config.json text
};

// The variants (built once per process); in sanitizer builds only those of the Llama 2 base.
const std::vector<Variant>& Variants() {
  static const std::vector<Variant> all = [] {
    const Json v = ReadJson(SourceDir() / "tests" / "data" / "tokenizer_variants.json");
    std::map<std::string, Json> bases;
    std::vector<Variant> out;
    for (const auto& e : v["variants"]) {
      const std::string base = e["base"].get<std::string>();
      if (kSanitizerBuild && base != "llama2") continue;
      if (!bases.contains(base)) bases[base] = ReadJson(TokenizerDir(base) / "tokenizer.json");
      Json j = bases[base];
      for (const auto& [k, val] : e["patch"].items()) {
        if (k == "model") {
          for (const auto& [mk, mv] : val.items()) j["model"][mk] = mv;
        } else if (k == "added_tokens_extra") {
          for (const auto& t : val) j["added_tokens"].push_back(t);
        } else {
          j[k] = val;
        }
      }
      std::ifstream cfg(TokenizerDir(base) / "tokenizer_config.json");
      std::ostringstream ss;
      ss << cfg.rdbuf();
      out.push_back(Variant{e["name"].get<std::string>(), base, j.dump(), ss.str()});
    }
    if (kSanitizerBuild) {
      std::printf("[ note ] sanitizer build: only the %zu variants of the llama2 base\n",
                  out.size());
    }
    return out;
  }();
  return all;
}

// The variant tokenizers by name (built once per process).
const std::map<std::string, Tokenizer>& VariantTokenizers() {
  static const std::map<std::string, Tokenizer> all = [] {
    std::map<std::string, Tokenizer> m;
    for (const Variant& v : Variants()) {
      auto t = Tokenizer::FromHuggingFaceJson(v.json, v.config_json, v.name);
      if (!t.ok()) {
        ADD_FAILURE() << v.name << ": " << t.status().ToString();
        std::abort();
      }
      m.emplace(v.name, std::move(*t));
    }
    return m;
  }();
  return all;
}

std::vector<std::string> VariantTexts() {
  std::vector<std::string> t;
  for (const auto& s : HardCases()) {
    if (s.size() <= 600) t.push_back(s);
  }
  const Json cases = CasesJson();  // (a named value: the loop must not outlive it)
  for (const auto& s : cases["variant_texts"]) t.push_back(s.get<std::string>());
  return t;
}

// Every variant: ids (both settings) and decode (both skip settings) equal to the reference's.
TEST(HfTokenizerVariants, EncodeDecodeEqualsReference) {
  if (!fs::exists(TokenizerDir("qwen3") / "tokenizer.json")) {
    GTEST_SKIP() << "no " << TokenizerDir("qwen3") << " (../shared absent)";
  }
  const std::vector<Variant>& variants = Variants();
  const std::vector<std::string> texts = VariantTexts();
  const fs::path root =
      fs::temp_directory_path() / ("kvb_hf_variants_" + std::to_string(::getpid()));
  Json requests = Json::array();
  std::vector<Tokenizer> toks;
  std::vector<std::vector<std::vector<int32_t>>> with(variants.size()), without(variants.size());
  for (size_t v = 0; v < variants.size(); ++v) {
    const Tokenizer* tok = &VariantTokenizers().at(variants[v].name);
    toks.push_back(*tok);
    for (const auto& t : texts) {
      auto w = tok->Encode(t, true);
      auto wo = tok->Encode(t, false);
      ASSERT_TRUE(w.ok() && wo.ok()) << variants[v].name << ": " << w.status().ToString();
      with[v].push_back(*w);
      without[v].push_back(*wo);
    }
    const fs::path dir = root / variants[v].name;
    fs::create_directories(dir);
    std::ofstream(dir / "tokenizer.json", std::ios::binary) << variants[v].json;
    std::ofstream(dir / "tokenizer_config.json", std::ios::binary) << variants[v].config_json;
    requests.push_back({{"dir", dir.string()}, {"texts", texts}, {"decode", with[v]}});
  }
  const Json ans = RunNode({{"requests", requests}}, "variants");
  fs::remove_all(root);
  ASSERT_TRUE(ans.is_object());
  // The npm package does not implement every component as the Rust `tokenizers` does (e.g.
  // Split behaviors other than Isolated/Removed, per-character Lowercase, U+FEFF as
  // whitespace, added-token ids): where it disagrees with the Python fixture, the fixture test
  // (HfTokenizerFixture) is the check and this one skips the text, saying how many.
  std::map<std::pair<std::string, std::string>, const Json*> python;
  const Json fixture = ReadJson(SourceDir() / "tests" / "data" / "hf_tokenizers_fixture.json");
  for (const auto& e : fixture["encode"]) {
    python[{e["tok"].get<std::string>(), e["text"].get<std::string>()}] = &e;
  }
  for (size_t v = 0; v < variants.size(); ++v) {
    const Reference ref = ToReference(ans["answers"][v]);
    ASSERT_EQ(ref.with.size(), texts.size());
    int npm_differs = 0;
    for (size_t i = 0; i < texts.size(); ++i) {
      const std::string where =
          variants[v].name + " text #" + std::to_string(i) + " \"" + Printable(texts[i]) + "\"";
      auto py = python.find({variants[v].name, texts[i]});
      ASSERT_NE(py, python.end()) << where << " is not in the fixture";
      const Json& e = *py->second;
      const auto py_with = e["with"].get<std::vector<int32_t>>();
      const auto py_without =
          e.contains("without") ? e["without"].get<std::vector<int32_t>>() : py_with;
      const std::string py_skip = e["skip"].get<std::string>();
      const std::string py_keep = e.contains("keep") ? e["keep"].get<std::string>() : py_skip;
      if (ref.with[i] != py_with || ref.without[i] != py_without || ref.skip[i] != py_skip ||
          ref.keep[i] != py_keep) {
        ++npm_differs;
        continue;
      }
      EXPECT_EQ(with[v][i], ref.with[i]) << where;
      EXPECT_EQ(without[v][i], ref.without[i]) << where;
      EXPECT_EQ(toks[v].Decode(with[v][i], true), ref.skip[i]) << where;
      EXPECT_EQ(toks[v].Decode(with[v][i], false), ref.keep[i]) << where;
    }
    if (npm_differs > 0) {
      std::printf(
          "[ note ] %s: the npm package differs from the Python tokenizers on %d of %zu "
          "texts (checked by the fixture instead)\n",
          variants[v].name.c_str(), npm_differs, texts.size());
    }
  }
}

// ---- The Python `tokenizers` fixture (tests/data/hf_tokenizers_fixture.json) ----

// The tokenizer a fixture entry names (one of the shared three or a variant); null for a
// variant this build leaves out.
const Tokenizer* FixtureTokenizer(const std::string& name) {
  if (name == "qwen3" || name == "llama3_1" || name == "llama2") return &Load(name);
  auto it = VariantTokenizers().find(name);
  return it == VariantTokenizers().end() ? nullptr : &it->second;
}

TEST(HfTokenizerFixture, EqualsPythonTokenizers) {
  if (!fs::exists(TokenizerDir("qwen3") / "tokenizer.json")) {
    GTEST_SKIP() << "no " << TokenizerDir("qwen3") << " (../shared absent)";
  }
  const Json f = ReadJson(SourceDir() / "tests" / "data" / "hf_tokenizers_fixture.json");
  ASSERT_GT(f["encode"].size(), 1000u);
  for (const auto& e : f["encode"]) {
    const Tokenizer* t = FixtureTokenizer(e["tok"].get<std::string>());
    if (t == nullptr) continue;
    const Tokenizer& tok = *t;
    const std::string text = e["text"].get<std::string>();
    const std::string where = e["tok"].get<std::string>() + " \"" + Printable(text) + "\"";
    const auto with = e["with"].get<std::vector<int32_t>>();
    const auto without = e.contains("without") ? e["without"].get<std::vector<int32_t>>() : with;
    auto w = tok.Encode(text, true);
    auto wo = tok.Encode(text, false);
    ASSERT_TRUE(w.ok() && wo.ok()) << where << ": " << w.status().ToString();
    EXPECT_EQ(*w, with) << where;
    EXPECT_EQ(*wo, without) << where;
    const std::string skip = e["skip"].get<std::string>();
    EXPECT_EQ(tok.Decode(with, true), skip) << where;
    EXPECT_EQ(tok.Decode(with, false), e.contains("keep") ? e["keep"].get<std::string>() : skip)
        << where;
  }
  ASSERT_GT(f["decode"].size(), 500u);
  for (const auto& d : f["decode"]) {
    const Tokenizer* t = FixtureTokenizer(d["tok"].get<std::string>());
    if (t == nullptr) continue;
    const Tokenizer& tok = *t;
    const auto ids = d["ids"].get<std::vector<int32_t>>();
    const std::string where = d["tok"].get<std::string>() + " ids " + Json(ids).dump();
    const std::string skip = d["skip"].get<std::string>();
    EXPECT_EQ(tok.Decode(ids, true), skip) << where;
    EXPECT_EQ(tok.Decode(ids, false), d.contains("keep") ? d["keep"].get<std::string>() : skip)
        << where;
  }
}

// ---- Load errors (no ../shared needed) ----

std::string MiniJson(const std::string& pre_tokenizer, const std::string& extra = "") {
  return R"({"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2}, "merges": ["a b"]},
             "pre_tokenizer": )" +
         pre_tokenizer + extra + "}";
}

// "CODE: message" of loading `json` (and `config`) as dir/tokenizer.json.
std::string LoadError(const std::string& json, const std::string& config = "") {
  return Tokenizer::FromHuggingFaceJson(json, config, "dir/tokenizer.json").status().ToString();
}

TEST(HfTokenizerErrors, NameTheFileAndTheJsonPath) {
  auto ok = Tokenizer::FromHuggingFaceJson(MiniJson("null"), "", "dir/tokenizer.json");
  ASSERT_TRUE(ok.ok()) << ok.status().ToString();
  EXPECT_EQ(*ok->Encode("abab", true), (std::vector<int32_t>{2, 2}));
  EXPECT_EQ(ok->vocab_size(), 3);
  EXPECT_EQ(ok->Encode("a\xFF", true).status().code(), StatusCode::kInvalidArgument);

  EXPECT_EQ(LoadError(MiniJson(R"({"type": "Sequence", "pretokenizers": [{"type": "Digits"},
                               {"type": "UnicodeScripts"}]})")),
            "UNIMPLEMENTED: dir/tokenizer.json: pre_tokenizer.pretokenizers[1].type "
            "\"UnicodeScripts\" is not supported");
  EXPECT_EQ(LoadError(MiniJson("null", R"(, "normalizer": {"type": "BertNormalizer"})")),
            "UNIMPLEMENTED: dir/tokenizer.json: normalizer.type \"BertNormalizer\" is not "
            "supported");
  EXPECT_EQ(LoadError(MiniJson("null", R"(, "truncation": {"max_length": 8})")),
            "UNIMPLEMENTED: dir/tokenizer.json: truncation is not supported (only null)");
  EXPECT_EQ(LoadError(R"({"model": {"type": "WordPiece", "vocab": {}}})"),
            "UNIMPLEMENTED: dir/tokenizer.json: model.type \"WordPiece\" is not supported");
  EXPECT_EQ(LoadError(R"({"model": {"type": "BPE", "dropout": 0.5, "vocab": {}, "merges": []}})"),
            "UNIMPLEMENTED: dir/tokenizer.json: model.dropout (BPE dropout 0.500000) is not "
            "supported");
  EXPECT_EQ(LoadError(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": [3]}})"),
            "INVALID_ARGUMENT: dir/tokenizer.json: model.merges[0]: expected \"left right\" or "
            "[left, right]");
  EXPECT_EQ(LoadError(R"({"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a c"]}})"),
            "INVALID_ARGUMENT: dir/tokenizer.json: model.merges[0]: token \"c\" is not in the "
            "vocab");
  EXPECT_EQ(LoadError(R"({"model": {"type": "BPE", "vocab": {"a": "x"}, "merges": []}})"),
            "INVALID_ARGUMENT: dir/tokenizer.json: model.vocab[\"a\"]: expected an id >= 0");
  EXPECT_EQ(LoadError(MiniJson("null", R"(, "added_tokens": [{"id": "x", "content": "c"}])")),
            "INVALID_ARGUMENT: dir/tokenizer.json: added_tokens[0].id: expected an id in [0, "
            "2^24)");
  EXPECT_EQ(LoadError(MiniJson(R"({"type": "Split", "pattern": {"Regex": "a"},
                               "behavior": "Sideways"})")),
            "INVALID_ARGUMENT: dir/tokenizer.json: pre_tokenizer.behavior: unknown behavior "
            "\"Sideways\"");
  EXPECT_TRUE(LoadError(MiniJson(R"({"type": "Split", "pattern": {"Regex": "(a"},
                                  "behavior": "Isolated"})"))
                  .starts_with("INVALID_ARGUMENT: dir/tokenizer.json: "
                               "pre_tokenizer.pattern.Regex: regex \"(a\" does not compile"));
  EXPECT_TRUE(LoadError("{\"model\": ")
                  .starts_with("INVALID_ARGUMENT: dir/tokenizer.json: not valid JSON"));
  EXPECT_EQ(LoadError(MiniJson("null"), R"({"bos_token": 3})"),
            "INVALID_ARGUMENT: dir/tokenizer_config.json: bos_token: expected a string, "
            "{\"content\": ...} or null");
}

TEST(HfTokenizerErrors, ConfigSpecialTokens) {
  auto t = Tokenizer::FromHuggingFaceJson(
      MiniJson("null", R"(, "added_tokens": [{"id": 3, "content": "<s>", "special": true,
               "normalized": false}, {"id": 4, "content": "</s>", "special": true}])"),
      R"({"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>",
          "pad_token": null})",
      "dir/tokenizer.json");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  EXPECT_EQ(t->bos_id(), 3);
  EXPECT_EQ(t->eos_id(), 4);
  EXPECT_EQ(t->pad_id(), -1);
  EXPECT_EQ(t->bos_token(), "<s>");
  EXPECT_EQ(t->eos_token(), "</s>");
  EXPECT_EQ(t->vocab_size(), 5);
  EXPECT_TRUE(t->IsSpecial(3));
  EXPECT_FALSE(t->IsSpecial(2));
  EXPECT_EQ(*t->Encode("a<s>b</s>", false), (std::vector<int32_t>{0, 3, 1, 4}));
  EXPECT_EQ(t->Decode(std::vector<int32_t>{0, 3, 1, 4, 99}, true), "a b");
  EXPECT_EQ(t->Decode(std::vector<int32_t>{0, 3, 1}, false), "a <s> b");
  EXPECT_EQ(t->TokenToId("ab"), 2);
  EXPECT_EQ(t->IdToToken(4), "</s>");
  EXPECT_EQ(t->IdToToken(5), std::nullopt);
}

INSTANTIATE_TEST_SUITE_P(Shared, HfTokenizerRef, ::testing::Values("qwen3", "llama3_1", "llama2"));

}  // namespace
}  // namespace kvbridge
