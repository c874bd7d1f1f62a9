// CPU-side logic of the CUDA forward pass (no GPU needed): tile plans, launch parameters,
// block-table packing, memory sizing.
#include "model/cuda/cuda_plan.h"

#include <gtest/gtest.h>

#include "kvbridge/model/cuda_model.h"

namespace kvbridge::cuda_internal {
namespace {

ModelConfig SmallConfig() {
  ModelConfig c;
  c.vocab_size = 264;
  c.hidden_size = 256;
  c.intermediate_size = 768;
  c.num_hidden_layers = 4;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 32;
  c.max_position_embeddings = 4096;
  return c;
}

TEST(CudaPlanTest, MatmulKOrderDoesNotDependOnM) {
  // The per-element K order (shard ranges, k-steps) is a function of k and the shard only.
  for (int k : {64, 896, 4864, 100, 18944}) {
    for (int shards : {1, 8}) {
      const MatmulPlan ref = PlanMatmul(1, 3584, k, shards);
      for (int m : {2, 17, 64, 65, 2048}) {
        const MatmulPlan p = PlanMatmul(m, 3584, k, shards);
        EXPECT_EQ(p.k_begin, ref.k_begin);
        EXPECT_EQ(p.k_end, ref.k_end);
        EXPECT_EQ(p.k_steps, ref.k_steps);
        EXPECT_EQ(p.grid_y, (m + kTileM - 1) / kTileM);
        EXPECT_EQ(p.grid_x, (3584 + kTileN - 1) / kTileN);
        EXPECT_EQ(p.grid_z, shards);
      }
    }
  }
}

TEST(CudaPlanTest, RowParallelShardsAreTheCpuShards) {
  // s*K/8 as the CPU's ShardBegin: hidden 896 -> 112-wide shards; K=100 -> uneven shards.
  const MatmulPlan p = PlanMatmul(4, 896, 896, 8);
  for (int s = 0; s < 8; ++s) {
    EXPECT_EQ(p.k_begin[s], 112 * s);
    EXPECT_EQ(p.k_end[s], 112 * (s + 1));
    EXPECT_EQ(p.k_steps[s], 8);  // ceil(112 / 32) * 2: the last stage is zero-padded
  }
  const MatmulPlan q = PlanMatmul(4, 64, 100, 8);
  EXPECT_EQ(q.k_begin, (std::vector<int>{0, 12, 25, 37, 50, 62, 75, 87}));
  EXPECT_EQ(q.k_end.back(), 100);
  const MatmulPlan one = PlanMatmul(4, 64, 100, 1);
  EXPECT_EQ(one.k_begin, std::vector<int>{0});
  EXPECT_EQ(one.k_end, std::vector<int>{100});
  EXPECT_EQ(one.k_steps, std::vector<int>{8});
}

TEST(CudaPlanTest, AttentionLaunch) {
  auto p = PlanAttention(37, 28, 4, 128);  // Qwen2.5-7B: 7 query heads per KV head
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ(p->grid_x, 37);
  EXPECT_EQ(p->grid_y, 4);
  EXPECT_EQ(p->threads, 7 * 32);
  EXPECT_EQ(p->smem_bytes, 2u * 16 * 128 * 4);
  EXPECT_EQ(p->dims_per_lane, 4);
  EXPECT_EQ(PlanAttention(1, 4, 2, 16)->dims_per_lane, 1);
  EXPECT_EQ(PlanAttention(1, 64, 1, 64).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanAttention(1, 8, 4, 512).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(PlanAttention(1, 6, 4, 64).status().code(), StatusCode::kInvalidArgument);
}

TEST(CudaPlanTest, PackStepLaysOutRowsAndTables) {
  const ModelConfig c = SmallConfig();
  PagedKvLayout layout{.num_layers = 4,
                       .num_kv_heads = 4,
                       .head_dim = 32,
                       .block_size = 16,
                       .num_blocks = 10,
                       .dtype = KvDtype::kBf16};
  const int32_t t0[] = {5, 6, 7};
  const int32_t t1[] = {9};
  const int32_t bt0[] = {3, 1, 9};  // needs 1 block (positions 0..2), table longer
  const int32_t bt1[] = {4, 2};     // decode at position 20: needs 2 blocks
  ForwardBatch b;
  b.sequences.push_back({t0, 3, 0, bt0, 3, true});
  b.sequences.push_back({t1, 1, 20, bt1, 2, true});
  PackedStep ps;
  ASSERT_TRUE(
      PackStep(c, layout, b, {.max_rows = 8, .max_seqs = 4, .max_table_blocks = 16}, &ps).ok());
  EXPECT_EQ(ps.rows, 4);
  EXPECT_EQ(ps.logit_rows, 2);
  EXPECT_EQ(ps.table_entries, 3);
  const std::vector<int32_t> want = {5, 6, 7, 9,   // tokens
                                     0, 1, 2, 20,  // positions
                                     0, 0, 0, 1,   // table offsets
                                     2, 3,         // logit rows
                                     3, 4, 2};     // packed tables
  EXPECT_EQ(ps.buf, want);
}

TEST(CudaPlanTest, PackStepRefusesWhatTheBuffersCannotHold) {
  const ModelConfig c = SmallConfig();
  PagedKvLayout layout{.num_layers = 4,
                       .num_kv_heads = 4,
                       .head_dim = 32,
                       .block_size = 16,
                       .num_blocks = 10,
                       .dtype = KvDtype::kBf16};
  std::vector<int32_t> toks(40, 1);
  const int32_t bt[] = {0, 1, 2};
  ForwardBatch b;
  b.sequences.push_back({toks.data(), 40, 0, bt, 3, true});
  PackedStep ps;
  auto st = PackStep(c, layout, b, {.max_rows = 32, .max_seqs = 4, .max_table_blocks = 16}, &ps);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("max_num_batched_tokens 32"), std::string::npos) << st.ToString();
  st = PackStep(c, layout, b, {.max_rows = 64, .max_seqs = 4, .max_table_blocks = 2}, &ps);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  // The CPU's own validation runs first: a block id outside the pool.
  const int32_t bad[] = {0, 11, 2};
  b.sequences[0].block_table = bad;
  st = PackStep(c, layout, b, {.max_rows = 64, .max_seqs = 4, .max_table_blocks = 16}, &ps);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_NE(st.message().find("block id 11"), std::string::npos) << st.ToString();
}

TEST(CudaPlanTest, ActivationBytes) {
  const ModelConfig c = SmallConfig();
  const ActivationSizes a =
      ActivationBytes(c, {.max_rows = 100, .max_seqs = 8, .max_table_blocks = 2048});
  EXPECT_EQ(a.x, AlignUp256(100 * 256 * 4));
  EXPECT_EQ(a.qkv, AlignUp256(100 * (256 + 2 * 128) * 4));
  EXPECT_EQ(a.partial, AlignUp256(8 * 100 * 256 * 4));
  EXPECT_EQ(a.gu, AlignUp256(100 * 2 * 768 * 4));
  EXPECT_EQ(a.logits, AlignUp256(8 * 264 * 4));
  EXPECT_EQ(a.meta, AlignUp256((300 + 8 + 2048) * 4));
  EXPECT_EQ(a.attn_scratch, 0u);  // max_len 0: one attention partition, nothing to fold
  EXPECT_EQ(a.Total(), a.x + a.hb + a.qkv + a.attn + a.partial + a.gu + a.act + a.logits + a.meta);
  // 1000 positions = 8 partitions of 128: states [rows][8][heads][head_dim + 2] fp32, capped.
  const ActivationSizes b = ActivationBytes(
      c, {.max_rows = 100, .max_seqs = 8, .max_table_blocks = 2048, .max_len = 1000});
  EXPECT_EQ(b.attn_scratch,
            AlignUp256(size_t{100} * 8 * c.num_attention_heads * (c.head_dim + 2) * 4));
  EXPECT_EQ(b.Total(), a.Total() + b.attn_scratch);
  const ActivationSizes big = ActivationBytes(
      c, {.max_rows = 8192, .max_seqs = 8, .max_table_blocks = 2048, .max_len = 32768});
  EXPECT_EQ(big.attn_scratch, kAttentionScratchMaxBytes);
}

TEST(CudaPlanTest, KvBlocksForUtilization) {
  const size_t gib = size_t{1} << 30;
  const size_t mib = size_t{1} << 20;
  // 100 GiB device, 0.9 -> 90 GiB budget; this engine's weights/activations 20 GiB -> 70 GiB.
  auto n = CudaKvBlocksForUtilization(100 * gib, 80 * gib, 20 * gib, 0.9, 1 << 20);
  ASSERT_TRUE(n.ok());
  EXPECT_EQ(*n, 70 * 1024);
  // Per instance: another process holding 30 GiB does not shrink a 0.2 share (20 GiB - 16 own).
  auto shared = CudaKvBlocksForUtilization(100 * gib, 54 * gib, 16 * gib, 0.2, 1 << 20);
  ASSERT_TRUE(shared.ok());
  EXPECT_EQ(*shared, 4 * 1024);
  // ... but the pool never takes more than is free, less the margin.
  auto capped = CudaKvBlocksForUtilization(100 * gib, 10 * gib, 20 * gib, 0.9, 1 << 20);
  ASSERT_TRUE(capped.ok());
  EXPECT_EQ(*capped, static_cast<int64_t>((10 * gib - kCudaFreeMargin) / mib));
  // The share is smaller than this engine's own weights: the error says so.
  auto small = CudaKvBlocksForUtilization(100 * gib, 80 * gib, 20 * gib, 0.1, 1 << 20);
  EXPECT_EQ(small.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(small.status().message().find("raise --gpu-memory-utilization"), std::string::npos)
      << small.status().ToString();
  // The device is full (others): the error says that instead.
  auto none = CudaKvBlocksForUtilization(100 * gib, 256 * mib, 20 * gib, 0.9, 1 << 20);
  EXPECT_EQ(none.status().code(), StatusCode::kResourceExhausted);
  EXPECT_NE(none.status().message().find("free on the device"), std::string::npos)
      << none.status().ToString();
  EXPECT_EQ(CudaKvBlocksForUtilization(100 * gib, 80 * gib, 0, 0.0, 1).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(CudaKvBlocksForUtilization(100 * gib, 80 * gib, 0, 1.5, 1).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(CudaPlanTest, ParseDeviceSpec) {
  EXPECT_EQ(*ParseDeviceSpec("cpu"), -1);
  EXPECT_EQ(*ParseDeviceSpec("cuda"), 0);
  EXPECT_EQ(*ParseDeviceSpec("cuda:3"), 3);
  EXPECT_EQ(*ParseDeviceSpec("cuda:12"), 12);
  for (const char* bad : {"gpu", "cuda:", "cuda:x", "cuda:-1", "CUDA", "cuda:1a", ""}) {
    EXPECT_EQ(ParseDeviceSpec(bad).status().code(), StatusCode::kInvalidArgument) << bad;
  }
}

}  // namespace
}  // namespace kvbridge::cuda_internal
