// kvbridge/model/config.h — the model's shape, parsed from a Hugging Face `config.json`.
//
// Supports the Llama family as Hugging Face writes it: `LlamaForCausalLM` (optional
// `attention_bias` on q/k/v/o), `MistralForCausalLM` (Llama layout; a sliding window only where
// it cannot matter), `Qwen2ForCausalLM` (bias on q/k/v, often tied embeddings) and
// `Qwen3ForCausalLM` (per-head RMSNorm of q and k before RoPE, explicit head_dim), with RoPE
// "default", "linear", "dynamic", "yarn" and "llama3" (`rope_scaling` or `rope_parameters`).
// Every config.json field that would change the math and is not implemented is refused by name
// (docs/model.md "Supported checkpoints").
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

enum class ModelArch : uint8_t { kLlama = 0, kQwen2 = 1, kQwen3 = 2, kMistral = 3 };

/// "llama" | "qwen2" | "qwen3" | "mistral" (the HF model_type).
std::string_view ModelArchName(ModelArch arch);
/// The inverse of ModelArchName; InvalidArgument for any other name.
Result<ModelArch> ParseModelArch(std::string_view name);

/// The RoPE variant (HF `rope_type`; legacy key `type`). Frequencies follow transformers'
/// modeling_rope_utils; docs/model.md "RoPE" states each formula.
enum class RopeType : uint8_t { kDefault = 0, kLinear, kDynamic, kYarn, kLlama3 };
/// "default" | "linear" | "dynamic" | "yarn" | "llama3".
std::string_view RopeTypeName(RopeType type);

struct RopeScaling {
  RopeType type = RopeType::kDefault;
  double factor = 1.0;  ///< linear, dynamic, yarn, llama3 (>= 1)
  /// llama3 and yarn: the pretraining context (defaults to max_position_embeddings).
  int original_max_position_embeddings = 0;
  double low_freq_factor = 1.0;   ///< llama3
  double high_freq_factor = 4.0;  ///< llama3 (> low_freq_factor)
  double beta_fast = 32.0;        ///< yarn
  double beta_slow = 1.0;         ///< yarn
  /// yarn: the factor cos/sin are multiplied by; 0 = derived from factor (and mscale,
  /// mscale_all_dim) as transformers does.
  double attention_factor = 0.0;
  double mscale = 0.0;          ///< yarn, 0 = absent
  double mscale_all_dim = 0.0;  ///< yarn, 0 = absent
  bool truncate = true;         ///< yarn: floor/ceil the correction range
};

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
  RopeScaling rope_scaling;  ///< type kDefault when config.json has none
  int max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;  ///< q/k/v projections carry a bias (Qwen2; Llama attention_bias)
  bool o_bias = false;    ///< o_proj carries a bias (Llama/Qwen3 attention_bias)
  /// Qwen3: q and k are RMSNorm'ed per head (weights [head_dim], eps rms_norm_eps) before RoPE.
  bool qk_norm = false;
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
  /// out of range), Unimplemented naming the architecture or field we do not support (an
  /// unknown rope type or rope key, partial_rotary_factor != 1, a sliding window shorter than
  /// max_position_embeddings, layer_types other than full_attention, mlp_bias, an activation
  /// other than silu).
  static Result<ModelConfig> FromJson(std::string_view json_text);
  /// Reads and parses a file; NotFound when it cannot be read. Messages start with the path.
  static Result<ModelConfig> FromFile(const std::string& path);

  /// An HF-valid config.json object (architectures, model_type, torch_dtype, ...).
  /// `torch_dtype` is the dtype the weights are stored in ("bfloat16" | "float32").
  nlohmann::json ToJson(std::string_view torch_dtype = "bfloat16") const;

  /// Checks internal consistency (positive sizes, heads divide, ids < vocab, RoPE parameters in
  /// range). Called by FromJson.
  Status Validate() const;

  int q_dim() const { return num_attention_heads * head_dim; }
  int kv_dim() const { return num_key_value_heads * head_dim; }
};

}  // namespace kvbridge
