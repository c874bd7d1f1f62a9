// kvbridge/common/block_hash.h — the prefix-cache block hash chain, shared by the engine's block
// pool (which caches blocks under these hashes) and the proxy's KV index (which predicts them).
//
// A FULL block of `block_size` tokens is hashed by a chain: hash_i = XXH3-128(hash_{i-1} (16
// bytes, lo then hi, little-endian) || the block's tokens as int32 little-endian), hash_{-1} =
// XXH3-128(model fingerprint). Equal prompts hash equally in every process that serves the same
// model, which is what lets a proxy compare engines' caches (docs/engine.md "Prefix cache").
//
//   std::vector<BlockHash> hashes;
//   AppendBlockHashes(RootBlockHash(fingerprint), prompt_ids, 16, &hashes);
//   std::string hex = BlockHashHex(hashes[0]);           // 32 lowercase hex digits, hi then lo
//   std::optional<BlockHash> back = ParseBlockHashHex(hex);
//
// Thread-safety: values and pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace kvbridge {

/// 128-bit block hash (XXH3-128), lo/hi halves.
struct BlockHash {
  uint64_t lo = 0;
  uint64_t hi = 0;
  friend bool operator==(const BlockHash&, const BlockHash&) = default;
};
struct BlockHashHasher {
  size_t operator()(const BlockHash& h) const { return h.lo ^ (h.hi * 0x9E3779B97F4A7C15ull); }
};

/// Root of every hash chain: XXH3-128 of the model fingerprint's bytes.
BlockHash RootBlockHash(std::string_view model_fingerprint);
/// XXH3-128 of 16 bytes of `parent` (lo then hi, little-endian) followed by `tokens` as int32
/// little-endian.
BlockHash ChainBlockHash(const BlockHash& parent, std::span<const int32_t> tokens);
/// Extends `hashes` (the chain of tokens' first hashes->size() full blocks) to cover every full
/// block of `tokens` (tokens.size() / block_size of them).
void AppendBlockHashes(const BlockHash& root, std::span<const int32_t> tokens, int block_size,
                       std::vector<BlockHash>* hashes);

/// 32 lowercase hex digits: hi (16) then lo (16).
std::string BlockHashHex(const BlockHash& h);
/// Inverse of BlockHashHex (upper or lower case); nullopt unless exactly 32 hex digits.
std::optional<BlockHash> ParseBlockHashHex(std::string_view hex);

}  // namespace kvbridge
