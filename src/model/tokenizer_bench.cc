// tokenizer_bench: encode throughput (MB/s of UTF-8 text, one thread) of a tokenizer directory
// on a JSONL file of prompts ({"model_input": "..."} per line, e.g. the MT-bench prompts).
//
//   tokenizer_bench DIR PROMPTS.jsonl [SECONDS=3]
//
// Loads DIR/tokenizer.json, encodes every prompt once (warm-up; prints the total token count so
// runs can be compared with other implementations), then encodes all prompts in a loop for
// SECONDS and prints one line: "<dir> load_ms=... tokens=... MB/s=... cpu_MB/s=..." (wall
// clock and thread CPU time).
#include <time.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "kvbridge/model/config.h"
#include "kvbridge/model/tokenizer.h"

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: tokenizer_bench DIR PROMPTS.jsonl [SECONDS]\n");
    return 2;
  }
  const double seconds = argc > 3 ? std::stod(argv[3]) : 3.0;
  std::vector<std::string> prompts;
  {
    std::ifstream in(argv[2]);
    std::string line;
    while (std::getline(in, line)) {
      if (line.empty()) continue;
      prompts.push_back(nlohmann::json::parse(line)["model_input"].get<std::string>());
    }
  }
  size_t bytes = 0;
  for (const auto& p : prompts) bytes += p.size();
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  auto tok = kvbridge::Tokenizer::Load(argv[1], kvbridge::ModelConfig{});
  const auto t1 = Clock::now();
  if (!tok.ok()) {
    std::fprintf(stderr, "%s\n", tok.status().ToString().c_str());
    return 1;
  }
  size_t tokens = 0;
  for (const auto& p : prompts) tokens += tok->Encode(p, false)->size();
  auto cpu_now = [] {
    timespec ts;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + static_cast<double>(ts.tv_nsec) * 1e-9;
  };
  size_t rounds = 0;
  const auto start = Clock::now();
  const double cpu_start = cpu_now();
  double elapsed = 0;
  while (elapsed < seconds) {
    for (const auto& p : prompts) {
      auto ids = tok->Encode(p, false);
      if (!ids.ok()) return 1;
    }
    ++rounds;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  }
  const double cpu = cpu_now() - cpu_start;
  const double total = static_cast<double>(bytes) * static_cast<double>(rounds);
  std::printf(
      "%s prompts=%zu bytes=%zu load_ms=%.0f tokens=%zu rounds=%zu MB/s=%.2f cpu_MB/s=%.2f\n",
      argv[1], prompts.size(), bytes, std::chrono::duration<double, std::milli>(t1 - t0).count(),
      tokens, rounds, total / elapsed / 1e6, total / cpu / 1e6);
  return 0;
}
