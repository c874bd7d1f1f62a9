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

std::vector<std::string> HardCases() {
  std::vector<std::string> t = {
      "",
      " ",
      "Hello world",
      "Hello, world! How are you?",
      "  leading spaces",
      "trailing spaces   ",
      "multiple     spaces    inside",
      "\t\ttabs\tand\t spaces \t",
      "line1\r\nline2\r\n\r\nline3\r",
      "\n\n\nthree newlines then text\n",
      " \n \n  \n",
      "a\u00a0b\u00a0\u00a0c",
      "zero\u200bwidth\u200cjoiner\u200dhere",
      "\ufeffBOM at the start",
      "mid\ufeffBOM",
      "NEL\u0085line\u2028sep\u2029para\u3000ideo",
      "1234567890",
      "3.14159 and 2,718,281,828 and 1e-10",
      "x=12345678901234567890123",
      "\u65e5\u672c\u8a9e\u306e\u30c6\u30ad\u30b9\u30c8\u3067\u3059\u3002",
      "\u4e2d\u6587\u6d4b\u8bd5\uff0c\u5305\u62ec\u6807\u70b9\u7b26\u53f7\uff01",
      "\ud55c\uad6d\uc5b4 \ud14d\uc2a4\ud2b8",
      "\U0001F468\u200D\U0001F469\u200D\U0001F467\u200D\U0001F466 family",
      "\U0001F44D\U0001F3FD thumbs \U0001F1FA\U0001F1F8 flag \U0001F600\U0001F600",
      "e\u0301 vs \u00e9, A\u030a vs \u00c5",
      "\ufb01 ligature \uff26\uff35\uff2c\uff2c width \u2460 \u00bd",
      "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
      "<|endoftext|>",
      "<s>hello</s> <s> x</s>",
      "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
      "<think>\nhmm\n</think>\n\nanswer",
      "<|im_start",
      "<<|im_end|>>",
      "a<|im_end|>b <|im_end|> c",
      "I'm sure don't they'll we've she'd IT'S You'RE it'\u017f",
      "def f(x):\n    return x**2  # comment\n\n\tpass\n",
      "!!!???...,,,;;; --- ___ ***",
      "\u00abquotes\u00bb \u201csmart\u201d \u2018single\u2019 \u2014 dash \u2013 en",
      "\u039f\u0394\u039f\u03a3 \u03bf\u03b4\u03bf\u03c2",
      "ctrl\x01\x02\x7f chars",
      "\U0001D518\U0001D52B\U0001D526\U0001D520\U0001D52C\U0001D521\U0001D522 math",
      "\U00013000 hieroglyph \U0001F9EC",
      "https://example.com/path?q=1&r=two#frag",
      "email@example.com +1 (555) 123-4567",
      "caf\u00e9 na\u00efve r\u00e9sum\u00e9 \u00fcber stra\u00dfe",
      "\u0645\u0631\u062d\u0628\u0627 \u05e9\u05dc\u05d5\u05dd "
      "\u0928\u092e\u0938\u094d\u0924\u0947",
  };
  t.push_back(std::string(5000, 'a'));
  std::string word;
  for (int i = 0; i < 20; ++i) word += "supercalifragilisticexpialidocious";
  t.push_back(word);
  t.push_back(std::string(1000, ' ') + "x");
  t.push_back(std::string(1000, '9'));
  t.push_back(std::string(300, '\n'));
  std::string cjk;
  for (int i = 0; i < 300; ++i) cjk += "\u6f22";
  t.push_back(cjk);
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

// Runs tests/tools/hf_tokenize.mjs on `texts` and `decode` for tokenizer `name`.
Reference RunReference(const std::string& name, const std::vector<std::string>& texts,
                       const std::vector<std::vector<int32_t>>& decode) {
  Reference ref;
  Json req = {{"dir", TokenizerDir(name).string()}, {"texts", texts}, {"decode", decode}};
  const fs::path tmp = fs::temp_directory_path() /
                       ("kvb_hf_req_" + std::to_string(::getpid()) + "_" + name + ".json");
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
    return ref;
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
    return ref;
  }
  Json ans = Json::parse(output, nullptr, false);
  if (ans.is_discarded()) {
    ADD_FAILURE() << "reference output is not JSON: " << output.substr(0, 2000);
    return ref;
  }
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

INSTANTIATE_TEST_SUITE_P(Shared, HfTokenizerRef, ::testing::Values("qwen3", "llama3_1", "llama2"));

}  // namespace
}  // namespace kvbridge
