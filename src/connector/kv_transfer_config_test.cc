#include "kvbridge/connector/kv_transfer_config.h"

#include <gtest/gtest.h>

namespace kvbridge {
namespace {

using nlohmann::json;

TEST(KvTransferConfig, ParsesFullConfig) {
  auto c = ParseKvTransferConfig(
      R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_consumer",
          "kv_connector_extra_config":{"mode":"read","transport":"tcp","lease_ms":5000,
          "load_failure_policy":"fail","reply_timeout_ms":250,"read_timeout_ms":900,
          "heartbeat_ms":1000,"max_parked_messages":7,"engine_id":"d0"}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->role, KvRole::kConsumer);
  EXPECT_EQ(c->mode, KvTransferMode::kRead);
  EXPECT_EQ(c->transport, KvTransport::kTcp);
  EXPECT_EQ(c->lease, 5000 * kMillisecond);
  EXPECT_EQ(c->load_failure_policy, LoadFailurePolicy::kFail);
  EXPECT_EQ(c->reply_timeout, 250 * kMillisecond);
  EXPECT_EQ(c->read_timeout, 900 * kMillisecond);
  EXPECT_EQ(c->EffectiveHeartbeat(), 1000 * kMillisecond);
  EXPECT_EQ(c->max_parked_messages, 7);
  EXPECT_EQ(c->engine_id, "d0");
  EXPECT_FALSE(c->IsProducer());
  EXPECT_TRUE(c->IsConsumer());
}

TEST(KvTransferConfig, DefaultsAndRoundTrip) {
  auto c = ParseKvTransferConfig(R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both"})");
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->lease, 60 * kSecond);
  EXPECT_EQ(c->EffectiveHeartbeat(), 15 * kSecond);
  EXPECT_EQ(c->transport, KvTransport::kAuto);
  EXPECT_EQ(c->load_failure_policy, LoadFailurePolicy::kRecompute);
  auto again = ParseKvTransferConfig(KvTransferConfigToJson(*c).dump());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(KvTransferConfigToJson(*again), KvTransferConfigToJson(*c));
}

TEST(KvTransferConfig, RefusesBadInputWithClearMessage) {
  struct Case {
    const char* text;
    const char* needle;
  };
  const Case cases[] = {
      {"not json", "not valid JSON"},
      {"[]", "must be a JSON object"},
      {R"({"kv_role":"kv_both"})", "kv_connector is required"},
      {R"({"kv_connector":"Nixl","kv_role":"kv_both"})", "unknown value \"Nixl\""},
      {R"({"kv_connector":"KVBridgeConnector"})", "kv_role is required"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_server"})",
       "allowed: kv_producer|kv_consumer|kv_both"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_rank":0})",
       "\"kv_rank\" (vLLM's, for other connectors) has no kvbridge meaning here; use kv_role"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_port":"21001"})",
       "remote_port"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_buffer_size":"1e1"})",
       "use serve --kv-cache-memory"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_ip":"10.0.0.1"})",
       "use serve --advertise-host"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_producer","kv_connector_extra_config":{"proxy_ip":"0.0.0.0","proxy_port":"30001"}})",
       "proxy_ip (another connector's key) has no kvbridge meaning here; use serve --proxy "
       "HOST:PORT"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"http_port":"20001"}})",
       "http_port (another connector's key) has no kvbridge meaning here; use serve --port"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"handshake_port":1}})",
       "handshake_port (another connector's key)"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"notify_port":1}})",
       "notify_port (another connector's key)"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"proxy_ping_port":1}})",
       "use serve --proxy"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"backend":"nixl"}})",
       "use kv_connector_extra_config.transport (auto|shm|tcp|ucx|cuda_ipc)"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"backends":["GDS"]}})",
       "only [\"UCX\"]"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"send_type":"PUSH"}})",
       "allowed: PUT|PUT_ASYNC|GET"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"send_type":"GET","mode":"read"}})",
       "mode or send_type, not both"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_load_failure_policy":"retry"})",
       "allowed: recompute|fail"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"mode":"push"}})",
       "mode: unknown value \"push\""},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"transport":"rdma"}})",
       "allowed: auto|shm|tcp|ucx|cuda_ipc"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"lease_ms":0}})",
       "lease_ms = 0 out of range"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"lease_ms":"5"}})",
       "lease_ms must be an integer"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"leas_ms":5}})",
       "unknown key \"leas_ms\""},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"load_failure_policy":"retry"}})",
       "allowed: recompute|fail"},
      {R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_both","kv_connector_extra_config":{"lease_ms":100,"heartbeat_ms":100}})",
       "heartbeat_ms must be smaller than lease_ms"},
  };
  for (const Case& c : cases) {
    auto r = ParseKvTransferConfig(c.text);
    ASSERT_FALSE(r.ok()) << c.text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << c.text;
    EXPECT_NE(r.status().message().find(c.needle), std::string::npos)
        << c.text << " -> " << r.status().message();
  }
}

json DecodeLeg() {
  return json{{"do_remote_prefill", true},   {"transfer_id", "xfer-1"},
              {"remote_engine_id", "p0-ab"}, {"remote_host", "127.0.0.1"},
              {"remote_port", 8100},         {"remote_block_ids", {7, 3, 9}},
              {"remote_num_tokens", 40},     {"tp_size", 1}};
}

TEST(KvTransferParams, ParsesDecodeLeg) {
  auto p = ParseKvTransferParams(DecodeLeg(), {.block_size = 16, .remote_num_blocks = 10});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_TRUE(p->do_remote_prefill);
  EXPECT_FALSE(p->do_remote_decode);
  EXPECT_EQ(p->transfer_id, "xfer-1");
  EXPECT_EQ(p->remote_engine_id, "p0-ab");
  EXPECT_EQ(p->remote_port, 8100);
  EXPECT_EQ(p->remote_block_ids, (std::vector<int32_t>{7, 3, 9}));
  EXPECT_EQ(p->remote_num_tokens, 40);
  EXPECT_EQ(KvTransferParamsToJson(*p), DecodeLeg());
}

TEST(KvTransferParams, ParsesPrefillLeg) {
  json j{{"do_remote_decode", true}, {"transfer_id", "xfer-2"}, {"remote_host", nullptr}};
  auto p = ParseKvTransferParams(j, {});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_TRUE(p->do_remote_decode);
  EXPECT_EQ(p->transfer_id, "xfer-2");
  EXPECT_EQ(KvTransferParamsToJson(*p),
            (json{{"do_remote_decode", true}, {"transfer_id", "xfer-2"}}));
}

TEST(KvTransferParams, RefusesEachBadField) {
  struct Case {
    const char* key;
    json value;  // null: erase the key
    const char* needle;
  };
  const Case cases[] = {
      {"transfer_id", "", "transfer_id must be"},
      {"transfer_id", "a b", "transfer_id must be"},
      {"transfer_id", 5, "transfer_id must be"},
      {"do_remote_prefill", "yes", "do_remote_prefill must be a boolean"},
      {"do_remote_decode", true, "exactly one of"},
      {"remote_port", 0, "remote_port = 0 out of range"},
      {"remote_port", 70000, "out of range"},
      {"remote_host", "a host", "remote_host must be"},
      {"remote_engine_id", nullptr, "remote_engine_id must be"},
      {"remote_block_ids", json::array({7, 3}), "has 2 ids; remote_num_tokens 40"},
      {"remote_block_ids", json::array({7, 3, -1}), "remote_block_ids[2] = -1 out of range"},
      {"remote_block_ids", json::array({7, 3, 10}), "remote_block_ids[2] = 10 out of range [0, 9]"},
      {"remote_block_ids", json::array({7, 3, 7}), "remote_block_ids[2] = 7 repeats"},
      {"remote_block_ids", json::array({7, 3, 1.5}), "must be an integer"},
      {"remote_block_ids", "7,3,9", "must be an array"},
      {"remote_num_tokens", 0, "remote_num_tokens = 0 out of range"},
      {"remote_num_tokens", 49, "remote_num_tokens 49 at block_size 16 needs 4"},
      {"tp_size", 0, "tp_size = 0 out of range"},
      {"mode", "push", "unknown value \"push\""},
      {"extra", 1, "extra: unknown field"},
  };
  for (const Case& c : cases) {
    json j = DecodeLeg();
    if (c.value.is_null())
      j.erase(c.key);
    else
      j[c.key] = c.value;
    auto p = ParseKvTransferParams(j, {.block_size = 16, .remote_num_blocks = 10});
    ASSERT_FALSE(p.ok()) << c.key << "=" << c.value.dump();
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(p.status().message().find(c.needle), std::string::npos)
        << c.key << " -> " << p.status().message();
  }
  EXPECT_FALSE(ParseKvTransferParams(json::array(), {}).ok());
  EXPECT_FALSE(ParseKvTransferParams(json{{"transfer_id", "x"}}, {}).ok());
  json prefill{{"do_remote_decode", true}, {"transfer_id", "x"}, {"remote_port", 80}};
  auto p = ParseKvTransferParams(prefill, {});
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("remote_port is not allowed with do_remote_decode"),
            std::string::npos);
}

TEST(KvTransferParams, OutOfRangeBlockIdsAllowedWhenRemotePoolUnknown) {
  json j = DecodeLeg();
  j["remote_block_ids"] = {7, 3, 100000};
  EXPECT_TRUE(ParseKvTransferParams(j, {.block_size = 16}).ok());
}

// Keys of vLLM's KVTransferConfig and other connectors' recipes that mean the same here.
TEST(KvTransferConfig, HonoursVllmKeysWithTheSameMeaning) {
  auto c = ParseKvTransferConfig(
      R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_producer","engine_id":"p0",
          "kv_load_failure_policy":"fail",
          "kv_connector_extra_config":{"send_type":"PUT_ASYNC","backends":["UCX"]}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->engine_id, "p0");
  EXPECT_EQ(c->load_failure_policy, LoadFailurePolicy::kFail);
  EXPECT_EQ(c->mode, KvTransferMode::kWrite);
  EXPECT_EQ(c->transport, KvTransport::kUcx);
  c = ParseKvTransferConfig(
      R"({"kv_connector":"KVBridgeConnector","kv_role":"kv_consumer",
          "kv_connector_extra_config":{"send_type":"GET"}})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->mode, KvTransferMode::kRead);
}

}  // namespace
}  // namespace kvbridge
