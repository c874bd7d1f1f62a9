// src/transfer/fill_pattern.h — deterministic block contents for checking transfers.
//
// FillPattern(p, n, seed, layer, block) writes n bytes that depend only on (seed, layer, block)
// (a SplitMix64 stream), so either side of a transfer can rebuild what a block must hold and
// compare every byte. Shared by `kvbridge xfer-bench` (verification before timing) and the
// transfer conformance suite.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>

namespace kvbridge::transfer {

inline void FillPattern(uint8_t* p, size_t n, uint64_t seed, int layer, int block) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(layer) * 1000003 + block;
  for (size_t i = 0; i < n; i += 8) {
    x += 0x9E3779B97F4A7C15ULL;
    uint64_t z = x;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    std::memcpy(p + i, &z, std::min<size_t>(8, n - i));
  }
}

}  // namespace kvbridge::transfer
