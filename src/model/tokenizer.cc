#include "kvbridge/model/tokenizer.h"

#include <charconv>

#include "kvbridge/model/config.h"

namespace kvbridge {

Result<Tokenizer> Tokenizer::ForConfig(const ModelConfig& config) {
  const int eos = config.eos_token_ids.empty() ? -1 : config.eos_token_ids[0];
  if (config.vocab_size < kNumByteTokens + 1) {
    return InvalidArgumentError("byte tokenizer needs vocab_size >= 257, model has " +
                                std::to_string(config.vocab_size));
  }
  for (int id : {config.bos_token_id, eos, config.pad_token_id}) {
    if (id != -1 && (id < kNumByteTokens || id >= config.vocab_size)) {
      return InvalidArgumentError(
          "byte tokenizer needs special token ids in [256, vocab_size), "
          "config has " +
          std::to_string(id));
    }
  }
  return Tokenizer(config.vocab_size, config.bos_token_id, eos, config.pad_token_id);
}

Tokenizer::Tokenizer(int vocab_size, int bos_id, int eos_id, int pad_id)
    : vocab_size_(vocab_size), bos_id_(bos_id), eos_id_(eos_id), pad_id_(pad_id) {}

std::vector<int32_t> Tokenizer::Encode(std::string_view text, bool add_bos) const {
  std::vector<int32_t> ids;
  ids.reserve(text.size() + 1);
  if (add_bos && bos_id_ >= 0) ids.push_back(bos_id_);
  for (char c : text) ids.push_back(static_cast<uint8_t>(c));
  return ids;
}

std::string Tokenizer::Decode(std::span<const int32_t> ids) const {
  std::string out;
  out.reserve(ids.size());
  for (int32_t id : ids) {
    if (id >= 0 && id < kNumByteTokens) out.push_back(static_cast<char>(id));
  }
  return out;
}

Result<std::vector<int32_t>> Tokenizer::ParseTokenIds(std::string_view text) const {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == ',' || text[i] == ' ' || text[i] == '\t' || text[i] == '\n') {
      ++i;
      continue;
    }
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(text.data() + i, text.data() + text.size(), v);
    if (ec != std::errc() || ptr == text.data() + i) {
      return InvalidArgumentError("token ids: not a number at offset " + std::to_string(i));
    }
    if (v < 0 || v >= vocab_size_) {
      return InvalidArgumentError("token ids: id " + std::to_string(v) + " outside [0, " +
                                  std::to_string(vocab_size_) + ")");
    }
    ids.push_back(static_cast<int32_t>(v));
    i = static_cast<size_t>(ptr - text.data());
  }
  return ids;
}

std::string Tokenizer::ApplyChatTemplate(std::span<const ChatMessage> messages,
                                         bool add_generation_prompt) const {
  std::string out;
  for (const auto& m : messages) out += "<|" + m.role + "|>\n" + m.content + "\n";
  if (add_generation_prompt) out += "<|assistant|>\n";
  return out;
}

}  // namespace kvbridge
