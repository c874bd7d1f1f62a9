// kvbridge/model/tokenizer.h — the byte-level tokenizer (the default for kvbridge models).
//
// Ids 0..255 are the UTF-8 bytes themselves; BOS, EOS and PAD are special ids >= 256 taken from
// the model config (make-model uses 256, 257, 258). Any text round-trips exactly:
//
//   Tokenizer tok = model->tokenizer();
//   std::vector<int32_t> ids = tok.Encode("Hello", /*add_bos=*/true);  // {256, 72, 101, ...}
//   std::string text = tok.Decode(ids);                                // "Hello" (specials
//   dropped)
//
// A chat template turns messages into one prompt string (see ApplyChatTemplate).
// Thread-safety: immutable after construction; safe to share.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge {

struct ModelConfig;

struct ChatMessage {
  std::string role;  ///< "system" | "user" | "assistant"
  std::string content;
};

class Tokenizer {
 public:
  static constexpr int kNumByteTokens = 256;

  /// From a model config: needs vocab_size >= 257 and every special id >= 256 and < vocab_size
  /// (InvalidArgument otherwise; a model without BOS/EOS gets none).
  static Result<Tokenizer> ForConfig(const ModelConfig& config);
  Tokenizer(int vocab_size, int bos_id, int eos_id, int pad_id);

  /// Bytes of `text` as ids, optionally preceded by BOS.
  std::vector<int32_t> Encode(std::string_view text, bool add_bos) const;
  /// Concatenated bytes of the byte tokens; special and out-of-range ids are dropped.
  std::string Decode(std::span<const int32_t> ids) const;
  /// Parses a token-id prompt "1, 2,3" (comma or space separated). InvalidArgument on a
  /// non-number or an id outside [0, vocab_size).
  Result<std::vector<int32_t>> ParseTokenIds(std::string_view text) const;
  /// Renders messages as "<|role|>\ncontent\n" each, then "<|assistant|>\n" when
  /// `add_generation_prompt`. The markers are plain bytes (the vocabulary has no role tokens).
  std::string ApplyChatTemplate(std::span<const ChatMessage> messages,
                                bool add_generation_prompt) const;

  bool IsSpecial(int32_t id) const { return id >= kNumByteTokens; }
  int vocab_size() const { return vocab_size_; }
  int bos_id() const { return bos_id_; }  ///< -1 when none
  int eos_id() const { return eos_id_; }  ///< -1 when none
  int pad_id() const { return pad_id_; }  ///< -1 when none

 private:
  int vocab_size_;
  int bos_id_;
  int eos_id_;
  int pad_id_;
};

}  // namespace kvbridge
