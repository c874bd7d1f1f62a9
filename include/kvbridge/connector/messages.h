// kvbridge/connector/messages.h — the connector's control messages between a decode and a prefill
// engine (READ and WRITE modes), their JSON wire form, and the TP rank pairing.
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

// ---- WRITE mode (DESIGN.md "WRITE mode"; docs/protocol.md "WRITE mode") ----

/// decode rank → prefill rank (WRITE): write the KV of prompt blocks [first_block, first_block +
/// block_ids.size()) (block indices in token order, block_size tokens each) of every layer into
/// these decode blocks, then confirm with WriteDoneMsg. Only the blocks the decode's prefix cache
/// lacks are listed. decode_host:decode_port is the decode's control endpoint (GET
/// /v1/kv/metadata gives its transfer-agent metadata).
struct WriteBlocksMsg {
  std::string transfer_id;
  std::string prefill_engine_id;
  int prefill_rank = 0;
  std::string decode_engine_id;  ///< the decode engine incarnation
  int decode_rank = 0;
  int decode_tp_size = 1;
  std::string decode_host;
  int decode_port = 0;
  int num_prompt_tokens = 0;  ///< must equal the prefill request's prompt length
  int first_block = 0;
  std::vector<int32_t> block_ids;  ///< decode block ids, distinct, >= 0
  friend bool operator==(const WriteBlocksMsg&, const WriteBlocksMsg&) = default;
};

/// How a prefill rank's writes to one decode rank ended.
enum class WriteOutcome : uint8_t {
  kOk = 0,         ///< every layer of every listed block landed
  kFailed = 1,     ///< a write failed, or the prefill aborted / was released / expired
  kCancelled = 2,  ///< the decode asked to stop (WriteCancelMsg)
};
/// "ok" | "failed" | "cancelled".
std::string_view WriteOutcomeName(WriteOutcome o);

/// prefill rank → decode rank (WRITE): the writes for (transfer_id, decode_rank) ended and no
/// more bytes of them can land (whatever the outcome: this is also the "drained" confirmation
/// that lets an aborted decode free its blocks). Sent after the last layer's data landed.
/// Timings (microseconds, measured on the prefill): compute_us = first to last layer computed
/// of the request's final chunk; write_us = first write posted to last write done;
/// since_last_layer_us = last layer computed to this message sent.
struct WriteDoneMsg {
  std::string transfer_id;
  std::string prefill_engine_id;
  int prefill_rank = 0;
  std::string decode_engine_id;
  int decode_rank = 0;
  WriteOutcome outcome = WriteOutcome::kOk;
  std::string reason;  ///< why not ok: "aborted" | "released" | "expired" | "write failed: ..."
  int64_t compute_us = 0;
  int64_t write_us = 0;
  int64_t since_last_layer_us = 0;
  /// The prefill's last layer computed, CLOCK_MONOTONIC µs of the prefill's host (0: unknown);
  /// comparable only with clocks of the same host.
  int64_t last_layer_at_us = 0;
  friend bool operator==(const WriteDoneMsg&, const WriteDoneMsg&) = default;
};

/// decode rank → prefill rank (WRITE): stop writing for (transfer_id, decode_rank). want_done:
/// the decode keeps its blocks until the WriteDoneMsg (cancelled) that confirms the writes
/// drained; false when it never sent WriteBlocks (its prefix cache had every block: "skip").
struct WriteCancelMsg {
  std::string transfer_id;
  std::string prefill_engine_id;
  int prefill_rank = 0;
  std::string decode_engine_id;
  int decode_rank = 0;
  int decode_tp_size = 1;
  bool want_done = true;
  friend bool operator==(const WriteCancelMsg&, const WriteCancelMsg&) = default;
};

using ControlMessage = std::variant<ReadDoneMsg, HoldReplyMsg, HeartbeatMsg, ReleaseMsg,
                                    WriteBlocksMsg, WriteDoneMsg, WriteCancelMsg>;

/// JSON text: {"type":"read_done"|"hold_reply"|"heartbeat"|"release"|"write_blocks"|
/// "write_done"|"write_cancel", ...fields}.
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
