// src/model/tokenizer_backend.h — what a tokenizer kind implements behind kvbridge::Tokenizer.
// Thread-safety: implementations are immutable after construction.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/status.h"
#include "kvbridge/model/tokenizer.h"

namespace kvbridge::model_internal {

/// The ids and strings every kind reports the same way (Tokenizer's accessors).
struct SpecialIds {
  int vocab_size = 0;
  int bos_id = -1;
  int eos_id = -1;
  int pad_id = -1;
  std::string bos_token;
  std::string eos_token;
};

class TokenizerBackend {
 public:
  explicit TokenizerBackend(SpecialIds special) : special_(std::move(special)) {}
  virtual ~TokenizerBackend() = default;

  virtual Tokenizer::Kind kind() const = 0;
  virtual Result<std::vector<int32_t>> Encode(std::string_view text,
                                              bool add_special_tokens) const = 0;
  virtual std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const = 0;
  virtual std::optional<std::string> IdToToken(int32_t id) const = 0;
  virtual std::optional<int32_t> TokenToId(std::string_view token) const = 0;
  virtual bool IsSpecial(int32_t id) const = 0;
  /// True when `text`, the Decode of `window_ids` (the newest ids of a stream), ends in
  /// something that the next ids may still change: an incomplete UTF-8 character or U+FFFD, or
  /// (Hugging Face kind) a pending byte-fallback run. IncrementalDecoder holds it back.
  virtual bool EndsIncomplete(std::span<const int32_t> window_ids, std::string_view text) const = 0;

  const SpecialIds& special() const { return special_; }

 protected:
  void set_special(SpecialIds s) { special_ = std::move(s); }

 private:
  SpecialIds special_;
};

/// The Hugging Face `tokenizer.json` kind (src/model/hf_tokenizer*.cc).
Result<std::shared_ptr<const TokenizerBackend>> MakeHuggingFaceBackend(
    std::string_view tokenizer_json, std::string_view tokenizer_config_json,
    std::string_view source);

/// True when `text` ends inside a UTF-8 sequence (1-3 bytes of a valid lead + continuation
/// prefix), or with U+FFFD (what lossy UTF-8 conversion writes for an incomplete sequence).
bool EndsInIncompleteUtf8(std::string_view text);

}  // namespace kvbridge::model_internal
