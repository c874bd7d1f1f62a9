// kvbridge/engine/engine.h — one inference engine: scheduler + KV cache + model, behind a
// thread-safe front door.
//
// One engine thread owns the scheduler and the KV cache (DESIGN.md "inside an engine"); callers
// on other threads submit requests and receive outputs through callbacks invoked on that thread.
//
//   ASSIGN_OR_RETURN(auto engine, Engine::Create(config, model));
//   EngineRequest req{.request_id = "cmpl-1", .prompt_token_ids = ids};
//   req.sampling.n = 8; req.sampling.max_tokens = 32;
//   RETURN_IF_ERROR(engine->AddRequest(std::move(req), [](const RequestOutput& out) { ... }));
//
// The value types (EngineRequest, RequestOutput, EngineConfig, ...) are in request.h.
//
// Thread-safety: every public method may be called from any thread.
// CONTRACT NOTE: the serve, connector and proxy modules build on these names; extend, don't rename.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "kvbridge/common/metrics.h"
#include "kvbridge/common/status.h"
#include "kvbridge/engine/request.h"

namespace kvbridge {

class Model;

class Engine {
 public:
  using OutputCallback = std::function<void(const RequestOutput&)>;

  /// Starts the engine thread. Errors: InvalidArgument (bad config), ResourceExhausted (pool).
  static Result<std::unique_ptr<Engine>> Create(const EngineConfig& config,
                                                std::shared_ptr<const Model> model);
  virtual ~Engine() = default;

  /// Queues a request. `on_output` runs on the engine thread for each step's news; the last call
  /// has finished = true. Errors (nothing queued): InvalidArgument (empty prompt, prompt longer
  /// than max_model_len, bad sampling), AlreadyExists (duplicate id), ResourceExhausted (queue
  /// full).
  virtual Status AddRequest(EngineRequest request, OutputCallback on_output) = 0;
  /// Aborts a request in any state; its final output has finish_reason "abort". Unknown ids: no-op.
  virtual void Abort(const std::string& request_id) = 0;
  virtual EngineStats Stats() const = 0;
  /// The engine's Prometheus metrics (kvbridge_* names, see docs/metrics.md).
  virtual MetricsRegistry& metrics() = 0;
  virtual const Model& model() const = 0;
  /// Stops the engine thread; pending requests end with finish_reason "abort".
  virtual void Shutdown() = 0;
};

}  // namespace kvbridge
