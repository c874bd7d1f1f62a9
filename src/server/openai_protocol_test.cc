#include "server/openai_protocol.h"

#include <gtest/gtest.h>

#include "server/fake_engine.h"

namespace kvbridge::server {
namespace {

using nlohmann::json;
using testing::ByteCodec;

ProtocolLimits Limits(int max_model_len = 64) {
  return ProtocolLimits{"tiny", max_model_len, 16, 5};
}

std::optional<ApiError> ParseC(const std::string& body, ParsedRequest* out, int max_len = 64) {
  const Tokenizer codec = ByteCodec::Make();
  return ParseCompletionRequest(json::parse(body), codec, Limits(max_len), out);
}

TEST(ParseCompletion, StringPromptAndSampling) {
  ParsedRequest r;
  ASSERT_FALSE(ParseC(R"({"model":"tiny","prompt":"hi","n":3,"max_tokens":5,"temperature":0.5,
      "top_p":0.9,"top_k":7,"seed":42,"stop":["x","yz"],"logprobs":2,"min_tokens":1,
      "ignore_eos":true})",
                      &r));
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0], (std::vector<int32_t>{'h', 'i'}));
  EXPECT_EQ(r.sampling.n, 3);
  EXPECT_EQ(r.sampling.max_tokens, 5);
  EXPECT_FLOAT_EQ(r.sampling.temperature, 0.5f);
  EXPECT_FLOAT_EQ(r.sampling.top_p, 0.9f);
  EXPECT_EQ(r.sampling.top_k, 7);
  EXPECT_EQ(r.sampling.seed, std::optional<uint64_t>(42));
  EXPECT_EQ(r.sampling.stop, (std::vector<std::string>{"x", "yz"}));
  EXPECT_EQ(r.sampling.logprobs, 2);
  EXPECT_EQ(r.sampling.min_tokens, 1);
  EXPECT_TRUE(r.sampling.ignore_eos);
  EXPECT_FALSE(r.stream);
}

TEST(ParseCompletion, PromptShapes) {
  ParsedRequest r;
  ASSERT_FALSE(ParseC(R"({"prompt":[1,2,3]})", &r));
  ASSERT_EQ(r.prompts.size(), 1u);
  EXPECT_EQ(r.prompts[0], (std::vector<int32_t>{1, 2, 3}));
  ASSERT_FALSE(ParseC(R"({"prompt":["ab","c"]})", &r));
  ASSERT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(r.prompts[1], (std::vector<int32_t>{'c'}));
  ASSERT_FALSE(ParseC(R"({"prompt":[[5,6],[7]]})", &r));
  ASSERT_EQ(r.prompts.size(), 2u);
  EXPECT_EQ(r.prompts[0], (std::vector<int32_t>{5, 6}));
  EXPECT_EQ(r.sampling.max_tokens, 16);  // OpenAI default
}

TEST(ParseCompletion, TruncateKeepsLastTokens) {
  ParsedRequest r;
  ASSERT_FALSE(ParseC(R"({"prompt":"abcdef","truncate_prompt_tokens":2})", &r));
  EXPECT_EQ(r.prompts[0], (std::vector<int32_t>{'e', 'f'}));
  // Truncation happens before the length check: a long prompt fits after it.
  ASSERT_FALSE(
      ParseC(R"({"prompt":")" + std::string(100, 'a') + R"(","truncate_prompt_tokens":10})", &r));
  EXPECT_EQ(r.prompts[0].size(), 10u);
}

TEST(ParseCompletion, DefaultMaxTokensFitsTheContext) {
  ParsedRequest r;
  ASSERT_FALSE(ParseC(R"({"prompt":")" + std::string(60, 'a') + R"("})", &r));
  EXPECT_EQ(r.sampling.max_tokens, 4);
}

TEST(ParseCompletion, StreamOptions) {
  ParsedRequest r;
  ASSERT_FALSE(
      ParseC(R"({"prompt":"a","stream":true,"stream_options":{"include_usage":true}})", &r));
  EXPECT_TRUE(r.stream);
  EXPECT_TRUE(r.include_usage);
  auto e = ParseC(R"({"prompt":"a","stream_options":{"include_usage":true}})", &r);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->param, "stream_options");
}

struct BadCase {
  std::string body;
  int status;
  std::string param;
};

TEST(ParseCompletion, RejectsBadInput) {
  const std::vector<BadCase> cases = {
      {R"([1,2])", 400, ""},
      {R"({"prompt":"a","model":"gpt-4"})", 404, "model"},
      {R"({"prompt":"a","model":7})", 400, "model"},
      {R"({})", 400, "prompt"},
      {R"({"prompt":5})", 400, "prompt"},
      {R"({"prompt":[]})", 400, "prompt"},
      {R"({"prompt":[1,"a"]})", 400, "prompt"},
      {R"({"prompt":[1,999]})", 400, "prompt"},
      {R"({"prompt":[-1]})", 400, "prompt"},
      {R"({"prompt":[[]]})", 400, "prompt"},
      {R"({"prompt":"a","n":0})", 400, "n"},
      {R"({"prompt":"a","n":17})", 400, "n"},
      {R"({"prompt":"a","n":"2"})", 400, "n"},
      {R"({"prompt":"a","n":1.5})", 400, "n"},
      {R"({"prompt":["a","b"],"n":9})", 400, "n"},
      {R"({"prompt":"a","max_tokens":0})", 400, "max_tokens"},
      {R"({"prompt":"a","max_tokens":-3})", 400, "max_tokens"},
      {R"({"prompt":"a","max_tokens":"5"})", 400, "max_tokens"},
      {R"({"prompt":"a","max_tokens":64})", 400, "max_tokens"},
      {R"({"prompt":")" + std::string(65, 'a') + R"("})", 400, "prompt"},
      {R"({"prompt":")" + std::string(64, 'a') + R"("})", 400, "prompt"},
      {R"({"prompt":"a","temperature":-0.1})", 400, "temperature"},
      {R"({"prompt":"a","temperature":"hot"})", 400, "temperature"},
      {R"({"prompt":"a","top_p":0})", 400, "top_p"},
      {R"({"prompt":"a","top_p":1.5})", 400, "top_p"},
      {R"({"prompt":"a","top_k":-2})", 400, "top_k"},
      {R"({"prompt":"a","stop":5})", 400, "stop"},
      {R"({"prompt":"a","stop":["a",1]})", 400, "stop"},
      {R"({"prompt":"a","stop":{"s":1}})", 400, "stop"},
      {R"({"prompt":"a","stop":[null]})", 400, "stop"},
      {R"({"prompt":"a","stop":")" + std::string(kMaxStopStringBytes + 1, 'x') + R"("})", 400,
       "stop"},
      {R"({"prompt":"a","stop":[)" +
           [] {
             std::string l;
             for (size_t i = 0; i <= kMaxStopStrings; ++i)
               l += (i ? ",\"s" : "\"s") + std::to_string(i) + "\"";
             return l;
           }() +
           "]}",
       400, "stop"},
      {R"({"prompt":"a","stop_token_ids":[-1]})", 400, "stop_token_ids"},
      {R"({"prompt":"a","stop_token_ids":[1.5]})", 400, "stop_token_ids"},
      {R"({"prompt":"a","stop_token_ids":5})", 400, "stop_token_ids"},
      {R"({"prompt":"a","include_stop_str_in_output":"yes"})", 400, "include_stop_str_in_output"},
      {R"({"prompt":"a","logprobs":6})", 400, "logprobs"},
      {R"({"prompt":"a","logprobs":true})", 400, "logprobs"},
      {R"({"prompt":"a","stream":"yes"})", 400, "stream"},
      {R"({"prompt":"a","truncate_prompt_tokens":0})", 400, "truncate_prompt_tokens"},
      {R"({"prompt":"a","max_tokens":4,"min_tokens":5})", 400, "min_tokens"},
      {R"({"prompt":"a","presence_penalty":0.5})", 400, "presence_penalty"},
      {R"({"prompt":"a","echo":true})", 400, "echo"},
      {R"({"prompt":"a","kv_transfer_params":[1]})", 400, "kv_transfer_params"},
      {R"({"prompt":["a","b"],"kv_transfer_params":{}})", 400, "kv_transfer_params"},
  };
  for (const BadCase& c : cases) {
    ParsedRequest r;
    auto e = ParseC(c.body, &r);
    ASSERT_TRUE(e.has_value()) << c.body;
    EXPECT_EQ(e->status, c.status) << c.body;
    EXPECT_EQ(e->param, c.param) << c.body;
    EXPECT_FALSE(e->message.empty());
  }
}

TEST(ParseChat, TemplateAndLogprobs) {
  const Tokenizer codec = ByteCodec::Make();
  ParsedRequest r;
  auto body = json::parse(R"({"messages":[{"role":"system","content":"S"},
      {"role":"user","content":[{"type":"text","text":"Hi"}]}],"logprobs":true,"top_logprobs":3,
      "max_completion_tokens":4})");
  ASSERT_FALSE(ParseChatRequest(body, codec, Limits(), &r));
  EXPECT_EQ(codec.Decode(r.prompts[0]), "<|system|>\nS\n<|user|>\nHi\n<|assistant|>\n");
  EXPECT_EQ(r.sampling.logprobs, 3);
  EXPECT_EQ(r.sampling.max_tokens, 4);
  // Default max_tokens: the rest of the context.
  ASSERT_FALSE(ParseChatRequest(json::parse(R"({"messages":[{"role":"user","content":"a"}]})"),
                                codec, Limits(), &r));
  EXPECT_EQ(r.sampling.max_tokens, 64 - static_cast<int>(r.prompts[0].size()));
  EXPECT_EQ(r.sampling.logprobs, -1);
}

// A checkpoint's template: rendered with messages, tools, add_generation_prompt, the special
// tokens and chat_template_kwargs; encoded without special tokens; raise_exception is a 400.
TEST(ParseChat, CheckpointTemplate) {
  const Tokenizer codec = ByteCodec::Make();
  auto t = ChatTemplate::Parse(
      "{{ bos_token }}{% for m in messages %}[{{ m.role }}:{{ m.content }}"
      "{% if m.tool_calls %}{{ m.tool_calls[0].function.arguments | tojson }}{% endif %}]"
      "{% endfor %}{% if tools %}T={{ tools | tojson }}{% endif %}"
      "{% if flavor is defined %}F={{ flavor }}{% endif %}"
      "{% if add_generation_prompt %}>{% endif %}"
      "{% if messages[0].role == 'bad' %}{{ raise_exception('no bad roles') }}{% endif %}",
      "test");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  ChatTemplates templates;
  templates.templates.emplace_back("default", *t);
  templates.special_tokens = {{"bos_token", "<s>"}};
  ProtocolLimits limits = Limits(256);
  limits.chat_templates = &templates;
  auto render = [&](const std::string& body) {
    ParsedRequest r;
    auto e = ParseChatRequest(json::parse(body), codec, limits, &r,
                              nullptr);  // key order from the sorted json
    EXPECT_FALSE(e) << body << ": " << (e ? e->message : "");
    return e ? std::string() : codec.Decode(r.prompts[0]);
  };
  EXPECT_EQ(render(R"({"messages":[{"role":"system","content":"S"},
      {"role":"user","content":[{"type":"text","text":"a"},{"type":"text","text":"b"}]}]})"),
            "<s>[system:S][user:a\nb]>");
  EXPECT_EQ(render(R"({"messages":[{"role":"user","content":"q"}],"add_generation_prompt":false,
      "chat_template_kwargs":{"flavor":"x"}})"),
            "<s>[user:q]F=x");
  EXPECT_EQ(render(R"({"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"c",
      "type":"function","function":{"name":"f","arguments":"{\"k\": 1}"}}]},
      {"role":"tool","content":"r","tool_call_id":"c"}],"tool_choice":"none","tools":[{"type":"function",
      "function":{"name":"f"}}]})"),
            "<s>[assistant:{\"k\": 1}][tool:r]T=[{\"function\": {\"name\": \"f\"}, \"type\": "
            "\"function\"}]>");
  // The template writes BOS; add_special_tokens stays false unless asked.
  ParsedRequest r;
  ASSERT_FALSE(ParseChatRequest(json::parse(R"({"messages":[{"role":"user","content":"q"}]})"),
                                codec, limits, &r));
  EXPECT_EQ(r.prompts[0].size(), std::string("<s>[user:q]>").size());
  // The request's key order reaches tojson when the ordered body is given.
  const std::string ordered_body =
      R"({"messages":[{"role":"user","content":"q"}],"tools":[{"type":"function","function":{"name":"f"}}],"tool_choice":"none"})";
  const auto ordered = nlohmann::ordered_json::parse(ordered_body);
  ASSERT_FALSE(ParseChatRequest(json::parse(ordered_body), codec, limits, &r, &ordered));
  EXPECT_EQ(codec.Decode(r.prompts[0]),
            "<s>[user:q]T=[{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]>");
  // raise_exception: a 400 with the template's message.
  auto t2 = ChatTemplate::Parse("{{ raise_exception('Conversation roles must alternate') }}", "t2");
  ASSERT_TRUE(t2.ok());
  templates.templates[0].second = *t2;
  auto e = ParseChatRequest(json::parse(R"({"messages":[{"role":"user","content":"q"}]})"), codec,
                            limits, &r);
  ASSERT_TRUE(e);
  EXPECT_EQ(e->status, 400);
  EXPECT_EQ(e->message, "Conversation roles must alternate");
  // /tokenize's chat form gives the same ids.
  templates.templates[0].second = *t;
  json tok_out;
  ASSERT_FALSE(Tokenize(json::parse(R"({"messages":[{"role":"user","content":"q"}]})"), codec,
                        limits, &tok_out));
  EXPECT_EQ(tok_out["count"], std::string("<s>[user:q]>").size());
}

TEST(ParseChat, RejectsBadMessages) {
  const Tokenizer codec = ByteCodec::Make();
  for (const char* body :
       {R"({"messages":[]})", R"({"messages":"hi"})", R"({"messages":[{"content":"x"}]})",
        R"({"messages":[{"role":"wizard","content":"x"}]})",
        R"({"messages":[{"role":"user","content":5}]})",
        R"({"messages":[{"role":"user","content":"x"}],"top_logprobs":2})"}) {
    ParsedRequest r;
    auto e = ParseChatRequest(json::parse(body), codec, Limits(), &r);
    ASSERT_TRUE(e.has_value()) << body;
    EXPECT_EQ(e->status, 400) << body;
  }
}

TEST(Utf8, LengthCountsCharactersAsPython) {
  EXPECT_EQ(Utf8Length(""), 0u);
  EXPECT_EQ(Utf8Length("abc"), 3u);
  EXPECT_EQ(Utf8Length("ab\xC3\xA9"), 3u);                    // "abé"
  EXPECT_EQ(Utf8Length("\xE2\x82\xAC\xF0\x9F\x98\x80"), 2u);  // "€😀"
  EXPECT_EQ(Utf8Length("\xEF\xBF\xBD"), 1u);                  // U+FFFD
  EXPECT_EQ(Utf8Length("a\xE2\x82"), 3u);  // an incomplete sequence: one per byte
  EXPECT_EQ(Utf8Length("a\x80"), 2u);      // a stray continuation byte
}

TEST(Utf8, DumpReplacesInvalidBytes) {
  EXPECT_EQ(DumpJson(json{{"t", std::string("a\xFF")}}), "{\"t\":\"a\xEF\xBF\xBD\"}");
  const Tokenizer codec = ByteCodec::Make();
  EXPECT_EQ(TokenDisplayText(codec, 0xFF), "bytes:\\xff");
  EXPECT_EQ(TokenDisplayText(codec, 'q'), "q");
}

RequestOutput Out(std::vector<CompletionOutput> outs, bool finished, int cached = 0) {
  RequestOutput o;
  o.outputs = std::move(outs);
  o.finished = finished;
  o.num_prompt_tokens = 3;
  o.num_cached_tokens = cached;
  return o;
}

TEST(ResponseBuilder, CompletionBodyWithLogprobsAndUsage) {
  const Tokenizer codec = ByteCodec::Make();
  ParsedRequest r;
  ASSERT_FALSE(ParseC(R"({"prompt":["abc","xyz"],"n":2,"logprobs":1})", &r));
  ResponseBuilder b(r, codec, "cmpl-1", "tiny", 100);
  auto lp = [](int32_t t) { return TokenLogprob{t, -1.0f, {{'z', -0.25f}}}; };
  b.Apply(0, Out({{0, {'h'}, {lp('h')}, false, ""}, {1, {'o'}, {lp('o')}, false, ""}}, false, 2));
  b.Apply(0, Out({{0, {'i'}, {lp('i')}, true, "length"}, {1, {}, {}, true, "stop"}}, true, 2));
  EXPECT_FALSE(b.AllFinished());
  b.Apply(
      1, Out({{0, {'q'}, {lp('q')}, true, "length"}, {1, {'r'}, {lp('r')}, true, "length"}}, true));
  ASSERT_TRUE(b.AllFinished());
  json body = b.FinalBody();
  EXPECT_EQ(body["object"], "text_completion");
  ASSERT_EQ(body["choices"].size(), 4u);
  EXPECT_EQ(body["choices"][0]["text"], "hi");
  EXPECT_EQ(body["choices"][1]["text"], "o");
  EXPECT_EQ(body["choices"][1]["finish_reason"], "stop");
  EXPECT_EQ(body["choices"][2]["index"], 2);
  EXPECT_EQ(body["choices"][2]["text"], "q");
  const json& l0 = body["choices"][0]["logprobs"];
  EXPECT_EQ(l0["tokens"], json::array({"h", "i"}));
  EXPECT_EQ(l0["token_logprobs"], json::array({-1.0, -1.0}));
  EXPECT_EQ(l0["top_logprobs"][0], json({{"z", -0.25}, {"h", -1.0}}));
  EXPECT_EQ(l0["text_offset"], json::array({0, 1}));
  EXPECT_EQ(body["usage"]["prompt_tokens"], 6);
  EXPECT_EQ(body["usage"]["completion_tokens"], 5);
  EXPECT_EQ(body["usage"]["total_tokens"], 11);
  EXPECT_EQ(body["usage"]["prompt_tokens_details"]["cached_tokens"], 2);
  EXPECT_FALSE(body.contains("kv_transfer_params"));
}

// The engine's stop results (CompletionOutput::stop_reason, text_len, text_tokens) shape the
// text whole and streamed alike; every id counts in usage.
TEST(ResponseBuilder, StopStringCutAndStopTokenTextAsVllm) {
  const Tokenizer codec = ByteCodec::Make();
  for (bool stream : {false, true}) {
    SCOPED_TRACE(stream);
    ParsedRequest r;
    ASSERT_FALSE(
        ParseC(stream ? R"({"prompt":"p","n":2,"stream":true})" : R"({"prompt":"p","n":2})", &r));
    ResponseBuilder b(r, codec, "cmpl-1", "tiny", 100);
    // Choice 0: "ab" streamed, then "cXYd" finishes on the stop string "XY" at byte 3.
    // Choice 1: "ab" then the stop token '!' (its text dropped: text_tokens 2).
    b.Apply(0, Out({{0, {'a', 'b'}, {}, false, ""}, {1, {'a', 'b'}, {}, false, ""}}, false));
    std::string frames = b.TakeStreamFrames();
    CompletionOutput c0{0, {'c', 'X', 'Y', 'd'}, {}, true, "stop"};
    c0.stop_reason = "XY";
    c0.text_len = 3;
    CompletionOutput c1{1, {'!'}, {}, true, "stop"};
    c1.stop_reason = '!';
    c1.text_tokens = 2;
    b.Apply(0, Out({c0, c1}, true));
    frames += b.TakeStreamFrames();
    if (!stream) {
      json body = b.FinalBody();
      EXPECT_EQ(body["choices"][0]["text"], "abc");
      EXPECT_EQ(body["choices"][0]["stop_reason"], "XY");
      EXPECT_EQ(body["choices"][1]["text"], "ab");
      EXPECT_EQ(body["choices"][1]["stop_reason"], '!');
      EXPECT_EQ(body["usage"]["completion_tokens"], 9);
      continue;
    }
    std::string text[2];
    json last[2];
    size_t pos = 0;
    while ((pos = frames.find("data: ", pos)) != std::string::npos) {
      const size_t end = frames.find("\n\n", pos);
      const std::string payload = frames.substr(pos + 6, end - pos - 6);
      pos = end;
      if (payload == "[DONE]") continue;
      const json c = json::parse(payload)["choices"][0];
      text[c["index"].get<int>()] += c["text"].get<std::string>();
      last[c["index"].get<int>()] = c;
    }
    EXPECT_EQ(text[0], "abc");
    EXPECT_EQ(text[1], "ab");
    EXPECT_EQ(last[0]["stop_reason"], "XY");
    EXPECT_EQ(last[0]["finish_reason"], "stop");
    EXPECT_EQ(last[1]["stop_reason"], '!');
  }
}

TEST(ResponseBuilder, ChatStreamFramesEndWithDone) {
  const Tokenizer codec = ByteCodec::Make();
  ParsedRequest r;
  ASSERT_FALSE(
      ParseChatRequest(json::parse(R"({"messages":[{"role":"user","content":"a"}],"stream":true,
          "stream_options":{"include_usage":true},"max_tokens":5})"),
                       codec, Limits(), &r));
  ResponseBuilder b(r, codec, "chatcmpl-1", "tiny", 100);
  // "é" is two bytes: the first byte alone must be held back.
  b.Apply(0, Out({{0, {'o', 0xC3}, {}, false, ""}}, false));
  std::string f1 = b.TakeStreamFrames();
  b.Apply(0, Out({{0, {0xA9}, {}, true, "stop"}}, true));
  std::string f2 = b.TakeStreamFrames();
  EXPECT_TRUE(b.StreamDone());
  EXPECT_EQ(b.TakeStreamFrames(), "");
  std::vector<json> chunks;
  std::string all = f1 + f2;
  size_t pos = 0;
  while ((pos = all.find("data: ", pos)) != std::string::npos) {
    size_t end = all.find("\n\n", pos);
    std::string payload = all.substr(pos + 6, end - pos - 6);
    if (payload != "[DONE]") chunks.push_back(json::parse(payload));
    pos = end;
  }
  EXPECT_EQ(all.substr(all.size() - 14), "data: [DONE]\n\n");
  ASSERT_EQ(chunks.size(), 4u);
  EXPECT_EQ(chunks[0]["choices"][0]["delta"], json({{"role", "assistant"}, {"content", ""}}));
  EXPECT_EQ(chunks[1]["choices"][0]["delta"]["content"], "o");
  EXPECT_EQ(chunks[2]["choices"][0]["delta"]["content"], "\xC3\xA9");
  EXPECT_EQ(chunks[2]["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(chunks[2]["object"], "chat.completion.chunk");
  EXPECT_TRUE(chunks[2]["usage"].is_null());
  EXPECT_TRUE(chunks[3]["choices"].empty());
  EXPECT_EQ(chunks[3]["usage"]["completion_tokens"], 3);
}

}  // namespace
}  // namespace kvbridge::server
