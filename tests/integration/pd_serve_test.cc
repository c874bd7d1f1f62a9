// READ-mode P/D with `kvbridge serve` processes as users run them (tcp transport): the test plays
// the proxy over HTTP and compares with a colocated `kvbridge serve`.
#include <gtest/gtest.h>
#include <httplib.h>

#include <nlohmann/json.hpp>

#include "support/free_port.h"
#include "support/serve_harness.h"
#include "support/subprocess.h"

namespace kvbridge {
namespace {

using nlohmann::json;
using testing::FreePort;
using testing::KvbridgeBin;
using testing::MakeModel;
using testing::MakeTempDir;
using testing::ScrapeMetricAt;
using testing::SpawnServe;
using testing::Subprocess;
using testing::WaitFor;
using testing::WaitForHttpOk;

const char* kToken = "pd-secret";

std::unique_ptr<Subprocess> Serve(const std::string& model, int port, const std::string& log,
                                  const std::string& role) {
  return SpawnServe({.model_dir = model,
                     .num_kv_blocks = 128,
                     .role = role,
                     .extra_config = {{"transport", "tcp"},
                                      {"lease_ms", 30000},
                                      {"load_failure_policy", "recompute"}},
                     .cluster_token = kToken,
                     .log_path = log,
                     .port = port})
      .proc;
}

double Scrape(int port, const std::string& name) { return ScrapeMetricAt(port, name); }

TEST(PdServe, ReadModeAnswersEqualColocatedAndDrains) {
  const std::string dir = MakeTempDir("kvb_pd_serve");
  const std::string model = dir + "/tiny";
  ASSERT_EQ(MakeModel(model, "tiny", 5, 60'000), 0);

  // A bad config is refused at start with a message naming the key.
  Subprocess bad({KvbridgeBin(), "serve", model, "--port", std::to_string(FreePort()),
                  "--kv-transfer-config", R"({"kv_connector":"KVBridgeConnector","kv_role":"x"})"},
                 dir + "/bad.log");
  EXPECT_NE(bad.Wait(60'000), 0);
  EXPECT_NE(bad.ReadLog().find("kv_role"), std::string::npos) << bad.ReadLog();

  const int cport = FreePort(), pport = FreePort(), dport = FreePort();
  auto colo = Serve(model, cport, dir + "/colo.log", "");
  auto pre = Serve(model, pport, dir + "/prefill.log", "kv_producer");
  auto dec = Serve(model, dport, dir + "/decode.log", "kv_consumer");
  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", cport, "/health", 60'000)) << colo->ReadLog();
  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", pport, "/health", 60'000)) << pre->ReadLog();
  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", dport, "/health", 60'000)) << dec->ReadLog();

  httplib::Headers tok{{"X-KVBridge-Cluster-Token", kToken}};
  httplib::Client pc("127.0.0.1", pport), dc("127.0.0.1", dport), cc("127.0.0.1", cport);
  for (auto* c : {&pc, &dc, &cc}) c->set_read_timeout(60, 0);
  int k = 0;
  for (int n : {1, 8}) {
    for (const std::string& prompt :
         {std::string("P/D in one line."), std::string(70, 'q') + " and a tail"}) {
      ++k;
      json body{{"model", "tiny"}, {"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}};
      body["kv_transfer_params"] = {{"do_remote_decode", true},
                                    {"transfer_id", "serve-" + std::to_string(k)}};
      auto pr = pc.Post("/v1/completions", tok, body.dump(), "application/json");
      ASSERT_TRUE(pr);
      ASSERT_EQ(pr->status, 200) << pr->body;
      json params = json::parse(pr->body).at("kv_transfer_params");
      json client{{"model", "tiny"},
                  {"prompt", prompt},
                  {"max_tokens", 8},
                  {"n", n},
                  {"temperature", n > 1 ? 1.0 : 0.0},
                  {"seed", 42},
                  {"logprobs", 5},
                  {"ignore_eos", true}};
      json dbody = client;
      dbody["kv_transfer_params"] = params;
      auto dr = dc.Post("/v1/completions", tok, dbody.dump(), "application/json");
      auto cr = cc.Post("/v1/completions", client.dump(), "application/json");
      ASSERT_TRUE(dr && cr);
      ASSERT_EQ(dr->status, 200) << dr->body;
      ASSERT_EQ(cr->status, 200) << cr->body;
      json a = json::parse(dr->body)["choices"], b = json::parse(cr->body)["choices"];
      ASSERT_EQ(a.size(), static_cast<size_t>(n));
      for (int i = 0; i < n; ++i) {
        EXPECT_EQ(a[i]["text"], b[i]["text"]) << "n=" << n << " i=" << i;
        // JSON numbers print floats round-trip exactly: equal text means bitwise-equal logprobs.
        EXPECT_EQ(a[i]["logprobs"].dump(), b[i]["logprobs"].dump()) << "n=" << n << " i=" << i;
      }
    }
  }
  // Drained on both sides, with no safety net used.
  EXPECT_TRUE(WaitFor(
      [&] {
        return Scrape(pport, "kvbridge_kv_blocks_held_for_transfer") == 0 &&
               Scrape(dport, "kvbridge_kv_transfers_inflight") == 0 &&
               Scrape(pport, "kvbridge_kv_transfer_table_entries") == 0;
      },
      5000));
  EXPECT_GT(Scrape(dport, "kvbridge_kv_transfer_bytes_total"), 0);
  for (int port : {pport, dport}) {
    EXPECT_EQ(Scrape(port, "kvbridge_kv_lease_expired_total"), 0);
    EXPECT_EQ(Scrape(port, "kvbridge_kv_notifications_ignored_total"), 0);
    EXPECT_EQ(Scrape(port, "kvbridge_kv_load_failures_total"), 0);
  }
}

}  // namespace
}  // namespace kvbridge
