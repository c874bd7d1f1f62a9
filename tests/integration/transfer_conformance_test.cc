// The transfer conformance suite: every backend passes the same TEST_P cases.
//
// Built twice from this one file: transfer_conformance_test (label unit: two agents in one
// process) and, with KVB_TRANSFER_MULTIPROCESS, transfer_multiprocess_test (label integration:
// a forked peer process, SIGKILLed mid-transfer; tcp across two network namespaces).
#include <fcntl.h>
#include <grp.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <sched.h>
#include <signal.h>
#include <sys/mount.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <future>
#include <mutex>
#include <random>
#include <thread>

#include "kvbridge/transfer/agent.h"
#include "transfer/auth.h"
#include "transfer/fill_pattern.h"
#include "transfer/socket_util.h"
#include "transfer/wire.h"

namespace kvbridge::transfer {
namespace {

constexpr uint8_t kPoison = 0xAB;

PagedKvLayout SmallLayout(int num_blocks = 64) {
  PagedKvLayout l;
  l.num_layers = 2;
  l.num_kv_heads = 2;
  l.head_dim = 16;
  l.block_size = 4;
  l.num_blocks = num_blocks;
  l.dtype = KvDtype::kFp32;
  return l;  // half = 512 B, block = 1 KiB
}

struct Side {
  PagedKvLayout layout;
  HostBuffer buf;
  std::unique_ptr<TransferAgent> agent;
  uint8_t* Block(int layer, int block) {
    return buf.data() + static_cast<size_t>(layer) * layout.LayerBytes() +
           static_cast<size_t>(block) * layout.BlockBytes();
  }
  void FillAll(uint64_t seed) {
    for (int l = 0; l < layout.num_layers; ++l) {
      for (int b = 0; b < layout.num_blocks; ++b)
        FillPattern(Block(l, b), layout.BlockBytes(), seed, l, b);
    }
  }
  void Poison() { std::memset(buf.data(), kPoison, buf.size()); }
  AgentMetadata Meta() { return agent->Metadata().value(); }
};

AgentConfig ConfigFor(const std::string& name, const std::string& backend) {
  AgentConfig c;
  c.name = name;
  c.backends = {backend};
  c.force_backend = backend;
  c.model_fingerprint = "model-A";
  c.peer_timeout_ms = 2000;
  c.reply_timeout_ms = 2000;
  return c;
}

std::unique_ptr<Side> MakeSide(AgentConfig cfg, PagedKvLayout layout) {
  auto s = std::make_unique<Side>();
  s->layout = layout;
  s->buf = HostBuffer::Allocate(layout.LayerBytes() * layout.num_layers).value();
  auto agent = TransferAgent::Create(std::move(cfg));
  EXPECT_TRUE(agent.ok()) << agent.status().ToString();
  s->agent = std::move(agent).value();
  Status st = s->agent->RegisterMemory(KvRegistration::FromHostBuffer(layout, s->buf));
  EXPECT_TRUE(st.ok()) << st.ToString();
  return s;
}

std::vector<BlockPair> ScatteredPairs(int n, int num_blocks, uint32_t seed) {
  std::vector<int> a(num_blocks), b(num_blocks);
  for (int i = 0; i < num_blocks; ++i) a[i] = b[i] = i;
  std::mt19937 rng(seed);
  std::shuffle(a.begin(), a.end(), rng);
  std::shuffle(b.begin(), b.end(), rng);
  std::vector<BlockPair> pairs;
  for (int i = 0; i < n; ++i) pairs.push_back({a[i], b[i]});
  return pairs;
}

class TransferConformance : public ::testing::TestWithParam<std::string> {
 protected:
  void SetUp() override {
    if (backend() == "cuda_ipc") {
      GTEST_SKIP() << "cuda_ipc moves CUDA device memory; this suite registers host memory "
                      "(its GPU conformance lives in tests/gpu)";
    }
  }
  std::string backend() const { return GetParam(); }
  bool one_sided() const { return backend() != "tcp"; }

  // a = initiator, b = target; a imported b.
  void Pair(PagedKvLayout la = SmallLayout(), PagedKvLayout lb = SmallLayout(),
            std::function<void(AgentConfig&)> tweak_b = nullptr) {
    AgentConfig cb = ConfigFor("b", backend());
    cb.cluster_token = token_;
    if (tweak_b) tweak_b(cb);
    b_ = MakeSide(cb, lb);
    AgentConfig ca = ConfigFor("a", backend());
    ca.cluster_token = token_;
    a_ = MakeSide(ca, la);
    auto added = a_->agent->AddPeer(b_->Meta());
    ASSERT_TRUE(added.ok()) << added.status().ToString();
    ASSERT_EQ(*added, backend());
  }

  TransferHandle PostOk(const TransferSpec& spec, PostOptions opt = {}) {
    auto p = a_->agent->Prepare(spec);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    auto h = a_->agent->Post(*p, std::move(opt));
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    return *h;
  }

  void ReadNotificationReplyPathCase();

  std::unique_ptr<Side> a_, b_;
  std::string token_;  ///< Pair(): both sides' cluster token.
};

TEST_P(TransferConformance, ReadScatteredBlocksAllLayersEveryByte) {
  Pair();
  b_->FillAll(7);
  a_->Poison();
  auto pairs = ScatteredPairs(20, 64, 1);
  TransferHandle h = PostOk({TransferOp::kRead, "b", pairs});
  ASSERT_TRUE(h.Wait(10000));
  ASSERT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
  std::vector<bool> dest(64, false);
  for (auto p : pairs) dest[p.local] = true;
  for (int l = 0; l < 2; ++l) {
    for (auto p : pairs) {
      ASSERT_EQ(0, std::memcmp(a_->Block(l, p.local), b_->Block(l, p.remote), 1024)) << l;
    }
    for (int blk = 0; blk < 64; ++blk) {
      if (dest[blk]) continue;
      for (int i = 0; i < 1024; ++i) ASSERT_EQ(a_->Block(l, blk)[i], kPoison);
    }
  }
}

TEST_P(TransferConformance, WriteOneLayerEveryByte) {
  Pair();
  a_->FillAll(9);
  b_->Poison();
  auto pairs = ScatteredPairs(10, 64, 2);
  TransferHandle h = PostOk({TransferOp::kWrite, "b", pairs, /*layer=*/1});
  ASSERT_TRUE(h.Wait(10000));
  ASSERT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
  std::vector<bool> dest(64, false);
  for (auto p : pairs) dest[p.remote] = true;
  for (auto p : pairs)
    ASSERT_EQ(0, std::memcmp(b_->Block(1, p.remote), a_->Block(1, p.local), 1024));
  for (int blk = 0; blk < 64; ++blk) {
    for (int i = 0; i < 1024; ++i) ASSERT_EQ(b_->Block(0, blk)[i], kPoison);  // layer 0 untouched
    if (!dest[blk]) {
      for (int i = 0; i < 1024; ++i) ASSERT_EQ(b_->Block(1, blk)[i], kPoison);
    }
  }
}

// A transfer large enough for shm's streaming-store copy (>= 4 MiB, stream_copy.h): READ and
// WRITE of scattered 39,304-byte blocks (so block starts are not all 64-byte aligned), every
// byte checked, the blocks not named left poisoned.
TEST_P(TransferConformance, LargeScatteredReadAndWriteEveryByte) {
  PagedKvLayout l = SmallLayout(200);
  l.num_layers = 1;
  l.num_kv_heads = 1;
  l.head_dim = 17;
  l.block_size = 289;  // 289 x 17 x 4 B = 19,652 B per half: 39,304 B blocks (8 mod 64)
  Pair(l, l);
  for (TransferOp op : {TransferOp::kRead, TransferOp::kWrite}) {
    Side& src = op == TransferOp::kRead ? *b_ : *a_;
    Side& dst = op == TransferOp::kRead ? *a_ : *b_;
    src.FillAll(op == TransferOp::kRead ? 51 : 52);
    dst.Poison();
    auto pairs = ScatteredPairs(150, 200, op == TransferOp::kRead ? 3 : 4);  // 5.6 MiB
    TransferHandle h = PostOk({op, "b", pairs});
    ASSERT_TRUE(h.Wait(20000));
    ASSERT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
    const size_t bb = l.BlockBytes();
    std::vector<bool> named(200, false);
    for (auto p : pairs) {
      const int s_blk = op == TransferOp::kRead ? p.remote : p.local;
      const int d_blk = op == TransferOp::kRead ? p.local : p.remote;
      named[d_blk] = true;
      ASSERT_EQ(0, std::memcmp(dst.Block(0, d_blk), src.Block(0, s_blk), bb)) << d_blk;
    }
    for (int blk = 0; blk < 200; ++blk) {
      if (named[blk]) continue;
      for (size_t i = 0; i < bb; ++i) ASSERT_EQ(dst.Block(0, blk)[i], kPoison) << blk;
    }
  }
}

TEST_P(TransferConformance, SubBlockHeadRangeBetweenDifferentTpLayouts) {
  // b holds 2 heads per rank; a holds 4 (TP 2 -> TP 1): a's heads 2..3 <- b's heads 0..1.
  PagedKvLayout la = SmallLayout();
  la.num_kv_heads = 4;
  Pair(la, SmallLayout());
  b_->FillAll(11);
  a_->Poison();
  TransferSpec spec{TransferOp::kRead, "b", {{5, 9}, {6, 3}}};
  spec.local_range = HeadRangeBytes(la, 2, 2);
  spec.remote_range = HeadRangeBytes(SmallLayout(), 0, 2);
  ASSERT_EQ(spec.local_range->offset, 2u * 4 * 16 * 4);
  ASSERT_EQ(spec.local_range->length, 512u);
  TransferHandle h = PostOk(spec);
  ASSERT_TRUE(h.Wait(10000));
  ASSERT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
  const size_t lhalf = la.HalfBlockBytes(), rhalf = 512;
  for (int l = 0; l < 2; ++l) {
    for (auto [loc, rem] : std::vector<std::pair<int, int>>{{5, 9}, {6, 3}}) {
      for (int kv = 0; kv < 2; ++kv) {
        uint8_t* dst = a_->Block(l, loc) + kv * lhalf;
        uint8_t* src = b_->Block(l, rem) + kv * rhalf;
        for (size_t i = 0; i < 512; ++i) ASSERT_EQ(dst[i], kPoison);  // heads 0..1 untouched
        ASSERT_EQ(0, std::memcmp(dst + 512, src, 512));               // heads 2..3 read
      }
    }
  }
}

TEST_P(TransferConformance, AdjacentBlocksCoalesce) {
  Pair();
  b_->FillAll(13);
  a_->Poison();
  // Given out of order; (10,20),(11,21),(12,22) and (30,40),(31,41) are runs; (50,5) alone.
  TransferSpec spec{
      TransferOp::kRead, "b", {{12, 22}, {30, 40}, {10, 20}, {50, 5}, {11, 21}, {31, 41}}, 0};
  auto p = a_->agent->Prepare(spec);
  ASSERT_TRUE(p.ok());
  ASSERT_EQ((*p)->segment_count(), 3u);
  EXPECT_EQ((*p)->segments()[0].length, 3u * 1024);
  EXPECT_EQ((*p)->segments()[0].remote_offset, 20u * 1024);
  EXPECT_EQ((*p)->bytes(), 6u * 1024);
  // Reused twice.
  for (int rep = 0; rep < 2; ++rep) {
    a_->Poison();
    auto h = a_->agent->Post(*p);
    ASSERT_TRUE(h.ok());
    ASSERT_TRUE(h->Wait(10000));
    ASSERT_EQ(h->state(), TransferState::kDone);
    for (auto bp : spec.blocks)
      ASSERT_EQ(0, std::memcmp(a_->Block(0, bp.local), b_->Block(0, bp.remote), 1024));
  }
}

TEST_P(TransferConformance, NotificationArrivesAfterWriteDataLanded) {
  Pair();
  a_->FillAll(17);
  b_->Poison();
  auto pairs = ScatteredPairs(32, 64, 3);
  std::mutex mu;
  std::condition_variable cv;
  bool got = false, data_ok = false;
  std::string payload, tid;
  b_->agent->SetNotificationHandler([&](Notification n) {
    bool ok = true;  // every byte must already be there when the notification runs
    for (int l = 0; l < 2; ++l) {
      for (auto p : pairs)
        ok = ok && std::memcmp(b_->Block(l, p.remote), a_->Block(l, p.local), 1024) == 0;
    }
    std::lock_guard<std::mutex> g(mu);
    got = true;
    data_ok = ok;
    payload = n.payload;
    tid = n.transfer_id;
    EXPECT_EQ(n.peer, "a");
    cv.notify_all();
  });
  PostOptions opt;
  opt.transfer_id = "tx-1";
  opt.notification = "written rank0";
  TransferHandle h = PostOk({TransferOp::kWrite, "b", pairs}, opt);
  ASSERT_TRUE(h.Wait(10000));
  ASSERT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
  std::unique_lock<std::mutex> l(mu);
  ASSERT_TRUE(cv.wait_for(l, std::chrono::seconds(5), [&] { return got; }));
  EXPECT_TRUE(data_ok);
  EXPECT_EQ(payload, "written rank0");
  EXPECT_EQ(tid, "tx-1");
}

TEST_P(TransferConformance, ReadNotificationReplyPath) { ReadNotificationReplyPathCase(); }

// The same with a cluster token on both sides: every handshake is proven both ways, and
// notifications and replies flow over the authenticated paths (ucx: messages count only from
// connections that completed the handshake).
TEST_P(TransferConformance, ReadNotificationReplyPathWithClusterToken) {
  token_ = "s3cret-token";
  ReadNotificationReplyPathCase();
  if (HasFatalFailure()) return;
  EXPECT_EQ(a_->agent->HandshakeRefusalCounts().servers, 0);
  EXPECT_EQ(b_->agent->HandshakeRefusalCounts().peers, 0);
}

void TransferConformance::ReadNotificationReplyPathCase() {
  Pair();
  if (HasFatalFailure()) return;
  b_->FillAll(19);
  a_->Poison();
  auto pairs = ScatteredPairs(8, 64, 4);
  std::atomic<bool> data_ok{false};
  b_->agent->SetNotificationHandler([&](Notification n) {
    bool ok = true;  // READ: the data landed at a before b hears of it
    for (auto p : pairs)
      ok = ok && std::memcmp(a_->Block(0, p.local), b_->Block(0, p.remote), 1024) == 0;
    data_ok = ok;
    ASSERT_TRUE(n.wants_reply);
    EXPECT_TRUE(b_->agent->Reply(n, n.transfer_id == "tx-9" ? "held" : "gone").ok());
  });
  std::promise<Result<std::string>> reply;
  PostOptions opt;
  opt.transfer_id = "tx-9";
  opt.notification = "read-done";
  opt.on_reply = [&](Result<std::string> r) { reply.set_value(std::move(r)); };
  TransferHandle h = PostOk({TransferOp::kRead, "b", pairs}, std::move(opt));
  ASSERT_TRUE(h.Wait(10000));
  ASSERT_EQ(h.state(), TransferState::kDone);
  auto f = reply.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  Result<std::string> r = f.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, "held");
  EXPECT_TRUE(data_ok);
  // Standalone notification, reply in the other direction (b -> a over b's inbound path).
  std::promise<std::string> back;
  a_->agent->SetNotificationHandler(
      [&](Notification n) { EXPECT_TRUE(a_->agent->Reply(n, "pong:" + n.payload).ok()); });
  ASSERT_TRUE(b_->agent
                  ->Notify("a", "tx-2", "ping",
                           [&](Result<std::string> r2) {
                             back.set_value(r2.ok() ? *r2 : r2.status().ToString());
                           })
                  .ok());
  auto fb = back.get_future();
  ASSERT_EQ(fb.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_EQ(fb.get(), "pong:ping");
}

TEST_P(TransferConformance, UnansweredNotificationTimesOut) {
  Pair();
  b_->agent->SetNotificationHandler([](Notification) {});  // never replies
  std::promise<Status> p;
  ASSERT_TRUE(
      a_->agent->Notify("b", "t", "x", [&](Result<std::string> r) { p.set_value(r.status()); })
          .ok());
  auto f = p.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(5)), std::future_status::ready);
  EXPECT_EQ(f.get().code(), StatusCode::kDeadlineExceeded);
}

TEST_P(TransferConformance, OutOfRangeRefusedAndNothingTouched) {
  Pair();
  // Prepare refuses against the peer's metadata.
  auto bad = a_->agent->Prepare({TransferOp::kRead, "b", {{0, 64}}});
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(bad.status().message().find("remote block 64"), std::string::npos);
  EXPECT_EQ(a_->agent->Prepare({TransferOp::kRead, "b", {{-1, 0}}}).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(a_->agent->Prepare({TransferOp::kRead, "b", {{0, 0}}, 2}).status().code(),
            StatusCode::kInvalidArgument);
  TransferSpec r{TransferOp::kRead, "b", {{0, 0}}};
  r.local_range = ByteRange{256, 512};
  r.remote_range = ByteRange{0, 512};
  EXPECT_EQ(a_->agent->Prepare(r).status().code(), StatusCode::kInvalidArgument);

  // A lying peer description (twice the blocks) gets past Prepare; the backend refuses.
  b_->Poison();
  a_->FillAll(5);
  AgentMetadata forged = b_->Meta();
  forged.agent_name = "b-forged";
  forged.layout.num_blocks *= 2;
  for (auto& n : forged.layer_bytes) n *= 2;
  auto added = a_->agent->AddPeer(forged);
  if (!added.ok()) {
    // shm maps the real regions: the handshake's sizes disagree with the metadata.
    EXPECT_TRUE(one_sided()) << added.status().ToString();
    EXPECT_EQ(added.status().code(), StatusCode::kUnavailable);
  } else {
    auto p = a_->agent->Prepare({TransferOp::kWrite, "b-forged", {{1, 63}, {2, 64}, {3, 100}}});
    ASSERT_TRUE(p.ok());
    auto h = a_->agent->Post(*p);
    ASSERT_TRUE(h.ok());
    ASSERT_TRUE(h->Wait(10000));
    EXPECT_EQ(h->state(), TransferState::kFailed);
    EXPECT_EQ(h->status().code(), StatusCode::kInvalidArgument) << h->status().ToString();
  }
  for (size_t i = 0; i < b_->buf.size(); ++i) ASSERT_EQ(b_->buf.data()[i], kPoison) << i;
}

TEST_P(TransferConformance, HoldCheckRefusesBlocksNotHeld) {
  if (one_sided())
    GTEST_SKIP() << backend() << " is one-sided: the target is never asked (trusted peers only)";
  std::mutex mu;
  std::vector<std::pair<std::string, std::vector<int>>> asked;
  Pair(SmallLayout(), SmallLayout(), [&](AgentConfig& c) {
    c.hold_check = [&](TransferOp op, std::string_view tid, const std::vector<int>& blocks) {
      std::lock_guard<std::mutex> l(mu);
      EXPECT_EQ(op, TransferOp::kRead);
      asked.emplace_back(std::string(tid), blocks);
      return tid == "held-tx";
    };
  });
  b_->FillAll(23);
  a_->Poison();
  PostOptions opt;
  opt.transfer_id = "other-tx";
  TransferHandle h = PostOk({TransferOp::kRead, "b", {{1, 7}, {2, 3}}}, opt);
  ASSERT_TRUE(h.Wait(10000));
  EXPECT_EQ(h.state(), TransferState::kFailed);
  EXPECT_EQ(h.status().code(), StatusCode::kFailedPrecondition) << h.status().ToString();
  for (size_t i = 0; i < a_->buf.size(); ++i) ASSERT_EQ(a_->buf.data()[i], kPoison);
  {
    std::lock_guard<std::mutex> l(mu);
    ASSERT_EQ(asked.size(), 1u);
    EXPECT_EQ(asked[0].first, "other-tx");
    EXPECT_EQ(asked[0].second, (std::vector<int>{3, 7}));
  }
  opt.transfer_id = "held-tx";
  TransferHandle ok = PostOk({TransferOp::kRead, "b", {{1, 7}, {2, 3}}}, opt);
  ASSERT_TRUE(ok.Wait(10000));
  EXPECT_EQ(ok.state(), TransferState::kDone) << ok.status().ToString();
  EXPECT_EQ(0, std::memcmp(a_->Block(1, 1), b_->Block(1, 7), 1024));
}

// Direction and ownership on the serving side (issue 22): a peer READs only blocks held for
// its transfer and WRITEs only into blocks offered for it; a WRITE into a READ hold (the
// attack: overwrite a prefill's held, maybe prefix-cached, blocks) is refused, no byte moves.
TEST_P(TransferConformance, DirectionCheckRefusesWriteIntoReadHold) {
  if (one_sided())
    GTEST_SKIP() << backend() << " is one-sided: the target is never asked (trusted peers only)";
  std::mutex mu;
  std::vector<TransferOp> asked;
  Pair(SmallLayout(), SmallLayout(), [&](AgentConfig& c) {
    // b holds blocks {3, 7} for READ transfer "rd-tx" and offered {5} to WRITE transfer "wr-tx".
    c.hold_check = [&](TransferOp op, std::string_view tid, const std::vector<int>& blocks) {
      std::lock_guard<std::mutex> l(mu);
      asked.push_back(op);
      const std::vector<int> allowed =
          op == TransferOp::kRead ? (tid == "rd-tx" ? std::vector<int>{3, 7} : std::vector<int>{})
                                  : (tid == "wr-tx" ? std::vector<int>{5} : std::vector<int>{});
      return std::includes(allowed.begin(), allowed.end(), blocks.begin(), blocks.end()) &&
             !blocks.empty();
    };
  });
  b_->FillAll(31);
  a_->FillAll(77);
  std::vector<uint8_t> b_before(b_->buf.data(), b_->buf.data() + b_->buf.size());
  auto refused = [&](TransferOp op, std::vector<BlockPair> pairs, const std::string& tid,
                     const std::string& want) {
    PostOptions opt;
    opt.transfer_id = tid;
    TransferHandle h = PostOk({op, "b", std::move(pairs)}, opt);
    ASSERT_TRUE(h.Wait(10000));
    EXPECT_EQ(h.state(), TransferState::kFailed);
    EXPECT_EQ(h.status().code(), StatusCode::kFailedPrecondition) << h.status().ToString();
    EXPECT_NE(h.status().message().find(want), std::string::npos) << h.status().ToString();
  };
  // WRITE into the READ hold: same transfer id, same blocks, wrong direction.
  refused(TransferOp::kWrite, {{1, 7}, {2, 3}}, "rd-tx",
          "WRITE refused: blocks not offered for writing by transfer 'rd-tx'");
  // WRITE beyond the offer (5 offered, 6 not).
  refused(TransferOp::kWrite, {{1, 5}, {2, 6}}, "wr-tx",
          "WRITE refused: blocks not offered for writing by transfer 'wr-tx'");
  ASSERT_EQ(0, std::memcmp(b_->buf.data(), b_before.data(), b_before.size()))
      << "a refused WRITE changed the target's bytes";
  // READ of blocks not held (9), and READ of the WRITE offer.
  a_->Poison();
  refused(TransferOp::kRead, {{1, 9}}, "rd-tx",
          "READ refused: blocks not held for transfer 'rd-tx'");
  refused(TransferOp::kRead, {{1, 5}}, "wr-tx",
          "READ refused: blocks not held for transfer 'wr-tx'");
  for (size_t i = 0; i < a_->buf.size(); ++i) ASSERT_EQ(a_->buf.data()[i], kPoison) << i;
  // The legitimate directions still move every byte.
  PostOptions rd;
  rd.transfer_id = "rd-tx";
  TransferHandle r = PostOk({TransferOp::kRead, "b", {{1, 7}, {2, 3}}}, rd);
  ASSERT_TRUE(r.Wait(10000));
  EXPECT_EQ(r.state(), TransferState::kDone) << r.status().ToString();
  EXPECT_EQ(0, std::memcmp(a_->Block(0, 1), b_->Block(0, 7), SmallLayout().BlockBytes()));
  EXPECT_EQ(0, std::memcmp(a_->Block(1, 2), b_->Block(1, 3), SmallLayout().BlockBytes()));
  a_->FillAll(77);
  PostOptions wr;
  wr.transfer_id = "wr-tx";
  TransferHandle w = PostOk({TransferOp::kWrite, "b", {{4, 5}}}, wr);
  ASSERT_TRUE(w.Wait(10000));
  EXPECT_EQ(w.state(), TransferState::kDone) << w.status().ToString();
  EXPECT_EQ(0, std::memcmp(b_->Block(0, 5), a_->Block(0, 4), SmallLayout().BlockBytes()));
  EXPECT_EQ(0, std::memcmp(b_->Block(1, 5), a_->Block(1, 4), SmallLayout().BlockBytes()));
  std::lock_guard<std::mutex> l(mu);
  EXPECT_EQ(asked,
            (std::vector<TransferOp>{TransferOp::kWrite, TransferOp::kWrite, TransferOp::kRead,
                                     TransferOp::kRead, TransferOp::kRead, TransferOp::kWrite}));
}

// Authenticated handshakes (issue 22): with a cluster token on the target, a peer without it
// or with another is refused at AddPeer (Unauthenticated, a clear reason, no memory reachable);
// the same token connects and moves bytes.
TEST_P(TransferConformance, ClusterTokenRefusesTokenlessAndWrongTokenPeers) {
  if (backend() != "shm" && backend() != "tcp" && backend() != "ucx")
    GTEST_SKIP() << backend() << " does not check the cluster token (docs/transfer.md)";
  b_ = MakeSide(
      [&] {
        AgentConfig c = ConfigFor("b", backend());
        c.cluster_token = "s3cret-token";
        return c;
      }(),
      SmallLayout());
  b_->FillAll(5);
  struct Case {
    std::string token;
    std::string want;
  };
  for (const Case& c :
       {Case{"", "requires the cluster token"}, Case{"another-token", "wrong cluster token"}}) {
    AgentConfig ca = ConfigFor("a", backend());
    ca.cluster_token = c.token;
    auto a = MakeSide(ca, SmallLayout());
    auto added = a->agent->AddPeer(b_->Meta());
    ASSERT_FALSE(added.ok()) << "token '" << c.token << "' was accepted";
    EXPECT_EQ(added.status().code(), StatusCode::kUnauthenticated) << added.status().ToString();
    EXPECT_NE(added.status().message().find(c.want), std::string::npos)
        << added.status().ToString();
  }
  // Both refusals counted on the serving side; the refused clients count a refusal too.
  EXPECT_EQ(b_->agent->HandshakeRefusalCounts().peers, 2);
  EXPECT_EQ(b_->agent->HandshakeRefusalCounts().servers, 0);
  AgentConfig ca = ConfigFor("a", backend());
  ca.cluster_token = "s3cret-token";
  a_ = MakeSide(ca, SmallLayout());
  auto added = a_->agent->AddPeer(b_->Meta());
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  EXPECT_EQ(a_->agent->HandshakeRefusalCounts().servers, 0);
  EXPECT_EQ(b_->agent->HandshakeRefusalCounts().peers, 2);
  a_->Poison();
  TransferHandle h = PostOk({TransferOp::kRead, "b", {{1, 7}}});
  ASSERT_TRUE(h.Wait(10000));
  EXPECT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
  EXPECT_EQ(0, std::memcmp(a_->Block(0, 1), b_->Block(0, 7), SmallLayout().BlockBytes()));
}

// Mutual proof (issue 22): a client holding the token refuses a serving side that does not
// prove it back — a real agent without the token (it sends no challenge), and a fake server at
// the endpoint the metadata names that answers the client's nonce with a proof under another
// token, or reflects the client's own proof. The refused AddPeer leaves no peer (Post fails:
// nothing can move) and is counted; the fake receives no data request.
TEST_P(TransferConformance, ClusterTokenClientRefusesUnprovenServer) {
  if (backend() != "shm" && backend() != "tcp" && backend() != "ucx")
    GTEST_SKIP() << backend() << " does not check the cluster token (docs/transfer.md)";
  AgentConfig ca = ConfigFor("a", backend());
  ca.cluster_token = "s3cret-token";
  a_ = MakeSide(ca, SmallLayout());
  a_->Poison();
  // 1. A tokenless agent: no challenge, an accepting ack.
  b_ = MakeSide(ConfigFor("b", backend()), SmallLayout());
  b_->FillAll(9);
  auto added = a_->agent->AddPeer(b_->Meta());
  ASSERT_FALSE(added.ok()) << "an unproven server was accepted";
  EXPECT_EQ(added.status().code(), StatusCode::kUnauthenticated) << added.status().ToString();
  EXPECT_NE(added.status().message().find("did not prove the cluster token"), std::string::npos)
      << added.status().ToString();
  EXPECT_EQ(a_->agent->HandshakeRefusalCounts().servers, 1);
  EXPECT_FALSE(a_->agent->Prepare({TransferOp::kRead, "b", {{1, 7}}}).ok());
  for (size_t i = 0; i < a_->buf.size(); ++i) ASSERT_EQ(a_->buf.data()[i], kPoison) << i;
  if (backend() == "ucx") return;  // the fake below speaks the stream backends' frames
  // 2. A fake server at the endpoint: a proof under another token; the client's own reflected.
  const AgentMetadata real = b_->Meta();
  for (const bool reflect : {false, true}) {
    AgentMetadata meta = real;
    net::Fd listen;
    if (backend() == "tcp") {
      int port = 0;
      listen = net::TcpListen("127.0.0.1", 0, &port).value();
      meta.endpoints["tcp"] = "127.0.0.1:" + std::to_string(port);
    } else {
      const std::string name = "@kvbridge-test-fake-" + std::to_string(::getpid());
      listen = net::UnixListen(name).value();
      meta.endpoints["shm"] = name;
    }
    std::atomic<int> data_requests{0};
    std::thread fake([&] {
      for (;;) {
        const int fd = ::accept(listen.get(), nullptr, nullptr);
        if (fd < 0) return;
        net::Fd sock(fd);
        net::SetTimeouts(sock.get(), 3000, 3000);
        wire::FrameHeader h;
        std::string m;
        if (!net::RecvFrameHead(sock.get(), &h, &m).ok()) continue;
        wire::Hello hello = wire::DecodeHello(m).value();
        const std::string nonce(auth::kNonceBytes, 'n');
        wire::FrameHeader c;
        c.type = wire::FrameType::kChallenge;
        if (!net::SendFrame(sock.get(), c, nonce).ok()) continue;
        if (!net::RecvFrameHead(sock.get(), &h, &m).ok()) continue;
        auto answer = auth::DecodeChallengeAnswer(m);
        if (!answer.ok() || answer->proof.empty()) continue;
        wire::FrameHeader p;
        p.type = wire::FrameType::kServerProof;
        const std::string proof =
            reflect
                ? answer->proof
                : auth::Proof("another-token",
                              auth::ServerContext(backend(), real.incarnation, hello.agent_name),
                              answer->client_nonce);
        if (!net::SendFrame(sock.get(), p, proof).ok()) continue;
        wire::FrameHeader ack;
        ack.type = wire::FrameType::kHelloAck;
        if (!net::SendFrame(sock.get(), ack, "").ok()) continue;
        // Anything further would be a data request the client must never send.
        if (net::RecvFrameHead(sock.get(), &h, &m).ok()) data_requests += 1;
      }
    });
    auto fake_added = a_->agent->AddPeer(meta);
    net::Shutdown(listen.get());
    fake.join();
    ASSERT_FALSE(fake_added.ok()) << "a fake server was accepted (reflect=" << reflect << ")";
    EXPECT_EQ(fake_added.status().code(), StatusCode::kUnauthenticated)
        << fake_added.status().ToString();
    EXPECT_NE(fake_added.status().message().find("proof of the cluster token is wrong"),
              std::string::npos)
        << fake_added.status().ToString();
    EXPECT_EQ(data_requests.load(), 0);
  }
  EXPECT_EQ(a_->agent->HandshakeRefusalCounts().servers, 3);
  for (size_t i = 0; i < a_->buf.size(); ++i) ASSERT_EQ(a_->buf.data()[i], kPoison) << i;
  // The same token both ways connects and moves bytes.
  AgentConfig cb = ConfigFor("b2", backend());
  cb.cluster_token = "s3cret-token";
  auto b2 = MakeSide(cb, SmallLayout());
  b2->FillAll(11);
  added = a_->agent->AddPeer(b2->Meta());
  ASSERT_TRUE(added.ok()) << added.status().ToString();
  TransferHandle h = PostOk({TransferOp::kRead, "b2", {{1, 7}}});
  ASSERT_TRUE(h.Wait(10000));
  EXPECT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
  EXPECT_EQ(0, std::memcmp(a_->Block(0, 1), b2->Block(0, 7), SmallLayout().BlockBytes()));
  EXPECT_EQ(b2->agent->HandshakeRefusalCounts().peers, 0);
}

// shm hands the KV pool's memfds only to processes of its own uid: a client running as
// `nobody` (a forked child that dropped to nobody/nogroup, as setpriv --reuid=nobody
// --regid=nogroup --clear-groups does) is refused with the reason and receives no fd — with
// or without a token on the server.
TEST_P(TransferConformance, ShmRefusesForeignUidPeer) {
  if (backend() != "shm") GTEST_SKIP() << "the uid check is shm's (same-host memfds)";
  if (::geteuid() != 0) GTEST_SKIP() << "needs root to run a client as another uid (nobody)";
  const struct passwd* nobody = ::getpwnam("nobody");
  if (nobody == nullptr) GTEST_SKIP() << "no 'nobody' user on this host";
  const uid_t uid = nobody->pw_uid;
  const gid_t gid = nobody->pw_gid;
  b_ = MakeSide(ConfigFor("b", backend()), SmallLayout());
  const AgentMetadata meta = b_->Meta();
  const std::string endpoint = meta.endpoints.at("shm");
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    // Child: only async-safe-ish socket work after dropping privileges; exit codes report.
    if (::setgroups(0, nullptr) != 0 || ::setresgid(gid, gid, gid) != 0 ||
        ::setresuid(uid, uid, uid) != 0 || ::geteuid() != uid)
      ::_exit(10);
    auto sock = net::UnixConnect(endpoint);
    if (!sock.ok()) ::_exit(11);
    net::SetTimeouts(sock->get(), 5000, 5000);
    wire::FrameHeader h;
    h.type = wire::FrameType::kHello;
    wire::Hello hello{"intruder", 1, meta.incarnation, 0};
    if (!net::SendFrame(sock->get(), h, wire::EncodeHello(hello)).ok()) ::_exit(12);
    uint8_t head[wire::kFrameHeaderBytes];
    std::vector<net::Fd> fds;
    if (!net::RecvWithFds(sock->get(), head, sizeof(head), &fds).ok()) ::_exit(13);
    if (!fds.empty()) ::_exit(1);  // the leak this test exists for
    auto ack = wire::DecodeFrameHeader(head, sizeof(head));
    if (!ack.ok() || ack->type != wire::FrameType::kHelloAck) ::_exit(14);
    if (ack->status != static_cast<uint16_t>(StatusCode::kPermissionDenied)) ::_exit(15);
    std::string m(ack->meta_len, '\0');
    if (!m.empty() && !net::RecvAll(sock->get(), m.data(), m.size()).ok()) ::_exit(16);
    if (m.find("must be processes of the same user") == std::string::npos) ::_exit(17);
    ::_exit(0);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status)) << status;
  EXPECT_EQ(WEXITSTATUS(status), 0)
      << "1 = the foreign-uid client received fds; 10.. = the probe failed at step "
      << WEXITSTATUS(status) - 10;
  // The same uid still connects.
  a_ = MakeSide(ConfigFor("a", backend()), SmallLayout());
  auto added = a_->agent->AddPeer(b_->Meta());
  EXPECT_TRUE(added.ok()) << added.status().ToString();
}

TEST_P(TransferConformance, MetadataMismatchRefusedNamingField) {
  b_ = MakeSide(ConfigFor("b", backend()), SmallLayout());
  AgentConfig ca = ConfigFor("a", backend());
  ca.model_fingerprint = "model-B";
  a_ = MakeSide(ca, SmallLayout());
  auto r = a_->agent->AddPeer(b_->Meta());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("model_fingerprint"), std::string::npos)
      << r.status().message();

  PagedKvLayout bf = SmallLayout();
  bf.dtype = KvDtype::kBf16;
  auto c = MakeSide(ConfigFor("c", backend()), bf);
  r = b_->agent->AddPeer(c->Meta());
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(), "peer metadata mismatch: dtype (local fp32, peer bf16)");
  // Round trip through the wire form keeps compatibility; a corrupted blob is refused.
  std::string blob = EncodeMetadata(b_->Meta());
  ASSERT_TRUE(DecodeMetadata(blob).ok());
  auto m = DecodeMetadata(blob);
  m->layout.head_dim = 32;
  EXPECT_EQ(a_->agent->AddPeer(*m).status().code(), StatusCode::kFailedPrecondition);
  // A peer restarted since its metadata was taken: stale incarnation refused at handshake.
  AgentMetadata stale = b_->Meta();
  stale.incarnation ^= 1;
  stale.model_fingerprint = "model-B";
  stale.compat_hash = ComputeCompatHash(stale);
  auto s = a_->agent->AddPeer(stale);
  ASSERT_FALSE(s.ok());
  EXPECT_NE(s.status().message().find("incarnation"), std::string::npos) << s.status().ToString();
}

TEST_P(TransferConformance, CancelEndsOnlyWhenNoMoreBytesLand) {
  PagedKvLayout big = SmallLayout();
  big.num_layers = 1;
  big.num_kv_heads = 8;
  big.head_dim = 64;
  big.block_size = 16;   // 64 KiB blocks
  big.num_blocks = 512;  // 32 MiB
  Pair(big, big);
  b_->FillAll(29);
  std::atomic<int> notes{0};
  b_->agent->SetNotificationHandler([&](Notification) { notes++; });
  int cancelled = 0;
  for (int rep = 0; rep < 3; ++rep) {
    a_->Poison();
    std::vector<BlockPair> pairs;
    for (int i = 0; i < 512; ++i) pairs.push_back({i, 511 - i});
    PostOptions opt;
    opt.transfer_id = "c" + std::to_string(rep);
    opt.notification = "done";
    TransferHandle h = PostOk({TransferOp::kRead, "b", pairs}, opt);
    h.Cancel();
    ASSERT_TRUE(h.Wait(10000));
    if (h.state() == TransferState::kFailed) {
      EXPECT_EQ(h.status().code(), StatusCode::kCancelled) << h.status().ToString();
      ++cancelled;
    }
    std::vector<uint8_t> snap(a_->buf.data(), a_->buf.data() + a_->buf.size());
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_EQ(0, std::memcmp(snap.data(), a_->buf.data(), snap.size()))
        << "bytes landed after cancel";
  }
  // ucx: a cancel only stops operations not yet posted; posted ones are flushed (kDone).
  if (backend() != "ucx") {
    EXPECT_GT(cancelled, 0);
  }
  // Only transfers that completed anyway sent their notification.
  EXPECT_EQ(notes.load(), 3 - cancelled);
}

TEST_P(TransferConformance, ThousandConcurrentTransfers) {
  PagedKvLayout l = SmallLayout(1000);
  l.num_layers = 1;
  Pair(l, l);
  b_->FillAll(31);
  a_->FillAll(37);
  std::vector<uint8_t> a_orig(a_->buf.data(), a_->buf.data() + a_->buf.size());
  std::vector<uint8_t> b_orig(b_->buf.data(), b_->buf.data() + b_->buf.size());
  for (int i = 0; i < 1000; i += 2) std::memset(a_->Block(0, i), kPoison, 1024);
  // Even i: READ a[i] <- b[999 - i]; odd i: WRITE a[i] -> b[999 - i]. All blocks disjoint.
  std::vector<TransferHandle> hs;
  for (int i = 0; i < 1000; ++i) {
    hs.push_back(PostOk({i % 2 ? TransferOp::kWrite : TransferOp::kRead, "b", {{i, 999 - i}}}));
  }
  for (auto& h : hs) {
    ASSERT_TRUE(h.Wait(20000));
    ASSERT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
  }
  for (int i = 0; i < 1000; ++i) {
    const size_t off_a = static_cast<size_t>(i) * 1024, off_b = static_cast<size_t>(999 - i) * 1024;
    if (i % 2 == 0) {
      ASSERT_EQ(0, std::memcmp(a_->Block(0, i), b_orig.data() + off_b, 1024)) << i;
    } else {
      ASSERT_EQ(0, std::memcmp(b_->Block(0, 999 - i), a_orig.data() + off_a, 1024)) << i;
    }
  }
}

TEST_P(TransferConformance, GonePeerFailsLaterOpsAtOnce) {
  Pair();
  auto p = a_->agent->Prepare({TransferOp::kRead, "b", {{0, 0}}});
  ASSERT_TRUE(p.ok());
  {
    // One READ that completes first, so connection setup is over before the peer goes (UCX 1.13
    // asserts inside libucs when a wireup reply reaches an endpoint that is being removed).
    auto h = a_->agent->Post(*p);
    ASSERT_TRUE(h.ok());
    ASSERT_TRUE(h->Wait(10000));
    ASSERT_EQ(h->state(), TransferState::kDone);
  }
  b_.reset();  // the peer agent goes away (connections close)
  auto t0 = std::chrono::steady_clock::now();
  Status last;
  for (;;) {
    auto h = a_->agent->Post(*p);
    if (!h.ok()) {
      last = h.status();
      break;
    }
    h->Wait(5000);
    if (h->state() == TransferState::kFailed) {
      last = h->status();
      break;
    }
    ASSERT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(3))
        << "peer death not detected";
  }
  EXPECT_EQ(last.code(), StatusCode::kUnavailable) << last.ToString();
  // Known dead now: the next post fails at once.
  auto h = a_->agent->Post(*p);
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(a_->agent->Notify("b", "t", "x").code(), StatusCode::kUnavailable);
}

// tcp stripes a WRITE over several connections, so a dying writer's message channel
// (connection 0) can close while the server thread of another of its connections is still
// copying bytes it sent before it died. Its loss — on which a WRITE decode frees the blocks the
// peer was writing — is reported only once every connection of that peer ended (issue 21).
TEST_P(TransferConformance, TcpPeerLossWaitsForEveryDataConnection) {
  if (backend() != "tcp") GTEST_SKIP() << "tcp's striping of a transfer over connections";
  AgentConfig cb = ConfigFor("b", backend());
  cb.hold_check = [](TransferOp op, std::string_view tid, const std::vector<int>&) {
    return op == TransferOp::kWrite && tid == "w-tx";
  };
  b_ = MakeSide(cb, SmallLayout());
  b_->Poison();
  std::mutex mu;
  std::condition_variable cv;
  std::vector<std::string> lost;
  b_->agent->SetPeerLostHandler([&](const std::string& peer) {
    std::lock_guard<std::mutex> l(mu);
    lost.push_back(peer);
    cv.notify_all();
  });
  const AgentMetadata meta = b_->Meta();
  std::string host;
  int port = 0;
  ASSERT_TRUE(net::ParseHostPort(meta.endpoints.at("tcp"), &host, &port).ok());
  // The writing peer "w", by hand: its channel (connection 0) and one data connection.
  auto connect = [&](uint32_t index) {
    auto sock = net::TcpConnect(host, port, 2000);
    EXPECT_TRUE(sock.ok()) << sock.status().ToString();
    if (!sock.ok()) return net::Fd();
    net::SetTimeouts(sock->get(), 3000, 3000);
    wire::FrameHeader h;
    h.type = wire::FrameType::kHello;
    const wire::Hello hello{"w", 77, meta.incarnation, index};
    EXPECT_TRUE(net::SendFrame(sock->get(), h, wire::EncodeHello(hello)).ok());
    wire::FrameHeader ack;
    std::string m;
    EXPECT_TRUE(net::RecvFrameHead(sock->get(), &ack, &m).ok());
    EXPECT_EQ(ack.type, wire::FrameType::kHelloAck);
    EXPECT_EQ(ack.status, 0);
    return std::move(*sock);
  };
  net::Fd channel = connect(0);
  net::Fd data = connect(1);
  ASSERT_TRUE(channel.valid() && data.valid());
  // A WRITE of block 5 (layer 0) whose payload is half sent: the server thread is copying it.
  const size_t bytes = SmallLayout().BlockBytes();
  std::vector<uint8_t> payload(bytes);
  FillPattern(payload.data(), bytes, 31, 0, 5);
  Segment seg;
  seg.remote_layer = 0;
  seg.remote_offset = 5 * bytes;
  seg.length = bytes;
  wire::Writer w;
  wire::EncodeDataRequest("w-tx", &seg, 1, w);
  wire::FrameHeader req;
  req.type = wire::FrameType::kWriteReq;
  req.request_id = 1;
  req.payload_len = bytes;
  struct iovec first {
    payload.data(), bytes / 2
  };
  ASSERT_TRUE(net::SendFrame(data.get(), req, w.buf(), &first, 1).ok());
  // The peer's channel closes (as its process dies, its connections close one by one).
  channel.Reset();
  {
    std::unique_lock<std::mutex> l(mu);
    EXPECT_FALSE(cv.wait_for(l, std::chrono::milliseconds(300), [&] { return !lost.empty(); }))
        << "the loss was reported while a data connection of the peer could still land bytes";
  }
  // Its bytes still land: a target freed at the channel's close would be overwritten now.
  struct iovec rest {
    payload.data() + bytes / 2, bytes - bytes / 2
  };
  ASSERT_TRUE(net::SendIov(data.get(), &rest, 1).ok());
  wire::FrameHeader ack;
  std::string m;
  ASSERT_TRUE(net::RecvFrameHead(data.get(), &ack, &m).ok());
  EXPECT_EQ(ack.type, wire::FrameType::kWriteAck);
  EXPECT_EQ(ack.status, 0);
  EXPECT_EQ(0, std::memcmp(b_->Block(0, 5), payload.data(), bytes));
  {
    std::lock_guard<std::mutex> l(mu);
    EXPECT_TRUE(lost.empty());
  }
  // Its last connection closes: no byte can land any more, and the loss is reported, once.
  const auto t0 = std::chrono::steady_clock::now();
  data.Reset();
  {
    std::unique_lock<std::mutex> l(mu);
    ASSERT_TRUE(cv.wait_for(l, std::chrono::seconds(2), [&] { return !lost.empty(); }))
        << "the loss was not reported once every connection of the peer had closed";
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(1));
  std::this_thread::sleep_for(std::chrono::milliseconds(100));
  std::lock_guard<std::mutex> l(mu);
  EXPECT_EQ(lost, std::vector<std::string>{"w"});
}

#ifdef KVB_TRANSFER_MULTIPROCESS
// ---------------------------------------------------------------- multi-process

// Forks a peer that registers `layout` filled with FillAll(seed) and prints its metadata to a
// pipe; it lives until killed. Called before the parent starts any thread of its own.
struct Child {
  pid_t pid = -1;
  AgentMetadata meta;
  ~Child() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

bool ReadAll(int fd, std::string* out) {
  char buf[4096];
  for (;;) {
    ssize_t n = ::read(fd, buf, sizeof(buf));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return !out->empty();
    out->append(buf, static_cast<size_t>(n));
    if (out->back() == '\n') return true;
  }
}

// Joins network namespace `netns` as `ip netns exec` does: setns, then a private mount
// namespace with /sys remounted, so that /sys/class/net lists this namespace's interfaces
// (UCX's tcp transport enumerates its devices there; with the host's /sys it finds no device
// of the namespace and ucp_ep_create fails). False on any failure.
bool EnterNetns(const std::string& netns) {
  const int nfd = ::open(("/run/netns/" + netns).c_str(), O_RDONLY | O_CLOEXEC);
  if (nfd < 0) return false;
  const bool joined = ::setns(nfd, CLONE_NEWNET) == 0;
  ::close(nfd);
  if (!joined || ::unshare(CLONE_NEWNS) != 0) return false;
  if (::mount(nullptr, "/", nullptr, MS_SLAVE | MS_REC, nullptr) != 0) return false;
  ::umount2("/sys", MNT_DETACH);
  return ::mount("sysfs", "/sys", "sysfs", 0, nullptr) == 0;
}

void ForkPeer(Child* c, const std::string& backend, PagedKvLayout layout, uint64_t seed,
              const std::string& netns = "", const std::string& bind = "127.0.0.1",
              const std::string& token = "") {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  c->pid = ::fork();
  ASSERT_GE(c->pid, 0);
  if (c->pid == 0) {
    ::close(fds[0]);
    if (!netns.empty() && !EnterNetns(netns)) ::_exit(3);
    AgentConfig cfg = ConfigFor("child", backend);
    cfg.bind_host = bind;
    cfg.cluster_token = token;
    auto side = MakeSide(cfg, layout);
    side->FillAll(seed);
    std::string blob = EncodeMetadata(side->Meta()) + "\n";
    if (::write(fds[1], blob.data(), blob.size()) != static_cast<ssize_t>(blob.size())) ::_exit(2);
    ::close(fds[1]);
    for (;;) ::pause();
  }
  ::close(fds[1]);
  std::string blob;
  ASSERT_TRUE(ReadAll(fds[0], &blob)) << "peer died before sending its metadata";
  ::close(fds[0]);
  auto m = DecodeMetadata(blob.substr(0, blob.size() - 1));
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  c->meta = *m;
}

PagedKvLayout BigLayout() {
  PagedKvLayout l = SmallLayout();
  l.num_layers = 2;
  l.num_kv_heads = 8;
  l.head_dim = 64;
  l.block_size = 16;    // 64 KiB blocks
  l.num_blocks = 1024;  // 64 MiB per layer
  return l;
}

TEST_P(TransferConformance, MultiProcessReadEveryByte) {
  Child child;
  ForkPeer(&child, backend(), SmallLayout(), 41);
  a_ = MakeSide(ConfigFor("a", backend()), SmallLayout());
  ASSERT_EQ(*a_->agent->AddPeer(child.meta), backend());
  a_->Poison();
  auto pairs = ScatteredPairs(30, 64, 5);
  TransferSpec spec{TransferOp::kRead, "child", pairs};
  auto p = a_->agent->Prepare(spec);
  auto h = a_->agent->Post(*p);
  ASSERT_TRUE(h->Wait(10000));
  ASSERT_EQ(h->state(), TransferState::kDone) << h->status().ToString();
  std::vector<uint8_t> want(1024);
  for (int l = 0; l < 2; ++l) {
    for (auto bp : pairs) {
      FillPattern(want.data(), 1024, 41, l, bp.remote);
      ASSERT_EQ(0, std::memcmp(a_->Block(l, bp.local), want.data(), 1024));
    }
  }
}

TEST_P(TransferConformance, MultiProcessPeerKilledMidTransfer) {
  Child child;
  ForkPeer(&child, backend(), BigLayout(), 43);
  a_ = MakeSide(ConfigFor("a", backend()), BigLayout());
  ASSERT_EQ(*a_->agent->AddPeer(child.meta), backend());
  std::vector<BlockPair> pairs;
  for (int i = 0; i < 1024; ++i) pairs.push_back({i, 1023 - i});
  auto p = a_->agent->Prepare({TransferOp::kRead, "child", pairs});
  ASSERT_TRUE(p.ok());
  std::vector<TransferHandle> hs;
  for (int i = 0; i < 8; ++i) hs.push_back(*a_->agent->Post(*p));  // 1 GiB in flight
  std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ::kill(child.pid, SIGKILL);
  auto t_kill = std::chrono::steady_clock::now();
  // Bound: process death closes the connection at once; stated bound is peer_timeout_ms (2 s).
  int done = 0, unavailable = 0;
  std::vector<uint8_t> want(BigLayout().BlockBytes());
  for (auto& h : hs) {
    ASSERT_TRUE(h.Wait(2500)) << "transfer still pending after the peer died";
    if (h.state() == TransferState::kDone) {
      ++done;
    } else {
      EXPECT_EQ(h.status().code(), StatusCode::kUnavailable) << h.status().ToString();
      ++unavailable;
    }
  }
  EXPECT_LT(std::chrono::steady_clock::now() - t_kill, std::chrono::milliseconds(2500));
  if (unavailable == 0) {
    // Every transfer completed (shm: the mapping outlives the process): data must be right.
    for (int l = 0; l < 2; ++l) {
      for (int b = 0; b < 1024; b += 97) {
        FillPattern(want.data(), want.size(), 43, l, 1023 - b);
        ASSERT_EQ(0, std::memcmp(a_->Block(l, b), want.data(), want.size()));
      }
    }
  }
  if (backend() == "tcp") {
    EXPECT_GT(unavailable, 0);
  }
  // Once known dead, later operations fail at once.
  auto t0 = std::chrono::steady_clock::now();
  Result<TransferHandle> h = UnavailableError("not posted");
  while (std::chrono::steady_clock::now() - t0 < std::chrono::seconds(2)) {
    h = a_->agent->Post(*p);
    if (!h.ok()) break;
    h->Wait(2500);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  ASSERT_FALSE(h.ok());
  EXPECT_EQ(h.status().code(), StatusCode::kUnavailable);
}

bool Sh(const std::string& cmd) { return std::system((cmd + " >/dev/null 2>&1").c_str()) == 0; }

TEST_P(TransferConformance, MultiProcessAcrossNetworkNamespaces) {
  if (backend() == "shm") GTEST_SKIP() << "shm is same-host, same-namespace only";
  const std::string a = "kvbt-a-" + std::to_string(::getpid()),
                    b = "kvbt-b-" + std::to_string(::getpid());
  if (!Sh("ip netns add " + a))
    GTEST_SKIP() << "ip netns does not work here (need root and iproute2)";
  Sh("ip netns add " + b);
  struct Cleanup {
    std::string a, b;
    ~Cleanup() {
      Sh("ip netns del " + a);
      Sh("ip netns del " + b);
    }
  } cleanup{a, b};
  // A veth pair between the two namespaces, on a link-local /30 that exists only there.
  bool ok = Sh("ip link add va" + std::to_string(::getpid() % 100000) + " netns " + a +
               " type veth peer name vb" + std::to_string(::getpid() % 100000) + " netns " + b);
  const std::string va = "va" + std::to_string(::getpid() % 100000),
                    vb = "vb" + std::to_string(::getpid() % 100000);
  ok = ok && Sh("ip -n " + a + " addr add 169.254.77.1/30 dev " + va) &&
       Sh("ip -n " + b + " addr add 169.254.77.2/30 dev " + vb) &&
       Sh("ip -n " + a + " link set " + va + " up") &&
       Sh("ip -n " + b + " link set " + vb + " up") && Sh("ip -n " + a + " link set lo up") &&
       Sh("ip -n " + b + " link set lo up");
  if (!ok) GTEST_SKIP() << "could not create a veth pair between network namespaces";
  // The link turns RUNNING a moment after "up"; UCX's tcp transport offers only running
  // interfaces (seen here: a worker created at once advertised lo only -> "Destination is
  // unreachable"). Wait for both ends (bounded).
  bool running = false;
  for (int i = 0; i < 100 && !running; ++i) {
    running = Sh("ip -n " + a + " link show dev " + va + " | grep -q 'state UP'") &&
              Sh("ip -n " + b + " link show dev " + vb + " | grep -q 'state UP'");
    if (!running) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  ASSERT_TRUE(running) << "the veth pair did not come up within 5 s";
  // Both sides hold the cluster token: the handshake is proven both ways across the link.
  const std::string token = "netns-token";
  Child child;
  ForkPeer(&child, backend(), SmallLayout(), 47, b, "169.254.77.2", token);
  ASSERT_GT(child.pid, 0);
  // The initiator runs in its own forked process inside namespace a; exit code = result.
  pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::alarm(60);  // bounded: a hang ends in SIGALRM, reported below
    if (!EnterNetns(a)) ::_exit(10);
    AgentConfig cfg = ConfigFor("a", backend());
    cfg.bind_host = "169.254.77.1";
    cfg.cluster_token = token;
    auto side = MakeSide(cfg, SmallLayout());
    side->Poison();
    auto added = side->agent->AddPeer(child.meta);
    if (!added.ok()) {
      std::fprintf(stderr, "AddPeer: %s\n", added.status().ToString().c_str());
      ::_exit(11);
    }
    // READ 16 scattered blocks, every byte against the child's pattern.
    auto pairs = ScatteredPairs(16, 64, 6);
    auto p = side->agent->Prepare({TransferOp::kRead, "child", pairs});
    auto h = side->agent->Post(*p);
    if (!h.ok() || !h->Wait(10000) || h->state() != TransferState::kDone) ::_exit(12);
    std::vector<uint8_t> want(1024);
    for (int l = 0; l < 2; ++l) {
      for (auto bp : pairs) {
        FillPattern(want.data(), 1024, 47, l, bp.remote);
        if (std::memcmp(side->Block(l, bp.local), want.data(), 1024) != 0) ::_exit(13);
      }
    }
    // WRITE local blocks 40..47 (a fresh pattern) into the child's 0..7, READ them back into
    // poisoned local blocks 50..57: every byte must be what was written.
    for (int l = 0; l < 2; ++l) {
      for (int k = 0; k < 8; ++k) FillPattern(side->Block(l, 40 + k), 1024, 99, l, k);
      for (int k = 0; k < 8; ++k) std::memset(side->Block(l, 50 + k), kPoison, 1024);
    }
    std::vector<BlockPair> wpairs, rpairs;
    for (int k = 0; k < 8; ++k) {
      wpairs.push_back({40 + k, 7 - k});
      rpairs.push_back({50 + k, 7 - k});
    }
    auto pw = side->agent->Prepare({TransferOp::kWrite, "child", wpairs});
    auto hw = side->agent->Post(*pw);
    if (!hw.ok() || !hw->Wait(10000) || hw->state() != TransferState::kDone) ::_exit(14);
    auto pr = side->agent->Prepare({TransferOp::kRead, "child", rpairs});
    auto hr = side->agent->Post(*pr);
    if (!hr.ok() || !hr->Wait(10000) || hr->state() != TransferState::kDone) ::_exit(15);
    for (int l = 0; l < 2; ++l) {
      for (int k = 0; k < 8; ++k) {
        if (std::memcmp(side->Block(l, 50 + k), side->Block(l, 40 + k), 1024) != 0) ::_exit(16);
      }
    }
    ::_exit(0);
  }
  int st = 0;
  ::waitpid(pid, &st, 0);
  ASSERT_TRUE(WIFEXITED(st)) << "initiator killed by signal " << WTERMSIG(st)
                             << " (SIGALRM = it hung past 60 s)";
  EXPECT_EQ(WEXITSTATUS(st), 0)
      << "10 entering the namespace, 11 AddPeer, 12 READ, 13 READ data, 14 WRITE, 15 READ back, "
         "16 written data";
}
#endif  // KVB_TRANSFER_MULTIPROCESS

INSTANTIATE_TEST_SUITE_P(Backends, TransferConformance, ::testing::ValuesIn(AvailableBackends()),
                         [](const auto& info) { return info.param; });

}  // namespace
}  // namespace kvbridge::transfer
