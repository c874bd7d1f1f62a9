#include "server/fake_engine.h"

#include <chrono>
#include <cstdlib>
#include <numeric>

namespace kvbridge::server::testing {

FakeEngine::FakeEngine(FakeEngineOptions options) : options_(options) {
  metrics_.AddCallbackGauge("kvbridge_kv_blocks_active", "Blocks referenced.",
                            [this] { return static_cast<double>(Stats().kv_blocks_active); });
  metrics_.AddCallbackGauge("kvbridge_requests_running", "Running.",
                            [this] { return static_cast<double>(Stats().running); });
  thread_ = std::thread([this] { Loop(); });
}

FakeEngine::~FakeEngine() { Shutdown(); }

const Model& FakeEngine::model() const { std::abort(); }

int64_t FakeEngine::BlocksOf(const Live& l) const {
  int64_t blocks = 0;
  const int64_t p = static_cast<int64_t>(l.req.prompt_token_ids.size());
  for (int g : l.generated) blocks += (p + g + options_.block_size - 1) / options_.block_size;
  return blocks;
}

Status FakeEngine::AddRequest(EngineRequest request, OutputCallback on_output) {
  if (request.prompt_token_ids.empty()) return InvalidArgumentError("empty prompt");
  if (static_cast<int>(request.prompt_token_ids.size()) > options_.max_model_len) {
    return InvalidArgumentError("prompt longer than max_model_len");
  }
  if (request.sampling.n < 1 || request.sampling.max_tokens < 1) {
    return InvalidArgumentError("bad sampling");
  }
  MutexLock l(&mu_);
  if (stop_) return UnavailableError("engine stopped");
  if (live_.count(request.request_id)) return AlreadyExistsError(request.request_id);
  if (static_cast<int>(live_.size()) >= options_.max_waiting_requests) {
    return ResourceExhaustedError("engine queue is full");
  }
  auto live = std::make_unique<Live>();
  const int n = request.sampling.n;
  live->generated.assign(n, 0);
  live->done.assign(n, false);
  live->text.assign(n, "");
  live->cb = std::move(on_output);
  last_ = request;
  live->req = std::move(request);
  live_[live->req.request_id] = std::move(live);
  ++added_;
  cv_.notify_all();
  return OkStatus();
}

void FakeEngine::Abort(const std::string& request_id) {
  MutexLock l(&mu_);
  auto it = live_.find(request_id);
  if (it != live_.end()) it->second->abort = true;
  cv_.notify_all();
}

EngineStats FakeEngine::Stats() const {
  MutexLock l(&mu_);
  EngineStats s;
  s.running = static_cast<int>(live_.size());
  s.kv_blocks_total = options_.num_blocks;
  for (const auto& [id, live] : live_) s.kv_blocks_active += BlocksOf(*live);
  s.kv_blocks_free = s.kv_blocks_total - s.kv_blocks_active;
  return s;
}

void FakeEngine::Shutdown() {
  {
    MutexLock l(&mu_);
    if (stop_ && !thread_.joinable()) return;
    stop_ = true;
    for (auto& [id, live] : live_) live->abort = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

void FakeEngine::SetPaused(bool paused) {
  MutexLock l(&mu_);
  paused_ = paused;
  cv_.notify_all();
}

int64_t FakeEngine::requests_added() const {
  MutexLock l(&mu_);
  return added_;
}

EngineRequest FakeEngine::last_request() const {
  MutexLock l(&mu_);
  return last_;
}

void FakeEngine::Loop() {
  MutexLock l(&mu_);
  for (;;) {
    cv_.wait_for(l.native(), std::chrono::milliseconds(options_.step_interval_ms));
    bool any_abort = false;
    for (auto& [id, live] : live_) any_abort |= live->abort;
    if (stop_ && live_.empty()) return;
    if (paused_ && !any_abort) continue;
    std::vector<std::pair<OutputCallback, RequestOutput>> outs;
    for (auto it = live_.begin(); it != live_.end();) {
      Live& lv = *it->second;
      if (paused_ && !lv.abort) {
        ++it;
        continue;
      }
      RequestOutput out;
      out.request_id = lv.req.request_id;
      out.num_prompt_tokens = static_cast<int>(lv.req.prompt_token_ids.size());
      const int64_t sum = std::accumulate(lv.req.prompt_token_ids.begin(),
                                          lv.req.prompt_token_ids.end(), int64_t{0});
      const SamplingParams& sp = lv.req.sampling;
      bool all_done = true;
      for (int i = 0; i < sp.n; ++i) {
        if (lv.done[i]) continue;
        CompletionOutput co;
        co.index = i;
        if (lv.abort) {
          co.finished = true;
          co.finish_reason = "abort";
        } else {
          const int j = lv.generated[i];
          int32_t tok = TokenAt(sum, j, i);
          if (!options_.scripted_output.empty()) {
            tok = j < static_cast<int>(options_.scripted_output.size())
                      ? static_cast<unsigned char>(options_.scripted_output[j])
                      : ByteCodec::kEos;
          }
          if (options_.eos_at >= 0 && j == options_.eos_at && !sp.ignore_eos &&
              j >= sp.min_tokens) {
            tok = ByteCodec::kEos;
          }
          co.new_token_ids.push_back(tok);
          if (sp.logprobs >= 0) {
            TokenLogprob lp{tok, -0.5f, {}};
            for (int k = 0; k < sp.logprobs; ++k) {
              lp.top.push_back({k == 0 ? tok : static_cast<int32_t>('A' + k), -0.5f - k});
            }
            co.new_logprobs.push_back(lp);
          }
          ++lv.generated[i];
          if (tok < 256) lv.text[i].push_back(static_cast<char>(tok));
          if (tok == ByteCodec::kEos) {
            co.finished = true;
            co.finish_reason = "stop";
            if (!sp.include_stop_str_in_output) co.text_tokens = lv.generated[i] - 1;
          } else if (lv.generated[i] > sp.min_tokens) {
            // The engine's semantics, for strings that end the text (one byte per token).
            for (const std::string& s : sp.stop) {
              if (lv.text[i].size() >= s.size() &&
                  lv.text[i].compare(lv.text[i].size() - s.size(), s.size(), s) == 0) {
                co.finished = true;
                co.finish_reason = "stop";
                co.stop_reason = s;
                co.text_len = static_cast<int64_t>(lv.text[i].size() -
                                                   (sp.include_stop_str_in_output ? 0 : s.size()));
                break;
              }
            }
          }
          if (!co.finished && lv.generated[i] >= sp.max_tokens) {
            co.finished = true;
            co.finish_reason = "length";
          }
        }
        if (co.finished) lv.done[i] = true;
        all_done &= lv.done[i];
        out.outputs.push_back(std::move(co));
      }
      out.finished = all_done;
      if (all_done && !lv.req.kv_transfer_params.is_null()) {
        out.kv_transfer_params = {{"echo", lv.req.kv_transfer_params}};
      }
      outs.emplace_back(lv.cb, std::move(out));
      if (all_done) {
        it = live_.erase(it);
      } else {
        ++it;
      }
    }
    l.Unlock();
    for (auto& [cb, out] : outs) cb(out);  // outside the lock: callbacks may call Stats()
    l.Lock();
  }
}

}  // namespace kvbridge::server::testing
