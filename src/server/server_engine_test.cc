// The HTTP layer in front of the real engine and the tiny random-weight model, in process.
#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <chrono>
#include <thread>

#include "kvbridge/common/metrics.h"
#include "kvbridge/engine/engine.h"
#include "kvbridge/model/model.h"
#include "kvbridge/server/api_server.h"
#include "support/tiny_model.h"

namespace kvbridge::server {
namespace {

using nlohmann::json;

// The tiny random model (seed 3), loaded once per process.
std::shared_ptr<const Model> TinyModel() { return kvbridge::testing::TinyRandomModel(3); }

class ServerEngineTest : public ::testing::Test {
 protected:
  void SetUp() override {
    EngineConfig ec;
    ec.block_size = 16;
    ec.num_blocks = 512;
    ec.max_model_len = 256;
    ec.debug_poison_kv_nan = true;
    auto engine = Engine::Create(ec, TinyModel());
    ASSERT_TRUE(engine.ok()) << engine.status().ToString();
    engine_ = std::move(engine).value();
    ServerConfig sc;
    sc.port = 0;
    sc.served_model_name = "tiny";
    sc.max_model_len = 256;
    auto srv = ApiServer::Create(sc, engine_.get(), TinyModel()->tokenizer());
    ASSERT_TRUE(srv.ok());
    server_ = std::move(srv).value();
    ASSERT_TRUE(server_->Start().ok());
  }
  void TearDown() override {
    if (server_) server_->Stop();
    if (engine_) {
      EXPECT_TRUE(Drained()) << "active blocks left: " << engine_->Stats().kv_blocks_active;
      engine_->Shutdown();
    }
  }
  httplib::Result Post(const std::string& path, const json& body) {
    httplib::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(60, 0);
    return c.Post(path.c_str(), body.dump(), "application/json");
  }
  double Metric(const std::string& name, const std::string& labels = "") {
    httplib::Client c("127.0.0.1", server_->port());
    auto r = c.Get("/metrics");
    return r ? ScrapeMetric(r->body, name, labels) : -2;
  }
  bool Drained(int timeout_ms = 10000) {
    for (int i = 0; i < timeout_ms / 10; ++i) {
      EngineStats s = engine_->Stats();
      if (s.kv_blocks_active == 0 && s.running == 0 && s.waiting == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  static std::string StreamText(const std::string& body, bool chat, bool* done, int* chunks) {
    std::string text;
    *done = false;
    *chunks = 0;
    size_t pos = 0;
    while ((pos = body.find("data: ", pos)) != std::string::npos) {
      size_t end = body.find("\n\n", pos);
      std::string payload = body.substr(pos + 6, end - pos - 6);
      pos = end + 2;
      if (payload == "[DONE]") {
        *done = true;
        continue;
      }
      json j = json::parse(payload);
      if (j["choices"].empty()) continue;
      ++*chunks;
      const json& c = j["choices"][0];
      text += chat ? c["delta"].value("content", "") : c["text"].get<std::string>();
    }
    return text;
  }

  std::unique_ptr<Engine> engine_;
  std::unique_ptr<ApiServer> server_;
};

TEST_F(ServerEngineTest, EightChoicesWithConsistentLogprobs) {
  auto r = Post("/v1/completions", {{"model", "tiny"},
                                    {"prompt", "The quick brown fox"},
                                    {"n", 8},
                                    {"max_tokens", 5},
                                    {"temperature", 1.0},
                                    {"seed", 11},
                                    {"ignore_eos", true},
                                    {"logprobs", 3}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  ASSERT_EQ(j["choices"].size(), 8u);
  for (int i = 0; i < 8; ++i) {
    const json& c = j["choices"][i];
    EXPECT_EQ(c["index"], i);
    EXPECT_EQ(c["finish_reason"], "length");
    const json& lp = c["logprobs"];
    ASSERT_EQ(lp["tokens"].size(), 5u);
    std::string joined;
    for (int k = 0; k < 5; ++k) {
      const std::string tok = lp["tokens"][k];
      const double l = lp["token_logprobs"][k];
      EXPECT_LE(l, 0.0);
      const json& top = lp["top_logprobs"][k];
      EXPECT_GE(top.size(), 3u);
      EXPECT_LE(top.size(), 4u);  // top-3 plus the sampled token when outside them
      ASSERT_TRUE(top.contains(tok));
      EXPECT_EQ(top[tok].get<double>(), l);
      double best = -1e30;
      for (auto& [k2, v] : top.items()) best = std::max(best, v.get<double>());
      EXPECT_LE(l, best);
      EXPECT_EQ(lp["text_offset"][k], static_cast<int>(joined.size()));
      if (tok.rfind("bytes:", 0) != 0)
        joined += tok;
      else
        joined += "?";  // invalid UTF-8 byte: one byte in the text
    }
  }
  // 4 prompt tokens + BOS; usage counts each sibling's tokens.
  EXPECT_EQ(j["usage"]["prompt_tokens"], 20);
  EXPECT_EQ(j["usage"]["completion_tokens"], 40);
}

TEST_F(ServerEngineTest, GreedyStreamEqualsWholeAnswerAndChatWorks) {
  json body{
      {"prompt", "Hello there"}, {"max_tokens", 12}, {"temperature", 0}, {"ignore_eos", true}};
  auto whole = Post("/v1/completions", body);
  ASSERT_TRUE(whole);
  ASSERT_EQ(whole->status, 200) << whole->body;
  body["stream"] = true;
  auto streamed = Post("/v1/completions", body);
  ASSERT_TRUE(streamed);
  ASSERT_EQ(streamed->status, 200);
  bool done = false;
  int chunks = 0;
  std::string text = StreamText(streamed->body, false, &done, &chunks);
  EXPECT_TRUE(done);
  EXPECT_GE(chunks, 1);  // the tiny model may finish before the first write: chunks coalesce
  // Raw bytes may be invalid UTF-8: compare after the same JSON replacement on both sides.
  EXPECT_EQ(json(text).dump(-1, ' ', false, json::error_handler_t::replace),
            json::parse(whole->body)["choices"][0]["text"].dump());

  json chat{{"messages", {{{"role", "user"}, {"content", "Hi"}}}},
            {"max_tokens", 6},
            {"temperature", 0},
            {"logprobs", true},
            {"top_logprobs", 2}};
  auto r = Post("/v1/chat/completions", chat);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  const json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_GE(content.size(), 1u);
  EXPECT_EQ(content[0]["top_logprobs"].size(), 2u);
  // Greedy: the chosen token is the most likely one.
  EXPECT_EQ(content[0]["top_logprobs"][0]["logprob"], content[0]["logprob"]);
  // "<|user|>\nHi\n<|assistant|>\n" + BOS.
  EXPECT_EQ(j["usage"]["prompt_tokens"], 27);
  chat["stream"] = true;
  r = Post("/v1/chat/completions", chat);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  StreamText(r->body, true, &done, &chunks);
  EXPECT_TRUE(done);
}

// Stops as vLLM does them, on the real engine and the tiny model (byte tokenizer: an id < 256
// is its byte, the others have no text): the greedy answer without stops gives the expected
// values exactly.
TEST_F(ServerEngineTest, StopsCutTheTextAsVllmWholeAndStreamed) {
  const json base{{"prompt", "Hello there"}, {"max_tokens", 24},
                  {"temperature", 0},        {"ignore_eos", true},
                  {"logprobs", 1},           {"return_tokens_as_token_ids", true}};
  auto free_run = Post("/v1/completions", base);
  ASSERT_TRUE(free_run);
  ASSERT_EQ(free_run->status, 200) << free_run->body;
  std::vector<int32_t> ids;
  const json free_body = json::parse(free_run->body);
  for (const json& t : free_body["choices"][0]["logprobs"]["tokens"]) {
    ids.push_back(std::stoi(t.get<std::string>().substr(9)));  // "token_id:N"
  }
  ASSERT_EQ(ids.size(), 24u) << free_run->body;
  std::string raw;             // the answer's bytes
  std::vector<size_t> end_of;  // raw.size() after each token
  for (int32_t t : ids) {
    if (t < 256) raw.push_back(static_cast<char>(t));
    end_of.push_back(raw.size());
  }
  auto printable = [](char ch) { return ch >= 0x20 && ch < 0x7f && ch != '"' && ch != '\\'; };
  size_t i = 1;
  while (i + 1 < raw.size() &&
         !(printable(raw[i]) && printable(raw[i + 1]) && raw.find(raw.substr(i, 2)) == i)) {
    ++i;
  }
  ASSERT_LT(i + 1, raw.size()) << "no printable pair in the greedy answer";
  const std::string stop = raw.substr(i, 2);
  // The token that completes the stop string ends the answer; all of its ids count.
  size_t last = 0;
  while (end_of[last] < i + 2) ++last;
  const int64_t completion_tokens = static_cast<int64_t>(last + 1);
  auto as_json = [](const std::string& bytes) {
    return json(bytes).dump(-1, ' ', false, json::error_handler_t::replace);
  };
  struct Case {
    json extra;
    std::string text;
    json stop_reason;
    int64_t completion_tokens;
  };
  const Case cases[] = {
      {{{"stop", stop}}, raw.substr(0, i), stop, completion_tokens},
      {{{"stop", json::array({"\x01\x02never", stop})}, {"include_stop_str_in_output", true}},
       raw.substr(0, i + 2),
       stop,
       completion_tokens},
      // A stop token: its id is returned and counted, its text is not (unless included).
      {{{"stop_token_ids", {ids[5]}}},
       raw.substr(0, end_of[std::find(ids.begin(), ids.end(), ids[5]) - ids.begin()] -
                         (ids[5] < 256 ? 1 : 0)),
       ids[5],
       std::find(ids.begin(), ids.end(), ids[5]) - ids.begin() + 1},
      {{{"stop_token_ids", {ids[5]}}, {"include_stop_str_in_output", true}},
       raw.substr(0, end_of[std::find(ids.begin(), ids.end(), ids[5]) - ids.begin()]),
       ids[5],
       std::find(ids.begin(), ids.end(), ids[5]) - ids.begin() + 1},
      // min_tokens past the match: the string is searched only in later text.
      {{{"stop", stop}, {"min_tokens", 23}}, raw, nullptr, 24},
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(n++);
    for (const char* path : {"/v1/completions", "/v1/chat/completions"}) {
      SCOPED_TRACE(path);
      const bool chat = std::string(path) == "/v1/chat/completions";
      json body = base;
      body.erase("logprobs");
      body.erase("return_tokens_as_token_ids");
      if (chat) {
        // The chat prompt differs: only the shapes are compared with the completion's below.
        body.erase("prompt");
        body["messages"] = {{{"role", "user"}, {"content", "Hello there"}}};
      }
      for (auto& [k, v] : c.extra.items()) body[k] = v;
      auto whole = Post(path, body);
      ASSERT_TRUE(whole);
      ASSERT_EQ(whole->status, 200) << whole->body;
      const json w = json::parse(whole->body);
      const json& choice = w["choices"][0];
      const std::string text = chat ? choice["message"]["content"].get<std::string>()
                                    : choice["text"].get<std::string>();
      if (!chat) {
        EXPECT_EQ(json(text).dump(), as_json(c.text));
        EXPECT_EQ(choice["stop_reason"], c.stop_reason);
        EXPECT_EQ(choice["finish_reason"], c.stop_reason.is_null() ? "length" : "stop");
        EXPECT_EQ(w["usage"]["completion_tokens"], c.completion_tokens);
      }
      body["stream"] = true;
      auto streamed = Post(path, body);
      ASSERT_TRUE(streamed);
      ASSERT_EQ(streamed->status, 200);
      bool done = false;
      int chunks = 0;
      EXPECT_EQ(as_json(StreamText(streamed->body, chat, &done, &chunks)), json(text).dump());
      EXPECT_TRUE(done);
    }
  }
  // n = 2 sampled: each choice stops on its own text.
  json sampled{
      {"prompt", "Hello there"}, {"max_tokens", 16}, {"temperature", 1.0}, {"seed", 5}, {"n", 2},
      {"ignore_eos", true}};
  auto free2 = Post("/v1/completions", sampled);
  ASSERT_TRUE(free2);
  ASSERT_EQ(free2->status, 200);
  const json f2 = json::parse(free2->body);
  std::string t0 = f2["choices"][0]["text"], t1 = f2["choices"][1]["text"];
  ASSERT_NE(t0, t1);
  // A stop string from choice 0's text (printable, first occurrence) that choice 1 lacks.
  std::string s2;
  for (size_t k = 1; k + 1 < t0.size() && s2.empty(); ++k) {
    std::string cand = t0.substr(k, 2);
    if (printable(cand[0]) && printable(cand[1]) && t0.find(cand) == k &&
        t1.find(cand) == std::string::npos) {
      s2 = cand;
    }
  }
  ASSERT_FALSE(s2.empty());
  sampled["stop"] = s2;
  for (bool stream : {false, true}) {
    sampled["stream"] = stream;
    auto r = Post("/v1/completions", sampled);
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200);
    if (!stream) {
      const json j = json::parse(r->body);
      EXPECT_EQ(j["choices"][0]["text"], t0.substr(0, t0.find(s2)));
      EXPECT_EQ(j["choices"][0]["stop_reason"], s2);
      EXPECT_EQ(j["choices"][1]["text"], t1);
      EXPECT_EQ(j["choices"][1]["finish_reason"], "length");
      EXPECT_TRUE(j["choices"][1]["stop_reason"].is_null());
    }
  }
}

TEST_F(ServerEngineTest, RepeatedPromptReportsCachedTokens) {
  json body{{"prompt", std::string(40, 'x')}, {"max_tokens", 2}, {"temperature", 0}};
  auto a = Post("/v1/completions", body);
  ASSERT_TRUE(a);
  ASSERT_EQ(a->status, 200);
  EXPECT_EQ(json::parse(a->body)["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  auto b = Post("/v1/completions", body);
  ASSERT_TRUE(b);
  ASSERT_EQ(b->status, 200);
  // 41 prompt tokens (BOS + 40): two full blocks of 16 are cached.
  EXPECT_EQ(json::parse(b->body)["usage"]["prompt_tokens_details"]["cached_tokens"], 32);
  EXPECT_EQ(json::parse(a->body)["choices"][0]["text"], json::parse(b->body)["choices"][0]["text"]);
}

TEST_F(ServerEngineTest, BadInputsLeaveTheEngineUnharmed) {
  auto r = Post("/v1/completions", {{"prompt", std::string(300, 'a')}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  r = Post("/v1/completions", {{"prompt", json::array({1, 2, 100000})}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  r = Post("/v1/completions", {{"prompt", "a"}, {"n", 0}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(engine_->Stats().kv_blocks_active, 0);
  EXPECT_EQ(Metric("kvbridge_http_requests_total", "code=\"400\""), 3);
  r = Post("/v1/completions", {{"prompt", "ok"}, {"max_tokens", 3}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

TEST_F(ServerEngineTest, DisconnectMidStreamFreesBlocks) {
  httplib::Client c("127.0.0.1", server_->port());
  int chunks = 0;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = json{
      {"prompt", std::string(100, 'q')},
      {"n", 4},
      {"max_tokens", 150},
      {"ignore_eos", true},
      {"stream",
       true}}.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
    return ++chunks < 3;  // go away after a few chunks
  };
  auto r = c.send(req);
  EXPECT_GE(chunks, 3);
  EXPECT_TRUE(Drained());
  for (int i = 0; i < 200 && Metric("kvbridge_http_generation_requests_in_flight") != 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(Metric("kvbridge_kv_blocks_active"), 0);
  EXPECT_EQ(Metric("kvbridge_http_client_disconnects_total"), 1);
}

TEST_F(ServerEngineTest, SixtyFourConcurrentMixedRequests) {
  constexpr int kClients = 64;
  std::vector<std::string> failures(kClients);
  std::vector<std::thread> threads;
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      httplib::Client c("127.0.0.1", server_->port());
      c.set_read_timeout(120, 0);
      json body{{"max_tokens", 4 + t % 5}, {"temperature", t % 2 ? 0.8 : 0.0}, {"seed", t}};
      std::string path = "/v1/completions";
      if (t % 3 == 2) {
        path = "/v1/chat/completions";
        body["messages"] = {{{"role", "user"}, {"content", "client " + std::to_string(t)}}};
      } else {
        body["prompt"] = "prompt number " + std::to_string(t % 7);
      }
      if (t % 4 == 1) body["stream"] = true;
      if (t % 5 == 3) body["n"] = 3;
      auto r = c.Post(path.c_str(), body.dump(), "application/json");
      if (!r) {
        failures[t] = "no response: " + httplib::to_string(r.error());
      } else if (r->status != 200) {
        failures[t] = r->body;
      } else if (t % 4 == 1 && r->body.find("data: [DONE]") == std::string::npos) {
        failures[t] = "stream without [DONE]";
      }
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kClients; ++t) EXPECT_EQ(failures[t], "") << "client " << t;
  EXPECT_TRUE(Drained());
  EXPECT_EQ(Metric("kvbridge_http_requests_total", "code=\"200\""), kClients);
  EXPECT_EQ(Metric("kvbridge_kv_blocks_active"), 0);
}

}  // namespace
}  // namespace kvbridge::server
