// libFuzzer target: a tokenizer.json (any bytes) must load or be refused with a Status
// (InvalidArgument naming the JSON path, Unimplemented naming the component), never crash or
// hang; a tokenizer that loads must encode and decode (and stream) any text without crashing.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/model/tokenizer.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvbridge;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto tok = Tokenizer::FromHuggingFaceJson(text, "", "fuzz/tokenizer.json");
  if (!tok.ok()) {
    const StatusCode c = tok.status().code();
    if (c != StatusCode::kInvalidArgument && c != StatusCode::kUnimplemented) __builtin_trap();
    return 0;
  }
  for (std::string_view s :
       {std::string_view("Hello world! 123 <s>"), std::string_view(""),
        std::string_view("\xC3\xA9t\xC3\xA9  \n\t\xE2\x96\x81x"), text.substr(0, 64)}) {
    auto ids = tok->Encode(s, true);
    if (!ids.ok()) continue;  // invalid UTF-8, or no unk_token for a character
    for (int32_t id : *ids) {
      if (id < 0 || id >= tok->vocab_size()) __builtin_trap();
    }
    const std::string back = tok->Decode(*ids, false);
    IncrementalDecoder stream(*tok, /*skip_special_tokens=*/false);
    std::string streamed;
    for (int32_t id : *ids) streamed += stream.Push(id);
    streamed += stream.Finish();
    if (streamed != back) __builtin_trap();
  }
  std::vector<int32_t> some;
  for (size_t i = 0; i + 1 < size && i < 32; i += 2) some.push_back(data[i] | (data[i + 1] << 8));
  (void)tok->Decode(some, true);
  return 0;
}
