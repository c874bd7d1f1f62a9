// sim/sim_connector.h — the engine-side connector of a simulated engine: the runtime's
// ConnectorLogic with the simulator as its sink, plus an exactly-once ledger. Internal to src/sim
// (not installed): the simulator's parts share these declarations.
#pragma once

#include <algorithm>
#include <cstdarg>
#include <cstdio>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <random>
#include <set>
#include <string>
#include <tuple>
#include <utility>
#include <variant>
#include <vector>

#include "kvbridge/connector/connector_logic.h"
#include "kvbridge/connector/decode_core.h"
#include "kvbridge/connector/kv_transfer_config.h"
#include "kvbridge/connector/messages.h"
#include "kvbridge/connector/prefill_core.h"
#include "kvbridge/connector/tp_plan.h"
#include "kvbridge/connector/write_decode_core.h"
#include "kvbridge/connector/write_prefill_core.h"
#include "kvbridge/engine/block_pool.h"
#include "kvbridge/engine/kv_connector.h"
#include "kvbridge/engine/scheduler.h"
#include "kvbridge/proxy/flow.h"
#include "sim/knobs.h"

namespace kvbridge::sim::internal {

// ------------------------------------------------------------------------------------------
class Sim;

struct InMsg {
  ControlMessage msg;
  uint64_t reply_token = 0;
};
struct InReadEnded {
  uint64_t read_id = 0;
  Status status;
};
struct InWriteEnded {
  uint64_t write_id = 0;
  Status status;
};
struct InPeerLost {
  std::string engine_id;
  PeerLoss loss = PeerLoss::kGone;
};
using InEvent = std::variant<InMsg, InReadEnded, InWriteEnded, InPeerLost>;

// The engine-side connector: the runtime's own ConnectorLogic (connector_logic.h: the hook
// mapping and the four cores) behind the engine's KvConnector hooks, with the simulator as its
// sink (fake transfers and network). It also keeps a ledger of what the engine holds, drains and
// loads, to check that every report names a request in the right state, exactly once.
class SimConnector final : public KvConnector, private ConnectorSink {
 public:
  SimConnector(Sim* sim, int engine, const std::string& engine_id, int port, const Knobs& k)
      : sim_(sim),
        engine_(engine),
        engine_id_(engine_id),
        port_(port),
        logic_(SimTransferConfig(k),
               {.engine_id = engine_id,
                .tp_size = engine < k.num_prefill ? k.prefill_tp : k.decode_tp,
                .num_kv_heads = k.num_kv_heads,
                .block_size = k.block_size,
                .num_layers = k.num_layers},
               this) {}

  Result<Match> GetNumNewMatchedTokens(const ConnectorRequestInfo& req, int num_local_computed,
                                       TimePoint now) override {
    return logic_.GetNumNewMatchedTokens(req, num_local_computed, now);
  }
  void UpdateStateAfterAlloc(const ConnectorRequestInfo& req, std::span<const int32_t> block_ids,
                             int num_local_computed, int num_external, TimePoint now) override;
  FinishDecision RequestFinished(const ConnectorRequestInfo& req,
                                 std::span<const int32_t> block_ids, std::string_view finish_reason,
                                 TimePoint now) override {
    return logic_.RequestFinished(req, block_ids, finish_reason, now);
  }
  bool RequestAborted(const ConnectorRequestInfo& req, TimePoint now) override;
  void RequestQueued(const ConnectorRequestInfo& req, TimePoint now) override {
    logic_.RequestQueued(req, now);
  }
  StepReport Poll(TimePoint now) override;
  void OnLayerKvWritten(int layer, std::span<const LayerKvChunk> chunks, TimePoint now) override {
    // What arrived during the forward pass is taken first, as the runtime does.
    if (!logic_.WantsLayers()) return;
    HandleInbox(now);
    logic_.OnLayerKvWritten(layer, chunks, now);
  }
  std::optional<TimePoint> NextDeadline() const override { return logic_.NextDeadline(); }
  bool Idle() const override { return logic_.Idle() && inbox_.empty(); }

  void Push(InEvent e) { inbox_.push_back(std::move(e)); }
  const PrefillCore& prefill() const { return logic_.cores().prefill; }
  const DecodeCore& decode() const { return logic_.cores().decode; }
  const WritePrefillCore& wprefill() const { return logic_.cores().wprefill; }
  const WriteDecodeCore& wdecode() const { return logic_.cores().wdecode; }
  size_t num_ledger_held() const { return held_.size(); }
  size_t num_ledger_held_read() const {
    size_t n = 0;
    for (const auto& [id, h] : held_) n += h.write ? 0 : 1;
    return n;
  }
  size_t num_ledger_draining() const { return draining_.size(); }
  size_t num_ledger_loading() const { return loading_.size(); }
  size_t num_write_decodes() const { return logic_.NumAwaitingAlloc(); }
  size_t inbox_size() const { return inbox_.size(); }
  int64_t lease_expired() const {
    // A claim lease that fires is a lease too (0 in fault-free runs).
    return prefill().counters().lease_expired + prefill().counters().claims_expired +
           wprefill().counters().lease_expired;
  }
  /// What is bound here to peer `engine_id` (ConnectorCores::BoundTo).
  std::pair<int64_t, int64_t> BoundTo(const std::string& engine_id) const {
    return logic_.cores().BoundTo(engine_id);
  }
  int64_t notifications_ignored() const {
    return prefill().counters().notifications_ignored + decode().counters().notifications_ignored +
           wprefill().counters().notifications_ignored + wdecode().counters().notifications_ignored;
  }

 private:
  void HandleInbox(TimePoint now);

  // ConnectorSink: the simulator performs the transfers and carries the messages.
  Status PostTransfer(const TransferAction& t) override;
  Status CancelTransfer(KvTransferMode op, uint64_t id) override;
  void Send(const SendMessageAction& a) override;
  void OnReport(const ConnectorLogic::Report& r) override;
  void Note(const RequestNote& n) override;
  std::pair<std::string, int> AdvertisedEndpoint() const override { return {"sim", port_}; }

  Sim* sim_;
  int engine_;
  std::string engine_id_;
  int port_;
  ConnectorLogic logic_;  // the runtime's hook mapping and cores
  std::vector<InEvent> inbox_;
  struct Held {
    std::string transfer_id;
    bool write = false;
  };
  std::map<std::string, Held> held_;              // finished, blocks held for a transfer
  std::set<std::string> draining_;                // aborted, blocks kept until a report
  std::set<std::string> loading_;                 // waiting for remote KV
  std::map<std::string, std::string> load_tid_;   // loading request -> transfer_id
  std::set<std::string> released_;                // READ transfers the proxy released here
  int64_t leases_before_poll_ = 0;                // PrefillCore's lease expiries when Poll began
  int64_t peer_lost_before_poll_ = 0;             // PrefillCore's peer-loss frees when Poll began
  std::map<std::string, std::string> write_tid_;  // WRITE decode request -> transfer_id
};

}  // namespace kvbridge::sim::internal
