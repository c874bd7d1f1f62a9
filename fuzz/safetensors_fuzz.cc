// libFuzzer target: the safetensors parser must reject any malformed input with a Status,
// never crash, hang or read out of bounds (built with ASan+UBSan under -DKVBRIDGE_FUZZ=ON).
#include <cstddef>
#include <cstdint>
#include <string>

#include "kvbridge/model/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto file = kvbridge::SafetensorsFile::Parse(
      std::string(reinterpret_cast<const char*>(data), size), "fuzz.safetensors");
  if (!file.ok()) return 0;
  // Every tensor the parser accepted must be readable (or cleanly refused) as fp32.
  for (const auto& t : file->tensors()) {
    auto v = file->ReadFloat32(t.name, t.shape);
    if (!v.ok()) continue;
    uint64_t elems = 1;
    for (int64_t d : t.shape) elems *= static_cast<uint64_t>(d);
    if (v->size() != elems) __builtin_trap();  // the parser's size check was wrong
  }
  return 0;
}
