#include "kvbridge/model/config.h"

#include <algorithm>
#include <cmath>
#include <fstream>
#include <optional>
#include <sstream>

namespace kvbridge {

std::string_view ModelArchName(ModelArch arch) {
  switch (arch) {
    case ModelArch::kLlama:
      return "llama";
    case ModelArch::kQwen2:
      return "qwen2";
    case ModelArch::kQwen3:
      return "qwen3";
    case ModelArch::kMistral:
      return "mistral";
  }
  return "llama";
}

Result<ModelArch> ParseModelArch(std::string_view name) {
  for (ModelArch a :
       {ModelArch::kLlama, ModelArch::kQwen2, ModelArch::kQwen3, ModelArch::kMistral}) {
    if (ModelArchName(a) == name) return a;
  }
  return InvalidArgumentError("unknown architecture '" + std::string(name) +
                              "' (expected llama, qwen2, qwen3 or mistral)");
}

std::string_view RopeTypeName(RopeType type) {
  switch (type) {
    case RopeType::kDefault:
      return "default";
    case RopeType::kLinear:
      return "linear";
    case RopeType::kDynamic:
      return "dynamic";
    case RopeType::kYarn:
      return "yarn";
    case RopeType::kLlama3:
      return "llama3";
  }
  return "default";
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

const char* ArchClassName(ModelArch arch) {
  switch (arch) {
    case ModelArch::kLlama:
      return "LlamaForCausalLM";
    case ModelArch::kQwen2:
      return "Qwen2ForCausalLM";
    case ModelArch::kQwen3:
      return "Qwen3ForCausalLM";
    case ModelArch::kMistral:
      return "MistralForCausalLM";
  }
  return "LlamaForCausalLM";
}

// The RoPE parameters: `rope_scaling` (HF 4.x) or `rope_parameters` (HF 5.x, where rope_theta
// moved inside); transformers gives `rope_scaling` priority. Keys a type does not use are
// refused by name, as are rope types we do not implement.
Status ParseRope(const json& j, ModelConfig* c) {
  const json* rope = nullptr;
  const char* where = "rope_scaling";
  // (transformers: `rope_scaling or rope_parameters`, so an empty rope_scaling does not count)
  if (auto it = j.find("rope_scaling");
      it != j.end() && !it->is_null() && !(it->is_object() && it->empty())) {
    rope = &*it;
  } else if (auto it2 = j.find("rope_parameters"); it2 != j.end() && !it2->is_null()) {
    rope = &*it2;
    where = "rope_parameters";
  }
  ASSIGN_OR_RETURN(c->rope_theta, GetDouble(j, "rope_theta", 10000.0));
  if (auto it = j.find("partial_rotary_factor"); it != j.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() != 1.0) {
      return UnimplementedError("config.json: partial_rotary_factor != 1 is not supported");
    }
  }
  if (rope == nullptr) return OkStatus();
  if (!rope->is_object()) return FieldError(where, "must be an object or null");
  const json& r = *rope;
  std::string type = "default";
  for (const char* key : {"type", "rope_type"}) {  // rope_type wins over the legacy type
    if (auto it = r.find(key); it != r.end() && !it->is_null()) {
      if (!it->is_string()) return FieldError(std::string(where) + "." + key, "must be a string");
      type = it->get<std::string>();
    }
  }
  RopeScaling& s = c->rope_scaling;
  std::vector<std::string> allowed = {"type", "rope_type", "rope_theta", "partial_rotary_factor"};
  if (type == "default") {
    s.type = RopeType::kDefault;
  } else if (type == "linear") {
    s.type = RopeType::kLinear;
    allowed.insert(allowed.end(), {"factor"});
  } else if (type == "dynamic") {
    s.type = RopeType::kDynamic;
    allowed.insert(allowed.end(), {"factor"});
  } else if (type == "yarn") {
    s.type = RopeType::kYarn;
    allowed.insert(allowed.end(),
                   {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast",
                    "beta_slow", "mscale", "mscale_all_dim", "truncate"});
  } else if (type == "llama3") {
    s.type = RopeType::kLlama3;
    allowed.insert(allowed.end(), {"factor", "original_max_position_embeddings", "low_freq_factor",
                                   "high_freq_factor"});
  } else {
    return UnimplementedError("config.json: " + std::string(where) + " type '" + type +
                              "' is not supported (supported: default, linear, dynamic, yarn, "
                              "llama3)");
  }
  for (const auto& [key, value] : r.items()) {
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end()) {
      return UnimplementedError("config.json: " + std::string(where) + " key '" + key +
                                "' is not supported for rope type '" + type + "'");
    }
  }
  auto field = [&](const char* key) { return std::string(where) + "." + key; };
  auto number = [&](const char* key, std::optional<double> fallback) -> Result<double> {
    auto it = r.find(key);
    if (it == r.end() || it->is_null()) {
      if (fallback) return *fallback;
      return FieldError(field(key), "is missing");
    }
    if (!it->is_number()) return FieldError(field(key), "must be a number");
    const double v = it->get<double>();
    if (!std::isfinite(v)) return FieldError(field(key), "must be finite");
    return v;
  };
  if (auto it = r.find("rope_theta"); it != r.end() && !it->is_null()) {
    ASSIGN_OR_RETURN(c->rope_theta, number("rope_theta", std::nullopt));
  }
  if (auto it = r.find("partial_rotary_factor"); it != r.end() && !it->is_null()) {
    if (!it->is_number() || it->get<double>() != 1.0) {
      return UnimplementedError("config.json: " + field("partial_rotary_factor") +
                                " != 1 is not supported");
    }
  }
  if (s.type == RopeType::kDefault) return OkStatus();
  ASSIGN_OR_RETURN(s.factor, number("factor", std::nullopt));
  if (s.type == RopeType::kLlama3 || s.type == RopeType::kYarn) {
    // transformers (standardize_rope_params): a top-level original_max_position_embeddings
    // (Phi-3 style) wins; else the rope key; else max_position_embeddings.
    double orig = 0;
    if (auto top = j.find("original_max_position_embeddings"); top != j.end() && !top->is_null()) {
      ASSIGN_OR_RETURN(int o, GetInt(j, "original_max_position_embeddings", std::nullopt));
      orig = o;
    } else {
      ASSIGN_OR_RETURN(orig, number("original_max_position_embeddings",
                                    static_cast<double>(c->max_position_embeddings)));
    }
    if (orig != std::floor(orig) || orig < 1 || orig > (1 << 24)) {
      return FieldError(field("original_max_position_embeddings"), "must be a positive integer");
    }
    s.original_max_position_embeddings = static_cast<int>(orig);
  }
  if (s.type == RopeType::kLlama3) {
    ASSIGN_OR_RETURN(s.low_freq_factor, number("low_freq_factor", std::nullopt));
    ASSIGN_OR_RETURN(s.high_freq_factor, number("high_freq_factor", std::nullopt));
  }
  if (s.type == RopeType::kYarn) {
    // transformers: `get("beta_fast") or 32` (a 0 means the default too).
    ASSIGN_OR_RETURN(s.beta_fast, number("beta_fast", 32.0));
    if (s.beta_fast == 0) s.beta_fast = 32.0;
    ASSIGN_OR_RETURN(s.beta_slow, number("beta_slow", 1.0));
    if (s.beta_slow == 0) s.beta_slow = 1.0;
    ASSIGN_OR_RETURN(s.mscale, number("mscale", 0.0));
    ASSIGN_OR_RETURN(s.mscale_all_dim, number("mscale_all_dim", 0.0));
    if (auto it = r.find("attention_factor"); it != r.end() && !it->is_null()) {
      ASSIGN_OR_RETURN(s.attention_factor, number("attention_factor", std::nullopt));
      if (!(s.attention_factor > 0)) return FieldError(field("attention_factor"), "must be > 0");
    }
    if (auto it = r.find("truncate"); it != r.end() && !it->is_null()) {
      if (!it->is_boolean()) return FieldError(field("truncate"), "must be a boolean");
      s.truncate = it->get<bool>();
    }
  }
  return OkStatus();
}

// Sliding-window attention is not implemented; refused where it would change a result, i.e.
// where a window shorter than max_position_embeddings applies to some layer.
Status CheckSlidingWindow(const json& j, const ModelConfig& c) {
  int window = 0;  // 0: none
  if (auto it = j.find("sliding_window"); it != j.end() && !it->is_null()) {
    ASSIGN_OR_RETURN(window, GetInt(j, "sliding_window", std::nullopt));
  }
  const bool short_window = window > 0 && window < c.max_position_embeddings;
  const std::string detail = "sliding_window " + std::to_string(window) +
                             " < max_position_embeddings " +
                             std::to_string(c.max_position_embeddings);
  if (c.arch == ModelArch::kQwen2 || c.arch == ModelArch::kQwen3) {
    ASSIGN_OR_RETURN(bool sliding, GetBool(j, "use_sliding_window", false));
    if (sliding && (window == 0 || short_window)) {
      return UnimplementedError(
          "config.json: use_sliding_window=true is not supported (sliding-window attention is "
          "not implemented" +
          (short_window ? ": " + detail + ")" : ")"));
    }
  } else if (c.arch == ModelArch::kMistral && short_window) {
    return UnimplementedError(
        "config.json: " + detail +
        " is not supported (sliding-window attention is not implemented; positions beyond the "
        "window would attend differently). Set max_position_embeddings <= sliding_window in "
        "config.json to serve this model up to the window");
  }
  if (auto it = j.find("layer_types"); it != j.end() && !it->is_null()) {
    if (!it->is_array()) return FieldError("layer_types", "must be a list");
    for (const auto& t : *it) {
      if (!t.is_string() || t.get<std::string>() != "full_attention") {
        return UnimplementedError("config.json: layer_types entry " + t.dump() +
                                  " is not supported (only full_attention)");
      }
    }
  }
  return OkStatus();
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
  bool known = false;
  for (ModelArch a :
       {ModelArch::kLlama, ModelArch::kQwen2, ModelArch::kQwen3, ModelArch::kMistral}) {
    if (arch_name == ArchClassName(a) || (arch_name.empty() && model_type == ModelArchName(a))) {
      c.arch = a;
      known = true;
    }
  }
  if (!known) {
    return UnimplementedError("config.json: architecture '" + arch_name + "' (model_type '" +
                              model_type +
                              "') is not supported; expected LlamaForCausalLM, "
                              "MistralForCausalLM, Qwen2ForCausalLM or Qwen3ForCausalLM");
  }
  ASSIGN_OR_RETURN(c.vocab_size, GetInt(j, "vocab_size", std::nullopt));
  ASSIGN_OR_RETURN(c.hidden_size, GetInt(j, "hidden_size", std::nullopt));
  ASSIGN_OR_RETURN(c.intermediate_size, GetInt(j, "intermediate_size", std::nullopt));
  ASSIGN_OR_RETURN(c.num_hidden_layers, GetInt(j, "num_hidden_layers", std::nullopt));
  ASSIGN_OR_RETURN(c.num_attention_heads, GetInt(j, "num_attention_heads", std::nullopt));
  ASSIGN_OR_RETURN(c.num_key_value_heads, GetInt(j, "num_key_value_heads", c.num_attention_heads));
  if (c.num_attention_heads <= 0) return FieldError("num_attention_heads", "must be > 0");
  ASSIGN_OR_RETURN(c.head_dim, GetInt(j, "head_dim", c.hidden_size / c.num_attention_heads));
  ASSIGN_OR_RETURN(c.max_position_embeddings, GetInt(j, "max_position_embeddings", 2048));
  RETURN_IF_ERROR(ParseRope(j, &c));
  ASSIGN_OR_RETURN(c.rms_norm_eps, GetDouble(j, "rms_norm_eps", 1e-6));
  ASSIGN_OR_RETURN(c.tie_word_embeddings, GetBool(j, "tie_word_embeddings", false));
  switch (c.arch) {
    case ModelArch::kQwen2:  // q/k/v bias always, o_proj none (Qwen2Attention)
      c.qkv_bias = true;
      c.o_bias = false;
      break;
    case ModelArch::kMistral:  // no bias anywhere (MistralAttention ignores attention_bias)
      c.qkv_bias = false;
      c.o_bias = false;
      break;
    case ModelArch::kLlama:
    case ModelArch::kQwen3: {
      ASSIGN_OR_RETURN(bool bias, GetBool(j, "attention_bias", false));
      c.qkv_bias = bias;
      c.o_bias = bias;
      break;
    }
  }
  c.qk_norm = c.arch == ModelArch::kQwen3;
  ASSIGN_OR_RETURN(bool mlp_bias, GetBool(j, "mlp_bias", false));
  if (mlp_bias) return UnimplementedError("config.json: mlp_bias=true is not supported");
  RETURN_IF_ERROR(CheckSlidingWindow(j, c));
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
  const RopeScaling& rs = rope_scaling;
  if (rs.type != RopeType::kDefault) {
    if (!(rs.factor > 0) || rs.factor > 1e6) {
      return FieldError("rope_scaling.factor", "must be in (0, 1e6]");
    }
  }
  if (rs.type == RopeType::kLlama3 || rs.type == RopeType::kYarn) {
    if (rs.original_max_position_embeddings <= 0) {
      return FieldError("rope_scaling.original_max_position_embeddings", "must be > 0");
    }
  }
  if (rs.type == RopeType::kLlama3 &&
      !(rs.low_freq_factor > 0 && rs.high_freq_factor > rs.low_freq_factor)) {
    return FieldError("rope_scaling", "needs 0 < low_freq_factor < high_freq_factor");
  }
  if (rs.type == RopeType::kYarn &&
      !(rs.beta_fast > 0 && rs.beta_slow > 0 && rs.attention_factor >= 0)) {
    return FieldError("rope_scaling", "needs beta_fast > 0, beta_slow > 0, attention_factor > 0");
  }
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
  const bool qwen = arch == ModelArch::kQwen2 || arch == ModelArch::kQwen3;
  j["architectures"] = json::array({ArchClassName(arch)});
  j["model_type"] = std::string(ModelArchName(arch));
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
  const RopeScaling& rs = rope_scaling;
  if (rs.type != RopeType::kDefault) {
    json r;
    r["rope_type"] = std::string(RopeTypeName(rs.type));
    r["factor"] = rs.factor;
    if (rs.type == RopeType::kLlama3 || rs.type == RopeType::kYarn) {
      r["original_max_position_embeddings"] = rs.original_max_position_embeddings;
    }
    if (rs.type == RopeType::kLlama3) {
      r["low_freq_factor"] = rs.low_freq_factor;
      r["high_freq_factor"] = rs.high_freq_factor;
    }
    if (rs.type == RopeType::kYarn) {
      r["beta_fast"] = rs.beta_fast;
      r["beta_slow"] = rs.beta_slow;
      if (rs.attention_factor > 0) r["attention_factor"] = rs.attention_factor;
      if (rs.mscale != 0) r["mscale"] = rs.mscale;
      if (rs.mscale_all_dim != 0) r["mscale_all_dim"] = rs.mscale_all_dim;
      if (!rs.truncate) r["truncate"] = false;
    }
    j["rope_scaling"] = r;
  }
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
    if (arch == ModelArch::kQwen3) j["attention_bias"] = qkv_bias;
  } else if (arch == ModelArch::kMistral) {
    j["sliding_window"] = nullptr;
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
