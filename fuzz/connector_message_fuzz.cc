// libFuzzer target: the P/D control messages a peer rank sends (read_done, hold_reply,
// heartbeat, release, write_blocks, write_done, write_cancel). Any input must decode to a message
// or an InvalidArgument, never crash; a decoded message must survive Encode → Decode unchanged.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvbridge/connector/messages.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvbridge;
  auto m = DecodeMessage(std::string_view(reinterpret_cast<const char*>(data), size));
  if (m.ok()) {
    auto again = DecodeMessage(EncodeMessage(*m));
    if (!again.ok() || !(*again == *m)) __builtin_trap();
  }
  return 0;
}
