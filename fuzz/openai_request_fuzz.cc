// libFuzzer target: client bodies of POST /v1/completions and /v1/chat/completions. Any JSON
// must give a ParsedRequest within the limits or an ApiError with a 4xx status, never crash.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

#include "kvbridge/model/tokenizer.h"
#include "server/openai_protocol.h"

namespace {

void Check(const std::optional<kvbridge::server::ApiError>& err,
           const kvbridge::server::ParsedRequest& req,
           const kvbridge::server::ProtocolLimits& limits, int32_t vocab) {
  if (err) {
    if (err->status < 400 || err->status > 499 || err->message.empty()) __builtin_trap();
    return;
  }
  if (req.prompts.empty() || req.sampling.n < 1 || req.sampling.n > limits.max_n) __builtin_trap();
  for (const auto& p : req.prompts) {
    if (p.empty() || static_cast<int>(p.size()) > limits.max_model_len) __builtin_trap();
    for (int32_t t : p)
      if (t < 0 || t >= vocab) __builtin_trap();
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvbridge;
  const nlohmann::json body = nlohmann::json::parse(
      std::string_view(reinterpret_cast<const char*>(data), size), nullptr, false);
  if (body.is_discarded()) return 0;
  static const Tokenizer codec(320, 256, 257, 258);
  server::ProtocolLimits limits;
  limits.served_model_name = "tiny";
  limits.max_model_len = 512;
  server::ParsedRequest completion;
  Check(server::ParseCompletionRequest(body, codec, limits, &completion), completion, limits,
        codec.vocab_size());
  server::ParsedRequest chat;
  Check(server::ParseChatRequest(body, codec, limits, &chat), chat, limits, codec.vocab_size());
  return 0;
}
