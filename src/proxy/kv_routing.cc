#include "kvbridge/proxy/kv_routing.h"

#include <algorithm>

namespace kvbridge::proxy {

std::pair<int, int> KvRouter::CachedBlocks(const std::string& id, std::span<const int32_t> tokens,
                                           const KvIndex& index) {
  std::optional<KvEngineView> v = index.Engine(id);
  if (!v || v->incarnation.empty() || v->block_size <= 0) return {0, 0};
  Chain* chain = nullptr;
  for (Chain& c : chains_) {
    if (c.root == v->root && c.block_size == v->block_size) chain = &c;
  }
  if (chain == nullptr) {
    chain = &chains_.emplace_back(Chain{v->root, v->block_size, {}});
    AppendBlockHashes(chain->root, tokens, chain->block_size, &chain->hashes);
  }
  const std::string ids[1] = {id};
  return {index.PrefixBlocks(chain->hashes, ids)[0], v->block_size};
}

std::optional<Endpoint> KvRouter::Best(Role role, std::span<const int32_t> tokens,
                                       InstanceRegistry& registry, const KvIndex& index,
                                       KvRouteDecision& d, int* cached_tokens) {
  std::vector<const InstanceState*> cands = registry.Healthy(role);
  if (cands.empty()) return std::nullopt;
  int max_queue = 0;
  for (const InstanceState* st : cands) {
    max_queue = std::max(max_queue, st->load.running + st->load.waiting + st->in_flight);
  }
  const size_t first = d.candidates.size();
  for (const InstanceState* st : cands) {
    auto [blocks, bs] = CachedBlocks(st->info.id, tokens, index);
    const int prompt_blocks = std::max<int>(1, bs > 0 ? static_cast<int>(tokens.size()) / bs : 1);
    const int queue = st->load.running + st->load.waiting + st->in_flight;
    KvCandidate c;
    c.id = st->info.id;
    c.role = role;
    c.cached_blocks = blocks;
    c.cached_tokens = blocks * bs;
    c.score = options_.weights.overlap * blocks / prompt_blocks -
              options_.weights.queue * queue / (1.0 + max_queue) -
              options_.weights.kv_usage * st->load.kv_usage;
    d.candidates.push_back(std::move(c));
  }
  // Best score; scanning from a rotating start breaks ties round-robin.
  const size_t n = cands.size();
  const size_t start = rr_[role == Role::kPrefill ? 0 : 1]++ % n;
  size_t best = start;
  for (size_t k = 1; k < n; ++k) {
    size_t i = (start + k) % n;
    if (d.candidates[first + i].score > d.candidates[first + best].score) best = i;
  }
  *cached_tokens = d.candidates[first + best].cached_tokens;
  return ToEndpoint(cands[best]->info);
}

KvRouteDecision KvRouter::Decide(std::span<const int32_t> tokens, InstanceRegistry& registry,
                                 const KvIndex& index, bool colocated) {
  KvRouteDecision d;
  d.prompt_tokens = static_cast<int>(tokens.size());
  if (!active() || tokens.empty()) return d;
  chains_.clear();
  if (options_.kv_aware) {
    d.decode = Best(Role::kDecode, tokens, registry, index, d, &d.decode_cached_tokens);
    if (!colocated) {
      d.prefill = Best(Role::kPrefill, tokens, registry, index, d, &d.prefill_cached_tokens);
    }
  } else {
    // Skip alone: the registry's usual decode, then its overlap.
    d.decode = registry.Pick(Role::kDecode, {});
    if (d.decode) {
      auto [blocks, bs] = CachedBlocks(d.decode->id, tokens, index);
      d.decode_cached_tokens = blocks * bs;
    }
  }
  if (!colocated && options_.pd_skip_threshold >= 0 && d.decode &&
      d.prompt_tokens - d.decode_cached_tokens <= options_.pd_skip_threshold) {
    d.skip_prefill = true;
    d.prefill.reset();
  }
  return d;
}

InstancePicker DecidedPicker(const KvRouteDecision& decision, InstancePicker fallback) {
  return [prefill = decision.prefill, decode = decision.decode, fallback = std::move(fallback)](
             Role role, const std::vector<std::string>& exclude) -> std::optional<Endpoint> {
    const std::optional<Endpoint>& mine = role == Role::kPrefill ? prefill : decode;
    if (mine && std::find(exclude.begin(), exclude.end(), mine->id) == exclude.end()) return mine;
    return fallback(role, exclude);
  };
}

FlowOptions DecidedFlowOptions(const KvRouteDecision& decision, FlowOptions base) {
  if (decision.skip_prefill) base.colocated = true;
  return base;
}

}  // namespace kvbridge::proxy
