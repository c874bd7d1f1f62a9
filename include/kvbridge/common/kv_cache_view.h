// kvbridge/common/kv_cache_view.h — the paged KV cache layout shared by model, engine and transfer.
//
// In common (not model) because three modules read it and only the model computes on it: the
// transfer engine moves blocks in this layout without linking the model.
//
// This layout is a contract between the model (which reads/writes K and V), the engine's block
// pool (which owns the memory) and the transfer engine (which moves blocks between processes).
// Do not change it without changing all three.
//
// Per layer, per TP rank, one contiguous region:
//   [num_blocks][2 (K=0, V=1)][num_kv_heads][block_size][head_dim]   elements of `dtype`
// so one block of one layer is `BlockBytes()` contiguous bytes, and one head range of a block
// is contiguous within its K half and within its V half (DESIGN.md, "The KV cache").
// Token t of a sequence lives in block_table[t / block_size] at slot t % block_size.
//
// fp8 (e4m3, OCP FP8 spec: 4 exponent bits, 3 mantissa bits, bias 7, max 448, no inf) stores
// value / scale; one scale per layer for K and one for V.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

namespace kvbridge {

enum class KvDtype : uint8_t { kFp32 = 0, kBf16 = 1, kFp8E4M3 = 2 };

/// Bytes per element: 4, 2, 1.
constexpr size_t KvDtypeSize(KvDtype d) {
  return d == KvDtype::kFp32 ? 4 : (d == KvDtype::kBf16 ? 2 : 1);
}
/// "fp32" | "bf16" | "fp8".
std::string_view KvDtypeName(KvDtype d);

/// Shape of one rank's KV cache.
struct PagedKvLayout {
  int num_layers = 0;
  int num_kv_heads = 0;  ///< KV heads held by this rank.
  int head_dim = 0;
  int block_size = 16;  ///< tokens per block
  int num_blocks = 0;
  KvDtype dtype = KvDtype::kFp32;

  /// Bytes of one K (or V) half of one block of one layer.
  size_t HalfBlockBytes() const {
    return static_cast<size_t>(num_kv_heads) * block_size * head_dim * KvDtypeSize(dtype);
  }
  /// Bytes of one block of one layer (K and V).
  size_t BlockBytes() const { return 2 * HalfBlockBytes(); }
  /// Bytes of one layer's region.
  size_t LayerBytes() const { return BlockBytes() * static_cast<size_t>(num_blocks); }
  /// Byte offset of (block, kv, head, slot) inside a layer's region; kv: 0 = K, 1 = V.
  size_t Offset(int block, int kv, int head, int slot) const {
    return static_cast<size_t>(block) * BlockBytes() + static_cast<size_t>(kv) * HalfBlockBytes() +
           (static_cast<size_t>(head) * block_size + slot) * head_dim * KvDtypeSize(dtype);
  }
};

/// Non-owning view of one rank's KV cache: a base pointer per layer plus fp8 scales.
struct PagedKvView {
  PagedKvLayout layout;
  std::vector<uint8_t*> layer_base;  ///< size num_layers; each LayerBytes() long.
  std::vector<float> k_scale;        ///< size num_layers; 1.0 unless dtype is fp8.
  std::vector<float> v_scale;        ///< size num_layers; 1.0 unless dtype is fp8.
};

}  // namespace kvbridge
