// kvbridge/connector/tp_plan.h — which decode rank reads which KV head slices from which prefill
// rank, for a prefill of TP = Tp and a decode of TP = Td (Tp = Td, Tp > Td, Tp < Td).
//
// Head ownership (DESIGN.md "The KV cache"; the engine's TP split): with Hkv global KV heads and
// T ranks, rank r holds the global heads [floor(r*Hkv/T), floor((r+1)*Hkv/T)) when Hkv >= T, and
// the single head floor(r*Hkv/T) when Hkv < T (a head is then replicated on several ranks).
// Per rank and layer a block is [2 (K,V)][heads_of_rank][block_size][head_dim], so a head range
// of a block is one contiguous byte range inside its K half and one inside its V half.
//
// The plan gives each decode rank the slices it reads: for every global head it owns, exactly one
// prefill rank that holds it (each needed byte read once). Where a head is replicated on the
// prefill side, the source is picked deterministically and spread over the replicas: the k-th
// decode replica of head h (k = 0 when the decode holds h once) reads from the (k mod m)-th of
// the m prefill ranks holding h, lowest first. Adjacent heads from one prefill rank form one
// slice, so each (decode rank, prefill rank) pair has at most one slice.
//
// Notification and release rule (docs/protocol.md "Tensor parallelism"): a decode rank notifies
// (ReadDone) exactly the prefill ranks of its slices — the pairs of the plan — and no others; a
// prefill engine frees a transfer's blocks when every pair of the plan has notified. A prefill rank
// whose replicas nobody reads is neither read nor notified, and does not hold up the release.
//
//   ASSIGN_OR_RETURN(TpPlan plan, PlanTpTransfer({.prefill_tp = 2, .decode_tp = 1,
//                                                 .num_kv_heads = 4, .head_dim = 64,
//                                                 .block_size = 16, .dtype_bytes = 4}));
//   // plan.slices: {d0 <- p0: heads 0..1 → local heads 0..1}, {d0 <- p1: heads 0..1 → 2..3}
//   for (const TpSlice& s : plan.ForDecodeRank(0)) ... s.src_range, s.dst_range ...
//
// Thread-safety: pure functions on values.
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge {

/// The global KV heads [begin, begin + count) one rank of a TP group holds.
struct TpHeadRange {
  int begin = 0;
  int count = 0;
  friend bool operator==(const TpHeadRange&, const TpHeadRange&) = default;
};
/// Heads of `rank` in a group of `tp_size` ranks over `num_kv_heads` heads (see the header
/// comment). Requires 0 <= rank < tp_size and num_kv_heads >= 1 (else {0, 0}).
TpHeadRange TpRankHeads(int rank, int tp_size, int num_kv_heads);

/// A byte range inside each half (K and V) of one block of one layer; offset and length in bytes.
struct TpByteRange {
  uint64_t offset = 0;
  uint64_t length = 0;
  friend bool operator==(const TpByteRange&, const TpByteRange&) = default;
};

/// One contiguous slice a decode rank reads from a prefill rank, for every block and layer of a
/// transfer. Head indices are rank-local (0 = the first head the rank holds).
struct TpSlice {
  int decode_rank = 0;
  int prefill_rank = 0;
  int global_head_begin = 0;
  int head_count = 0;
  int src_head_begin = 0;  ///< in the prefill rank's block
  int dst_head_begin = 0;  ///< in the decode rank's block
  TpByteRange src_range;   ///< in each half block of the prefill rank
  TpByteRange dst_range;   ///< in each half block of the decode rank
  bool src_whole = false;  ///< src_range is the prefill rank's whole half block
  bool dst_whole = false;  ///< dst_range is the decode rank's whole half block
  friend bool operator==(const TpSlice&, const TpSlice&) = default;
};

struct TpPlanInput {
  int prefill_tp = 1;
  int decode_tp = 1;
  int num_kv_heads = 1;  ///< global KV heads of the model
  int head_dim = 1;
  int block_size = 16;  ///< tokens per block
  int dtype_bytes = 4;  ///< bytes per KV element (4 fp32, 2 bf16, 1 fp8)
};

struct TpPlan {
  TpPlanInput input;
  std::vector<TpSlice> slices;  ///< sorted by (decode_rank, prefill_rank); one per pair

  /// Slices of decode rank `d` (sorted by prefill rank).
  std::vector<TpSlice> ForDecodeRank(int d) const;
  /// (decode_rank, prefill_rank) pairs, sorted: who reads from and notifies whom.
  std::vector<std::pair<int, int>> Pairs() const;
  /// Decode ranks that read from (and must notify) `prefill_rank`, sorted.
  std::vector<int> DecodeRanksReadingFrom(int prefill_rank) const;
  /// Bytes of one half block of `rank` on the prefill (decode) side.
  uint64_t PrefillHalfBlockBytes(int rank) const;
  uint64_t DecodeHalfBlockBytes(int rank) const;
};

/// Plans the slices. InvalidArgument when a size is < 1 or a TP size exceeds 1024.
/// Cost O(Td * Hkv).
Result<TpPlan> PlanTpTransfer(const TpPlanInput& in);

/// The (decode_rank, prefill_rank) pairs of PlanTpTransfer for these sizes (the head size does
/// not change them); empty when a size is < 1.
std::vector<std::pair<int, int>> TpPlanPairs(int prefill_tp, int decode_tp, int num_kv_heads);

}  // namespace kvbridge
