// libFuzzer target: the tcp/shm wire decoders (frame header, hello, data request + validation
// against a registration). Build: scripts/fuzz.sh (-DKVBRIDGE_FUZZ=ON, clang).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "transfer/wire.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvbridge::transfer;
  auto h = wire::DecodeFrameHeader(data, size);
  if (size < wire::kFrameHeaderBytes) return 0;
  std::string_view meta(reinterpret_cast<const char*>(data) + wire::kFrameHeaderBytes,
                        size - wire::kFrameHeaderBytes);
  (void)wire::DecodeHello(meta);
  auto req = wire::DecodeDataRequest(meta);
  if (req.ok()) {
    static uint8_t mem[2 * 4 * 1024];
    KvRegistration reg;
    reg.layout = {2, 2, 16, 4, 4, kvbridge::KvDtype::kFp32};  // 1 KiB blocks, 4 KiB layers
    reg.layers = {MemoryRegion{MemoryKind::kHost, -1, mem, 4096},
                  MemoryRegion{MemoryKind::kHost, -1, mem + 4096, 4096}};
    std::vector<int> blocks;
    if (wire::ValidateSegments(*req, reg, &blocks).ok()) {
      for (const auto& s : req->segments) {  // what the server would touch: must be in range
        if (s.offset + s.length > 4096 || s.layer >= 2) __builtin_trap();
      }
      for (int b : blocks) {
        if (b < 0 || b >= 4) __builtin_trap();
      }
    }
  }
  (void)h;
  return 0;
}
