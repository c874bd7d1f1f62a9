#include "kvbridge/model/generation_config.h"

#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

namespace kvbridge {

namespace {

using nlohmann::json;

Status KeyError(const std::string& path, const std::string& key, const std::string& what) {
  return InvalidArgumentError(path + ": '" + key + "' " + what);
}

// A number key of the file; `dflt` is transformers' GenerationConfig() default (a value equal
// to it is not in to_diff_dict(), so it is no default here either).
Status ReadNumber(const json& j, const std::string& path, const char* key,
                  std::optional<double> dflt, std::optional<double>* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return OkStatus();
  if (!it->is_number()) return KeyError(path, key, "must be a number");
  const double v = it->get<double>();
  if (dflt && v == *dflt) return OkStatus();
  *out = v;
  return OkStatus();
}

Status ReadInt(const json& j, const std::string& path, const char* key, std::optional<int64_t> dflt,
               std::optional<int64_t>* out) {
  auto it = j.find(key);
  if (it == j.end() || it->is_null()) return OkStatus();
  if (!it->is_number_integer()) return KeyError(path, key, "must be an integer");
  const int64_t v = it->get<int64_t>();
  if (dflt && v == *dflt) return OkStatus();
  *out = v;
  return OkStatus();
}

}  // namespace

std::string SamplingDefaults::ToString() const {
  json j = json::object();
  if (repetition_penalty) j["repetition_penalty"] = *repetition_penalty;
  if (temperature) j["temperature"] = *temperature;
  if (top_k) j["top_k"] = *top_k;
  if (top_p) j["top_p"] = *top_p;
  if (min_p) j["min_p"] = *min_p;
  if (max_tokens) j["max_tokens"] = *max_tokens;
  return j.dump();
}

Result<GenerationConfig> LoadGenerationConfig(const std::string& model_dir,
                                              const std::string& mode) {
  const bool own = mode.empty() || mode == "auto" || mode == "vllm";
  const std::string dir = own ? model_dir : mode;
  const std::string path = (std::filesystem::path(dir) / "generation_config.json").string();
  GenerationConfig g;
  std::error_code ec;
  if (!std::filesystem::exists(path, ec)) {
    if (!own) {
      return NotFoundError("--generation-config " + mode + ": no generation_config.json there");
    }
    return g;
  }
  std::ifstream f(path);
  std::stringstream text;
  text << f.rdbuf();
  if (!f) return InvalidArgumentError(path + ": cannot read");
  json j = json::parse(text.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return InvalidArgumentError(path + ": not a JSON object");
  g.path = path;
  if (auto it = j.find("eos_token_id"); it != j.end() && !it->is_null()) {
    std::vector<int32_t> ids;
    auto add = [&](const json& v) -> Status {
      if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
        return KeyError(path, "eos_token_id", "must be a token id or a list of token ids");
      }
      ids.push_back(static_cast<int32_t>(v.get<int64_t>()));
      return OkStatus();
    };
    if (it->is_array()) {
      for (const json& v : *it) RETURN_IF_ERROR(add(v));
    } else {
      RETURN_IF_ERROR(add(*it));
    }
    g.eos_token_ids = std::move(ids);
  }
  SamplingDefaults d;
  RETURN_IF_ERROR(ReadNumber(j, path, "repetition_penalty", 1.0, &d.repetition_penalty));
  RETURN_IF_ERROR(ReadNumber(j, path, "temperature", 1.0, &d.temperature));
  RETURN_IF_ERROR(ReadInt(j, path, "top_k", 50, &d.top_k));
  RETURN_IF_ERROR(ReadNumber(j, path, "top_p", 1.0, &d.top_p));
  RETURN_IF_ERROR(ReadNumber(j, path, "min_p", std::nullopt, &d.min_p));
  RETURN_IF_ERROR(ReadInt(j, path, "max_new_tokens", std::nullopt, &d.max_tokens));
  if (mode != "vllm") g.defaults = d;
  return g;
}

}  // namespace kvbridge
