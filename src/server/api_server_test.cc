// In-process tests of the HTTP layer: a real ApiServer on a free port in front of FakeEngine.
#include "kvbridge/server/api_server.h"

#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <numeric>
#include <thread>

#include "kvbridge/common/metrics.h"
#include "server/fake_engine.h"
#include "server/openai_protocol.h"
#include "support/test_cert.h"

namespace kvbridge::server {
namespace {

using kvbridge::testing::MakeSelfSignedCert;
using kvbridge::testing::TestCert;
using nlohmann::json;
using testing::ByteCodec;
using testing::FakeEngine;
using testing::FakeEngineOptions;

// Raw HTTP/1.1 over a socket, for tests that must control when the client goes away.
class RawClient {
 public:
  explicit RawClient(int port) {
    fd_ = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(static_cast<uint16_t>(port));
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    connected_ = connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  }
  ~RawClient() { Close(); }
  bool connected() const { return connected_; }
  void Post(const std::string& path, const std::string& body) {
    std::string req = "POST " + path +
                      " HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" +
                      "Content-Length: " + std::to_string(body.size()) + "\r\n\r\n" + body;
    ASSERT_EQ(send(fd_, req.data(), req.size(), 0), static_cast<ssize_t>(req.size()));
  }
  // Reads until `needle` appears (or 5 s pass); returns what was read.
  std::string ReadUntil(const std::string& needle) {
    std::string got;
    timeval tv{0, 100000};
    setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    for (int i = 0; i < 50 && got.find(needle) == std::string::npos; ++i) {
      char buf[4096];
      ssize_t n = recv(fd_, buf, sizeof(buf), 0);
      if (n == 0) break;
      if (n > 0) got.append(buf, static_cast<size_t>(n));
    }
    return got;
  }
  void Close() {
    if (fd_ >= 0) close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

class ApiServerTest : public ::testing::Test {
 protected:
  void StartServer(FakeEngineOptions eopts = {}, ServerConfig cfg = {}) {
    engine_ = std::make_unique<FakeEngine>(eopts);
    cfg.port = 0;
    if (cfg.served_model_name == "kvbridge") cfg.served_model_name = "tiny";
    if (cfg.max_model_len == 0) cfg.max_model_len = eopts.max_model_len;
    auto server = ApiServer::Create(cfg, engine_.get(), ByteCodec::Make());
    ASSERT_TRUE(server.ok()) << server.status().ToString();
    server_ = std::move(server).value();
    ASSERT_TRUE(server_->Start().ok());
  }
  void TearDown() override {
    if (server_) server_->Stop();
    if (engine_) {
      EXPECT_EQ(engine_->Stats().kv_blocks_active, 0) << "blocks leaked";
      engine_->Shutdown();
    }
  }
  httplib::Client Client(int timeout_s = 10) {
    httplib::Client c("127.0.0.1", server_->port());
    c.set_read_timeout(timeout_s, 0);
    return c;
  }
  httplib::Result Post(const std::string& path, const json& body, httplib::Headers h = {}) {
    return Client().Post(path.c_str(), h, body.dump(), "application/json");
  }
  std::string Metrics() {
    auto r = Client().Get("/metrics");
    return r ? r->body : "";
  }
  // Polls until the engine holds no blocks and no request is in flight (bounded).
  bool Drained(int timeout_ms = 5000) {
    for (int i = 0; i < timeout_ms / 10; ++i) {
      if (engine_->Stats().kv_blocks_active == 0 && engine_->Stats().running == 0) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return false;
  }
  static std::string Expected(const std::string& prompt, int len, int sibling) {
    int64_t sum = 0;
    for (unsigned char c : prompt) sum += c;
    std::string s;
    for (int j = 0; j < len; ++j)
      s.push_back(static_cast<char>(FakeEngine::TokenAt(sum, j, sibling)));
    return s;
  }
  static std::vector<json> SseEvents(const std::string& body, bool* done) {
    std::vector<json> events;
    *done = false;
    size_t pos = 0;
    while ((pos = body.find("data: ", pos)) != std::string::npos) {
      size_t end = body.find("\n\n", pos);
      if (end == std::string::npos) break;
      std::string payload = body.substr(pos + 6, end - pos - 6);
      if (payload == "[DONE]") {
        *done = true;
      } else {
        events.push_back(json::parse(payload));
      }
      pos = end + 2;
    }
    return events;
  }
  static void ExpectOpenAiError(const httplib::Result& r, int status) {
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, status) << r->body;
    json j = json::parse(r->body, nullptr, false);
    ASSERT_TRUE(j.is_object()) << r->body;
    ASSERT_TRUE(j.contains("error")) << r->body;
    EXPECT_TRUE(j["error"]["message"].is_string());
    EXPECT_TRUE(j["error"]["type"].is_string());
    EXPECT_TRUE(j["error"].contains("param"));
    EXPECT_EQ(j["error"]["code"], status);
  }

  std::unique_ptr<FakeEngine> engine_;
  std::unique_ptr<ApiServer> server_;
};

TEST_F(ApiServerTest, CompletionWithEightChoicesAndLogprobs) {
  StartServer();
  auto r =
      Post("/v1/completions",
           {{"model", "tiny"}, {"prompt", "Hello"}, {"n", 8}, {"max_tokens", 6}, {"logprobs", 2}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "text_completion");
  EXPECT_EQ(j["model"], "tiny");
  EXPECT_EQ(j["id"].get<std::string>().rfind("cmpl-", 0), 0u);
  ASSERT_EQ(j["choices"].size(), 8u);
  for (int i = 0; i < 8; ++i) {
    const json& c = j["choices"][i];
    EXPECT_EQ(c["index"], i);
    EXPECT_EQ(c["text"], Expected("Hello", 6, i));
    EXPECT_EQ(c["finish_reason"], "length");
    const json& lp = c["logprobs"];
    ASSERT_EQ(lp["tokens"].size(), 6u);
    ASSERT_EQ(lp["token_logprobs"].size(), 6u);
    ASSERT_EQ(lp["top_logprobs"].size(), 6u);
    ASSERT_EQ(lp["text_offset"].size(), 6u);
    for (int k = 0; k < 6; ++k) {
      std::string tok = lp["tokens"][k];
      EXPECT_EQ(tok, std::string(1, c["text"].get<std::string>()[k]));
      EXPECT_EQ(lp["top_logprobs"][k][tok], lp["token_logprobs"][k]);  // consistent
      EXPECT_EQ(lp["top_logprobs"][k].size(), 2u);
      EXPECT_EQ(lp["text_offset"][k], k);
    }
  }
  EXPECT_EQ(j["usage"]["prompt_tokens"], 5);
  EXPECT_EQ(j["usage"]["completion_tokens"], 48);
  EXPECT_EQ(j["usage"]["total_tokens"], 53);
  EXPECT_EQ(j["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
  EngineRequest last = engine_->last_request();
  EXPECT_EQ(last.sampling.n, 8);
  EXPECT_EQ(last.sampling.max_tokens, 6);
  EXPECT_EQ(last.sampling.logprobs, 2);
  EXPECT_TRUE(Drained());
}

TEST_F(ApiServerTest, SeveralPromptsGiveChoicesIndexedPromptTimesN) {
  StartServer();
  auto r =
      Post("/v1/completions",
           {{"prompt", json::array({"ab", json::array({120, 121})})}, {"n", 2}, {"max_tokens", 3}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  ASSERT_EQ(j["choices"].size(), 4u);
  EXPECT_EQ(j["choices"][0]["text"], Expected("ab", 3, 0));
  EXPECT_EQ(j["choices"][1]["text"], Expected("ab", 3, 1));
  EXPECT_EQ(j["choices"][2]["text"], Expected("xy", 3, 0));
  EXPECT_EQ(j["choices"][3]["text"], Expected("xy", 3, 1));
  EXPECT_EQ(j["choices"][3]["index"], 3);
  EXPECT_EQ(j["usage"]["prompt_tokens"], 4);
  EXPECT_EQ(j["usage"]["completion_tokens"], 12);
  EXPECT_EQ(engine_->requests_added(), 2);
}

TEST_F(ApiServerTest, StreamingCompletionMatchesWholeAnswer) {
  StartServer();
  json body{{"prompt", "Hi"},
            {"n", 2},
            {"max_tokens", 5},
            {"stream", true},
            {"stream_options", {{"include_usage", true}}},
            {"logprobs", 0}};
  auto r = Post("/v1/completions", body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_EQ(r->get_header_value("Content-Type"), "text/event-stream");
  bool done = false;
  auto events = SseEvents(r->body, &done);
  EXPECT_TRUE(done);
  std::string text[2];
  int finishes = 0;
  size_t logprob_tokens = 0;
  ASSERT_GE(events.size(), 3u);
  for (size_t e = 0; e + 1 < events.size(); ++e) {
    const json& c = events[e]["choices"][0];
    text[c["index"].get<int>()] += c["text"].get<std::string>();
    logprob_tokens += c["logprobs"]["tokens"].size();
    if (!c["finish_reason"].is_null()) {
      EXPECT_EQ(c["finish_reason"], "length");
      ++finishes;
    }
    EXPECT_TRUE(events[e]["usage"].is_null());
  }
  EXPECT_EQ(text[0], Expected("Hi", 5, 0));
  EXPECT_EQ(text[1], Expected("Hi", 5, 1));
  EXPECT_EQ(finishes, 2);
  EXPECT_EQ(logprob_tokens, 10u);
  const json& last = events.back();
  EXPECT_TRUE(last["choices"].empty());
  EXPECT_EQ(last["usage"]["completion_tokens"], 10);
  EXPECT_EQ(last["usage"]["prompt_tokens"], 2);
  EXPECT_TRUE(Drained());
}

TEST_F(ApiServerTest, ChatCompletionWholeAndStreamed) {
  StartServer();
  json body{{"messages", {{{"role", "user"}, {"content", "Hey"}}}},
            {"max_tokens", 4},
            {"logprobs", true},
            {"top_logprobs", 2}};
  auto r = Post("/v1/chat/completions", body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  EXPECT_EQ(j["object"], "chat.completion");
  const std::string prompt = "<|user|>\nHey\n<|assistant|>\n";
  EXPECT_EQ(j["choices"][0]["message"]["role"], "assistant");
  EXPECT_EQ(j["choices"][0]["message"]["content"], Expected(prompt, 4, 0));
  const json& content = j["choices"][0]["logprobs"]["content"];
  ASSERT_EQ(content.size(), 4u);
  EXPECT_EQ(content[0]["token"], Expected(prompt, 1, 0));
  EXPECT_EQ(content[0]["top_logprobs"].size(), 2u);
  EXPECT_EQ(content[0]["bytes"].size(), 1u);
  EXPECT_EQ(j["usage"]["prompt_tokens"], static_cast<int>(prompt.size()));

  body["stream"] = true;
  r = Post("/v1/chat/completions", body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  bool done = false;
  auto events = SseEvents(r->body, &done);
  EXPECT_TRUE(done);
  ASSERT_GE(events.size(), 2u);
  EXPECT_EQ(events[0]["object"], "chat.completion.chunk");
  EXPECT_EQ(events[0]["choices"][0]["delta"]["role"], "assistant");
  std::string text;
  for (const json& e : events) text += e["choices"][0]["delta"].value("content", "");
  EXPECT_EQ(text, Expected(prompt, 4, 0));
  EXPECT_EQ(events.back()["choices"][0]["finish_reason"], "length");
  EXPECT_TRUE(Drained());
}

TEST_F(ApiServerTest, ModelsHealthAndMetrics) {
  StartServer();
  auto r = Client().Get("/v1/models");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  json j = json::parse(r->body);
  EXPECT_EQ(j["data"][0]["id"], "tiny");
  EXPECT_EQ(j["data"][0]["max_model_len"], 256);
  r = Client().Get("/health");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  std::string m = Metrics();
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_kv_blocks_active"), 0.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_http_requests_total", "code=\"200\""), 2.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_http_generation_requests_in_flight"), 0.0);
}

TEST_F(ApiServerTest, BadInputsGetOpenAiErrorsAndLeaveTheEngineAlone) {
  StartServer();
  auto post_raw = [&](const char* path, const std::string& body) {
    return Client().Post(path, body, "application/json");
  };
  ExpectOpenAiError(post_raw("/v1/completions", "{not json"), 400);
  ExpectOpenAiError(post_raw("/v1/chat/completions", ""), 400);
  ExpectOpenAiError(Post("/v1/completions", {{"prompt", "a"}, {"n", 0}}), 400);
  ExpectOpenAiError(Post("/v1/completions", {{"prompt", "a"}, {"n", 1000}}), 400);
  ExpectOpenAiError(Post("/v1/completions", {{"prompt", "a"}, {"max_tokens", -1}}), 400);
  ExpectOpenAiError(Post("/v1/completions", {{"prompt", "a"}, {"max_tokens", "x"}}), 400);
  ExpectOpenAiError(Post("/v1/completions", {{"prompt", std::string(300, 'a')}}), 400);
  ExpectOpenAiError(Post("/v1/completions", {{"prompt", "a"}, {"temperature", -1}}), 400);
  ExpectOpenAiError(Post("/v1/completions", {{"prompt", "a"}, {"top_p", 2}}), 400);
  ExpectOpenAiError(Post("/v1/completions", {{"prompt", "a"}, {"model", "nope"}}), 404);
  ExpectOpenAiError(Post("/v1/chat/completions", {{"messages", 3}}), 400);
  ExpectOpenAiError(Client().Get("/v1/nothing"), 404);
  ExpectOpenAiError(Client().Get("/v1/completions"), 404);
  auto r = Post("/v1/completions", {{"prompt", "a"}, {"model", "nope"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(json::parse(r->body)["error"]["param"], "model");
  EXPECT_EQ(engine_->requests_added(), 0);
  EXPECT_EQ(engine_->Stats().kv_blocks_active, 0);
  std::string m = Metrics();
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_http_requests_total", "code=\"400\""), 10.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_http_requests_total", "code=\"404\""), 4.0);
  // The engine still serves.
  r = Post("/v1/completions", {{"prompt", "a"}, {"max_tokens", 2}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
}

TEST_F(ApiServerTest, InvalidUtf8IsA400) {
  StartServer();
  // Raw bytes that are not UTF-8 inside a JSON string, and a lone surrogate escape.
  for (const std::string& body :
       {std::string("{\"prompt\":\"a\xFF\xFE"
                    "b\"}"),
        std::string("{\"prompt\":\"\xC3\"}"), std::string("{\"prompt\":\"\\ud800\"}")}) {
    for (const char* path : {"/v1/completions", "/tokenize"}) {
      auto r = Client().Post(path, body, "application/json");
      ExpectOpenAiError(r, 400);
      EXPECT_NE(r->body.find("not valid JSON"), std::string::npos) << r->body;
    }
  }
  auto r = Client().Post("/v1/chat/completions",
                         std::string("{\"messages\":[{\"role\":\"user\",\"content\":\"\x80\"}]}"),
                         "application/json");
  ExpectOpenAiError(r, 400);
  EXPECT_NE(r->body.find("UTF-8"), std::string::npos) << r->body;
  EXPECT_EQ(engine_->requests_added(), 0);
}

TEST_F(ApiServerTest, TokenizeAndDetokenize) {
  StartServer();
  auto r = Post("/tokenize", {{"model", "tiny"}, {"prompt", "hi"}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(
      json::parse(r->body),
      json(
          {{"count", 2}, {"max_model_len", 256}, {"tokens", {104, 105}}, {"token_strs", nullptr}}));
  r = Post("/tokenize",
           {{"prompt", "hi"}, {"return_token_strs", true}, {"add_special_tokens", false}});
  ASSERT_TRUE(r);
  EXPECT_EQ(json::parse(r->body)["token_strs"], json({"h", "i"}));
  r = Post("/tokenize", {{"prompt", ""}});
  ASSERT_TRUE(r);
  EXPECT_EQ(json::parse(r->body)["tokens"], json::array());
  EXPECT_EQ(json::parse(r->body)["count"], 0);
  // No length check: /tokenize is how a client finds out that a prompt is too long.
  r = Post("/tokenize", {{"prompt", std::string(300, 'a')}});
  ASSERT_TRUE(r);
  EXPECT_EQ(json::parse(r->body)["count"], 300);

  r = Post("/detokenize", {{"model", "tiny"}, {"tokens", {104, 105, ByteCodec::kEos}}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body), json({{"prompt", "hi"}}));
  r = Post("/detokenize", {{"tokens", json::array()}});
  ASSERT_TRUE(r);
  EXPECT_EQ(json::parse(r->body), json({{"prompt", ""}}));

  ExpectOpenAiError(Post("/detokenize", {{"tokens", {104, 258}}}), 400);
  ExpectOpenAiError(Post("/detokenize", {{"tokens", {-1}}}), 400);
  ExpectOpenAiError(Post("/detokenize", {{"tokens", {"a"}}}), 400);
  ExpectOpenAiError(Post("/detokenize", {{"tokens", 5}}), 400);
  ExpectOpenAiError(Post("/detokenize", json::object()), 400);
  ExpectOpenAiError(Post("/tokenize", {{"prompt", 5}}), 400);
  ExpectOpenAiError(Post("/tokenize", {{"prompt", "a"}, {"add_special_tokens", "yes"}}), 400);
  ExpectOpenAiError(Post("/tokenize", {{"prompt", "a"}, {"model", "nope"}}), 404);
  ExpectOpenAiError(Post("/detokenize", {{"tokens", {1}}, {"model", "nope"}}), 404);
  ExpectOpenAiError(Client().Post("/tokenize", "{", "application/json"), 400);
  r = Post("/detokenize", {{"tokens", {104, 258}}});
  EXPECT_EQ(json::parse(r->body)["error"]["param"], "tokens");
  EXPECT_EQ(engine_->requests_added(), 0);
}

TEST_F(ApiServerTest, ApiKeyGuardsV1Routes) {
  ServerConfig cfg;
  cfg.api_key = "s3cret";
  StartServer({}, cfg);
  ExpectOpenAiError(Post("/v1/completions", {{"prompt", "a"}}), 401);
  ExpectOpenAiError(Post("/v1/completions", {{"prompt", "a"}}, {{"Authorization", "Bearer nope"}}),
                    401);
  ExpectOpenAiError(Client().Get("/v1/models"), 401);
  auto r = Post("/v1/completions", {{"prompt", "a"}, {"max_tokens", 1}},
                {{"Authorization", "Bearer s3cret"}});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  r = Client().Get("/health");  // probes need no key
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 200);
  EXPECT_EQ(engine_->requests_added(), 1);
}

TEST_F(ApiServerTest, FullEngineQueueIs503) {
  FakeEngineOptions eo;
  eo.max_waiting_requests = 1;
  StartServer(eo);
  engine_->SetPaused(true);
  std::thread first([&] {
    auto r = Post("/v1/completions", {{"prompt", "a"}, {"max_tokens", 2}});
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 200);
  });
  for (int i = 0; i < 500 && engine_->requests_added() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // Two prompts: the first is queued, the second refused; the first must be aborted too.
  ExpectOpenAiError(Post("/v1/completions", {{"prompt", "b"}}), 503);
  ExpectOpenAiError(Post("/v1/completions", {{"prompt", json::array({"c", "d"})}}), 503);
  engine_->SetPaused(false);
  first.join();
  EXPECT_TRUE(Drained());
  EXPECT_EQ(ScrapeMetric(Metrics(), "kvbridge_http_engine_rejections_total"), 2.0);
}

TEST_F(ApiServerTest, KvTransferParamsNeedTheHookAndTheClusterToken) {
  StartServer();
  auto r = Post(
      "/v1/completions",
      {{"prompt", "a"}, {"max_tokens", 1}, {"kv_transfer_params", {{"do_remote_decode", true}}}});
  ExpectOpenAiError(r, 400);
  EXPECT_EQ(json::parse(r->body)["error"]["message"], "P/D is not configured on this engine");
  server_->Stop();
  server_.reset();

  ServerConfig cfg;
  cfg.cluster_token = "tok";
  cfg.validate_kv_transfer_params = [](json& p) -> Status {
    if (!p.contains("transfer_id")) return InvalidArgumentError("transfer_id is required");
    p["validated"] = true;
    return OkStatus();
  };
  engine_->Shutdown();
  StartServer({}, cfg);
  json body{{"prompt", "a"}, {"max_tokens", 1}, {"kv_transfer_params", {{"transfer_id", "t1"}}}};
  ExpectOpenAiError(Post("/v1/completions", body), 403);
  ExpectOpenAiError(Post("/v1/completions", body, {{"X-KVBridge-Cluster-Token", "bad"}}), 403);
  json bad = body;
  bad["kv_transfer_params"] = {{"x", 1}};
  r = Post("/v1/completions", bad, {{"X-KVBridge-Cluster-Token", "tok"}});
  ExpectOpenAiError(r, 400);
  EXPECT_EQ(json::parse(r->body)["error"]["message"], "transfer_id is required");
  EXPECT_EQ(engine_->requests_added(), 0);
  r = Post("/v1/completions", body, {{"X-KVBridge-Cluster-Token", "tok"}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  // FakeEngine answers {"echo": <what it got>}: the hook's normalization reached the engine;
  // the server adds the digest of the prompt ids it sent (for a decode to compare).
  const std::string digest = PromptDigest(std::vector<int32_t>{'a'});
  EXPECT_EQ(j["kv_transfer_params"], json({{"echo", {{"transfer_id", "t1"}, {"validated", true}}},
                                           {kPromptDigestKey, digest}}));
  // A request carrying the prefill's digest: the same ids pass (the key is not passed on) ...
  json with_digest = body;
  with_digest["kv_transfer_params"][kPromptDigestKey] = digest;
  r = Post("/v1/completions", with_digest, {{"X-KVBridge-Cluster-Token", "tok"}});
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["kv_transfer_params"]["echo"],
            json({{"transfer_id", "t1"}, {"validated", true}}));
  // ... other ids (a prefill with another tokenizer) are refused before the engine sees them.
  const int64_t added = engine_->requests_added();
  for (const json& other : {json(PromptDigest(std::vector<int32_t>{'b'})),
                            json(PromptDigest(std::vector<int32_t>{'a', 'a'})), json(7)}) {
    with_digest["kv_transfer_params"][kPromptDigestKey] = other;
    r = Post("/v1/completions", with_digest, {{"X-KVBridge-Cluster-Token", "tok"}});
    ExpectOpenAiError(r, 500);
    EXPECT_NE(json::parse(r->body)["error"]["message"].get<std::string>().find(
                  "must serve the same model with the same tokenizer"),
              std::string::npos)
        << r->body;
  }
  EXPECT_EQ(engine_->requests_added(), added);
  EXPECT_TRUE(
      server_->CheckClusterToken(HttpRequest{.headers = {{"x-kvbridge-cluster-token", "tok"}}}));
  EXPECT_FALSE(server_->CheckClusterToken(HttpRequest{}));
}

TEST_F(ApiServerTest, ExtraRoutesFromOtherModules) {
  ServerConfig cfg;
  cfg.api_key = "k";
  engine_ = std::make_unique<FakeEngine>();
  cfg.port = 0;
  auto created = ApiServer::Create(cfg, engine_.get(), ByteCodec::Make());
  ASSERT_TRUE(created.ok());
  server_ = std::move(created).value();
  ASSERT_TRUE(
      server_
          ->RegisterRoute("POST", R"(/v1/kv/release/(\w+))",
                          [](const HttpRequest& r) {
                            return HttpResponse{
                                200, json{{"id", r.path_matches.at(1)}, {"body", r.body}}.dump()};
                          })
          .ok());
  EXPECT_FALSE(server_->RegisterRoute("PATCHY", "/x", nullptr).ok());
  EXPECT_FALSE(server_->RegisterRoute("GET", "([", nullptr).ok());
  ASSERT_TRUE(server_->Start().ok());
  EXPECT_EQ(server_->RegisterRoute("GET", "/late", nullptr).code(),
            StatusCode::kFailedPrecondition);
  ExpectOpenAiError(Client().Post("/v1/kv/release/abc", "hi", "text/plain"), 401);
  auto r = Client().Post("/v1/kv/release/abc", {{"Authorization", "Bearer k"}}, "hi", "text/plain");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_EQ(json::parse(r->body), json({{"id", "abc"}, {"body", "hi"}}));
}

TEST_F(ApiServerTest, DisconnectMidStreamAbortsAndFreesBlocks) {
  FakeEngineOptions eo;
  eo.step_interval_ms = 10;
  StartServer(eo);
  RawClient c(server_->port());
  ASSERT_TRUE(c.connected());
  c.Post("/v1/completions",
         json{{"prompt", "abcdefgh"}, {"n", 4}, {"max_tokens", 200}, {"stream", true}}.dump());
  std::string got = c.ReadUntil("data: {");
  ASSERT_NE(got.find("data: {"), std::string::npos) << got;
  EXPECT_GT(engine_->Stats().kv_blocks_active, 0);
  c.Close();
  // 200 tokens at 10 ms would take 2 s; the abort must free the blocks long before.
  EXPECT_TRUE(Drained(1000));
  for (int i = 0;
       i < 100 && ScrapeMetric(Metrics(), "kvbridge_http_generation_requests_in_flight") != 0;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::string m = Metrics();
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_http_client_disconnects_total"), 1.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_http_generation_requests_in_flight"), 0.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_kv_blocks_active"), 0.0);
}

TEST_F(ApiServerTest, DisconnectWhileWaitingForAWholeAnswerAborts) {
  StartServer();
  engine_->SetPaused(true);  // the request is queued and never progresses on its own
  RawClient c(server_->port());
  ASSERT_TRUE(c.connected());
  c.Post("/v1/completions", json{{"prompt", "abcdefgh"}, {"max_tokens", 5}}.dump());
  for (int i = 0; i < 500 && engine_->requests_added() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(engine_->Stats().running, 1);
  c.Close();
  EXPECT_TRUE(Drained(2000));
  for (int i = 0;
       i < 100 && ScrapeMetric(Metrics(), "kvbridge_http_generation_requests_in_flight") != 0;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(ScrapeMetric(Metrics(), "kvbridge_http_client_disconnects_total"), 1.0);
}

// The server watches each request's own connection: on a keep-alive connection the second
// request is the one aborted when the client goes away, and its blocks are freed.
TEST_F(ApiServerTest, DisconnectOnTheSecondRequestOfAKeepAliveConnectionFreesBlocks) {
  StartServer();
  RawClient c(server_->port());
  ASSERT_TRUE(c.connected());
  c.Post("/v1/completions", json{{"prompt", "abcdefgh"}, {"max_tokens", 2}}.dump());
  std::string first = c.ReadUntil("\"usage\"");
  ASSERT_NE(first.find("HTTP/1.1 200"), std::string::npos) << first;
  ASSERT_TRUE(Drained(2000));
  engine_->SetPaused(true);  // the second request is queued and never progresses on its own
  c.Post("/v1/completions", json{{"prompt", "ijklmnop"}, {"max_tokens", 5}}.dump());
  for (int i = 0; i < 500 && engine_->requests_added() < 2; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_EQ(engine_->requests_added(), 2);
  ASSERT_EQ(engine_->Stats().running, 1);
  EXPECT_GT(engine_->Stats().kv_blocks_active, 0);
  c.Close();
  EXPECT_TRUE(Drained(2000));
  for (int i = 0;
       i < 100 && ScrapeMetric(Metrics(), "kvbridge_http_generation_requests_in_flight") != 0;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  std::string m = Metrics();
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_http_client_disconnects_total"), 1.0);
  EXPECT_EQ(ScrapeMetric(m, "kvbridge_kv_blocks_active"), 0.0);
}

TEST_F(ApiServerTest, SixtyFourConcurrentMixedRequests) {
  StartServer();
  constexpr int kClients = 64;
  std::atomic<int> ok{0};
  std::vector<std::thread> threads;
  std::vector<std::string> failures(kClients);
  for (int t = 0; t < kClients; ++t) {
    threads.emplace_back([&, t] {
      std::string prompt = "p" + std::to_string(t);
      httplib::Client c("127.0.0.1", server_->port());
      c.set_read_timeout(30, 0);
      std::string want;
      auto r = [&] {
        switch (t % 4) {
          case 0:
            return c.Post("/v1/completions", json{{"prompt", prompt}, {"max_tokens", 8}}.dump(),
                          "application/json");
          case 1:
            return c.Post("/v1/completions",
                          json{{"prompt", prompt}, {"max_tokens", 8}, {"stream", true}}.dump(),
                          "application/json");
          case 2:
            return c.Post(
                "/v1/chat/completions",
                json{{"messages", {{{"role", "user"}, {"content", prompt}}}}, {"max_tokens", 8}}
                    .dump(),
                "application/json");
          default:
            return c.Post("/v1/completions",
                          json{{"prompt", prompt}, {"max_tokens", 8}, {"n", 4}}.dump(),
                          "application/json");
        }
      }();
      switch (t % 4) {
        case 0:
        case 1:
          want = Expected(prompt, 8, 0);
          break;
        case 2:
          want = Expected("<|user|>\n" + prompt + "\n<|assistant|>\n", 8, 0);
          break;
        default:
          want = Expected(prompt, 8, 3);
          break;
      }
      if (!r || r->status != 200) {
        failures[t] = r ? r->body : "no response: " + httplib::to_string(r.error());
        return;
      }
      std::string text;
      if (t % 4 == 1) {
        bool done = false;
        for (const json& e : SseEvents(r->body, &done))
          text += e["choices"][0]["text"].get<std::string>();
        if (!done) failures[t] = "no [DONE]";
      } else {
        json j = json::parse(r->body);
        const json& c = j["choices"].back();
        text =
            t % 4 == 2 ? c["message"]["content"].get<std::string>() : c["text"].get<std::string>();
      }
      if (text != want) failures[t] = "text " + text + " != " + want;
      if (failures[t].empty()) ++ok;
    });
  }
  for (auto& th : threads) th.join();
  for (int t = 0; t < kClients; ++t) EXPECT_EQ(failures[t], "") << "client " << t;
  EXPECT_EQ(ok.load(), kClients);
  EXPECT_TRUE(Drained());
  EXPECT_EQ(ScrapeMetric(Metrics(), "kvbridge_http_requests_total", "code=\"200\""), kClients);
}

TEST_F(ApiServerTest, StopEndsAStreamPromptly) {
  FakeEngineOptions eo;
  eo.step_interval_ms = 20;
  StartServer(eo);
  std::thread client([&] {
    auto r = Post("/v1/completions", {{"prompt", "a"}, {"max_tokens", 200}, {"stream", true}});
    // Either the abort reached the stream (finish_reason "abort", then [DONE]) or the server
    // closed the connection first (no response object); never the full 200 tokens.
    if (!r) return;
    EXPECT_EQ(r->status, 200);
    bool done = false;
    auto events = SseEvents(r->body, &done);
    std::string text;
    for (const json& e : events) text += e["choices"][0]["text"].get<std::string>();
    EXPECT_LT(text.size(), 200u);
    if (done) {
      EXPECT_EQ(events.back()["choices"][0]["finish_reason"], "abort");
    }
  });
  for (int i = 0; i < 500 && engine_->requests_added() == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(engine_->requests_added(), 1);
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  auto t0 = std::chrono::steady_clock::now();
  server_->Stop();
  client.join();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_TRUE(Drained());
}

// TLS (issue 22; vLLM's --ssl-certfile / --ssl-keyfile / --ssl-ca-certs): with a certificate
// the server answers HTTPS only — a client that trusts the certificate gets the API, a plain
// HTTP client gets no answer, a client that does not trust it fails the handshake; with a CA
// bundle, a client without a certificate it signed is refused. Bad TLS configs fail Create.
// Over TLS the request's socket comes from its SSL session: a client that goes away mid-stream
// aborts its request and frees its blocks, as over plain HTTP.
TEST_F(ApiServerTest, TlsDisconnectMidStreamAbortsAndFreesBlocks) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("kvb_tls_disc_" + std::to_string(::getpid())))
          .string();
  std::filesystem::create_directories(dir);
  const TestCert cert = MakeSelfSignedCert(dir, "server");
  FakeEngineOptions eo;
  eo.step_interval_ms = 10;
  ServerConfig cfg;
  cfg.ssl_certfile = cert.cert;
  cfg.ssl_keyfile = cert.key;
  StartServer(eo, cfg);
  httplib::SSLClient c("127.0.0.1", server_->port());
  c.set_ca_cert_path(cert.cert.c_str());
  c.enable_server_certificate_verification(true);
  int chunks = 0;
  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.body = json{{"prompt", "abcdefgh"}, {"n", 4}, {"max_tokens", 200}, {"stream", true}}.dump();
  req.set_header("Content-Type", "application/json");
  req.content_receiver = [&](const char*, size_t, uint64_t, uint64_t) {
    return ++chunks < 2;  // go away after the first chunks
  };
  auto r = c.send(req);
  c.stop();
  EXPECT_GE(chunks, 2);
  // 200 tokens at 10 ms would take 2 s; the abort must free the blocks long before.
  EXPECT_TRUE(Drained(1000));
  // (Metrics() speaks plain HTTP: read the server's own registry instead.)
  for (int i = 0; i < 100 && ScrapeMetric(server_->metrics().Render(),
                                          "kvbridge_http_generation_requests_in_flight") != 0;
       ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(ScrapeMetric(server_->metrics().Render(), "kvbridge_http_client_disconnects_total"),
            1.0);
  EXPECT_EQ(engine_->Stats().kv_blocks_active, 0);
  server_->Stop();
  server_.reset();
  std::filesystem::remove_all(dir);
}

TEST_F(ApiServerTest, TlsServesHttpsOnly) {
  const std::string dir =
      (std::filesystem::temp_directory_path() / ("kvb_tls_" + std::to_string(::getpid()))).string();
  std::filesystem::create_directories(dir);
  const TestCert server_cert = MakeSelfSignedCert(dir, "server");
  const TestCert other = MakeSelfSignedCert(dir, "other");
  ServerConfig cfg;
  cfg.ssl_certfile = server_cert.cert;
  cfg.ssl_keyfile = server_cert.key;
  StartServer({}, cfg);
  {
    httplib::SSLClient c("127.0.0.1", server_->port());
    c.set_ca_cert_path(server_cert.cert.c_str());
    c.enable_server_certificate_verification(true);
    auto r = c.Get("/health");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 200);
    auto gen = c.Post("/v1/completions",
                      json{{"model", "tiny"}, {"prompt", "hi"}, {"max_tokens", 2}}.dump(),
                      "application/json");
    ASSERT_TRUE(gen) << httplib::to_string(gen.error());
    EXPECT_EQ(gen->status, 200) << gen->body;
  }
  {
    httplib::Client plain("127.0.0.1", server_->port());
    plain.set_read_timeout(2, 0);
    EXPECT_FALSE(plain.Get("/health")) << "plain HTTP was answered";
  }
  {
    httplib::SSLClient untrusting("127.0.0.1", server_->port());
    untrusting.set_ca_cert_path(other.cert.c_str());  // trusts another certificate only
    untrusting.enable_server_certificate_verification(true);
    auto r = untrusting.Get("/health");
    EXPECT_FALSE(r);
    if (!r) {
      EXPECT_EQ(r.error(), httplib::Error::SSLServerVerification);
    }
  }
  server_->Stop();
  server_.reset();
  // Mutual TLS: only clients with a certificate the bundle vouches for.
  cfg.ssl_ca_certs = other.cert;
  StartServer({}, cfg);
  {
    httplib::SSLClient anonymous("127.0.0.1", server_->port());
    anonymous.set_ca_cert_path(server_cert.cert.c_str());
    EXPECT_FALSE(anonymous.Get("/health")) << "a client without a certificate was served";
    httplib::SSLClient known("127.0.0.1", server_->port(), other.cert, other.key);
    known.set_ca_cert_path(server_cert.cert.c_str());
    auto r = known.Get("/health");
    ASSERT_TRUE(r) << httplib::to_string(r.error());
    EXPECT_EQ(r->status, 200);
  }
  // Bad configurations name the problem.
  struct Bad {
    std::string cert, key, ca, want;
  };
  for (const Bad& b : {Bad{server_cert.cert, "", "", "both --ssl-certfile and --ssl-keyfile"},
                       Bad{"", "", other.cert, "--ssl-ca-certs needs"},
                       Bad{dir + "/missing.crt", server_cert.key, "", "cannot read"},
                       Bad{server_cert.cert, other.key, "", "the key must match"}}) {
    ServerConfig bad;
    bad.ssl_certfile = b.cert;
    bad.ssl_keyfile = b.key;
    bad.ssl_ca_certs = b.ca;
    auto created = ApiServer::Create(bad, engine_.get(), ByteCodec::Make());
    ASSERT_FALSE(created.ok()) << b.want;
    EXPECT_EQ(created.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(created.status().message().find(b.want), std::string::npos)
        << created.status().ToString();
  }
  std::filesystem::remove_all(dir);
}

// Tools and reasoning end to end: the request's tools reach the checkpoint's template, and a
// fixed model output (the fake engine's script) comes back as vLLM's hermes + qwen3 parsers
// shape it, whole and streamed.
class ToolsEndToEndTest : public ApiServerTest {
 protected:
  void Start(const std::string& script, bool flags = true) {
    auto t = ChatTemplate::Parse(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
        "{% if tools %}<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>{% endif %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}",
        "hermes-like");
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    auto templates = std::make_shared<ChatTemplates>();
    templates->templates.emplace_back("default", *t);
    ServerConfig cfg;
    cfg.chat_templates = templates;
    if (flags) {
      cfg.enable_auto_tool_choice = true;
      cfg.tool_call_parser = "hermes";
      cfg.reasoning_parser = "qwen3";
    }
    FakeEngineOptions e;
    e.scripted_output = script;
    e.max_model_len = 512;
    StartServer(e, cfg);
  }
  static json Body(bool stream) {
    return json{{"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}},
                {"tools",
                 {{{"type", "function"},
                   {"function",
                    {{"name", "get_weather"},
                     {"parameters",
                      {{"type", "object"}, {"properties", {{"city", {{"type", "string"}}}}}}}}}}}},
                {"max_tokens", 200},
                {"stream", stream}};
  }
  static std::vector<json> Events(const std::string& body) {
    std::vector<json> out;
    size_t pos = 0;
    while ((pos = body.find("data: ", pos)) != std::string::npos) {
      const size_t end = body.find("\n\n", pos);
      const std::string payload = body.substr(pos + 6, end - pos - 6);
      pos = end;
      if (payload != "[DONE]") out.push_back(json::parse(payload));
    }
    return out;
  }
};

TEST_F(ToolsEndToEndTest, ToolCallsAndReasoningWholeAndStreamed) {
  Start(
      "<think>plan</think>Sure.<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
      "{\"city\":\"Paris\"}}\n</tool_call>");
  // The tools reach the template (tojson of the request's tool, keys sorted as the server's
  // json keeps them).
  auto tk = Post("/tokenize", Body(false));
  ASSERT_TRUE(tk);
  ASSERT_EQ(tk->status, 200) << tk->body;
  std::string rendered;
  const json tk_body = json::parse(tk->body);
  for (const json& id : tk_body["tokens"]) rendered.push_back(id.get<char>());
  EXPECT_EQ(rendered,
            "<|user|>Weather in Paris?<tools>{\"function\": {\"name\": \"get_weather\", "
            "\"parameters\": {\"properties\": {\"city\": {\"type\": \"string\"}}, \"type\": "
            "\"object\"}}, \"type\": \"function\"}</tools><|assistant|>");

  auto r = Post("/v1/chat/completions", Body(false));
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  json choice = json::parse(r->body)["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  json message = choice["message"];
  ASSERT_EQ(message["tool_calls"].size(), 1u);
  const std::string id = message["tool_calls"][0]["id"];
  EXPECT_EQ(id.rfind("chatcmpl-tool-", 0), 0u);
  message["tool_calls"][0].erase("id");
  EXPECT_EQ(message, json::parse(R"({"role": "assistant", "reasoning_content": "plan",
      "content": "Sure.", "tool_calls": [{"type": "function", "function": {"name": "get_weather",
      "arguments": "{\"city\": \"Paris\"}"}}]})"));

  auto s = Post("/v1/chat/completions", Body(true));
  ASSERT_TRUE(s);
  ASSERT_EQ(s->status, 200);
  std::string reasoning, content;
  std::vector<json> calls;
  json last;
  for (const json& e : Events(s->body)) {
    const json& c = e["choices"][0];
    const json& d = c["delta"];
    reasoning += d.value("reasoning_content", "");
    content += d.value("content", "");
    if (d.contains("tool_calls")) calls.push_back(d["tool_calls"][0]);
    last = c;
  }
  EXPECT_EQ(reasoning, "plan");
  EXPECT_EQ(content, "Sure.");
  ASSERT_EQ(calls.size(), 2u);
  EXPECT_EQ(calls[0]["index"], 0);
  EXPECT_EQ(calls[0]["type"], "function");
  EXPECT_EQ(calls[0]["function"], json({{"name", "get_weather"}}));
  EXPECT_EQ(calls[1], json::parse(R"({"index": 0, "function": {"arguments":
      "{\"city\": \"Paris\"}"}})"));
  EXPECT_EQ(last["finish_reason"], "tool_calls");

  // Bad tools / tool_choice: 400, nothing reaches the engine.
  const int64_t before = engine_->requests_added();
  struct Bad {
    const char* key;
    json value;
    const char* says;
  };
  const Bad bad[] = {
      {"tools", "get_weather", "'tools' must be a list"},
      {"tools", json::array({{{"type", "function"}}}), "each tool must be"},
      {"tool_choice", "required", "required\\\" is not supported (it needs"},
      {"tool_choice",
       {{"type", "function"}, {"function", {{"name", "get_weather"}}}},
       "named function"},
      {"tool_choice", "sometimes", "'tool_choice' must be"},
      {"tool_choice", 3, "'tool_choice' must be"},
  };
  for (const Bad& b : bad) {
    json body = Body(false);
    body[b.key] = b.value;
    auto e = Post("/v1/chat/completions", body);
    ASSERT_TRUE(e);
    EXPECT_EQ(e->status, 400) << b.key << ": " << e->body;
    EXPECT_NE(e->body.find(b.says), std::string::npos) << e->body;
  }
  EXPECT_EQ(engine_->requests_added(), before);
  EXPECT_TRUE(Drained());
}

TEST_F(ToolsEndToEndTest, MalformedToolCallIsContent) {
  const std::string script = "<tool_call>{\"name\": \"get_weather\", \"arguments\": }</tool_call>";
  Start(script);
  auto r = Post("/v1/chat/completions", Body(false));
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  const json choice = json::parse(r->body)["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "stop");
  EXPECT_EQ(choice["message"],
            json({{"role", "assistant"}, {"content", script}, {"reasoning_content", nullptr}}));
  auto s = Post("/v1/chat/completions", Body(true));
  ASSERT_TRUE(s);
  std::string content;
  for (const json& e : Events(s->body)) {
    content += e["choices"][0]["delta"].value("content", "");
    EXPECT_FALSE(e["choices"][0]["delta"].contains("tool_calls"));
  }
  EXPECT_EQ(content, script);
}

// Without --enable-auto-tool-choice: tools with tool_choice "auto" (the default with tools) is
// vLLM's 400; tool_choice "none" renders them and returns plain content.
TEST_F(ToolsEndToEndTest, AutoToolChoiceNeedsTheFlags) {
  Start("<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>", /*flags=*/false);
  auto r = Post("/v1/chat/completions", Body(false));
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_NE(r->body.find("\\\"auto\\\" tool choice requires --enable-auto-tool-choice and "
                         "--tool-call-parser to be set"),
            std::string::npos)
      << r->body;
  json body = Body(false);
  body["tool_choice"] = "none";
  r = Post("/v1/chat/completions", body);
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  EXPECT_EQ(json::parse(r->body)["choices"][0]["message"],
            json({{"role", "assistant"},
                  {"content", "<tool_call>{\"name\": \"f\", \"arguments\": {}}</tool_call>"}}));
  ServerConfig cfg;
  cfg.enable_auto_tool_choice = true;
  FakeEngine engine;
  auto refused = ApiServer::Create(cfg, &engine, ByteCodec::Make());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("`--tool-call-parser` must be set"), std::string::npos);
  cfg.tool_call_parser = "pythonic";
  refused = ApiServer::Create(cfg, &engine, ByteCodec::Make());
  ASSERT_FALSE(refused.ok());
  EXPECT_NE(refused.status().message().find("hermes and llama3_json"), std::string::npos);
  engine.Shutdown();
}

}  // namespace
}  // namespace kvbridge::server
