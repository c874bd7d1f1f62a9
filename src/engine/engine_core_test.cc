// Engine tests on the tiny model, driven step by step through EngineCore (no thread, no clock).
#include "kvbridge/engine/engine_core.h"

#include <gtest/gtest.h>

#include <cmath>
#include <set>

#include "engine/engine_test_util.h"
#include "kvbridge/model/random_model.h"

namespace kvbridge {
namespace {

using testing_engine::BitwiseEqual;
using testing_engine::Collected;
using testing_engine::LogitsLog;
using testing_engine::MakeCore;
using testing_engine::Prompt;
using testing_engine::Req;
using testing_engine::RunAll;
using testing_engine::SmallConfig;

TEST(EngineCore, GreedyDecodeProducesMaxTokensAndFreesEverything) {
  auto core = MakeCore(SmallConfig());
  TimePoint now = 0;
  EngineRequest r = Req("a", Prompt(20), 6);
  r.sampling.logprobs = 2;
  ASSERT_TRUE(core->AddRequest(r, now).ok());
  auto out = RunAll(*core, &now);
  const Collected& c = out["a"];
  EXPECT_TRUE(c.finished);
  EXPECT_TRUE(c.error.ok());
  ASSERT_EQ(c.tokens.at(0).size(), 6u);
  EXPECT_EQ(c.reasons.at(0), "length");
  ASSERT_EQ(c.logprobs.at(0).size(), 6u);
  for (size_t i = 0; i < 6; ++i) {
    EXPECT_EQ(c.logprobs.at(0)[i].token, c.tokens.at(0)[i]);
    ASSERT_EQ(c.logprobs.at(0)[i].top.size(), 2u);
    // Greedy: the sampled token is the most likely one.
    EXPECT_EQ(c.logprobs.at(0)[i].top[0].token, c.tokens.at(0)[i]);
    EXPECT_LE(c.logprobs.at(0)[i].logprob, 0.0f);
  }
  EXPECT_EQ(c.outputs_after_finish, 0);
  EXPECT_EQ(core->pool().NumActive(), 0);
  EXPECT_TRUE(core->pool().CheckInvariants().ok());
}

TEST(EngineCore, RejectsBadRequests) {
  auto core = MakeCore(SmallConfig());
  EXPECT_EQ(core->AddRequest(Req("a", {}), 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(core->AddRequest(Req("a", {1, 99999}), 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(core->AddRequest(Req("a", Prompt(1024)), 0).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(core->AddRequest(Req("a", Prompt(4), 4, 65), 0).code(), StatusCode::kInvalidArgument);
  ASSERT_TRUE(core->AddRequest(Req("a", Prompt(4)), 0).ok());
  EXPECT_EQ(core->AddRequest(Req("a", Prompt(4)), 0).code(), StatusCode::kAlreadyExists);
  // A request that cannot fit in the pool even alone.
  auto small = MakeCore(SmallConfig(2));
  EXPECT_EQ(small->AddRequest(Req("b", Prompt(30), 8), 0).code(), StatusCode::kInvalidArgument);
}

TEST(EngineCore, ChunkedPrefillEqualsUnchunkedBitwise) {
  const auto prompt = Prompt(75, 3);
  auto run = [&](int budget) {
    EngineConfig c = SmallConfig();
    c.max_num_batched_tokens = budget;
    auto core = MakeCore(c);
    LogitsLog log;
    log.Attach(*core);
    TimePoint now = 0;
    EngineRequest r = Req("x", prompt, 5);
    r.sampling.logprobs = 3;
    EXPECT_TRUE(core->AddRequest(r, now).ok());
    auto out = RunAll(*core, &now);
    return std::make_pair(log.rows, out["x"].tokens.at(0));
  };
  auto [whole, t_whole] = run(2048);
  auto [chunked, t_chunked] = run(7);  // 75 tokens in 11 chunks, not block aligned
  ASSERT_EQ(whole.size(), 5u);
  ASSERT_EQ(chunked.size(), 5u);
  for (auto& [key, row] : whole) {
    ASSERT_TRUE(chunked.count(key)) << key.second;
    EXPECT_TRUE(BitwiseEqual(row, chunked[key])) << "position " << key.second;
  }
  EXPECT_EQ(t_whole, t_chunked);
}

TEST(EngineCore, Bf16AndFp8KvCachesChunkBitwiseToo) {
  for (KvDtype dtype : {KvDtype::kBf16, KvDtype::kFp8E4M3}) {
    SCOPED_TRACE(std::string(KvDtypeName(dtype)));
    auto run = [&](int budget) {
      EngineConfig c = SmallConfig();
      c.kv_dtype = dtype;
      c.max_num_batched_tokens = budget;
      auto core = MakeCore(c);
      EXPECT_EQ(core->storage().layout().dtype, dtype);
      LogitsLog log;
      log.Attach(*core);
      TimePoint now = 0;
      EXPECT_TRUE(core->AddRequest(Req("x", Prompt(37, 2), 4), now).ok());
      RunAll(*core, &now);
      EXPECT_EQ(core->pool().NumActive(), 0);
      return log.rows;
    };
    auto whole = run(2048);
    auto chunked = run(5);
    ASSERT_EQ(whole.size(), 4u);
    for (auto& [key, row] : whole) {
      for (float v : row) ASSERT_FALSE(std::isnan(v));
      EXPECT_TRUE(BitwiseEqual(row, chunked.at(key))) << key.second;
    }
  }
}

TEST(EngineCore, PrefixCacheHitServesBlocksAndKeepsLogitsBitwise) {
  MetricsRegistry metrics;
  auto core = MakeCore(SmallConfig(), &metrics);
  LogitsLog log;
  log.Attach(*core);
  TimePoint now = 0;
  auto a = Prompt(40, 1);
  ASSERT_TRUE(core->AddRequest(Req("a", a, 2), now).ok());
  RunAll(*core, &now);
  EXPECT_EQ(core->pool().NumActive(), 0);
  // a's 40 prompt tokens + 1 computed output token: 2 full blocks cached.
  EXPECT_EQ(core->pool().NumCachedFree(), 2);
  auto b = a;
  b.resize(36);  // shares 2 full blocks (32 tokens) with a
  b.push_back(7);
  ASSERT_TRUE(core->AddRequest(Req("b", b, 3), now).ok());
  auto out = RunAll(*core, &now);
  EXPECT_EQ(out["b"].num_cached_tokens, 32);
  std::string text = metrics.Render();
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_prefix_cache_queries_total"), 40.0 + 37.0);
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_prefix_cache_hits_total"), 32.0);
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_prompt_tokens_total"), 77.0);
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_generation_tokens_total"), 5.0);
  EXPECT_EQ(ScrapeMetric(text, "kvbridge_requests_finished_total", "reason=\"length\""), 2.0);

  // Same request on an engine without prefix caching: bitwise equal logits.
  EngineConfig c = SmallConfig();
  c.enable_prefix_caching = false;
  auto cold = MakeCore(c);
  LogitsLog cold_log;
  cold_log.Attach(*cold);
  ASSERT_TRUE(cold->AddRequest(Req("b", b, 3), now).ok());
  auto cold_out = RunAll(*cold, &now);
  EXPECT_EQ(cold_out["b"].num_cached_tokens, 0);
  EXPECT_EQ(cold->pool().NumCachedFree(), 0);
  int compared = 0;
  for (auto& [key, row] : cold_log.rows) {
    ASSERT_TRUE(log.rows.count(key));
    EXPECT_TRUE(BitwiseEqual(row, log.rows[key]));
    ++compared;
  }
  EXPECT_EQ(compared, 3);
  EXPECT_EQ(out["b"].tokens, cold_out["b"].tokens);
}

TEST(EngineCore, PrefixCacheEvictsLeastRecentlyUsed) {
  // 6 blocks: a (33 tokens + 1) caches 2 full blocks; b needs 5 fresh blocks -> evicts one.
  auto core = MakeCore(SmallConfig(6));
  TimePoint now = 0;
  ASSERT_TRUE(core->AddRequest(Req("a", Prompt(33, 1), 1), now).ok());
  RunAll(*core, &now);
  EXPECT_EQ(core->pool().NumCachedFree(), 2);
  ASSERT_TRUE(core->AddRequest(Req("b", Prompt(70, 2), 8), now).ok());
  RunAll(*core, &now);
  EXPECT_GE(core->pool().num_evictions(), 1);
  EXPECT_EQ(core->pool().NumActive(), 0);
  EXPECT_TRUE(core->pool().CheckInvariants().ok());
}

TEST(EngineCore, PreemptionAndResumeEqualBitwise) {
  std::vector<EngineRequest> reqs;
  for (int i = 0; i < 4; ++i) {
    EngineRequest r = Req("r" + std::to_string(i), Prompt(30, i), 24);
    r.sampling.temperature = 0.9f;
    r.sampling.seed = 100 + i;
    reqs.push_back(r);
  }
  // Alone, with room to spare.
  std::map<std::string, std::vector<int32_t>> alone;
  LogitsLog alone_log;
  for (auto& r : reqs) {
    auto core = MakeCore(SmallConfig());
    alone_log.Attach(*core);
    TimePoint now = 0;
    ASSERT_TRUE(core->AddRequest(r, now).ok());
    alone[r.request_id] = RunAll(*core, &now)[r.request_id].tokens.at(0);
  }
  // Together, in 9 blocks: each needs 4 at the end (54 tokens), so some must be preempted.
  auto core = MakeCore(SmallConfig(9));
  LogitsLog log;
  log.Attach(*core);
  TimePoint now = 0;
  for (auto& r : reqs) ASSERT_TRUE(core->AddRequest(r, now).ok());
  auto out = RunAll(*core, &now);
  EXPECT_GT(core->scheduler().num_preemptions(), 0);
  for (auto& r : reqs)
    EXPECT_EQ(out[r.request_id].tokens.at(0), alone[r.request_id]) << r.request_id;
  int compared = 0;
  for (auto& [key, row] : log.rows) {
    ASSERT_TRUE(alone_log.rows.count(key));
    EXPECT_TRUE(BitwiseEqual(row, alone_log.rows[key])) << key.first << "@" << key.second;
    ++compared;
  }
  EXPECT_EQ(compared, 4 * 24);
  EXPECT_EQ(core->pool().NumActive(), 0);
}

TEST(EngineCore, SeededSamplingIsReproducibleAloneAndInABatch) {
  EngineRequest target = Req("t", Prompt(25, 9), 20);
  target.sampling.temperature = 1.0f;
  target.sampling.top_p = 0.9f;
  target.sampling.top_k = 50;
  target.sampling.seed = 1234;
  auto run = [&](int others, int budget) {
    EngineConfig c = SmallConfig();
    c.max_num_batched_tokens = budget;
    auto core = MakeCore(c);
    TimePoint now = 0;
    for (int i = 0; i < others; ++i) {
      EngineRequest o = Req("o" + std::to_string(i), Prompt(10 + 7 * i, 20 + i), 15);
      o.sampling.temperature = 0.7f;
      EXPECT_TRUE(core->AddRequest(o, now).ok());
    }
    EXPECT_TRUE(core->AddRequest(target, now).ok());
    return RunAll(*core, &now)["t"].tokens.at(0);
  };
  auto alone = run(0, 2048);
  EXPECT_EQ(alone.size(), 20u);
  EXPECT_EQ(run(0, 2048), alone);  // across runs
  EXPECT_EQ(run(5, 2048), alone);  // in a batch of others
  EXPECT_EQ(run(5, 13), alone);    // in a batch, chunked
  // A different seed gives a different sequence (20 draws from a near-uniform random model).
  target.sampling.seed = 4321;
  EXPECT_NE(run(0, 2048), alone);
}

TEST(EngineCore, ParallelSamplingSharesPromptBlocksExactly) {
  for (bool caching : {true, false}) {
    SCOPED_TRACE(caching ? "prefix caching on" : "prefix caching off");
    EngineConfig c = SmallConfig();
    c.enable_prefix_caching = caching;
    auto core = MakeCore(c);
    TimePoint now = 0;
    // 40 tokens = 2 full blocks + a partial block of 8.
    ASSERT_TRUE(core->AddRequest(Req("p", Prompt(40, 4), 6, 8), now).ok());
    ASSERT_TRUE(core->Step(now += 1000).ok());  // prefill, fork, first tokens
    EXPECT_EQ(core->scheduler().num_running(), 8);
    EXPECT_EQ(core->pool().NumActive(), 3);  // the 8 siblings share the prompt's 3 blocks
    std::set<int32_t> distinct;
    for (int i = 0; i < 8; ++i) {
      auto t = core->scheduler().GetBlockTable(std::to_string(i) + "_p");
      ASSERT_EQ(t.size(), 3u);
      distinct.insert(t.begin(), t.end());
    }
    EXPECT_EQ(distinct.size(), 3u);
    for (int32_t b : distinct) EXPECT_EQ(core->pool().RefCount(b), 8);
    ASSERT_TRUE(core->Step(now += 1000).ok());  // first decode writes slot 8 of the partial block
    // Copy on write: 7 siblings copied the partial block, the last wrote in place.
    EXPECT_EQ(core->pool().NumActive(), 3 + 7);
    auto t0 = core->scheduler().GetBlockTable("0_p");
    EXPECT_EQ(core->pool().RefCount(t0[0]), 8);
    EXPECT_EQ(core->pool().RefCount(t0[1]), 8);
    EXPECT_EQ(core->pool().RefCount(t0[2]), 1);
    auto out = RunAll(*core, &now);
    EXPECT_EQ(core->pool().NumActive(), 0);
    // Greedy: every sibling equals the n = 1 answer, so the copies carried the right KV.
    auto single = MakeCore(c);
    ASSERT_TRUE(single->AddRequest(Req("s", Prompt(40, 4), 6), now).ok());
    auto ref = RunAll(*single, &now)["s"].tokens.at(0);
    ASSERT_EQ(out["p"].tokens.size(), 8u);
    for (int i = 0; i < 8; ++i) {
      EXPECT_EQ(out["p"].tokens[i], ref) << "sibling " << i;
      EXPECT_EQ(out["p"].reasons[i], "length");
    }
  }
}

TEST(EngineCore, ParallelSamplingOnABlockBoundaryAllocatesFreshBlocks) {
  auto core = MakeCore(SmallConfig());
  TimePoint now = 0;
  ASSERT_TRUE(core->AddRequest(Req("p", Prompt(32, 4), 4, 8), now).ok());
  ASSERT_TRUE(core->Step(now += 1000).ok());
  EXPECT_EQ(core->pool().NumActive(), 2);
  ASSERT_TRUE(core->Step(now += 1000).ok());
  EXPECT_EQ(core->pool().NumActive(), 2 + 8);  // no copy: each sibling starts its own block
  RunAll(*core, &now);
  EXPECT_EQ(core->pool().NumActive(), 0);
}

TEST(EngineCore, SeededSiblingZeroEqualsSingleRequest) {
  EngineRequest r = Req("p", Prompt(21, 2), 10, 4);
  r.sampling.temperature = 1.0f;
  r.sampling.seed = 77;
  auto core = MakeCore(SmallConfig());
  TimePoint now = 0;
  ASSERT_TRUE(core->AddRequest(r, now).ok());
  auto out = RunAll(*core, &now)["p"];
  r.sampling.n = 1;
  auto single = MakeCore(SmallConfig());
  ASSERT_TRUE(single->AddRequest(r, now).ok());
  auto one = RunAll(*single, &now)["p"];
  EXPECT_EQ(out.tokens[0], one.tokens[0]);
  EXPECT_NE(out.tokens[1], out.tokens[0]);  // siblings draw independently
}

TEST(EngineCore, AbortInEveryStateLeavesNoActiveBlocks) {
  // WAITING (never scheduled).
  {
    auto core = MakeCore(SmallConfig());
    ASSERT_TRUE(core->AddRequest(Req("w", Prompt(20)), 0).ok());
    EXPECT_EQ(core->scheduler().GetState("w"), RequestState::kWaiting);
    EXPECT_TRUE(core->Abort("w", 1));
    auto outs = core->TakeOutputs();
    ASSERT_EQ(outs.size(), 1u);
    EXPECT_TRUE(outs[0].finished);
    EXPECT_EQ(outs[0].outputs.at(0).finish_reason, "abort");
    EXPECT_EQ(core->pool().NumActive(), 0);
    EXPECT_FALSE(core->Abort("w", 2));  // unknown now: no-op
  }
  // RUNNING mid-prefill (chunked), RUNNING decode, forked siblings, PREEMPTED.
  {
    EngineConfig c = SmallConfig(9);
    c.max_num_batched_tokens = 10;
    auto core = MakeCore(c);
    TimePoint now = 0;
    ASSERT_TRUE(core->AddRequest(Req("pre", Prompt(50, 1), 40), now).ok());
    ASSERT_TRUE(core->Step(now += 1000).ok());
    EXPECT_EQ(core->scheduler().GetState("pre"), RequestState::kRunning);
    EXPECT_EQ(core->scheduler().GetNumComputed("pre"), 10);
    EXPECT_GT(core->pool().NumActive(), 0);
    ASSERT_TRUE(core->Abort("pre", now));
    EXPECT_EQ(core->pool().NumActive(), 0);

    ASSERT_TRUE(core->AddRequest(Req("dec", Prompt(5, 2), 40), now).ok());
    ASSERT_TRUE(core->AddRequest(Req("fan", Prompt(5, 3), 40, 3), now).ok());
    for (int i = 0; i < 4; ++i) ASSERT_TRUE(core->Step(now += 1000).ok());
    EXPECT_EQ(core->scheduler().GetState("dec"), RequestState::kRunning);
    EXPECT_EQ(core->scheduler().GetState("2_fan"), RequestState::kRunning);
    ASSERT_TRUE(core->Abort("fan", now));
    auto outs = core->TakeOutputs();
    const RequestOutput* fin = nullptr;
    for (auto& o : outs) {
      if (o.request_id == "fan" && o.finished) fin = &o;
    }
    ASSERT_NE(fin, nullptr);
    ASSERT_EQ(fin->outputs.size(), 3u);
    ASSERT_TRUE(core->Abort("dec", now));
    EXPECT_EQ(core->pool().NumActive(), 0);

    // Preempted: three long requests in 9 blocks.
    for (int i = 0; i < 3; ++i) {
      ASSERT_TRUE(core->AddRequest(Req("q" + std::to_string(i), Prompt(40, i), 40), now).ok());
    }
    bool saw_preempted = false;
    for (int i = 0; i < 200 && !saw_preempted; ++i) {
      ASSERT_TRUE(core->Step(now += 1000).ok());
      for (int k = 0; k < 3; ++k) {
        saw_preempted |=
            core->scheduler().GetState("q" + std::to_string(k)) == RequestState::kPreempted;
      }
    }
    ASSERT_TRUE(saw_preempted);
    for (int k = 0; k < 3; ++k) core->Abort("q" + std::to_string(k), now);
    EXPECT_EQ(core->pool().NumActive(), 0);
    EXPECT_FALSE(core->scheduler().HasUnfinished());
    EXPECT_TRUE(core->pool().CheckInvariants().ok());
  }
}

TEST(EngineCore, StopConditions) {
  auto core = MakeCore(SmallConfig());
  TimePoint now = 0;
  // Learn the greedy continuation, then stop on pieces of it.
  ASSERT_TRUE(core->AddRequest(Req("g", Prompt(12, 5), 12), now).ok());
  auto g = RunAll(*core, &now)["g"].tokens.at(0);
  ASSERT_EQ(g.size(), 12u);

  // A stop token: its id is returned (vLLM keeps it in token_ids), its text is not, and it is
  // the stop_reason.
  EngineRequest st = Req("stop_id", Prompt(12, 5), 12);
  st.sampling.stop_token_ids = {g[3]};
  ASSERT_TRUE(core->AddRequest(st, now).ok());
  auto o = RunAll(*core, &now)["stop_id"];
  auto first = std::find(g.begin(), g.end(), g[3]) - g.begin();
  EXPECT_EQ(o.tokens.at(0), std::vector<int32_t>(g.begin(), g.begin() + first + 1));
  EXPECT_EQ(o.reasons.at(0), "stop");
  EXPECT_EQ(o.final_output.at(0).stop_reason, nlohmann::json(g[3]));
  EXPECT_EQ(o.final_output.at(0).text_tokens, first);
  EXPECT_EQ(o.final_output.at(0).text_len, -1);
  // include_stop_str_in_output keeps the stop token's text too.
  st.request_id = "stop_id_kept";
  st.sampling.include_stop_str_in_output = true;
  ASSERT_TRUE(core->AddRequest(st, now).ok());
  o = RunAll(*core, &now)["stop_id_kept"];
  EXPECT_EQ(o.tokens.at(0).size(), static_cast<size_t>(first + 1));
  EXPECT_EQ(o.final_output.at(0).text_tokens, -1);

  // min_tokens masks the stop token until it is reached.
  EngineRequest mt = st;
  mt.request_id = "min";
  mt.sampling.min_tokens = 12;
  ASSERT_TRUE(core->AddRequest(mt, now).ok());
  o = RunAll(*core, &now)["min"];
  EXPECT_EQ(o.tokens.at(0).size(), 12u);
  EXPECT_EQ(o.reasons.at(0), "length");
  EXPECT_TRUE(o.final_output.at(0).stop_reason.is_null());
  for (int32_t t : o.tokens.at(0)) EXPECT_NE(t, g[3]);

  // Stop strings made of two consecutive byte tokens of the continuation (byte tokenizer:
  // token id = byte), starting after the first token so some output precedes it, the second
  // byte not seen before (so a one-byte stop string of it matches at the same token).
  std::string text;
  for (int32_t t : g) {
    if (t < 256) text.push_back(static_cast<char>(t));
  }
  size_t k = 1;
  auto fits = [&](size_t i) {
    if (!(g[i] < 256 && g[i + 1] < 256)) return false;
    for (size_t j = 0; j <= i; ++j) {
      if (g[j] == g[i + 1]) return false;
    }
    return true;
  };
  while (k + 1 < g.size() && !fits(k)) ++k;
  ASSERT_LT(k + 1, g.size()) << "no fitting byte pair in the greedy continuation";
  const std::string s = {static_cast<char>(g[k]), static_cast<char>(g[k + 1])};
  const std::string c = {static_cast<char>(g[k + 1])};
  // The text before token k + 1 (tokens >= 256 have no text here).
  size_t pos = 0;
  for (size_t j = 0; j < k; ++j) pos += g[j] < 256 ? 1 : 0;
  ASSERT_EQ(text.find(s), pos);
  struct Case {
    std::vector<std::string> stop;
    bool include;
    std::string reason;
    int64_t text_len;
  };
  const Case cases[] = {
      {{s}, false, s, static_cast<int64_t>(pos)},
      {{s}, true, s, static_cast<int64_t>(pos + 2)},
      // vLLM takes the first string of the list that matches, not the earliest match.
      {{s, c}, false, s, static_cast<int64_t>(pos)},
      {{c, s}, false, c, static_cast<int64_t>(pos + 1)},
      {{"\x01never", c, s}, true, c, static_cast<int64_t>(pos + 2)},
  };
  int n = 0;
  for (const Case& cs : cases) {
    SCOPED_TRACE(n);
    const std::string id = "stop_str" + std::to_string(n++);
    EngineRequest ss = Req(id, Prompt(12, 5), 12);
    ss.sampling.stop = cs.stop;
    ss.sampling.include_stop_str_in_output = cs.include;
    ASSERT_TRUE(core->AddRequest(ss, now).ok());
    o = RunAll(*core, &now)[id];
    // Every token up to the one that completes the string is returned; the text is cut.
    EXPECT_EQ(o.tokens.at(0), std::vector<int32_t>(g.begin(), g.begin() + k + 2));
    EXPECT_EQ(o.reasons.at(0), "stop");
    EXPECT_EQ(o.final_output.at(0).stop_reason, nlohmann::json(cs.reason));
    EXPECT_EQ(o.final_output.at(0).text_len, cs.text_len);
    EXPECT_EQ(o.final_output.at(0).text_tokens, -1);
  }
  // min_tokens past the match: the string is not searched in text made before min_tokens.
  EngineRequest late = Req("late", Prompt(12, 5), 12);
  late.sampling.stop = {s};
  late.sampling.min_tokens = static_cast<int>(k + 2);
  ASSERT_TRUE(core->AddRequest(late, now).ok());
  o = RunAll(*core, &now)["late"];
  const bool again = text.find(s, pos + 1) != std::string::npos;
  if (!again) {
    EXPECT_EQ(o.tokens.at(0), g);
    EXPECT_EQ(o.reasons.at(0), "length");
  }
  EXPECT_EQ(core->pool().NumActive(), 0);
}

TEST(EngineCore, MaxNumSeqsBoundsTheBatch) {
  EngineConfig c = SmallConfig();
  c.max_num_seqs = 3;
  auto core = MakeCore(c);
  TimePoint now = 0;
  for (int i = 0; i < 5; ++i)
    ASSERT_TRUE(core->AddRequest(Req("m" + std::to_string(i), Prompt(8, i), 5), now).ok());
  ASSERT_TRUE(core->Step(now += 1000).ok());
  EXPECT_EQ(core->scheduler().num_running(), 3);
  EXPECT_EQ(core->scheduler().num_waiting(), 2);
  auto out = RunAll(*core, &now);
  EXPECT_EQ(out.size(), 5u);
  for (auto& [id, col] : out) EXPECT_EQ(col.tokens.at(0).size(), 5u);
}

}  // namespace
}  // namespace kvbridge

namespace kvbridge {
namespace {

// --device cuda on the engine: the refusals that need no GPU (a GPU engine's behaviour is
// tested on the device machine: tests/gpu/cuda_model_test.cc, scripts/gpu_serve_check.py).
// A weightless preset model (no host weights) runs on the GPU only: the CPU engine refuses it.
TEST(EngineCore, CpuEngineRefusesAWeightlessModel) {
  using testing_engine::SmallConfig;
  auto spec = RandomModelPreset("tiny", 0);
  ASSERT_TRUE(spec.ok());
  auto model = Model::CreateWeightless(*spec);
  ASSERT_TRUE(model.ok()) << model.status().ToString();
  auto core = EngineCore::Create(SmallConfig(), *model, nullptr, {});
  ASSERT_FALSE(core.ok());
  EXPECT_EQ(core.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(core.status().message().find("weightless"), std::string::npos)
      << core.status().ToString();
}

TEST(EngineCore, GpuEngineRefusesTensorParallelAndSaysWhyWithoutAGpu) {
  using testing_engine::SmallConfig;
  using testing_engine::TinyModel;
  EngineConfig c = SmallConfig();
  c.cuda_device = 0;
  c.tensor_parallel_size = 2;
  auto tp = EngineCore::Create(c, TinyModel(), nullptr, {});
  ASSERT_FALSE(tp.ok());
  EXPECT_EQ(tp.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(tp.status().message().find("tensor_parallel_size 1"), std::string::npos);
  c.tensor_parallel_size = 1;
  if (CudaDeviceAvailable(0).ok()) GTEST_SKIP() << "this machine has a GPU";
  auto none = EngineCore::Create(c, TinyModel(), nullptr, {});
  ASSERT_FALSE(none.ok());
  // Unavailable "no CUDA device: ..." with CUDA built in, Unimplemented without.
  EXPECT_TRUE(none.status().code() == StatusCode::kUnavailable ||
              none.status().code() == StatusCode::kUnimplemented)
      << none.status().ToString();
  EXPECT_TRUE(none.status().message().find("no CUDA device") != std::string::npos ||
              none.status().message().find("without CUDA") != std::string::npos)
      << none.status().ToString();
}

}  // namespace
}  // namespace kvbridge
