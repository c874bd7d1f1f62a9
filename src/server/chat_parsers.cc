#include "server/chat_parsers.h"

#include <cstdio>
#include <random>

namespace kvbridge::server {

namespace {

using ojson = nlohmann::ordered_json;

constexpr std::string_view kToolCallStart = "<tool_call>";
constexpr std::string_view kToolCallEnd = "</tool_call>";
constexpr std::string_view kThinkStart = "<think>";
constexpr std::string_view kThinkEnd = "</think>";

// Python's str.isspace() over ASCII (what the models write between JSON objects).
bool IsSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\f' || c == '\v';
}

std::string Strip(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && IsSpace(s[b])) ++b;
  while (e > b && IsSpace(s[e - 1])) --e;
  return std::string(s.substr(b, e - b));
}

void DumpString(const std::string& s, std::string* out) {
  out->push_back('"');
  for (unsigned char c : s) {
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          *out += buf;
        } else {
          out->push_back(static_cast<char>(c));
        }
    }
  }
  out->push_back('"');
}

void Dump(const ojson& v, std::string* out) {
  switch (v.type()) {
    case ojson::value_t::object: {
      *out += "{";
      bool first = true;
      for (auto it = v.begin(); it != v.end(); ++it) {
        if (!first) *out += ", ";
        first = false;
        DumpString(it.key(), out);
        *out += ": ";
        Dump(it.value(), out);
      }
      *out += "}";
      break;
    }
    case ojson::value_t::array: {
      *out += "[";
      for (size_t i = 0; i < v.size(); ++i) {
        if (i > 0) *out += ", ";
        Dump(v[i], out);
      }
      *out += "]";
      break;
    }
    case ojson::value_t::string:
      DumpString(v.get_ref<const std::string&>(), out);
      break;
    case ojson::value_t::number_float: {
      // Python's repr of a float: the shortest round trip, always with '.' or an exponent.
      std::string s = v.dump();
      if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
      *out += s;
      break;
    }
    default:
      *out += v.dump();  // null, true, false, integers: as Python writes them
  }
}

// One call object of a model's output: {"name": string, <args_key>: any} (llama3_json also
// takes "parameters"). nullopt when it is not one (vLLM: an exception, the text stays content).
std::optional<ParsedToolCall> CallFromJson(std::string_view text, bool parameters_too) {
  ojson j = ojson::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  auto name = j.find("name");
  if (name == j.end() || !name->is_string()) return std::nullopt;
  auto args = j.find("arguments");
  if (args == j.end() && parameters_too) args = j.find("parameters");
  if (args == j.end()) return std::nullopt;
  return ParsedToolCall{name->get<std::string>(), PythonJsonDumps(*args)};
}

// vLLM's llama3_json pattern {[^{}]*(?:{[^{}]*}[^{}]*)*}: an object with objects nested one
// level at most. Returns the end of the match at `i`, or npos.
size_t MatchFlatObject(const std::string& s, size_t i) {
  if (i >= s.size() || s[i] != '{') return std::string::npos;
  size_t j = i + 1;
  int depth = 1;
  for (; j < s.size(); ++j) {
    if (s[j] == '{') {
      if (depth == 2) return std::string::npos;
      depth = 2;
    } else if (s[j] == '}') {
      if (--depth == 0) return j + 1;
    }
  }
  return std::string::npos;
}

ExtractedToolCalls Hermes(const std::string& text) {
  ExtractedToolCalls r;
  const size_t first = text.find(kToolCallStart);
  if (first == std::string::npos) {
    r.content = text;
    return r;
  }
  // <tool_call>(.*?)</tool_call>|<tool_call>(.*) over the whole text.
  size_t at = first;
  while (at != std::string::npos) {
    const size_t body = at + kToolCallStart.size();
    const size_t end = text.find(kToolCallEnd, body);
    const std::string_view call = end == std::string::npos
                                      ? std::string_view(text).substr(body)
                                      : std::string_view(text).substr(body, end - body);
    auto parsed = CallFromJson(call, /*parameters_too=*/false);
    if (!parsed) {
      r.calls.clear();
      r.content = text;
      return r;
    }
    r.calls.push_back(std::move(*parsed));
    if (end == std::string::npos) break;
    at = text.find(kToolCallStart, end + kToolCallEnd.size());
  }
  r.tools_called = true;
  if (first > 0) r.content = text.substr(0, first);
  return r;
}

ExtractedToolCalls Llama3Json(const std::string& text) {
  ExtractedToolCalls plain;
  plain.content = text;
  // (<|python_tag|> is a special token: skipped from the text the parser sees.)
  size_t start = std::string::npos, end = std::string::npos;
  for (size_t i = text.find('{'); i != std::string::npos; i = text.find('{', i + 1)) {
    end = MatchFlatObject(text, i);
    if (end != std::string::npos) {
      start = i;
      break;
    }
  }
  if (start == std::string::npos) return plain;
  // (?:\s*;\s*OBJ)*
  for (;;) {
    size_t k = end;
    while (k < text.size() && IsSpace(text[k])) ++k;
    if (k >= text.size() || text[k] != ';') break;
    ++k;
    while (k < text.size() && IsSpace(text[k])) ++k;
    const size_t next = MatchFlatObject(text, k);
    if (next == std::string::npos) break;
    end = next;
  }
  ExtractedToolCalls r;
  const std::string run = text.substr(start, end - start);
  size_t from = 0;
  while (from <= run.size()) {  // json_str.split(";"), each stripped, empty ones skipped
    size_t semi = run.find(';', from);
    if (semi == std::string::npos) semi = run.size();
    const std::string piece = Strip(std::string_view(run).substr(from, semi - from));
    from = semi + 1;
    if (piece.empty()) continue;
    auto call = CallFromJson(piece, /*parameters_too=*/true);
    if (!call) return plain;
    r.calls.push_back(std::move(*call));
  }
  r.tools_called = true;
  return r;
}

// The length of the longest suffix of `s` that is a proper prefix of `tag` (text to hold back:
// it may still become the tag).
size_t PartialTagSuffix(std::string_view s, std::string_view tag) {
  for (size_t n = std::min(s.size(), tag.size() - 1); n > 0; --n) {
    if (s.substr(s.size() - n) == tag.substr(0, n)) return n;
  }
  return 0;
}

}  // namespace

Result<ToolParserKind> ParseToolParserName(std::string_view name) {
  if (name.empty()) return ToolParserKind::kNone;
  if (name == "hermes") return ToolParserKind::kHermes;
  if (name == "llama3_json") return ToolParserKind::kLlama3Json;
  return InvalidArgumentError("--tool-call-parser " + std::string(name) +
                              ": supported are hermes and llama3_json");
}

Result<ReasoningParserKind> ParseReasoningParserName(std::string_view name) {
  if (name.empty()) return ReasoningParserKind::kNone;
  if (name == "qwen3") return ReasoningParserKind::kQwen3;
  if (name == "deepseek_r1") return ReasoningParserKind::kDeepSeekR1;
  return InvalidArgumentError("--reasoning-parser " + std::string(name) +
                              ": supported are qwen3 and deepseek_r1");
}

std::string PythonJsonDumps(const ojson& v) {
  std::string out;
  Dump(v, &out);
  return out;
}

ExtractedToolCalls ExtractToolCalls(ToolParserKind kind, const std::string& text) {
  switch (kind) {
    case ToolParserKind::kHermes:
      return Hermes(text);
    case ToolParserKind::kLlama3Json:
      return Llama3Json(text);
    case ToolParserKind::kNone:
      break;
  }
  ExtractedToolCalls r;
  r.content = text;
  return r;
}

std::pair<std::optional<std::string>, std::optional<std::string>> ExtractReasoning(
    ReasoningParserKind kind, const std::string& text) {
  auto opt = [](std::string s) -> std::optional<std::string> {
    if (s.empty()) return std::nullopt;
    return s;
  };
  switch (kind) {
    case ReasoningParserKind::kQwen3: {
      if (text.find(kThinkStart) == std::string::npos ||
          text.find(kThinkEnd) == std::string::npos) {
        return {std::nullopt, text};
      }
      const size_t s = text.find(kThinkStart);
      const std::string rest = text.substr(s + kThinkStart.size());
      const size_t e = rest.find(kThinkEnd);
      if (e == std::string::npos) return {std::nullopt, rest};  // </think> only before <think>
      return {rest.substr(0, e), opt(rest.substr(e + kThinkEnd.size()))};
    }
    case ReasoningParserKind::kDeepSeekR1: {
      const size_t s = text.find(kThinkStart);
      const std::string rest = s == std::string::npos ? text : text.substr(s + kThinkStart.size());
      const size_t e = rest.find(kThinkEnd);
      if (e == std::string::npos) return {rest, std::nullopt};
      return {rest.substr(0, e), opt(rest.substr(e + kThinkEnd.size()))};
    }
    case ReasoningParserKind::kNone:
      break;
  }
  return {std::nullopt, text};
}

StreamingReasoningParser::StreamingReasoningParser(ReasoningParserKind kind)
    : kind_(kind),
      phase_(kind == ReasoningParserKind::kDeepSeekR1 ? Phase::kReasoning : Phase::kBefore) {}

ChatDelta StreamingReasoningParser::Push(std::string_view text) {
  pending_.append(text);
  return Drain(false);
}

ChatDelta StreamingReasoningParser::Finish() { return Drain(true); }

ChatDelta StreamingReasoningParser::Drain(bool final) {
  ChatDelta d;
  if (kind_ == ReasoningParserKind::kNone) {
    d.content = std::move(pending_);
    pending_.clear();
    return d;
  }
  for (;;) {
    if (phase_ == Phase::kContent) {
      d.content += pending_;
      pending_.clear();
      return d;
    }
    const bool before = phase_ == Phase::kBefore;
    std::string& out = before ? d.content : d.reasoning;
    // deepseek_r1 drops one <think> inside its reasoning; qwen3 waits for <think> first.
    const bool look_start = before || (kind_ == ReasoningParserKind::kDeepSeekR1 && !saw_start_);
    const size_t end = before ? std::string::npos : pending_.find(kThinkEnd);
    const size_t start = look_start ? pending_.find(kThinkStart) : std::string::npos;
    if (start != std::string::npos && (end == std::string::npos || start < end)) {
      out += pending_.substr(0, start);
      pending_.erase(0, start + kThinkStart.size());
      saw_start_ = true;
      phase_ = Phase::kReasoning;
      continue;
    }
    if (end != std::string::npos) {
      out += pending_.substr(0, end);
      pending_.erase(0, end + kThinkEnd.size());
      phase_ = Phase::kContent;
      continue;
    }
    size_t hold = 0;
    if (!final) {
      if (look_start) hold = PartialTagSuffix(pending_, kThinkStart);
      if (!before) hold = std::max(hold, PartialTagSuffix(pending_, kThinkEnd));
    }
    out += pending_.substr(0, pending_.size() - hold);
    pending_.erase(0, pending_.size() - hold);
    return d;
  }
}

StreamingToolParser::StreamingToolParser(ToolParserKind kind, std::function<std::string()> make_id)
    : kind_(kind), make_id_(std::move(make_id)) {}

ChatDelta StreamingToolParser::Push(std::string_view text) {
  pending_.append(text);
  return Drain(false);
}

ChatDelta StreamingToolParser::Finish() { return Drain(true); }

void StreamingToolParser::EmitCall(const ParsedToolCall& call, ChatDelta* out) {
  out->tool_calls.push_back(nlohmann::json{{"index", num_calls_},
                                           {"id", make_id_()},
                                           {"type", "function"},
                                           {"function", {{"name", call.name}}}});
  out->tool_calls.push_back(
      nlohmann::json{{"index", num_calls_}, {"function", {{"arguments", call.arguments}}}});
  ++num_calls_;
}

ChatDelta StreamingToolParser::Drain(bool final) {
  ChatDelta d;
  switch (kind_) {
    case ToolParserKind::kNone:
      d.content = std::move(pending_);
      pending_.clear();
      return d;
    case ToolParserKind::kLlama3Json: {
      if (decided_ < 0 && !pending_.empty()) decided_ = pending_[0] == '{' ? 1 : 0;
      if (decided_ == 0) {
        d.content = std::move(pending_);
        pending_.clear();
      } else if (decided_ == 1 && final) {
        ExtractedToolCalls t = ExtractToolCalls(kind_, pending_);
        if (t.tools_called) {
          for (const ParsedToolCall& c : t.calls) EmitCall(c, &d);
        } else {
          d.content = pending_;
        }
        pending_.clear();
      }
      return d;
    }
    case ToolParserKind::kHermes:
      break;
  }
  for (;;) {
    if (!in_call_) {
      const size_t s = pending_.find(kToolCallStart);
      if (s != std::string::npos) {
        d.content += pending_.substr(0, s);
        pending_.erase(0, s + kToolCallStart.size());
        in_call_ = true;
        continue;
      }
      const size_t hold = final ? 0 : PartialTagSuffix(pending_, kToolCallStart);
      d.content += pending_.substr(0, pending_.size() - hold);
      pending_.erase(0, pending_.size() - hold);
      return d;
    }
    const size_t e = pending_.find(kToolCallEnd);
    if (e == std::string::npos && !final) return d;
    const std::string body = e == std::string::npos ? pending_ : pending_.substr(0, e);
    auto call = CallFromJson(body, /*parameters_too=*/false);
    if (call) {
      EmitCall(*call, &d);
    } else {  // malformed: the text as it came
      d.content += std::string(kToolCallStart) + body +
                   (e == std::string::npos ? "" : std::string(kToolCallEnd));
    }
    pending_.erase(0, e == std::string::npos ? pending_.size() : e + kToolCallEnd.size());
    in_call_ = false;
    if (final && pending_.empty()) return d;
  }
}

std::string MakeToolCallId() {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[33];
  const uint64_t a = rng(), b = rng();
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(a),
                static_cast<unsigned long long>(b));
  return "chatcmpl-tool-" + std::string(buf);
}

}  // namespace kvbridge::server
