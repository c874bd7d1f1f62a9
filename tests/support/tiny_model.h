// tests/support/tiny_model.h — the `tiny` random-weight llama model for in-process tests that run
// the real engine (server_engine_test, and the P/D tests through pd_engine.h): written under the
// test's temp dir and loaded once per process and seed.
//
//   std::shared_ptr<const Model> m = TinyRandomModel(7);
//   auto engine = Engine::Create(config, m);
//
// Failures are reported through GoogleTest (EXPECT_*), so this is for test bodies only.
// Thread-safe.
#pragma once

#include <cstdint>
#include <memory>

#include "kvbridge/model/model.h"

namespace kvbridge::testing {

/// The `tiny` llama preset with weights drawn from `seed` (one thread). The same pointer for every
/// call with the same seed; a model that failed to write or load fails the test.
std::shared_ptr<const Model> TinyRandomModel(uint64_t seed);

}  // namespace kvbridge::testing
