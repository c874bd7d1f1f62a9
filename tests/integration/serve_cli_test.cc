// `kvbridge serve` as a user runs it: a separate process on a free port, driven over HTTP.
#include <gtest/gtest.h>
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <thread>

#include "kvbridge/common/metrics.h"
#include "support/free_port.h"
#include "support/subprocess.h"
#include "support/test_cert.h"

namespace kvbridge {
namespace {

using nlohmann::json;
using testing::FreePort;
using testing::KvbridgeBin;
using testing::MakeTempDir;
using testing::Subprocess;
using testing::WaitForHttpOk;

class ServeCliTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    model_dir_ = new std::string(MakeTempDir("kvb_serve_cli") + "/tiny");
    Subprocess make(
        {KvbridgeBin(), "make-model", "--preset", "tiny", "--seed", "5", "--out", *model_dir_});
    ASSERT_EQ(make.Wait(60'000), 0);
  }
  static std::string* model_dir_;
};
std::string* ServeCliTest::model_dir_ = nullptr;

TEST_F(ServeCliTest, ServesAnswersErrorsAndStopsOnSigterm) {
  const int port = FreePort();
  const std::string log = MakeTempDir("kvb_serve_cli_log") + "/serve.log";
  Subprocess serve(
      {KvbridgeBin(), "serve", *model_dir_, "--port", std::to_string(port), "--served-model-name",
       "tiny", "--max-model-len", "128", "--num-kv-blocks", "64", "--api-key", "k1", "--seed", "3"},
      log);
  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", port, "/health", 60'000)) << serve.ReadLog();
  EXPECT_NE(serve.ReadLog().find("listening on http://127.0.0.1:" + std::to_string(port)),
            std::string::npos)
      << serve.ReadLog();

  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(60, 0);
  httplib::Headers auth{{"Authorization", "Bearer k1"}};
  auto r = c.Post("/v1/completions", auth,
                  json{{"model", "tiny"},
                       {"prompt", "abc"},
                       {"n", 2},
                       {"max_tokens", 4},
                       {"ignore_eos", true},
                       {"logprobs", 1}}
                      .dump(),
                  "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200) << r->body;
  json j = json::parse(r->body);
  ASSERT_EQ(j["choices"].size(), 2u);
  EXPECT_EQ(j["choices"][1]["logprobs"]["tokens"].size(), 4u);
  EXPECT_EQ(j["usage"]["completion_tokens"], 8);

  r = c.Post("/v1/completions", json{{"prompt", "abc"}}.dump(), "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 401);
  r = c.Post("/v1/completions", auth, json{{"prompt", std::string(200, 'a')}}.dump(),
             "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 400);
  EXPECT_EQ(json::parse(r->body)["error"]["type"], "invalid_request_error");
  r = c.Post("/v1/completions", auth, json{{"prompt", "a"}, {"model", "other"}}.dump(),
             "application/json");
  ASSERT_TRUE(r);
  EXPECT_EQ(r->status, 404);

  r = c.Post("/v1/chat/completions", auth,
             json{{"messages", {{{"role", "user"}, {"content", "hi"}}}},
                  {"max_tokens", 3},
                  {"stream", true}}
                 .dump(),
             "application/json");
  ASSERT_TRUE(r);
  ASSERT_EQ(r->status, 200);
  EXPECT_NE(r->body.find("data: [DONE]\n\n"), std::string::npos);

  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(ScrapeMetric(m->body, "kvbridge_kv_blocks_total"), 64);
  EXPECT_EQ(ScrapeMetric(m->body, "kvbridge_kv_blocks_active"), 0);
  EXPECT_EQ(ScrapeMetric(m->body, "kvbridge_http_requests_total", "code=\"401\""), 1);

  serve.Signal(SIGTERM);
  EXPECT_EQ(serve.Wait(15'000), 0) << serve.ReadLog();
}

TEST_F(ServeCliTest, BadFlagsFailClearly) {
  Subprocess bad({KvbridgeBin(), "serve", *model_dir_, "--kv-cache-dtype", "int4", "--port",
                  std::to_string(FreePort())},
                 MakeTempDir("kvb_serve_bad") + "/log");
  EXPECT_EQ(bad.Wait(30'000), 1);
  EXPECT_NE(bad.ReadLog().find("--kv-cache-dtype must be auto|fp32|bf16|fp8"), std::string::npos)
      << bad.ReadLog();
  Subprocess missing(
      {KvbridgeBin(), "serve", "/nonexistent/model", "--port", std::to_string(FreePort())},
      MakeTempDir("kvb_serve_bad") + "/log");
  EXPECT_EQ(missing.Wait(30'000), 1);
}

// No open P/D engine by accident (issue 22): a P/D config on a non-loopback --host without
// --cluster-token refuses to start naming both flags; --insecure-no-cluster-token starts it and
// says so in the log; with a token, a missing or wrong one on kv_transfer_params or /v1/kv/* is
// 403 and changes nothing.
TEST_F(ServeCliTest, PdEngineNeedsClusterTokenOffLoopback) {
  const std::string pd = R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_producer"})";
  Subprocess open_pd({KvbridgeBin(), "serve", *model_dir_, "--host", "0.0.0.0", "--port",
                      std::to_string(FreePort()), "--kv-transfer-config", pd},
                     MakeTempDir("kvb_serve_open") + "/log");
  EXPECT_EQ(open_pd.Wait(30'000), 1);
  EXPECT_NE(open_pd.ReadLog().find("on the non-loopback --host 0.0.0.0 needs --cluster-token"),
            std::string::npos)
      << open_pd.ReadLog();
  EXPECT_NE(open_pd.ReadLog().find("--insecure-no-cluster-token"), std::string::npos)
      << open_pd.ReadLog();

  {
    const int port = FreePort();
    Subprocess insecure(
        {KvbridgeBin(), "serve", *model_dir_, "--host", "0.0.0.0", "--port", std::to_string(port),
         "--num-kv-blocks", "64", "--kv-transfer-config", pd, "--insecure-no-cluster-token"},
        MakeTempDir("kvb_serve_insecure") + "/log");
    ASSERT_TRUE(WaitForHttpOk("127.0.0.1", port, "/health", 60'000)) << insecure.ReadLog();
    EXPECT_NE(insecure.ReadLog().find("--insecure-no-cluster-token: P/D engine on 0.0.0.0"),
              std::string::npos)
        << insecure.ReadLog();
    insecure.Signal(SIGTERM);
    EXPECT_EQ(insecure.Wait(15'000), 0) << insecure.ReadLog();
  }

  const int port = FreePort();
  Subprocess serve(
      {KvbridgeBin(), "serve", *model_dir_, "--port", std::to_string(port), "--served-model-name",
       "tiny", "--num-kv-blocks", "64", "--kv-transfer-config", pd, "--cluster-token", "tok-22"},
      MakeTempDir("kvb_serve_tok") + "/log");
  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", port, "/health", 60'000)) << serve.ReadLog();
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(60, 0);
  json body{{"model", "tiny"}, {"prompt", "hold me"}, {"max_tokens", 1}};
  body["kv_transfer_params"] = {{"do_remote_decode", true}, {"transfer_id", "t-22"}};
  for (const httplib::Headers& h :
       {httplib::Headers{}, httplib::Headers{{"X-KVBridge-Cluster-Token", "wrong"}}}) {
    auto r = c.Post("/v1/completions", h, body.dump(), "application/json");
    ASSERT_TRUE(r);
    EXPECT_EQ(r->status, 403) << r->body;
    auto md = c.Get("/v1/kv/metadata/0", h);
    ASSERT_TRUE(md);
    EXPECT_EQ(md->status, 403) << md->body;
  }
  auto m = c.Get("/metrics");
  ASSERT_TRUE(m);
  EXPECT_EQ(ScrapeMetric(m->body, "kvbridge_prompt_tokens_total"), 0) << "a refused call ran";
  EXPECT_EQ(ScrapeMetric(m->body, "kvbridge_kv_blocks_held_for_transfer"), 0);
  EXPECT_EQ(ScrapeMetric(m->body, "kvbridge_kv_transfer_table_entries"), 0);
  // The right token is served (and holds the blocks for the transfer).
  auto ok = c.Post("/v1/completions", {{"X-KVBridge-Cluster-Token", "tok-22"}}, body.dump(),
                   "application/json");
  ASSERT_TRUE(ok);
  EXPECT_EQ(ok->status, 200) << ok->body;
  // SIGTERM drains (issue 21): the engine waits for its hold, which no decode claims here, until
  // it is released; then it exits 0.
  serve.Signal(SIGTERM);
  EXPECT_EQ(serve.Wait(300), -1) << "stopped with a hold outstanding: " << serve.ReadLog();
  auto rel = c.Post("/v1/kv/release", {{"X-KVBridge-Cluster-Token", "tok-22"}},
                    R"({"transfer_id":"t-22"})", "application/json");
  ASSERT_TRUE(rel);
  EXPECT_EQ(rel->status, 200) << rel->body;
  EXPECT_EQ(serve.Wait(15'000), 0) << serve.ReadLog();
  EXPECT_NE(serve.ReadLog().find("drained in"), std::string::npos) << serve.ReadLog();
}

// Every architecture through make-model --arch and serve (tiny shapes; the real-shaped presets
// are 1-2.5 GB and stay out of CI's unit and integration runs).
TEST(ServeCliArchs, MakeModelAndServeEveryArchitecture) {
  for (const char* arch : {"mistral", "qwen2", "qwen3"}) {
    SCOPED_TRACE(arch);
    const std::string dir = MakeTempDir("kvb_serve_arch") + "/" + arch;
    Subprocess make({KvbridgeBin(), "make-model", "--preset", "tiny", "--arch", arch, "--seed", "2",
                     "--out", dir},
                    dir + ".make.log");
    ASSERT_EQ(make.Wait(60'000), 0) << make.ReadLog();
    EXPECT_NE(make.ReadLog().find(std::string("arch ") + arch), std::string::npos)
        << make.ReadLog();
    const int port = FreePort();
    Subprocess serve({KvbridgeBin(), "serve", dir, "--port", std::to_string(port),
                      "--max-model-len", "128", "--num-kv-blocks", "32"},
                     dir + ".serve.log");
    ASSERT_TRUE(WaitForHttpOk("127.0.0.1", port, "/health", 60'000)) << serve.ReadLog();
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(60, 0);
    auto r = c.Post("/v1/completions",
                    json{{"prompt", "abc"}, {"max_tokens", 4}, {"ignore_eos", true}}.dump(),
                    "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(json::parse(r->body)["usage"]["completion_tokens"], 4) << r->body;
    serve.Signal(SIGTERM);
    EXPECT_EQ(serve.Wait(15'000), 0) << serve.ReadLog();
  }
  // A real-shaped preset's arch is fixed (refused before anything is written).
  const std::string dir = MakeTempDir("kvb_make_bad") + "/m";
  Subprocess bad(
      {KvbridgeBin(), "make-model", "--preset", "qwen3-0.6b", "--arch", "llama", "--out", dir},
      dir + ".log");
  EXPECT_EQ(bad.Wait(30'000), 1);
  EXPECT_NE(bad.ReadLog().find("preset 'qwen3-0.6b' is a qwen3 model, not llama"),
            std::string::npos)
      << bad.ReadLog();
}

// `generate` and `serve` on every real-shaped preset (random bf16 weights, the published configs:
// qwen2.5-0.5b 0.99 GB, qwen3-0.6b 1.19 GB, llama-3.2-1b 2.47 GB with its llama3 rope scaling):
// each loads with its weights BF16-resident as stored, generates 2 tokens and serves a 2-token
// completion; each model is deleted after. The P/D case on qwen3-0.6b is up_e2e_test's
// UpRealShape.
TEST(ServeCliArchs, RealShapedPresetsGenerateAndServe) {
  const auto t0 = std::chrono::steady_clock::now();
  for (const char* preset : {"qwen2.5-0.5b", "qwen3-0.6b", "llama-3.2-1b"}) {
    SCOPED_TRACE(preset);
    const std::string base = MakeTempDir("kvb_real_preset");
    const std::string dir = base + "/m";
    Subprocess make({KvbridgeBin(), "make-model", "--preset", preset, "--seed", "1", "--out", dir},
                    base + "/make.log");
    ASSERT_EQ(make.Wait(300'000), 0) << make.ReadLog();
    Subprocess gen({KvbridgeBin(), "generate", dir, "--prompt", "Hello", "--max-tokens", "2"},
                   base + "/generate.log");
    EXPECT_EQ(gen.Wait(300'000), 0) << gen.ReadLog();
    EXPECT_NE(gen.ReadLog().find("generated 2 tokens"), std::string::npos) << gen.ReadLog();
    EXPECT_NE(gen.ReadLog().find("weights BF16"), std::string::npos) << gen.ReadLog();
    const int port = FreePort();
    Subprocess serve({KvbridgeBin(), "serve", dir, "--port", std::to_string(port),
                      "--max-model-len", "128", "--num-kv-blocks", "16"},
                     base + "/serve.log");
    ASSERT_TRUE(WaitForHttpOk("127.0.0.1", port, "/health", 300'000)) << serve.ReadLog();
    EXPECT_NE(serve.ReadLog().find("model: weights BF16 resident"), std::string::npos)
        << serve.ReadLog();
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(120, 0);
    auto r = c.Post("/v1/completions",
                    json{{"prompt", "abc"}, {"max_tokens", 2}, {"ignore_eos", true}}.dump(),
                    "application/json");
    ASSERT_TRUE(r);
    ASSERT_EQ(r->status, 200) << r->body;
    EXPECT_EQ(json::parse(r->body)["usage"]["completion_tokens"], 2) << r->body;
    serve.Signal(SIGTERM);
    EXPECT_EQ(serve.Wait(30'000), 0) << serve.ReadLog();
    std::filesystem::remove_all(dir);
  }
  std::printf("real-shaped presets: %.1f s\n",
              std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
}

// TLS as vLLM spells it (issue 22): --ssl-certfile/--ssl-keyfile serve HTTPS only (a cert made
// at test time); a P/D engine with TLS refuses to start (the proxy and the connector speak
// plain HTTP), and so does a certificate without its key.
TEST_F(ServeCliTest, SslCertfileServesHttps) {
  const std::string dir = MakeTempDir("kvb_serve_tls");
  const testing::TestCert cert = testing::MakeSelfSignedCert(dir, "engine");
  const int port = FreePort();
  Subprocess serve(
      {KvbridgeBin(), "serve", *model_dir_, "--port", std::to_string(port), "--served-model-name",
       "tiny", "--num-kv-blocks", "64", "--ssl-certfile", cert.cert, "--ssl-keyfile", cert.key},
      dir + "/serve.log");
  httplib::SSLClient c("127.0.0.1", port);
  c.set_ca_cert_path(cert.cert.c_str());
  c.enable_server_certificate_verification(true);
  c.set_read_timeout(60, 0);
  bool up = false;
  for (int i = 0; i < 600 && !up; ++i) {
    auto h = c.Get("/health");
    up = h && h->status == 200;
    if (!up) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  ASSERT_TRUE(up) << serve.ReadLog();
  EXPECT_NE(serve.ReadLog().find("listening on https://127.0.0.1:" + std::to_string(port)),
            std::string::npos)
      << serve.ReadLog();
  auto r = c.Post("/v1/completions",
                  json{{"model", "tiny"}, {"prompt", "abc"}, {"max_tokens", 3}}.dump(),
                  "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200) << r->body;
  httplib::Client plain("127.0.0.1", port);
  plain.set_read_timeout(2, 0);
  EXPECT_FALSE(plain.Get("/health")) << "plain HTTP was answered";
  serve.Signal(SIGTERM);
  EXPECT_EQ(serve.Wait(15'000), 0) << serve.ReadLog();

  // P/D over TLS runs (pd_serve_test PdTls); a CA bundle for the peers that cannot be read stops
  // it at start.
  const std::string pd = R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_producer"})";
  Subprocess tls_pd({KvbridgeBin(), "serve", *model_dir_, "--port", std::to_string(FreePort()),
                     "--kv-transfer-config", pd, "--ssl-certfile", cert.cert, "--ssl-keyfile",
                     cert.key, "--ssl-peer-ca-certs", dir + "/missing-ca.pem"},
                    dir + "/pd.log");
  EXPECT_EQ(tls_pd.Wait(30'000), 1);
  EXPECT_NE(tls_pd.ReadLog().find("--ssl-peer-ca-certs: cannot read"), std::string::npos)
      << tls_pd.ReadLog();
  Subprocess no_key({KvbridgeBin(), "serve", *model_dir_, "--port", std::to_string(FreePort()),
                     "--ssl-certfile", cert.cert},
                    dir + "/nokey.log");
  EXPECT_EQ(no_key.Wait(30'000), 1);
  EXPECT_NE(no_key.ReadLog().find("both --ssl-certfile and --ssl-keyfile"), std::string::npos)
      << no_key.ReadLog();
}

// A vLLM command line's flags with no effect here are accepted and logged once as ignored.
TEST_F(ServeCliTest, IgnoredVllmFlagsAreAcceptedAndLogged) {
  const int port = FreePort();
  const std::string log = MakeTempDir("kvb_serve_vllm") + "/serve.log";
  Subprocess serve(
      {KvbridgeBin(), "serve", *model_dir_, "--port", std::to_string(port), "--trust-remote-code",
       "--enforce-eager", "--swap-space", "4", "--disable-log-requests"},
      log);
  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", port, "/health", 60'000)) << serve.ReadLog();
  const std::string out = serve.ReadLog();
  for (const char* f :
       {"--trust-remote-code", "--enforce-eager", "--swap-space 4", "--disable-log-requests"}) {
    EXPECT_NE(out.find(std::string(f) + ": accepted for vLLM compatibility"), std::string::npos)
        << f << "\n"
        << out;
  }
  serve.Signal(SIGTERM);
  EXPECT_EQ(serve.Wait(15'000), 0) << serve.ReadLog();
}

// generation_config.json as vLLM reads it: its eos_token_id ids stop in every mode (the
// tokenizer's EOS reports stop_reason null, another id reports itself), its sampling values are
// the defaults of requests that leave them out with --generation-config auto (logged as vLLM
// logs it), not with vllm; a directory given instead must hold the file.
TEST_F(ServeCliTest, GenerationConfigEosAndDefaultsAsVllm) {
  const std::string dir = MakeTempDir("kvb_serve_gencfg");
  const std::string model = dir + "/tiny";
  Subprocess make({KvbridgeBin(), "make-model", "--preset", "tiny", "--seed", "5", "--out", model});
  ASSERT_EQ(make.Wait(60'000), 0);
  auto write_gen = [&](const json& j) { std::ofstream(model + "/generation_config.json") << j; };
  auto serve = [&](const std::vector<std::string>& extra, const std::string& log, int* port) {
    *port = FreePort();
    std::vector<std::string> args = {KvbridgeBin(), "serve", model, "--port",
                                     std::to_string(*port)};
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<Subprocess>(args, dir + "/" + log);
  };
  auto post = [](int port, const json& body) {
    httplib::Client c("127.0.0.1", port);
    c.set_read_timeout(60, 0);
    auto r = c.Post("/v1/completions", body.dump(), "application/json");
    return r && r->status == 200 ? json::parse(r->body) : json{{"_error", r ? r->body : "none"}};
  };
  auto ids_of = [](const json& answer) {
    std::vector<int> ids;
    for (const json& t : answer["choices"][0]["logprobs"]["tokens"]) {
      ids.push_back(std::stoi(t.get<std::string>().substr(9)));
    }
    return ids;
  };
  const json greedy{{"prompt", "abc"},    {"max_tokens", 6}, {"temperature", 0},
                    {"ignore_eos", true}, {"logprobs", 1},   {"return_tokens_as_token_ids", true}};
  json defaulted = greedy;
  defaulted.erase("temperature");
  defaulted["seed"] = 1;

  // vllm: the file's temperature 0 is no default; sampled and greedy answers differ.
  write_gen({{"temperature", 0.0}, {"eos_token_id", 257}});
  int port = 0;
  auto a = serve({"--generation-config", "vllm"}, "vllm.log", &port);
  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", port, "/health", 60'000)) << a->ReadLog();
  const json g = post(port, greedy);
  ASSERT_FALSE(g.contains("_error")) << g.dump();
  const std::vector<int> want = ids_of(g);
  ASSERT_EQ(want.size(), 6u);
  EXPECT_NE(ids_of(post(port, defaulted)), want);
  EXPECT_EQ(a->ReadLog().find("Default sampling parameters"), std::string::npos);
  a->Signal(SIGTERM);
  EXPECT_EQ(a->Wait(15'000), 0);

  // auto: temperature 0 is the default (top_k 50 equals transformers' default: none); the
  // file's eos ids stop: the third greedy token ends the answer, its id the stop_reason.
  const int stop_id = want[2];
  write_gen({{"temperature", 0.0}, {"top_k", 50}, {"eos_token_id", {257, stop_id}}});
  auto b = serve({}, "auto.log", &port);
  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", port, "/health", 60'000)) << b->ReadLog();
  EXPECT_EQ(ids_of(post(port, defaulted)), want);  // ignore_eos: no stop
  json stopping = defaulted;
  stopping.erase("ignore_eos");
  const json s = post(port, stopping);
  ASSERT_FALSE(s.contains("_error")) << s.dump();
  const size_t first = std::find(want.begin(), want.end(), stop_id) - want.begin();
  EXPECT_EQ(ids_of(s), std::vector<int>(want.begin(), want.begin() + first + 1));
  EXPECT_EQ(s["choices"][0]["finish_reason"], "stop");
  EXPECT_EQ(s["choices"][0]["stop_reason"], stop_id);
  const std::string log = b->ReadLog();
  EXPECT_NE(log.find("Default sampling parameters have been overridden by the model's Hugging "
                     "Face generation config recommended from the model creator"),
            std::string::npos)
      << log;
  EXPECT_NE(log.find("{\"temperature\":0.0}"), std::string::npos) << log;
  b->Signal(SIGTERM);
  EXPECT_EQ(b->Wait(15'000), 0);

  // A directory without the file; a bad file; tool flags without a parser: refused at start.
  for (const auto& extra :
       std::vector<std::vector<std::string>>{{"--generation-config", dir + "/nowhere"},
                                             {"--enable-auto-tool-choice"},
                                             {"--tool-call-parser", "pythonic"},
                                             {"--reasoning-parser", "granite"}}) {
    auto bad = serve(extra, "bad.log", &port);
    EXPECT_EQ(bad->Wait(30'000), 1) << extra[0];
    const std::string out = bad->ReadLog();
    EXPECT_TRUE(out.find("nowhere") != std::string::npos ||
                out.find("--tool-call-parser") != std::string::npos ||
                out.find("qwen3") != std::string::npos)
        << out;
  }
  write_gen({{"eos_token_id", "x"}});
  auto bad = serve({}, "badfile.log", &port);
  EXPECT_EQ(bad->Wait(30'000), 1);
  EXPECT_NE(bad->ReadLog().find("generation_config.json: 'eos_token_id'"), std::string::npos)
      << bad->ReadLog();
}

// make-model --tokenizer: a missing directory, or one without tokenizer.json, fails naming it.
TEST_F(ServeCliTest, MakeModelTokenizerErrorsNameThePath) {
  const std::string dir = MakeTempDir("kvb_mm_tok");
  Subprocess none({KvbridgeBin(), "make-model", "--preset", "tiny", "--tokenizer",
                   "/nonexistent/tok", "--out", dir + "/m1"},
                  dir + "/log1");
  EXPECT_EQ(none.Wait(30'000), 1);
  EXPECT_NE(none.ReadLog().find("--tokenizer /nonexistent/tok: not a directory"), std::string::npos)
      << none.ReadLog();
  Subprocess empty(
      {KvbridgeBin(), "make-model", "--preset", "tiny", "--tokenizer", dir, "--out", dir + "/m2"},
      dir + "/log2");
  EXPECT_EQ(empty.Wait(30'000), 1);
  EXPECT_NE(empty.ReadLog().find("--tokenizer " + dir + ": no tokenizer.json there"),
            std::string::npos)
      << empty.ReadLog();
}

}  // namespace
}  // namespace kvbridge
