// kvbridge/connector/actions.h — what the sans-IO connector cores ask their runtime to do.
//
// The four protocol cores (prefill_core.h, decode_core.h, write_prefill_core.h,
// write_decode_core.h) take events (engine hooks, messages, transfer completions, `now`) and
// queue actions; ConnectorLogic (connector_logic.h) drains them with TakeActions() and performs
// them through its sink (the runtime or the simulator): posts and cancels READs and WRITEs (one
// PostTransferAction / CancelTransferAction kind for both), sends control messages, and turns the
// three Report* actions into the engine's KvConnector::StepReport. None of the cores reads a
// clock, a socket or a thread.
//
//   for (ConnectorAction& a : core.TakeActions()) std::visit(runtime_visitor, a);
//
// Thread-safety: values.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kvbridge/common/kv_transfer_mode.h"
#include "kvbridge/common/status.h"
#include "kvbridge/connector/messages.h"

namespace kvbridge {

/// How the loss of a transfer peer (an engine incarnation) was observed (DESIGN.md "Peer loss is
/// observed, not waited out"; docs/protocol.md "Peer loss"):
///  - kGone: its connection closed or its process is gone (shm: its control socket closed), so
///    no byte of it can land any more — what it was writing into may be freed now;
///  - kSuspected: only its heartbeats stopped (the proxy says so); it may still be writing —
///    its requests fail, but blocks it may write stay reserved until the write bound (the
///    prefill's lease plus a grace).
enum class PeerLoss : uint8_t { kGone = 0, kSuspected = 1 };
/// "gone" | "suspected".
inline std::string_view PeerLossName(PeerLoss loss) {
  return loss == PeerLoss::kGone ? "gone" : "suspected";
}

/// Where a prefill rank listens: its engine incarnation and control endpoint (from
/// kv_transfer_params.remote_engine_id / remote_host / remote_port) and the TP rank.
struct PeerEndpoint {
  std::string engine_id;
  std::string host;
  int port = 0;
  int rank = 0;
  friend bool operator==(const PeerEndpoint&, const PeerEndpoint&) = default;
};

/// Either side: start one transfer. Both modes have the same shape and the same TP strategy:
/// one core per engine covers every rank, and each (prefill rank, decode rank) pair of the TP
/// plan (tp_plan.h) is its own transfer, on the local rank's agent.
///  - op kRead (the decode, READ mode): READ the prefill's blocks `remote_block_ids[i]` into the
///    local `local_block_ids[i]`, every layer; its end is DecodeCore::OnReadCompleted(id).
///  - op kWrite (the prefill, WRITE mode): WRITE local blocks `local_block_ids[i]` into the
///    decode's `remote_block_ids[i]` for layer `layer` (-1: every layer); its end is
///    WritePrefillCore::OnWriteCompleted(id).
/// With head_count > 0 only a head slice of each block moves: the prefill rank's heads
/// [src_head_begin, +head_count) into the decode rank's [dst_head_begin, +head_count) (src is
/// always the prefill side, dst the decode side), rank-local indices, in both the K and the V
/// half; 0: whole blocks. ConnectorLogic's sink reports the end as OnTransferEnded(op, id).
struct PostTransferAction {
  KvTransferMode op = KvTransferMode::kRead;
  uint64_t id = 0;         ///< unique per op within one engine's cores, > 0
  std::string request_id;  ///< kRead: the decode request that waits for it; kWrite: empty
  std::string transfer_id;
  /// The remote rank: kRead the prefill rank read from, kWrite the decode rank written to.
  PeerEndpoint peer;
  int local_rank = 0;    ///< the local TP rank whose agent moves it (kRead decode, kWrite prefill)
  int peer_tp_size = 1;  ///< the peer engine's TP size
  int layer = -1;        ///< -1: every layer (always, for kRead)
  int src_head_begin = 0;
  int dst_head_begin = 0;
  int head_count = 0;
  std::vector<int32_t> local_block_ids;
  std::vector<int32_t> remote_block_ids;
  /// kWrite only. When set (the target's last WRITE, nothing else in flight): send this
  /// WriteDone to the decode as the transfer's notification, which the agent delivers only after
  /// the data landed (and not at all when the WRITE fails or is cancelled).
  std::optional<WriteDoneMsg> notification;
};
/// Either side: cancel transfer `id` of `op`; its end (status Cancelled or its real end) is
/// reported only once no more bytes can land.
struct CancelTransferAction {
  KvTransferMode op = KvTransferMode::kRead;
  uint64_t id = 0;
};
/// Either side: send `msg`. A prefill's HoldReplyMsg goes back on the reply path of the ReadDone
/// it answers (`reply_token`, as handed to PrefillCore::OnReadDone); other messages go to `to`.
struct SendMessageAction {
  PeerEndpoint to;
  ControlMessage msg;
  uint64_t reply_token = 0;
};
/// Decode: the remote KV of `request_id` landed and every prefill rank said its hold was valid:
/// proceed (KvConnector::StepReport::finished_recving).
struct ReportLoadDoneAction {
  std::string request_id;
};
/// Decode: the load of `request_id` failed; no READ can still land (StepReport::failed_recving).
struct ReportLoadFailedAction {
  std::string request_id;
  bool recompute = true;
  Status status;
};
/// Either side: the engine may free `request_id`'s blocks now (StepReport::finished_sending).
struct ReportBlocksFreeAction {
  std::string request_id;
};

using ConnectorAction =
    std::variant<PostTransferAction, CancelTransferAction, SendMessageAction, ReportLoadDoneAction,
                 ReportLoadFailedAction, ReportBlocksFreeAction>;

}  // namespace kvbridge
