#include "kvbridge/server/tokenizer_codec.h"

namespace kvbridge::server {

std::vector<int32_t> TokenizerCodec::Encode(std::string_view text) const {
  return tok_.Encode(text, /*add_bos=*/tok_.bos_id() >= 0);
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
