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
