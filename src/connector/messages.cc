#include "kvbridge/connector/messages.h"

#include <algorithm>
#include <array>
#include <nlohmann/json.hpp>
#include <optional>
#include <set>
#include <span>
#include <utility>

#include "kvbridge/connector/kv_transfer_config.h"

namespace kvbridge {
namespace {

using nlohmann::json;

constexpr int kMaxTp = 1024;

Status Bad(std::string m) { return InvalidArgumentError("control message: " + std::move(m)); }

// ---- Typed fields: each checks presence, type and range, and names the field when it fails.

Result<std::string> Id(const json& j, const char* k, bool allow_empty = false) {
  if (!j.contains(k) || !j.at(k).is_string()) return Bad(std::string(k) + " must be a string");
  std::string s = j.at(k).get<std::string>();
  if (allow_empty && s.empty()) return s;
  if (!IsValidTransferId(s)) return Bad(std::string(k) + " must be 1-128 chars [A-Za-z0-9._:-]");
  return s;
}

// An integer in [lo, hi], hi >= 0.
Result<int64_t> Integer(const json& j, const char* k, int64_t lo, int64_t hi) {
  if (!j.contains(k) || !j.at(k).is_number_integer())
    return Bad(std::string(k) + " must be an integer");
  if (j.at(k).is_number_unsigned() && j.at(k).get<uint64_t>() > static_cast<uint64_t>(hi)) {
    return Bad(std::string(k) + " out of range");
  }
  const int64_t v = j.at(k).get<int64_t>();
  if (v < lo || v > hi) return Bad(std::string(k) + " out of range");
  return v;
}

Result<int> Int(const json& j, const char* k, int lo, int hi) {
  ASSIGN_OR_RETURN(int64_t v, Integer(j, k, lo, hi));
  return static_cast<int>(v);
}

// Microseconds in [0, 2^53] (exact as a JSON double).
Result<int64_t> Micros(const json& j, const char* k) { return Integer(j, k, 0, int64_t{1} << 53); }

Result<bool> Bool(const json& j, const char* k) {
  if (!j.contains(k) || !j.at(k).is_boolean()) return Bad(std::string(k) + " must be a boolean");
  return j.at(k).get<bool>();
}

Result<std::string> Text(const json& j, const char* k, size_t max_chars) {
  if (!j.contains(k) || !j.at(k).is_string() || j.at(k).get<std::string>().size() > max_chars) {
    return Bad(std::string(k) + " must be a string of <= " + std::to_string(max_chars) + " chars");
  }
  return j.at(k).get<std::string>();
}

// An enum on the wire as one of its names.
template <typename E>
struct NamedValue {
  const char* name;
  E value;
};

constexpr NamedValue<ReadOutcome> kReadOutcomes[] = {{"ok", ReadOutcome::kOk},
                                                     {"failed", ReadOutcome::kFailed},
                                                     {"aborted", ReadOutcome::kAborted},
                                                     {"skipped", ReadOutcome::kSkipped}};
constexpr NamedValue<WriteOutcome> kWriteOutcomes[] = {{"ok", WriteOutcome::kOk},
                                                       {"failed", WriteOutcome::kFailed},
                                                       {"cancelled", WriteOutcome::kCancelled}};

template <typename E, size_t N>
Result<E> Named(const json& j, const char* k, const NamedValue<E> (&names)[N]) {
  if (!j.contains(k) || !j.at(k).is_string()) return Bad(std::string(k) + " must be a string");
  const std::string s = j.at(k).get<std::string>();
  std::string all;
  for (const auto& [name, value] : names) {
    if (s == name) return value;
    all += (all.empty() ? "" : "|") + std::string(name);
  }
  return Bad(std::string(k) + " \"" + s + "\" unknown (" + all + ")");
}

template <typename E, size_t N>
std::string_view NameOf(E v, const NamedValue<E> (&names)[N]) {
  for (const auto& [name, value] : names) {
    if (value == v) return name;
  }
  return names[0].name;
}

// ---- The route that every rank-to-rank message carries: the shared transfer_id, the prefill
// incarnation and rank, the decode incarnation and rank, and in some messages the decode's TP
// size (which then bounds decode_rank; without it decode_rank is bounded by kMaxTp).

template <typename M>
concept Routed = requires(const M& m) {
  m.decode_rank;
};
template <typename M>
concept HasDecodeTp = requires(const M& m) {
  m.decode_tp_size;
};

constexpr std::string_view kRouteKeys[] = {"type",          "transfer_id",      "prefill_engine_id",
                                           "prefill_rank",  "decode_engine_id", "decode_rank",
                                           "decode_tp_size"};

// Refuses a key that is neither the route's (when M has one; decode_tp_size only when M has it)
// nor one of `own`.
template <typename M>
Status CheckKeys(const json& j, std::span<const std::string_view> own) {
  for (const auto& [k, v] : j.items()) {
    const bool route_key = Routed<M> && std::ranges::find(kRouteKeys, k) != std::end(kRouteKeys) &&
                           (HasDecodeTp<M> || k != "decode_tp_size");
    if (!route_key && std::ranges::find(own, k) == own.end()) {
      return Bad("unknown field \"" + k + "\"");
    }
  }
  return OkStatus();
}

template <Routed M>
void EncodeRoute(const M& m, json& j) {
  j["transfer_id"] = m.transfer_id;
  j["prefill_engine_id"] = m.prefill_engine_id;
  j["prefill_rank"] = m.prefill_rank;
  j["decode_engine_id"] = m.decode_engine_id;
  j["decode_rank"] = m.decode_rank;
  if constexpr (HasDecodeTp<M>) j["decode_tp_size"] = m.decode_tp_size;
}

template <Routed M>
Status DecodeRoute(const json& j, M& m) {
  ASSIGN_OR_RETURN(m.transfer_id, Id(j, "transfer_id"));
  ASSIGN_OR_RETURN(m.prefill_engine_id, Id(j, "prefill_engine_id"));
  ASSIGN_OR_RETURN(m.prefill_rank, Int(j, "prefill_rank", 0, kMaxTp - 1));
  ASSIGN_OR_RETURN(m.decode_engine_id, Id(j, "decode_engine_id"));
  int decode_tp = kMaxTp;
  if constexpr (HasDecodeTp<M>) {
    ASSIGN_OR_RETURN(m.decode_tp_size, Int(j, "decode_tp_size", 1, kMaxTp));
    decode_tp = m.decode_tp_size;
  }
  ASSIGN_OR_RETURN(m.decode_rank, Int(j, "decode_rank", 0, decode_tp - 1));
  return OkStatus();
}

// ---- Each message's wire form beyond the route: its "type", its other keys, and how they are
// written and read (Decode runs after CheckKeys and DecodeRoute).
template <typename M>
struct Wire;

template <>
struct Wire<ReadDoneMsg> {
  static constexpr std::string_view kType = "read_done";
  static constexpr std::array<std::string_view, 2> kKeys = {"outcome", "want_reply"};
  static void Encode(const ReadDoneMsg& m, json& j) {
    j["outcome"] = NameOf(m.outcome, kReadOutcomes);
    j["want_reply"] = m.want_reply;
  }
  static Status Decode(const json& j, ReadDoneMsg& m) {
    ASSIGN_OR_RETURN(m.want_reply, Bool(j, "want_reply"));
    ASSIGN_OR_RETURN(m.outcome, Named(j, "outcome", kReadOutcomes));
    return OkStatus();
  }
};

template <>
struct Wire<HoldReplyMsg> {
  static constexpr std::string_view kType = "hold_reply";
  static constexpr std::array<std::string_view, 2> kKeys = {"hold_valid", "reason"};
  static void Encode(const HoldReplyMsg& m, json& j) {
    j["hold_valid"] = m.hold_valid;
    j["reason"] = m.reason;
  }
  static Status Decode(const json& j, HoldReplyMsg& m) {
    ASSIGN_OR_RETURN(m.hold_valid, Bool(j, "hold_valid"));
    if (j.contains("reason")) {
      ASSIGN_OR_RETURN(m.reason, Text(j, "reason", 256));
    }
    return OkStatus();
  }
};

template <>
struct Wire<HeartbeatMsg> {
  static constexpr std::string_view kType = "heartbeat";
  static constexpr std::array<std::string_view, 0> kKeys = {};
  static void Encode(const HeartbeatMsg&, json&) {}
  static Status Decode(const json&, HeartbeatMsg&) { return OkStatus(); }
};

// Not rank-to-rank: the proxy (or a decode) ends a prefill's hold on a transfer.
template <>
struct Wire<ReleaseMsg> {
  static constexpr std::string_view kType = "release";
  static constexpr std::array<std::string_view, 3> kKeys = {"type", "transfer_id",
                                                            "prefill_engine_id"};
  static void Encode(const ReleaseMsg& m, json& j) {
    j["transfer_id"] = m.transfer_id;
    j["prefill_engine_id"] = m.prefill_engine_id;
  }
  static Status Decode(const json& j, ReleaseMsg& m) {
    ASSIGN_OR_RETURN(m.transfer_id, Id(j, "transfer_id"));
    if (j.contains("prefill_engine_id")) {
      ASSIGN_OR_RETURN(m.prefill_engine_id, Id(j, "prefill_engine_id", /*allow_empty=*/true));
    }
    return OkStatus();
  }
};

template <>
struct Wire<WriteBlocksMsg> {
  static constexpr std::string_view kType = "write_blocks";
  static constexpr std::array<std::string_view, 5> kKeys = {
      "decode_host", "decode_port", "num_prompt_tokens", "first_block", "block_ids"};
  static void Encode(const WriteBlocksMsg& m, json& j) {
    j["decode_host"] = m.decode_host;
    j["decode_port"] = m.decode_port;
    j["num_prompt_tokens"] = m.num_prompt_tokens;
    j["first_block"] = m.first_block;
    j["block_ids"] = m.block_ids;
  }
  static Status Decode(const json& j, WriteBlocksMsg& m) {
    ASSIGN_OR_RETURN(m.decode_host, Text(j, "decode_host", 255));
    ASSIGN_OR_RETURN(m.decode_port, Int(j, "decode_port", 0, 65535));
    ASSIGN_OR_RETURN(m.num_prompt_tokens, Int(j, "num_prompt_tokens", 1, 1 << 30));
    ASSIGN_OR_RETURN(m.first_block, Int(j, "first_block", 0, 1 << 30));
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
      m.block_ids.push_back(b);
    }
    if (m.block_ids.empty()) return Bad("block_ids must not be empty");
    if (static_cast<int64_t>(m.first_block) + static_cast<int64_t>(m.block_ids.size()) >
        m.num_prompt_tokens) {
      return Bad("first_block + block_ids exceed the prompt's tokens");
    }
    return OkStatus();
  }
};

template <>
struct Wire<WriteDoneMsg> {
  static constexpr std::string_view kType = "write_done";
  static constexpr std::array<std::string_view, 6> kKeys = {
      "outcome", "reason", "compute_us", "write_us", "since_last_layer_us", "last_layer_at_us"};
  static void Encode(const WriteDoneMsg& m, json& j) {
    j["outcome"] = NameOf(m.outcome, kWriteOutcomes);
    j["reason"] = m.reason;
    j["compute_us"] = m.compute_us;
    j["write_us"] = m.write_us;
    j["since_last_layer_us"] = m.since_last_layer_us;
    j["last_layer_at_us"] = m.last_layer_at_us;
  }
  static Status Decode(const json& j, WriteDoneMsg& m) {
    ASSIGN_OR_RETURN(m.outcome, Named(j, "outcome", kWriteOutcomes));
    if (j.contains("reason")) {
      ASSIGN_OR_RETURN(m.reason, Text(j, "reason", 256));
    }
    ASSIGN_OR_RETURN(m.compute_us, Micros(j, "compute_us"));
    ASSIGN_OR_RETURN(m.write_us, Micros(j, "write_us"));
    ASSIGN_OR_RETURN(m.since_last_layer_us, Micros(j, "since_last_layer_us"));
    if (j.contains("last_layer_at_us")) {
      ASSIGN_OR_RETURN(m.last_layer_at_us, Micros(j, "last_layer_at_us"));
    }
    return OkStatus();
  }
};

template <>
struct Wire<WriteCancelMsg> {
  static constexpr std::string_view kType = "write_cancel";
  static constexpr std::array<std::string_view, 1> kKeys = {"want_done"};
  static void Encode(const WriteCancelMsg& m, json& j) { j["want_done"] = m.want_done; }
  static Status Decode(const json& j, WriteCancelMsg& m) {
    ASSIGN_OR_RETURN(m.want_done, Bool(j, "want_done"));
    return OkStatus();
  }
};

template <typename M>
Result<ControlMessage> DecodeAs(const json& j) {
  RETURN_IF_ERROR(CheckKeys<M>(j, Wire<M>::kKeys));
  M m;
  if constexpr (Routed<M>) RETURN_IF_ERROR(DecodeRoute(j, m));
  RETURN_IF_ERROR(Wire<M>::Decode(j, m));
  return ControlMessage(std::move(m));
}

// Decodes `j` as the ControlMessage alternative whose Wire kType is `type`; nullopt when none is.
template <size_t... I>
std::optional<Result<ControlMessage>> DecodeByType(std::string_view type, const json& j,
                                                   std::index_sequence<I...>) {
  std::optional<Result<ControlMessage>> out;
  (void)((type == Wire<std::variant_alternative_t<I, ControlMessage>>::kType &&
          (out = DecodeAs<std::variant_alternative_t<I, ControlMessage>>(j), true)) ||
         ...);
  return out;
}

// "read_done|hold_reply|...": every type, in ControlMessage's order.
template <size_t... I>
std::string TypeNames(std::index_sequence<I...>) {
  std::string all;
  ((all +=
    (I == 0 ? "" : "|") + std::string(Wire<std::variant_alternative_t<I, ControlMessage>>::kType)),
   ...);
  return all;
}

constexpr auto kAlternatives = std::make_index_sequence<std::variant_size_v<ControlMessage>>();

}  // namespace

std::string_view WriteOutcomeName(WriteOutcome o) { return NameOf(o, kWriteOutcomes); }

std::string_view ReadOutcomeName(ReadOutcome o) { return NameOf(o, kReadOutcomes); }

std::string EncodeMessage(const ControlMessage& m) {
  return std::visit(
      [](const auto& msg) {
        using M = std::decay_t<decltype(msg)>;
        json j;
        j["type"] = Wire<M>::kType;
        if constexpr (Routed<M>) EncodeRoute(msg, j);
        Wire<M>::Encode(msg, j);
        return j.dump();
      },
      m);
}

Result<ControlMessage> DecodeMessage(std::string_view text) {
  if (text.size() > 64 * 1024) return Bad("larger than 64 KiB");
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return Bad("not a JSON object");
  if (!j.contains("type") || !j.at("type").is_string()) return Bad("type must be a string");
  const std::string type = j.at("type").get<std::string>();
  if (auto decoded = DecodeByType(type, j, kAlternatives)) return *std::move(decoded);
  return Bad("unknown type \"" + type + "\" (" + TypeNames(kAlternatives) + ")");
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
