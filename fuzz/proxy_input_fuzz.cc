// libFuzzer target: what reaches the proxy from outside — an engine's registration and
// heartbeat JSON, and a client's body that the proxy shapes into a prefill leg. Any input must
// parse or give an error Status, never crash; a registration must round-trip through its JSON;
// a shaped prefill body must be a JSON object with max_tokens 1 and stream false.
#include <cstddef>
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string_view>

#include "kvbridge/proxy/flow.h"
#include "kvbridge/proxy/registry.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace kvbridge::proxy;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto reg = ParseRegistration(text);
  if (reg.ok()) {
    const std::string j = RegistrationJson(reg->first, reg->second);
    auto again = ParseRegistration(j);
    if (!again.ok() || RegistrationJson(again->first, again->second) != j) __builtin_trap();
  }
  (void)ParseLoad(text);
  for (bool forward_n : {false, true}) {
    auto shaped = ShapePrefillBody(text, forward_n, R"({"do_remote_decode":true})");
    if (!shaped.ok()) continue;
    const nlohmann::json j = nlohmann::json::parse(*shaped, nullptr, false);
    if (!j.is_object() || j.value("max_tokens", -1) != 1 || j.value("stream", true))
      __builtin_trap();
  }
  return 0;
}
