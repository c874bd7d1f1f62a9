#include "kvbridge/common/block_hash.h"

#include <xxhash.h>

namespace kvbridge {

namespace {

BlockHash FromXxh128(XXH128_hash_t h) { return BlockHash{h.low64, h.high64}; }

void PutLe64(uint64_t v, uint8_t* out) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}

int HexDigit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

}  // namespace

BlockHash RootBlockHash(std::string_view model_fingerprint) {
  return FromXxh128(XXH3_128bits(model_fingerprint.data(), model_fingerprint.size()));
}

BlockHash ChainBlockHash(const BlockHash& parent, std::span<const int32_t> tokens) {
  // Explicit little-endian serialization so the chain is the same on every host.
  std::vector<uint8_t> buf(16 + 4 * tokens.size());
  PutLe64(parent.lo, buf.data());
  PutLe64(parent.hi, buf.data() + 8);
  for (size_t i = 0; i < tokens.size(); ++i) {
    uint32_t t = static_cast<uint32_t>(tokens[i]);
    for (int k = 0; k < 4; ++k) buf[16 + 4 * i + k] = static_cast<uint8_t>(t >> (8 * k));
  }
  return FromXxh128(XXH3_128bits(buf.data(), buf.size()));
}

void AppendBlockHashes(const BlockHash& root, std::span<const int32_t> tokens, int block_size,
                       std::vector<BlockHash>* hashes) {
  size_t full = tokens.size() / static_cast<size_t>(block_size);
  while (hashes->size() < full) {
    size_t i = hashes->size();
    const BlockHash& parent = i == 0 ? root : (*hashes)[i - 1];
    hashes->push_back(ChainBlockHash(parent, tokens.subspan(i * block_size, block_size)));
  }
}

std::string BlockHashHex(const BlockHash& h) {
  static constexpr char kDigits[] = "0123456789abcdef";
  std::string out(32, '0');
  for (int i = 0; i < 16; ++i) {
    out[15 - i] = kDigits[(h.hi >> (4 * i)) & 0xF];
    out[31 - i] = kDigits[(h.lo >> (4 * i)) & 0xF];
  }
  return out;
}

std::optional<BlockHash> ParseBlockHashHex(std::string_view hex) {
  if (hex.size() != 32) return std::nullopt;
  BlockHash h;
  for (int i = 0; i < 32; ++i) {
    int d = HexDigit(hex[i]);
    if (d < 0) return std::nullopt;
    uint64_t& half = i < 16 ? h.hi : h.lo;
    half = (half << 4) | static_cast<uint64_t>(d);
  }
  return h;
}

}  // namespace kvbridge
