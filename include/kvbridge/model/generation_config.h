// kvbridge/model/generation_config.h — a checkpoint's generation_config.json, read as vLLM
// reads it: its eos_token_id joins the stop ids and, with `--generation-config auto`, its
// sampling values become the defaults of requests that leave them out.
//
//   ASSIGN_OR_RETURN(GenerationConfig g, LoadGenerationConfig(model_dir, flag));  // "auto"
//   if (g.eos_token_ids) engine_config.eos_token_ids = *g.eos_token_ids;
//   server_config.sampling_defaults = g.defaults;  // empty with "vllm"
//
// vLLM (vllm/config ModelConfig.get_diff_sampling_param, try_get_generation_config):
// `auto` reads <model>/generation_config.json, `vllm` uses none of its sampling values, any
// other value is a directory whose generation_config.json is read instead. The sampling values
// are those of transformers' GenerationConfig.to_diff_dict() (only values that differ from
// GenerationConfig()'s defaults: temperature 1.0, top_p 1.0, top_k 50, repetition_penalty
// 1.0) among repetition_penalty, temperature, top_k, top_p, min_p and max_new_tokens (vLLM's
// max_tokens). The eos ids are read in every mode (vLLM's update_from_generation_config).
//
// Thread-safety: values.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge {

/// Sampling values a request gets when it leaves them out (vLLM's default_sampling_params).
struct SamplingDefaults {
  std::optional<double> temperature;
  std::optional<double> top_p;
  std::optional<int64_t> top_k;
  std::optional<double> min_p;
  std::optional<double> repetition_penalty;
  std::optional<int64_t> max_tokens;  ///< generation_config's max_new_tokens
  bool empty() const {
    return !temperature && !top_p && !top_k && !min_p && !repetition_penalty && !max_tokens;
  }
  /// {"temperature": 0.6, "top_k": 20, ...}: the set values, for the startup log.
  std::string ToString() const;
};

struct GenerationConfig {
  /// The file read ("" when there was none).
  std::string path;
  /// Its eos_token_id (an int or a list of ints); nullopt when the file or the key is absent.
  std::optional<std::vector<int32_t>> eos_token_ids;
  /// The sampling defaults (empty with mode "vllm" or when the file sets none).
  SamplingDefaults defaults;
};

/// Reads the generation config for `mode` ("auto" | "vllm" | a directory; "" = "auto") of the
/// checkpoint in `model_dir`. No file: an empty config (not an error), except for a directory
/// given as `mode` (NotFound naming it). Errors: InvalidArgument naming the file and the key
/// (not JSON, eos_token_id not an int or a list of ints >= 0, a sampling value of the wrong
/// type).
Result<GenerationConfig> LoadGenerationConfig(const std::string& model_dir,
                                              const std::string& mode);

}  // namespace kvbridge
