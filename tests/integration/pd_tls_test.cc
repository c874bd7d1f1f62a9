// P/D over HTTPS end to end (issue 22): `kvbridge proxy` and two `kvbridge serve` engines, every
// HTTP hop TLS — the client to the proxy, the proxy's legs and releases to the engines, the
// engines' registration with the proxy, the decode's (READ) or prefill's (WRITE) metadata fetch
// from its peer — verified against a CA made in the test. Answers equal a plain-HTTP colocated
// engine's. A proxy that trusts another CA sends no leg: the client gets the certificate error,
// and neither engine computed or holds anything.
#include <gtest/gtest.h>
#include <httplib.h>

#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvbridge/common/metrics.h"
#include "support/free_port.h"
#include "support/serve_harness.h"
#include "support/subprocess.h"
#include "support/test_cert.h"

namespace kvbridge {
namespace {

using nlohmann::json;
using testing::FreePort;
using testing::KvbridgeBin;
using testing::MakeModel;
using testing::MakeTempDir;
using testing::Subprocess;
using testing::TestCert;
using testing::WaitFor;
using testing::WaitForHttpOk;

const char* kToken = "tls-secret";

// An HTTPS client of 127.0.0.1:port that trusts `ca`.
std::unique_ptr<httplib::SSLClient> Https(int port, const std::string& ca) {
  auto c = std::make_unique<httplib::SSLClient>("127.0.0.1", port);
  c->set_ca_cert_path(ca.c_str());
  c->enable_server_certificate_verification(true);
  c->set_read_timeout(60, 0);
  c->set_connection_timeout(5, 0);
  return c;
}

double HttpsMetric(int port, const std::string& ca, const std::string& name) {
  auto r = Https(port, ca)->Get("/metrics");
  return r && r->status == 200 ? ScrapeMetric(r->body, name) : -2.0;
}

struct Topology {
  std::unique_ptr<Subprocess> proxy, prefill, decode;
  int proxy_port = 0, prefill_port = 0, decode_port = 0;
};

// Proxy + prefill + decode, all HTTPS with `node` (cert for 127.0.0.1, its own CA); the proxy
// verifies engines with `proxy_ca`, the engines verify their peers and the proxy with node.cert.
Topology Start(const std::string& dir, const std::string& model, const std::string& mode,
               const TestCert& node, const std::string& proxy_ca) {
  Topology t;
  t.proxy_port = FreePort();
  t.prefill_port = FreePort();
  t.decode_port = FreePort();
  t.proxy = std::make_unique<Subprocess>(
      std::vector<std::string>{KvbridgeBin(), "proxy", "--port", std::to_string(t.proxy_port),
                               "--mode", mode, "--cluster-token", kToken, "--ssl-certfile",
                               node.cert, "--ssl-keyfile", node.key, "--ssl-ca-certs", proxy_ca},
      dir + "/proxy-" + mode + ".log");
  const json extra = {{"transport", "tcp"}, {"mode", mode}, {"lease_ms", 30000}};
  auto serve = [&](const std::string& role, int port, const std::string& log) {
    return testing::SpawnServe(
               {.model_dir = model,
                .num_kv_blocks = 128,
                .role = role,
                .extra_config = extra,
                .cluster_token = kToken,
                .log_path = log,
                .port = port,
                .extra_args = {"--ssl-certfile", node.cert, "--ssl-keyfile", node.key,
                               "--ssl-peer-ca-certs", node.cert, "--proxy",
                               "https://127.0.0.1:" + std::to_string(t.proxy_port)}})
        .proc;
  };
  t.prefill = serve("kv_producer", t.prefill_port, dir + "/prefill-" + mode + ".log");
  t.decode = serve("kv_consumer", t.decode_port, dir + "/decode-" + mode + ".log");
  return t;
}

// Waits until the proxy lists one healthy prefill and one healthy decode (they registered over
// HTTPS).
bool Registered(const Topology& t, const std::string& ca) {
  return WaitFor(
      [&] {
        auto r = Https(t.proxy_port, ca)->Get("/health");
        if (!r || r->status != 200) return false;
        json j = json::parse(r->body, nullptr, false);
        return j.is_object() && j.value("prefill_healthy", 0) >= 1 &&
               j.value("decode_healthy", 0) >= 1;
      },
      60'000);
}

class PdTls : public ::testing::TestWithParam<std::string> {};

TEST_P(PdTls, EveryHopHttpsAnswersEqualPlainColocated) {
  const std::string mode = GetParam();
  const std::string dir = MakeTempDir("kvb_pd_tls");
  const std::string model = dir + "/tiny";
  ASSERT_EQ(MakeModel(model, "tiny", 5, 60'000), 0);
  const TestCert node = testing::MakeSelfSignedCert(dir, "node");

  const int cport = FreePort();
  Subprocess colo({KvbridgeBin(), "serve", model, "--port", std::to_string(cport),
                   "--served-model-name", "tiny", "--num-kv-blocks", "128"},
                  dir + "/colo.log");
  Topology t = Start(dir, model, mode, node, node.cert);
  ASSERT_TRUE(WaitForHttpOk("127.0.0.1", cport, "/health", 60'000)) << colo.ReadLog();
  ASSERT_TRUE(Registered(t, node.cert))
      << t.proxy->ReadLog() << t.prefill->ReadLog() << t.decode->ReadLog();
  // Plain HTTP to an HTTPS engine gets nothing.
  httplib::Client plain("127.0.0.1", t.prefill_port);
  plain.set_connection_timeout(2, 0);
  plain.set_read_timeout(2, 0);
  auto pr = plain.Get("/health");
  EXPECT_TRUE(!pr || pr->status != 200);

  httplib::Client cc("127.0.0.1", cport);
  cc.set_read_timeout(60, 0);
  for (int n : {1, 4}) {
    for (bool stream : {false, true}) {
      json client{{"model", "tiny"},
                  {"prompt", std::string(40, 't') + " tls " + mode + " n=" + std::to_string(n)},
                  {"max_tokens", 8},
                  {"n", n},
                  {"temperature", 1.0},
                  {"seed", 7},
                  {"logprobs", 3},
                  {"ignore_eos", true}};
      auto cr = cc.Post("/v1/completions", client.dump(), "application/json");
      ASSERT_TRUE(cr);
      ASSERT_EQ(cr->status, 200) << cr->body;
      json want = json::parse(cr->body)["choices"];
      if (stream) client["stream"] = true;
      auto r = Https(t.proxy_port, node.cert)
                   ->Post("/v1/completions", client.dump(), "application/json");
      ASSERT_TRUE(r) << httplib::to_string(r.error()) << t.proxy->ReadLog();
      ASSERT_EQ(r->status, 200) << r->body << t.proxy->ReadLog();
      std::vector<std::string> text(n);
      if (!stream) {
        json got = json::parse(r->body)["choices"];
        ASSERT_EQ(got.size(), static_cast<size_t>(n));
        for (int i = 0; i < n; ++i) {
          EXPECT_EQ(got[i]["logprobs"].dump(), want[i]["logprobs"].dump()) << mode << " n=" << n;
          text[i] = got[i]["text"].get<std::string>();
        }
      } else {
        // SSE through the proxy's TLS front door: the deltas add up to the whole text.
        size_t pos = 0;
        while ((pos = r->body.find("data: ", pos)) != std::string::npos) {
          const size_t end = r->body.find("\n\n", pos);
          const std::string data = r->body.substr(pos + 6, end - pos - 6);
          pos = end;
          if (data == "[DONE]") break;
          json chunk = json::parse(data);
          for (const json& c : chunk["choices"]) {
            text[c["index"].get<int>()] += c["text"].get<std::string>();
          }
        }
      }
      for (int i = 0; i < n; ++i) {
        EXPECT_EQ(text[i], want[i]["text"].get<std::string>())
            << mode << " n=" << n << " stream=" << stream << " i=" << i;
      }
    }
  }
  // The KV moved (READ: the decode pulled; WRITE: the prefill pushed), nothing recomputed, both
  // sides drained.
  const double bytes =
      std::max(HttpsMetric(t.decode_port, node.cert, "kvbridge_kv_transfer_bytes_total"),
               HttpsMetric(t.prefill_port, node.cert, "kvbridge_kv_transfer_bytes_total"));
  EXPECT_GT(bytes, 0);
  EXPECT_EQ(HttpsMetric(t.decode_port, node.cert, "kvbridge_kv_load_failures_total"), 0);
  EXPECT_TRUE(WaitFor(
      [&] {
        return HttpsMetric(t.prefill_port, node.cert, "kvbridge_kv_blocks_held_for_transfer") ==
                   0 &&
               HttpsMetric(t.prefill_port, node.cert, "kvbridge_kv_transfer_table_entries") == 0 &&
               HttpsMetric(t.decode_port, node.cert, "kvbridge_kv_transfers_inflight") == 0;
      },
      5000));
}

INSTANTIATE_TEST_SUITE_P(Modes, PdTls, ::testing::Values("read", "write"));

TEST(PdTlsRefused, AProxyThatTrustsAnotherCaSendsNoLeg) {
  const std::string dir = MakeTempDir("kvb_pd_tls_ca");
  const std::string model = dir + "/tiny";
  ASSERT_EQ(MakeModel(model, "tiny", 5, 60'000), 0);
  const TestCert node = testing::MakeSelfSignedCert(dir, "node");
  const TestCert other = testing::MakeSelfSignedCert(dir, "other");
  // The engines register (they trust the proxy's certificate); the proxy trusts only `other`.
  Topology t = Start(dir, model, "read", node, other.cert);
  ASSERT_TRUE(Registered(t, node.cert))
      << t.proxy->ReadLog() << t.prefill->ReadLog() << t.decode->ReadLog();
  json client{{"model", "tiny"}, {"prompt", "refused"}, {"max_tokens", 4}};
  auto r =
      Https(t.proxy_port, node.cert)->Post("/v1/completions", client.dump(), "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 502) << r->body;
  EXPECT_NE(r->body.find("certificate verify failed"), std::string::npos) << r->body;
  EXPECT_NE(t.proxy->ReadLog().find("certificate verify failed"), std::string::npos)
      << t.proxy->ReadLog();
  // Nothing reached the engines: no prompt computed, nothing held, nothing moved.
  for (int port : {t.prefill_port, t.decode_port}) {
    EXPECT_EQ(HttpsMetric(port, node.cert, "kvbridge_prompt_tokens_total"), 0) << port;
    EXPECT_EQ(HttpsMetric(port, node.cert, "kvbridge_kv_blocks_active"), 0) << port;
    EXPECT_EQ(HttpsMetric(port, node.cert, "kvbridge_kv_transfer_bytes_total"), 0) << port;
  }
  EXPECT_EQ(HttpsMetric(t.prefill_port, node.cert, "kvbridge_kv_transfer_table_entries"), 0);
}

// An engine's own calls verify too: a decode that trusts another CA does not fetch the prefill's
// metadata (the load fails, counted, and is recomputed: the client still gets its answer), and
// the prefill's hold is freed by its lease — nothing stays held.
TEST(PdTlsRefused, ADecodeThatTrustsAnotherCaFetchesNoMetadata) {
  const std::string dir = MakeTempDir("kvb_pd_tls_peer");
  const std::string model = dir + "/tiny";
  ASSERT_EQ(MakeModel(model, "tiny", 5, 60'000), 0);
  const TestCert node = testing::MakeSelfSignedCert(dir, "node");
  const TestCert other = testing::MakeSelfSignedCert(dir, "other");
  const int xport = FreePort(), pport = FreePort(), dport = FreePort();
  const json extra = {{"transport", "tcp"}, {"lease_ms", 1500}};
  auto serve = [&](const std::string& role, int port, const std::string& peer_ca) {
    return std::make_unique<Subprocess>(
        std::vector<std::string>{
            KvbridgeBin(), "serve", model, "--port", std::to_string(port), "--served-model-name",
            "tiny", "--num-kv-blocks", "128", "--kv-transfer-config",
            testing::TransferConfigJson(role, extra).dump(), "--cluster-token", kToken,
            "--ssl-certfile", node.cert, "--ssl-keyfile", node.key, "--ssl-peer-ca-certs", peer_ca},
        dir + "/" + role + ".log");
  };
  auto pre = serve("kv_producer", pport, node.cert);
  auto dec = serve("kv_consumer", dport, other.cert);
  Subprocess proxy(
      {KvbridgeBin(), "proxy", "--port", std::to_string(xport), "--cluster-token", kToken,
       "--ssl-certfile", node.cert, "--ssl-keyfile", node.key, "--ssl-ca-certs", node.cert,
       "--prefill", "https://127.0.0.1:" + std::to_string(pport), "--decode",
       "https://127.0.0.1:" + std::to_string(dport)},
      dir + "/proxy.log");
  Topology t;
  t.proxy_port = xport;
  ASSERT_TRUE(Registered(t, node.cert)) << proxy.ReadLog() << pre->ReadLog() << dec->ReadLog();
  json client{{"model", "tiny"}, {"prompt", "peer refused"}, {"max_tokens", 4}};
  auto r = Https(xport, node.cert)->Post("/v1/completions", client.dump(), "application/json");
  ASSERT_TRUE(r) << httplib::to_string(r.error());
  EXPECT_EQ(r->status, 200) << r->body;  // recomputed (kv_load_failure_policy recompute)
  EXPECT_EQ(HttpsMetric(dport, node.cert, "kvbridge_kv_load_failures_total"), 1);
  EXPECT_EQ(HttpsMetric(dport, node.cert, "kvbridge_kv_transfer_bytes_total"), 0);
  EXPECT_NE(dec->ReadLog().find("certificate did not verify"), std::string::npos) << dec->ReadLog();
  EXPECT_TRUE(WaitFor(
      [&] {
        return HttpsMetric(pport, node.cert, "kvbridge_kv_blocks_held_for_transfer") == 0 &&
               HttpsMetric(pport, node.cert, "kvbridge_kv_transfer_table_entries") == 0;
      },
      10'000))
      << pre->ReadLog();
}

}  // namespace
}  // namespace kvbridge
