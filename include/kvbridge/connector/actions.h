// kvbridge/connector/actions.h — what the sans-IO connector cores ask their runtime to do.
//
// PrefillCore and DecodeCore (prefill_core.h, decode_core.h) take events (engine hooks, messages,
// transfer completions, `now`) and queue actions; ConnectorLogic (connector_logic.h) drains them
// with TakeActions() and performs them through its sink (the runtime or the simulator): posts/cancels READs on the transfer
// agent, sends control messages, and turns the three Report* actions into the engine's
// KvConnector::StepReport. None of the cores reads a clock, a socket or a thread.
//
//   for (ConnectorAction& a : core.TakeActions()) std::visit(runtime_visitor, a);
//
// Thread-safety: values.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "kvbridge/common/status.h"
#include "kvbridge/connector/messages.h"

namespace kvbridge {

/// Where a prefill rank listens: its engine incarnation and control endpoint (from
/// kv_transfer_params.remote_engine_id / remote_host / remote_port) and the TP rank.
struct PeerEndpoint {
  std::string engine_id;
  std::string host;
  int port = 0;
  int rank = 0;
  friend bool operator==(const PeerEndpoint&, const PeerEndpoint&) = default;
};

/// Decode: READ `remote_block_ids[i]` of `prefill` into local `local_block_ids[i]` (all layers of
/// decode rank `decode_rank`'s heads). Report the end with DecodeCore::OnReadCompleted(read_id).
/// With head_count > 0 only a head slice of each block moves (the TP plan, tp_plan.h): the
/// prefill rank's heads [src_head_begin, +head_count) into the decode rank's [dst_head_begin,
/// +head_count), rank-local indices, in both the K and the V half; 0: whole blocks.
struct PostReadAction {
  uint64_t read_id = 0;  ///< unique per DecodeCore, > 0
  std::string request_id;
  std::string transfer_id;
  PeerEndpoint prefill;
  int decode_rank = 0;
  int src_head_begin = 0;
  int dst_head_begin = 0;
  int head_count = 0;
  std::vector<int32_t> local_block_ids;
  std::vector<int32_t> remote_block_ids;
};
/// Decode: cancel READ `read_id`; its OnReadCompleted (status Cancelled or its real end) follows
/// only once no more bytes can land.
struct CancelReadAction {
  uint64_t read_id = 0;
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

/// Prefill (WRITE mode): WRITE local blocks `local_block_ids[i]` into `decode`'s blocks
/// `remote_block_ids[i]`, for layer `layer` (-1: every layer). Report the end with
/// WritePrefillCore::OnWriteCompleted(write_id).
struct PostWriteAction {
  uint64_t write_id = 0;  ///< unique per WritePrefillCore, > 0
  std::string transfer_id;
  PeerEndpoint decode;  ///< engine_id / host / port / rank of the decode rank written to
  int prefill_rank = 0;
  int decode_tp_size = 1;  ///< the decode's TP size (with the TP plan: which head slice)
  int layer = -1;
  std::vector<int32_t> local_block_ids;
  std::vector<int32_t> remote_block_ids;
  /// When set (the target's last WRITE, nothing else in flight): send this WriteDone to the
  /// decode as the transfer's notification, which the agent delivers only after the data landed
  /// (and not at all when the WRITE fails or is cancelled).
  std::optional<WriteDoneMsg> notification;
};
/// Prefill (WRITE mode): cancel write `write_id`; its OnWriteCompleted follows only once no more
/// bytes can land.
struct CancelWriteAction {
  uint64_t write_id = 0;
};

using ConnectorAction = std::variant<PostReadAction, CancelReadAction, SendMessageAction,
                                     ReportLoadDoneAction, ReportLoadFailedAction,
                                     ReportBlocksFreeAction, PostWriteAction, CancelWriteAction>;

}  // namespace kvbridge
