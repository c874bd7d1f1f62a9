// kvbridge/model/tokenizer.h — text <-> token ids for a model.
//
// Two kinds behind one value type:
//  - kHuggingFace: a checkpoint's own `tokenizer.json` (the Hugging Face `tokenizers` format:
//    BPE models, normalizers, pre-tokenizers, added tokens, post-processor, decoder), giving
//    exactly the ids and text of Hugging Face `tokenizers` (docs/model.md "Tokenizers").
//  - kBytes: the byte tokenizer of the random presets: ids 0..255 are the UTF-8 bytes; BOS, EOS
//    and PAD are special ids >= 256 from the model config (make-model uses 256, 257, 258).
//
//   ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(model_dir, config));
//   ASSIGN_OR_RETURN(std::vector<int32_t> ids, tok.Encode("Hello", /*add_special_tokens=*/true));
//   std::string text = tok.Decode(ids, /*skip_special_tokens=*/true);
//
//   IncrementalDecoder stream(tok, /*skip_special_tokens=*/true);
//   for (int32_t id : generated) send(stream.Push(id));   // never half a UTF-8 character
//   send(stream.Finish());                                  // deltas concatenate to Decode(...)
//
// Thread-safety: Tokenizer is immutable after construction and cheap to copy (shared state);
// safe to share across threads. IncrementalDecoder is single-threaded.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge {

struct ModelConfig;

struct ChatMessage {
  std::string role;  ///< "system" | "user" | "assistant" | "tool"
  std::string content;
};

namespace model_internal {
class TokenizerBackend;  // src/model/tokenizer_backend.h
}  // namespace model_internal

class Tokenizer {
 public:
  static constexpr int kNumByteTokens = 256;
  enum class Kind { kBytes, kHuggingFace };

  /// The byte tokenizer for a model config: needs vocab_size >= 257 and every special id >= 256
  /// and < vocab_size (InvalidArgument otherwise; a model without BOS/EOS gets none).
  static Result<Tokenizer> ForConfig(const ModelConfig& config);
  /// The tokenizer of a model directory: `model_dir/tokenizer.json` (with
  /// `tokenizer_config.json` beside it when present) when that file exists, else
  /// ForConfig(config). Errors: InvalidArgument naming the file and the JSON path of a bad
  /// field; Unimplemented naming a component or option that is not supported (never a silent
  /// difference from Hugging Face).
  static Result<Tokenizer> Load(const std::string& model_dir, const ModelConfig& config);
  /// A Hugging Face tokenizer from the text of `tokenizer.json` and of `tokenizer_config.json`
  /// ("" when there is none); `source` (e.g. the file path) prefixes every error.
  static Result<Tokenizer> FromHuggingFaceJson(std::string_view tokenizer_json,
                                               std::string_view tokenizer_config_json,
                                               std::string_view source);
  /// A byte tokenizer (ids as in ForConfig; -1 = none).
  Tokenizer(int vocab_size, int bos_id, int eos_id, int pad_id);

  Kind kind() const;

  /// Token ids of `text`, as Hugging Face `tokenizer.encode(text, add_special_tokens=...)`:
  /// added tokens split out first, then normalizer, pre-tokenizer, model; the post-processor
  /// (e.g. Llama's BOS) only with `add_special_tokens`. Byte kind: the bytes, preceded by BOS
  /// when `add_special_tokens` and the model has one. Errors: InvalidArgument when a
  /// kHuggingFace tokenizer is given text that is not valid UTF-8.
  Result<std::vector<int32_t>> Encode(std::string_view text, bool add_special_tokens) const;
  /// Text of `ids`, as Hugging Face `tokenizer.decode(ids, skip_special_tokens=...)`: ids outside
  /// the vocabulary render as nothing; kHuggingFace output is valid UTF-8 (an incomplete byte
  /// sequence becomes U+FFFD, as `tokenizers` does). Byte kind: the raw bytes (may be invalid
  /// UTF-8); special ids render as nothing whatever `skip_special_tokens` says.
  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens = true) const;

  /// The vocabulary entry of `id` (e.g. "Ġhello", "<|im_end|>"); nullopt outside the vocabulary.
  /// Byte kind: one byte as a string for 0..255, "<bos>"/"<eos>"/"<pad>" for the specials.
  std::optional<std::string> IdToToken(int32_t id) const;
  /// The id of a vocabulary entry or added token; nullopt when there is none.
  std::optional<int32_t> TokenToId(std::string_view token) const;
  /// True for special ids (added tokens with `special: true`; byte kind: ids >= 256).
  bool IsSpecial(int32_t id) const;

  /// Parses a token-id prompt "1, 2,3" (comma or space separated). InvalidArgument on a
  /// non-number or an id outside [0, vocab_size).
  Result<std::vector<int32_t>> ParseTokenIds(std::string_view text) const;
  /// kvbridge's plain chat format: "<|role|>\ncontent\n" per message, then "<|assistant|>\n"
  /// when `add_generation_prompt` (for models without a chat template).
  std::string ApplyChatTemplate(std::span<const ChatMessage> messages,
                                bool add_generation_prompt) const;

  /// Number of ids the tokenizer knows: 1 + the largest id of its vocabulary and added tokens
  /// (byte kind: the model's vocab_size). May be smaller than the model's vocab_size.
  int vocab_size() const;
  int bos_id() const;  ///< -1 when none
  int eos_id() const;  ///< -1 when none (the tokenizer's own; generation_config may add more)
  int pad_id() const;  ///< -1 when none
  /// Token strings of BOS / EOS ("" when none), as chat templates see them.
  const std::string& bos_token() const;
  const std::string& eos_token() const;

  /// The implementation (byte or Hugging Face); for src/model only.
  const model_internal::TokenizerBackend& backend() const { return *backend_; }

 private:
  explicit Tokenizer(std::shared_ptr<const model_internal::TokenizerBackend> backend);
  std::shared_ptr<const model_internal::TokenizerBackend> backend_;
};

/// Streaming detokenization of generated ids. Each Push returns the text that became final;
/// text is held back while it could still change (an incomplete UTF-8 character, a byte-fallback
/// run, a pending `▁` of a SentencePiece-style decoder). Invariant: the concatenation of every
/// Push and the final Finish equals `tokenizer.Decode(all ids, skip_special_tokens)`.
/// Keeps a reference to the tokenizer's shared state (the Tokenizer may go away).
class IncrementalDecoder {
 public:
  IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens);
  /// Adds one generated id; returns the newly final text (often "").
  std::string Push(int32_t id);
  /// End of stream: returns whatever was held back.
  std::string Finish();
  /// Every id pushed so far.
  const std::vector<int32_t>& ids() const { return ids_; }

 private:
  Tokenizer tokenizer_;
  bool skip_special_tokens_;
  std::vector<int32_t> ids_;
  size_t prefix_offset_ = 0;  ///< ids_[prefix_offset_, read_offset_) decode to emitted_tail_
  size_t read_offset_ = 0;
  std::string emitted_;  ///< all text returned so far
};

}  // namespace kvbridge
