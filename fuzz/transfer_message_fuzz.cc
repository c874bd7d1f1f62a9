// libFuzzer target: agent notification/reply messages (decode, then re-encode round trip).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "transfer/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvbridge::transfer::wire;
  auto m = DecodeAgentMessage(std::string_view(reinterpret_cast<const char*>(data), size));
  if (m.ok()) {
    std::string again = EncodeAgentMessage(*m);
    if (again != std::string_view(reinterpret_cast<const char*>(data), size)) __builtin_trap();
  }
  return 0;
}
