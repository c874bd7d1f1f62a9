#include "kvbridge/model/config.h"

#include <cmath>
#include <fstream>
#include <sstream>

namespace kvbridge {

std::string_view ModelArchName(ModelArch arch) {
  return arch == ModelArch::kQwen2 ? "qwen2" : "llama";
}

namespace {

using nlohmann::json;

Status FieldError(std::string_view field, std::string_view what) {
  return InvalidArgumentError("config.json: field '" + std::string(field) + "' " +
                              std::string(what));
}

Result<int> GetInt(const json& j, const char* field, std::optional<int> fallback) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    if (fallback) return *fallback;
    return FieldError(field, "is missing");
  }
  if (!it->is_number_integer()) return FieldError(field, "must be an integer");
  const int64_t v = it->get<int64_t>();
  if (v < INT32_MIN || v > INT32_MAX) return FieldError(field, "is out of range");
  return static_cast<int>(v);
}

Result<double> GetDouble(const json& j, const char* field, std::optional<double> fallback) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) {
    if (fallback) return *fallback;
    return FieldError(field, "is missing");
  }
  if (!it->is_number()) return FieldError(field, "must be a number");
  const double v = it->get<double>();
  if (!std::isfinite(v)) return FieldError(field, "must be finite");
  return v;
}

Result<bool> GetBool(const json& j, const char* field, bool fallback) {
  auto it = j.find(field);
  if (it == j.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return FieldError(field, "must be a boolean");
  return it->get<bool>();
}

Result<std::vector<float>> GetScales(const json& j, const char* field, int layers) {
  auto it = j.find(field);
  std::vector<float> out(static_cast<size_t>(std::max(layers, 0)), 1.0f);
  if (it == j.end() || it->is_null()) return out;
  auto check = [&](const json& v) -> Result<float> {
    if (!v.is_number()) return FieldError(field, "must hold numbers");
    const double d = v.get<double>();
    if (!(d > 0) || !std::isfinite(d) || d > 1e30) return FieldError(field, "must be > 0");
    return static_cast<float>(d);
  };
  if (it->is_array()) {
    if (static_cast<int>(it->size()) != layers) {
      return FieldError(field, "must list num_hidden_layers scales");
    }
    for (int l = 0; l < layers; ++l) {
      ASSIGN_OR_RETURN(out[l], check((*it)[l]));
    }
    return out;
  }
  ASSIGN_OR_RETURN(float s, check(*it));
  for (auto& v : out) v = s;
  return out;
}

}  // namespace

Result<ModelConfig> ModelConfig::FromJson(std::string_view json_text) {
  json j = json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return InvalidArgumentError("config.json: not valid JSON");
  if (!j.is_object()) return InvalidArgumentError("config.json: not a JSON object");
  ModelConfig c;
  std::string arch_name;
  if (auto it = j.find("architectures");
      it != j.end() && it->is_array() && !it->empty() && (*it)[0].is_string()) {
    arch_name = (*it)[0].get<std::string>();
  }
  std::string model_type;
  if (auto it = j.find("model_type"); it != j.end() && it->is_string()) {
    model_type = it->get<std::string>();
  }
  if (arch_name == "LlamaForCausalLM" || (arch_name.empty() && model_type == "llama")) {
    c.arch = ModelArch::kLlama;
  } else if (arch_name == "Qwen2ForCausalLM" || (arch_name.empty() && model_type == "qwen2")) {
    c.arch = ModelArch::kQwen2;
  } else {
    return UnimplementedError("config.json: architecture '" + arch_name + "' (model_type '" +
                              model_type +
                              "') is not supported; expected LlamaForCausalLM or Qwen2ForCausalLM");
  }
  ASSIGN_OR_RETURN(c.vocab_size, GetInt(j, "vocab_size", std::nullopt));
  ASSIGN_OR_RETURN(c.hidden_size, GetInt(j, "hidden_size", std::nullopt));
  ASSIGN_OR_RETURN(c.intermediate_size, GetInt(j, "intermediate_size", std::nullopt));
  ASSIGN_OR_RETURN(c.num_hidden_layers, GetInt(j, "num_hidden_layers", std::nullopt));
  ASSIGN_OR_RETURN(c.num_attention_heads, GetInt(j, "num_attention_heads", std::nullopt));
  ASSIGN_OR_RETURN(c.num_key_value_heads, GetInt(j, "num_key_value_heads", c.num_attention_heads));
  if (c.num_attention_heads <= 0) return FieldError("num_attention_heads", "must be > 0");
  ASSIGN_OR_RETURN(c.head_dim, GetInt(j, "head_dim", c.hidden_size / c.num_attention_heads));
  ASSIGN_OR_RETURN(c.rope_theta, GetDouble(j, "rope_theta", 10000.0));
  ASSIGN_OR_RETURN(c.max_position_embeddings, GetInt(j, "max_position_embeddings", 2048));
  ASSIGN_OR_RETURN(c.rms_norm_eps, GetDouble(j, "rms_norm_eps", 1e-6));
  ASSIGN_OR_RETURN(c.tie_word_embeddings,
                   GetBool(j, "tie_word_embeddings", c.arch == ModelArch::kQwen2 ? false : false));
  if (c.arch == ModelArch::kQwen2) {
    c.qkv_bias = true;
    c.o_bias = false;
  } else {
    ASSIGN_OR_RETURN(bool bias, GetBool(j, "attention_bias", false));
    c.qkv_bias = bias;
    c.o_bias = bias;
  }
  ASSIGN_OR_RETURN(bool mlp_bias, GetBool(j, "mlp_bias", false));
  if (mlp_bias) return UnimplementedError("config.json: mlp_bias=true is not supported");
  if (auto it = j.find("rope_scaling"); it != j.end() && !it->is_null()) {
    return UnimplementedError("config.json: rope_scaling is not supported");
  }
  ASSIGN_OR_RETURN(bool sliding, GetBool(j, "use_sliding_window", false));
  if (sliding) return UnimplementedError("config.json: use_sliding_window=true is not supported");
  if (auto it = j.find("hidden_act"); it != j.end() && !it->is_null()) {
    if (!it->is_string() || it->get<std::string>() != "silu") {
      return UnimplementedError("config.json: hidden_act must be \"silu\"");
    }
  }
  ASSIGN_OR_RETURN(c.bos_token_id, GetInt(j, "bos_token_id", -1));
  ASSIGN_OR_RETURN(c.pad_token_id, GetInt(j, "pad_token_id", -1));
  if (auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    if (it->is_number_integer()) {
      ASSIGN_OR_RETURN(int e, GetInt(j, "eos_token_id", std::nullopt));
      c.eos_token_ids.push_back(e);
    } else if (it->is_array()) {
      for (const auto& e : *it) {
        if (!e.is_number_integer()) return FieldError("eos_token_id", "must hold integers");
        const int64_t v = e.get<int64_t>();
        if (v < 0 || v > INT32_MAX) return FieldError("eos_token_id", "is out of range");
        c.eos_token_ids.push_back(static_cast<int>(v));
      }
    } else {
      return FieldError("eos_token_id", "must be an integer or a list of integers");
    }
  }
  ASSIGN_OR_RETURN(c.fp8_k_scale, GetScales(j, "kvbridge_fp8_k_scale", c.num_hidden_layers));
  ASSIGN_OR_RETURN(c.fp8_v_scale, GetScales(j, "kvbridge_fp8_v_scale", c.num_hidden_layers));
  RETURN_IF_ERROR(c.Validate());
  return c;
}

Result<ModelConfig> ModelConfig::FromFile(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError(path + ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  auto r = FromJson(ss.str());
  if (!r.ok()) return r.status().WithPrefix(path);
  return r;
}

Status ModelConfig::Validate() const {
  auto positive = [](const char* f, int v) -> Status {
    if (v <= 0) return FieldError(f, "must be > 0");
    return OkStatus();
  };
  RETURN_IF_ERROR(positive("vocab_size", vocab_size));
  RETURN_IF_ERROR(positive("hidden_size", hidden_size));
  RETURN_IF_ERROR(positive("intermediate_size", intermediate_size));
  RETURN_IF_ERROR(positive("num_hidden_layers", num_hidden_layers));
  RETURN_IF_ERROR(positive("num_attention_heads", num_attention_heads));
  RETURN_IF_ERROR(positive("num_key_value_heads", num_key_value_heads));
  RETURN_IF_ERROR(positive("head_dim", head_dim));
  RETURN_IF_ERROR(positive("max_position_embeddings", max_position_embeddings));
  // Bounds that keep every size product far from int overflow (~2^31 elements per tensor).
  if (vocab_size > (1 << 20) || hidden_size > (1 << 15) || intermediate_size > (1 << 17) ||
      num_hidden_layers > 1024 || num_attention_heads > 1024 || head_dim > 1024 ||
      max_position_embeddings > (1 << 20)) {
    return InvalidArgumentError("config.json: model dimensions are implausibly large");
  }
  if (num_attention_heads % num_key_value_heads != 0) {
    return FieldError("num_key_value_heads", "must divide num_attention_heads");
  }
  if (head_dim % 2 != 0) return FieldError("head_dim", "must be even (RoPE)");
  if (!(rope_theta > 0)) return FieldError("rope_theta", "must be > 0");
  if (!(rms_norm_eps > 0)) return FieldError("rms_norm_eps", "must be > 0");
  auto id_ok = [&](const char* f, int id) -> Status {
    if (id < -1 || id >= vocab_size) return FieldError(f, "must be < vocab_size");
    return OkStatus();
  };
  RETURN_IF_ERROR(id_ok("bos_token_id", bos_token_id));
  RETURN_IF_ERROR(id_ok("pad_token_id", pad_token_id));
  for (int e : eos_token_ids) RETURN_IF_ERROR(id_ok("eos_token_id", e));
  if (static_cast<int>(fp8_k_scale.size()) != num_hidden_layers ||
      static_cast<int>(fp8_v_scale.size()) != num_hidden_layers) {
    return InvalidArgumentError("config: fp8 scales must have num_hidden_layers entries");
  }
  return OkStatus();
}

nlohmann::json ModelConfig::ToJson(std::string_view torch_dtype) const {
  json j;
  const bool qwen = arch == ModelArch::kQwen2;
  j["architectures"] = json::array({qwen ? "Qwen2ForCausalLM" : "LlamaForCausalLM"});
  j["model_type"] = qwen ? "qwen2" : "llama";
  j["vocab_size"] = vocab_size;
  j["hidden_size"] = hidden_size;
  j["intermediate_size"] = intermediate_size;
  j["num_hidden_layers"] = num_hidden_layers;
  j["num_attention_heads"] = num_attention_heads;
  j["num_key_value_heads"] = num_key_value_heads;
  j["head_dim"] = head_dim;
  j["hidden_act"] = "silu";
  j["rope_theta"] = rope_theta;
  j["rope_scaling"] = nullptr;
  j["max_position_embeddings"] = max_position_embeddings;
  j["rms_norm_eps"] = rms_norm_eps;
  j["tie_word_embeddings"] = tie_word_embeddings;
  j["initializer_range"] = 0.02;
  j["use_cache"] = true;
  j["attention_dropout"] = 0.0;
  j["torch_dtype"] = std::string(torch_dtype);
  if (qwen) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
    j["max_window_layers"] = num_hidden_layers;
  } else {
    j["attention_bias"] = qkv_bias;
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  }
  if (bos_token_id >= 0) j["bos_token_id"] = bos_token_id;
  if (eos_token_ids.size() == 1) {
    j["eos_token_id"] = eos_token_ids[0];
  } else if (!eos_token_ids.empty()) {
    j["eos_token_id"] = eos_token_ids;
  }
  if (pad_token_id >= 0) j["pad_token_id"] = pad_token_id;
  auto scales = [](const std::vector<float>& s) -> json {
    bool all_one = true;
    for (float v : s) all_one = all_one && v == 1.0f;
    if (all_one) return nullptr;
    return json(s);
  };
  if (json k = scales(fp8_k_scale); !k.is_null()) j["kvbridge_fp8_k_scale"] = k;
  if (json v = scales(fp8_v_scale); !v.is_null()) j["kvbridge_fp8_v_scale"] = v;
  return j;
}

}  // namespace kvbridge
