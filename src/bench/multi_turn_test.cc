#include <gtest/gtest.h>
#include <httplib.h>

#include <atomic>
#include <cstdio>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "kvbridge/bench/bench.h"

namespace kvbridge::bench {
namespace {

using nlohmann::json;

TEST(MultiTurn, LoadConversationsReadsTurns) {
  const std::string path = ::testing::TempDir() + "/mt.jsonl";
  {
    std::ofstream f(path);
    f << R"({"question_id": 1, "turns": ["a", "b"]})"
      << "\n\n"
      << R"({"turns": ["c"]})"
      << "\n";
  }
  auto c = LoadConversations(path);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(*c, (std::vector<std::vector<std::string>>{{"a", "b"}, {"c"}}));
  {
    std::ofstream f(path);
    f << R"({"turns": ["a"]})"
      << "\n"
      << R"({"turns": [1]})"
      << "\n";
  }
  c = LoadConversations(path);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("mt.jsonl:2"), std::string::npos) << c.status().ToString();
}

// A fake chat engine behind a fake proxy: streams a role-only delta, then the answer in two
// deltas, then usage; counts the prompt tokens it "computes" as the number of messages * 10.
TEST(MultiTurn, TurnsCarryTheAnswerAndCountTheEnginesWork) {
  httplib::Server srv;
  std::mutex mu;
  std::vector<json> got;
  std::atomic<int> computed{0};
  srv.Post("/v1/chat/completions", [&](const httplib::Request& req, httplib::Response& res) {
    json body = json::parse(req.body);
    {
      std::lock_guard<std::mutex> l(mu);
      got.push_back(body);
    }
    const int prompt = static_cast<int>(body["messages"].size()) * 10;
    computed += prompt;
    std::string sse =
        "data: " +
        json({{"choices", {{{"index", 0}, {"delta", {{"role", "assistant"}, {"content", ""}}}}}}})
            .dump() +
        "\n\ndata: " +
        json({{"choices", {{{"index", 0}, {"delta", {{"content", "ans"}}}}}}}).dump() +
        "\n\ndata: " +
        json({{"choices", {{{"index", 0}, {"delta", {{"content", "wer"}}}}}}}).dump() +
        "\n\ndata: " +
        json({{"choices", json::array()},
              {"usage", {{"prompt_tokens", prompt}, {"completion_tokens", 2}}}})
            .dump() +
        "\n\ndata: [DONE]\n\n";
    res.set_content(sse, "text/event-stream");
  });
  srv.Get("/metrics", [&](const httplib::Request&, httplib::Response& res) {
    res.set_content("kvbridge_prompt_tokens_computed_total " + std::to_string(computed.load()) +
                        "\nkvbridge_prefix_cache_hits_total 0\n",
                    "text/plain");
  });
  const int port = srv.bind_to_any_port("127.0.0.1");
  std::thread t([&] { srv.listen_after_bind(); });
  while (!srv.is_running()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const std::string url = "http://127.0.0.1:" + std::to_string(port);
  const std::string path = ::testing::TempDir() + "/mt2.jsonl";
  {
    std::ofstream f(path);
    f << R"({"turns": ["q1", "q2"]})"
      << "\n"
      << R"({"turns": ["r1"]})"
      << "\n";
  }
  MultiTurnOptions o;
  o.host = url;
  o.prompts_file = path;
  o.model = "m";
  o.concurrency = 2;
  o.metrics_urls = {url};
  auto r = RunMultiTurn(o, {});
  srv.stop();
  t.join();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  ASSERT_TRUE(r->ok);
  ASSERT_EQ(r->turns.size(), 2u);
  EXPECT_EQ(r->turns[0].requests, 2);
  EXPECT_EQ(r->turns[1].requests, 1);
  EXPECT_EQ(r->turns[0].prompt_tokens, 20);
  EXPECT_EQ(r->turns[0].prompt_tokens_computed, 20);
  EXPECT_EQ(r->turns[1].prompt_tokens, 30);  // user, assistant, user
  EXPECT_EQ(r->turns[1].prompt_tokens_computed, 30);
  EXPECT_EQ(r->turns[1].cache_hit_rate, 0);
  EXPECT_GT(r->turns[1].ttft_p50_s, 0);
  json last = got.back();
  EXPECT_EQ(last["messages"], json::parse(R"([{"role":"user","content":"q1"},
      {"role":"assistant","content":"answer"},{"role":"user","content":"q2"}])"));
  EXPECT_EQ(last["stream"], true);
  EXPECT_EQ(last["temperature"], 0);
  json j = json::parse(MultiTurnJson(*r));
  EXPECT_EQ(j["turns"][1]["turn"], 2);
  EXPECT_EQ(j["turns"][1]["prompt_tokens_computed"], 30);
  EXPECT_TRUE(j["turns"][0].contains("ttft_p50_s"));
}

}  // namespace
}  // namespace kvbridge::bench
