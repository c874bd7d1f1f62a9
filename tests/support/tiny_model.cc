#include "support/tiny_model.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <map>
#include <mutex>
#include <string>
#include <utility>

#include "kvbridge/model/random_model.h"

namespace kvbridge::testing {

std::shared_ptr<const Model> TinyRandomModel(uint64_t seed) {
  static std::mutex mu;
  static std::map<uint64_t, std::shared_ptr<const Model>> models;
  std::lock_guard<std::mutex> l(mu);
  std::shared_ptr<const Model>& model = models[seed];
  if (model == nullptr) {
    const std::string dir =
        ::testing::TempDir() + "/kvb_tiny_" + std::to_string(seed) + "_" + std::to_string(getpid());
    auto spec = RandomModelPreset("tiny", ModelArch::kLlama, seed);
    EXPECT_TRUE(spec.ok());
    EXPECT_TRUE(WriteRandomModel(*spec, dir).ok());
    auto m = Model::Load(dir, {.num_threads = 1});
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    model = std::shared_ptr<const Model>(std::move(m).value());
  }
  return model;
}

}  // namespace kvbridge::testing
