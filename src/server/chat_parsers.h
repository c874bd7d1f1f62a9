// src/server/chat_parsers.h — what a chat model's output text means beyond text: tool calls
// (vLLM's --tool-call-parser hermes | llama3_json) and reasoning (vLLM's --reasoning-parser
// qwen3 | deepseek_r1), for whole answers and for streams. Pure functions and small state
// machines on text: unit tested on fixed strings (random weights never write these forms).
//
//   ExtractedToolCalls t = ExtractToolCalls(ToolParserKind::kHermes, text);
//   StreamingToolParser s(ToolParserKind::kHermes);
//   for (...) { ChatDelta d = s.Push(delta_text); ... }  ChatDelta last = s.Finish();
//
// The whole-answer rules are vLLM's (vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py,
// llama_tool_parser.py, vllm/reasoning/qwen3_reasoning_parser.py, deepseek_r1_reasoning_parser.py
// of the releases whose field is reasoning_content). Streams give the same calls and text, but
// where vLLM sends a call's arguments in fragments as they are generated, these send a call once
// it is complete: one delta with its id, type and name, then one with all its arguments (the
// shapes vLLM's deltas have; a client concatenating fragments gets the same call).
//
// Thread-safety: values; a streaming parser belongs to one choice of one stream.
#pragma once

#include <functional>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge::server {

enum class ToolParserKind { kNone, kHermes, kLlama3Json };
enum class ReasoningParserKind { kNone, kQwen3, kDeepSeekR1 };

/// "hermes" | "llama3_json" (vLLM's names); "" = kNone. Errors: InvalidArgument listing them.
Result<ToolParserKind> ParseToolParserName(std::string_view name);
/// "qwen3" | "deepseek_r1"; "" = kNone. Errors: InvalidArgument listing them.
Result<ReasoningParserKind> ParseReasoningParserName(std::string_view name);

/// Python's json.dumps(v, ensure_ascii=False): ", " and ": " separators, keys in `v`'s order.
std::string PythonJsonDumps(const nlohmann::ordered_json& v);

struct ParsedToolCall {
  std::string name;
  std::string arguments;  ///< PythonJsonDumps of the call's arguments object
};
struct ExtractedToolCalls {
  bool tools_called = false;
  std::vector<ParsedToolCall> calls;
  std::optional<std::string> content;  ///< the message content (nullopt: null)
};
/// vLLM's extract_tool_calls on a whole answer. hermes: every `<tool_call>JSON</tool_call>` (the
/// last may be unterminated), each {"name": string, "arguments": any}; content is the text
/// before the first `<tool_call>` (null when empty). llama3_json: the first run of JSON objects
/// (one nested level, as vLLM's pattern) separated by ';', each {"name", "arguments" or
/// "parameters"}; content null. Anything malformed: no calls, the whole text as content.
ExtractedToolCalls ExtractToolCalls(ToolParserKind kind, const std::string& text);

/// vLLM's extract_reasoning_content on a whole answer: {reasoning, content}, nullopt = null.
/// qwen3: both `<think>` and `</think>` present: the text between is the reasoning, the rest
/// after `</think>` the content (null when empty); otherwise everything is content. deepseek_r1:
/// a leading part up to `<think>` is dropped; the text up to `</think>` is the reasoning
/// (everything when there is none), the rest the content.
std::pair<std::optional<std::string>, std::optional<std::string>> ExtractReasoning(
    ReasoningParserKind kind, const std::string& text);

/// One step of a parsed stream: text for "reasoning_content", text for "content", and
/// tool-call deltas (each an OpenAI DeltaToolCall object: {"index", "id", "type", "function":
/// {"name"}} then {"index", "function": {"arguments"}}).
struct ChatDelta {
  std::string reasoning;
  std::string content;
  std::vector<nlohmann::json> tool_calls;
  bool empty() const { return reasoning.empty() && content.empty() && tool_calls.empty(); }
};

/// Splits streamed text into reasoning and content as vLLM's streaming reasoning parsers do
/// (text-based: a tag split across deltas is held back until it is whole). qwen3: content until
/// `<think>`, reasoning until `</think>`, content after. deepseek_r1: reasoning (a `<think>` in
/// it dropped) until `</think>`, content after. Differs from the whole answer as vLLM's does: a
/// qwen3 stream cut inside <think> streamed reasoning, the whole answer calls it content.
class StreamingReasoningParser {
 public:
  explicit StreamingReasoningParser(ReasoningParserKind kind);
  ChatDelta Push(std::string_view text);
  ChatDelta Finish();  ///< flushes what was held back

 private:
  enum class Phase { kBefore, kReasoning, kContent };
  ChatDelta Drain(bool final);
  ReasoningParserKind kind_;
  Phase phase_;
  bool saw_start_ = false;
  std::string pending_;
};

/// Turns streamed content into content and tool-call deltas (see the header comment). hermes:
/// text is content until `<tool_call>` (a partial tag held back); a call is sent when
/// `</tool_call>` (or the end) completes it; a malformed call goes out as content, text and all.
/// llama3_json: a stream whose text starts with '{' is held to the end and parsed whole
/// (calls, or all of it as content); any other stream is content as it comes.
class StreamingToolParser {
 public:
  /// `make_id` gives each call its id ("chatcmpl-tool-<32 hex>" in the server).
  StreamingToolParser(ToolParserKind kind, std::function<std::string()> make_id);
  ChatDelta Push(std::string_view text);
  ChatDelta Finish();
  bool tools_called() const { return num_calls_ > 0; }

 private:
  ChatDelta Drain(bool final);
  void EmitCall(const ParsedToolCall& call, ChatDelta* out);
  ToolParserKind kind_;
  std::function<std::string()> make_id_;
  std::string pending_;
  bool in_call_ = false;
  int decided_ = -1;  // llama3_json: -1 undecided, 0 plain content, 1 buffered to the end
  int num_calls_ = 0;
};

/// A fresh tool-call id as vLLM makes them: "chatcmpl-tool-" + 32 lowercase hex digits.
std::string MakeToolCallId();

}  // namespace kvbridge::server
