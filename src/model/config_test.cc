#include "kvbridge/model/config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "kvbridge/model/generation_config.h"

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
          "rope_scaling": {"type": "longrope", "factor": 2.0}})",
       StatusCode::kUnimplemented, "rope_scaling type 'longrope' is not supported"},
      {R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "rope_scaling": {"type": "linear", "factor": 2.0, "mrope_section": [2, 2]}})",
       StatusCode::kUnimplemented, "rope_scaling key 'mrope_section' is not supported"},
      {R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "rope_scaling": {"rope_type": "linear"}})",
       StatusCode::kInvalidArgument, "'rope_scaling.factor' is missing"},
      {R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "rope_scaling": {"rope_type": "llama3", "factor": 8, "high_freq_factor": 4,
                           "original_max_position_embeddings": 64}})",
       StatusCode::kInvalidArgument, "'rope_scaling.low_freq_factor' is missing"},
      {R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "rope_scaling": {"rope_type": "llama3", "factor": 8, "low_freq_factor": 4,
                           "high_freq_factor": 1, "original_max_position_embeddings": 64}})",
       StatusCode::kInvalidArgument, "low_freq_factor < high_freq_factor"},
      {R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "rope_scaling": "linear"})",
       StatusCode::kInvalidArgument, "'rope_scaling' must be an object"},
      {R"({"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "partial_rotary_factor": 0.5})",
       StatusCode::kUnimplemented, "partial_rotary_factor"},
      {R"({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}})",
       StatusCode::kUnimplemented, "rope_parameters.partial_rotary_factor"},
      {R"({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 4,
          "layer_types": ["full_attention", "sliding_attention"]})",
       StatusCode::kUnimplemented, "layer_types entry \"sliding_attention\""},
      {R"({"architectures": ["MistralForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "max_position_embeddings": 32768, "sliding_window": 4096})",
       StatusCode::kUnimplemented,
       "sliding_window 4096 < max_position_embeddings 32768 is not supported"},
      {R"({"architectures": ["Qwen3ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
          "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
          "max_position_embeddings": 4096, "use_sliding_window": true, "sliding_window": 1024})",
       StatusCode::kUnimplemented, "sliding_window 1024 < max_position_embeddings 4096"},
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

// Llama-3.2-1B-Instruct's config.json (rope_scaling llama3), as published.
constexpr const char* kLlama32 = R"({
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "head_dim": 64,
  "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
  "intermediate_size": 8192, "max_position_embeddings": 131072, "mlp_bias": false,
  "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 16,
  "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
  "rope_scaling": {"factor": 32.0, "high_freq_factor": 4.0, "low_freq_factor": 1.0,
                   "original_max_position_embeddings": 8192, "rope_type": "llama3"},
  "rope_theta": 500000.0, "tie_word_embeddings": true, "torch_dtype": "bfloat16",
  "transformers_version": "4.45.0.dev0", "use_cache": true, "vocab_size": 128256
})";

TEST(ModelConfig, ParsesLlama3RopeScaling) {
  auto c = ModelConfig::FromJson(kLlama32);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->rope_theta, 500000.0);
  EXPECT_EQ(c->rope_scaling.type, RopeType::kLlama3);
  EXPECT_EQ(c->rope_scaling.factor, 32.0);
  EXPECT_EQ(c->rope_scaling.low_freq_factor, 1.0);
  EXPECT_EQ(c->rope_scaling.high_freq_factor, 4.0);
  EXPECT_EQ(c->rope_scaling.original_max_position_embeddings, 8192);
  EXPECT_TRUE(c->tie_word_embeddings);
  EXPECT_EQ(c->eos_token_ids, (std::vector<int>{128001, 128008, 128009}));
  auto again = ModelConfig::FromJson(c->ToJson().dump());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->ToJson().dump(), c->ToJson().dump());
  EXPECT_EQ(c->ToJson()["rope_scaling"]["rope_type"], "llama3");
}

// Qwen3-0.6B's config.json, as published.
constexpr const char* kQwen3 = R"({
  "architectures": ["Qwen3ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
  "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 3072,
  "max_position_embeddings": 40960, "max_window_layers": 28, "model_type": "qwen3",
  "num_attention_heads": 16, "num_hidden_layers": 28, "num_key_value_heads": 8,
  "rms_norm_eps": 1e-06, "rope_scaling": null, "rope_theta": 1000000, "sliding_window": null,
  "tie_word_embeddings": true, "torch_dtype": "bfloat16", "transformers_version": "4.51.0",
  "use_cache": true, "use_sliding_window": false, "vocab_size": 151936
})";

TEST(ModelConfig, ParsesQwen3WithQkNormAndExplicitHeadDim) {
  auto c = ModelConfig::FromJson(kQwen3);
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->arch, ModelArch::kQwen3);
  EXPECT_TRUE(c->qk_norm);
  EXPECT_FALSE(c->qkv_bias);
  EXPECT_FALSE(c->o_bias);
  EXPECT_EQ(c->head_dim, 128);
  EXPECT_EQ(c->q_dim(), 2048);  // != hidden_size
  EXPECT_EQ(c->kv_dim(), 1024);
  EXPECT_EQ(c->rope_theta, 1e6);
  EXPECT_EQ(c->rope_scaling.type, RopeType::kDefault);
  EXPECT_EQ(c->rms_norm_eps, 1e-6);
  auto again = ModelConfig::FromJson(c->ToJson().dump());
  ASSERT_TRUE(again.ok()) << again.status().ToString();
  EXPECT_EQ(again->ToJson().dump(), c->ToJson().dump());
  EXPECT_EQ(c->ToJson()["architectures"][0], "Qwen3ForCausalLM");
  // Qwen3 with attention_bias: bias on q/k/v and o (Qwen3Attention).
  auto biased = ModelConfig::FromJson(R"({"architectures": ["Qwen3ForCausalLM"],
    "vocab_size": 300, "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 4, "attention_bias": true})");
  ASSERT_TRUE(biased.ok()) << biased.status().ToString();
  EXPECT_TRUE(biased->qkv_bias);
  EXPECT_TRUE(biased->o_bias);
}

TEST(ModelConfig, ParsesMistralAndAcceptsAWindowThatCannotMatter) {
  // Mistral-7B-v0.3 style: no window.
  auto c = ModelConfig::FromJson(R"({"architectures": ["MistralForCausalLM"],
    "model_type": "mistral", "vocab_size": 300, "hidden_size": 64, "intermediate_size": 8,
    "num_hidden_layers": 1, "num_attention_heads": 4, "num_key_value_heads": 1,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "sliding_window": null,
    "attention_bias": true})");
  ASSERT_TRUE(c.ok()) << c.status().ToString();
  EXPECT_EQ(c->arch, ModelArch::kMistral);
  EXPECT_FALSE(c->qkv_bias);  // MistralAttention has no bias whatever attention_bias says
  EXPECT_FALSE(c->qk_norm);
  EXPECT_EQ(c->ToJson()["architectures"][0], "MistralForCausalLM");
  EXPECT_TRUE(c->ToJson()["sliding_window"].is_null());
  // A window at least as long as the context never drops a position.
  auto w = ModelConfig::FromJson(R"({"architectures": ["MistralForCausalLM"],
    "vocab_size": 300, "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1,
    "num_attention_heads": 4, "max_position_embeddings": 4096, "sliding_window": 4096})");
  ASSERT_TRUE(w.ok()) << w.status().ToString();
}

TEST(ModelConfig, ParsesEveryRopeType) {
  const std::string base = R"("architectures": ["LlamaForCausalLM"], "vocab_size": 300,
    "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1, "num_attention_heads": 4,
    "max_position_embeddings": 512, )";
  // Legacy "type" key.
  auto lin =
      ModelConfig::FromJson("{" + base + R"("rope_scaling": {"type": "linear", "factor": 4}})");
  ASSERT_TRUE(lin.ok()) << lin.status().ToString();
  EXPECT_EQ(lin->rope_scaling.type, RopeType::kLinear);
  EXPECT_EQ(lin->rope_scaling.factor, 4.0);
  // transformers 5 form: rope_parameters with rope_theta inside (wins over the top level).
  auto dyn = ModelConfig::FromJson("{" + base + R"("rope_theta": 1.0, "rope_parameters":
    {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 20000.0}})");
  ASSERT_TRUE(dyn.ok()) << dyn.status().ToString();
  EXPECT_EQ(dyn->rope_scaling.type, RopeType::kDynamic);
  EXPECT_EQ(dyn->rope_theta, 20000.0);
  // rope_type wins over type; yarn's optional keys; original defaults to max positions.
  auto yarn = ModelConfig::FromJson("{" + base + R"("rope_scaling": {"type": "linear",
    "rope_type": "yarn", "factor": 8, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0,
    "mscale_all_dim": 0.5, "truncate": false}})");
  ASSERT_TRUE(yarn.ok()) << yarn.status().ToString();
  const RopeScaling& y = yarn->rope_scaling;
  EXPECT_EQ(y.type, RopeType::kYarn);
  EXPECT_EQ(y.original_max_position_embeddings, 512);
  EXPECT_EQ(y.beta_fast, 16.0);
  EXPECT_EQ(y.beta_slow, 2.0);
  EXPECT_EQ(y.mscale, 1.0);
  EXPECT_EQ(y.mscale_all_dim, 0.5);
  EXPECT_FALSE(y.truncate);
  EXPECT_EQ(y.attention_factor, 0.0);  // derived
  auto yarn_af = ModelConfig::FromJson("{" + base + R"("rope_scaling": {"rope_type": "yarn",
    "factor": 4, "original_max_position_embeddings": 128, "attention_factor": 1.5}})");
  ASSERT_TRUE(yarn_af.ok()) << yarn_af.status().ToString();
  EXPECT_EQ(yarn_af->rope_scaling.attention_factor, 1.5);
  EXPECT_EQ(yarn_af->rope_scaling.original_max_position_embeddings, 128);
  // llama3 without original_max_position_embeddings: max_position_embeddings (transformers).
  auto l3 = ModelConfig::FromJson("{" + base + R"("rope_scaling": {"rope_type": "llama3",
    "factor": 8, "low_freq_factor": 1, "high_freq_factor": 4}})");
  ASSERT_TRUE(l3.ok()) << l3.status().ToString();
  EXPECT_EQ(l3->rope_scaling.original_max_position_embeddings, 512);
  auto dflt = ModelConfig::FromJson("{" + base + R"("rope_scaling": {"rope_type": "default"}})");
  ASSERT_TRUE(dflt.ok()) << dflt.status().ToString();
  EXPECT_EQ(dflt->rope_scaling.type, RopeType::kDefault);
  for (const auto* c : {&*lin, &*dyn, &*yarn, &*yarn_af}) {
    auto again = ModelConfig::FromJson(c->ToJson().dump());
    ASSERT_TRUE(again.ok()) << again.status().ToString();
    EXPECT_EQ(again->ToJson().dump(), c->ToJson().dump());
  }
}

TEST(ModelConfig, ArchNamesRoundTrip) {
  for (ModelArch a :
       {ModelArch::kLlama, ModelArch::kQwen2, ModelArch::kQwen3, ModelArch::kMistral}) {
    auto parsed = ParseModelArch(ModelArchName(a));
    ASSERT_TRUE(parsed.ok());
    EXPECT_EQ(*parsed, a);
  }
  EXPECT_EQ(ParseModelArch("gpt2").status().code(), StatusCode::kInvalidArgument);
}

TEST(ModelConfig, FromFileNamesThePath) {
  auto c = ModelConfig::FromFile("/nonexistent/config.json");
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.status().code(), StatusCode::kNotFound);
  EXPECT_NE(c.status().message().find("/nonexistent/config.json"), std::string::npos);
}

}  // namespace
}  // namespace kvbridge

// generation_config.json as vLLM reads it (LoadGenerationConfig).
namespace kvbridge {
namespace {

TEST(GenerationConfig, EosIdsAndDiffDefaultsAsVllm) {
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("kvb_gencfg_" + std::to_string(::getpid()));
  fs::create_directories(dir / "other");
  auto write = [](const fs::path& p, const std::string& text) {
    std::ofstream(p, std::ios::trunc) << text;
  };
  // No file: nothing, in every mode but a directory.
  auto none = LoadGenerationConfig(dir.string(), "auto");
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_FALSE(none->eos_token_ids);
  EXPECT_TRUE(none->defaults.empty());
  EXPECT_EQ(none->path, "");
  auto missing = LoadGenerationConfig(dir.string(), (dir / "nowhere").string());
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("nowhere"), std::string::npos);

  // Qwen3's: values equal to GenerationConfig()'s defaults (top_k 50 here) are no defaults.
  write(dir / "generation_config.json",
        R"({"bos_token_id": 151643, "do_sample": true, "eos_token_id": [151645, 151643],
            "pad_token_id": 151643, "temperature": 0.6, "top_k": 50, "top_p": 0.95,
            "max_new_tokens": 64, "transformers_version": "4.51.0"})");
  auto q = LoadGenerationConfig(dir.string(), "");
  ASSERT_TRUE(q.ok()) << q.status().ToString();
  EXPECT_EQ(*q->eos_token_ids, (std::vector<int32_t>{151645, 151643}));
  EXPECT_EQ(q->defaults.temperature, 0.6);
  EXPECT_EQ(q->defaults.top_p, 0.95);
  EXPECT_FALSE(q->defaults.top_k);
  EXPECT_EQ(q->defaults.max_tokens, 64);
  EXPECT_FALSE(q->defaults.repetition_penalty);
  EXPECT_EQ(q->defaults.ToString(), R"({"max_tokens":64,"temperature":0.6,"top_p":0.95})");
  // vllm: the same EOS ids, no sampling defaults.
  auto v = LoadGenerationConfig(dir.string(), "vllm");
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(*v->eos_token_ids, (std::vector<int32_t>{151645, 151643}));
  EXPECT_TRUE(v->defaults.empty());
  // A directory: its file instead; a single eos id.
  write(dir / "other" / "generation_config.json",
        R"({"eos_token_id": 7, "top_k": 20, "temperature": 1.0, "repetition_penalty": 1.05})");
  auto o = LoadGenerationConfig(dir.string(), (dir / "other").string());
  ASSERT_TRUE(o.ok()) << o.status().ToString();
  EXPECT_EQ(*o->eos_token_ids, (std::vector<int32_t>{7}));
  EXPECT_EQ(o->defaults.top_k, 20);
  EXPECT_FALSE(o->defaults.temperature);
  EXPECT_EQ(o->defaults.repetition_penalty, 1.05);

  // Bad files name the file and the key.
  for (const char* bad : {R"({"eos_token_id": "x"})", R"({"eos_token_id": [1, -2]})",
                          R"({"temperature": "hot"})", R"({"top_k": 1.5})", R"([1])", "{"}) {
    write(dir / "generation_config.json", bad);
    auto r = LoadGenerationConfig(dir.string(), "auto");
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(r.status().message().find("generation_config.json"), std::string::npos) << bad;
  }
  write(dir / "generation_config.json", R"({"top_p": "x"})");
  EXPECT_NE(LoadGenerationConfig(dir.string(), "vllm").status().message().find("'top_p'"),
            std::string::npos);
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvbridge
