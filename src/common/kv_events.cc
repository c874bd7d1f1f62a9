#include "kvbridge/common/kv_events.h"

#include <nlohmann/json.hpp>

namespace kvbridge {

std::string_view KvEventOpName(KvEventOp op) {
  return op == KvEventOp::kStored ? "stored" : "removed";
}

std::string KvEventBatchJson(const KvEventBatch& batch) {
  nlohmann::json snapshot = nlohmann::json::array();
  for (const BlockHash& h : batch.snapshot) snapshot.push_back(BlockHashHex(h));
  nlohmann::json events = nlohmann::json::array();
  for (const KvEvent& e : batch.events) {
    events.push_back({{"seq", e.seq}, {"op", KvEventOpName(e.op)}, {"hash", BlockHashHex(e.hash)}});
  }
  nlohmann::json j = {{"incarnation", batch.incarnation}, {"block_size", batch.block_size},
                      {"root", BlockHashHex(batch.root)}, {"head_seq", batch.head_seq},
                      {"next_since", batch.next_since},   {"reset", batch.reset},
                      {"snapshot", std::move(snapshot)},  {"events", std::move(events)}};
  return j.dump();
}

namespace {

Result<BlockHash> HashField(const nlohmann::json& j, std::string_view what) {
  if (!j.is_string()) return InvalidArgumentError(std::string(what) + ": not a string");
  auto h = ParseBlockHashHex(j.get_ref<const std::string&>());
  if (!h) return InvalidArgumentError(std::string(what) + ": not 32 hex digits");
  return *h;
}

Result<uint64_t> U64Field(const nlohmann::json& j, const char* key) {
  auto it = j.find(key);
  if (it == j.end() || !it->is_number_unsigned())
    return InvalidArgumentError(std::string("kv events: '") + key + "' must be an integer >= 0");
  return it->get<uint64_t>();
}

}  // namespace

Result<KvEventBatch> ParseKvEventBatch(std::string_view json) {
  nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return InvalidArgumentError("kv events: not a JSON object");
  KvEventBatch b;
  auto inc = j.find("incarnation");
  if (inc == j.end() || !inc->is_string() || inc->get_ref<const std::string&>().empty())
    return InvalidArgumentError("kv events: 'incarnation' must be a non-empty string");
  b.incarnation = inc->get<std::string>();
  ASSIGN_OR_RETURN(uint64_t bs, U64Field(j, "block_size"));
  if (bs == 0 || bs > (1u << 20)) return InvalidArgumentError("kv events: bad 'block_size'");
  b.block_size = static_cast<int>(bs);
  auto root = j.find("root");
  if (root == j.end()) return InvalidArgumentError("kv events: 'root' missing");
  ASSIGN_OR_RETURN(b.root, HashField(*root, "kv events: 'root'"));
  ASSIGN_OR_RETURN(b.head_seq, U64Field(j, "head_seq"));
  ASSIGN_OR_RETURN(b.next_since, U64Field(j, "next_since"));
  auto reset = j.find("reset");
  if (reset == j.end() || !reset->is_boolean())
    return InvalidArgumentError("kv events: 'reset' must be a boolean");
  b.reset = reset->get<bool>();
  auto snap = j.find("snapshot");
  if (snap != j.end()) {
    if (!snap->is_array()) return InvalidArgumentError("kv events: 'snapshot' must be an array");
    b.snapshot.reserve(snap->size());
    for (const auto& h : *snap) {
      ASSIGN_OR_RETURN(BlockHash v, HashField(h, "kv events: snapshot entry"));
      b.snapshot.push_back(v);
    }
  }
  auto events = j.find("events");
  if (events == j.end() || !events->is_array())
    return InvalidArgumentError("kv events: 'events' must be an array");
  b.events.reserve(events->size());
  for (const auto& e : *events) {
    if (!e.is_object()) return InvalidArgumentError("kv events: an event is not an object");
    KvEvent ev;
    ASSIGN_OR_RETURN(ev.seq, U64Field(e, "seq"));
    auto op = e.find("op");
    if (op == e.end() || !op->is_string())
      return InvalidArgumentError("kv events: event 'op' must be a string");
    const std::string& ops = op->get_ref<const std::string&>();
    if (ops == "stored") {
      ev.op = KvEventOp::kStored;
    } else if (ops == "removed") {
      ev.op = KvEventOp::kRemoved;
    } else {
      return InvalidArgumentError("kv events: event 'op' must be stored|removed, got '" + ops +
                                  "'");
    }
    auto h = e.find("hash");
    if (h == e.end()) return InvalidArgumentError("kv events: event 'hash' missing");
    ASSIGN_OR_RETURN(ev.hash, HashField(*h, "kv events: event 'hash'"));
    b.events.push_back(ev);
  }
  return b;
}

}  // namespace kvbridge
