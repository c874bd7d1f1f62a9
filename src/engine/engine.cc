// The threaded Engine: one thread owns an EngineCore; other threads post commands to it.
#include "kvbridge/engine/engine.h"

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <variant>

#include "kvbridge/common/logging.h"
#include "kvbridge/common/process_metrics.h"
#include "kvbridge/common/thread_annotations.h"
#include "kvbridge/engine/engine_core.h"
#include "kvbridge/model/model.h"

namespace kvbridge {

namespace {

class EngineImpl final : public Engine {
 public:
  EngineImpl() = default;
  ~EngineImpl() override { Shutdown(); }

  Status Init(const EngineConfig& config, std::shared_ptr<const Model> model) {
    model_ = model;
    config_ = config;
    ASSIGN_OR_RETURN(core_,
                     EngineCore::Create(config, std::move(model), &metrics_, [this] { Wake(); }));
    core_->set_clock(SteadyNow);
    m_running_ = &metrics_.AddGauge("kvbridge_requests_running", "Sequences running.");
    AddProcessMetrics(metrics_);
    m_waiting_ = &metrics_.AddGauge("kvbridge_requests_waiting", "Sequences waiting or preempted.");
    m_waiting_remote_ =
        &metrics_.AddGauge("kvbridge_requests_waiting_for_remote_kv",
                           "Requests waiting for remote KV (WAITING_FOR_REMOTE_KVS).");
    m_blocks_total_ = &metrics_.AddGauge("kvbridge_kv_blocks_total", "KV blocks in the pool.");
    m_blocks_active_ = &metrics_.AddGauge(
        "kvbridge_kv_blocks_active", "Distinct KV blocks referenced by a live request or held.");
    m_blocks_held_ = &metrics_.AddGauge("kvbridge_kv_blocks_held_for_transfer",
                                        "Distinct KV blocks with a transfer hold.");
    m_blocks_cached_ = &metrics_.AddGauge("kvbridge_kv_blocks_cached_free",
                                          "Unreferenced KV blocks kept as prefix-cache entries.");
    for (const char* phase : {"prefill", "decode"}) {
      const std::string l = std::string("phase=\"") + phase + "\"";
      const int i = phase[0] == 'p' ? 0 : 1;
      m_step_seconds_[i] = &metrics_.AddCounter(
          "kvbridge_engine_step_seconds_total",
          "Wall time of engine steps (schedule + forward + sampling); phase prefill: a step "
          "with a prompt chunk, decode: only one-token rows.",
          l);
      m_steps_[i] =
          &metrics_.AddCounter("kvbridge_engine_steps_total", "Engine steps that ran a batch.", l);
    }
    metrics_
        .AddGauge("kvbridge_model_weight_bytes",
                  "Bytes of model weights resident for compute (matrices in their resident type, "
                  "memory-mapped in place or converted by --dtype, plus fp32 norms and biases).")
        .Set(static_cast<double>(model_->weight_bytes()));
    metrics_.AddGauge("kvbridge_model_weight_file_bytes", "Bytes of the model's safetensors files.")
        .Set(static_cast<double>(model_->weight_file_bytes()));
    PublishStats();
    thread_ = std::thread([this] { Loop(); });
    return OkStatus();
  }

  Status AddRequest(EngineRequest request, OutputCallback on_output) override {
    RETURN_IF_ERROR(core_->ValidateRequest(request));
    MutexLock lock(&mu_);
    if (stopping_) return UnavailableError("engine is shut down");
    if (live_ids_.count(request.request_id)) {
      return AlreadyExistsError("request id '" + request.request_id + "' is already in use");
    }
    if (num_queued_adds_ + waiting_snapshot_ >= config_.max_waiting_requests) {
      return ResourceExhaustedError("engine: " + std::to_string(config_.max_waiting_requests) +
                                    " requests already waiting");
    }
    if (request.arrival_time == 0) request.arrival_time = SteadyNow();
    live_ids_.insert(request.request_id);
    ++num_queued_adds_;
    commands_.push_back(AddCmd{std::move(request), std::move(on_output)});
    cv_.notify_one();
    return OkStatus();
  }

  void Abort(const std::string& request_id) override {
    MutexLock lock(&mu_);
    if (!live_ids_.count(request_id)) return;
    commands_.push_back(AbortCmd{request_id});
    cv_.notify_one();
  }

  EngineStats Stats() const override {
    MutexLock lock(&stats_mu_);
    return stats_;
  }

  MetricsRegistry& metrics() override { return metrics_; }
  const Model& model() const override { return *model_; }

  void Shutdown() override {
    {
      MutexLock lock(&mu_);
      if (stopping_) {
        if (!thread_.joinable()) return;
      }
      stopping_ = true;
      cv_.notify_one();
    }
    if (thread_.joinable()) thread_.join();
  }

 private:
  struct AddCmd {
    EngineRequest request;
    OutputCallback on_output;
  };
  struct AbortCmd {
    std::string request_id;
  };
  using Command = std::variant<AddCmd, AbortCmd>;

  void Wake() {
    MutexLock lock(&mu_);
    wake_ = true;
    cv_.notify_one();
  }

  void Deliver(std::vector<RequestOutput> outs) {
    for (RequestOutput& out : outs) {
      auto it = callbacks_.find(out.request_id);
      if (it == callbacks_.end()) continue;
      OutputCallback cb = it->second;
      if (out.finished) {
        callbacks_.erase(it);
        // The id is free before the final callback runs, so the callback's owner may reuse it.
        MutexLock lock(&mu_);
        live_ids_.erase(out.request_id);
      }
      if (cb) cb(out);
    }
  }

  void FailNow(const std::string& id, const OutputCallback& cb, Status st, const char* reason) {
    RequestOutput out;
    out.request_id = id;
    out.finished = true;
    out.error = std::move(st);
    CompletionOutput co;
    co.finished = true;
    co.finish_reason = reason;
    out.outputs.push_back(co);
    {
      MutexLock lock(&mu_);
      live_ids_.erase(id);
    }
    if (cb) cb(out);
  }

  void Apply(Command& cmd, TimePoint now) {
    if (auto* add = std::get_if<AddCmd>(&cmd)) {
      std::string id = add->request.request_id;
      Status st = core_->AddRequest(std::move(add->request), now);
      if (!st.ok()) {
        FailNow(id, add->on_output, st, "error");
        return;
      }
      callbacks_[id] = std::move(add->on_output);
    } else {
      auto& ab = std::get<AbortCmd>(cmd);
      core_->Abort(ab.request_id, now);
    }
  }

  // `applied_adds`: AddCmds applied since the last call, no longer queued once this publishes
  // the waiting count that holds them.
  void PublishStats(int applied_adds = 0) {
    EngineStats s = core_->Stats();
    m_running_->Set(s.running);
    m_waiting_->Set(s.waiting);
    m_waiting_remote_->Set(s.waiting_for_remote_kv);
    m_blocks_total_->Set(static_cast<double>(s.kv_blocks_total));
    m_blocks_active_->Set(static_cast<double>(s.kv_blocks_active));
    m_blocks_held_->Set(static_cast<double>(s.kv_blocks_held_for_transfer));
    m_blocks_cached_->Set(static_cast<double>(s.kv_blocks_cached_free));
    if (VllmMetrics* v = core_->scheduler().vllm_metrics()) {
      v->SetSchedulerState(s.running, s.waiting + s.waiting_for_remote_kv,
                           s.kv_blocks_total > 0 ? static_cast<double>(s.kv_blocks_active) /
                                                       static_cast<double>(s.kv_blocks_total)
                                                 : 0.0);
    }
    {
      MutexLock lock(&stats_mu_);
      stats_ = s;
    }
    MutexLock lock(&mu_);
    num_queued_adds_ -= applied_adds;
    waiting_snapshot_ = s.waiting + s.waiting_for_remote_kv;
  }

  void Loop() {
    bool idle = false;
    while (true) {
      std::deque<Command> cmds;
      {
        MutexLock lock(&mu_);
        if (idle && !stopping_ && commands_.empty() && !wake_) {
          std::optional<TimePoint> deadline = core_->NextDeadline();
          auto pred = [this]() REQUIRES(mu_) { return stopping_ || !commands_.empty() || wake_; };
          if (deadline) {
            DurationUs wait = std::max<DurationUs>(0, *deadline - SteadyNow());
            cv_.wait_for(lock.native(), std::chrono::microseconds(wait), pred);
          } else {
            cv_.wait(lock.native(), pred);
          }
        }
        if (stopping_) break;
        cmds.swap(commands_);
        wake_ = false;
      }
      // The adds taken stay counted as queued until the waiting count that includes them is
      // published (PublishStats, under mu_): else an AddRequest in between would see neither and
      // admit past max_waiting_requests.
      int taken_adds = 0;
      for (const Command& c : cmds) taken_adds += std::holds_alternative<AddCmd>(c) ? 1 : 0;
      TimePoint now = SteadyNow();
      for (Command& c : cmds) Apply(c, now);
      // Stats before the callbacks: a client that has its answer (and reads /metrics at once)
      // sees its blocks freed.
      PublishStats(taken_adds);
      Deliver(core_->TakeOutputs());
      const auto step_start = std::chrono::steady_clock::now();
      Result<EngineCore::StepResult> r = core_->Step(now);
      if (r.ok() && r->made_progress) {
        const int i = r->num_tokens > r->num_sequences ? 0 : 1;
        m_step_seconds_[i]->Inc(
            std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count());
        m_steps_[i]->Inc();
      }
      PublishStats();
      Deliver(core_->TakeOutputs());
      idle = !r.ok() ? false : !r->made_progress;
    }
    // Shutdown: every queued and unfinished request ends with "abort".
    std::deque<Command> cmds;
    {
      MutexLock lock(&mu_);
      cmds.swap(commands_);
      num_queued_adds_ = 0;
    }
    for (Command& c : cmds) {
      if (auto* add = std::get_if<AddCmd>(&c)) {
        FailNow(add->request.request_id, add->on_output, OkStatus(), "abort");
      }
    }
    TimePoint now = SteadyNow();
    for (const std::string& id : core_->RequestIds()) core_->Abort(id, now);
    Deliver(core_->TakeOutputs());
    PublishStats();
  }

  EngineConfig config_;
  std::shared_ptr<const Model> model_;
  MetricsRegistry metrics_;
  std::unique_ptr<EngineCore> core_;                           // engine thread only (after Init)
  std::unordered_map<std::string, OutputCallback> callbacks_;  // engine thread only

  Mutex mu_;
  std::condition_variable cv_;
  std::deque<Command> commands_ GUARDED_BY(mu_);
  std::unordered_set<std::string> live_ids_ GUARDED_BY(mu_);
  int num_queued_adds_ GUARDED_BY(mu_) = 0;
  int waiting_snapshot_ GUARDED_BY(mu_) = 0;
  bool wake_ GUARDED_BY(mu_) = false;
  bool stopping_ GUARDED_BY(mu_) = false;

  mutable Mutex stats_mu_;
  EngineStats stats_ GUARDED_BY(stats_mu_);

  Gauge* m_running_ = nullptr;
  Gauge* m_waiting_ = nullptr;
  Gauge* m_waiting_remote_ = nullptr;
  Gauge* m_blocks_total_ = nullptr;
  Gauge* m_blocks_active_ = nullptr;
  Gauge* m_blocks_held_ = nullptr;
  Gauge* m_blocks_cached_ = nullptr;
  Counter* m_step_seconds_[2] = {nullptr, nullptr};  // [prefill, decode]
  Counter* m_steps_[2] = {nullptr, nullptr};
  std::thread thread_;
};

}  // namespace

Result<std::unique_ptr<Engine>> Engine::Create(const EngineConfig& config,
                                               std::shared_ptr<const Model> model) {
  auto impl = std::make_unique<EngineImpl>();
  RETURN_IF_ERROR(impl->Init(config, std::move(model)));
  return std::unique_ptr<Engine>(std::move(impl));
}

}  // namespace kvbridge
