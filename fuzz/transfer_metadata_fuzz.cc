// libFuzzer target: agent metadata decode (JSON) and the compatibility check.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "kvbridge/transfer/metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvbridge::transfer;
  auto m = DecodeMetadata(std::string_view(reinterpret_cast<const char*>(data), size));
  if (m.ok()) {
    (void)CheckCompatible(*m, *m);
    auto again = DecodeMetadata(EncodeMetadata(*m));
    if (!again.ok()) __builtin_trap();
  }
  return 0;
}
