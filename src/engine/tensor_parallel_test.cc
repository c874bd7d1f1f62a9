// Tensor parallelism inside the engine: the same requests give the same greedy tokens, sampled
// tokens, top-5 logprobs and raw logits at T = 1, 2, 4 (bitwise), every rank's KV storage holds
// exactly its head slice of the T=1 pool, the connector hooks describe every rank, invalid T is
// refused, and a threaded Engine at T=2 drains to 0 active blocks.
#include "kvbridge/model/tensor_parallel.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <set>
#include <thread>

#include "engine/engine_test_util.h"
#include "kvbridge/engine/engine.h"
#include "kvbridge/model/model.h"

namespace kvbridge {
namespace {

using testing_engine::BitwiseEqual;
using testing_engine::Collected;
using testing_engine::InstallFake;
using testing_engine::LogitsLog;
using testing_engine::MakeCore;
using testing_engine::Prompt;
using testing_engine::Req;
using testing_engine::RunAll;
using testing_engine::SmallConfig;
using testing_engine::TinyModel;

struct RunResult {
  std::map<std::string, Collected> outputs;
  LogitsLog logits;
  std::unique_ptr<EngineCore> core;
};

// Two waves of requests (the second reuses the first's prompts: prefix-cache hits), with
// varied prompt lengths, n > 1 (copy-on-write of a shared partial block), top-5 logprobs,
// one seeded sampled request, and chunked prefill (max_num_batched_tokens 24).
RunResult RunWorkload(int tp, KvDtype dtype) {
  EngineConfig config = SmallConfig(96);
  config.tensor_parallel_size = tp;
  config.kv_dtype = dtype;
  config.max_num_batched_tokens = 24;
  RunResult res;
  res.core = MakeCore(config);
  if (res.core == nullptr) return res;
  res.logits.Attach(*res.core);
  TimePoint now = 0;
  const int lens[] = {3, 17, 40, 70};
  for (int wave = 0; wave < 2; ++wave) {
    for (int i = 0; i < 4; ++i) {
      EngineRequest r = Req("w" + std::to_string(wave) + "r" + std::to_string(i),
                            Prompt(lens[i] + wave, i), /*max_tokens=*/6, /*n=*/i % 2 ? 3 : 1);
      r.sampling.logprobs = 5;
      if (i == 3) {
        r.sampling.temperature = 0.8f;
        r.sampling.seed = 11;
      }
      EXPECT_TRUE(res.core->AddRequest(std::move(r), now).ok());
    }
    res.outputs = RunAll(*res.core, &now, std::move(res.outputs));
  }
  return res;
}

TEST(EngineTensorParallel, TokensLogprobsAndLogitsBitwiseEqualAtEveryT) {
  for (KvDtype dtype : {KvDtype::kFp32, KvDtype::kFp8E4M3}) {
    SCOPED_TRACE(std::string(KvDtypeName(dtype)));
    RunResult ref = RunWorkload(1, dtype);
    ASSERT_NE(ref.core, nullptr);
    ASSERT_EQ(ref.outputs.size(), 8u);
    ASSERT_GT(ref.logits.rows.size(), 40u);
    for (int tp : {2, 4}) {
      SCOPED_TRACE("T=" + std::to_string(tp));
      RunResult got = RunWorkload(tp, dtype);
      ASSERT_NE(got.core, nullptr);
      EXPECT_EQ(got.core->tp_size(), tp);
      ASSERT_EQ(got.outputs.size(), ref.outputs.size());
      for (const auto& [id, want] : ref.outputs) {
        const Collected& have = got.outputs.at(id);
        EXPECT_TRUE(have.finished && have.error.ok()) << id;
        EXPECT_EQ(have.tokens, want.tokens) << id;
        EXPECT_EQ(have.num_cached_tokens, want.num_cached_tokens) << id;
        ASSERT_EQ(have.logprobs.size(), want.logprobs.size()) << id;
        for (const auto& [index, lps] : want.logprobs) {
          const auto& hl = have.logprobs.at(index);
          ASSERT_EQ(hl.size(), lps.size()) << id;
          for (size_t t = 0; t < lps.size(); ++t) {
            ASSERT_EQ(hl[t].top.size(), 5u);
            EXPECT_EQ(0, std::memcmp(&hl[t].logprob, &lps[t].logprob, 4)) << id << " " << t;
            for (size_t k = 0; k < 5; ++k) {
              EXPECT_EQ(hl[t].top[k].token, lps[t].top[k].token);
              EXPECT_EQ(0, std::memcmp(&hl[t].top[k].logprob, &lps[t].top[k].logprob, 4));
            }
          }
        }
      }
      ASSERT_EQ(got.logits.rows.size(), ref.logits.rows.size());
      for (const auto& [key, row] : ref.logits.rows) {
        EXPECT_TRUE(BitwiseEqual(got.logits.rows.at(key), row)) << key.first << "@" << key.second;
      }
      // The wave-2 requests hit the prefix cache at every T.
      EXPECT_GT(got.outputs.at("w1r2").num_cached_tokens, 0);
      EXPECT_EQ(got.core->pool().NumActive(), 0);
      EXPECT_EQ(got.core->pool().NumHeld(), 0);
    }
  }
}

TEST(EngineTensorParallel, RankStorageHoldsItsHeadSliceOfTheOneRankPool) {
  RunResult ref = RunWorkload(1, KvDtype::kBf16);
  ASSERT_NE(ref.core, nullptr);
  const KvCacheStorage& full = ref.core->storage();
  const PagedKvLayout& fl = full.layout();
  for (int tp : {2, 4}) {
    RunResult got = RunWorkload(tp, KvDtype::kBf16);
    ASSERT_NE(got.core, nullptr);
    for (int r = 0; r < tp; ++r) {
      const KvCacheStorage& st = got.core->storage(r);
      const HeadRange heads = got.core->tp_model().kv_heads(r);
      ASSERT_EQ(st.layout().num_kv_heads, heads.size());
      ASSERT_EQ(st.layout().num_blocks, fl.num_blocks);
      const size_t bytes = static_cast<size_t>(heads.size()) * fl.block_size * fl.head_dim * 2;
      int mismatched = 0;
      for (int l = 0; l < fl.num_layers; ++l) {
        for (int b = 0; b < fl.num_blocks; ++b) {
          for (int kv = 0; kv < 2; ++kv) {
            mismatched +=
                std::memcmp(full.view().layer_base[l] + fl.Offset(b, kv, heads.begin, 0),
                            st.view().layer_base[l] + st.layout().Offset(b, kv, 0, 0), bytes) != 0;
          }
        }
      }
      EXPECT_EQ(mismatched, 0) << "T=" << tp << " rank " << r;
    }
  }
}

TEST(EngineTensorParallel, InvalidSizeRefusedAtStart) {
  EngineConfig config = SmallConfig(16);
  config.tensor_parallel_size = 3;
  auto r = EngineCore::Create(config, TinyModel(), nullptr, {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().message(),
            "engine: tensor_parallel_size 3 must divide 8 (the fixed K-shards of the "
            "row-parallel matmuls): use 1, 2, 4 or 8");
  config.tensor_parallel_size = 8;  // tiny has 4 attention heads
  EXPECT_EQ(EngineCore::Create(config, TinyModel(), nullptr, {}).status().message(),
            "engine: tensor_parallel_size 8 must divide the model's num_attention_heads (4)");
  config.tensor_parallel_size = 0;
  EXPECT_EQ(Engine::Create(config, TinyModel()).status().code(), StatusCode::kInvalidArgument);
}

TEST(EngineTensorParallel, HooksDescribeEveryRank) {
  for (int tp : {1, 2, 4}) {
    EngineConfig config = SmallConfig(32);
    config.tensor_parallel_size = tp;
    auto** fake = InstallFake(&config);
    auto core = MakeCore(config);
    ASSERT_NE(core, nullptr);
    const EngineHooks& h = (*fake)->hooks;
    EXPECT_EQ(h.tp_size, tp);
    ASSERT_EQ(static_cast<int>(h.ranks.size()), tp);
    EXPECT_EQ(h.ranks[0].kv_view.layer_base, h.kv_view.layer_base);
    EXPECT_EQ(h.ranks[0].kv_shm_fd, h.kv_shm_fd);
    EXPECT_EQ(h.ranks[0].kv_layer_offsets, h.kv_layer_offsets);
    std::set<int> fds;
    for (int r = 0; r < tp; ++r) {
      const KvRankHooks& rh = h.ranks[r];
      EXPECT_EQ(rh.rank, r);
      // tiny: 2 KV heads. T=2: one each; T=4: replicated, ranks 0,1 -> head 0, 2,3 -> head 1.
      const int want_begin = tp == 1 ? 0 : (tp == 2 ? r : r / 2);
      const int want_end = tp == 1 ? 2 : want_begin + 1;
      EXPECT_EQ(rh.kv_head_begin, want_begin) << tp << " " << r;
      EXPECT_EQ(rh.kv_head_end, want_end) << tp << " " << r;
      EXPECT_EQ(rh.kv_view.layout.num_kv_heads, want_end - want_begin);
      EXPECT_EQ(rh.kv_view.layout.num_blocks, 32);
      EXPECT_EQ(rh.kv_view.layer_base, core->storage(r).view().layer_base);
      EXPECT_EQ(rh.kv_shm_fd, core->storage(r).shm_fd());
      if (rh.kv_shm_fd >= 0) {
        EXPECT_EQ(rh.kv_layer_offsets, core->storage(r).layer_offsets());
        fds.insert(rh.kv_shm_fd);
      }
    }
    if (!fds.empty()) {
      EXPECT_EQ(static_cast<int>(fds.size()), tp);  // one memfd per rank
    }
  }
}

TEST(EngineTensorParallel, RankWeightBytesGauge) {
  MetricsRegistry metrics;
  EngineConfig config = SmallConfig(16);
  config.tensor_parallel_size = 2;
  auto core = MakeCore(config, &metrics);
  ASSERT_NE(core, nullptr);
  // tiny llama per layer: q 64x64, k/v 32x64, o 64x64, gate/up/down 128x64; 2 layers; halved;
  // resident as stored: bf16, 2 bytes each.
  const double per_rank = (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64) * 2.0;
  const std::string text = metrics.Render();
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_tp_rank_weight_bytes", "rank=\"0\""), per_rank);
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_tp_rank_weight_bytes", "rank=\"1\""), per_rank);
}

TEST(EngineTensorParallel, ThreadedEngineDrainsToZeroActiveBlocks) {
  EngineConfig config = SmallConfig(64);
  config.tensor_parallel_size = 2;
  auto engine = Engine::Create(config, TinyModel());
  ASSERT_TRUE(engine.ok()) << engine.status().ToString();
  std::mutex mu;
  std::condition_variable cv;
  int finished = 0;
  std::map<std::string, std::vector<int32_t>> tokens;
  for (int i = 0; i < 6; ++i) {
    const std::string id = "r" + std::to_string(i);
    ASSERT_TRUE((*engine)
                    ->AddRequest(Req(id, Prompt(5 + 9 * i, i), 5, i % 3 == 0 ? 2 : 1),
                                 [&, id](const RequestOutput& o) {
                                   std::lock_guard<std::mutex> lock(mu);
                                   for (const auto& c : o.outputs) {
                                     auto& t = tokens[id + "/" + std::to_string(c.index)];
                                     t.insert(t.end(), c.new_token_ids.begin(),
                                              c.new_token_ids.end());
                                   }
                                   if (o.finished) {
                                     EXPECT_TRUE(o.error.ok()) << o.error.ToString();
                                     ++finished;
                                     cv.notify_all();
                                   }
                                 })
                    .ok());
  }
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, std::chrono::seconds(60), [&] { return finished == 6; }));
  }
  // Same greedy tokens as a one-rank EngineCore.
  auto core = MakeCore(SmallConfig(64));
  TimePoint now = 0;
  for (int i = 0; i < 6; ++i) {
    ASSERT_TRUE(
        core->AddRequest(Req("r" + std::to_string(i), Prompt(5 + 9 * i, i), 5, i % 3 == 0 ? 2 : 1),
                         now)
            .ok());
  }
  auto want = RunAll(*core, &now);
  {
    std::lock_guard<std::mutex> lock(mu);
    for (const auto& [id, c] : want) {
      for (const auto& [index, t] : c.tokens) {
        EXPECT_EQ(tokens[id + "/" + std::to_string(index)], t) << id << "/" << index;
      }
    }
  }
  // Stats are read on the engine thread's side; allow it to settle (bounded).
  int64_t active = -1;
  for (int i = 0; i < 200 && active != 0; ++i) {
    active = (*engine)->Stats().kv_blocks_active;
    if (active != 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  EXPECT_EQ(active, 0);
  EXPECT_EQ((*engine)->Stats().kv_blocks_held_for_transfer, 0);
  (*engine)->Shutdown();
}

}  // namespace
}  // namespace kvbridge
