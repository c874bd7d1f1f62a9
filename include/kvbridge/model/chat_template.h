// kvbridge/model/chat_template.h — a checkpoint's chat template (Jinja2), rendered byte for
// byte as Hugging Face transformers' apply_chat_template(tokenize=False) renders it.
//
// transformers renders a template with Python Jinja2 in an ImmutableSandboxedEnvironment with
// trim_blocks, lstrip_blocks and the loopcontrols extension, its own tojson (json.dumps with
// ensure_ascii=False), and the globals raise_exception and strftime_now. ChatTemplate is a
// small Jinja2 interpreter with those semantics (docs/model.md "Chat templates" lists what it
// covers); it never recognises a template by its text.
//
//   ASSIGN_OR_RETURN(ChatTemplates templates, LoadChatTemplates(model_dir, flag_chat_template));
//   const ChatTemplate* t = templates.Select("", /*has_tools=*/false);
//   if (t == nullptr) { ... the model has no template: keep the plain format ... }
//   // request: nlohmann::ordered_json (keeps the client's key order, which tojson shows)
//   auto ctx = MakeChatTemplateContext(templates, request["messages"], request.value("tools",
//   nullptr),
//                                      /*add_generation_prompt=*/true,
//                                      request.value("chat_template_kwargs", nullptr));
//   Result<std::string> prompt = t->Render(ctx);
//   if (IsChatTemplateRejection(prompt.status())) ... HTTP 400 with ChatTemplateRejectionMessage
//
// Thread-safety: a ChatTemplate is immutable after Parse; Render may run on many threads at once.
#pragma once

#include <cstdint>
#include <ctime>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge {

/// Prefix of the message of a Render error that the template raised itself
/// (`raise_exception(msg)`): the message is this prefix + msg, with code InvalidArgument.
inline constexpr std::string_view kChatTemplateRejectionPrefix =
    "chat template rejected the request: ";

/// Whether `s` is a template's own raise_exception (a client error: HTTP 400).
bool IsChatTemplateRejection(const Status& s);
/// The template's message of such an error (the text after the prefix); "" for other errors.
std::string ChatTemplateRejectionMessage(const Status& s);

struct ChatTemplateRenderOptions {
  /// Work bound: every statement, expression and loop item counts one step.
  int64_t max_steps = 100'000'000;
  /// No string (and so no output) may grow past this many bytes.
  size_t max_output_bytes = 32u << 20;
  /// Macro calls and value nesting (tojson / printing / comparing) deeper than this fail.
  int max_depth = 200;
  /// The time strftime_now formats; nullopt: the local time now (datetime.now()).
  std::optional<std::tm> now;
};

class ChatTemplate {
 public:
  /// Parses `source` (UTF-8 Jinja2). `origin` names it in errors ("tokenizer_config.json",
  /// "/path/chat_template.jinja"). Errors: InvalidArgument "chat template ORIGIN:LINE: what"
  /// for a syntax error, an unknown tag, filter or test, malformed UTF-8;
  /// ResourceExhausted when it nests deeper than 200 levels.
  static Result<ChatTemplate> Parse(std::string_view source, std::string origin);

  /// Renders with `context` (a JSON object: its keys are the template's variables — messages,
  /// tools, add_generation_prompt, bos_token, eos_token, chat_template_kwargs' keys...). JSON
  /// objects become Python dicts in their key order (use ordered_json to keep a request's order:
  /// it shows in tojson and items()). Errors: InvalidArgument with kChatTemplateRejectionPrefix
  /// for raise_exception; InvalidArgument "chat template ORIGIN:LINE: what" where Jinja2 would
  /// raise (an undefined value used, a type error, ...); ResourceExhausted past a limit.
  Result<std::string> Render(const nlohmann::ordered_json& context,
                             const ChatTemplateRenderOptions& options = {}) const;
  Result<std::string> Render(const nlohmann::json& context,
                             const ChatTemplateRenderOptions& options = {}) const;

  const std::string& source() const;
  const std::string& origin() const;

  struct Impl;  // opaque: the parsed tree (src/model/chat_template.cc)

 private:
  explicit ChatTemplate(std::shared_ptr<const Impl> impl) : impl_(std::move(impl)) {}
  std::shared_ptr<const Impl> impl_;
};

/// A checkpoint's templates and the special tokens transformers passes to them.
struct ChatTemplates {
  /// Named templates; one named "default" when the checkpoint has a single template.
  std::vector<std::pair<std::string, ChatTemplate>> templates;
  /// Non-null string special tokens of tokenizer_config.json (bos_token, eos_token, unk_token,
  /// pad_token, sep_token, cls_token, mask_token; an AddedToken dict gives its "content"), as
  /// transformers passes its special_tokens_map to the template.
  nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object();
  std::optional<std::string> bos_token;
  std::optional<std::string> eos_token;

  bool empty() const { return templates.empty(); }
  /// transformers' choice: `name` when given (nullptr if absent); else "tool_use" when the
  /// request has tools and such a template exists; else "default"; nullptr when none.
  const ChatTemplate* Select(std::string_view name, bool has_tools) const;
};

/// The context transformers' apply_chat_template renders with: `templates.special_tokens`, then
/// `messages`, `tools` (null when the request has none, as transformers passes tools=None),
/// `documents` (null), `add_generation_prompt`, then the request's `chat_template_kwargs` (an
/// object or null; its keys override special tokens but never the four above).
nlohmann::ordered_json MakeChatTemplateContext(
    const ChatTemplates& templates, const nlohmann::ordered_json& messages,
    const nlohmann::ordered_json& tools, bool add_generation_prompt,
    const nlohmann::ordered_json& chat_template_kwargs = nullptr);

/// Loads the chat templates of the Hugging Face model directory `model_dir`, in transformers'
/// order of precedence: `override_template` (vLLM's --chat-template: a file path, or, when no
/// such file exists and the text holds any of "{}\n", the template itself), else
/// `chat_template.jinja` (+ additional_chat_templates/NAME.jinja), else `chat_template.json`
/// ({"chat_template": ...}), else tokenizer_config.json's `chat_template` (a string, or a list of
/// {"name", "template"}). No template anywhere is not an error: `empty()` is true.
/// Special tokens always come from tokenizer_config.json when it exists.
/// Errors: NotFound for a missing override file; InvalidArgument for malformed JSON or a
/// template that does not parse (naming the file and line).
Result<ChatTemplates> LoadChatTemplates(const std::string& model_dir,
                                        const std::string& override_template = "");

}  // namespace kvbridge
