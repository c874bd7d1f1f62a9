// `kvbridge bench`: drive /v1/completions over concurrency levels and check the KV drains.
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <memory>
#include <string>
#include <vector>

#include "apps/command_registry.h"
#include "kvbridge/bench/bench.h"

namespace {

struct BenchCli {
  kvbridge::bench::BenchOptions o;
  std::string batches = "1,4";
  bool no_shuffle = false;
  bool json = false;
  bool multi_turn = false;
  kvbridge::bench::MultiTurnOptions mt;
  kvbridge::bench::OverloadOptions ov;  // --overload X (> 0)
};

// `--overload X`: X times the measured capacity, open loop (bench.h).
int RunOverloadCommand(BenchCli& cli) {
  cli.ov.host = cli.o.host;
  cli.ov.path = cli.o.path;
  cli.ov.model = cli.o.model;
  cli.ov.request_timeout_s = cli.o.request_timeout_s;
  cli.ov.drain_timeout_s = cli.o.drain_timeout_s;
  cli.ov.seed = cli.o.seed;
  cli.ov.input_tokens = cli.o.input_tokens;
  cli.ov.output_tokens = cli.o.output_tokens;
  auto progress = [](const std::string& line) { std::fprintf(stderr, "%s\n", line.c_str()); };
  auto report = kvbridge::bench::RunOverload(cli.ov, progress);
  if (!report.ok()) {
    std::fprintf(stderr, "error: %s\n", report.status().ToString().c_str());
    return 2;
  }
  if (cli.json) {
    std::printf("%s\n", kvbridge::bench::OverloadJson(*report).c_str());
  } else {
    std::printf("%s", kvbridge::bench::FormatOverload(*report).c_str());
  }
  return report->ok_all ? 0 : 1;
}

// `--multi-turn`: conversations through the chat API, turn by turn (bench.h).
int RunMultiTurnCommand(BenchCli& cli) {
  cli.mt.host = cli.o.host;
  cli.mt.prompts_file = cli.o.prompts_file;
  cli.mt.model = cli.o.model;
  cli.mt.request_timeout_s = cli.o.request_timeout_s;
  cli.mt.seed = cli.o.seed;
  const bool tty = ::isatty(2);
  auto progress = [tty](const std::string& line) {
    if (tty) std::fprintf(stderr, "\r%-78s", line.c_str());
  };
  auto report = kvbridge::bench::RunMultiTurn(cli.mt, progress);
  if (tty) std::fprintf(stderr, "\n");
  if (!report.ok()) {
    std::fprintf(stderr, "error: %s\n", report.status().ToString().c_str());
    return 2;
  }
  if (cli.json) {
    std::printf("%s\n", kvbridge::bench::MultiTurnJson(*report).c_str());
  } else {
    std::printf("%s", kvbridge::bench::FormatMultiTurn(*report).c_str());
  }
  return report->ok ? 0 : 1;
}

int RunBenchCommand(BenchCli& cli, bool check_drain) {
  if (cli.multi_turn) return RunMultiTurnCommand(cli);
  if (cli.ov.factor > 0) return RunOverloadCommand(cli);
  auto batches = kvbridge::bench::ParseBatches(cli.batches);
  if (!batches.ok()) {
    std::fprintf(stderr, "error: %s\n", batches.status().ToString().c_str());
    return 2;
  }
  cli.o.batches = *batches;
  cli.o.shuffle = !cli.no_shuffle;
  cli.o.check_drain = check_drain;
  // `--check-drain` given without URLs leaves one empty entry: that means "ask /instances".
  std::erase(cli.o.drain_urls, std::string());
  if (cli.o.prompts_file.empty()) {
    std::fprintf(stderr,
                 "bench: no --prompts file: using %d synthetic prompts (seed %llu) built here\n",
                 std::max(1, cli.o.synthetic_prompts), static_cast<unsigned long long>(cli.o.seed));
  }
  const bool tty = ::isatty(2);
  // On a terminal one line redrawn in place; into a file or pipe a line every 5 s (and one per
  // batch), not the 5 per second RunBench reports.
  auto throttle = std::make_shared<kvbridge::bench::ProgressThrottle>(tty);
  auto progress = [throttle](const std::string& line) {
    const std::string out = throttle->Format(line, std::chrono::steady_clock::now());
    if (!out.empty()) std::fputs(out.c_str(), stderr);
  };
  auto report = kvbridge::bench::RunBench(cli.o, progress);
  if (tty) std::fprintf(stderr, "\n");
  if (!report.ok()) {
    std::fprintf(stderr, "error: %s\n", report.status().ToString().c_str());
    return 2;
  }
  if (cli.json) {
    std::printf("%s\n", kvbridge::bench::ReportJson(*report).c_str());
  } else {
    std::printf("%s", kvbridge::bench::FormatTable(*report).c_str());
  }
  return report->ok ? 0 : 1;
}

const bool kRegistered = kvbridge::apps::RegisterCommand(
    "bench", "Drive /v1/completions over concurrency levels; report latency and KV drain",
    [](CLI::App& sub) -> kvbridge::apps::CommandMain {
      auto c = std::make_shared<BenchCli>();
      auto& o = c->o;
      sub.add_option("--host", o.host, "Base URL (proxy or engine)")->capture_default_str();
      sub.add_option("--path", o.path, "Endpoint")->capture_default_str();
      sub.add_option("--prompts", o.prompts_file, "JSONL file with a model_input field per row");
      sub.add_option("--model", o.model, "model field (default: first of GET /v1/models)");
      sub.add_option("--samples", o.samples, "Requests per batch")->capture_default_str();
      sub.add_option("--batches", c->batches, "Concurrency levels, one batch each: 3,4,8")
          ->capture_default_str();
      sub.add_option("--input-tokens", o.input_tokens,
                     "Sent as truncate_prompt_tokens (±100 jitter); 0 = not sent")
          ->capture_default_str();
      sub.add_option("--output-tokens", o.output_tokens, "max_tokens (±10 jitter)")
          ->capture_default_str();
      sub.add_option("--best-of-n", o.best_of_n, "Sent as n")->capture_default_str();
      sub.add_option("--max-latency", o.max_latency_s,
                     "Stop the sweep when a batch's mean and p50 latency exceed this (s)");
      sub.add_flag("--no-shuffle-input", c->no_shuffle, "Keep the prompts' order");
      sub.add_option("--seed", o.seed, "Seed for shuffling and jitter")->capture_default_str();
      sub.add_flag("--stream", o.stream, "Request SSE streams; reports TTFT and TPOT");
      sub.add_flag("--json", c->json, "Print a JSON summary instead of the table");
      auto* drain = sub.add_option("--check-drain", o.drain_urls,
                                   "After each batch, wait for these instances' KV to drain "
                                   "(no URL: every instance GET {host}/instances lists)")
                        ->expected(0, -1);
      sub.add_option("--drain-timeout", o.drain_timeout_s,
                     "Seconds after a batch's last response for the drain")
          ->capture_default_str();
      sub.add_option("--request-timeout", o.request_timeout_s, "Seconds per request")
          ->capture_default_str();
      sub.add_flag("--multi-turn", c->multi_turn,
                   "Conversations through /v1/chat/completions (streamed): --prompts rows with a "
                   "\"turns\" list; per-turn TTFT, cache hit rate, prompt tokens computed");
      sub.add_option("--conversations", c->mt.conversations,
                     "--multi-turn: conversations (0 = every row)")
          ->capture_default_str();
      sub.add_option("--concurrency", c->mt.concurrency,
                     "--multi-turn: conversations in flight within a turn")
          ->capture_default_str();
      sub.add_option("--max-turns", c->mt.max_turns, "--multi-turn: turns (0 = all)")
          ->capture_default_str();
      sub.add_option("--answer-tokens", c->mt.output_tokens, "--multi-turn: max_tokens per answer")
          ->capture_default_str();
      sub.add_option(
          "--metrics-url", c->mt.metrics_urls,
          "--multi-turn: engines whose /metrics to read (default: GET {host}/instances)");
      c->ov.factor = 0;  // off unless --overload
      sub.add_option("--overload", c->ov.factor,
                     "Overload measure: X times the capacity (measured first by a closed loop) "
                     "for --overload-seconds, open loop; every answer must be a 200 or a "
                     "429/503 with Retry-After, then every instance drains (exit 1 otherwise)");
      sub.add_option("--overload-seconds", c->ov.seconds, "--overload: how long")
          ->capture_default_str();
      sub.add_option("--probe-concurrency", c->ov.probe_concurrency,
                     "--overload: clients of the capacity probe")
          ->capture_default_str();
      sub.add_option("--probe-seconds", c->ov.probe_seconds, "--overload: the probe's length")
          ->capture_default_str();
      sub.add_option("--capacity", c->ov.capacity_rps,
                     "--overload: capacity in requests/s (skips the probe)");
      sub.add_option("--overload-clients", c->ov.clients,
                     "--overload: sender threads (arrivals finding none free go late)")
          ->capture_default_str();
      return [c, drain] { return RunBenchCommand(*c, drain->count() > 0); };
    });

}  // namespace
