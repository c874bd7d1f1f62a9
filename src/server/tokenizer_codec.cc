#include "kvbridge/server/tokenizer_codec.h"

namespace kvbridge::server {

std::vector<int32_t> TokenizerCodec::Encode(std::string_view text) const {
  // The byte kind never fails; a Hugging Face tokenizer refuses invalid UTF-8, which the JSON
  // parser already rejected before a prompt gets here.
  auto ids = tok_.Encode(text, /*add_special_tokens=*/true);
  return ids.ok() ? *std::move(ids) : std::vector<int32_t>{};
}

std::string TokenizerCodec::Decode(std::span<const int32_t> ids) const { return tok_.Decode(ids); }

std::string TokenizerCodec::ApplyChatTemplate(
    const std::vector<TextCodec::ChatMessage>& messages) const {
  std::vector<kvbridge::ChatMessage> converted;
  converted.reserve(messages.size());
  for (const auto& m : messages) converted.push_back({m.role, m.content});
  return tok_.ApplyChatTemplate(converted, /*add_generation_prompt=*/true);
}

}  // namespace kvbridge::server
