// src/model/hf_internal.h — the pieces of the Hugging Face tokenizer.json kind
// (src/model/hf_*.cc): Unicode helpers, the PCRE2 regex wrapper, JSON reading with paths, and
// the component interfaces (normalizer, pre-tokenizer, BPE model, decoder).
//
// Every component reproduces what Hugging Face `tokenizers` (Rust) does for the same JSON; the
// comments name the Rust behaviour each one follows. Thread-safety: components are immutable
// after construction (the BPE word cache is internally locked).
#pragma once

#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge::model_internal::hf {

using Json = nlohmann::json;

// ---- Unicode (hf_unicode.cc) ----

/// True when `s` is valid UTF-8 (no surrogates, no overlongs, <= U+10FFFF).
bool IsValidUtf8(std::string_view s);
/// Decodes the code point at s[i] of valid UTF-8; sets *len to its byte length.
char32_t DecodeUtf8(std::string_view s, size_t i, int* len);
inline int Utf8Len(uint8_t lead) { return lead < 0x80 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4; }
void AppendUtf8(char32_t c, std::string* out);
/// `bytes` as UTF-8, each maximal invalid subsequence replaced by U+FFFD (Rust's
/// String::from_utf8_lossy).
std::string Utf8Lossy(std::string_view bytes);

/// Rust char predicates (as `tokenizers` uses them).
bool IsWhitespace(char32_t c);    // char::is_whitespace (White_Space)
bool IsNumeric(char32_t c);       // char::is_numeric (Nd, Nl, No)
bool IsAlphanumeric(char32_t c);  // char::is_alphanumeric (Alphabetic or numeric)
bool IsPunctuation(char32_t c);   // is_ascii_punctuation or general category P*
bool IsRustWordChar(char32_t c);  // Rust regex \w: Alphabetic, M*, Nd, Pc, Join_Control

enum class NormForm { kNfc, kNfd, kNfkc, kNfkd };
/// Unicode normalization (ICU normalizer2) of valid UTF-8.
std::string Normalize(NormForm form, std::string_view s);
/// char::to_lowercase applied code point by code point (no context: final sigma stays σ).
std::string Lowercase(std::string_view s);

// ---- Regex (hf_unicode.cc) ----

/// A compiled PCRE2 pattern in UTF + UCP mode (JIT when available). Patterns written for
/// Oniguruma (tokenizers' SysRegex) or the Rust `regex` crate are translated so the classes
/// \s \S \w \d mean what they mean there.
class Regex {
 public:
  enum class Syntax { kOniguruma, kRustRegex };
  static Result<std::shared_ptr<const Regex>> Compile(std::string_view pattern, Syntax syntax);
  /// A pattern matching `literal` exactly.
  static Result<std::shared_ptr<const Regex>> Literal(std::string_view literal);
  ~Regex();
  Regex(const Regex&) = delete;
  Regex& operator=(const Regex&) = delete;

  /// Appends the [start, end) byte ranges of the successive non-overlapping matches in `text`
  /// (valid UTF-8), as the onig crate's find_iter: an empty match right where the previous
  /// match ended is skipped.
  void FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const;

 private:
  Regex() = default;
  void* code_ = nullptr;  // pcre2_code_8*
};

// ---- JSON with paths (hf_tokenizer.cc) ----

/// Errors of the JSON reading: "<source>: <path>: <what>".
struct JsonCtx {
  std::string_view source;
  Status Invalid(const std::string& path, const std::string& what) const;
  Status Unsupported(const std::string& path, const std::string& what) const;
};
Result<const Json*> Field(const JsonCtx& ctx, const Json& obj, const std::string& path,
                          const char* key);  // required, any type
Result<std::string> StringField(const JsonCtx& ctx, const Json& obj, const std::string& path,
                                const char* key);
/// Optional string: `fallback` when absent or null.
Result<std::string> OptStringField(const JsonCtx& ctx, const Json& obj, const std::string& path,
                                   const char* key, std::string fallback);
Result<bool> OptBoolField(const JsonCtx& ctx, const Json& obj, const std::string& path,
                          const char* key, bool fallback);
Result<int64_t> OptIntField(const JsonCtx& ctx, const Json& obj, const std::string& path,
                            const char* key, int64_t fallback);
/// The `type` of a component object.
Result<std::string> TypeField(const JsonCtx& ctx, const Json& obj, const std::string& path);
/// A `pattern` of Split / Replace: a literal string or an Oniguruma regex.
struct Pattern {
  std::string literal;  // used when regex is null ("" matches nothing)
  std::shared_ptr<const Regex> regex;
  /// Successive non-overlapping matches, as Regex::FindAll.
  void FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const;
};
/// The `pattern` field of `obj`: {"String": s} or {"Regex": r}.
Result<Pattern> PatternField(const JsonCtx& ctx, const Json& obj, const std::string& path);
/// Replaces every match of `pattern` in `s` with `content`.
std::string ReplaceAll(const Pattern& pattern, std::string_view s, std::string_view content);
/// A single-character string field (e.g. Metaspace's replacement).
Result<char32_t> CharField(const JsonCtx& ctx, const Json& obj, const std::string& path,
                           const char* key, char32_t fallback);

// ---- Pieces of text between the stages ----

/// A piece of the text on its way to the model. `at_origin` is true when the piece starts at
/// offset 0 of the original text (Metaspace's prepend_scheme "first" looks at it).
struct Piece {
  std::string text;
  bool at_origin = false;
};

// ---- Normalizers (hf_normalizers.cc) ----

class Normalizer {
 public:
  virtual ~Normalizer() = default;
  virtual std::string Apply(std::string s) const = 0;
};
Result<std::unique_ptr<Normalizer>> ParseNormalizer(const JsonCtx& ctx, const Json& j,
                                                    const std::string& path);

// ---- Pre-tokenizers (hf_pre_tokenizers.cc) ----

class PreTokenizer {
 public:
  virtual ~PreTokenizer() = default;
  /// Splits/transforms every piece of `pieces` in place (empty pieces are dropped).
  virtual void Apply(std::vector<Piece>* pieces) const = 0;
};
Result<std::unique_ptr<PreTokenizer>> ParsePreTokenizer(const JsonCtx& ctx, const Json& j,
                                                        const std::string& path);

/// The ByteLevel alphabet: byte -> its printable code point (GPT-2's bytes_to_unicode).
const std::vector<std::string>& ByteLevelChars();  // 256 UTF-8 strings
/// Inverse: code point -> byte, -1 when the code point is not in the alphabet.
int ByteLevelByte(char32_t c);

// ---- Decoders (hf_decoders.cc) ----

class Decoder {
 public:
  virtual ~Decoder() = default;
  /// Rust decode_chain: tokens in, tokens out (the final text is their concatenation).
  virtual std::vector<std::string> DecodeChain(std::vector<std::string> tokens) const = 0;
  /// True when this decoder (or one in its sequence) is ByteFallback.
  virtual bool HasByteFallback() const { return false; }
};
Result<std::unique_ptr<Decoder>> ParseDecoder(const JsonCtx& ctx, const Json& j,
                                              const std::string& path);
/// "<0xNN>" as ByteFallback reads it; -1 when `token` is not one.
int ByteFallbackValue(std::string_view token);

// ---- BPE model (hf_bpe.cc) ----

struct StringHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const noexcept;
};
using Vocab = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;

class BpeModel {
 public:
  static Result<std::unique_ptr<BpeModel>> Parse(const JsonCtx& ctx, const Json& j,
                                                 const std::string& path);
  /// Appends the ids of one pre-tokenized word. InvalidArgument when a character has no id and
  /// the model has no unk_token (Rust: UnkTokenMissing).
  Status Tokenize(std::string_view word, std::vector<int32_t>* out) const;

  const Vocab& vocab() const { return vocab_; }
  /// id -> token ("" for ids the vocab does not use).
  const std::vector<std::string>& id_to_token() const { return id_to_token_; }
  bool byte_fallback() const { return byte_fallback_; }

 private:
  struct MergeValue {
    uint32_t rank;
    int32_t new_id;
  };
  void MergeWord(std::string_view word, std::vector<int32_t>* ids) const;
  Status InitialSymbols(std::string_view word, std::vector<int32_t>* ids,
                        std::vector<uint32_t>* lens) const;
  const MergeValue* FindMerge(int32_t a, int32_t b) const;

  Vocab vocab_;
  std::vector<std::string> id_to_token_;
  std::vector<int32_t> char_ids_;  // BMP code point -> id of the one-character token, or -1
  // Open-addressing map (a << 32 | b) -> merge, key and value in one slot (one cache line per
  // probe); a key of 0xFFFFFFFFFFFFFFFF is an empty slot.
  struct MergeSlot {
    uint64_t key;
    MergeValue value;
  };
  std::vector<MergeSlot> merge_slots_;
  uint64_t merge_mask_ = 0;
  std::string continuing_subword_prefix_;
  std::string end_of_word_suffix_;
  bool has_prefix_ = false;
  bool has_suffix_ = false;
  bool byte_fallback_ = false;
  bool fuse_unk_ = false;
  bool ignore_merges_ = false;
  int32_t unk_id_ = -1;
  // Bounded per-word cache, as Rust's BPE cache (words shorter than kCacheMaxWord bytes).
  static constexpr size_t kCacheCapacity = 10000;
  static constexpr size_t kCacheMaxWord = 256;
  mutable std::shared_mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>> cache_;
};

}  // namespace kvbridge::model_internal::hf
