// src/model/chat_template.cc — ChatTemplate (parse + render through src/model/jinja/) and
// LoadChatTemplates (where transformers finds a checkpoint's template).
#include "kvbridge/model/chat_template.h"

#include <exception>
#include <filesystem>
#include <fstream>
#include <new>
#include <sstream>

#include "model/jinja/ast.h"
#include "model/jinja/interp.h"

namespace kvbridge {

namespace fs = std::filesystem;

struct ChatTemplate::Impl {
  std::string source;
  std::string origin;
  jinja::NodePtr root;
};

namespace {

constexpr int kMaxParseDepth = 400;

Status ToStatus(const jinja::Error& e, const std::string& origin) {
  if (e.raised) return InvalidArgumentError(std::string(kChatTemplateRejectionPrefix) + e.message);
  std::string where = "chat template " + origin;
  if (e.line > 0) where += ":" + std::to_string(e.line);
  std::string msg = where + ": " + e.message;
  if (e.resource) return ResourceExhaustedError(std::move(msg));
  return InvalidArgumentError(std::move(msg));
}

template <typename Json>
jinja::Value ToValue(const Json& j, int depth, int max_depth) {
  if (depth > max_depth) jinja::Fail("the context nests deeper than " + std::to_string(max_depth));
  using jinja::Value;
  switch (j.type()) {
    case nlohmann::json::value_t::null:
      return Value::None();
    case nlohmann::json::value_t::boolean:
      return Value::Bool(j.template get<bool>());
    case nlohmann::json::value_t::number_integer:
      return Value::Int(j.template get<int64_t>());
    case nlohmann::json::value_t::number_unsigned: {
      uint64_t u = j.template get<uint64_t>();
      if (u > static_cast<uint64_t>(INT64_MAX)) return Value::Float(static_cast<double>(u));
      return Value::Int(static_cast<int64_t>(u));
    }
    case nlohmann::json::value_t::number_float:
      return Value::Float(j.template get<double>());
    case nlohmann::json::value_t::string:
      return Value::String(j.template get<std::string>());
    case nlohmann::json::value_t::array: {
      jinja::ValueList items;
      items.reserve(j.size());
      for (const auto& x : j) items.push_back(ToValue(x, depth + 1, max_depth));
      return Value::List(std::move(items));
    }
    case nlohmann::json::value_t::object: {
      jinja::ValueDict items;
      items.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) {
        items.emplace_back(Value::String(it.key()), ToValue(it.value(), depth + 1, max_depth));
      }
      return Value::Dict(std::move(items));
    }
    default:
      jinja::Fail("the context holds a value JSON templates cannot read (binary)");
  }
}

template <typename Json>
Result<std::string> RenderImpl(const std::shared_ptr<const ChatTemplate::Impl>& impl,
                               const Json& context, const ChatTemplateRenderOptions& options) {
  if (!context.is_object()) {
    return InvalidArgumentError("chat template " + impl->origin +
                                ": the context must be a JSON object");
  }
  jinja::RenderLimits limits;
  limits.max_steps = options.max_steps;
  limits.max_output_bytes = options.max_output_bytes;
  limits.max_depth = options.max_depth;
  limits.now = options.now;
  try {
    std::vector<std::pair<std::string, jinja::Value>> vars;
    for (auto it = context.begin(); it != context.end(); ++it) {
      vars.emplace_back(it.key(), ToValue(it.value(), 0, options.max_depth));
    }
    jinja::Interpreter interp(limits);
    return interp.Render(*impl->root, std::move(vars));
  } catch (const jinja::Error& e) {
    return ToStatus(e, impl->origin);
  } catch (const std::bad_alloc&) {
    return ResourceExhaustedError("chat template " + impl->origin + ": out of memory");
  } catch (const std::exception& e) {
    // A bug of the interpreter (the fuzz target traps on it); never let it reach the server.
    return InternalError("chat template " + impl->origin + ": internal error: " + e.what());
  }
}

Result<std::string> ReadFile(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError(path.string() + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) return InternalError(path.string() + ": read failed");
  return ss.str();
}

Result<nlohmann::ordered_json> ReadJson(const fs::path& path) {
  ASSIGN_OR_RETURN(std::string text, ReadFile(path));
  try {
    return nlohmann::ordered_json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return InvalidArgumentError(path.string() + ": not valid JSON: " + e.what());
  }
}

}  // namespace

bool IsChatTemplateRejection(const Status& s) {
  return s.code() == StatusCode::kInvalidArgument &&
         std::string_view(s.message()).substr(0, kChatTemplateRejectionPrefix.size()) ==
             kChatTemplateRejectionPrefix;
}

std::string ChatTemplateRejectionMessage(const Status& s) {
  if (!IsChatTemplateRejection(s)) return "";
  return s.message().substr(kChatTemplateRejectionPrefix.size());
}

Result<ChatTemplate> ChatTemplate::Parse(std::string_view source_text, std::string origin) {
  auto impl = std::make_shared<Impl>();
  impl->source = std::string(source_text);
  impl->origin = std::move(origin);
  try {
    impl->root = jinja::ParseTemplate(impl->source, /*trim_blocks=*/true, /*lstrip_blocks=*/true,
                                      kMaxParseDepth);
  } catch (const jinja::Error& e) {
    return ToStatus(e, impl->origin);
  } catch (const std::exception& e) {
    return InternalError("chat template " + impl->origin + ": internal error: " + e.what());
  }
  return ChatTemplate(std::move(impl));
}

Result<std::string> ChatTemplate::Render(const nlohmann::ordered_json& context,
                                         const ChatTemplateRenderOptions& options) const {
  return RenderImpl(impl_, context, options);
}

Result<std::string> ChatTemplate::Render(const nlohmann::json& context,
                                         const ChatTemplateRenderOptions& options) const {
  return RenderImpl(impl_, context, options);
}

const std::string& ChatTemplate::source() const { return impl_->source; }
const std::string& ChatTemplate::origin() const { return impl_->origin; }

nlohmann::ordered_json MakeChatTemplateContext(const ChatTemplates& templates,
                                               const nlohmann::ordered_json& messages,
                                               const nlohmann::ordered_json& tools,
                                               bool add_generation_prompt,
                                               const nlohmann::ordered_json& chat_template_kwargs) {
  nlohmann::ordered_json ctx = templates.special_tokens;
  if (!ctx.is_object()) ctx = nlohmann::ordered_json::object();
  ctx["messages"] = messages;
  ctx["tools"] = tools;
  ctx["documents"] = nullptr;
  ctx["add_generation_prompt"] = add_generation_prompt;
  if (chat_template_kwargs.is_object()) {
    for (auto it = chat_template_kwargs.begin(); it != chat_template_kwargs.end(); ++it) {
      const std::string& k = it.key();
      if (k == "messages" || k == "tools" || k == "documents" || k == "add_generation_prompt")
        continue;
      ctx[k] = it.value();
    }
  }
  return ctx;
}

const ChatTemplate* ChatTemplates::Select(std::string_view name, bool has_tools) const {
  auto find = [&](std::string_view n) -> const ChatTemplate* {
    for (const auto& [k, t] : templates) {
      if (k == n) return &t;
    }
    return nullptr;
  };
  if (!name.empty()) return find(name);
  if (has_tools) {
    if (const ChatTemplate* t = find("tool_use")) return t;
  }
  return find("default");
}

Result<ChatTemplates> LoadChatTemplates(const std::string& model_dir,
                                        const std::string& override_template) {
  ChatTemplates out;
  const fs::path dir(model_dir);
  const fs::path config_path = dir / "tokenizer_config.json";
  nlohmann::ordered_json config;
  std::error_code ec;
  if (fs::exists(config_path, ec)) {
    ASSIGN_OR_RETURN(config, ReadJson(config_path));
    if (!config.is_object()) {
      return InvalidArgumentError(config_path.string() + ": not a JSON object");
    }
    for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                            "cls_token", "mask_token"}) {
      auto it = config.find(key);
      if (it == config.end()) continue;
      std::optional<std::string> value;
      if (it->is_string()) {
        value = it->get<std::string>();
      } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
        value = (*it)["content"].get<std::string>();
      }
      if (!value) continue;
      out.special_tokens[key] = *value;
      if (std::string_view(key) == "bos_token") out.bos_token = *value;
      if (std::string_view(key) == "eos_token") out.eos_token = *value;
    }
  }
  auto add = [&](std::string name, std::string_view text, const std::string& origin) -> Status {
    ASSIGN_OR_RETURN(ChatTemplate t, ChatTemplate::Parse(text, origin));
    out.templates.emplace_back(std::move(name), std::move(t));
    return OkStatus();
  };

  if (!override_template.empty()) {
    if (fs::is_regular_file(override_template, ec)) {
      ASSIGN_OR_RETURN(std::string text, ReadFile(override_template));
      RETURN_IF_ERROR(add("default", text, override_template));
    } else if (override_template.find_first_of("{}\n") != std::string::npos) {
      RETURN_IF_ERROR(add("default", override_template, "--chat-template"));
    } else {
      return NotFoundError("--chat-template " + override_template +
                           ": no such file (and it does not look like a template)");
    }
    return out;
  }

  const fs::path jinja_path = dir / "chat_template.jinja";
  if (fs::is_regular_file(jinja_path, ec)) {
    ASSIGN_OR_RETURN(std::string text, ReadFile(jinja_path));
    RETURN_IF_ERROR(add("default", text, jinja_path.string()));
    const fs::path extra = dir / "additional_chat_templates";
    if (fs::is_directory(extra, ec)) {
      std::vector<fs::path> files;
      for (const auto& entry : fs::directory_iterator(extra, ec)) {
        if (entry.path().extension() == ".jinja") files.push_back(entry.path());
      }
      std::sort(files.begin(), files.end());
      for (const fs::path& f : files) {
        ASSIGN_OR_RETURN(std::string t, ReadFile(f));
        RETURN_IF_ERROR(add(f.stem().string(), t, f.string()));
      }
    }
    return out;
  }

  const fs::path json_path = dir / "chat_template.json";
  if (fs::is_regular_file(json_path, ec)) {
    ASSIGN_OR_RETURN(nlohmann::ordered_json j, ReadJson(json_path));
    if (j.is_object() && j.contains("chat_template") && j["chat_template"].is_string()) {
      RETURN_IF_ERROR(add("default", j["chat_template"].get<std::string>(), json_path.string()));
      return out;
    }
  }

  if (config.is_object() && config.contains("chat_template")) {
    const auto& ct = config["chat_template"];
    const std::string origin = config_path.string();
    if (ct.is_string()) {
      RETURN_IF_ERROR(add("default", ct.get<std::string>(), origin));
    } else if (ct.is_array()) {
      for (const auto& entry : ct) {
        if (!entry.is_object() || !entry.contains("name") || !entry["name"].is_string() ||
            !entry.contains("template") || !entry["template"].is_string()) {
          return InvalidArgumentError(
              origin + ": chat_template list entries need a string \"name\" and \"template\"");
        }
        std::string name = entry["name"].get<std::string>();
        RETURN_IF_ERROR(
            add(name, entry["template"].get<std::string>(), origin + " (" + name + ")"));
      }
    } else if (!ct.is_null()) {
      return InvalidArgumentError(origin +
                                  ": chat_template must be a string or a list of {name, template}");
    }
  }
  return out;
}

}  // namespace kvbridge
