// The MODEL argument of `serve` and `generate`: a model directory, or the name of a random-model
// preset (random_model.h: "qwen2.5-7b", "small", ...) that a GPU engine generates straight into
// device memory without a directory (Model::CreateWeightless; seed 0, the weights of
// `make-model --preset NAME --seed 0`).
#pragma once

#include <filesystem>
#include <memory>
#include <string>

#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"

namespace kvbridge::apps {

/// A directory (or anything that is not a preset name) -> Model::Load. A preset name that is not
/// an existing path -> a weightless model when `on_gpu`, else FailedPrecondition saying how to
/// get weights. `*weightless` says which happened.
inline Result<std::shared_ptr<Model>> LoadModelOrPreset(const std::string& name_or_dir, bool on_gpu,
                                                        ModelLoadOptions options,
                                                        bool* weightless) {
  *weightless = false;
  std::error_code ec;
  if (!std::filesystem::exists(name_or_dir, ec)) {
    Result<RandomModelSpec> spec = RandomModelPreset(name_or_dir, /*seed=*/0);
    if (spec.ok()) {
      if (!on_gpu) {
        return FailedPreconditionError(
            "'" + name_or_dir +
            "' is a random-model preset, not a directory: without a model directory only a GPU "
            "engine runs it (--device cuda generates the weights on the device); for the CPU "
            "write it first: kvbridge make-model --preset " +
            name_or_dir + " --out DIR");
      }
      *weightless = true;
      ASSIGN_OR_RETURN(std::shared_ptr<Model> m, Model::CreateWeightless(*spec));
      return m;
    }
  }
  ASSIGN_OR_RETURN(std::shared_ptr<Model> m, Model::Load(name_or_dir, options));
  return m;
}

}  // namespace kvbridge::apps
