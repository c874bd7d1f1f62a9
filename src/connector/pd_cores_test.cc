// PrefillCore and DecodeCore wired to each other through an in-test message pipe: the protocol
// end to end with no network, as the simulator (issue 7) will drive it.
#include <gtest/gtest.h>

#include "kvbridge/connector/decode_core.h"
#include "kvbridge/connector/prefill_core.h"

namespace kvbridge {
namespace {

struct Pipe {
  PrefillCore prefill{{.engine_id = "p0", .lease = 10 * kSecond}};
  DecodeCore decode{{.engine_id = "d0", .block_size = 16}};
  std::vector<std::string> prefill_freed, loads_done;
  std::vector<uint64_t> reads;

  // Delivers every queued action until both cores are quiet.
  void Pump(TimePoint now) {
    for (int i = 0; i < 100; ++i) {
      auto pa = prefill.TakeActions();
      auto da = decode.TakeActions();
      if (pa.empty() && da.empty()) return;
      for (auto& a : pa) {
        if (auto* f = std::get_if<ReportBlocksFreeAction>(&a))
          prefill_freed.push_back(f->request_id);
        if (auto* s = std::get_if<SendMessageAction>(&a)) {
          decode.OnHoldReply(std::get<HoldReplyMsg>(s->msg), now);
        }
      }
      for (auto& a : da) {
        if (auto* r = std::get_if<PostTransferAction>(&a)) reads.push_back(r->id);
        if (auto* d = std::get_if<ReportLoadDoneAction>(&a)) loads_done.push_back(d->request_id);
        if (auto* s = std::get_if<SendMessageAction>(&a)) {
          if (auto* rd = std::get_if<ReadDoneMsg>(&s->msg)) prefill.OnReadDone(*rd, 1, now);
        }
      }
    }
    FAIL() << "actions never settled";
  }
};

TEST(PdCores, SiblingsOnThePrefillAreAllFreedByOneDecodeRead) {
  Pipe p;
  // A proxy that (wrongly) sends n = 4 to the prefill: four siblings share one transfer id.
  ASSERT_TRUE(p.prefill.OnRequestAdded("cmpl-9", 4, "xfer-9", 0).ok());
  const std::vector<int32_t> blocks = {10, 11, 12};
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(p.prefill.OnRequestFinished(std::to_string(i) + "_cmpl-9", "xfer-9", blocks, 1));
  }
  KvTransferParams params;
  params.do_remote_prefill = true;
  params.transfer_id = "xfer-9";
  params.remote_engine_id = "p0";
  params.remote_host = "127.0.0.1";
  params.remote_port = 1;
  params.remote_block_ids = blocks;
  params.remote_num_tokens = 40;
  auto m = p.decode.OnRequestAdded("cmpl-9-decode-local", params, 40, 0, 2);
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->num_external_tokens, 39);
  EXPECT_TRUE(
      p.decode.OnBlocksAllocated("cmpl-9-decode-local", std::vector<int32_t>{0, 1, 2}, 0, 39, 3)
          .ok());
  p.Pump(3);
  ASSERT_EQ(p.reads.size(), 1u);
  p.decode.OnReadCompleted(p.reads[0], OkStatus(), 4);
  p.Pump(4);
  EXPECT_EQ(p.loads_done, (std::vector<std::string>{"cmpl-9-decode-local"}));
  EXPECT_EQ(p.prefill_freed,
            (std::vector<std::string>{"0_cmpl-9", "1_cmpl-9", "2_cmpl-9", "3_cmpl-9"}));
  EXPECT_TRUE(p.prefill.Idle());
  EXPECT_TRUE(p.decode.Idle());
  EXPECT_EQ(p.prefill.counters().notifications_ignored, 0);
  EXPECT_EQ(p.decode.counters().notifications_ignored, 0);
  EXPECT_EQ(p.prefill.counters().lease_expired, 0);
}

}  // namespace
}  // namespace kvbridge
