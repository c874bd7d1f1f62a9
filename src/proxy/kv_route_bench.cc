// kv_route_bench — the cost of one KV-aware routing decision (docs/proxy.md "KV-aware routing"):
// KvRouter::Decide (the prompt's block hashes, the index lookups, the scores) for a prompt of
// --prompt-tokens ids against a KvIndex of --blocks hashes spread over --engines engines (half
// prefills, half decodes; one decode and one prefill hold the prompt's first half), and beside
// it the cost of getting those ids: the in-process tokenizer + chat template of --model DIR
// (server::PromptTokenizer) and, with --tokenize-url, an engine's POST /tokenize.
//
//   build/bin/kv_route_bench --blocks 100000 --prompt-tokens 2048 [--model DIR]
//       [--tokenize-url http://127.0.0.1:8200] [--iters 20000]
#include <httplib.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include "kvbridge/bench/bench.h"
#include "kvbridge/proxy/kv_routing.h"
#include "kvbridge/server/prompt_tokens.h"

namespace {

using namespace kvbridge;
using namespace kvbridge::proxy;
using Clock = std::chrono::steady_clock;

struct Stats {
  double p50_us = 0, p90_us = 0, p99_us = 0;
};

Stats Summarize(std::vector<double> us) {
  return {bench::Percentile(us, 0.5), bench::Percentile(us, 0.9), bench::Percentile(us, 0.99)};
}

void Print(const char* what, const Stats& s, size_t n) {
  std::printf("%-44s p50 %9.2f us  p90 %9.2f us  p99 %9.2f us  (%zu runs)\n", what, s.p50_us,
              s.p90_us, s.p99_us, n);
}

// A chat request of about `tokens` tokens of English-like text.
std::string ChatBody(int words) {
  static const char* kWords[] = {"the",    "cache",  "block",    "engine", "prefill", "decode",
                                 "token",  "river",  "mountain", "quiet",  "bright",  "signal",
                                 "number", "garden", "window",   "silver", "answer",  "question"};
  std::mt19937 rng(7);
  std::string text;
  for (int i = 0; i < words; ++i) {
    text += kWords[rng() % (sizeof kWords / sizeof kWords[0])];
    text += ' ';
  }
  nlohmann::json body = {{"model", "m"},
                         {"max_tokens", 16},
                         {"messages",
                          {{{"role", "system"}, {"content", "You are a helpful assistant."}},
                           {{"role", "user"}, {"content", text}}}}};
  return body.dump();
}

}  // namespace

int main(int argc, char** argv) {
  size_t blocks = 100000;
  int prompt_tokens = 2048;
  int engines = 8;
  int iters = 20000;
  std::string model_dir, tokenize_url;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--blocks")
      blocks = std::stoul(v);
    else if (k == "--prompt-tokens")
      prompt_tokens = std::stoi(v);
    else if (k == "--engines")
      engines = std::stoi(v);
    else if (k == "--iters")
      iters = std::stoi(v);
    else if (k == "--model")
      model_dir = v;
    else if (k == "--tokenize-url")
      tokenize_url = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  constexpr int kBs = 16;
  const BlockHash root = RootBlockHash("bench-model");
  InstanceRegistry reg(RegistryOptions{.policy = RoutingPolicy::kKvAware});
  KvIndex index({.max_blocks = blocks + 1024});
  std::vector<std::string> ids;
  for (int e = 0; e < engines; ++e) {
    InstanceInfo info;
    info.id = (e % 2 == 0 ? "p" : "d") + std::to_string(e / 2);
    info.role = e % 2 == 0 ? Role::kPrefill : Role::kDecode;
    info.url = "http://127.0.0.1:" + std::to_string(9000 + e);
    if (!reg.Register(info, {.running = e, .waiting = 1, .kv_usage = 0.1 * e}, 0).ok()) return 1;
    ids.push_back(info.id);
  }
  // The prompt, and its first half held by p0 and d0.
  std::mt19937 rng(1);
  std::vector<int32_t> prompt(static_cast<size_t>(prompt_tokens));
  for (auto& t : prompt) t = static_cast<int32_t>(rng() % 150000);
  std::vector<BlockHash> chain;
  AppendBlockHashes(root, prompt, kBs, &chain);
  const size_t half = chain.size() / 2;
  // 1e5 other hashes, spread over the engines (each snapshot one engine's share).
  std::mt19937_64 r64(2);
  std::vector<std::vector<BlockHash>> shares(static_cast<size_t>(engines));
  for (size_t b = 0; b < blocks; ++b) {
    shares[b % static_cast<size_t>(engines)].push_back(BlockHash{r64(), r64()});
  }
  for (int e = 0; e < engines; ++e) {
    KvEventBatch snap;
    snap.incarnation = "inc" + std::to_string(e);
    snap.block_size = kBs;
    snap.root = root;
    snap.reset = true;
    snap.snapshot = std::move(shares[static_cast<size_t>(e)]);
    if (e < 2) snap.snapshot.insert(snap.snapshot.end(), chain.begin(), chain.begin() + half);
    if (!index.Apply(ids[static_cast<size_t>(e)], snap).ok()) return 1;
  }
  std::printf(
      "index: %zu block hashes, %zu (hash, engine) entries, %d engines; prompt %d tokens "
      "(%zu blocks of %d)\n",
      index.num_blocks(), index.num_entries(), engines, prompt_tokens, chain.size(), kBs);

  KvRouter router({.kv_aware = true, .pd_skip_threshold = 64});
  std::vector<double> us;
  us.reserve(static_cast<size_t>(iters));
  KvRouteDecision d;
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    d = router.Decide(prompt, reg, index, false);
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  Print("KvRouter::Decide (hashes + lookups + scores)", Summarize(us), us.size());
  std::printf("  chose prefill %s (%d cached tokens), decode %s (%d), skip %d\n",
              d.prefill ? d.prefill->id.c_str() : "-", d.prefill_cached_tokens,
              d.decode ? d.decode->id.c_str() : "-", d.decode_cached_tokens, d.skip_prefill);
  us.clear();
  for (int i = 0; i < iters; ++i) {
    const auto t0 = Clock::now();
    std::vector<BlockHash> hs;
    AppendBlockHashes(root, prompt, kBs, &hs);
    us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
  }
  Print("  of which the prompt's block hashes", Summarize(us), us.size());

  const std::string body = ChatBody(prompt_tokens * 15 / 16);  // ~1.07 Qwen3 tokens per word
  if (!model_dir.empty()) {
    auto pt = server::PromptTokenizer::Load(model_dir);
    if (!pt.ok()) {
      std::fprintf(stderr, "--model: %s\n", pt.status().ToString().c_str());
      return 1;
    }
    auto n = (*pt)->PromptIds("/v1/chat/completions", body);
    if (!n.ok()) {
      std::fprintf(stderr, "tokenize: %s\n", n.status().ToString().c_str());
      return 1;
    }
    std::printf("chat request: %zu bytes, %zu prompt tokens (model %s)\n", body.size(), n->size(),
                model_dir.c_str());
    us.clear();
    const int n_tok = std::max(50, iters / 40);
    for (int i = 0; i < n_tok; ++i) {
      const auto t0 = Clock::now();
      auto r = (*pt)->PromptIds("/v1/chat/completions", body);
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      if (!r.ok()) return 1;
    }
    Print("in-process tokenizer + chat template", Summarize(us), us.size());
  }
  if (!tokenize_url.empty()) {
    std::string hostport = tokenize_url.substr(tokenize_url.find("//") + 2);
    httplib::Client c(hostport.substr(0, hostport.rfind(':')),
                      std::stoi(hostport.substr(hostport.rfind(':') + 1)));
    c.set_keep_alive(true);
    c.set_tcp_nodelay(true);
    nlohmann::json b = nlohmann::json::parse(body);
    b.erase("model");
    const std::string tb = b.dump();
    us.clear();
    const int n_http = std::max(50, iters / 40);
    for (int i = 0; i < n_http; ++i) {
      const auto t0 = Clock::now();
      auto res = c.Post("/tokenize", tb, "application/json");
      us.push_back(std::chrono::duration<double, std::micro>(Clock::now() - t0).count());
      if (!res || res->status != 200) {
        std::fprintf(stderr, "/tokenize failed: %s\n",
                     res ? res->body.c_str() : httplib::to_string(res.error()).c_str());
        return 1;
      }
    }
    Print("engine POST /tokenize (keep-alive)", Summarize(us), us.size());
  }
  return 0;
}
