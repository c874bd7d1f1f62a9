#include "server/openai_protocol.h"

#include <cmath>
#include <cstdio>
#include <limits>
#include <string_view>

namespace kvbridge::server {
namespace {

using nlohmann::json;

ApiError BadRequest(std::string message, std::string param) {
  return ApiError{400, std::move(message), std::move(param)};
}

std::string_view JsonTypeName(const json& v) { return v.type_name(); }

// Optional integer field: absent or null leaves *out unset. Booleans and floats are wrong types.
std::optional<ApiError> GetInt(const json& body, const char* key, std::optional<int64_t>* out) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number_integer()) {
    return BadRequest(
        std::string("'") + key + "' must be an integer, got " + std::string(JsonTypeName(*it)),
        key);
  }
  if (it->is_number_unsigned()) {
    uint64_t u = it->get<uint64_t>();
    if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      return BadRequest(std::string("'") + key + "' is out of range", key);
    }
    *out = static_cast<int64_t>(u);
  } else {
    *out = it->get<int64_t>();
  }
  return std::nullopt;
}

std::optional<ApiError> GetNumber(const json& body, const char* key, std::optional<double>* out) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_number()) {
    return BadRequest(
        std::string("'") + key + "' must be a number, got " + std::string(JsonTypeName(*it)), key);
  }
  *out = it->get<double>();
  return std::nullopt;
}

std::optional<ApiError> GetBool(const json& body, const char* key, std::optional<bool>* out) {
  auto it = body.find(key);
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_boolean()) {
    return BadRequest(
        std::string("'") + key + "' must be a boolean, got " + std::string(JsonTypeName(*it)), key);
  }
  *out = it->get<bool>();
  return std::nullopt;
}

#define KVB_API_TRY(expr)                  \
  do {                                     \
    auto kvb_api_err_ = (expr);            \
    if (kvb_api_err_) return kvb_api_err_; \
  } while (0)

std::optional<ApiError> CheckModel(const json& body, const ProtocolLimits& limits) {
  auto it = body.find("model");
  if (it == body.end() || it->is_null()) return std::nullopt;
  if (!it->is_string()) return BadRequest("'model' must be a string", "model");
  const std::string& name = it->get_ref<const std::string&>();
  if (name != limits.served_model_name) {
    return ApiError{404, "The model `" + name + "` does not exist.", "model"};
  }
  return std::nullopt;
}

bool IsZeroNumber(const json& v) { return v.is_number() && v.get<double>() == 0.0; }

// Fields of both endpoints that kvbridge does not implement: accepted only at their no-op values.
std::optional<ApiError> CheckUnsupported(const json& body) {
  for (const char* key : {"presence_penalty", "frequency_penalty"}) {
    auto it = body.find(key);
    if (it != body.end() && !it->is_null() && !IsZeroNumber(*it)) {
      return BadRequest(std::string("'") + key + "' is not supported (only 0)", key);
    }
  }
  if (auto it = body.find("repetition_penalty");
      it != body.end() && !it->is_null() && !(it->is_number() && it->get<double>() == 1.0)) {
    return BadRequest("'repetition_penalty' is not supported (only 1)", "repetition_penalty");
  }
  if (auto it = body.find("logit_bias"); it != body.end() && !it->is_null() && !it->empty()) {
    return BadRequest("'logit_bias' is not supported", "logit_bias");
  }
  if (auto it = body.find("echo"); it != body.end() && it->is_boolean() && it->get<bool>()) {
    return BadRequest("'echo' is not supported", "echo");
  }
  if (auto it = body.find("suffix"); it != body.end() && !it->is_null()) {
    return BadRequest("'suffix' is not supported", "suffix");
  }
  return std::nullopt;
}

// Sampling fields shared by both endpoints (everything except max_tokens defaults and logprobs).
std::optional<ApiError> ParseCommon(const json& body, const ProtocolLimits& limits,
                                    ParsedRequest* out) {
  KVB_API_TRY(CheckModel(body, limits));
  KVB_API_TRY(CheckUnsupported(body));
  SamplingParams& s = out->sampling;

  std::optional<int64_t> n;
  KVB_API_TRY(GetInt(body, "n", &n));
  if (n) {
    if (*n < 1) return BadRequest("'n' must be at least 1, got " + std::to_string(*n), "n");
    if (*n > limits.max_n) {
      return BadRequest(
          "'n' must be at most " + std::to_string(limits.max_n) + ", got " + std::to_string(*n),
          "n");
    }
    s.n = static_cast<int>(*n);
  }
  std::optional<int64_t> best_of;
  KVB_API_TRY(GetInt(body, "best_of", &best_of));
  if (best_of && *best_of != s.n) {
    return BadRequest("'best_of' other than n is not supported", "best_of");
  }

  // vLLM's default_sampling_params (the generation config's): for keys the request leaves out.
  const SamplingDefaults no_defaults;
  const SamplingDefaults& dflt =
      limits.sampling_defaults != nullptr ? *limits.sampling_defaults : no_defaults;
  std::optional<double> temperature;
  KVB_API_TRY(GetNumber(body, "temperature", &temperature));
  if (!temperature) temperature = dflt.temperature;
  if (temperature) {
    if (!(*temperature >= 0.0) || *temperature > 100.0) {
      return BadRequest("'temperature' must be in [0, 100], got " + std::to_string(*temperature),
                        "temperature");
    }
    s.temperature = static_cast<float>(*temperature);
  }
  std::optional<double> top_p;
  KVB_API_TRY(GetNumber(body, "top_p", &top_p));
  if (!top_p) top_p = dflt.top_p;
  if (top_p) {
    if (!(*top_p > 0.0 && *top_p <= 1.0)) {
      return BadRequest("'top_p' must be in (0, 1], got " + std::to_string(*top_p), "top_p");
    }
    s.top_p = static_cast<float>(*top_p);
  }
  std::optional<int64_t> top_k;
  KVB_API_TRY(GetInt(body, "top_k", &top_k));
  if (!top_k) top_k = dflt.top_k;
  if (top_k) {
    if (*top_k < -1) {
      return BadRequest(
          "'top_k' must be -1 (off), 0 (off) or positive, got " + std::to_string(*top_k), "top_k");
    }
    s.top_k = *top_k <= 0 ? 0 : static_cast<int>(std::min<int64_t>(*top_k, 1 << 30));
  }
  std::optional<int64_t> seed;
  KVB_API_TRY(GetInt(body, "seed", &seed));
  if (seed) s.seed = static_cast<uint64_t>(*seed);

  if (auto it = body.find("stop"); it != body.end() && !it->is_null()) {
    const char* const kStopType = "'stop' must be a string or a list of strings";
    auto add = [&](const json& v) -> std::optional<ApiError> {
      if (!v.is_string()) return BadRequest(kStopType, "stop");
      const std::string& str = v.get_ref<const std::string&>();
      if (str.size() > kMaxStopStringBytes) {
        return BadRequest("a 'stop' string must be at most " + std::to_string(kMaxStopStringBytes) +
                              " bytes, got " + std::to_string(str.size()),
                          "stop");
      }
      if (!str.empty()) s.stop.push_back(str);  // vLLM drops empty strings
      return std::nullopt;
    };
    if (it->is_array()) {
      if (it->size() > kMaxStopStrings) {
        return BadRequest("'stop' must hold at most " + std::to_string(kMaxStopStrings) +
                              " strings, got " + std::to_string(it->size()),
                          "stop");
      }
      for (const json& v : *it) KVB_API_TRY(add(v));
    } else {
      KVB_API_TRY(add(*it));
    }
  }
  if (auto it = body.find("stop_token_ids"); it != body.end() && !it->is_null()) {
    if (!it->is_array())
      return BadRequest("'stop_token_ids' must be a list of integers", "stop_token_ids");
    if (it->size() > kMaxStopTokenIds) {
      return BadRequest("'stop_token_ids' must hold at most " + std::to_string(kMaxStopTokenIds) +
                            " ids, got " + std::to_string(it->size()),
                        "stop_token_ids");
    }
    for (const json& v : *it) {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
        return BadRequest("'stop_token_ids' must be a list of token ids (integers >= 0)",
                          "stop_token_ids");
      }
      s.stop_token_ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
    }
  }
  std::optional<bool> ignore_eos;
  KVB_API_TRY(GetBool(body, "ignore_eos", &ignore_eos));
  if (ignore_eos) s.ignore_eos = *ignore_eos;
  std::optional<bool> include_stop;
  KVB_API_TRY(GetBool(body, "include_stop_str_in_output", &include_stop));
  if (include_stop) s.include_stop_str_in_output = *include_stop;

  std::optional<bool> stream;
  KVB_API_TRY(GetBool(body, "stream", &stream));
  out->stream = stream.value_or(false);
  if (auto it = body.find("stream_options"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) return BadRequest("'stream_options' must be an object", "stream_options");
    if (!out->stream) {
      return BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options");
    }
    std::optional<bool> include_usage;
    KVB_API_TRY(GetBool(*it, "include_usage", &include_usage));
    out->include_usage = include_usage.value_or(false);
  }
  std::optional<bool> as_ids;
  KVB_API_TRY(GetBool(body, "return_tokens_as_token_ids", &as_ids));
  out->tokens_as_ids = as_ids.value_or(false);
  if (auto it = body.find("kv_transfer_params"); it != body.end() && !it->is_null()) {
    if (!it->is_object()) {
      return BadRequest("'kv_transfer_params' must be an object", "kv_transfer_params");
    }
    out->kv_transfer_params = *it;
  }
  return std::nullopt;
}

// max_tokens, min_tokens, truncation and the context-length check, once prompts are known.
std::optional<ApiError> FinishLengths(const json& body, const ProtocolLimits& limits, bool chat,
                                      ParsedRequest* out) {
  SamplingParams& s = out->sampling;
  std::optional<int64_t> truncate;
  KVB_API_TRY(GetInt(body, "truncate_prompt_tokens", &truncate));
  if (truncate) {
    if (*truncate < 1) {
      return BadRequest("'truncate_prompt_tokens' must be at least 1", "truncate_prompt_tokens");
    }
    for (auto& p : out->prompts) {
      if (static_cast<int64_t>(p.size()) > *truncate) {
        p.erase(p.begin(), p.end() - *truncate);  // keep the last k tokens
      }
    }
  }
  size_t longest = 0;
  for (const auto& p : out->prompts) {
    if (p.empty()) return BadRequest("the prompt is empty", chat ? "messages" : "prompt");
    longest = std::max(longest, p.size());
  }
  const char* max_key = "max_tokens";
  std::optional<int64_t> max_tokens;
  KVB_API_TRY(GetInt(body, "max_tokens", &max_tokens));
  if (chat && !max_tokens) {
    KVB_API_TRY(GetInt(body, "max_completion_tokens", &max_tokens));
    if (max_tokens) max_key = "max_completion_tokens";
  }
  if (max_tokens && *max_tokens < 1) {
    return BadRequest(
        std::string("'") + max_key + "' must be at least 1, got " + std::to_string(*max_tokens),
        max_key);
  }
  const int64_t len_limit = limits.max_model_len;
  if (len_limit > 0) {
    if (static_cast<int64_t>(longest) > len_limit) {
      return BadRequest("This model's maximum context length is " + std::to_string(len_limit) +
                            " tokens. However, your prompt has " + std::to_string(longest) +
                            " tokens.",
                        chat ? "messages" : "prompt");
    }
    if (static_cast<int64_t>(longest) == len_limit) {
      return BadRequest("This model's maximum context length is " + std::to_string(len_limit) +
                            " tokens and your prompt fills it: no room for a completion.",
                        chat ? "messages" : "prompt");
    }
    const int64_t room = len_limit - static_cast<int64_t>(longest);
    if (max_tokens && *max_tokens > room) {
      return BadRequest("This model's maximum context length is " + std::to_string(len_limit) +
                            " tokens. However, you requested " +
                            std::to_string(static_cast<int64_t>(longest) + *max_tokens) +
                            " tokens (" + std::to_string(longest) + " in the prompt, " +
                            std::to_string(*max_tokens) + " for the completion).",
                        max_key);
    }
    // OpenAI defaults: completions 16 tokens, chat the rest of the context; the generation
    // config's max_new_tokens instead when it sets one (vLLM), within the room.
    int64_t dflt = chat ? room : std::min<int64_t>(16, room);
    if (limits.sampling_defaults != nullptr && limits.sampling_defaults->max_tokens) {
      dflt = std::clamp<int64_t>(*limits.sampling_defaults->max_tokens, 1, room);
    }
    s.max_tokens = static_cast<int>(max_tokens ? *max_tokens : dflt);
  } else {
    if (max_tokens && *max_tokens > (1 << 30))
      return BadRequest("'max_tokens' is too large", max_key);
    int64_t dflt = 16;
    if (limits.sampling_defaults != nullptr && limits.sampling_defaults->max_tokens) {
      dflt = std::clamp<int64_t>(*limits.sampling_defaults->max_tokens, 1, 1 << 30);
    }
    s.max_tokens = static_cast<int>(max_tokens.value_or(dflt));
  }
  std::optional<int64_t> min_tokens;
  KVB_API_TRY(GetInt(body, "min_tokens", &min_tokens));
  if (min_tokens) {
    if (*min_tokens < 0 || *min_tokens > s.max_tokens) {
      return BadRequest(
          "'min_tokens' must be in [0, max_tokens], got " + std::to_string(*min_tokens),
          "min_tokens");
    }
    s.min_tokens = static_cast<int>(*min_tokens);
  }
  if (!out->kv_transfer_params.is_null() && out->prompts.size() != 1) {
    return BadRequest("'kv_transfer_params' needs exactly one prompt", "kv_transfer_params");
  }
  return std::nullopt;
}

std::optional<ApiError> TokenIdsFromJson(const json& arr, const Tokenizer& tok,
                                         std::vector<int32_t>* ids, const char* param = "prompt") {
  for (const json& v : arr) {
    if (!v.is_number_integer()) {
      return BadRequest(std::string("'") + param + "' token lists must hold integers", param);
    }
    int64_t t = v.get<int64_t>();
    if (v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT32_MAX)) t = -1;
    if (t < 0 || t >= tok.vocab_size()) {
      return BadRequest("token id " + v.dump() + " is out of vocabulary [0, " +
                            std::to_string(tok.vocab_size()) + ")",
                        param);
    }
    ids->push_back(static_cast<int32_t>(t));
  }
  return std::nullopt;
}

// A text prompt's ids; the tokenizer's refusal (e.g. invalid UTF-8) is a 400.
std::optional<ApiError> EncodeText(const Tokenizer& tok, const std::string& text,
                                   bool add_special_tokens, const char* param,
                                   std::vector<int32_t>* ids) {
  Result<std::vector<int32_t>> r = tok.Encode(text, add_special_tokens);
  if (!r.ok()) return BadRequest("cannot tokenize the prompt: " + r.status().message(), param);
  *ids = *std::move(r);
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> ParseCompletionRequest(const json& body, const Tokenizer& tok,
                                               const ProtocolLimits& limits, ParsedRequest* out) {
  *out = ParsedRequest{};
  out->endpoint = Endpoint::kCompletions;
  if (!body.is_object()) return BadRequest("the request body must be a JSON object", "");
  KVB_API_TRY(ParseCommon(body, limits, out));
  std::optional<bool> add_special;
  KVB_API_TRY(GetBool(body, "add_special_tokens", &add_special));
  auto encode = [&](const json& text) -> std::optional<ApiError> {
    out->prompts.emplace_back();
    return EncodeText(tok, text.get_ref<const std::string&>(), add_special.value_or(true), "prompt",
                      &out->prompts.back());
  };

  auto it = body.find("prompt");
  if (it == body.end() || it->is_null()) return BadRequest("'prompt' is required", "prompt");
  const json& prompt = *it;
  if (prompt.is_string()) {
    KVB_API_TRY(encode(prompt));
  } else if (prompt.is_array()) {
    if (prompt.empty()) return BadRequest("'prompt' must not be an empty list", "prompt");
    if (prompt[0].is_number_integer()) {  // one prompt as token ids
      out->prompts.emplace_back();
      KVB_API_TRY(TokenIdsFromJson(prompt, tok, &out->prompts.back()));
    } else {  // several prompts: strings or token lists
      for (const json& p : prompt) {
        if (p.is_string()) {
          KVB_API_TRY(encode(p));
        } else if (p.is_array()) {
          if (p.empty()) return BadRequest("a token-id prompt must not be empty", "prompt");
          out->prompts.emplace_back();
          KVB_API_TRY(TokenIdsFromJson(p, tok, &out->prompts.back()));
        } else {
          return BadRequest("'prompt' must be a string, a list of token ids, or a list of either",
                            "prompt");
        }
      }
    }
  } else {
    return BadRequest("'prompt' must be a string, a list of token ids, or a list of either",
                      "prompt");
  }
  if (static_cast<int64_t>(out->prompts.size()) * out->sampling.n > limits.max_n) {
    return BadRequest("prompts x n must be at most " + std::to_string(limits.max_n), "n");
  }

  std::optional<int64_t> logprobs;
  KVB_API_TRY(GetInt(body, "logprobs", &logprobs));
  if (logprobs) {
    if (*logprobs < 0 || *logprobs > limits.max_logprobs) {
      return BadRequest("'logprobs' must be in [0, " + std::to_string(limits.max_logprobs) +
                            "], got " + std::to_string(*logprobs),
                        "logprobs");
    }
    out->sampling.logprobs = static_cast<int>(*logprobs);
  }
  return FinishLengths(body, limits, /*chat=*/false, out);
}

namespace {

// The text of a message's content: a string, null, or text parts (vLLM's "string" content
// format joins them with newlines; kvbridge's plain format concatenates them).
template <typename Json>
std::optional<ApiError> ContentText(const Json& m, const char* join, std::string* out) {
  out->clear();
  auto c = m.find("content");
  if (c == m.end() || c->is_null()) return std::nullopt;
  if (c->is_string()) {
    *out = c->template get<std::string>();
    return std::nullopt;
  }
  if (!c->is_array()) {
    return BadRequest("message 'content' must be a string or a list of text parts", "messages");
  }
  bool first = true;
  for (const auto& part : *c) {
    if (!part.is_object() || !part.contains("type") || part["type"] != "text" ||
        !part.contains("text") || !part["text"].is_string()) {
      return BadRequest("only text content parts are supported", "messages");
    }
    if (!first) *out += join;
    *out += part["text"].template get<std::string>();
    first = false;
  }
  return std::nullopt;
}

// The chat prompt's ids of `body` (its "messages" ...), rendered with the checkpoint's template
// when there is one (see ParseChatRequest), else with kvbridge's plain format.
std::optional<ApiError> ChatPromptIds(const json& body, const nlohmann::ordered_json* ordered,
                                      const Tokenizer& tok, const ProtocolLimits& limits,
                                      std::vector<int32_t>* ids) {
  auto it = body.find("messages");
  if (it == body.end() || !it->is_array() || it->empty()) {
    return BadRequest("'messages' must be a non-empty list", "messages");
  }
  std::optional<bool> add_special, add_generation_prompt;
  KVB_API_TRY(GetBool(body, "add_special_tokens", &add_special));
  KVB_API_TRY(GetBool(body, "add_generation_prompt", &add_generation_prompt));
  if (auto c = body.find("continue_final_message");
      c != body.end() && c->is_boolean() && c->get<bool>()) {
    return BadRequest("'continue_final_message' is not supported", "continue_final_message");
  }
  if (auto c = body.find("chat_template"); c != body.end() && !c->is_null()) {
    return BadRequest("a per-request 'chat_template' is not supported (serve --chat-template)",
                      "chat_template");
  }
  const ChatTemplate* tmpl = nullptr;
  const bool has_tools =
      body.contains("tools") && body["tools"].is_array() && !body["tools"].empty();
  if (limits.chat_templates != nullptr && !limits.chat_templates->empty()) {
    tmpl = limits.chat_templates->Select("", has_tools);
  }
  for (const json& m : *it) {
    if (!m.is_object()) return BadRequest("each message must be an object", "messages");
    auto role = m.find("role");
    if (role == m.end() || !role->is_string()) {
      return BadRequest("each message needs a string 'role'", "messages");
    }
    const std::string& r = role->get_ref<const std::string&>();
    if (r != "system" && r != "user" && r != "assistant" && r != "developer" &&
        !(tmpl != nullptr && r == "tool")) {
      return BadRequest("unknown message role '" + r + "'", "messages");
    }
    std::string unused;
    KVB_API_TRY(ContentText(m, "", &unused));
  }
  if (tmpl == nullptr) {
    std::vector<ChatMessage> messages;
    for (const json& m : *it) {
      const std::string& r = m["role"].get_ref<const std::string&>();
      std::string content;
      KVB_API_TRY(ContentText(m, "", &content));
      messages.push_back({r == "developer" ? "system" : r, std::move(content)});
    }
    return EncodeText(tok, tok.ApplyChatTemplate(messages, add_generation_prompt.value_or(true)),
                      add_special.value_or(true), "messages", ids);
  }
  // The template's context, as transformers builds it (keys in the request's order).
  nlohmann::ordered_json req =
      ordered != nullptr ? *ordered : nlohmann::ordered_json::parse(body.dump());
  nlohmann::ordered_json messages = nlohmann::ordered_json::array();
  for (auto& m : req["messages"]) {
    nlohmann::ordered_json msg = m;
    std::string content;
    KVB_API_TRY(ContentText(m, "\n", &content));
    if (m.contains("content") && m["content"].is_array()) msg["content"] = content;
    if (!msg.contains("content") || msg["content"].is_null()) msg["content"] = "";  // as vLLM
    // vLLM hands a tool call's arguments to the template as an object, not a JSON string.
    if (auto tc = msg.find("tool_calls"); tc != msg.end() && tc->is_array()) {
      for (auto& call : *tc) {
        if (!call.is_object() || !call.contains("function")) continue;
        auto& fn = call["function"];
        if (fn.is_object() && fn.contains("arguments") && fn["arguments"].is_string()) {
          auto parsed =
              nlohmann::ordered_json::parse(fn["arguments"].get<std::string>(), nullptr, false);
          if (!parsed.is_discarded()) fn["arguments"] = std::move(parsed);
        }
      }
    }
    messages.push_back(std::move(msg));
  }
  nlohmann::ordered_json kwargs = nullptr;
  if (auto kw = req.find("chat_template_kwargs"); kw != req.end() && !kw->is_null()) {
    if (!kw->is_object()) {
      return BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs");
    }
    kwargs = *kw;
  }
  const nlohmann::ordered_json ctx = MakeChatTemplateContext(
      *limits.chat_templates, messages,
      req.contains("tools") ? req["tools"] : nlohmann::ordered_json(nullptr),
      add_generation_prompt.value_or(true), kwargs);
  Result<std::string> prompt = tmpl->Render(ctx);
  if (!prompt.ok()) {
    if (IsChatTemplateRejection(prompt.status())) {
      return BadRequest(ChatTemplateRejectionMessage(prompt.status()), "messages");
    }
    return BadRequest("cannot render the chat template: " + prompt.status().message(), "messages");
  }
  return EncodeText(tok, *prompt, add_special.value_or(false), "messages", ids);
}

// tools and tool_choice as vLLM takes them: tools a list of {"type": "function", "function":
// {"name": string, ...}}; tool_choice "none" | "auto" (the default when tools are given) |
// "required" | {"type": "function", "function": {"name"}}; "auto" needs the server's
// --enable-auto-tool-choice and --tool-call-parser. "required" and a named function need
// guided decoding, which this engine does not have: refused.
std::optional<ApiError> ParseTools(const json& body, const ProtocolLimits& limits,
                                   ParsedRequest* out) {
  out->reasoning_parser = limits.reasoning_parser;
  size_t num_tools = 0;
  if (auto it = body.find("tools"); it != body.end() && !it->is_null()) {
    if (!it->is_array()) return BadRequest("'tools' must be a list of tools", "tools");
    for (const json& t : *it) {
      const char* const kShape =
          "each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}";
      if (!t.is_object() || t.value("type", json()) != "function")
        return BadRequest(kShape, "tools");
      auto fn = t.find("function");
      if (fn == t.end() || !fn->is_object() || !fn->contains("name") ||
          !(*fn)["name"].is_string()) {
        return BadRequest(kShape, "tools");
      }
    }
    num_tools = it->size();
  }
  std::string choice = num_tools > 0 ? "auto" : "none";
  if (auto it = body.find("tool_choice"); it != body.end() && !it->is_null()) {
    if (it->is_object()) {
      if (it->value("type", json()) != "function" || !it->contains("function") ||
          !(*it)["function"].is_object() || !(*it)["function"].contains("name")) {
        return BadRequest(
            "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": "
            "\"function\", \"function\": {\"name\": ...}}",
            "tool_choice");
      }
      return BadRequest(
          "a named function in 'tool_choice' is not supported (it needs guided decoding); use "
          "\"auto\" (serve --enable-auto-tool-choice --tool-call-parser ...)",
          "tool_choice");
    }
    if (!it->is_string() || (*it != "none" && *it != "auto" && *it != "required")) {
      return BadRequest(
          "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": "
          "\"function\", \"function\": {\"name\": ...}}",
          "tool_choice");
    }
    choice = it->get<std::string>();
    if (choice == "required") {
      return BadRequest(
          "tool_choice \"required\" is not supported (it needs guided decoding); use \"auto\" "
          "(serve --enable-auto-tool-choice --tool-call-parser ...)",
          "tool_choice");
    }
    if (choice == "auto" && num_tools == 0) {
      return BadRequest("When using `tool_choice`, `tools` must be set.", "tool_choice");
    }
  }
  if (choice == "auto") {
    if (!limits.enable_auto_tool_choice || limits.tool_parser == ToolParserKind::kNone) {
      return BadRequest(
          "\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be "
          "set",
          "tool_choice");
    }
    out->tool_parser = limits.tool_parser;
  }
  return std::nullopt;
}

}  // namespace

std::optional<ApiError> ParseChatRequest(const json& body, const Tokenizer& tok,
                                         const ProtocolLimits& limits, ParsedRequest* out,
                                         const nlohmann::ordered_json* ordered) {
  *out = ParsedRequest{};
  out->endpoint = Endpoint::kChatCompletions;
  if (!body.is_object()) return BadRequest("the request body must be a JSON object", "");
  KVB_API_TRY(ParseCommon(body, limits, out));
  KVB_API_TRY(ParseTools(body, limits, out));
  out->prompts.emplace_back();
  KVB_API_TRY(ChatPromptIds(body, ordered, tok, limits, &out->prompts.back()));

  std::optional<bool> logprobs;
  KVB_API_TRY(GetBool(body, "logprobs", &logprobs));
  std::optional<int64_t> top_logprobs;
  KVB_API_TRY(GetInt(body, "top_logprobs", &top_logprobs));
  if (top_logprobs) {
    if (!logprobs.value_or(false)) {
      return BadRequest("'top_logprobs' needs 'logprobs' to be true", "top_logprobs");
    }
    if (*top_logprobs < 0 || *top_logprobs > limits.max_logprobs) {
      return BadRequest("'top_logprobs' must be in [0, " + std::to_string(limits.max_logprobs) +
                            "], got " + std::to_string(*top_logprobs),
                        "top_logprobs");
    }
  }
  if (logprobs.value_or(false)) out->sampling.logprobs = static_cast<int>(top_logprobs.value_or(0));
  return FinishLengths(body, limits, /*chat=*/true, out);
}

std::optional<ApiError> Tokenize(const json& body, const Tokenizer& tok,
                                 const ProtocolLimits& limits, json* response,
                                 const nlohmann::ordered_json* ordered) {
  if (!body.is_object()) return BadRequest("the request body must be a JSON object", "");
  KVB_API_TRY(CheckModel(body, limits));
  std::optional<bool> add_special, token_strs;
  KVB_API_TRY(GetBool(body, "add_special_tokens", &add_special));
  KVB_API_TRY(GetBool(body, "return_token_strs", &token_strs));
  std::vector<int32_t> ids;
  if (body.contains("messages")) {
    KVB_API_TRY(ChatPromptIds(body, ordered, tok, limits, &ids));
  } else {
    auto it = body.find("prompt");
    if (it == body.end() || !it->is_string()) {
      return BadRequest("'prompt' must be a string (or 'messages' a list)", "prompt");
    }
    KVB_API_TRY(EncodeText(tok, it->get_ref<const std::string&>(), add_special.value_or(true),
                           "prompt", &ids));
  }
  json strs = nullptr;
  if (token_strs.value_or(false)) {
    strs = json::array();
    for (int32_t id : ids) strs.push_back(tok.IdToToken(id).value_or(""));
  }
  *response = json{{"count", ids.size()},
                   {"max_model_len", limits.max_model_len},
                   {"tokens", ids},
                   {"token_strs", std::move(strs)}};
  return std::nullopt;
}

std::optional<ApiError> Detokenize(const json& body, const Tokenizer& tok,
                                   const ProtocolLimits& limits, json* response) {
  if (!body.is_object()) return BadRequest("the request body must be a JSON object", "");
  KVB_API_TRY(CheckModel(body, limits));
  auto it = body.find("tokens");
  if (it == body.end() || !it->is_array()) {
    return BadRequest("'tokens' must be a list of token ids", "tokens");
  }
  std::vector<int32_t> ids;
  KVB_API_TRY(TokenIdsFromJson(*it, tok, &ids, "tokens"));
  *response = json{{"prompt", tok.Decode(ids, /*skip_special_tokens=*/false)}};
  return std::nullopt;
}

std::optional<ApiError> ParseBody(const std::string& text, json* body) {
  try {
    *body = json::parse(text);
  } catch (const json::parse_error& e) {
    std::string what = e.what();
    // "[json.exception.parse_error.101] parse error at line 1, column 9: syntax error ... -
    // invalid string: ill-formed UTF-8 byte; last read: '...'": keep the reason, not the bytes.
    if (auto at = what.find("parse error"); at != std::string::npos) what = what.substr(at);
    if (auto last = what.find("; last read"); last != std::string::npos) what.resize(last);
    return BadRequest("the request body is not valid JSON: " + what, "");
  }
  return std::nullopt;
}

std::string PromptDigest(std::span<const int32_t> ids) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int32_t id : ids) {
    const auto u = static_cast<uint32_t>(id);
    for (int b = 0; b < 4; ++b) {
      h ^= (u >> (8 * b)) & 0xFF;
      h *= 0x100000001b3ull;
    }
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return std::to_string(ids.size()) + ":" + hex;
}

std::string DumpJson(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

namespace {
bool IsValidUtf8(const std::string& s) {
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    size_t need = c < 0x80             ? 1
                  : (c & 0xE0) == 0xC0 ? 2
                  : (c & 0xF0) == 0xE0 ? 3
                  : (c & 0xF8) == 0xF0 ? 4
                                       : 0;
    if (need == 0 || i + need > s.size()) return false;
    if (need == 2 && c < 0xC2) return false;  // overlong
    for (size_t k = 1; k < need; ++k) {
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    }
    i += need;
  }
  return true;
}
}  // namespace

size_t Utf8Length(std::string_view s) {
  size_t n = 0, i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    size_t need = c < 0x80             ? 1
                  : (c & 0xE0) == 0xC0 ? 2
                  : (c & 0xF0) == 0xE0 ? 3
                  : (c & 0xF8) == 0xF0 ? 4
                                       : 1;
    size_t k = 1;
    while (k < need && i + k < s.size() && (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80)
      ++k;
    i += k == need ? need : 1;  // an incomplete or stray sequence: one replacement per byte
    ++n;
  }
  return n;
}

std::string TokenDisplayText(const Tokenizer& tok, int32_t token) {
  std::string text = tok.Decode(std::span<const int32_t>(&token, 1), /*skip_special_tokens=*/false);
  if (IsValidUtf8(text)) return text;
  std::string out = "bytes:";
  char buf[8];
  for (unsigned char c : text) {
    std::snprintf(buf, sizeof(buf), "\\x%02x", c);
    out += buf;
  }
  return out;
}

ResponseBuilder::ResponseBuilder(const ParsedRequest& request, const Tokenizer& tok, std::string id,
                                 std::string model, int64_t created)
    : endpoint_(request.endpoint),
      n_(request.sampling.n),
      logprobs_(request.sampling.logprobs),
      include_usage_(request.include_usage),
      tokens_as_ids_(request.tokens_as_ids),
      stream_(request.stream),
      tool_parser_(request.tool_parser),
      reasoning_parser_(request.reasoning_parser),
      tok_(tok),
      id_(std::move(id)),
      model_(std::move(model)),
      created_(created),
      prompts_(request.prompts.size()) {
  for (size_t p = 0; p < prompts_.size(); ++p) {
    prompts_[p].choices.resize(n_);
    if (stream_) {
      for (Choice& c : prompts_[p].choices) {
        c.text_stream.emplace(tok_, /*skip_special_tokens=*/true);
        if (reasoning_parser_ != ReasoningParserKind::kNone) {
          c.reasoning_stream.emplace(reasoning_parser_);
        }
        if (tool_parser_ != ToolParserKind::kNone) {
          c.tool_stream.emplace(tool_parser_, MakeToolCallId);
        }
      }
    }
    prompts_[p].num_prompt_tokens = static_cast<int>(request.prompts[p].size());
    if (!request.kv_transfer_params.is_null()) {
      prompts_[p].prompt_digest = PromptDigest(request.prompts[p]);
    }
  }
}

void ResponseBuilder::Apply(size_t prompt_index, const RequestOutput& out) {
  if (prompt_index >= prompts_.size()) return;
  Prompt& p = prompts_[prompt_index];
  if (p.finished) return;
  if (out.num_prompt_tokens > 0) p.num_prompt_tokens = out.num_prompt_tokens;
  p.num_cached_tokens = std::max(p.num_cached_tokens, out.num_cached_tokens);
  for (const CompletionOutput& o : out.outputs) {
    if (o.index < 0 || o.index >= n_) continue;
    Choice& c = p.choices[o.index];
    if (c.finished) continue;
    if (o.finished) {
      c.stop_reason = o.stop_reason;
      c.text_tokens = o.text_tokens;
      c.text_len = o.text_len;
    }
    c.token_ids.insert(c.token_ids.end(), o.new_token_ids.begin(), o.new_token_ids.end());
    if (c.text_stream) {
      // A stop token's text is not pushed when it is not kept (text_tokens).
      const size_t end = c.text_tokens >= 0 ? std::min<size_t>(c.text_tokens, c.token_ids.size())
                                            : c.token_ids.size();
      for (size_t k = c.text_stream->ids().size(); k < end; ++k) {
        c.pending_text += c.text_stream->Push(c.token_ids[k]);
      }
    }
    if (logprobs_ >= 0) {
      c.logprobs.insert(c.logprobs.end(), o.new_logprobs.begin(), o.new_logprobs.end());
    }
    if (o.finished) FinishChoice(c, o.finish_reason.empty() ? "stop" : o.finish_reason);
  }
  if (!out.kv_transfer_params.is_null()) {
    p.kv_transfer_params = out.kv_transfer_params;
    if (p.kv_transfer_params.is_object() && !p.prompt_digest.empty()) {
      p.kv_transfer_params[kPromptDigestKey] = p.prompt_digest;
    }
  }
  if (!out.error.ok() && p.error.ok()) p.error = out.error;
  if (out.finished) {
    p.finished = true;
    for (Choice& c : p.choices) {
      if (!c.finished) FinishChoice(c, out.error.ok() ? "abort" : "error");
    }
  }
}

void ResponseBuilder::FinishAll(const std::string& reason) {
  for (Prompt& p : prompts_) {
    if (p.finished) continue;
    p.finished = true;
    for (Choice& c : p.choices) {
      if (!c.finished) FinishChoice(c, reason);
    }
  }
}

void ResponseBuilder::FinishChoice(Choice& c, const std::string& reason) {
  c.finished = true;
  c.finish_reason = reason;
  if (!c.text_stream) return;
  c.pending_text += c.text_stream->Finish();
  // A stop string cuts the text where it starts. The engine held back every token whose text
  // could begin one, so nothing past the cut was streamed.
  if (c.text_len >= 0) {
    const size_t keep = static_cast<size_t>(c.text_len);
    c.pending_text.resize(keep > c.streamed_text_bytes
                              ? std::min(c.pending_text.size(), keep - c.streamed_text_bytes)
                              : 0);
  }
}

std::string ResponseBuilder::ChoiceText(const Choice& c) const {
  std::span<const int32_t> ids(c.token_ids);
  if (c.text_tokens >= 0 && static_cast<size_t>(c.text_tokens) < ids.size()) {
    ids = ids.first(static_cast<size_t>(c.text_tokens));
  }
  std::string text = tok_.Decode(ids, /*skip_special_tokens=*/true);
  if (c.text_len >= 0 && static_cast<size_t>(c.text_len) < text.size()) text.resize(c.text_len);
  return text;
}

bool ResponseBuilder::AllFinished() const {
  for (const Prompt& p : prompts_) {
    if (!p.finished) return false;
  }
  return true;
}

Status ResponseBuilder::FirstError() const {
  for (const Prompt& p : prompts_) {
    if (!p.error.ok()) return p.error;
  }
  return OkStatus();
}

json ResponseBuilder::Usage() const {
  int64_t prompt_tokens = 0, completion_tokens = 0, cached = 0;
  for (const Prompt& p : prompts_) {
    prompt_tokens += p.num_prompt_tokens;
    cached += p.num_cached_tokens;
    for (const Choice& c : p.choices) completion_tokens += static_cast<int64_t>(c.token_ids.size());
  }
  return json{{"prompt_tokens", prompt_tokens},
              {"completion_tokens", completion_tokens},
              {"total_tokens", prompt_tokens + completion_tokens},
              {"prompt_tokens_details", {{"cached_tokens", cached}}}};
}

json ResponseBuilder::KvTransferParams() const {
  for (const Prompt& p : prompts_) {
    if (!p.kv_transfer_params.is_null()) return p.kv_transfer_params;
  }
  return nullptr;
}

std::string ResponseBuilder::TokenText(int32_t token) const {
  return tokens_as_ids_ ? "token_id:" + std::to_string(token) : TokenDisplayText(tok_, token);
}

json ResponseBuilder::LogprobsJson(const Choice& c, size_t from, size_t to,
                                   size_t* text_offset) const {
  if (endpoint_ == Endpoint::kCompletions) {
    json tokens = json::array(), token_logprobs = json::array(), top = json::array(),
         offsets = json::array();
    for (size_t k = from; k < to && k < c.logprobs.size(); ++k) {
      const TokenLogprob& lp = c.logprobs[k];
      std::string text = TokenText(lp.token);
      json entry = json::object();
      for (const TopLogprob& t : lp.top) {
        std::string key = TokenText(t.token);
        if (!entry.contains(key)) entry[key] = t.logprob;
      }
      if (!entry.contains(text)) entry[text] = lp.logprob;  // the sampled token is always listed
      top.push_back(std::move(entry));
      offsets.push_back(*text_offset);
      // vLLM: the previous offset + len(token text); a byte token shown as "bytes:\xNN"
      // counts as the one character it becomes in `text`.
      *text_offset += Utf8Length(tok_.Decode(std::span<const int32_t>(&lp.token, 1), false));
      tokens.push_back(std::move(text));
      token_logprobs.push_back(lp.logprob);
    }
    return json{{"tokens", tokens},
                {"token_logprobs", token_logprobs},
                {"top_logprobs", top},
                {"text_offset", offsets}};
  }
  auto entry = [&](int32_t token, float logprob) {
    // vLLM: the bytes of the token's text (U+FFFD included); the byte tokenizer's raw byte.
    std::string raw = tok_.Decode(std::span<const int32_t>(&token, 1), false);
    json bytes = json::array();
    for (unsigned char b : raw) bytes.push_back(static_cast<int>(b));
    return json{{"token", TokenText(token)}, {"logprob", logprob}, {"bytes", bytes}};
  };
  json content = json::array();
  for (size_t k = from; k < to && k < c.logprobs.size(); ++k) {
    const TokenLogprob& lp = c.logprobs[k];
    json e = entry(lp.token, lp.logprob);
    json top = json::array();
    for (const TopLogprob& t : lp.top) top.push_back(entry(t.token, t.logprob));
    e["top_logprobs"] = std::move(top);
    content.push_back(std::move(e));
  }
  return json{{"content", content}};
}

json ResponseBuilder::ChatMessage(const Choice& c, std::string* finish_reason) const {
  // vLLM's serving_chat: the reasoning parser first, the tool parser on the content it leaves.
  std::optional<std::string> content = ChoiceText(c);
  json message{{"role", "assistant"}};
  if (reasoning_parser_ != ReasoningParserKind::kNone) {
    auto [reasoning, rest] = ExtractReasoning(reasoning_parser_, *content);
    message["reasoning_content"] = reasoning ? json(*reasoning) : json(nullptr);
    content = std::move(rest);
  }
  if (tool_parser_ != ToolParserKind::kNone) {
    ExtractedToolCalls t = ExtractToolCalls(tool_parser_, content.value_or(""));
    if (t.tools_called) {
      json calls = json::array();
      for (const ParsedToolCall& call : t.calls) {
        calls.push_back(json{{"id", MakeToolCallId()},
                             {"type", "function"},
                             {"function", {{"name", call.name}, {"arguments", call.arguments}}}});
      }
      message["tool_calls"] = std::move(calls);
      content = t.content;
      *finish_reason = "tool_calls";
    } else if (t.content && !t.content->empty()) {
      content = t.content;
    }
  }
  message["content"] = content ? json(*content) : json(nullptr);
  return message;
}

void ResponseBuilder::ParsedStreamChunks(Choice& c, int64_t index, const json& kv,
                                         const std::function<void(const json&)>& emit) {
  std::string text = std::move(c.pending_text);
  c.pending_text.clear();
  c.streamed_text_bytes += text.size();
  ChatDelta d;
  if (c.reasoning_stream) {
    d = c.reasoning_stream->Push(text);
    if (c.finished) {
      ChatDelta rest = c.reasoning_stream->Finish();
      d.reasoning += rest.reasoning;
      d.content += rest.content;
    }
  } else {
    d.content = std::move(text);
  }
  if (c.tool_stream) {
    ChatDelta t = c.tool_stream->Push(d.content);
    if (c.finished) {
      ChatDelta rest = c.tool_stream->Finish();
      t.content += rest.content;
      for (json& tc : rest.tool_calls) t.tool_calls.push_back(std::move(tc));
    }
    d.content = std::move(t.content);
    d.tool_calls = std::move(t.tool_calls);
  }
  bool logprobs_sent = false;
  auto chunk_with = [&](json delta) {
    json choice{{"index", index}, {"delta", std::move(delta)}};
    if (logprobs_ >= 0 && !logprobs_sent) {
      choice["logprobs"] = LogprobsJson(c, c.streamed_tokens, c.token_ids.size(), &c.text_offset);
      logprobs_sent = true;
    } else {
      choice["logprobs"] = nullptr;
    }
    choice["finish_reason"] = nullptr;
    choice["stop_reason"] = nullptr;
    json chunk = ChunkBase();
    chunk["choices"].push_back(std::move(choice));
    return chunk;
  };
  if (!d.reasoning.empty() || !d.content.empty()) {
    json delta = json::object();
    if (!d.reasoning.empty()) delta["reasoning_content"] = d.reasoning;
    if (!d.content.empty()) delta["content"] = d.content;
    emit(chunk_with(std::move(delta)));
  }
  for (json& tc : d.tool_calls) emit(chunk_with(json{{"tool_calls", json::array({tc})}}));
  if (c.finished) {
    json chunk = chunk_with(json::object());
    json& choice = chunk["choices"][0];
    choice["finish_reason"] =
        c.tool_stream && c.tool_stream->tools_called() ? "tool_calls" : c.finish_reason;
    choice["stop_reason"] = c.stop_reason;
    if (!kv.is_null()) chunk["kv_transfer_params"] = kv;
    c.finish_sent = true;
    emit(chunk);
  }
  if (logprobs_sent || c.finished) c.streamed_tokens = c.token_ids.size();
}

json ResponseBuilder::FinalBody() const {
  const bool chat = endpoint_ == Endpoint::kChatCompletions;
  json choices = json::array();
  for (size_t p = 0; p < prompts_.size(); ++p) {
    for (int i = 0; i < n_; ++i) {
      const Choice& c = prompts_[p].choices[i];
      json choice{{"index", static_cast<int64_t>(p) * n_ + i}};
      std::string text = ChoiceText(c);
      std::string finish_reason = c.finish_reason;
      if (chat && (tool_parser_ != ToolParserKind::kNone ||
                   reasoning_parser_ != ReasoningParserKind::kNone)) {
        choice["message"] = ChatMessage(c, &finish_reason);
      } else if (chat) {
        choice["message"] = json{{"role", "assistant"}, {"content", text}};
      } else {
        choice["text"] = text;
      }
      if (logprobs_ >= 0) {
        size_t offset = 0;
        choice["logprobs"] = LogprobsJson(c, 0, c.logprobs.size(), &offset);
      } else {
        choice["logprobs"] = nullptr;
      }
      choice["finish_reason"] = c.finished ? json(finish_reason) : json(nullptr);
      choice["stop_reason"] = c.finished ? c.stop_reason : json(nullptr);
      choices.push_back(std::move(choice));
    }
  }
  json body{{"id", id_},
            {"object", chat ? "chat.completion" : "text_completion"},
            {"created", created_},
            {"model", model_},
            {"choices", std::move(choices)},
            {"usage", Usage()}};
  json kv = KvTransferParams();
  if (!kv.is_null()) body["kv_transfer_params"] = kv;
  return body;
}

json ResponseBuilder::ChunkBase() const {
  const bool chat = endpoint_ == Endpoint::kChatCompletions;
  json chunk{{"id", id_},
             {"object", chat ? "chat.completion.chunk" : "text_completion"},
             {"created", created_},
             {"model", model_},
             {"choices", json::array()}};
  if (include_usage_) chunk["usage"] = nullptr;
  return chunk;
}

std::string ResponseBuilder::TakeStreamFrames() {
  if (done_sent_) return "";
  const bool chat = endpoint_ == Endpoint::kChatCompletions;
  std::string frames;
  auto emit = [&](const json& j) { frames += "data: " + DumpJson(j) + "\n\n"; };
  for (size_t p = 0; p < prompts_.size(); ++p) {
    for (int i = 0; i < n_; ++i) {
      Choice& c = prompts_[p].choices[i];
      if (c.finish_sent) continue;
      const int64_t index = static_cast<int64_t>(p) * n_ + i;
      const bool has_text = !c.pending_text.empty();
      bool has_tokens = c.token_ids.size() > c.streamed_tokens;
      if (chat && !c.role_sent) {
        json chunk = ChunkBase();
        chunk["choices"].push_back(json{{"index", index},
                                        {"delta", {{"role", "assistant"}, {"content", ""}}},
                                        {"logprobs", nullptr},
                                        {"finish_reason", nullptr}});
        emit(chunk);
        c.role_sent = true;
      }
      if (!has_text && !has_tokens && !c.finished) continue;
      if (chat && (c.reasoning_stream || c.tool_stream)) {
        ParsedStreamChunks(c, index, prompts_[p].kv_transfer_params, emit);
        continue;
      }
      std::string delta = std::move(c.pending_text);
      c.pending_text.clear();
      c.streamed_text_bytes += delta.size();
      json choice{{"index", index}};
      if (chat) {
        choice["delta"] =
            c.finished && delta.empty() && !has_tokens ? json::object() : json{{"content", delta}};
      } else {
        choice["text"] = delta;
      }
      if (logprobs_ >= 0) {
        choice["logprobs"] = LogprobsJson(c, c.streamed_tokens, c.token_ids.size(), &c.text_offset);
      } else {
        choice["logprobs"] = nullptr;
      }
      choice["finish_reason"] = c.finished ? json(c.finish_reason) : json(nullptr);
      choice["stop_reason"] = c.finished ? c.stop_reason : json(nullptr);
      json chunk = ChunkBase();
      chunk["choices"].push_back(std::move(choice));
      if (c.finished) {
        json kv = prompts_[p].kv_transfer_params;
        if (!kv.is_null()) chunk["kv_transfer_params"] = kv;
        c.finish_sent = true;
      }
      emit(chunk);
      c.streamed_tokens = c.token_ids.size();
    }
  }
  if (AllFinished()) {
    Status err = FirstError();
    if (!err.ok()) {
      frames += "data: " + OpenAiErrorBody(HttpStatusFromStatus(err), err.message()) + "\n\n";
    }
    if (include_usage_) {
      json chunk = ChunkBase();
      chunk["usage"] = Usage();
      emit(chunk);
    }
    frames += "data: [DONE]\n\n";
    done_sent_ = true;
  }
  return frames;
}

}  // namespace kvbridge::server
