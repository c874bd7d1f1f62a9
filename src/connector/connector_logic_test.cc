#include "kvbridge/connector/connector_logic.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <string>
#include <variant>
#include <vector>

namespace kvbridge {
namespace {

// Records what the logic asks; PostTransfer answers `post_status`.
class RecordingSink : public ConnectorSink {
 public:
  Status PostTransfer(const TransferAction& t) override {
    posted.push_back(t);
    return post_status;
  }
  Status CancelTransfer(KvTransferMode op, uint64_t id) override {
    cancelled.emplace_back(op, id);
    return OkStatus();
  }
  void Send(const SendMessageAction& a) override { sent.push_back(a); }
  void OnReport(const ConnectorLogic::Report& r) override { reports.push_back(r); }
  void PreparePeer(const PeerEndpoint& p) override { peers.push_back(p); }
  void Note(const RequestNote& n) override { notes.push_back(n); }
  std::pair<std::string, int> AdvertisedEndpoint() const override { return {"10.0.0.7", 8100}; }

  Status post_status = OkStatus();
  std::vector<TransferAction> posted;
  std::vector<std::pair<KvTransferMode, uint64_t>> cancelled;
  std::vector<SendMessageAction> sent;
  std::vector<ConnectorLogic::Report> reports;
  std::vector<PeerEndpoint> peers;
  std::vector<RequestNote> notes;
};

constexpr int kBlock = 16;

ConnectorCores::Shape Shape(const std::string& id) {
  return {.engine_id = id, .tp_size = 1, .num_kv_heads = 2, .block_size = kBlock, .num_layers = 2};
}

// A decode leg of a 40-token prompt whose 3 blocks prefill "p0" holds.
nlohmann::json DecodeParams() {
  KvTransferParams p;
  p.do_remote_prefill = true;
  p.transfer_id = "tid-1";
  p.remote_engine_id = "p0";
  p.remote_host = "127.0.0.1";
  p.remote_port = 9000;
  p.remote_block_ids = {7, 8, 9};
  p.remote_num_tokens = 40;
  return KvTransferParamsToJson(p);
}

ConnectorRequestInfo Req(const std::string& id, const nlohmann::json* params) {
  return {.request_id = id, .parent_id = id, .num_prompt_tokens = 40, .kv_transfer_params = params};
}

TEST(ConnectorLogic, DecodeLegReadsThenProceedsAfterTheHoldReply) {
  RecordingSink sink;
  ConnectorLogic logic(KvTransferConfig{}, Shape("d0"), &sink);
  const nlohmann::json params = DecodeParams();
  const ConnectorRequestInfo req = Req("r1", &params);
  auto m = logic.GetNumNewMatchedTokens(req, 0, 0);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  EXPECT_EQ(m->num_external_tokens, 39);
  EXPECT_TRUE(m->load_async);
  ASSERT_EQ(sink.peers.size(), 1u);  // the prefill's metadata is fetched ahead
  EXPECT_EQ(sink.peers[0].engine_id, "p0");
  ASSERT_EQ(sink.notes.size(), 1u);
  EXPECT_EQ(sink.notes[0].kind, RequestNote::Kind::kLoadStarted);

  const std::vector<int32_t> table = {1, 2, 3};
  EXPECT_TRUE(logic.UpdateStateAfterAlloc(req, table, 0, 39, 10).ok());
  ASSERT_EQ(sink.posted.size(), 1u);
  const PostTransferAction& read = sink.posted[0];
  EXPECT_EQ(sink.posted[0].op, KvTransferMode::kRead);
  EXPECT_EQ(read.local_block_ids, (std::vector<int32_t>{1, 2, 3}));
  EXPECT_EQ(read.remote_block_ids, (std::vector<int32_t>{7, 8, 9}));

  logic.OnTransferEnded(KvTransferMode::kRead, read.id, OkStatus(), 20);
  ASSERT_EQ(sink.sent.size(), 1u);
  const auto& done = std::get<ReadDoneMsg>(sink.sent[0].msg);
  EXPECT_EQ(done.transfer_id, "tid-1");
  EXPECT_TRUE(logic.Poll(21).finished_recving.empty());  // not before the hold reply

  ASSERT_TRUE(logic
                  .OnMessage(HoldReplyMsg{.transfer_id = "tid-1",
                                          .prefill_engine_id = "p0",
                                          .decode_engine_id = "d0",
                                          .hold_valid = true},
                             0, 30)
                  .ok());
  ASSERT_EQ(sink.reports.size(), 1u);  // told when decided, reported at the next Poll
  KvConnector::StepReport r = logic.Poll(31);
  EXPECT_EQ(r.finished_recving, (std::vector<std::string>{"r1"}));
  EXPECT_TRUE(logic.Poll(32).finished_recving.empty());  // once
}

TEST(ConnectorLogic, ATransferTheSinkCannotStartEndsAtOnce) {
  RecordingSink sink;
  sink.post_status = UnavailableError("no route to p0");
  ConnectorLogic logic(KvTransferConfig{}, Shape("d0"), &sink);
  const nlohmann::json params = DecodeParams();
  const ConnectorRequestInfo req = Req("r1", &params);
  ASSERT_TRUE(logic.GetNumNewMatchedTokens(req, 0, 0).ok());
  const std::vector<int32_t> table = {1, 2, 3};
  EXPECT_TRUE(logic.UpdateStateAfterAlloc(req, table, 0, 39, 10).ok());
  ASSERT_EQ(sink.posted.size(), 1u);
  KvConnector::StepReport r = logic.Poll(11);
  ASSERT_EQ(r.failed_recving.size(), 1u);
  EXPECT_EQ(r.failed_recving[0].request_id, "r1");
  EXPECT_TRUE(r.failed_recving[0].recompute);  // the default policy
}

TEST(ConnectorLogic, TheRoleGatesEachLeg) {
  RecordingSink sink;
  KvTransferConfig producer;
  producer.role = KvRole::kProducer;
  ConnectorLogic logic(producer, Shape("p0"), &sink);
  const nlohmann::json params = DecodeParams();
  auto m = logic.GetNumNewMatchedTokens(Req("r1", &params), 0, 0);
  EXPECT_EQ(m.status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(sink.posted.empty());
  EXPECT_TRUE(logic.Idle());
}

TEST(ConnectorLogic, AFinishedPrefillLegIsHeldAndAnswersWithTheAdvertisedEndpoint) {
  RecordingSink sink;
  ConnectorLogic logic(KvTransferConfig{}, Shape("p0"), &sink);
  const nlohmann::json params = {{"do_remote_decode", true}, {"transfer_id", "tid-9"}};
  const ConnectorRequestInfo req = Req("r9", &params);
  ASSERT_TRUE(logic.GetNumNewMatchedTokens(req, 0, 0).ok());
  const std::vector<int32_t> blocks = {4, 5, 6, 11};  // 3 prompt blocks + one generated
  KvConnector::FinishDecision d = logic.RequestFinished(req, blocks, "length", 5);
  EXPECT_TRUE(d.hold_blocks);
  auto out = ParseKvTransferParams(d.kv_transfer_params, {.block_size = kBlock});
  ASSERT_TRUE(out.ok()) << out.status().ToString();
  EXPECT_TRUE(out->do_remote_prefill);
  EXPECT_EQ(out->transfer_id, "tid-9");
  EXPECT_EQ(out->remote_engine_id, "p0");
  EXPECT_EQ(out->remote_host, "10.0.0.7");
  EXPECT_EQ(out->remote_port, 8100);
  EXPECT_EQ(out->remote_block_ids, (std::vector<int32_t>{4, 5, 6}));
  ASSERT_EQ(sink.notes.size(), 2u);
  EXPECT_EQ(sink.notes[0].kind, RequestNote::Kind::kPrefillAdmitted);
  EXPECT_EQ(sink.notes[1].kind, RequestNote::Kind::kHeld);
  EXPECT_EQ(logic.cores().prefill.NumHeldBlocks(), 3);
}

}  // namespace
}  // namespace kvbridge
