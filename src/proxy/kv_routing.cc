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
                                       KvRouteDecision& d, int* cached_tokens,
                                       const std::string& exclude_url) {
  const Role other = role == Role::kPrefill ? Role::kDecode : Role::kPrefill;
  // Native candidates first, then the other role's kv_both instances (cross-role).
  std::vector<const InstanceState*> cands;
  for (const InstanceState* st : registry.Healthy(role)) {
    if (st->info.url != exclude_url) cands.push_back(st);
  }
  const size_t natives = cands.size();
  for (const InstanceState* st : registry.Healthy(other)) {
    if (st->info.kv_both && st->info.url != exclude_url) cands.push_back(st);
  }
  if (cands.empty()) return std::nullopt;
  // A cross-role candidate's running requests and the legs in flight to it are its own role's
  // (a decode's running sequences add one token each to a step): only its waiting ones count.
  auto queue = [&](size_t i) {
    const InstanceState* st = cands[i];
    return i < natives ? st->load.running + st->load.waiting + st->in_flight : st->load.waiting;
  };
  int max_queue = 0;
  for (size_t i = 0; i < cands.size(); ++i) max_queue = std::max(max_queue, queue(i));
  const size_t first = d.candidates.size();
  for (size_t i = 0; i < cands.size(); ++i) {
    const InstanceState* st = cands[i];
    auto [blocks, bs] = CachedBlocks(st->info.id, tokens, index);
    const int prompt_blocks = std::max<int>(1, bs > 0 ? static_cast<int>(tokens.size()) / bs : 1);
    KvCandidate c;
    c.id = st->info.id;
    c.role = role;
    c.cross_role = i >= natives;
    c.cached_blocks = blocks;
    c.cached_tokens = blocks * bs;
    c.score = options_.weights.overlap * blocks / prompt_blocks -
              options_.weights.queue * queue(i) / (1.0 + max_queue) -
              options_.weights.kv_usage * st->load.kv_usage;
    d.candidates.push_back(std::move(c));
  }
  auto at = [&](size_t i) -> const KvCandidate& { return d.candidates[first + i]; };
  // Best native score; scanning from a rotating start breaks ties round-robin.
  std::optional<size_t> native;
  if (natives > 0) {
    const size_t start = rr_[role == Role::kPrefill ? 0 : 1]++ % natives;
    native = start;
    for (size_t k = 1; k < natives; ++k) {
      size_t i = (start + k) % natives;
      if (at(i).score > at(*native).score) native = i;
    }
  }
  // A cross-role candidate takes the leg only when it holds more of the prompt than the native
  // pick and scores better (first turns, holding nothing anywhere, stay on their role).
  std::optional<size_t> best = native;
  for (size_t i = natives; i < cands.size(); ++i) {
    const bool eligible = !native || (at(i).cached_blocks > at(*native).cached_blocks &&
                                      at(i).score > at(*native).score);
    if (eligible && (best == native || at(i).score > at(*best).score)) best = i;
  }
  *cached_tokens = at(*best).cached_tokens;
  return ToEndpoint(cands[*best]->info);
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
  // One engine (kv_both) should not be both legs of a request: it cannot READ from itself. The
  // prefill keeps it (computing is what costs) and the decode is the best other one, else the
  // prefill is the best other one; with no other engine at all both stay (the flow then sends
  // both legs there, as it would without a decision).
  if (!d.skip_prefill && d.prefill && d.decode && d.prefill->url == d.decode->url) {
    int cached = 0;
    if (auto other = Best(Role::kDecode, tokens, registry, index, d, &cached, d.prefill->url)) {
      d.decode = other;
      d.decode_cached_tokens = cached;
    } else if (auto other_prefill =
                   Best(Role::kPrefill, tokens, registry, index, d, &cached, d.decode->url)) {
      d.prefill = other_prefill;
      d.prefill_cached_tokens = cached;
    }
  }
  return d;
}

InstancePicker DecidedPicker(const KvRouteDecision& decision, InstancePicker fallback) {
  return [prefill = decision.prefill, decode = decision.decode, fallback = std::move(fallback)](
             Role role, const std::vector<std::string>& exclude) -> std::optional<Endpoint> {
    const std::optional<Endpoint>& mine = role == Role::kPrefill ? prefill : decode;
    if (mine && std::find(exclude.begin(), exclude.end(), mine->id) == exclude.end() &&
        std::find(exclude.begin(), exclude.end(), mine->url) == exclude.end()) {
      return mine;
    }
    return fallback(role, exclude);
  };
}

FlowOptions DecidedFlowOptions(const KvRouteDecision& decision, FlowOptions base) {
  if (decision.skip_prefill) base.colocated = true;
  return base;
}

}  // namespace kvbridge::proxy
