// Test helpers of the model module: temporary model directories made by the same code as
// `kvbridge make-model`.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <memory>
#include <string>

#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"

namespace kvbridge::testing_model {

/// A directory removed when this object dies.
class TempDir {
 public:
  TempDir() {
    static std::atomic<int> counter{0};
    path_ = (std::filesystem::temp_directory_path() /
             ("kvbridge_model_test_" + std::to_string(::getpid()) + "_" +
              std::to_string(counter.fetch_add(1))))
                .string();
    std::filesystem::remove_all(path_);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

/// Writes `spec` into `dir` and loads it (fails the test on error).
inline std::shared_ptr<Model> WriteAndLoad(const std::string& dir, const RandomModelSpec& spec,
                                           int threads = 2) {
  auto st = WriteRandomModel(spec, dir);
  EXPECT_TRUE(st.ok()) << st.ToString();
  auto model = Model::Load(dir, {.num_threads = threads});
  EXPECT_TRUE(model.ok()) << model.status().ToString();
  return model.ok() ? *model : nullptr;
}

/// Writes preset/arch/seed into `dir` and loads it (fails the test on error).
inline std::shared_ptr<Model> MakeAndLoad(const std::string& dir, const char* preset,
                                          ModelArch arch, uint64_t seed, int threads = 2) {
  auto spec = RandomModelPreset(preset, arch, seed);
  EXPECT_TRUE(spec.ok()) << spec.status().ToString();
  if (!spec.ok()) return nullptr;
  return WriteAndLoad(dir, *spec, threads);
}

/// The tiny preset of `arch` with RoPE scaling of `type` whose original context (16 for llama3
/// and yarn) is shorter than the test prompts, so the scaled bands matter.
inline RandomModelSpec TinyWithRope(ModelArch arch, uint64_t seed, RopeType type) {
  auto spec = RandomModelPreset("tiny", arch, seed);
  EXPECT_TRUE(spec.ok()) << spec.status().ToString();
  RopeScaling& r = spec->config.rope_scaling;
  r.type = type;
  r.factor = 4.0;
  r.original_max_position_embeddings = 16;
  spec->config.rope_theta = 10000.0;
  return *spec;
}

}  // namespace kvbridge::testing_model
