#include "kvbridge/common/kv_transfer_mode.h"

#include <string>

namespace kvbridge {

std::string_view KvTransferModeName(KvTransferMode m) {
  return m == KvTransferMode::kWrite ? "write" : "read";
}

Result<KvTransferMode> ParseKvTransferMode(std::string_view text) {
  if (text == "read") return KvTransferMode::kRead;
  if (text == "write") return KvTransferMode::kWrite;
  return InvalidArgumentError("unknown KV mode '" + std::string(text) + "' (read|write)");
}

}  // namespace kvbridge
