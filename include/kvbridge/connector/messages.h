// kvbridge/connector/messages.h — the connector's control messages between a decode and a prefill
// engine (READ mode), their JSON wire form, and the TP rank pairing.
//
// Every message names the prefill engine incarnation it is about (`prefill_engine_id`), the
// shared `transfer_id` (never a local request id: DESIGN.md pitfall 2) and TP ranks on both
// sides. Wire form: one JSON object with a "type" field; docs/protocol.md has the tables.
//
//   std::string wire = EncodeMessage(ReadDoneMsg{.transfer_id = "t1", ...});
//   ASSIGN_OR_RETURN(ControlMessage m, DecodeMessage(wire));   // InvalidArgument when malformed
//   if (auto* rd = std::get_if<ReadDoneMsg>(&m)) ...
//
// Thread-safety: pure functions on values.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <variant>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge {

/// What became of a decode rank's READ of one prefill rank.
enum class ReadOutcome : uint8_t {
  kOk = 0,       ///< all bytes landed; the decode wants to know whether the hold was valid
  kFailed = 1,   ///< the READ failed or was cancelled; no more bytes will be read
  kAborted = 2,  ///< the decode request was aborted; no more bytes will be read
  kSkipped = 3,  ///< the decode will not read (its prefix cache had every block it needs)
};
/// "ok" | "failed" | "aborted" | "skipped".
std::string_view ReadOutcomeName(ReadOutcome o);

/// decode rank → prefill rank, after its READ ended (or instead of one). The prefill counts the
/// decode rank as notified whatever the outcome; it answers with HoldReplyMsg iff want_reply.
struct ReadDoneMsg {
  std::string transfer_id;
  std::string prefill_engine_id;  ///< the incarnation named by kv_transfer_params.remote_engine_id
  int prefill_rank = 0;
  std::string decode_engine_id;
  int decode_rank = 0;
  int decode_tp_size = 1;
  ReadOutcome outcome = ReadOutcome::kOk;
  bool want_reply = true;
  friend bool operator==(const ReadDoneMsg&, const ReadDoneMsg&) = default;
};

/// prefill rank → decode rank: was the hold in force from registration until the ReadDone?
/// Only hold_valid = true lets the decode use the bytes it read.
struct HoldReplyMsg {
  std::string transfer_id;
  std::string prefill_engine_id;
  int prefill_rank = 0;
  std::string decode_engine_id;
  int decode_rank = 0;
  bool hold_valid = false;
  std::string reason;  ///< why not valid: "unknown" | "expired" | "released" | "incarnation"
  friend bool operator==(const HoldReplyMsg&, const HoldReplyMsg&) = default;
};

/// decode → prefill rank: a decode still wants this transfer; extend the lease.
struct HeartbeatMsg {
  std::string transfer_id;
  std::string prefill_engine_id;
  int prefill_rank = 0;
  std::string decode_engine_id;
  int decode_rank = 0;
  friend bool operator==(const HeartbeatMsg&, const HeartbeatMsg&) = default;
};

/// proxy → prefill: release the hold now (decode leg failed or never started). An empty
/// prefill_engine_id matches the current incarnation.
struct ReleaseMsg {
  std::string transfer_id;
  std::string prefill_engine_id;
  friend bool operator==(const ReleaseMsg&, const ReleaseMsg&) = default;
};

using ControlMessage = std::variant<ReadDoneMsg, HoldReplyMsg, HeartbeatMsg, ReleaseMsg>;

/// JSON text: {"type":"read_done"|"hold_reply"|"heartbeat"|"release", ...fields}.
std::string EncodeMessage(const ControlMessage& m);
/// Parses EncodeMessage's output. InvalidArgument naming the field on malformed input, unknown
/// type or keys, bad ids, ranks outside [0, tp), never throws.
Result<ControlMessage> DecodeMessage(std::string_view text);

/// Which decode rank reads from which prefill rank, for KV heads split evenly over TP ranks:
/// pairs (decode_rank, prefill_rank), sorted. decode_tp == prefill_tp: (r, r); decode_tp >
/// prefill_tp: each decode rank d reads its heads from prefill rank d * prefill_tp / decode_tp;
/// decode_tp < prefill_tp: decode rank d reads from every prefill rank in
/// [d * prefill_tp / decode_tp, (d + 1) * prefill_tp / decode_tp). Sizes must be >= 1.
std::vector<std::pair<int, int>> TpReadPairs(int decode_tp, int prefill_tp);
/// The decode ranks that read from `prefill_rank` (from TpReadPairs).
std::vector<int> DecodeRanksReadingFrom(int prefill_rank, int prefill_tp, int decode_tp);

}  // namespace kvbridge
