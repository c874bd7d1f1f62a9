// src/server/fake_engine.h — a deterministic stand-in Engine for the server's unit tests.
//
// It honours the Engine contract that the HTTP layer relies on (callbacks on its own thread,
// siblings, max_tokens/min_tokens/stop, logprobs, Abort in any state, ResourceExhausted when
// its queue is full) and accounts KV blocks like the real one: a request references
// ceil(tokens / block_size) blocks per sibling while live. Outputs are a pure function of the
// prompt, so tests assert exact text. Test-only; not part of kvbridge_server.
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <thread>

#include "kvbridge/common/thread_annotations.h"
#include "kvbridge/engine/engine.h"
#include "kvbridge/model/tokenizer.h"
#include "kvbridge/server/api_server.h"

namespace kvbridge::server::testing {

/// The tests' byte tokenizer: bytes are tokens 0..255; 256 is special (never added to
/// prompts), EOS 257 (Decode renders neither); vocabulary 258.
struct ByteCodec {
  static constexpr int32_t kBos = 256;
  static constexpr int32_t kEos = 257;
  static Tokenizer Make() { return Tokenizer(258, /*bos_id=*/-1, kEos, /*pad_id=*/-1); }
};

struct FakeEngineOptions {
  int block_size = 4;
  int64_t num_blocks = 4096;
  int max_model_len = 256;
  int max_waiting_requests = 1024;
  int step_interval_ms = 2;  ///< one token per sibling per step
  /// Token j of sibling i of a prompt whose ids sum to s: 'a' + (s + 3*j + 5*i) % 26; a sibling
  /// emits EOS at position `eos_at` (when >= 0 and not ignore_eos).
  int eos_at = -1;
  /// Non-empty: every sibling writes these bytes (one token each, then EOS) instead: a fixed
  /// model output, e.g. a tool call for the parsers' end-to-end tests.
  std::string scripted_output;
};

class FakeEngine : public Engine {
 public:
  explicit FakeEngine(FakeEngineOptions options = {});
  ~FakeEngine() override;

  /// The token FakeEngine emits at position j of sibling i for a prompt with id sum `sum`.
  static int32_t TokenAt(int64_t sum, int j, int i) {
    return static_cast<int32_t>('a' + (sum + 3 * j + 5 * i) % 26);
  }

  Status AddRequest(EngineRequest request, OutputCallback on_output) override;
  void Abort(const std::string& request_id) override;
  EngineStats Stats() const override;
  MetricsRegistry& metrics() override { return metrics_; }
  const Model& model() const override;
  void Shutdown() override;

  /// Pauses/resumes stepping (requests queue up while paused).
  void SetPaused(bool paused);
  int64_t requests_added() const;
  /// The last request accepted (for assertions on parsing).
  EngineRequest last_request() const;

 private:
  struct Live {
    EngineRequest req;
    OutputCallback cb;
    std::vector<int> generated;  // per sibling
    std::vector<bool> done;
    std::vector<std::string> text;  // per sibling, for stop strings
    bool abort = false;
  };
  void Loop();
  int64_t BlocksOf(const Live& l) const;

  FakeEngineOptions options_;
  mutable Mutex mu_;
  std::condition_variable cv_;
  std::map<std::string, std::unique_ptr<Live>> live_ GUARDED_BY(mu_);
  bool paused_ GUARDED_BY(mu_) = false;
  bool stop_ GUARDED_BY(mu_) = false;
  int64_t added_ GUARDED_BY(mu_) = 0;
  EngineRequest last_ GUARDED_BY(mu_);
  MetricsRegistry metrics_;
  std::thread thread_;
};

}  // namespace kvbridge::server::testing
