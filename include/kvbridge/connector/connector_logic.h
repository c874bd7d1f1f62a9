// kvbridge/connector/connector_logic.h — the connector's whole protocol logic, sans-IO: the
// mapping from the engine's KvConnector hooks and the transport's events to the four protocol
// cores (ConnectorCores), written once. Two drivers wrap it: the runtime's KvBridgeConnector
// (src/connector/kvbridge_connector.cc: transfer agents, watcher thread, peer directory, metrics)
// and the simulator's SimConnector (src/sim: a fake network and a release ledger). Each driver
// is a ConnectorSink: it performs what the logic asks (post / cancel a transfer, send a message)
// and feeds the results back as events on a later turn (OnTransferEnded, OnMessage).
//
//   class Shell : public KvConnector, private ConnectorSink { ... };   // the driver
//   ConnectorLogic logic(config, {.engine_id = id, .tp_size = 2, .block_size = 16}, &shell);
//   ASSIGN_OR_RETURN(auto m, logic.GetNumNewMatchedTokens(req, 0, now));  // → sink.PostTransfer...
//   logic.OnTransferEnded(KvTransferMode::kRead, id, OkStatus(), now);  // → sink.Send(ReadDone)
//   KvConnector::StepReport r = logic.Poll(now);  // timers, then what the engine must hear
//
// Every entry point runs the cores, then performs their actions through the sink until none is
// left (a transfer the sink could not start ends at once with the sink's status). A request's
// kv_transfer_params is parsed once (ParamsOf) and kept while the request lives.
//
// Thread-safety: not thread-safe; one owner thread (the engine thread, or the simulator). The
// sink is called on that thread, from inside the logic's calls, and must not call back into it.
#pragma once

#include <cstdint>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/status.h"
#include "kvbridge/connector/actions.h"
#include "kvbridge/connector/connector_cores.h"
#include "kvbridge/connector/kv_transfer_config.h"
#include "kvbridge/connector/messages.h"
#include "kvbridge/engine/kv_connector.h"

namespace kvbridge {

/// A transfer to post: a READ (decode side, READ mode) or a WRITE (prefill side, WRITE mode),
/// one shape for both (actions.h); `op` and `id` name it in OnTransferEnded and CancelTransfer.
using TransferAction = PostTransferAction;

/// What the logic decided about one request, told to the sink before the actions that follow
/// (a runtime's timeline, a simulator's ledger). It has no effect on the protocol.
struct RequestNote {
  enum class Kind : uint8_t {
    kPrefillAdmitted,  ///< a prefill leg entered the cores (request_id: its parent id)
    kLoadStarted,      ///< a decode leg waits for remote KV (Match::load_async)
    kHeld,             ///< a finished prefill request's blocks are held for its transfer
    kReleased,         ///< the READ prefill core accepted a release of transfer_id
  };
  Kind kind = Kind::kPrefillAdmitted;
  KvTransferMode mode = KvTransferMode::kRead;
  std::string request_id;
  std::string transfer_id;
};

/// What the logic asks of its driver. Called on the logic's thread while the logic runs; none
/// may call back into the logic (results come back on a later turn as events).
class ConnectorSink {
 public:
  virtual ~ConnectorSink() = default;
  /// Starts a READ or WRITE. OK: it is under way and its end comes back through
  /// ConnectorLogic::OnTransferEnded(transfer.op, transfer.id, ...). Not OK: it did not start; the
  /// logic ends it with this status now (the sink never reports it).
  virtual Status PostTransfer(const TransferAction& transfer) = 0;
  /// Cancels transfer `id` of `op`. OK: its end (Cancelled or real) still comes back through
  /// OnTransferEnded, once no more bytes can land (or it is unknown: nothing). Not OK: it had not
  /// started (queued in the sink) and ended now with this status; the sink never reports it.
  virtual Status CancelTransfer(KvTransferMode op, uint64_t id) = 0;
  /// Sends a control message (to `action.to`, or on the reply path `action.reply_token`).
  virtual void Send(const SendMessageAction& action) = 0;
  /// The engine's next StepReport carries this report (ConnectorLogic::Poll returns it); told at
  /// the moment the cores decide it. Default: nothing.
  virtual void OnReport(const std::variant<ReportLoadDoneAction, ReportLoadFailedAction,
                                           ReportBlocksFreeAction>& report) {}
  /// Transfers and messages to `peer` follow soon (a runtime fetches its metadata ahead).
  /// Default: nothing.
  virtual void PreparePeer(const PeerEndpoint& peer) {}
  /// See RequestNote. Default: nothing.
  virtual void Note(const RequestNote& note) {}
  /// This engine's control endpoint: the remote_host / remote_port a prefill returns, and the
  /// decode_host / decode_port of a WRITE decode's WriteBlocks.
  virtual std::pair<std::string, int> AdvertisedEndpoint() const = 0;
};

class ConnectorLogic {
 public:
  using Report = std::variant<ReportLoadDoneAction, ReportLoadFailedAction, ReportBlocksFreeAction>;

  /// Cores for `shape` (ConnectorCores), driven through `sink` (not owned; outlives this).
  /// `config.role` gates the legs (a do_remote_decode leg needs a producer, do_remote_prefill a
  /// consumer); `config.mode` routes a release of a transfer no core knows yet.
  ConnectorLogic(const KvTransferConfig& config, const ConnectorCores::Shape& shape,
                 ConnectorSink* sink);
  ConnectorLogic(const ConnectorLogic&) = delete;
  ConnectorLogic& operator=(const ConnectorLogic&) = delete;

  // ---- Engine hooks: KvConnector's, with its meaning (engine/kv_connector.h). ----

  void RequestQueued(const ConnectorRequestInfo& req, TimePoint now);
  /// InvalidArgument for malformed kv_transfer_params or a leg this engine's role does not
  /// serve; the cores' errors (FailedPrecondition, AlreadyExists, ...) otherwise.
  Result<KvConnector::Match> GetNumNewMatchedTokens(const ConnectorRequestInfo& req,
                                                    int num_local_computed, TimePoint now);
  /// The decode cores' OnBlocksAllocated status: NotFound for a request no decode core admitted
  /// (e.g. a local one), FailedPrecondition for a second allocation (nothing changes).
  Status UpdateStateAfterAlloc(const ConnectorRequestInfo& req, std::span<const int32_t> block_ids,
                               int num_local_computed, int num_external, TimePoint now);
  KvConnector::FinishDecision RequestFinished(const ConnectorRequestInfo& req,
                                              std::span<const int32_t> block_ids,
                                              std::string_view finish_reason, TimePoint now);
  bool RequestAborted(const ConnectorRequestInfo& req, TimePoint now);
  /// WRITE mode: layer `layer` of `chunks` is computed (a chunk that completes its tokens posts
  /// that layer's WRITEs). A driver first feeds what arrived during the pass (WantsLayers).
  void OnLayerKvWritten(int layer, std::span<const KvConnector::LayerKvChunk> chunks,
                        TimePoint now);
  /// Timers of every core (leases, reply / read / write timeouts, heartbeats), then the
  /// reports decided since the last Poll, each once.
  KvConnector::StepReport Poll(TimePoint now);
  std::optional<TimePoint> NextDeadline() const { return cores_.NextDeadline(); }
  /// No core has work in flight.
  bool Idle() const { return cores_.Idle(); }

  // ---- Transport events. ----

  /// Transfer `id` of `op` (PostTransferAction::op / id) ended: OK, or why not (Cancelled after
  /// CancelTransfer).
  void OnTransferEnded(KvTransferMode op, uint64_t id, const Status& status, TimePoint now);
  /// A control message from a peer; `reply_token` != 0 when the sender waits for a reply (a
  /// HoldReplyMsg goes back through Send with that token). Returns a release's result (NotFound
  /// for another incarnation); OK for every other message.
  Status OnMessage(const ControlMessage& msg, uint64_t reply_token, TimePoint now);
  /// The peer engine incarnation `engine_id` is lost (its transfer connection closed or its
  /// process is gone: kGone; only its heartbeats stopped: kSuspected). Everything bound to it
  /// is released or failed now, as far as PeerLoss makes it safe (ConnectorCores::OnPeerLost;
  /// docs/protocol.md "Peer loss"). Returns what was released or failed (holds, requests,
  /// targets); 0 when nothing was bound to it.
  int64_t OnPeerLost(const std::string& engine_id, PeerLoss loss, TimePoint now);

  // ---- Queries (the driver's stats, metrics and checks). ----

  /// True while a WRITE-mode prefill transfer is registered (OnLayerKvWritten has work).
  bool WantsLayers() const { return cores_.wprefill.NumTransfers() > 0; }
  /// The request's parsed kv_transfer_params (nullopt when it carries none), parsed once.
  Result<std::optional<KvTransferParams>> ParamsOf(const ConnectorRequestInfo& req);
  const ConnectorCores& cores() const { return cores_; }
  /// WRITE mode, for metrics: the decode's load timings and the prefill's per-target transfer
  /// times (µs) since the last call (WriteDecodeCore::TakeLoadTimings,
  /// WritePrefillCore::TakeTransferTimes).
  std::vector<WriteDecodeCore::LoadTiming> TakeWriteLoadTimings() {
    return cores_.wdecode.TakeLoadTimings();
  }
  std::vector<int64_t> TakeWriteTransferTimes() { return cores_.wprefill.TakeTransferTimes(); }
  /// WRITE decode requests admitted with remote tokens, not allocated yet.
  size_t NumAwaitingAlloc() const { return awaiting_alloc_.size(); }

  /// The bound on action rounds one entry point performs (a round's actions can queue more).
  static constexpr int kMaxActionRounds = 1000;

 private:
  Result<KvConnector::Match> WriteRequestAdded(const ConnectorRequestInfo& req,
                                               const KvTransferParams& p, int num_local_computed,
                                               TimePoint now);
  Result<KvConnector::Match> ReadRequestAdded(const ConnectorRequestInfo& req,
                                              const KvTransferParams& p, int num_local_computed,
                                              TimePoint now);
  // Routes a release to the WRITE or READ prefill cores.
  Status OnRelease(const ReleaseMsg& msg, TimePoint now);
  // Performs the cores' actions until none is left (kMaxActionRounds at most).
  void Drain(TimePoint now);
  void Perform(ConnectorAction& a, TimePoint now);
  // Tells the cores of `op` that transfer `id` ended.
  void EndTransfer(KvTransferMode op, uint64_t id, const Status& status, TimePoint now);
  // One sibling of the request's parent is done with its params (finished or aborted).
  void ForgetParams(const ConnectorRequestInfo& req);

  KvTransferConfig config_;
  ConnectorCores::Shape shape_;
  ConnectorSink* sink_;
  ConnectorCores cores_;
  KvConnector::StepReport report_;
  // Parents whose decode leg the cores admitted (GetNumNewMatchedTokens succeeded): an abort of
  // one not admitted tells the prefill itself (OnAbortedBeforeAdmission).
  std::set<std::string> admitted_;
  std::set<std::string> awaiting_alloc_;  // WRITE decode requests awaiting UpdateStateAfterAlloc
  struct ParsedParams {
    nlohmann::json raw;  // what was parsed (a reused parent id with other params parses again)
    Result<std::optional<KvTransferParams>> params;
    int open = 1;  // siblings not finished or aborted yet
  };
  std::map<std::string, ParsedParams> params_;  // parent id -> its parsed kv_transfer_params
};

}  // namespace kvbridge
