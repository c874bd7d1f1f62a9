// kvbridge/model/config.h — the model's shape, parsed from a Hugging Face `config.json`.
//
// Supports the Llama family as Hugging Face writes it: `LlamaForCausalLM` (optional
// `attention_bias` on q/k/v/o) and `Qwen2ForCausalLM` (bias on q/k/v, often tied embeddings).
//
//   ASSIGN_OR_RETURN(ModelConfig cfg, ModelConfig::FromFile(dir + "/config.json"));
//   int q_dim = cfg.num_attention_heads * cfg.head_dim;
//
// Thread-safety: a value type.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge {

enum class ModelArch : uint8_t { kLlama = 0, kQwen2 = 1 };

/// "llama" | "qwen2".
std::string_view ModelArchName(ModelArch arch);

struct ModelConfig {
  ModelArch arch = ModelArch::kLlama;
  int vocab_size = 0;
  int hidden_size = 0;
  int intermediate_size = 0;
  int num_hidden_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;  ///< defaults to num_attention_heads when absent
  int head_dim = 0;             ///< defaults to hidden_size / num_attention_heads when absent
  double rope_theta = 10000.0;
  int max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;           ///< q/k/v projections carry a bias (Qwen2; Llama attention_bias)
  bool o_bias = false;             ///< o_proj carries a bias (Llama attention_bias only)
  int bos_token_id = -1;           ///< -1: none
  std::vector<int> eos_token_ids;  ///< config's eos_token_id (int or list); may be empty
  int pad_token_id = -1;           ///< -1: none
  /// fp8 KV scales (DESIGN.md "The KV cache"): stored value = value / scale. One K and one V
  /// scale per layer; read from the optional config.json keys `kvbridge_fp8_k_scale` /
  /// `kvbridge_fp8_v_scale` (a number for every layer, or a list of num_hidden_layers numbers),
  /// default 1.0 (deterministic: never calibrated at run time).
  std::vector<float> fp8_k_scale;
  std::vector<float> fp8_v_scale;

  /// Parses config.json text. Errors: InvalidArgument naming the field (missing, wrong type,
  /// out of range), Unimplemented for architectures/features we do not support (rope_scaling,
  /// sliding window, mlp_bias, an activation other than silu).
  static Result<ModelConfig> FromJson(std::string_view json_text);
  /// Reads and parses a file; NotFound when it cannot be read. Messages start with the path.
  static Result<ModelConfig> FromFile(const std::string& path);

  /// An HF-valid config.json object (architectures, model_type, torch_dtype, ...).
  /// `torch_dtype` is the dtype the weights are stored in ("bfloat16" | "float32").
  nlohmann::json ToJson(std::string_view torch_dtype = "bfloat16") const;

  /// Checks internal consistency (positive sizes, heads divide, ids < vocab). Called by FromJson.
  Status Validate() const;

  int q_dim() const { return num_attention_heads * head_dim; }
  int kv_dim() const { return num_key_value_heads * head_dim; }
};

}  // namespace kvbridge
