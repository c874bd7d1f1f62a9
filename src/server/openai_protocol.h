// src/server/openai_protocol.h — the OpenAI wire format of the server, without any I/O.
//
// Parse*Request turns a JSON body into ParsedRequest (prompts as token ids + SamplingParams) or
// an ApiError (HTTP status + message + offending param). ResponseBuilder accumulates the engine's
// RequestOutputs of one HTTP request (one engine request per prompt) and renders the whole
// response body or the SSE frames of a stream. Both are pure: unit tested without an engine.
//
// Thread-safety: values; a ResponseBuilder needs external locking when shared.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "kvbridge/engine/engine.h"
#include "kvbridge/server/api_server.h"

namespace kvbridge::server {

enum class Endpoint { kCompletions, kChatCompletions };

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
};

struct ParsedRequest {
  Endpoint endpoint = Endpoint::kCompletions;
  std::vector<std::vector<int32_t>> prompts;  ///< tokenized, truncated; one engine request each
  SamplingParams sampling;
  bool stream = false;
  bool include_usage = false;         ///< stream_options.include_usage
  nlohmann::json kv_transfer_params;  ///< null when absent
};

/// Body of POST /v1/completions. Returns nullopt and fills `out`, or the error.
std::optional<ApiError> ParseCompletionRequest(const nlohmann::json& body, const TextCodec& codec,
                                               const ProtocolLimits& limits, ParsedRequest* out);
/// Body of POST /v1/chat/completions (the prompt is codec.ApplyChatTemplate(messages)).
std::optional<ApiError> ParseChatRequest(const nlohmann::json& body, const TextCodec& codec,
                                         const ProtocolLimits& limits, ParsedRequest* out);

/// JSON text that never throws on invalid UTF-8 (bytes become U+FFFD).
std::string DumpJson(const nlohmann::json& j);
/// Length of the longest prefix of `s` that does not end inside an incomplete UTF-8 sequence.
size_t CompleteUtf8Prefix(const std::string& s);
/// A token's text for logprobs: the decoded text when it is valid UTF-8, else "bytes:\xNN...".
std::string TokenDisplayText(const TextCodec& codec, int32_t token);

class ResponseBuilder {
 public:
  /// `id` like "cmpl-..."; `created` Unix seconds; one engine request per request.prompts.
  ResponseBuilder(const ParsedRequest& request, const TextCodec& codec, std::string id,
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
    size_t streamed_tokens = 0;      // tokens whose logprobs were streamed
    size_t streamed_text_bytes = 0;  // bytes of Decode(token_ids) streamed
    bool role_sent = false;          // chat: the first delta carries the role
    bool finish_sent = false;
    size_t text_offset = 0;  // completions logprobs: bytes before streamed_tokens
  };
  struct Prompt {
    std::vector<Choice> choices;
    int num_prompt_tokens = 0;
    int num_cached_tokens = 0;
    bool finished = false;
    Status error;
    nlohmann::json kv_transfer_params;
  };
  nlohmann::json Usage() const;
  nlohmann::json ChunkBase() const;
  /// Logprobs of tokens [from, to) of `c` in this endpoint's shape; `text_offset` advances.
  nlohmann::json LogprobsJson(const Choice& c, size_t from, size_t to, size_t* text_offset) const;
  nlohmann::json KvTransferParams() const;

  Endpoint endpoint_;
  int n_;
  int logprobs_;  // -1 none
  bool include_usage_;
  const TextCodec& codec_;
  std::string id_;
  std::string model_;
  int64_t created_;
  std::vector<Prompt> prompts_;
  bool done_sent_ = false;
};

}  // namespace kvbridge::server
