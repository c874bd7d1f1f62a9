// kvbridge/proxy/kv_routing.h — KV-aware routing and the P/D skip decision, sans-IO.
//
// For one request with prompt ids `tokens`, KvRouter::Decide looks up each healthy candidate's
// cached prefix in the KvIndex (kv_index.h) — the prompt's block hashes computed with the
// engine's own root and block size, as its prefix cache does (common/block_hash.h) — and
// chooses:
//   - with kv_aware: the prefill with the best score among prefills (its overlap is what it need
//     not compute) and the decode with the best score among decodes (its overlap is what it
//     need not read); in colocated mode only the decode;
//   - with pd_skip_threshold N >= 0 (independent of kv_aware; without it the decode is the
//     registry's usual pick): when the chosen decode already holds all but at most N tokens of
//     the prompt, skip_prefill — the request goes whole to that decode, no prefill leg and no
//     transfer (PdFlow with FlowOptions::colocated). The decode computes the rest itself from
//     its prefix cache: the same tokens as the P/D path (prefix-cached = cold, bitwise).
//
// Score of a candidate (higher wins; ties go round-robin):
//   score = w.overlap  * cached_blocks / prompt_blocks                 (in [0, 1])
//         - w.queue    * (running + waiting + in_flight) / (1 + max of that over candidates)
//         - w.kv_usage * kv_usage                                        (in [0, 1])
// with the defaults 1.0 / 0.5 / 0.25: a candidate holding the whole prompt beats an idle one
// holding nothing even when it is the busiest; among equal overlaps (a first turn: none) the
// least loaded wins. prompt_blocks = full blocks of the prompt (at least 1). An index entry is a
// hint: a stale one costs a worse route, never a wrong answer (the engine recomputes what it
// lacks).
//
// kv_both instances (InstanceInfo::kv_both: vLLM's kv_role "kv_both") are also candidates of the
// other role (cross-role): a decode that served a conversation's first turn holds its prompt and
// its answer, so it may be the second turn's prefill. Its queue term counts only its waiting
// requests (its running ones are the other role's work: a decode's running sequences add one
// token each to a step), and it takes the leg only when it holds more blocks than the best
// candidate of the role and scores better. One engine is not both legs of a request while another
// can take one (it cannot READ from itself): the decode is then the best other decode, else the
// prefill the best other.
//
//   KvRouter router({.kv_aware = true, .pd_skip_threshold = 32});
//   KvRouteDecision d = router.Decide(ids, registry, index, /*colocated=*/false);
//   // d.prefill / d.decode: the first pick of each role; d.skip_prefill: decode alone.
//
// Thread-safety: none (the proxy calls it under the mutex that guards registry and index).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvbridge/proxy/flow.h"
#include "kvbridge/proxy/kv_index.h"
#include "kvbridge/proxy/registry.h"

namespace kvbridge::proxy {

struct KvScoreWeights {
  double overlap = 1.0;
  double queue = 0.5;
  double kv_usage = 0.25;
};

struct KvRouteOptions {
  bool kv_aware = false;
  /// Tokens of the prompt the chosen decode may lack for the request to skip the prefill leg;
  /// < 0: never skip.
  int pd_skip_threshold = -1;
  KvScoreWeights weights;
};

struct KvCandidate {
  std::string id;
  Role role = Role::kDecode;  ///< the leg it was scored for
  bool cross_role = false;    ///< registered as the other role, kv_both
  int cached_blocks = 0;
  int cached_tokens = 0;
  double score = 0;
};

struct KvRouteDecision {
  std::optional<Endpoint> prefill;  ///< nullopt: the registry's own pick
  std::optional<Endpoint> decode;
  bool skip_prefill = false;
  int prompt_tokens = 0;
  int prefill_cached_tokens = 0;  ///< of the chosen prefill (0 when none chosen)
  int decode_cached_tokens = 0;
  std::vector<KvCandidate> candidates;  ///< every candidate scored, for tests and logs
};

class KvRouter {
 public:
  explicit KvRouter(KvRouteOptions options) : options_(options) {}

  /// Nothing to decide (both switches off): Decide would return an empty decision.
  bool active() const { return options_.kv_aware || options_.pd_skip_threshold >= 0; }
  const KvRouteOptions& options() const { return options_; }

  KvRouteDecision Decide(std::span<const int32_t> tokens, InstanceRegistry& registry,
                         const KvIndex& index, bool colocated);

 private:
  // Scores the healthy instances of `role` and the other role's kv_both ones, none at
  // `exclude_url`; returns the best (nullopt when none).
  std::optional<Endpoint> Best(Role role, std::span<const int32_t> tokens,
                               InstanceRegistry& registry, const KvIndex& index, KvRouteDecision& d,
                               int* cached_tokens, const std::string& exclude_url = "");
  // Cached prefix (blocks, block size) of `id` for `tokens`, hashing with its root.
  std::pair<int, int> CachedBlocks(const std::string& id, std::span<const int32_t> tokens,
                                   const KvIndex& index);

  KvRouteOptions options_;
  uint64_t rr_[2] = {0, 0};
  // Hashes of the current request per (root, block size): usually one chain for all engines.
  struct Chain {
    BlockHash root;
    int block_size = 0;
    std::vector<BlockHash> hashes;
  };
  std::vector<Chain> chains_;
};

/// The flow's picker for a decided request: each role's decided instance while it is not
/// excluded (a retry after it was unreachable), else `fallback` (the registry's policy).
InstancePicker DecidedPicker(const KvRouteDecision& decision, InstancePicker fallback);
/// The flow options of a decided request: `base`, with colocated (decode alone) on a skip.
FlowOptions DecidedFlowOptions(const KvRouteDecision& decision, FlowOptions base);

}  // namespace kvbridge::proxy
