// engine_bench — steps/s and tokens/s of one EngineCore (scheduler + KV cache + model, no HTTP,
// no thread hand-off) at several concurrencies. Not a test: figures go to docs/engine.md.
//
//   build/bin/engine_bench [--model DIR | --preset small] [--prompt 64] [--max-tokens 64]
//                          [--concurrency 1,2,4,8,16,32,64] [--threads 0] [--tp 1]
//
// Each run: `concurrency` requests (distinct byte prompts, greedy, ignore_eos) added at once,
// stepped until all finish. Reports steps, wall seconds, steps/s, generated tokens/s and
// computed tokens/s (prompt + generated). `--tp T` runs the engine with T tensor-parallel rank
// threads (then `--threads` only matters at T = 1).
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "kvbridge/common/logging.h"
#include "kvbridge/engine/engine_core.h"
#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"

using namespace kvbridge;

int main(int argc, char** argv) {
  std::string model_dir, preset = "small";
  int prompt_len = 64, max_tokens = 64, threads = 0, tp = 1;
  std::vector<int> conc = {1, 2, 4, 8, 16, 32, 64};
  SetLogLevel("warn");
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--model")
      model_dir = v;
    else if (k == "--preset")
      preset = v;
    else if (k == "--prompt")
      prompt_len = std::atoi(v.c_str());
    else if (k == "--max-tokens")
      max_tokens = std::atoi(v.c_str());
    else if (k == "--threads")
      threads = std::atoi(v.c_str());
    else if (k == "--tp")
      tp = std::atoi(v.c_str());
    else if (k == "--concurrency") {
      conc.clear();
      std::stringstream ss(v);
      std::string item;
      while (std::getline(ss, item, ',')) conc.push_back(std::atoi(item.c_str()));
    } else {
      std::fprintf(stderr, "unknown flag %s\n", k.c_str());
      return 2;
    }
  }
  if (model_dir.empty()) {
    model_dir = "/tmp/kvb_engine_bench_" + preset + "_" + std::to_string(getpid());
    auto spec = RandomModelPreset(preset, ModelArch::kLlama, 1);
    if (!spec.ok()) {
      std::fprintf(stderr, "%s\n", spec.status().ToString().c_str());
      return 1;
    }
    Status st = WriteRandomModel(*spec, model_dir);
    if (!st.ok()) {
      std::fprintf(stderr, "%s\n", st.ToString().c_str());
      return 1;
    }
  }
  auto model = Model::Load(model_dir, {.num_threads = threads});
  if (!model.ok()) {
    std::fprintf(stderr, "%s\n", model.status().ToString().c_str());
    return 1;
  }
  std::shared_ptr<const Model> m = std::move(model).value();
  std::printf("model %s (%d layers, hidden %d), prompt %d, max_tokens %d, tp %d, threads %d\n",
              model_dir.c_str(), m->config().num_hidden_layers, m->config().hidden_size, prompt_len,
              max_tokens, tp, threads);
  std::printf("%6s %7s %9s %9s %12s %12s\n", "conc", "steps", "wall_s", "steps/s", "gen_tok/s",
              "all_tok/s");
  for (int c : conc) {
    EngineConfig cfg;
    cfg.num_blocks = static_cast<int64_t>(c) * ((prompt_len + max_tokens) / 16 + 2) + 16;
    cfg.max_num_seqs = std::max(64, c);
    cfg.enable_prefix_caching = false;  // distinct prompts anyway; measure compute
    cfg.tensor_parallel_size = tp;
    auto core_or = EngineCore::Create(cfg, m, nullptr, {});
    if (!core_or.ok()) {
      std::fprintf(stderr, "%s\n", core_or.status().ToString().c_str());
      return 1;
    }
    auto core = std::move(core_or).value();
    for (int r = 0; r < c; ++r) {
      EngineRequest req;
      req.request_id = "b" + std::to_string(r);
      for (int i = 0; i < prompt_len; ++i) req.prompt_token_ids.push_back((i * 7 + r * 13) % 256);
      req.sampling.max_tokens = max_tokens;
      req.sampling.temperature = 0;
      req.sampling.ignore_eos = true;
      Status st = core->AddRequest(std::move(req), 0);
      if (!st.ok()) {
        std::fprintf(stderr, "%s\n", st.ToString().c_str());
        return 1;
      }
    }
    auto t0 = std::chrono::steady_clock::now();
    int64_t steps = 0, tokens = 0, gen = 0;
    while (core->scheduler().HasUnfinished()) {
      auto r = core->Step(SteadyNow());
      if (!r.ok()) {
        std::fprintf(stderr, "%s\n", r.status().ToString().c_str());
        return 1;
      }
      ++steps;
      tokens += r->num_tokens;
      for (auto& out : core->TakeOutputs()) {
        for (auto& co : out.outputs) gen += static_cast<int64_t>(co.new_token_ids.size());
      }
    }
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    std::printf("%6d %7lld %9.3f %9.1f %12.1f %12.1f\n", c, static_cast<long long>(steps), s,
                steps / s, gen / s, tokens / s);
    std::fflush(stdout);
  }
  return 0;
}
