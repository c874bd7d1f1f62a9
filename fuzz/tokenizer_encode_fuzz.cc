// libFuzzer target: encode/decode/streaming of any text on two small Hugging Face tokenizers
// built here (byte-level BPE with added tokens of every flag and a Split regex; SentencePiece
// style with byte fallback). Never a crash; valid UTF-8 always encodes; the byte-level one
// round-trips exactly (decode(encode(text)) == text); streamed deltas concatenate to the decode.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>

#include "kvbridge/model/tokenizer.h"
#include "model/hf_internal.h"

namespace {

using kvbridge::Tokenizer;
using Json = nlohmann::json;

Json AddedTokens(int first_id) {
  Json a = Json::array();
  const char* contents[] = {"<|im_start|>", "<|im_end|>", "<tok_l>", "<tok_r>", "word", "ab cd"};
  for (int i = 0; i < 6; ++i) {
    a.push_back({{"id", first_id + i},
                 {"content", contents[i]},
                 {"special", i < 3},
                 {"single_word", i == 4},
                 {"lstrip", i == 2},
                 {"rstrip", i == 3},
                 {"normalized", i >= 4}});
  }
  return a;
}

Tokenizer ByteLevelTokenizer() {
  const auto& chars = kvbridge::model_internal::hf::ByteLevelChars();
  Json vocab = Json::object();
  for (int b = 0; b < 256; ++b) vocab[chars[b]] = b;
  const std::string g = chars[' '];
  Json merges = Json::array();
  int id = 256;
  for (const auto& [a, b] : std::vector<std::pair<std::string, std::string>>{
           {g, "t"}, {"h", "e"}, {g + "t", "he"}, {"i", "n"}, {g, "a"}, {"e", "r"}, {g, g}}) {
    vocab[a + b] = id++;
    merges.push_back(a + " " + b);
  }
  Json j = {
      {"version", "1.0"},
      {"normalizer", {{"type", "NFC"}}},
      {"pre_tokenizer",
       {{"type", "Sequence"},
        {"pretokenizers",
         {{{"type", "Split"},
           {"pattern",
            {{"Regex",
              R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"}}},
           {"behavior", "Isolated"},
           {"invert", false}},
          {{"type", "ByteLevel"}, {"add_prefix_space", false}, {"use_regex", false}}}}}},
      {"post_processor", {{"type", "ByteLevel"}}},
      {"decoder", {{"type", "ByteLevel"}}},
      {"model", {{"type", "BPE"}, {"vocab", vocab}, {"merges", merges}, {"ignore_merges", true}}},
      {"added_tokens", AddedTokens(id)}};
  return *Tokenizer::FromHuggingFaceJson(j.dump(), "", "bytelevel");
}

Tokenizer SentencePieceTokenizer() {
  Json vocab = {{"<unk>", 0}, {"<s>", 1}, {"</s>", 2}};
  int id = 3;
  for (int b = 0; b < 256; ++b) {
    char code[8];
    std::snprintf(code, sizeof(code), "<0x%02X>", b);
    vocab[code] = id++;
  }
  Json merges = Json::array();
  for (const char* c : {"\xE2\x96\x81", "a", "b", "c", "d", "e", "t", "h"}) vocab[c] = id++;
  for (const auto& [a, b] : std::vector<std::pair<std::string, std::string>>{
           {"\xE2\x96\x81", "t"}, {"h", "e"}, {"\xE2\x96\x81t", "he"}, {"a", "b"}}) {
    vocab[a + b] = id++;
    merges.push_back(Json::array({a, b}));
  }
  Json j = {
      {"normalizer",
       {{"type", "Sequence"},
        {"normalizers",
         {{{"type", "Prepend"}, {"prepend", "\xE2\x96\x81"}},
          {{"type", "Replace"}, {"pattern", {{"String", " "}}}, {"content", "\xE2\x96\x81"}}}}}},
      {"pre_tokenizer", nullptr},
      {"post_processor",
       {{"type", "TemplateProcessing"},
        {"single",
         {{{"SpecialToken", {{"id", "<s>"}, {"type_id", 0}}}},
          {{"Sequence", {{"id", "A"}, {"type_id", 0}}}}}},
        {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", {1}}, {"tokens", {"<s>"}}}}}}}},
      {"decoder",
       {{"type", "Sequence"},
        {"decoders",
         {{{"type", "Replace"}, {"pattern", {{"String", "\xE2\x96\x81"}}}, {"content", " "}},
          {{"type", "ByteFallback"}},
          {{"type", "Fuse"}},
          {{"type", "Strip"}, {"content", " "}, {"start", 1}, {"stop", 0}}}}}},
      {"model",
       {{"type", "BPE"},
        {"vocab", vocab},
        {"merges", merges},
        {"unk_token", "<unk>"},
        {"byte_fallback", true},
        {"fuse_unk", true}}},
      {"added_tokens", AddedTokens(id)}};
  return *Tokenizer::FromHuggingFaceJson(j.dump(), "", "sentencepiece");
}

void Stream(const Tokenizer& tok, const std::vector<int32_t>& ids, bool skip) {
  kvbridge::IncrementalDecoder stream(tok, skip);
  std::string text;
  for (int32_t id : ids) text += stream.Push(id);
  text += stream.Finish();
  if (text != tok.Decode(ids, skip)) __builtin_trap();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  static const Tokenizer byte_level = ByteLevelTokenizer();
  static const Tokenizer sentencepiece = SentencePieceTokenizer();
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const bool valid = kvbridge::model_internal::hf::IsValidUtf8(text);
  for (const Tokenizer* tok : {&byte_level, &sentencepiece}) {
    auto ids = tok->Encode(text, true);
    if (ids.ok() != valid) __builtin_trap();
    if (!ids.ok()) continue;
    for (int32_t id : *ids) {
      if (id < 0 || id >= tok->vocab_size()) __builtin_trap();
    }
    Stream(*tok, *ids, true);
    Stream(*tok, *ids, false);
  }
  if (valid) {
    // No normalization changes ASCII; the byte-level tokenizer is lossless on it.
    bool ascii = true;
    for (char c : text) ascii = ascii && static_cast<uint8_t>(c) < 0x80;
    // (lstrip/rstrip added tokens swallow spaces: not lossless around "<tok_")
    if (ascii && text.find("<tok_") == std::string_view::npos &&
        byte_level.Decode(*byte_level.Encode(text, false), false) != text) {
      __builtin_trap();
    }
  }
  // Raw ids (any value) decode and stream without crashing.
  std::vector<int32_t> raw;
  for (size_t i = 0; i + 1 < size && i < 64; i += 2)
    raw.push_back((data[i] | (data[i + 1] << 8)) % 600);
  for (const Tokenizer* tok : {&byte_level, &sentencepiece}) {
    Stream(*tok, raw, true);
    Stream(*tok, raw, false);
  }
  return 0;
}
