#include "kvbridge/connector/messages.h"

#include <gtest/gtest.h>

namespace kvbridge {
namespace {

TEST(ControlMessage, RoundTripsEveryType) {
  const ControlMessage msgs[] = {
      ReadDoneMsg{.transfer_id = "t1",
                  .prefill_engine_id = "p0",
                  .prefill_rank = 1,
                  .decode_engine_id = "d0",
                  .decode_rank = 3,
                  .decode_tp_size = 4,
                  .outcome = ReadOutcome::kAborted,
                  .want_reply = false},
      HoldReplyMsg{.transfer_id = "t1",
                   .prefill_engine_id = "p0",
                   .prefill_rank = 1,
                   .decode_engine_id = "d0",
                   .decode_rank = 3,
                   .hold_valid = false,
                   .reason = "expired"},
      HeartbeatMsg{.transfer_id = "t1",
                   .prefill_engine_id = "p0",
                   .prefill_rank = 0,
                   .decode_engine_id = "d0",
                   .decode_rank = 0},
      ReleaseMsg{.transfer_id = "t1", .prefill_engine_id = ""},
  };
  for (const ControlMessage& m : msgs) {
    auto back = DecodeMessage(EncodeMessage(m));
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, m) << EncodeMessage(m);
  }
  EXPECT_EQ(EncodeMessage(ReleaseMsg{.transfer_id = "t9", .prefill_engine_id = "p1"}),
            R"({"prefill_engine_id":"p1","transfer_id":"t9","type":"release"})");
}

TEST(ControlMessage, RefusesMalformed) {
  const char* bad[] = {
      "",
      "[]",
      "{}",
      R"({"type":"nope"})",
      R"({"type":"release"})",
      R"({"type":"release","transfer_id":"t","x":1})",
      R"({"type":"heartbeat","transfer_id":"t","prefill_engine_id":"p","prefill_rank":-1,"decode_engine_id":"d","decode_rank":0})",
      R"({"type":"read_done","transfer_id":"t","prefill_engine_id":"p","prefill_rank":0,"decode_engine_id":"d","decode_rank":2,"decode_tp_size":2,"outcome":"ok","want_reply":true})",
      R"({"type":"read_done","transfer_id":"t","prefill_engine_id":"p","prefill_rank":0,"decode_engine_id":"d","decode_rank":0,"decode_tp_size":1,"outcome":"meh","want_reply":true})",
      R"({"type":"hold_reply","transfer_id":"t","prefill_engine_id":"p","prefill_rank":0,"decode_engine_id":"d","decode_rank":0,"hold_valid":"yes"})",
  };
  for (const char* text : bad) {
    auto r = DecodeMessage(text);
    EXPECT_FALSE(r.ok()) << text;
    if (!r.ok()) {
      EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
    }
  }
}

// The wire form, pinned: keys sorted, every field written (also the optional ones).
TEST(ControlMessage, EncodesEveryTypeExactly) {
  const std::pair<ControlMessage, const char*> cases[] = {
      {ReadDoneMsg{"t1", "p0", 1, "d0", 3, 4, ReadOutcome::kSkipped, false},
       R"({"decode_engine_id":"d0","decode_rank":3,"decode_tp_size":4,"outcome":"skipped","prefill_engine_id":"p0","prefill_rank":1,"transfer_id":"t1","type":"read_done","want_reply":false})"},
      {HoldReplyMsg{"t1", "p0", 1, "d0", 3, true, ""},
       R"({"decode_engine_id":"d0","decode_rank":3,"hold_valid":true,"prefill_engine_id":"p0","prefill_rank":1,"reason":"","transfer_id":"t1","type":"hold_reply"})"},
      {HeartbeatMsg{"t1", "p0", 2, "d0", 0},
       R"({"decode_engine_id":"d0","decode_rank":0,"prefill_engine_id":"p0","prefill_rank":2,"transfer_id":"t1","type":"heartbeat"})"},
      {ReleaseMsg{"t1", ""}, R"({"prefill_engine_id":"","transfer_id":"t1","type":"release"})"},
      {WriteBlocksMsg{"t2", "p1", 1, "d1", 2, 4, "10.0.0.7", 4242, 70, 1, {9, 3, 5}},
       R"({"block_ids":[9,3,5],"decode_engine_id":"d1","decode_host":"10.0.0.7","decode_port":4242,"decode_rank":2,"decode_tp_size":4,"first_block":1,"num_prompt_tokens":70,"prefill_engine_id":"p1","prefill_rank":1,"transfer_id":"t2","type":"write_blocks"})"},
      {WriteDoneMsg{"t2", "p1", 1, "d1", 2, WriteOutcome::kCancelled, "aborted", 11, 22, 33, 44},
       R"({"compute_us":11,"decode_engine_id":"d1","decode_rank":2,"last_layer_at_us":44,"outcome":"cancelled","prefill_engine_id":"p1","prefill_rank":1,"reason":"aborted","since_last_layer_us":33,"transfer_id":"t2","type":"write_done","write_us":22})"},
      {WriteCancelMsg{"t2", "p1", 0, "d1", 1, 2, false},
       R"({"decode_engine_id":"d1","decode_rank":1,"decode_tp_size":2,"prefill_engine_id":"p1","prefill_rank":0,"transfer_id":"t2","type":"write_cancel","want_done":false})"},
  };
  for (const auto& [msg, wire] : cases) {
    EXPECT_EQ(EncodeMessage(msg), wire);
    auto back = DecodeMessage(wire);
    ASSERT_TRUE(back.ok()) << back.status().ToString();
    EXPECT_EQ(*back, msg) << wire;
  }
  EXPECT_EQ(ReadOutcomeName(ReadOutcome::kAborted), "aborted");
  EXPECT_EQ(WriteOutcomeName(WriteOutcome::kFailed), "failed");
}

// A malformed message is refused naming what is wrong, checked in a fixed order: keys, the route
// (transfer_id, engines, ranks; decode_tp_size bounds decode_rank), then the message's own fields.
TEST(ControlMessage, NamesTheFirstBadField) {
  const std::string route =
      R"("transfer_id":"t","prefill_engine_id":"p","prefill_rank":0,"decode_engine_id":"d",)";
  const std::pair<std::string, std::string> cases[] = {
      {R"({"type":7})", "type must be a string"},
      {R"({"type":"nope"})",
       "unknown type \"nope\" "
       "(read_done|hold_reply|heartbeat|release|write_blocks|write_done|write_cancel)"},
      {R"({"type":"release","transfer_id":"bad id"})",
       "transfer_id must be 1-128 chars [A-Za-z0-9._:-]"},
      {R"({"type":"release","transfer_id":"t","prefill_engine_id":5})",
       "prefill_engine_id must be a string"},
      {R"({"type":"heartbeat",)" + route + R"("decode_rank":0,"decode_tp_size":1})",
       "unknown field \"decode_tp_size\""},
      {R"({"type":"heartbeat",)" + route + R"("decode_rank":1024})", "decode_rank out of range"},
      {R"({"type":"heartbeat","transfer_id":"t","prefill_engine_id":"p","prefill_rank":18446744073709551615,"decode_engine_id":"d","decode_rank":0})",
       "prefill_rank out of range"},
      {R"({"type":"read_done",)" + route +
           R"("decode_rank":2,"decode_tp_size":2,"outcome":"ok","want_reply":true})",
       "decode_rank out of range"},
      {R"({"type":"read_done",)" + route +
           R"("decode_rank":0,"decode_tp_size":1,"outcome":"meh","want_reply":1})",
       "want_reply must be a boolean"},
      {R"({"type":"read_done",)" + route +
           R"("decode_rank":0,"decode_tp_size":1,"outcome":"meh","want_reply":true})",
       "outcome \"meh\" unknown (ok|failed|aborted|skipped)"},
      {R"({"type":"hold_reply",)" + route + R"("decode_rank":0,"hold_valid":true,"reason":7})",
       "reason must be a string of <= 256 chars"},
      {R"({"type":"write_blocks",)" + route +
           R"("decode_rank":0,"decode_tp_size":1,"decode_host":3,"decode_port":1,"num_prompt_tokens":10,"first_block":0,"block_ids":[1]})",
       "decode_host must be a string of <= 255 chars"},
      {R"({"type":"write_blocks",)" + route +
           R"("decode_rank":0,"decode_tp_size":1,"decode_host":"h","decode_port":1,"num_prompt_tokens":10,"first_block":0,"block_ids":[1,1]})",
       "block_ids repeats 1"},
      {R"({"type":"write_blocks",)" + route +
           R"("decode_rank":0,"decode_tp_size":1,"decode_host":"h","decode_port":1,"num_prompt_tokens":2,"first_block":1,"block_ids":[4,5]})",
       "first_block + block_ids exceed the prompt's tokens"},
      {R"({"type":"write_done",)" + route +
           R"("decode_rank":0,"outcome":"skipped","compute_us":0,"write_us":0,"since_last_layer_us":0})",
       "outcome \"skipped\" unknown (ok|failed|cancelled)"},
      {R"({"type":"write_done",)" + route +
           R"("decode_rank":0,"outcome":"ok","compute_us":0,"write_us":9007199254740993,"since_last_layer_us":0})",
       "write_us out of range"},
      {R"({"type":"write_done",)" + route +
           R"("decode_rank":0,"outcome":"ok","compute_us":0,"write_us":0,"since_last_layer_us":0,"last_layer_at_us":"x"})",
       "last_layer_at_us must be an integer"},
      {R"({"type":"write_cancel",)" + route + R"("decode_rank":0,"decode_tp_size":1})",
       "want_done must be a boolean"},
  };
  for (const auto& [text, why] : cases) {
    auto r = DecodeMessage(text);
    ASSERT_FALSE(r.ok()) << text;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << text;
    EXPECT_EQ(r.status().message(), "control message: " + why) << text;
  }
}

TEST(TpReadPairs, MapsRanksByHeadRange) {
  using P = std::vector<std::pair<int, int>>;
  EXPECT_EQ(TpReadPairs(1, 1), (P{{0, 0}}));
  EXPECT_EQ(TpReadPairs(2, 2), (P{{0, 0}, {1, 1}}));
  EXPECT_EQ(TpReadPairs(4, 2), (P{{0, 0}, {1, 0}, {2, 1}, {3, 1}}));
  EXPECT_EQ(TpReadPairs(1, 4), (P{{0, 0}, {0, 1}, {0, 2}, {0, 3}}));
  EXPECT_EQ(TpReadPairs(2, 4), (P{{0, 0}, {0, 1}, {1, 2}, {1, 3}}));
  EXPECT_EQ(DecodeRanksReadingFrom(1, 2, 4), (std::vector<int>{2, 3}));
  EXPECT_EQ(DecodeRanksReadingFrom(3, 4, 2), (std::vector<int>{1}));
  EXPECT_TRUE(TpReadPairs(0, 1).empty());
}

}  // namespace
}  // namespace kvbridge
