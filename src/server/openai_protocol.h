// src/server/openai_protocol.h — the OpenAI wire format of the server, without any I/O.
//
// Parse*Request turns a JSON body into ParsedRequest (prompts as token ids + SamplingParams) or
// an ApiError (HTTP status + message + offending param). ResponseBuilder accumulates the engine's
// RequestOutputs of one HTTP request (one engine request per prompt) and renders the whole
// response body or the SSE frames of a stream. Tokenize/Detokenize answer vLLM's /tokenize and
// /detokenize. All pure: unit tested without an engine.
//
// Thread-safety: values; a ResponseBuilder needs external locking when shared.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvbridge/engine/request.h"
#include "kvbridge/model/chat_template.h"
#include "kvbridge/model/generation_config.h"
#include "kvbridge/model/tokenizer.h"
#include "kvbridge/server/api_server.h"
#include "server/chat_parsers.h"

namespace kvbridge::server {

enum class Endpoint { kCompletions, kChatCompletions };

/// Bounds on a request's stops (vLLM has none; these keep the per-token stop check and the
/// streaming hold-back small). Beyond them: 400.
inline constexpr size_t kMaxStopStrings = 64;
inline constexpr size_t kMaxStopStringBytes = 1024;
inline constexpr size_t kMaxStopTokenIds = 1024;

struct ApiError {
  int status = 400;
  std::string message;
  std::string param;
};

/// Limits the parser enforces (from ServerConfig).
struct ProtocolLimits {
  std::string served_model_name;
  int max_model_len = 0;  ///< 0: no length check here (the engine checks)
  int max_n = 128;
  int max_logprobs = 20;
  /// The checkpoint's chat templates (not owned; null or empty: kvbridge's plain format).
  const ChatTemplates* chat_templates = nullptr;
  /// Values for sampling keys a request leaves out (not owned; null: the OpenAI defaults).
  const SamplingDefaults* sampling_defaults = nullptr;
  /// vLLM's --enable-auto-tool-choice with --tool-call-parser: tool_choice "auto" parses the
  /// answer's tool calls; without both, a request with tools and tool_choice "auto" (the
  /// default when tools are given) is a 400, as vLLM.
  bool enable_auto_tool_choice = false;
  ToolParserKind tool_parser = ToolParserKind::kNone;
  /// vLLM's --reasoning-parser: chat answers split into reasoning_content and content.
  ReasoningParserKind reasoning_parser = ReasoningParserKind::kNone;
};

struct ParsedRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::vector<std::vector<int32_t>> prompts;  ///< tokenized, truncated; one engine request each
  SamplingParams sampling;
  bool stream = false;
  bool include_usage = false;         ///< stream_options.include_usage
  bool tokens_as_ids = false;         ///< return_tokens_as_token_ids: logprobs say "token_id:N"
  nlohmann::json kv_transfer_params;  ///< null when absent
  /// Chat: how the answer's text is parsed (tool_choice "auto" with tools and a parser; the
  /// server's reasoning parser).
  ToolParserKind tool_parser = ToolParserKind::kNone;
  ReasoningParserKind reasoning_parser = ReasoningParserKind::kNone;
};

/// Body of POST /v1/completions. Returns nullopt and fills `out`, or the error. Text prompts
/// are tok.Encode(text, add_special_tokens) (the request's `add_special_tokens`, default true);
/// token-id prompts must lie in [0, tok.vocab_size()).
std::optional<ApiError> ParseCompletionRequest(const nlohmann::json& body, const Tokenizer& tok,
                                               const ProtocolLimits& limits, ParsedRequest* out);
/// Body of POST /v1/chat/completions. With a chat template (limits.chat_templates), the prompt
/// is the template rendered as transformers' apply_chat_template does (messages, tools,
/// documents null, add_generation_prompt (default true), the tokenizer_config's special tokens,
/// chat_template_kwargs' keys) and encoded without special tokens (vLLM's default
/// add_special_tokens false: the template writes BOS); a template's raise_exception is a 400
/// with its message. Without one: tok.ApplyChatTemplate(messages) encoded with special tokens.
/// `ordered` (optional) is the same body parsed keeping key order (tojson of tools shows it).
std::optional<ApiError> ParseChatRequest(const nlohmann::json& body, const Tokenizer& tok,
                                         const ProtocolLimits& limits, ParsedRequest* out,
                                         const nlohmann::ordered_json* ordered = nullptr);

/// POST /tokenize (vLLM): {"model", "prompt", "add_special_tokens" (default true),
/// "return_token_strs" (default false)} -> {"count", "max_model_len", "tokens", "token_strs"
/// (null unless asked: the vocabulary entries, e.g. "Ġworld")}. No length check (as vLLM).
/// The chat form {"model", "messages", "add_generation_prompt" (default true),
/// "add_special_tokens" (default false), "tools", "chat_template_kwargs"} gives the ids of the
/// prompt a chat completion would get.
std::optional<ApiError> Tokenize(const nlohmann::json& body, const Tokenizer& tok,
                                 const ProtocolLimits& limits, nlohmann::json* response,
                                 const nlohmann::ordered_json* ordered = nullptr);
/// POST /detokenize (vLLM): {"model", "tokens"} -> {"prompt"}: Decode with special tokens kept.
/// An id outside [0, tok.vocab_size()) is a 400.
std::optional<ApiError> Detokenize(const nlohmann::json& body, const Tokenizer& tok,
                                   const ProtocolLimits& limits, nlohmann::json* response);

/// Parses a request body. A body that is not JSON (invalid UTF-8 in a string included: JSON
/// text is UTF-8) is a 400 "the request body is not valid JSON: <reason>".
std::optional<ApiError> ParseBody(const std::string& text, nlohmann::json* body);
/// The key of kv_transfer_params by which a prefill tells the decode which prompt ids it
/// prefilled (PromptDigest), so that a decode whose tokenizer gives other ids refuses the KV.
inline constexpr const char* kPromptDigestKey = "kvbridge_prompt_digest";
/// "<count>:<16 hex digits of FNV-1a 64 over the ids' little-endian int32 bytes>".
std::string PromptDigest(std::span<const int32_t> ids);

/// JSON text that never throws on invalid UTF-8 (bytes become U+FFFD).
std::string DumpJson(const nlohmann::json& j);
/// A token's text for logprobs, as vLLM reports it: the token decoded alone with special tokens
/// kept (a Hugging Face tokenizer writes U+FFFD for a part of a UTF-8 character). The byte
/// tokenizer's text when it is valid UTF-8, else "bytes:\xNN...".
std::string TokenDisplayText(const Tokenizer& tok, int32_t token);
/// Characters (code points) of UTF-8 text, as Python's len(); a stray byte counts as one.
size_t Utf8Length(std::string_view s);

class ResponseBuilder {
 public:
  /// `id` like "cmpl-..."; `created` Unix seconds; one engine request per request.prompts.
  ResponseBuilder(const ParsedRequest& request, const Tokenizer& tok, std::string id,
                  std::string model, int64_t created);

  /// Folds one engine output of prompt `prompt_index` in.
  void Apply(size_t prompt_index, const RequestOutput& out);
  /// Marks every unfinished choice of every prompt finished with `reason` (stop/abort paths).
  void FinishAll(const std::string& reason);

  bool AllFinished() const;
  /// The first engine error (OK when none).
  Status FirstError() const;

  /// The whole non-streaming response body.
  nlohmann::json FinalBody() const;
  /// SSE frames ("data: {...}\n\n") for everything new since the last call; after the last
  /// output: the finishing chunks, the usage chunk (include_usage) and "data: [DONE]\n\n".
  /// An engine error becomes one "data: {"error":...}" frame before [DONE].
  std::string TakeStreamFrames();
  bool StreamDone() const { return done_sent_; }

  const std::string& id() const { return id_; }

 private:
  struct Choice {
    std::vector<int32_t> token_ids;
    std::vector<TokenLogprob> logprobs;
    bool finished = false;
    std::string finish_reason;
    nlohmann::json stop_reason;                                // CompletionOutput::stop_reason
    int text_tokens = -1;                                      // CompletionOutput::text_tokens
    int64_t text_len = -1;                                     // CompletionOutput::text_len
    std::optional<StreamingReasoningParser> reasoning_stream;  // streaming, a reasoning parser
    std::optional<StreamingToolParser> tool_stream;            // streaming, tool parsing
    std::optional<IncrementalDecoder> text_stream;             // streaming only
    std::string pending_text;                                  // final text not streamed yet
    size_t streamed_text_bytes = 0;                            // text streamed before pending_text
    size_t streamed_tokens = 0;  // tokens whose logprobs were streamed
    bool role_sent = false;      // chat: the first delta carries the role
    bool finish_sent = false;
    size_t text_offset = 0;  // completions logprobs: characters before streamed_tokens
  };
  struct Prompt {
    std::vector<Choice> choices;
    std::string prompt_digest;  // PromptDigest of its ids, for a P/D request
    int num_prompt_tokens = 0;
    int num_cached_tokens = 0;
    bool finished = false;
    Status error;
    nlohmann::json kv_transfer_params;
  };
  void FinishChoice(Choice& c, const std::string& reason);
  /// Chat with a parser: the message object and finish_reason of a whole answer.
  nlohmann::json ChatMessage(const Choice& c, std::string* finish_reason) const;
  /// Chat with a parser: the SSE chunks of `c`'s new text (reasoning/content/tool-call deltas).
  void ParsedStreamChunks(Choice& c, int64_t index, const nlohmann::json& kv,
                          const std::function<void(const nlohmann::json&)>& emit);
  /// The whole text of a finished (or the text so far of an unfinished) choice.
  std::string ChoiceText(const Choice& c) const;
  nlohmann::json Usage() const;
  nlohmann::json ChunkBase() const;
  /// Logprobs of tokens [from, to) of `c` in this endpoint's shape; `text_offset` (characters
  /// of the token texts before `from`) advances.
  nlohmann::json LogprobsJson(const Choice& c, size_t from, size_t to, size_t* text_offset) const;
  nlohmann::json KvTransferParams() const;
  std::string TokenText(int32_t token) const;

  Endpoint endpoint_;
  int n_;
  int logprobs_;  // -1 none
  bool include_usage_;
  bool tokens_as_ids_;
  bool stream_;
  ToolParserKind tool_parser_;
  ReasoningParserKind reasoning_parser_;
  Tokenizer tok_;
  std::string id_;
  std::string model_;
  int64_t created_;
  std::vector<Prompt> prompts_;
  bool done_sent_ = false;
};

}  // namespace kvbridge::server
