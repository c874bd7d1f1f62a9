// Tensor parallelism: logits bitwise equal to the single-rank forward at every valid T, each
// rank's KV equal to its head slice of the single-rank cache, and invalid T refused.
#include "kvbridge/model/tensor_parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"
#include "model/test_util.h"

namespace kvbridge {
namespace {

using testing_model::TempDir;

constexpr KvDtype kAllDtypes[] = {KvDtype::kFp32, KvDtype::kBf16, KvDtype::kFp8E4M3};

ModelConfig TinyConfig() {
  auto spec = RandomModelPreset("tiny", ModelArch::kLlama, 1);
  EXPECT_TRUE(spec.ok());
  return spec->config;
}

TEST(TensorParallelSize, ValidSizesAccepted) {
  ModelConfig c = TinyConfig();  // 4 heads, 2 KV heads
  for (int t : {1, 2, 4}) EXPECT_TRUE(ValidateTensorParallelSize(c, t).ok()) << t;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 8;
  c.head_dim = 8;
  for (int t : {1, 2, 4, 8}) EXPECT_TRUE(ValidateTensorParallelSize(c, t).ok()) << t;
}

TEST(TensorParallelSize, InvalidSizesRefusedWithTheRule) {
  ModelConfig c = TinyConfig();
  EXPECT_EQ(ValidateTensorParallelSize(c, 0).message(), "tensor_parallel_size must be >= 1, got 0");
  EXPECT_EQ(ValidateTensorParallelSize(c, 3).message(),
            "tensor_parallel_size 3 must divide 8 (the fixed K-shards of the row-parallel "
            "matmuls): use 1, 2, 4 or 8");
  EXPECT_EQ(ValidateTensorParallelSize(c, 16).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateTensorParallelSize(c, 8).message(),
            "tensor_parallel_size 8 must divide the model's num_attention_heads (4)");
  c.num_attention_heads = 24;
  c.num_key_value_heads = 6;
  c.head_dim = 8;
  EXPECT_EQ(ValidateTensorParallelSize(c, 4).message(),
            "tensor_parallel_size 4: the model's num_key_value_heads (6) must be a multiple of "
            "it, or it a multiple of num_key_value_heads (KV heads replicated)");
  EXPECT_TRUE(ValidateTensorParallelSize(c, 2).ok());
}

TEST(TensorParallelSize, KvHeadRanges) {
  struct Case {
    int kv, t, r, begin, end;
  };
  for (const Case& k : std::vector<Case>{{2, 1, 0, 0, 2},
                                         {2, 2, 0, 0, 1},
                                         {2, 2, 1, 1, 2},
                                         {8, 4, 3, 6, 8},
                                         {2, 4, 0, 0, 1},  // replicated: ranks 0,1 hold head 0
                                         {2, 4, 1, 0, 1},
                                         {2, 4, 2, 1, 2},
                                         {2, 4, 3, 1, 2},
                                         {1, 8, 7, 0, 1},
                                         {4, 8, 5, 2, 3}}) {
    HeadRange h = TpKvHeads(k.kv, k.t, k.r);
    EXPECT_EQ(h.begin, k.begin) << k.kv << " " << k.t << " " << k.r;
    EXPECT_EQ(h.end, k.end) << k.kv << " " << k.t << " " << k.r;
  }
  EXPECT_EQ(TpQueryHeads(8, 4, 3).begin, 6);
  EXPECT_EQ(TpQueryHeads(8, 4, 3).end, 8);
}

// One scenario: 4 sequences of varied prompt lengths, chunked prefill mixed with other
// sequences, then greedy decode steps, all in batches; block tables shuffled.
struct Scenario {
  static constexpr int kBlockSize = 8;
  static constexpr int kNumBlocks = 40;
  std::vector<std::vector<int32_t>> tokens;  // grows with decode
  std::vector<std::vector<int32_t>> tables;
  std::vector<int> computed;  // tokens whose KV is cached

  Scenario() {
    const int lens[] = {1, 5, 17, 40};
    std::vector<int32_t> ids(kNumBlocks);
    std::iota(ids.begin(), ids.end(), 0);
    std::mt19937 rng(3);
    std::shuffle(ids.begin(), ids.end(), rng);
    int next = 0;
    for (int s = 0; s < 4; ++s) {
      std::vector<int32_t> t;
      for (int i = 0; i < lens[s]; ++i) t.push_back((i * 37 + s * 11 + 3) % 256);
      tokens.push_back(t);
      tables.emplace_back(ids.begin() + next, ids.begin() + next + 8);  // 64 positions each
      next += 8;
      computed.push_back(0);
    }
  }
};

// Runs the scenario with `forward`; returns the logits of every step, concatenated.
template <typename ForwardFn>
std::vector<std::vector<float>> RunScenario(const ForwardFn& forward, int vocab) {
  Scenario sc;
  std::vector<std::vector<float>> all;
  // Prefill plan: (sequence, chunk length) per step.
  const std::vector<std::vector<std::pair<int, int>>> plan = {
      {{0, 1}, {1, 5}, {2, 9}, {3, 16}}, {{2, 8}, {3, 17}}, {{3, 7}}};
  auto step = [&](const std::vector<std::pair<int, int>>& chunks) {
    ForwardBatch b;
    for (auto [s, n] : chunks) {
      b.sequences.push_back({sc.tokens[s].data() + sc.computed[s], n, sc.computed[s],
                             sc.tables[s].data(), static_cast<int>(sc.tables[s].size()),
                             sc.computed[s] + n == static_cast<int>(sc.tokens[s].size())});
    }
    std::vector<float> logits;
    Status st = forward(b, &logits);
    EXPECT_TRUE(st.ok()) << st.ToString();
    int row = 0;
    for (size_t i = 0; i < chunks.size(); ++i) {
      auto [s, n] = chunks[i];
      sc.computed[s] += n;
      if (b.sequences[i].compute_logits && !logits.empty()) {
        const float* l = logits.data() + static_cast<size_t>(row++) * vocab;
        sc.tokens[s].push_back(static_cast<int32_t>(std::max_element(l, l + vocab) - l));
      }
    }
    all.push_back(std::move(logits));
  };
  for (const auto& chunks : plan) step(chunks);
  for (int d = 0; d < 4; ++d) step({{0, 1}, {1, 1}, {2, 1}, {3, 1}});
  return all;
}

struct TpCase {
  std::string name;
  ModelArch arch;
  int heads, kv_heads, head_dim, intermediate;
  std::vector<int> sizes;
  int threads = 2;                     // model pool; > T: ranks also split their work over it
  RopeType rope = RopeType::kDefault;  // scaled with an original context of 16 (TinyWithRope)
  // Resident weights: kAuto keeps the files' bf16 (ranks view them in place); kFloat32
  // converts at load.
  WeightDtype dtype = WeightDtype::kAuto;
};

class TensorParallelForward : public ::testing::TestWithParam<TpCase> {};

// Fills every rank's cache with 0xFF (NaN in every dtype) so a read of unwritten KV shows.
std::vector<LocalKvCache> MakeCaches(const TensorParallelModel& tp, KvDtype dtype) {
  std::vector<LocalKvCache> caches;
  for (int r = 0; r < tp.tp_size(); ++r) {
    std::vector<float> ks, vs;
    tp.model().KvScales(dtype, &ks, &vs);
    caches.emplace_back(tp.KvLayout(r, Scenario::kNumBlocks, Scenario::kBlockSize, dtype), ks, vs);
    const PagedKvView& v = caches.back().view();
    for (uint8_t* base : v.layer_base) std::memset(base, 0xFF, v.layout.LayerBytes());
  }
  return caches;
}

TEST_P(TensorParallelForward, LogitsAndKvBitwiseEqualToOneRank) {
  const TpCase& tc = GetParam();
  TempDir dir;
  auto spec = RandomModelPreset("tiny", tc.arch, 5);
  ASSERT_TRUE(spec.ok());
  if (tc.rope != RopeType::kDefault) *spec = testing_model::TinyWithRope(tc.arch, 5, tc.rope);
  spec->config.num_attention_heads = tc.heads;
  spec->config.num_key_value_heads = tc.kv_heads;
  spec->config.head_dim = tc.head_dim;
  spec->config.intermediate_size = tc.intermediate;
  ASSERT_TRUE(WriteRandomModel(*spec, dir.path()).ok());
  auto loaded = Model::Load(dir.path(), {.num_threads = tc.threads, .dtype = tc.dtype});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  std::shared_ptr<const Model> model = *loaded;
  const ModelConfig& c = model->config();
  const int vocab = c.vocab_size, hd = c.head_dim;

  for (KvDtype dtype : kAllDtypes) {
    SCOPED_TRACE(std::string(KvDtypeName(dtype)));
    auto one = TensorParallelModel::Create(model, 1);
    ASSERT_TRUE(one.ok());
    std::vector<LocalKvCache> ref_kv = MakeCaches(**one, dtype);
    const auto ref =
        RunScenario([&](const ForwardBatch& b,
                        std::vector<float>* l) { return model->Forward(b, ref_kv[0].view(), l); },
                    vocab);
    for (const auto& step : ref) {
      for (float f : step) ASSERT_TRUE(std::isfinite(f));
    }

    for (int t : tc.sizes) {
      SCOPED_TRACE("T=" + std::to_string(t));
      auto tp = TensorParallelModel::Create(model, t);
      ASSERT_TRUE(tp.ok()) << tp.status().ToString();
      std::vector<LocalKvCache> kv = MakeCaches(**tp, dtype);
      std::vector<PagedKvView> views;
      for (auto& k : kv) views.push_back(k.view());
      std::vector<int> hook_layers;
      const auto got = RunScenario(
          [&](ForwardBatch b, std::vector<float>* l) {
            b.on_layer_kv_written = [&](int layer) { hook_layers.push_back(layer); };
            return (*tp)->Forward(b, views, l);
          },
          vocab);
      ASSERT_EQ(got.size(), ref.size());
      for (size_t s = 0; s < ref.size(); ++s) {
        ASSERT_EQ(got[s].size(), ref[s].size()) << "step " << s;
        EXPECT_EQ(0, std::memcmp(got[s].data(), ref[s].data(), ref[s].size() * 4))
            << "logits differ at step " << s;
      }
      // The hook ran once per layer per step, in layer order.
      ASSERT_EQ(hook_layers.size(), ref.size() * c.num_hidden_layers);
      for (size_t i = 0; i < hook_layers.size(); ++i) {
        EXPECT_EQ(hook_layers[i], static_cast<int>(i % c.num_hidden_layers));
      }
      // Every rank's cache is byte-equal to its head slice of the one-rank cache (whole pool,
      // including never-written blocks).
      const PagedKvLayout& full = ref_kv[0].view().layout;
      for (int r = 0; r < t; ++r) {
        const HeadRange heads = (*tp)->kv_heads(r);
        const PagedKvLayout& rl = views[r].layout;
        ASSERT_EQ(rl.num_kv_heads, heads.size());
        const size_t head_bytes = static_cast<size_t>(rl.block_size) * hd * KvDtypeSize(dtype);
        size_t mismatches = 0;
        for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
          for (int b = 0; b < full.num_blocks; ++b) {
            for (int kvh = 0; kvh < 2; ++kvh) {
              const uint8_t* want =
                  ref_kv[0].view().layer_base[layer] + full.Offset(b, kvh, heads.begin, 0);
              const uint8_t* have = views[r].layer_base[layer] + rl.Offset(b, kvh, 0, 0);
              mismatches += std::memcmp(want, have, head_bytes * heads.size()) != 0;
            }
          }
        }
        EXPECT_EQ(mismatches, 0u) << "rank " << r;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Models, TensorParallelForward,
    ::testing::Values(
        // tiny llama: 4 heads / 2 KV heads; T=4 replicates each KV head on 2 ranks.
        TpCase{"tiny_llama", ModelArch::kLlama, 4, 2, 16, 128, {2, 4}},
        // qwen2: q/k/v bias, tied embeddings.
        TpCase{"tiny_qwen2", ModelArch::kQwen2, 4, 2, 16, 128, {2, 4}},
        // qwen3: per-head q/k norm, head_dim 32 (q_dim 128 = 2 hidden), tied embeddings.
        TpCase{"tiny_qwen3", ModelArch::kQwen3, 4, 2, 32, 128, {2, 4}},
        // RoPE scaling: llama3 bands and yarn (attention factor on cos/sin).
        TpCase{"tiny_llama_rope_llama3",
               ModelArch::kLlama,
               4,
               2,
               16,
               128,
               {2, 4},
               2,
               RopeType::kLlama3},
        TpCase{"tiny_qwen3_rope_yarn",
               ModelArch::kQwen3,
               8,
               2,
               16,
               100,
               {2, 4, 8},
               2,
               RopeType::kYarn},
        // 8 heads / 2 KV heads, intermediate 100 (uneven shards 12/13): T=8 replicates 4x.
        TpCase{"h8_kv2", ModelArch::kLlama, 8, 2, 8, 100, {2, 4, 8}},
        // 8 heads / 8 KV heads: one KV head per rank at T=8.
        TpCase{"h8_kv8", ModelArch::kLlama, 8, 8, 8, 128, {2, 8}},
        // 5 model threads: at T=2 and 4 every rank also splits its matmuls and attention
        // over the shared pool.
        TpCase{"h8_kv2_pooled", ModelArch::kLlama, 8, 2, 8, 100, {2, 4}, 5},
        // The same with fp32 weights (--dtype float32).
        TpCase{"tiny_qwen2_fp32w",
               ModelArch::kQwen2,
               4,
               2,
               16,
               128,
               {2, 4},
               2,
               RopeType::kDefault,
               WeightDtype::kFloat32},
        TpCase{"h8_kv2_fp32w",
               ModelArch::kLlama,
               8,
               2,
               8,
               100,
               {2, 4, 8},
               2,
               RopeType::kDefault,
               WeightDtype::kFloat32}),
    [](const auto& info) { return info.param.name; });

// Ranks view the model's weights in place (no copies): their slices' bytes in the resident
// type, fp32 (--dtype float32) and as stored (bf16).
TEST(TensorParallelModel, WeightBytesPerRank) {
  TempDir dir;
  auto stored = testing_model::MakeAndLoad(dir.path(), "tiny", ModelArch::kLlama, 1);
  ASSERT_NE(stored, nullptr);
  auto fp32 = Model::Load(dir.path(), {.num_threads = 2, .dtype = WeightDtype::kFloat32});
  ASSERT_TRUE(fp32.ok());
  for (const auto& [model, esize] :
       {std::pair<std::shared_ptr<Model>, size_t>{*fp32, 4}, {stored, 2}}) {
    SCOPED_TRACE(esize);
    // tiny llama: hidden 64, q_dim 64, kv_dim 32, intermediate 128, 2 layers, vocab 264.
    const size_t layer = (64 * 64 + 2 * 32 * 64 + 64 * 64 + 3 * 128 * 64) * esize;
    auto one = TensorParallelModel::Create(model, 1);
    ASSERT_TRUE(one.ok());
    EXPECT_EQ((*one)->RankWeightBytes(0), 2 * layer);
    EXPECT_EQ((*one)->ReplicatedWeightBytes(), 2 * 264 * 64 * esize + (64 + 2 * 2 * 64) * 4u);
    auto two = TensorParallelModel::Create(model, 2);
    ASSERT_TRUE(two.ok());
    EXPECT_EQ((*two)->RankWeightBytes(0), layer);  // exactly half: 2 KV heads over 2 ranks
    EXPECT_EQ((*two)->RankWeightBytes(1), layer);
    auto four = TensorParallelModel::Create(model, 4);
    ASSERT_TRUE(four.ok());
    // Quarter of q/o/MLP; k/v of one whole KV head (replicated on two ranks).
    const size_t quarter = (16 * 64 + 2 * 16 * 64 + 64 * 16 + 3 * 32 * 64) * esize;
    for (int r = 0; r < 4; ++r) EXPECT_EQ((*four)->RankWeightBytes(r), 2 * quarter) << r;
    // Creating ranks copies no weights: the model's resident bytes are all there is.
    EXPECT_EQ(model->weight_bytes(), 2 * layer + (*one)->ReplicatedWeightBytes());
  }
}

TEST(TensorParallelModel, RefusesBadSizesAndViews) {
  TempDir dir;
  auto model = testing_model::MakeAndLoad(dir.path(), "tiny", ModelArch::kLlama, 1);
  ASSERT_NE(model, nullptr);
  EXPECT_EQ(TensorParallelModel::Create(model, 3).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(TensorParallelModel::Create(nullptr, 1).status().code(), StatusCode::kInvalidArgument);
  auto tp = TensorParallelModel::Create(model, 2);
  ASSERT_TRUE(tp.ok());
  std::vector<float> ks(2, 1.0f), vs(2, 1.0f);
  LocalKvCache r0((*tp)->KvLayout(0, 4, 16, KvDtype::kFp32), ks, vs);
  LocalKvCache r1((*tp)->KvLayout(1, 4, 16, KvDtype::kFp32), ks, vs);
  LocalKvCache whole(model->KvLayout(4, 16, KvDtype::kFp32), ks, vs);
  LocalKvCache fewer((*tp)->KvLayout(1, 3, 16, KvDtype::kFp32), ks, vs);
  const int32_t tokens[] = {1, 2, 3};
  const int32_t table[] = {0};
  ForwardBatch b;
  b.sequences.push_back({tokens, 3, 0, table, 1, true});
  std::vector<float> logits;
  std::vector<PagedKvView> one = {r0.view()};
  EXPECT_EQ((*tp)->Forward(b, one, &logits).message(),
            "Forward: 1 KV views for tensor_parallel_size 2");
  std::vector<PagedKvView> wrong_heads = {r0.view(), whole.view()};
  EXPECT_EQ((*tp)->Forward(b, wrong_heads, &logits).message(),
            "rank 1: KV view layout (layers 2, kv heads 2, head_dim 16) does not match the "
            "model (2, 1, 16)");
  std::vector<PagedKvView> mismatched = {r0.view(), fewer.view()};
  EXPECT_EQ((*tp)->Forward(b, mismatched, &logits).code(), StatusCode::kInvalidArgument);
  const int32_t bad_table[] = {7};
  ForwardBatch bad;
  bad.sequences.push_back({tokens, 3, 0, bad_table, 1, true});
  std::vector<PagedKvView> good = {r0.view(), r1.view()};
  EXPECT_EQ((*tp)->Forward(bad, good, &logits).message(),
            "Forward: sequence 0: block id 7 outside the cache's 4 blocks");
  ASSERT_TRUE((*tp)->Forward(b, good, &logits).ok());
  EXPECT_EQ(logits.size(), static_cast<size_t>(model->config().vocab_size));
}

}  // namespace
}  // namespace kvbridge
