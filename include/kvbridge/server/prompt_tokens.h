// kvbridge/server/prompt_tokens.h — the prompt ids an engine would compute for a request,
// outside the engine: for a proxy that routes by the engines' prefix caches (KV-aware routing,
// proxy/kv_routing.h) and so must hash the same ids they will.
//
// The same code as the engine's POST /tokenize (openai_protocol.h Tokenize: the model
// directory's tokenizer and chat template, the request's add_special_tokens), run in process.
//
//   ASSIGN_OR_RETURN(auto pt, PromptTokenizer::Load("/models/qwen3-0.6b"));
//   ASSIGN_OR_RETURN(std::vector<int32_t> ids, pt->PromptIds("/v1/chat/completions", body));
//
// Thread-safety: PromptIds is const and may run on several threads at once.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge::server {

class PromptTokenizer {
 public:
  /// Reads config.json, the tokenizer and the chat templates (`chat_template`: vLLM's
  /// --chat-template override, as `serve`) of `model_dir`. Errors: those of the loaders.
  static Result<std::unique_ptr<PromptTokenizer>> Load(const std::string& model_dir,
                                                       const std::string& chat_template = "");
  ~PromptTokenizer();

  /// `path` "/v1/completions" (one prompt: a string, or a list of ids) or
  /// "/v1/chat/completions" (messages, tools, chat_template_kwargs, add_generation_prompt).
  /// Errors: InvalidArgument (not JSON, a batch of prompts, what the engine would refuse with a
  /// 400, e.g. a template's raise_exception), with the engine's message.
  Result<std::vector<int32_t>> PromptIds(std::string_view path, std::string_view body) const;

 private:
  struct Impl;
  explicit PromptTokenizer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge::server
