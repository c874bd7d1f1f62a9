#include "kvbridge/connector/messages.h"

#include <nlohmann/json.hpp>
#include <set>

#include "kvbridge/connector/kv_transfer_config.h"

namespace kvbridge {
namespace {

using nlohmann::json;

constexpr int kMaxTp = 1024;

Status Bad(std::string m) { return InvalidArgumentError("control message: " + std::move(m)); }

Status CheckKeys(const json& j, const std::set<std::string>& keys) {
  for (const auto& [k, v] : j.items()) {
    if (!keys.count(k)) return Bad("unknown field \"" + k + "\"");
  }
  return OkStatus();
}

Result<std::string> Id(const json& j, const char* k, bool allow_empty = false) {
  if (!j.contains(k) || !j.at(k).is_string()) return Bad(std::string(k) + " must be a string");
  std::string s = j.at(k).get<std::string>();
  if (allow_empty && s.empty()) return s;
  if (!IsValidTransferId(s)) return Bad(std::string(k) + " must be 1-128 chars [A-Za-z0-9._:-]");
  return s;
}

Result<int> Int(const json& j, const char* k, int lo, int hi) {
  if (!j.contains(k) || !j.at(k).is_number_integer())
    return Bad(std::string(k) + " must be an integer");
  if (j.at(k).is_number_unsigned() && j.at(k).get<uint64_t>() > static_cast<uint64_t>(hi)) {
    return Bad(std::string(k) + " out of range");
  }
  int64_t v = j.at(k).get<int64_t>();
  if (v < lo || v > hi) return Bad(std::string(k) + " out of range");
  return static_cast<int>(v);
}

Result<bool> Bool(const json& j, const char* k) {
  if (!j.contains(k) || !j.at(k).is_boolean()) return Bad(std::string(k) + " must be a boolean");
  return j.at(k).get<bool>();
}

}  // namespace

std::string_view ReadOutcomeName(ReadOutcome o) {
  switch (o) {
    case ReadOutcome::kOk:
      return "ok";
    case ReadOutcome::kFailed:
      return "failed";
    case ReadOutcome::kAborted:
      return "aborted";
    case ReadOutcome::kSkipped:
      return "skipped";
  }
  return "ok";
}

std::string EncodeMessage(const ControlMessage& m) {
  json j;
  if (const auto* r = std::get_if<ReadDoneMsg>(&m)) {
    j = {{"type", "read_done"},
         {"transfer_id", r->transfer_id},
         {"prefill_engine_id", r->prefill_engine_id},
         {"prefill_rank", r->prefill_rank},
         {"decode_engine_id", r->decode_engine_id},
         {"decode_rank", r->decode_rank},
         {"decode_tp_size", r->decode_tp_size},
         {"outcome", ReadOutcomeName(r->outcome)},
         {"want_reply", r->want_reply}};
  } else if (const auto* h = std::get_if<HoldReplyMsg>(&m)) {
    j = {{"type", "hold_reply"},
         {"transfer_id", h->transfer_id},
         {"prefill_engine_id", h->prefill_engine_id},
         {"prefill_rank", h->prefill_rank},
         {"decode_engine_id", h->decode_engine_id},
         {"decode_rank", h->decode_rank},
         {"hold_valid", h->hold_valid},
         {"reason", h->reason}};
  } else if (const auto* b = std::get_if<HeartbeatMsg>(&m)) {
    j = {{"type", "heartbeat"},
         {"transfer_id", b->transfer_id},
         {"prefill_engine_id", b->prefill_engine_id},
         {"prefill_rank", b->prefill_rank},
         {"decode_engine_id", b->decode_engine_id},
         {"decode_rank", b->decode_rank}};
  } else {
    const auto& rel = std::get<ReleaseMsg>(m);
    j = {{"type", "release"},
         {"transfer_id", rel.transfer_id},
         {"prefill_engine_id", rel.prefill_engine_id}};
  }
  return j.dump();
}

Result<ControlMessage> DecodeMessage(std::string_view text) {
  if (text.size() > 64 * 1024) return Bad("larger than 64 KiB");
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Bad("not a JSON object");
  if (!j.contains("type") || !j.at("type").is_string()) return Bad("type must be a string");
  const std::string type = j.at("type").get<std::string>();
  if (type == "read_done") {
    RETURN_IF_ERROR(CheckKeys(
        j, {"type", "transfer_id", "prefill_engine_id", "prefill_rank", "decode_engine_id",
            "decode_rank", "decode_tp_size", "outcome", "want_reply"}));
    ReadDoneMsg r;
    ASSIGN_OR_RETURN(r.transfer_id, Id(j, "transfer_id"));
    ASSIGN_OR_RETURN(r.prefill_engine_id, Id(j, "prefill_engine_id"));
    ASSIGN_OR_RETURN(r.prefill_rank, Int(j, "prefill_rank", 0, kMaxTp - 1));
    ASSIGN_OR_RETURN(r.decode_engine_id, Id(j, "decode_engine_id"));
    ASSIGN_OR_RETURN(r.decode_tp_size, Int(j, "decode_tp_size", 1, kMaxTp));
    ASSIGN_OR_RETURN(r.decode_rank, Int(j, "decode_rank", 0, r.decode_tp_size - 1));
    ASSIGN_OR_RETURN(r.want_reply, Bool(j, "want_reply"));
    if (!j.contains("outcome") || !j.at("outcome").is_string())
      return Bad("outcome must be a string");
    const std::string o = j.at("outcome").get<std::string>();
    if (o == "ok")
      r.outcome = ReadOutcome::kOk;
    else if (o == "failed")
      r.outcome = ReadOutcome::kFailed;
    else if (o == "aborted")
      r.outcome = ReadOutcome::kAborted;
    else if (o == "skipped")
      r.outcome = ReadOutcome::kSkipped;
    else
      return Bad("outcome \"" + o + "\" unknown (ok|failed|aborted|skipped)");
    return ControlMessage(r);
  }
  if (type == "hold_reply") {
    RETURN_IF_ERROR(CheckKeys(j, {"type", "transfer_id", "prefill_engine_id", "prefill_rank",
                                  "decode_engine_id", "decode_rank", "hold_valid", "reason"}));
    HoldReplyMsg h;
    ASSIGN_OR_RETURN(h.transfer_id, Id(j, "transfer_id"));
    ASSIGN_OR_RETURN(h.prefill_engine_id, Id(j, "prefill_engine_id"));
    ASSIGN_OR_RETURN(h.prefill_rank, Int(j, "prefill_rank", 0, kMaxTp - 1));
    ASSIGN_OR_RETURN(h.decode_engine_id, Id(j, "decode_engine_id"));
    ASSIGN_OR_RETURN(h.decode_rank, Int(j, "decode_rank", 0, kMaxTp - 1));
    ASSIGN_OR_RETURN(h.hold_valid, Bool(j, "hold_valid"));
    if (j.contains("reason")) {
      if (!j.at("reason").is_string() || j.at("reason").get<std::string>().size() > 256) {
        return Bad("reason must be a string of <= 256 chars");
      }
      h.reason = j.at("reason").get<std::string>();
    }
    return ControlMessage(h);
  }
  if (type == "heartbeat") {
    RETURN_IF_ERROR(CheckKeys(j, {"type", "transfer_id", "prefill_engine_id", "prefill_rank",
                                  "decode_engine_id", "decode_rank"}));
    HeartbeatMsg b;
    ASSIGN_OR_RETURN(b.transfer_id, Id(j, "transfer_id"));
    ASSIGN_OR_RETURN(b.prefill_engine_id, Id(j, "prefill_engine_id"));
    ASSIGN_OR_RETURN(b.prefill_rank, Int(j, "prefill_rank", 0, kMaxTp - 1));
    ASSIGN_OR_RETURN(b.decode_engine_id, Id(j, "decode_engine_id"));
    ASSIGN_OR_RETURN(b.decode_rank, Int(j, "decode_rank", 0, kMaxTp - 1));
    return ControlMessage(b);
  }
  if (type == "release") {
    RETURN_IF_ERROR(CheckKeys(j, {"type", "transfer_id", "prefill_engine_id"}));
    ReleaseMsg r;
    ASSIGN_OR_RETURN(r.transfer_id, Id(j, "transfer_id"));
    if (j.contains("prefill_engine_id")) {
      ASSIGN_OR_RETURN(r.prefill_engine_id, Id(j, "prefill_engine_id", /*allow_empty=*/true));
    }
    return ControlMessage(r);
  }
  return Bad("unknown type \"" + type + "\" (read_done|hold_reply|heartbeat|release)");
}

std::vector<std::pair<int, int>> TpReadPairs(int decode_tp, int prefill_tp) {
  std::vector<std::pair<int, int>> out;
  if (decode_tp < 1 || prefill_tp < 1) return out;
  for (int d = 0; d < decode_tp; ++d) {
    if (decode_tp >= prefill_tp) {
      out.emplace_back(d, static_cast<int>(static_cast<int64_t>(d) * prefill_tp / decode_tp));
    } else {
      const int lo = static_cast<int>(static_cast<int64_t>(d) * prefill_tp / decode_tp);
      const int hi = static_cast<int>(static_cast<int64_t>(d + 1) * prefill_tp / decode_tp);
      for (int p = lo; p < hi; ++p) out.emplace_back(d, p);
    }
  }
  return out;
}

std::vector<int> DecodeRanksReadingFrom(int prefill_rank, int prefill_tp, int decode_tp) {
  std::vector<int> out;
  for (const auto& [d, p] : TpReadPairs(decode_tp, prefill_tp)) {
    if (p == prefill_rank) out.push_back(d);
  }
  return out;
}

}  // namespace kvbridge
