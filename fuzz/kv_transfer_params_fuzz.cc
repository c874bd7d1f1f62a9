// libFuzzer target: a request's `kv_transfer_params` (from the proxy, i.e. from the network) and
// the `--kv-transfer-config` text. Any input must parse or give an InvalidArgument, never crash;
// what parses must round-trip through its JSON form to the same JSON.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

#include "kvbridge/connector/kv_transfer_config.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvbridge;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto config = ParseKvTransferConfig(text);
  if (config.ok()) {
    const nlohmann::json j = KvTransferConfigToJson(*config);
    auto again = ParseKvTransferConfig(j.dump());
    if (!again.ok() || KvTransferConfigToJson(*again) != j) __builtin_trap();
  }
  const nlohmann::json body = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (body.is_discarded()) return 0;
  KvTransferParamsLimits limits;
  limits.remote_num_blocks = 64;
  auto params = ParseKvTransferParams(body, limits);
  if (params.ok()) {
    const nlohmann::json j = KvTransferParamsToJson(*params);
    auto again = ParseKvTransferParams(j, limits);
    if (!again.ok() || KvTransferParamsToJson(*again) != j) __builtin_trap();
  }
  return 0;
}
