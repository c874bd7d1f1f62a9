// libFuzzer target: the chat-template interpreter must parse and render any template with a
// bounded context and never crash, hang, leak or overflow its stack: every failure is a Status
// (built with ASan+UBSan under -DKVBRIDGE_FUZZ=ON). Input: the template, optionally followed by
// a NUL byte and a JSON object of extra variables.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvbridge/model/chat_template.h"

namespace {

const nlohmann::ordered_json& BaseContext() {
  static const nlohmann::ordered_json ctx = nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "sys"},
                 {"role": "user", "content": "Hi <think>x</think> é"},
                 {"role": "assistant", "content": "ok", "tool_calls": [
                   {"type": "function", "function": {"name": "f", "arguments": {"a": [1, 2.5, null]}}}]},
                 {"role": "tool", "content": "{\"r\": true}"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>", "enable_thinking": false
  })");
  return ctx;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  std::string_view input(reinterpret_cast<const char*>(data), size);
  std::string_view source = input.substr(0, input.find('\0'));
  auto t = kvbridge::ChatTemplate::Parse(source, "fuzz");
  // kInternal is a C++ exception the interpreter let through: a bug.
  if (t.status().code() == kvbridge::StatusCode::kInternal) __builtin_trap();
  if (!t.ok()) return 0;
  nlohmann::ordered_json ctx = BaseContext();
  if (source.size() < input.size()) {
    auto extra = nlohmann::ordered_json::parse(input.substr(source.size() + 1), nullptr,
                                               /*allow_exceptions=*/false);
    if (extra.is_object()) {
      for (auto it = extra.begin(); it != extra.end(); ++it) ctx[it.key()] = it.value();
    }
  }
  kvbridge::ChatTemplateRenderOptions options;
  options.max_steps = 20000;
  options.max_output_bytes = 1 << 16;
  options.max_depth = 64;
  options.now = std::tm{};
  auto r = t->Render(ctx, options);
  if (r.status().code() == kvbridge::StatusCode::kInternal) __builtin_trap();
  if (r.ok() && r->size() > options.max_output_bytes) __builtin_trap();  // the size bound leaked
  return 0;
}
