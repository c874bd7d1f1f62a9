#include "kvbridge/server/prompt_tokens.h"

#include <filesystem>

#include "kvbridge/model/chat_template.h"
#include "kvbridge/model/config.h"
#include "kvbridge/model/tokenizer.h"
#include "server/openai_protocol.h"

namespace kvbridge::server {

using nlohmann::json;

struct PromptTokenizer::Impl {
  Tokenizer tokenizer;
  ChatTemplates templates;
  ProtocolLimits limits;
};

PromptTokenizer::PromptTokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
PromptTokenizer::~PromptTokenizer() = default;

Result<std::unique_ptr<PromptTokenizer>> PromptTokenizer::Load(const std::string& model_dir,
                                                               const std::string& chat_template) {
  ASSIGN_OR_RETURN(
      ModelConfig config,
      ModelConfig::FromFile((std::filesystem::path(model_dir) / "config.json").string()));
  ASSIGN_OR_RETURN(Tokenizer tok, Tokenizer::Load(model_dir, config));
  ASSIGN_OR_RETURN(ChatTemplates templates, LoadChatTemplates(model_dir, chat_template));
  auto impl = std::unique_ptr<Impl>(new Impl{std::move(tok), std::move(templates), {}});
  if (!impl->templates.empty()) impl->limits.chat_templates = &impl->templates;
  return std::unique_ptr<PromptTokenizer>(new PromptTokenizer(std::move(impl)));
}

Result<std::vector<int32_t>> PromptTokenizer::PromptIds(std::string_view path,
                                                        std::string_view body) const {
  json j = json::parse(body, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return InvalidArgumentError("the request body is not a JSON object");
  j.erase("model");  // the engine checks it; the ids do not depend on it
  json req;
  nlohmann::ordered_json ordered;
  if (path == "/v1/chat/completions") {
    req = std::move(j);
    ordered = nlohmann::ordered_json::parse(body, nullptr, false);
    if (ordered.is_object()) ordered.erase("model");
  } else {
    auto it = j.find("prompt");
    if (it == j.end()) return InvalidArgumentError("no 'prompt'");
    if (it->is_array() && !it->empty() && it->front().is_number_integer()) {
      std::vector<int32_t> ids;
      for (const json& v : *it) {
        if (!v.is_number_integer()) return InvalidArgumentError("'prompt': not a list of ids");
        ids.push_back(v.get<int32_t>());
      }
      return ids;
    }
    if (!it->is_string()) return InvalidArgumentError("'prompt': not one prompt");
    req = {{"prompt", *it}};
    if (auto a = j.find("add_special_tokens"); a != j.end()) req["add_special_tokens"] = *a;
  }
  json response;
  if (auto err = Tokenize(req, impl_->tokenizer, impl_->limits, &response,
                          ordered.is_object() ? &ordered : nullptr)) {
    return InvalidArgumentError(err->message);
  }
  return response["tokens"].get<std::vector<int32_t>>();
}

}  // namespace kvbridge::server
