// The forward pass on the GPU (kvbridge/model/cuda_model.h), label gpu: batch invariance bitwise
// (alone / batched with 1..63 others / chunked / from cached KV / KV from another CudaModel) for
// bf16 and fp8 KV on the tiny and small presets, GPU vs CPU logits (measured bound), the
// per-layer KV callback, errors, no device-memory growth, and the golden export read by
// scripts/gpu_golden.py. Every GPU case skips with the reason printed where no CUDA device is
// usable. KVB_GPU_LOCAL picks the GPU (default 0).
#include "kvbridge/model/cuda_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "engine/engine_test_util.h"
#include "kvbridge/engine/engine_core.h"
#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"
#include "model/cuda/cuda_kernels.h"
#include "model/test_util.h"

namespace kvbridge {
namespace {

int Gpu() {
  const char* e = std::getenv("KVB_GPU_LOCAL");
  return e != nullptr ? std::atoi(e) : 0;
}

#define SKIP_WITHOUT_GPU()                                                \
  do {                                                                    \
    const Status kvb_dev = CudaDeviceAvailable(Gpu());                    \
    if (!kvb_dev.ok()) GTEST_SKIP() << "skipped: " << kvb_dev.ToString(); \
  } while (0)

// Models are written and loaded once per (preset, arch).
std::shared_ptr<const Model> GetModel(const std::string& preset, ModelArch arch) {
  static std::map<std::string, std::shared_ptr<Model>> cache;
  static std::vector<std::unique_ptr<testing_model::TempDir>> dirs;
  const std::string key = preset + "/" + std::string(ModelArchName(arch));
  auto it = cache.find(key);
  if (it != cache.end()) return it->second;
  dirs.push_back(std::make_unique<testing_model::TempDir>());
  auto m = testing_model::MakeAndLoad(dirs.back()->path(), preset.c_str(), arch, 11, 2);
  cache[key] = m;
  return m;
}

std::unique_ptr<CudaModel> MakeGpu(std::shared_ptr<const Model> m, KvDtype dtype,
                                   int num_blocks = 1024, int max_tokens = 2048) {
  auto g = CudaModel::Create(m, {.device = Gpu(),
                                 .kv_dtype = dtype,
                                 .block_size = 16,
                                 .num_blocks = num_blocks,
                                 .max_num_batched_tokens = max_tokens,
                                 .max_num_seqs = 128});
  EXPECT_TRUE(g.ok()) << g.status().ToString();
  return g.ok() ? std::move(g).value() : nullptr;
}

// A sequence of the test: its tokens and its own blocks.
struct Seq {
  std::vector<int32_t> tokens;
  std::vector<int32_t> table;
};

std::vector<int32_t> RandomTokens(std::mt19937& rng, int n, int vocab) {
  std::vector<int32_t> t(n);
  for (auto& x : t) x = static_cast<int32_t>(rng() % vocab);
  return t;
}

// Runs one step; returns the logits rows.
std::vector<float> Step(CudaModel& g, const ForwardBatch& b) {
  std::vector<float> logits;
  const Status st = g.Forward(b, &logits);
  EXPECT_TRUE(st.ok()) << st.ToString();
  return logits;
}

std::vector<float> Row(const std::vector<float>& l, int r, int vocab) {
  return std::vector<float>(l.begin() + static_cast<size_t>(r) * vocab,
                            l.begin() + static_cast<size_t>(r + 1) * vocab);
}

bool BitEqual(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * 4) == 0;
}

struct Case {
  const char* preset;
  ModelArch arch;
  KvDtype dtype;
};
std::string CaseName(const ::testing::TestParamInfo<Case>& i) {
  return std::string(i.param.preset) + "_" + std::string(ModelArchName(i.param.arch)) + "_" +
         std::string(KvDtypeName(i.param.dtype));
}

class CudaInvarianceTest : public ::testing::TestWithParam<Case> {};

TEST_P(CudaInvarianceTest, LogitsAreBitwiseIdenticalWhateverTheBatch) {
  SKIP_WITHOUT_GPU();
  const Case p = GetParam();
  auto model = GetModel(p.preset, p.arch);
  ASSERT_NE(model, nullptr);
  const int vocab = model->config().vocab_size;
  auto gpu = MakeGpu(model, p.dtype);
  ASSERT_NE(gpu, nullptr);
  std::mt19937 rng(5);
  const int n = 45;  // the target: 45 prompt tokens (3 blocks), then 3 decode tokens
  Seq target{RandomTokens(rng, n + 3, vocab), {0, 1, 2, 3}};
  auto one = [&](int start, int len, bool logits) {
    return SequenceChunk{target.tokens.data() + start, len, start, target.table.data(), 4, logits};
  };

  // Alone: prefill in one chunk, then one decode step at a time.
  std::vector<std::vector<float>> ref;
  for (int s = 0; s <= 3; ++s) {
    ForwardBatch b;
    b.sequences.push_back(s == 0 ? one(0, n, true) : one(n + s - 1, 1, true));
    ref.push_back(Step(*gpu, b));
    ASSERT_EQ(ref.back().size(), static_cast<size_t>(vocab));
  }
  std::vector<std::vector<uint8_t>> ref_kv(model->config().num_hidden_layers);
  for (int l = 0; l < model->config().num_hidden_layers; ++l) {
    ASSERT_TRUE(gpu->ReadKvLayer(l, &ref_kv[l]).ok());
  }
  const size_t block_bytes = gpu->kv_view().layout.BlockBytes();

  // Batched with 1..63 others (random prefill chunks and decodes), the target anywhere.
  for (int others : {1, 2, 7, 31, 63}) {
    std::vector<Seq> seqs(others);
    ForwardBatch b;
    int next_block = 8;
    for (auto& s : seqs) {
      const int len = 1 + static_cast<int>(rng() % 40);
      s.tokens = RandomTokens(rng, len + 1, vocab);
      for (int k = 0; k < 3; ++k) s.table.push_back(next_block++);
    }
    // Prime half of them (their prompt minus the last token) so that they decode in the batch.
    ForwardBatch prime;
    for (int i = 0; i < others; i += 2) {
      Seq& s = seqs[i];
      prime.sequences.push_back(
          {s.tokens.data(), static_cast<int>(s.tokens.size()) - 1, 0, s.table.data(), 3, false});
    }
    if (!prime.sequences.empty()) Step(*gpu, prime);
    for (int step = 0; step <= 3; ++step) {
      ForwardBatch sb;
      const int where = static_cast<int>(rng() % (others + 1));
      int target_row = -1, rows = 0;
      for (int i = 0; i <= others; ++i) {
        if (i == where) {
          sb.sequences.push_back(step == 0 ? one(0, n, true) : one(n + step - 1, 1, true));
          target_row = rows++;
        }
        if (i == others) break;
        Seq& s = seqs[i];
        const int len = static_cast<int>(s.tokens.size());
        const bool logits = (rng() & 1) != 0;
        if (i % 2 == 0) {
          sb.sequences.push_back(
              {s.tokens.data() + len - 1, 1, len - 1, s.table.data(), 3, logits});
        } else {
          sb.sequences.push_back({s.tokens.data(), len, 0, s.table.data(), 3, logits});
        }
        if (logits) ++rows;
      }
      const auto l = Step(*gpu, sb);
      ASSERT_TRUE(BitEqual(Row(l, target_row, vocab), ref[step]))
          << "others " << others << " step " << step << " target at " << where;
    }
    // The target's KV bytes are the same as when it ran alone.
    for (int l = 0; l < model->config().num_hidden_layers; ++l) {
      std::vector<uint8_t> kv;
      ASSERT_TRUE(gpu->ReadKvLayer(l, &kv).ok());
      ASSERT_EQ(std::memcmp(kv.data(), ref_kv[l].data(), 4 * block_bytes), 0) << "layer " << l;
    }
  }

  // Chunked prefill (chunk sizes crossing block and attention-chunk boundaries).
  for (const std::vector<int>& chunks :
       {std::vector<int>{1, 44}, {5, 16, 3, 21}, {16, 16, 13}, {17, 17, 11}, {44, 1}}) {
    int start = 0;
    std::vector<float> last;
    for (size_t c = 0; c < chunks.size(); ++c) {
      ForwardBatch b;
      b.sequences.push_back(one(start, chunks[c], c + 1 == chunks.size()));
      last = Step(*gpu, b);
      start += chunks[c];
    }
    ASSERT_EQ(start, n);
    ASSERT_TRUE(BitEqual(last, ref[0])) << "chunks starting " << chunks[0];
  }

  // From KV computed by another CudaModel ("another engine process"): copy the target's KV
  // layers into a second model's pool and decode there.
  auto other = MakeGpu(model, p.dtype);
  ASSERT_NE(other, nullptr);
  for (int l = 0; l < model->config().num_hidden_layers; ++l) {
    ASSERT_TRUE(other->WriteKvLayer(l, ref_kv[l]).ok());
  }
  for (int s = 1; s <= 3; ++s) {
    ForwardBatch b;
    b.sequences.push_back(one(n + s - 1, 1, true));
    ASSERT_TRUE(BitEqual(Step(*other, b), ref[s])) << "decode " << s << " from copied KV";
  }
  // Copy-on-write of a block keeps the bits: the target's first block copied to block 900.
  ASSERT_TRUE(gpu->CopyBlock(0, 900).ok());
  std::vector<int32_t> cow = {900, 1, 2, 3};
  ForwardBatch b;
  b.sequences.push_back({target.tokens.data() + n, 1, n, cow.data(), 4, true});
  ASSERT_TRUE(BitEqual(Step(*gpu, b), ref[1]));
}

INSTANTIATE_TEST_SUITE_P(Presets, CudaInvarianceTest,
                         ::testing::Values(Case{"tiny", ModelArch::kLlama, KvDtype::kBf16},
                                           Case{"tiny", ModelArch::kQwen2, KvDtype::kFp8E4M3},
                                           Case{"tiny", ModelArch::kLlama, KvDtype::kFp32},
                                           Case{"tiny", ModelArch::kQwen3, KvDtype::kBf16},
                                           Case{"small", ModelArch::kQwen3, KvDtype::kFp8E4M3},
                                           Case{"small", ModelArch::kQwen2, KvDtype::kBf16},
                                           Case{"small", ModelArch::kLlama, KvDtype::kFp8E4M3}),
                         CaseName);

// GPU vs CPU logits: the same model, the same prompt, the same KV dtype. The GPU feeds bf16
// activations into the matmuls (the CPU fp32), so they differ: the bound below is measured.
TEST(CudaModelTest, LogitsCloseToTheCpu) {
  SKIP_WITHOUT_GPU();
  for (const Case p : {Case{"tiny", ModelArch::kLlama, KvDtype::kBf16},
                       Case{"small", ModelArch::kQwen2, KvDtype::kBf16},
                       Case{"small", ModelArch::kLlama, KvDtype::kFp8E4M3},
                       Case{"small", ModelArch::kQwen3, KvDtype::kBf16}}) {
    auto model = GetModel(p.preset, p.arch);
    ASSERT_NE(model, nullptr);
    const int vocab = model->config().vocab_size;
    auto gpu = MakeGpu(model, p.dtype, 64);
    ASSERT_NE(gpu, nullptr);
    std::vector<float> ks, vs;
    model->KvScales(p.dtype, &ks, &vs);
    LocalKvCache kv(model->KvLayout(64, 16, p.dtype), ks, vs);
    std::mt19937 rng(9);
    double max_diff = 0, max_abs = 0;
    int argmax_same = 0, prompts = 0;
    for (int len : {1, 7, 33, 100, 250}) {
      const std::vector<int32_t> toks = RandomTokens(rng, len, vocab);
      std::vector<int32_t> table(16);
      for (int i = 0; i < 16; ++i) table[i] = i;
      ForwardBatch b;
      b.sequences.push_back({toks.data(), len, 0, table.data(), 16, true});
      std::vector<float> cpu;
      ASSERT_TRUE(model->Forward(b, kv.view(), &cpu).ok());
      const std::vector<float> g = Step(*gpu, b);
      ASSERT_EQ(g.size(), cpu.size());
      for (size_t i = 0; i < g.size(); ++i) {
        max_diff = std::max(max_diff, std::fabs(static_cast<double>(g[i]) - cpu[i]));
        max_abs = std::max(max_abs, std::fabs(static_cast<double>(cpu[i])));
      }
      argmax_same += std::max_element(g.begin(), g.end()) - g.begin() ==
                     std::max_element(cpu.begin(), cpu.end()) - cpu.begin();
      ++prompts;
    }
    std::printf(
        "GPU_VS_CPU | %s %s %s | max |gpu-cpu| %.3g | max |cpu| %.3g | rel %.3g | argmax "
        "%d/%d\n",
        p.preset, std::string(ModelArchName(p.arch)).c_str(),
        std::string(KvDtypeName(p.dtype)).c_str(), max_diff, max_abs, max_diff / max_abs,
        argmax_same, prompts);
    EXPECT_LE(max_diff, 0.05 * max_abs + 1e-3) << p.preset;
  }
}

TEST(CudaModelTest, LayerCallbackSeesThatLayersKvOnTheDevice) {
  SKIP_WITHOUT_GPU();
  auto model = GetModel("tiny", ModelArch::kLlama);
  auto gpu = MakeGpu(model, KvDtype::kBf16, 16);
  ASSERT_NE(gpu, nullptr);
  ASSERT_TRUE(gpu->FillKv(0xFF).ok());
  const std::vector<int32_t> toks = {1, 2, 3, 4, 5};
  const std::vector<int32_t> table = {3};
  ForwardBatch b;
  b.sequences.push_back({toks.data(), 5, 0, table.data(), 1, true});
  std::vector<int> seen;
  const size_t bb = gpu->kv_view().layout.BlockBytes();
  b.on_layer_kv_written = [&](int layer) {
    seen.push_back(layer);
    std::vector<uint8_t> kv;
    ASSERT_TRUE(gpu->ReadKvLayer(layer, &kv).ok());
    // Slot 0 of block 3 (K of head 0) holds this step's bf16 K: not the 0xFFFF fill.
    EXPECT_FALSE(kv[3 * bb] == 0xFF && kv[3 * bb + 1] == 0xFF) << "layer " << layer;
    if (layer + 1 < model->config().num_hidden_layers) {
      std::vector<uint8_t> next;
      ASSERT_TRUE(gpu->ReadKvLayer(layer + 1, &next).ok());
      EXPECT_TRUE(next[3 * bb] == 0xFF && next[3 * bb + 1] == 0xFF) << "layer " << layer + 1;
    }
    EXPECT_NE(gpu->layer_kv_event(layer), nullptr);
  };
  std::vector<float> logits;
  ASSERT_TRUE(gpu->Forward(b, &logits).ok());
  EXPECT_EQ(seen, (std::vector<int>{0, 1}));
  for (float f : logits) ASSERT_TRUE(std::isfinite(f));
}

TEST(CudaModelTest, BadBatchesAreRefusedBeforeAnythingRuns) {
  SKIP_WITHOUT_GPU();
  auto model = GetModel("tiny", ModelArch::kLlama);
  auto gpu = MakeGpu(model, KvDtype::kBf16, 16, 32);
  ASSERT_NE(gpu, nullptr);
  std::vector<int32_t> toks(40, 7);
  std::vector<int32_t> table = {0, 1, 2};
  std::vector<float> logits;
  ForwardBatch b;
  b.sequences.push_back({toks.data(), 40, 0, table.data(), 3, true});
  Status st = gpu->Forward(b, &logits);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  b.sequences[0].num_tokens = 8;
  table[0] = 16;
  st = gpu->Forward(b, &logits);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  table[0] = 0;
  toks[0] = model->config().vocab_size;
  st = gpu->Forward(b, &logits);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  toks[0] = 1;
  EXPECT_TRUE(gpu->Forward(b, &logits).ok());
  // No logit rows: an empty result.
  b.sequences[0].compute_logits = false;
  EXPECT_TRUE(gpu->Forward(b, &logits).ok());
  EXPECT_TRUE(logits.empty());
}

TEST(CudaModelTest, OutOfMemoryAtStartNamesWhatDidNotFit) {
  SKIP_WITHOUT_GPU();
  auto model = GetModel("tiny", ModelArch::kLlama);
  // 2^31 - 1 blocks of 4 KiB x 2 layers: far beyond any GPU.
  auto g = CudaModel::Create(model, {.device = Gpu(), .num_blocks = (int64_t{1} << 31) - 1});
  ASSERT_FALSE(g.ok());
  EXPECT_EQ(g.status().code(), StatusCode::kResourceExhausted) << g.status().ToString();
  EXPECT_NE(g.status().message().find("KV cache"), std::string::npos) << g.status().ToString();
  auto a = CudaModel::Create(
      model, {.device = Gpu(), .num_blocks = 16, .max_num_batched_tokens = 1 << 30});
  ASSERT_FALSE(a.ok());
  EXPECT_EQ(a.status().code(), StatusCode::kResourceExhausted) << a.status().ToString();
  EXPECT_NE(a.status().message().find("activations"), std::string::npos);
  // The utilization rule sizes a pool that fits.
  auto u = CudaModel::Create(model, {.device = Gpu(), .gpu_memory_utilization = 0.05});
  if (u.ok()) {
    std::printf("UTILIZATION | 0.05 | %lld blocks | kv %.1f MiB | device %s\n",
                static_cast<long long>((*u)->kv_view().layout.num_blocks),
                (*u)->memory().kv_bytes / 1048576.0, (*u)->device_name().c_str());
  } else {
    EXPECT_EQ(u.status().code(), StatusCode::kResourceExhausted) << u.status().ToString();
  }
  EXPECT_EQ(CudaModel::Create(model, {.device = 999}).status().code(), StatusCode::kUnavailable);
}

TEST(CudaModelTest, NoDeviceMemoryGrowthOverManySteps) {
  SKIP_WITHOUT_GPU();
  auto model = GetModel("tiny", ModelArch::kQwen2);
  auto gpu = MakeGpu(model, KvDtype::kFp8E4M3, 256, 512);
  ASSERT_NE(gpu, nullptr);
  std::mt19937 rng(3);
  const int vocab = model->config().vocab_size;
  size_t free10 = 0;
  for (int r = 0; r < 1000; ++r) {
    const int nseq = 1 + static_cast<int>(rng() % 8);
    std::vector<Seq> seqs(nseq);
    ForwardBatch b;
    for (int i = 0; i < nseq; ++i) {
      const int len = 1 + static_cast<int>(rng() % 60);
      seqs[i].tokens = RandomTokens(rng, len, vocab);
      for (int k = 0; k < 4; ++k) seqs[i].table.push_back(static_cast<int32_t>(rng() % 256));
      b.sequences.push_back({seqs[i].tokens.data(), len, 0, seqs[i].table.data(), 4, true});
    }
    std::vector<float> logits;
    ASSERT_TRUE(gpu->Forward(b, &logits).ok());
    if (r == 9) free10 = gpu->DeviceFreeBytes().value();
  }
  const size_t free1000 = gpu->DeviceFreeBytes().value();
  std::printf("MEMORY | free after 10 steps %zu | after 1000 steps %zu\n", free10, free1000);
  EXPECT_EQ(free10, free1000);
}

// A short forward for compute-sanitizer racecheck (every kernel once, small grids).
TEST(CudaModelTest, RacecheckSmallStep) {
  SKIP_WITHOUT_GPU();
  auto model = GetModel("tiny", ModelArch::kQwen2);
  auto gpu = MakeGpu(model, KvDtype::kBf16, 16, 64);
  ASSERT_NE(gpu, nullptr);
  const std::vector<int32_t> a = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18};
  const std::vector<int32_t> ta = {0, 1}, tb = {2};
  ForwardBatch b;
  b.sequences.push_back({a.data(), 18, 0, ta.data(), 2, true});
  b.sequences.push_back({a.data(), 3, 0, tb.data(), 1, true});
  std::vector<float> logits;
  ASSERT_TRUE(gpu->Forward(b, &logits).ok());
  EXPECT_EQ(logits.size(), 2u * model->config().vocab_size);
}

// Attention over several 128-position partitions: the schedule (one CTA per (row, KV head)
// walking the partitions, or split across CTAs and folded by a second kernel) and the batch do
// not change a bit. A 300-token prompt (3 partitions) prefilled in two chunks, then 3 decodes;
// every schedule, alone and with a 200-token prefill of another sequence in the same steps.
TEST(CudaModelTest, AttentionPartitionsAreBitwiseIdenticalWhateverTheSchedule) {
  SKIP_WITHOUT_GPU();
  std::vector<Case> cases = {Case{"tiny", ModelArch::kLlama, KvDtype::kBf16},
                             Case{"small", ModelArch::kQwen3, KvDtype::kFp8E4M3},
                             Case{"tiny", ModelArch::kLlama, KvDtype::kFp32}};
  if (std::getenv("KVB_TEST_LITE") != nullptr) cases.resize(1);  // under racecheck: one case
  for (const Case& p : cases) {
    SCOPED_TRACE(std::string(p.preset) + " " + std::string(KvDtypeName(p.dtype)));
    auto model = GetModel(p.preset, p.arch);
    ASSERT_NE(model, nullptr);
    const int vocab = model->config().vocab_size;
    auto gpu = MakeGpu(model, p.dtype, 128);
    ASSERT_NE(gpu, nullptr);
    std::mt19937 rng(17);
    const std::vector<int32_t> tok = RandomTokens(rng, 303, vocab);
    const std::vector<int32_t> other = RandomTokens(rng, 200, vocab);
    std::vector<int32_t> table(20), table2(13);
    for (int i = 0; i < 20; ++i) table[i] = i;
    for (int i = 0; i < 13; ++i) table2[i] = 40 + i;
    // steps: prefill [0, 170), [170, 300), then decodes at 300, 301, 302.
    const auto run = [&](int schedule, bool crowded) {
      cuda_internal::SetAttentionScheduleForTest(schedule);
      std::vector<std::vector<float>> rows;
      const int starts[] = {0, 170, 300, 301, 302}, lens[] = {170, 130, 1, 1, 1};
      for (int s = 0; s < 5; ++s) {
        ForwardBatch b;
        if (crowded && s >= 2)
          b.sequences.push_back({other.data(), 200, 0, table2.data(), 13, true});
        b.sequences.push_back({tok.data() + starts[s], lens[s], starts[s], table.data(), 20, true});
        const std::vector<float> l = Step(*gpu, b);
        rows.push_back(Row(l, crowded && s >= 2 ? 1 : 0, vocab));
      }
      cuda_internal::SetAttentionScheduleForTest(-1);
      return rows;
    };
    const auto ref = run(-1, false);
    for (int schedule : {0, 1}) {
      for (bool crowded : {false, true}) {
        const auto got = run(schedule, crowded);
        for (int s = 0; s < 5; ++s) {
          EXPECT_TRUE(BitEqual(ref[s], got[s]))
              << "step " << s << " schedule " << schedule << " crowded " << crowded;
        }
      }
    }
  }
}

// CreateRandom generates on the GPU exactly the weights WriteRandomModel writes (the counter-based
// generator of numerics_hd.h compiled for both): logits of the generated and of the written and
// loaded model are the same bits, and so are the KV bytes they wrote. Covers every tensor kind:
// llama (untied lm_head), qwen2 (q/k/v bias, tied), qwen3 (q/k norm).
TEST(CudaModelTest, CreateRandomEqualsTheWrittenModel) {
  SKIP_WITHOUT_GPU();
  for (const auto& [preset, arch] :
       {std::pair{"tiny", ModelArch::kLlama}, std::pair{"small", ModelArch::kQwen2},
        std::pair{"small", ModelArch::kQwen3}}) {
    SCOPED_TRACE(std::string(preset) + " " + std::string(ModelArchName(arch)));
    auto model = GetModel(preset, arch);  // written with seed 11
    ASSERT_NE(model, nullptr);
    auto loaded = MakeGpu(model, KvDtype::kBf16, 64);
    auto spec = RandomModelPreset(preset, arch, 11);
    ASSERT_TRUE(spec.ok());
    auto made = CudaModel::CreateRandom(*spec, loaded->options());
    ASSERT_TRUE(made.ok()) << made.status().ToString();
    EXPECT_EQ((*made)->memory().weight_bytes, loaded->memory().weight_bytes);
    std::mt19937 rng(3);
    const std::vector<int32_t> tokens = RandomTokens(rng, 40, model->config().vocab_size);
    const std::vector<int32_t> table = {0, 1, 2};
    ForwardBatch b;
    b.sequences.push_back({tokens.data(), 40, 0, table.data(), 3, true});
    const std::vector<float> want = Step(*loaded, b);
    const std::vector<float> got = Step(**made, b);
    EXPECT_TRUE(BitEqual(want, got));
    for (int l = 0; l < model->config().num_hidden_layers; ++l) {
      std::vector<uint8_t> kw, kg;
      ASSERT_TRUE(loaded->ReadKvLayer(l, &kw).ok());
      ASSERT_TRUE((*made)->ReadKvLayer(l, &kg).ok());
      EXPECT_TRUE(kw == kg) << "layer " << l;
    }
  }
}

// Golden export (for scripts/gpu_golden.py): KVB_GOLDEN_MODEL = a model dir, KVB_GOLDEN_OUT = an
// output dir. Writes prompts.txt (one prompt of token ids per line) and, per KV dtype,
// gpu_<dtype>.f32 and cpu_<dtype>.f32: [prompts][vocab] last-token logits.
TEST(CudaModelTest, GoldenExport) {
  const char* dir = std::getenv("KVB_GOLDEN_MODEL");
  const char* out = std::getenv("KVB_GOLDEN_OUT");
  if (dir == nullptr || out == nullptr) GTEST_SKIP() << "skipped: KVB_GOLDEN_MODEL/OUT unset";
  SKIP_WITHOUT_GPU();
  auto loaded = Model::Load(dir, {.num_threads = 8});
  ASSERT_TRUE(loaded.ok()) << loaded.status().ToString();
  std::shared_ptr<const Model> model = *loaded;
  const int vocab = model->config().vocab_size;
  std::mt19937 rng(21);
  std::vector<std::vector<int32_t>> prompts;
  for (int len : {1, 16, 45, 128}) prompts.push_back(RandomTokens(rng, len, std::min(vocab, 256)));
  {
    std::ofstream f(std::string(out) + "/prompts.txt");
    for (const auto& p : prompts) {
      for (size_t i = 0; i < p.size(); ++i) f << (i ? " " : "") << p[i];
      f << "\n";
    }
  }
  for (KvDtype dtype : {KvDtype::kBf16, KvDtype::kFp32}) {
    auto gpu = MakeGpu(model, dtype, 16, 256);
    ASSERT_NE(gpu, nullptr);
    std::vector<float> ks, vs;
    model->KvScales(dtype, &ks, &vs);
    LocalKvCache kv(model->KvLayout(16, 16, dtype), ks, vs);
    std::vector<float> all_gpu, all_cpu;
    std::vector<int32_t> table(16);
    for (int i = 0; i < 16; ++i) table[i] = i;
    for (const auto& p : prompts) {
      ForwardBatch b;
      b.sequences.push_back({p.data(), static_cast<int>(p.size()), 0, table.data(), 16, true});
      const std::vector<float> g = Step(*gpu, b);
      std::vector<float> c;
      ASSERT_TRUE(model->Forward(b, kv.view(), &c).ok());
      all_gpu.insert(all_gpu.end(), g.begin(), g.end());
      all_cpu.insert(all_cpu.end(), c.begin(), c.end());
    }
    for (auto [name, v] : {std::pair{"gpu", &all_gpu}, std::pair{"cpu", &all_cpu}}) {
      std::ofstream f(
          std::string(out) + "/" + name + "_" + std::string(KvDtypeName(dtype)) + ".f32",
          std::ios::binary);
      f.write(reinterpret_cast<const char*>(v->data()),
              static_cast<std::streamsize>(v->size() * 4));
    }
    EXPECT_EQ(all_gpu.size(), prompts.size() * vocab);
  }
}

// The engine on the GPU (EngineConfig::cuda_device): scheduler, sampler and outputs unchanged;
// a request's logits are bitwise the same alone and among 20 others (n=8 siblings, chunked
// prefills: max_num_batched_tokens 64), and the prefix cache serves a repeat bitwise too.
TEST(CudaEngineTest, GpuEngineIsBatchInvariant) {
  SKIP_WITHOUT_GPU();
  using namespace testing_engine;  // NOLINT
  auto run = [&](int others, int budget) {
    EngineConfig c = SmallConfig(512);
    c.cuda_device = Gpu();
    c.kv_dtype = KvDtype::kBf16;
    c.max_num_batched_tokens = budget;
    auto created = EngineCore::Create(c, TinyModel(), nullptr, {});
    EXPECT_TRUE(created.ok()) << created.status().ToString();
    auto core = std::move(created).value();
    EXPECT_NE(core->cuda_model(), nullptr);
    LogitsLog log;
    log.Attach(*core);
    TimePoint now = 0;
    EngineRequest x = Req("x", Prompt(70, 1), 6);
    x.sampling.logprobs = 2;
    EXPECT_TRUE(core->AddRequest(x, now).ok());
    for (int i = 0; i < others; ++i) {
      EngineRequest o =
          Req("o" + std::to_string(i), Prompt(5 + 7 * i, i + 2), 5, i % 3 == 0 ? 8 : 1);
      o.sampling.temperature = 0.7f;
      o.sampling.seed = i;
      EXPECT_TRUE(core->AddRequest(o, now).ok());
    }
    auto out = RunAll(*core, &now);
    std::map<int, std::vector<float>> xs;
    for (auto& [key, row] : log.rows) {
      if (key.first == "x") xs[key.second] = row;
    }
    EXPECT_TRUE(out["x"].finished && out["x"].error.ok());
    return std::make_pair(xs, out["x"].tokens.at(0));
  };
  auto [alone, t_alone] = run(0, 2048);
  auto [crowd, t_crowd] = run(20, 64);
  ASSERT_EQ(alone.size(), 6u);
  ASSERT_EQ(crowd.size(), 6u);
  for (auto& [pos, row] : alone) EXPECT_TRUE(BitwiseEqual(row, crowd[pos])) << "position " << pos;
  EXPECT_EQ(t_alone, t_crowd);
}

// Writes a random-weight model for the golden run (no GPU needed): KVB_MAKE_MODEL_OUT = dir,
// KVB_MAKE_MODEL_SHAPE = PRESET-ARCH for tiny/small (e.g. small-qwen3), or a real-shaped preset
// (qwen2.5-0.5b, qwen3-0.6b, llama-3.2-1b: random_model.h).
TEST(CudaModelTest, MakeModel) {
  const char* out = std::getenv("KVB_MAKE_MODEL_OUT");
  const char* shape = std::getenv("KVB_MAKE_MODEL_SHAPE");
  if (out == nullptr || shape == nullptr) GTEST_SKIP() << "skipped: KVB_MAKE_MODEL_* unset";
  const std::string sh = shape;
  Result<RandomModelSpec> spec = InvalidArgumentError("unknown shape " + sh);
  const size_t dash = sh.find('-');
  if (sh.rfind("tiny-", 0) == 0 || sh.rfind("small-", 0) == 0) {
    auto arch = ParseModelArch(sh.substr(dash + 1));
    ASSERT_TRUE(arch.ok()) << arch.status().ToString();
    spec = RandomModelPreset(sh.substr(0, dash), *arch, 3);
  } else {
    spec = RandomModelPreset(sh, 3);
  }
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  ASSERT_TRUE(WriteRandomModel(*spec, out).ok());
}

}  // namespace
}  // namespace kvbridge
