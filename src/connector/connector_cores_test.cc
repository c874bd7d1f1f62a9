#include "kvbridge/connector/connector_cores.h"

#include <gtest/gtest.h>

#include <string>
#include <variant>
#include <vector>

namespace kvbridge {
namespace {

KvTransferConfig Config() {
  KvTransferConfig c;
  c.lease = 8 * kSecond;
  c.reply_timeout = 3 * kSecond;
  c.read_timeout = 5 * kSecond;
  c.max_parked_messages = 7;
  c.load_failure_policy = LoadFailurePolicy::kFail;
  return c;
}

ConnectorCores::Shape TwoRanks() {
  return {.engine_id = "e0",
          .rank = 1,
          .tp_size = 2,
          .num_kv_heads = 4,
          .block_size = 32,
          .num_layers = 3};
}

TEST(ConnectorCores, EveryCoreGetsTheConfigAndShape) {
  ConnectorCores cores(Config(), TwoRanks());
  const PrefillCore::Options& p = cores.prefill.options();
  EXPECT_EQ(p.engine_id, "e0");
  EXPECT_EQ(p.tp_size, 2);  // one core for every rank
  EXPECT_EQ(p.num_kv_heads, 4);
  EXPECT_EQ(p.lease, 8 * kSecond);
  EXPECT_EQ(p.claim_lease, 5 * kSecond);  // the default, below the lease
  EXPECT_EQ(p.max_parked_messages, 7);

  const DecodeCore::Options& d = cores.decode.options();
  EXPECT_EQ(d.engine_id, "e0");
  EXPECT_EQ(d.tp_size, 2);
  EXPECT_EQ(d.num_kv_heads, 4);
  EXPECT_EQ(d.block_size, 32);
  EXPECT_EQ(d.reply_timeout, 3 * kSecond);
  EXPECT_EQ(d.read_timeout, 5 * kSecond);
  EXPECT_EQ(d.heartbeat_interval, 2 * kSecond);  // heartbeat_ms 0: lease / 4
  EXPECT_EQ(d.load_failure_policy, LoadFailurePolicy::kFail);

  ASSERT_EQ(cores.wprefill.tp_size(), 2);
  const WritePrefillCore::Options& w = cores.wprefill.options();
  EXPECT_EQ(w.engine_id, "e0");
  EXPECT_EQ(w.tp_size, 2);
  EXPECT_EQ(w.num_kv_heads, 4);
  EXPECT_EQ(w.block_size, 32);
  EXPECT_EQ(w.num_layers, 3);
  EXPECT_EQ(w.lease, 8 * kSecond);
  EXPECT_EQ(w.max_parked_messages, 7);

  const WriteDecodeCore::Options& wd = cores.wdecode.options();
  EXPECT_EQ(wd.engine_id, "e0");
  EXPECT_EQ(wd.tp_size, 2);
  EXPECT_EQ(wd.num_kv_heads, 4);
  EXPECT_EQ(wd.block_size, 32);
  EXPECT_EQ(wd.write_timeout, 10 * kSecond);  // lease + max(2 s, lease / 4)
  EXPECT_EQ(wd.load_failure_policy, LoadFailurePolicy::kFail);
}

TEST(ConnectorCores, WriteTimeoutIsLeasePlusGrace) {
  KvTransferConfig c;
  c.lease = 60 * kSecond;
  EXPECT_EQ(ConnectorCores::WriteTimeout(c), 75 * kSecond);
  c.lease = 4 * kSecond;
  EXPECT_EQ(ConnectorCores::WriteTimeout(c), 6 * kSecond);
  c.heartbeat_interval = 1 * kSecond;  // the heartbeat plays no part
  EXPECT_EQ(ConnectorCores::WriteTimeout(c), 6 * kSecond);
}

TEST(ConnectorCores, HeartbeatIntervalWhenSet) {
  KvTransferConfig c = Config();
  c.heartbeat_interval = 500 * kMillisecond;
  ConnectorCores cores(c, TwoRanks());
  EXPECT_EQ(cores.decode.options().heartbeat_interval, 500 * kMillisecond);
}

TEST(ConnectorCores, DeadlinesTicksAbortsAndActionsSpanTheCores) {
  KvTransferConfig c = Config();
  c.claim_lease = 0;  // the claim lease is peer_loss_test's
  ConnectorCores cores(c, {.engine_id = "e0", .tp_size = 1, .block_size = 16});
  EXPECT_TRUE(cores.Idle());
  EXPECT_EQ(cores.NextDeadline(), std::nullopt);
  EXPECT_TRUE(cores.TakeActions().empty());

  // A READ prefill hold and a WRITE prefill hold, both under the 8 s lease (the earlier one
  // from t=0).
  ASSERT_TRUE(cores.prefill.OnRequestAdded("r", 1, "t-read", 0).ok());
  ASSERT_TRUE(cores.wprefill.OnRequestAdded("w", 1, "t-write", 16, 0).ok());
  EXPECT_TRUE(cores.prefill.OnRequestFinished("r", "t-read", std::vector<int32_t>{1}, 0));
  EXPECT_TRUE(cores.wprefill.OnRequestFinished("w", std::vector<int32_t>{2}, 100));
  EXPECT_FALSE(cores.Idle());
  EXPECT_EQ(cores.NextDeadline(), std::optional<TimePoint>(8 * kSecond));

  // Aborting a held request: every core is asked; the READ prefill keeps its blocks.
  EXPECT_TRUE(cores.OnRequestAborted("r", 300));
  EXPECT_FALSE(cores.OnRequestAborted("nobody", 300));

  // Past both leases: both holds free, the READ prefill's action first.
  cores.OnTick(100 + 8 * kSecond);
  std::vector<std::string> freed;
  for (const ConnectorAction& a : cores.TakeActions()) {
    if (auto* f = std::get_if<ReportBlocksFreeAction>(&a)) freed.push_back(f->request_id);
  }
  EXPECT_EQ(freed, (std::vector<std::string>{"r", "w"}));
  EXPECT_TRUE(cores.TakeActions().empty());
}

}  // namespace
}  // namespace kvbridge
