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

Result<int64_t> Micros(const json& j, const char* k) {
  if (!j.contains(k) || !j.at(k).is_number_integer())
    return Bad(std::string(k) + " must be an integer");
  if (j.at(k).is_number_unsigned() && j.at(k).get<uint64_t>() > (uint64_t{1} << 53)) {
    return Bad(std::string(k) + " out of range");
  }
  const int64_t v = j.at(k).get<int64_t>();
  if (v < 0 || v > (int64_t{1} << 53)) return Bad(std::string(k) + " out of range");
  return v;
}

// The WRITE-mode messages (write_blocks, write_done, write_cancel).
Result<ControlMessage> DecodeWriteMessage(const std::string& type, const json& j) {
  if (type == "write_blocks") {
    RETURN_IF_ERROR(
        CheckKeys(j, {"type", "transfer_id", "prefill_engine_id", "prefill_rank",
                      "decode_engine_id", "decode_rank", "decode_tp_size", "decode_host",
                      "decode_port", "num_prompt_tokens", "first_block", "block_ids"}));
    WriteBlocksMsg w;
    ASSIGN_OR_RETURN(w.transfer_id, Id(j, "transfer_id"));
    ASSIGN_OR_RETURN(w.prefill_engine_id, Id(j, "prefill_engine_id"));
    ASSIGN_OR_RETURN(w.prefill_rank, Int(j, "prefill_rank", 0, kMaxTp - 1));
    ASSIGN_OR_RETURN(w.decode_engine_id, Id(j, "decode_engine_id"));
    ASSIGN_OR_RETURN(w.decode_tp_size, Int(j, "decode_tp_size", 1, kMaxTp));
    ASSIGN_OR_RETURN(w.decode_rank, Int(j, "decode_rank", 0, w.decode_tp_size - 1));
    if (!j.contains("decode_host") || !j.at("decode_host").is_string() ||
        j.at("decode_host").get<std::string>().size() > 255) {
      return Bad("decode_host must be a string of <= 255 chars");
    }
    w.decode_host = j.at("decode_host").get<std::string>();
    ASSIGN_OR_RETURN(w.decode_port, Int(j, "decode_port", 0, 65535));
    ASSIGN_OR_RETURN(w.num_prompt_tokens, Int(j, "num_prompt_tokens", 1, 1 << 30));
    ASSIGN_OR_RETURN(w.first_block, Int(j, "first_block", 0, 1 << 30));
    if (!j.contains("block_ids") || !j.at("block_ids").is_array()) {
      return Bad("block_ids must be an array");
    }
    std::set<int32_t> seen;
    for (const json& v : j.at("block_ids")) {
      if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > INT32_MAX) ||
          v.get<int64_t>() < 0 || v.get<int64_t>() > INT32_MAX) {
        return Bad("block_ids must hold integers in [0, 2^31)");
      }
      const int32_t b = static_cast<int32_t>(v.get<int64_t>());
      if (!seen.insert(b).second) return Bad("block_ids repeats " + std::to_string(b));
      w.block_ids.push_back(b);
    }
    if (w.block_ids.empty()) return Bad("block_ids must not be empty");
    const int64_t bs_blocks = static_cast<int64_t>(w.first_block) + w.block_ids.size();
    if (bs_blocks > w.num_prompt_tokens) {
      return Bad("first_block + block_ids exceed the prompt's tokens");
    }
    return ControlMessage(w);
  }
  if (type == "write_done") {
    RETURN_IF_ERROR(
        CheckKeys(j, {"type", "transfer_id", "prefill_engine_id", "prefill_rank",
                      "decode_engine_id", "decode_rank", "outcome", "reason", "compute_us",
                      "write_us", "since_last_layer_us", "last_layer_at_us"}));
    WriteDoneMsg w;
    ASSIGN_OR_RETURN(w.transfer_id, Id(j, "transfer_id"));
    ASSIGN_OR_RETURN(w.prefill_engine_id, Id(j, "prefill_engine_id"));
    ASSIGN_OR_RETURN(w.prefill_rank, Int(j, "prefill_rank", 0, kMaxTp - 1));
    ASSIGN_OR_RETURN(w.decode_engine_id, Id(j, "decode_engine_id"));
    ASSIGN_OR_RETURN(w.decode_rank, Int(j, "decode_rank", 0, kMaxTp - 1));
    if (!j.contains("outcome") || !j.at("outcome").is_string())
      return Bad("outcome must be a string");
    const std::string o = j.at("outcome").get<std::string>();
    if (o == "ok")
      w.outcome = WriteOutcome::kOk;
    else if (o == "failed")
      w.outcome = WriteOutcome::kFailed;
    else if (o == "cancelled")
      w.outcome = WriteOutcome::kCancelled;
    else
      return Bad("outcome \"" + o + "\" unknown (ok|failed|cancelled)");
    if (j.contains("reason")) {
      if (!j.at("reason").is_string() || j.at("reason").get<std::string>().size() > 256) {
        return Bad("reason must be a string of <= 256 chars");
      }
      w.reason = j.at("reason").get<std::string>();
    }
    ASSIGN_OR_RETURN(w.compute_us, Micros(j, "compute_us"));
    ASSIGN_OR_RETURN(w.write_us, Micros(j, "write_us"));
    ASSIGN_OR_RETURN(w.since_last_layer_us, Micros(j, "since_last_layer_us"));
    if (j.contains("last_layer_at_us")) {
      ASSIGN_OR_RETURN(w.last_layer_at_us, Micros(j, "last_layer_at_us"));
    }
    return ControlMessage(w);
  }
  RETURN_IF_ERROR(CheckKeys(j, {"type", "transfer_id", "prefill_engine_id", "prefill_rank",
                                "decode_engine_id", "decode_rank", "decode_tp_size", "want_done"}));
  WriteCancelMsg w;
  ASSIGN_OR_RETURN(w.transfer_id, Id(j, "transfer_id"));
  ASSIGN_OR_RETURN(w.prefill_engine_id, Id(j, "prefill_engine_id"));
  ASSIGN_OR_RETURN(w.prefill_rank, Int(j, "prefill_rank", 0, kMaxTp - 1));
  ASSIGN_OR_RETURN(w.decode_engine_id, Id(j, "decode_engine_id"));
  ASSIGN_OR_RETURN(w.decode_tp_size, Int(j, "decode_tp_size", 1, kMaxTp));
  ASSIGN_OR_RETURN(w.decode_rank, Int(j, "decode_rank", 0, w.decode_tp_size - 1));
  ASSIGN_OR_RETURN(w.want_done, Bool(j, "want_done"));
  return ControlMessage(w);
}

}  // namespace

std::string_view WriteOutcomeName(WriteOutcome o) {
  switch (o) {
    case WriteOutcome::kOk:
      return "ok";
    case WriteOutcome::kFailed:
      return "failed";
    case WriteOutcome::kCancelled:
      return "cancelled";
  }
  return "ok";
}

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
  } else if (const auto* wb = std::get_if<WriteBlocksMsg>(&m)) {
    j = {{"type", "write_blocks"},
         {"transfer_id", wb->transfer_id},
         {"prefill_engine_id", wb->prefill_engine_id},
         {"prefill_rank", wb->prefill_rank},
         {"decode_engine_id", wb->decode_engine_id},
         {"decode_rank", wb->decode_rank},
         {"decode_tp_size", wb->decode_tp_size},
         {"decode_host", wb->decode_host},
         {"decode_port", wb->decode_port},
         {"num_prompt_tokens", wb->num_prompt_tokens},
         {"first_block", wb->first_block},
         {"block_ids", wb->block_ids}};
  } else if (const auto* wd = std::get_if<WriteDoneMsg>(&m)) {
    j = {{"type", "write_done"},
         {"transfer_id", wd->transfer_id},
         {"prefill_engine_id", wd->prefill_engine_id},
         {"prefill_rank", wd->prefill_rank},
         {"decode_engine_id", wd->decode_engine_id},
         {"decode_rank", wd->decode_rank},
         {"outcome", WriteOutcomeName(wd->outcome)},
         {"reason", wd->reason},
         {"compute_us", wd->compute_us},
         {"write_us", wd->write_us},
         {"since_last_layer_us", wd->since_last_layer_us},
         {"last_layer_at_us", wd->last_layer_at_us}};
  } else if (const auto* wc = std::get_if<WriteCancelMsg>(&m)) {
    j = {{"type", "write_cancel"},
         {"transfer_id", wc->transfer_id},
         {"prefill_engine_id", wc->prefill_engine_id},
         {"prefill_rank", wc->prefill_rank},
         {"decode_engine_id", wc->decode_engine_id},
         {"decode_rank", wc->decode_rank},
         {"decode_tp_size", wc->decode_tp_size},
         {"want_done", wc->want_done}};
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
  if (type == "write_blocks" || type == "write_done" || type == "write_cancel") {
    return DecodeWriteMessage(type, j);
  }
  return Bad("unknown type \"" + type +
             "\" (read_done|hold_reply|heartbeat|release|write_blocks|write_done|write_cancel)");
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
