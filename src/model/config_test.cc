#include "kvbridge/model/config.h"

#include <gtest/gtest.h>

namespace kvbridge {
namespace {

constexpr const char* kLlama = R"({
  "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 264,
  "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
  "num_attention_heads": 4, "num_key_value_heads": 2, "rope_theta": 500000.0,
  "max_position_embeddings": 512, "rms_norm_eps": 1e-05, "tie_word_embeddings": false,
  "attention_bias": true, "bos_token_id": 256, "eos_token_id": [257, 258], "hidden_act": "silu"
})";

TEST(ModelConfig, ParsesLlama) {
  auto c = ModelConfig::FromJson(kLlama);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->arch, ModelArch::kLlama);
  EXPECT_EQ(c->vocab_size, 264);
  EXPECT_EQ(c->hidden_size, 64);
  EXPECT_EQ(c->intermediate_size, 128);
  EXPECT_EQ(c->num_hidden_layers, 2);
  EXPECT_EQ(c->num_attention_heads, 4);
  EXPECT_EQ(c->num_key_value_heads, 2);
  EXPECT_EQ(c->head_dim, 16);  // hidden / heads when absent
  EXPECT_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->max_position_embeddings, 512);
  EXPECT_EQ(c->rms_norm_eps, 1e-5);
  EXPECT_FALSE(c->tie_word_embeddings);
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_TRUE(c->o_bias);
  EXPECT_EQ(c->bos_token_id, 256);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int>{257, 258}));
  EXPECT_EQ(c->pad_token_id, -1);
  EXPECT_EQ(c->fp8_k_scale, (std::vector<float>{1.0f, 1.0f}));
}

TEST(ModelConfig, ParsesQwen2WithBiasTiedEmbeddingsAndExplicitHeadDim) {
  auto c = ModelConfig::FromJson(R"({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 300,
    "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 32, "tie_word_embeddings": true,
    "use_sliding_window": false, "sliding_window": null, "eos_token_id": 257,
    "kvbridge_fp8_k_scale": 0.5, "kvbridge_fp8_v_scale": [1, 2, 4]})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->arch, ModelArch::kQwen2);
  EXPECT_TRUE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->head_dim, 32);
  EXPECT_EQ(c->q_dim(), 256);
  EXPECT_EQ(c->kv_dim(), 64);
  EXPECT_EQ(c->rope_theta, 10000.0);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int>{257}));
  EXPECT_EQ(c->fp8_k_scale, (std::vector<float>{0.5f, 0.5f, 0.5f}));
  EXPECT_EQ(c->fp8_v_scale, (std::vector<float>{1.0f, 2.0f, 4.0f}));
}

TEST(ModelConfig, ToJsonRoundTrips) {
  auto c = ModelConfig::FromJson(kLlama);
  ASSERT_TRUE(c.ok());
  auto again = ModelConfig::FromJson(c->ToJson().dump());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->ToJson().dump(), c->ToJson().dump());
  EXPECT_EQ(c->ToJson()["architectures"][0], "LlamaForCausalLM");
  EXPECT_EQ(c->ToJson()["torch_dtype"], "bfloat16");
}

struct BadConfig {
  const char* json;
  StatusCode code;
  const char* message_part;
};

TEST(ModelConfig, RejectsBadConfigsWithNamedField) {
  const BadConfig cases[] = {
      {"not json", StatusCode::kInvalidArgument, "not valid JSON"},
      {"[1]", StatusCode::kInvalidArgument, "not a JSON object"},
      {R"({"architectures": ["GPT2LMHeadModel"]})", StatusCode::kUnimplemented, "GPT2LMHeadModel"},
      {R"({"architectures": ["LlamaForCausalLM"], "hidden_size": 64})",
       StatusCode::kInvalidArgument, "'vocab_size' is missing"},
      {R"({"architectures": ["LlamaForCausalLM"], "vocab_size": "x"})",
       StatusCode::kInvalidArgument, "'vocab_size' must be an integer"},
      {R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "num_key_value_heads": 3})",
       StatusCode::kInvalidArgument, "'num_key_value_heads' must divide"},
      {R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 0})",
       StatusCode::kInvalidArgument, "'num_attention_heads' must be > 0"},
      {R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "rope_scaling": {"type": "linear", "factor": 2.0}})",
       StatusCode::kUnimplemented, "rope_scaling"},
      {R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "bos_token_id": 300})",
       StatusCode::kInvalidArgument, "'bos_token_id' must be < vocab_size"},
      {R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 4,
          "kvbridge_fp8_k_scale": [1.0]})",
       StatusCode::kInvalidArgument, "kvbridge_fp8_k_scale"},
      {R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "hidden_act": "gelu"})",
       StatusCode::kUnimplemented, "hidden_act"},
      {R"({"architectures": ["Qwen2ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "use_sliding_window": true})",
       StatusCode::kUnimplemented, "use_sliding_window"},
  };
  for (const auto& bc : cases) {
    auto c = ModelConfig::FromJson(bc.json);
    ASSERT_FALSE(c.ok()) << bc.json;
    EXPECT_EQ(c.status().code(), bc.code) << c.status().ToString();
    EXPECT_NE(c.status().message().find(bc.message_part), std::string::npos)
        << c.status().ToString();
  }
}

TEST(ModelConfig, FromFileNamesThePath) {
  auto c = ModelConfig::FromFile("/nonexistent/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_NE(c.status().message().find("/nonexistent/config.json"), std::string::npos);
}

}  // namespace
}  // namespace kvbridge
