// The tool-call and reasoning parsers on fixed model outputs, whole and streamed, against the
// values vLLM's parsers give (hermes, llama3_json, qwen3, deepseek_r1).
#include "server/chat_parsers.h"

#include <gtest/gtest.h>

namespace kvbridge::server {
namespace {

using nlohmann::json;

TEST(PythonJsonDumps, WritesAsJsonDumpsEnsureAsciiFalse) {
  const auto v = nlohmann::ordered_json::parse(
      R"({"b": "é\n\"q\"\u0001", "a": [1.0, -2, 1e20, 0.5, {}, [], true], "c": null})");
  EXPECT_EQ(PythonJsonDumps(v),
            "{\"b\": \"é\\n\\\"q\\\"\\u0001\", \"a\": [1.0, -2, 1e+20, 0.5, {}, [], true], "
            "\"c\": null}");
}

TEST(ToolParsers, HermesWholeAnswers) {
  // Content before the call, arguments re-dumped as Python does (key order kept, non-ASCII raw).
  auto t =
      ExtractToolCalls(ToolParserKind::kHermes,
                       "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                       "{\"city\":\"Paris\",\"unit\":\"°C\"}}\n</tool_call>");
  ASSERT_TRUE(t.tools_called);
  ASSERT_EQ(t.calls.size(), 1u);
  EXPECT_EQ(t.calls[0].name, "get_weather");
  EXPECT_EQ(t.calls[0].arguments, "{\"city\": \"Paris\", \"unit\": \"°C\"}");
  EXPECT_EQ(t.content, "Let me check.\n");
  // Two calls, the last unterminated; nothing before them: content null.
  t = ExtractToolCalls(ToolParserKind::kHermes,
                       "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call>\n<tool_call>"
                       "{\"name\":\"b\",\"arguments\":{\"x\":[1,2.5,null,true]}}");
  ASSERT_TRUE(t.tools_called);
  ASSERT_EQ(t.calls.size(), 2u);
  EXPECT_EQ(t.calls[0].name, "a");
  EXPECT_EQ(t.calls[0].arguments, "{}");
  EXPECT_EQ(t.calls[1].arguments, "{\"x\": [1, 2.5, null, true]}");
  EXPECT_FALSE(t.content);
  // Malformed: the whole text is the content, no calls (vLLM's fallback).
  for (const char* bad :
       {"<tool_call>{\"name\": \"a\", \"arguments\": }</tool_call>",
        "ok <tool_call>{\"name\": \"a\"}</tool_call>", "<tool_call>[1]</tool_call>",
        "<tool_call>{\"name\": 5, \"arguments\": {}}</tool_call>",
        "<tool_call>{\"name\":\"a\",\"arguments\":{}}</tool_call><tool_call>oops</tool_call>"}) {
    t = ExtractToolCalls(ToolParserKind::kHermes, bad);
    EXPECT_FALSE(t.tools_called) << bad;
    EXPECT_TRUE(t.calls.empty()) << bad;
    EXPECT_EQ(t.content, bad);
  }
  t = ExtractToolCalls(ToolParserKind::kHermes, "plain text");
  EXPECT_FALSE(t.tools_called);
  EXPECT_EQ(t.content, "plain text");
}

TEST(ToolParsers, Llama3JsonWholeAnswers) {
  auto t = ExtractToolCalls(ToolParserKind::kLlama3Json,
                            "{\"name\": \"f\", \"parameters\": {\"q\": \"x\"}}");
  ASSERT_TRUE(t.tools_called);
  ASSERT_EQ(t.calls.size(), 1u);
  EXPECT_EQ(t.calls[0].name, "f");
  EXPECT_EQ(t.calls[0].arguments, "{\"q\": \"x\"}");
  EXPECT_FALSE(t.content);
  // Several, ';'-separated; text around them is dropped (content null).
  t = ExtractToolCalls(
      ToolParserKind::kLlama3Json,
      "Calling: {\"name\": \"f\", \"arguments\": {\"a\": 1}} ; {\"name\":\"g\",\"parameters\":{}}"
      " done");
  ASSERT_TRUE(t.tools_called);
  ASSERT_EQ(t.calls.size(), 2u);
  EXPECT_EQ(t.calls[0].arguments, "{\"a\": 1}");
  EXPECT_EQ(t.calls[1].name, "g");
  EXPECT_EQ(t.calls[1].arguments, "{}");
  EXPECT_FALSE(t.content);
  // vLLM's pattern nests one level: here it matches only {"b": {}}, which has no name: content.
  for (const char* bad :
       {"Sure: {\"name\": \"f\", \"arguments\": {\"a\": {\"b\": {}}}}", "no json here",
        "{not json}", "{\"name\": \"f\"}", "{\"name\": \"f\", \"arguments\": {\"s\": \"a;b\"}}"}) {
    t = ExtractToolCalls(ToolParserKind::kLlama3Json, bad);
    EXPECT_FALSE(t.tools_called) << bad;
    EXPECT_EQ(t.content, bad);
  }
}

// Feeds `text` in pieces of `step` bytes, then finishes; returns the joined deltas.
ChatDelta StreamTools(ToolParserKind kind, const std::string& text, size_t step, bool* called) {
  int next_id = 0;
  StreamingToolParser p(kind, [&] { return "id" + std::to_string(next_id++); });
  ChatDelta all;
  auto add = [&](ChatDelta d) {
    all.content += d.content;
    for (json& tc : d.tool_calls) all.tool_calls.push_back(std::move(tc));
  };
  for (size_t i = 0; i < text.size(); i += step) add(p.Push(text.substr(i, step)));
  add(p.Finish());
  *called = p.tools_called();
  return all;
}

TEST(ToolParsers, StreamsGiveTheWholeAnswersCallsAndText) {
  const std::string text =
      "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
      "{\"city\":\"Paris\"}}\n</tool_call>\n<tool_call>{\"name\":\"t\",\"arguments\":{}}";
  for (size_t step : {1, 3, 1000}) {
    SCOPED_TRACE(step);
    bool called = false;
    ChatDelta d = StreamTools(ToolParserKind::kHermes, text, step, &called);
    EXPECT_TRUE(called);
    EXPECT_EQ(d.content, "Let me check.\n\n");  // vLLM streams text between calls too
    ASSERT_EQ(d.tool_calls.size(), 4u);
    EXPECT_EQ(d.tool_calls[0], json::parse(R"({"index": 0, "id": "id0", "type": "function",
                                                "function": {"name": "get_weather"}})"));
    EXPECT_EQ(d.tool_calls[1],
              json::parse(R"({"index": 0, "function": {"arguments": "{\"city\": \"Paris\"}"}})"));
    EXPECT_EQ(d.tool_calls[2]["index"], 1);
    EXPECT_EQ(d.tool_calls[2]["function"]["name"], "t");
    EXPECT_EQ(d.tool_calls[3]["function"]["arguments"], "{}");
    // A malformed call streams as the text it was.
    const std::string bad = "a <tool_c <tool_call>{\"name\": oops}</tool_call> z";
    d = StreamTools(ToolParserKind::kHermes, bad, step, &called);
    EXPECT_FALSE(called);
    EXPECT_EQ(d.content, bad);
    EXPECT_TRUE(d.tool_calls.empty());
    // llama3_json: held to the end when it starts with '{'; other text streams as content.
    d = StreamTools(ToolParserKind::kLlama3Json,
                    "{\"name\": \"f\", \"parameters\": {\"q\": 1}}; {\"name\": \"g\", "
                    "\"arguments\": {}}",
                    step, &called);
    EXPECT_TRUE(called);
    EXPECT_EQ(d.content, "");
    ASSERT_EQ(d.tool_calls.size(), 4u);
    EXPECT_EQ(d.tool_calls[1]["function"]["arguments"], "{\"q\": 1}");
    EXPECT_EQ(d.tool_calls[2]["function"]["name"], "g");
    d = StreamTools(ToolParserKind::kLlama3Json, "{\"a\": }", step, &called);
    EXPECT_FALSE(called);
    EXPECT_EQ(d.content, "{\"a\": }");
    d = StreamTools(ToolParserKind::kLlama3Json, "Hi {\"name\": \"f\", \"arguments\": {}}", step,
                    &called);
    EXPECT_FALSE(called);
    EXPECT_EQ(d.content, "Hi {\"name\": \"f\", \"arguments\": {}}");
  }
  const std::string id = MakeToolCallId();
  EXPECT_EQ(id.rfind("chatcmpl-tool-", 0), 0u);
  EXPECT_EQ(id.size(), 14u + 32u);
  EXPECT_NE(id, MakeToolCallId());
}

TEST(ReasoningParsers, WholeAnswersAsVllm) {
  using R = std::pair<std::optional<std::string>, std::optional<std::string>>;
  const auto q = ReasoningParserKind::kQwen3;
  EXPECT_EQ(ExtractReasoning(q, "<think>\nplan\n</think>\n\nanswer"), R("\nplan\n", "\n\nanswer"));
  EXPECT_EQ(ExtractReasoning(q, "<think>plan</think>"), R("plan", std::nullopt));
  EXPECT_EQ(ExtractReasoning(q, "no tags"), R(std::nullopt, "no tags"));
  EXPECT_EQ(ExtractReasoning(q, "<think>unfinished"), R(std::nullopt, "<think>unfinished"));
  EXPECT_EQ(ExtractReasoning(q, "plan</think>x"), R(std::nullopt, "plan</think>x"));
  EXPECT_EQ(ExtractReasoning(q, "pre<think>r</think>c"), R("r", "c"));
  const auto d = ReasoningParserKind::kDeepSeekR1;
  EXPECT_EQ(ExtractReasoning(d, "plan</think>ans"), R("plan", "ans"));
  EXPECT_EQ(ExtractReasoning(d, "<think>p</think>"), R("p", std::nullopt));
  EXPECT_EQ(ExtractReasoning(d, "just thinking"), R("just thinking", std::nullopt));
  EXPECT_EQ(ExtractReasoning(ReasoningParserKind::kNone, "<think>x</think>"),
            R(std::nullopt, "<think>x</think>"));
}

TEST(ReasoningParsers, StreamsSplitAtTheTagsWhereverThePiecesEnd) {
  struct Case {
    ReasoningParserKind kind;
    std::string text, reasoning, content;
  };
  const Case cases[] = {
      {ReasoningParserKind::kQwen3, "<think>\nplan\n</think>\n\nanswer", "\nplan\n", "\n\nanswer"},
      {ReasoningParserKind::kQwen3, "hi <think>r</think>c", "r", "hi c"},
      {ReasoningParserKind::kQwen3, "no tags < at all <th", "", "no tags < at all <th"},
      {ReasoningParserKind::kQwen3, "<think>cut off </thi", "cut off </thi", ""},
      {ReasoningParserKind::kDeepSeekR1, "<think>p</think>c", "p", "c"},
      {ReasoningParserKind::kDeepSeekR1, "p2</think>c2</think>", "p2", "c2</think>"},
  };
  for (const Case& c : cases) {
    for (size_t step : {1, 2, 5, 1000}) {
      SCOPED_TRACE(c.text + " / " + std::to_string(step));
      StreamingReasoningParser p(c.kind);
      std::string reasoning, content;
      for (size_t i = 0; i < c.text.size(); i += step) {
        ChatDelta d = p.Push(c.text.substr(i, step));
        reasoning += d.reasoning;
        content += d.content;
      }
      ChatDelta d = p.Finish();
      reasoning += d.reasoning;
      content += d.content;
      EXPECT_EQ(reasoning, c.reasoning);
      EXPECT_EQ(content, c.content);
    }
  }
}

TEST(ParserNames, AsVllmNamesThem) {
  EXPECT_EQ(*ParseToolParserName("hermes"), ToolParserKind::kHermes);
  EXPECT_EQ(*ParseToolParserName("llama3_json"), ToolParserKind::kLlama3Json);
  EXPECT_EQ(*ParseToolParserName(""), ToolParserKind::kNone);
  EXPECT_EQ(ParseToolParserName("mistral").status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(*ParseReasoningParserName("qwen3"), ReasoningParserKind::kQwen3);
  EXPECT_EQ(*ParseReasoningParserName("deepseek_r1"), ReasoningParserKind::kDeepSeekR1);
  EXPECT_NE(ParseReasoningParserName("granite").status().message().find("qwen3"),
            std::string::npos);
}

}  // namespace
}  // namespace kvbridge::server
