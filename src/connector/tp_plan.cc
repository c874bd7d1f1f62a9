#include "kvbridge/connector/tp_plan.h"

#include <algorithm>
#include <string>

namespace kvbridge {
namespace {

constexpr int kMaxTp = 1024;

}  // namespace

TpHeadRange TpRankHeads(int rank, int tp_size, int num_kv_heads) {
  if (tp_size < 1 || rank < 0 || rank >= tp_size || num_kv_heads < 1) return {};
  const int64_t h = num_kv_heads;
  const int begin = static_cast<int>(rank * h / tp_size);
  if (num_kv_heads < tp_size) return {begin, 1};  // replicated: one head per rank
  const int end = static_cast<int>((rank + 1) * h / tp_size);
  return {begin, end - begin};
}

std::vector<TpSlice> TpPlan::ForDecodeRank(int d) const {
  std::vector<TpSlice> out;
  for (const TpSlice& s : slices) {
    if (s.decode_rank == d) out.push_back(s);
  }
  return out;
}

std::vector<std::pair<int, int>> TpPlan::Pairs() const {
  std::vector<std::pair<int, int>> out;
  for (const TpSlice& s : slices) out.emplace_back(s.decode_rank, s.prefill_rank);
  return out;
}

std::vector<int> TpPlan::DecodeRanksReadingFrom(int prefill_rank) const {
  std::vector<int> out;
  for (const TpSlice& s : slices) {
    if (s.prefill_rank == prefill_rank) out.push_back(s.decode_rank);
  }
  return out;
}

uint64_t TpPlan::PrefillHalfBlockBytes(int rank) const {
  return static_cast<uint64_t>(TpRankHeads(rank, input.prefill_tp, input.num_kv_heads).count) *
         input.block_size * input.head_dim * input.dtype_bytes;
}

uint64_t TpPlan::DecodeHalfBlockBytes(int rank) const {
  return static_cast<uint64_t>(TpRankHeads(rank, input.decode_tp, input.num_kv_heads).count) *
         input.block_size * input.head_dim * input.dtype_bytes;
}

Result<TpPlan> PlanTpTransfer(const TpPlanInput& in) {
  if (in.prefill_tp < 1 || in.prefill_tp > kMaxTp || in.decode_tp < 1 || in.decode_tp > kMaxTp) {
    return InvalidArgumentError("tp plan: TP sizes must be in [1, " + std::to_string(kMaxTp) +
                                "] (prefill " + std::to_string(in.prefill_tp) + ", decode " +
                                std::to_string(in.decode_tp) + ")");
  }
  if (in.num_kv_heads < 1 || in.head_dim < 1 || in.block_size < 1 || in.dtype_bytes < 1) {
    return InvalidArgumentError(
        "tp plan: num_kv_heads, head_dim, block_size and dtype_bytes must be >= 1");
  }
  TpPlan plan;
  plan.input = in;
  const int hkv = in.num_kv_heads;
  // Holders of each global head on both sides, lowest rank first.
  std::vector<std::vector<int>> prefill_holders(static_cast<size_t>(hkv));
  std::vector<std::vector<int>> decode_holders(static_cast<size_t>(hkv));
  for (int p = 0; p < in.prefill_tp; ++p) {
    const TpHeadRange r = TpRankHeads(p, in.prefill_tp, hkv);
    for (int h = r.begin; h < r.begin + r.count; ++h) prefill_holders[h].push_back(p);
  }
  for (int d = 0; d < in.decode_tp; ++d) {
    const TpHeadRange r = TpRankHeads(d, in.decode_tp, hkv);
    for (int h = r.begin; h < r.begin + r.count; ++h) decode_holders[h].push_back(d);
  }
  const uint64_t per_head =
      static_cast<uint64_t>(in.block_size) * in.head_dim * static_cast<uint64_t>(in.dtype_bytes);
  for (int d = 0; d < in.decode_tp; ++d) {
    const TpHeadRange dh = TpRankHeads(d, in.decode_tp, hkv);
    std::vector<TpSlice> mine;
    for (int h = dh.begin; h < dh.begin + dh.count; ++h) {
      const auto& dec = decode_holders[h];
      const auto& pre = prefill_holders[h];
      const size_t k = static_cast<size_t>(std::find(dec.begin(), dec.end(), d) - dec.begin());
      const int p = pre[k % pre.size()];
      if (!mine.empty() && mine.back().prefill_rank == p &&
          mine.back().global_head_begin + mine.back().head_count == h) {
        ++mine.back().head_count;
        continue;
      }
      for (const TpSlice& s : mine) {
        if (s.prefill_rank == p) {
          return InternalError("tp plan: two slices for decode rank " + std::to_string(d) +
                               " from prefill rank " + std::to_string(p));
        }
      }
      mine.push_back(
          TpSlice{.decode_rank = d, .prefill_rank = p, .global_head_begin = h, .head_count = 1});
    }
    for (TpSlice& s : mine) {
      const TpHeadRange ph = TpRankHeads(s.prefill_rank, in.prefill_tp, hkv);
      s.src_head_begin = s.global_head_begin - ph.begin;
      s.dst_head_begin = s.global_head_begin - dh.begin;
      s.src_range = {per_head * static_cast<uint64_t>(s.src_head_begin),
                     per_head * static_cast<uint64_t>(s.head_count)};
      s.dst_range = {per_head * static_cast<uint64_t>(s.dst_head_begin),
                     per_head * static_cast<uint64_t>(s.head_count)};
      s.src_whole = s.src_head_begin == 0 && s.head_count == ph.count;
      s.dst_whole = s.dst_head_begin == 0 && s.head_count == dh.count;
    }
    std::sort(mine.begin(), mine.end(),
              [](const TpSlice& a, const TpSlice& b) { return a.prefill_rank < b.prefill_rank; });
    plan.slices.insert(plan.slices.end(), mine.begin(), mine.end());
  }
  return plan;
}

std::vector<std::pair<int, int>> TpPlanPairs(int prefill_tp, int decode_tp, int num_kv_heads) {
  auto plan = PlanTpTransfer({.prefill_tp = prefill_tp,
                              .decode_tp = decode_tp,
                              .num_kv_heads = num_kv_heads,
                              .head_dim = 1,
                              .block_size = 1,
                              .dtype_bytes = 1});
  if (!plan.ok()) return {};
  return plan->Pairs();
}

}  // namespace kvbridge
