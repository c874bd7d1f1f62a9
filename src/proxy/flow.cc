#include "kvbridge/proxy/flow.h"

#include <sys/random.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <iterator>
#include <nlohmann/json.hpp>
#include <random>

namespace kvbridge::proxy {
namespace {

using nlohmann::json;

bool Is2xx(int status) { return status >= 200 && status < 300; }
// An engine answers 503 when it admits nothing (draining, shutting down, queue full): the request
// can go to another instance as it is.
bool IsRefusal(int status) { return status == 503; }

std::string ErrorBody(int status, std::string_view type, std::string_view message) {
  json j = {{"error", {{"message", message}, {"type", type}, {"code", status}}}};
  return j.dump();
}

constexpr const char* kJson = "application/json";

}  // namespace

std::string_view RoleName(Role role) { return role == Role::kPrefill ? "prefill" : "decode"; }

Result<Role> ParseRole(std::string_view text) {
  if (text == "prefill") return Role::kPrefill;
  if (text == "decode") return Role::kDecode;
  return InvalidArgumentError("unknown role '" + std::string(text) + "' (prefill|decode)");
}

std::string_view OutcomeName(Outcome outcome) {
  switch (outcome) {
    case Outcome::kPending:
      return "pending";
    case Outcome::kOk:
      return "ok";
    case Outcome::kBadRequest:
      return "bad_request";
    case Outcome::kNoInstance:
      return "no_instance";
    case Outcome::kPrefillError:
      return "prefill_error";
    case Outcome::kDecodeError:
      return "decode_error";
    case Outcome::kUnreachable:
      return "unreachable";
    case Outcome::kClientDisconnected:
      return "client_disconnected";
    case Outcome::kTimeout:
      return "timeout";
  }
  return "unknown";
}

namespace {

// The prefill leg's body from the client's object (see ShapePrefillBody).
json ShapePrefillJson(json j, bool forward_n, json params) {
  for (const char* key : {"stream_options", "min_tokens", "logprobs", "top_logprobs", "echo",
                          "best_of", "max_completion_tokens"}) {
    j.erase(key);
  }
  j["max_tokens"] = 1;
  j["stream"] = false;
  if (!forward_n) j["n"] = 1;
  j["kv_transfer_params"] = std::move(params);
  return j;
}

// `object` (a dumped JSON object without the key) with "key": value_json added, by splicing the
// text: the decode leg's body without parsing and dumping the client's body again.
std::string WithMember(const std::string& object, std::string_view key,
                       const std::string& value_json) {
  std::string out = object.substr(0, object.size() - 1);  // drop the closing brace
  if (out.size() > 1) out += ',';
  out += '"';
  out += key;
  out += "\":";
  out += value_json;
  out += '}';
  return out;
}

// The fields the prefill leg overwrites or drops (n, max_tokens, max_completion_tokens,
// min_tokens) cannot be refused by the prefill engine, and the decode would refuse them only after
// the prompt was prefilled and held. Checked here with the engine's rules (openai_protocol.cc):
// an integer, n and the max_tokens >= 1, min_tokens >= 0; null means absent. Returns the message.
std::optional<std::string> CheckFieldsThePrefillLegOverrides(const json& j) {
  const std::pair<const char*, int64_t> fields[] = {
      {"n", 1}, {"max_tokens", 1}, {"max_completion_tokens", 1}, {"min_tokens", 0}};
  for (const auto& [name, min] : fields) {
    auto it = j.find(name);
    if (it == j.end() || it->is_null()) continue;
    if (!it->is_number_integer() || it->get<int64_t>() < min) {
      return "'" + std::string(name) + "' must be an integer >= " + std::to_string(min);
    }
  }
  return std::nullopt;
}

}  // namespace

Result<std::string> ShapePrefillBody(std::string_view client_body, bool forward_n,
                                     std::string_view kv_transfer_params_json) {
  json j = json::parse(client_body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return InvalidArgumentError("request body must be a JSON object");
  }
  json params = json::parse(kv_transfer_params_json, nullptr, false);
  if (params.is_discarded() || !params.is_object()) {
    return InvalidArgumentError("kv_transfer_params must be a JSON object");
  }
  return ShapePrefillJson(std::move(j), forward_n, std::move(params)).dump();
}

std::string MintTransferId() {
  // 16 bytes from the kernel's CSPRNG per id, taken from a per-thread batch so that minting costs
  // one getrandom() call per 32 ids instead of four random_device reads each.
  struct Batch {
    unsigned char bytes[512];
    size_t used = sizeof(bytes);
  };
  static thread_local Batch batch;
  if (batch.used + 16 > sizeof(batch.bytes)) {
    size_t got = 0;
    while (got < sizeof(batch.bytes)) {
      ssize_t n = ::getrandom(batch.bytes + got, sizeof(batch.bytes) - got, 0);
      if (n > 0) {
        got += static_cast<size_t>(n);
      } else if (n < 0 && errno != EINTR) {
        break;
      }
    }
    if (got < sizeof(batch.bytes)) {  // no getrandom (old kernel, seccomp): random_device
      static thread_local std::random_device rd;
      for (size_t i = got; i < sizeof(batch.bytes); ++i) {
        batch.bytes[i] = static_cast<unsigned char>(rd());
      }
    }
    batch.used = 0;
  }
  static constexpr char kHex[] = "0123456789abcdef";
  std::string id(32, '0');
  for (int i = 0; i < 16; ++i) {
    const unsigned char b = batch.bytes[batch.used + i];
    id[2 * i] = kHex[b >> 4];
    id[2 * i + 1] = kHex[b & 15];
  }
  batch.used += 16;
  return id;
}

Result<DurationUs> ParseRequestTimeout(std::string_view value) {
  while (!value.empty() && (value.front() == ' ' || value.front() == '\t')) value.remove_prefix(1);
  while (!value.empty() && (value.back() == ' ' || value.back() == '\t')) value.remove_suffix(1);
  auto bad = [&] {
    return InvalidArgumentError(std::string(kRequestTimeoutHeader) +
                                " must be a number of seconds in (0, 86400], got '" +
                                std::string(value) + "'");
  };
  // Digits, at most one '.', at least one digit: no sign, exponent, inf or nan.
  int digits = 0, dots = 0;
  for (char c : value) {
    if (c >= '0' && c <= '9') {
      ++digits;
    } else if (c == '.') {
      ++dots;
    } else {
      return bad();
    }
  }
  if (digits == 0 || dots > 1 || value.size() > 32) return bad();
  const double seconds = std::strtod(std::string(value).c_str(), nullptr);
  if (!(seconds > 0) || seconds > 86400) return bad();
  return std::max<DurationUs>(1, static_cast<DurationUs>(seconds * kSecond));
}

PdFlow::PdFlow(FlowOptions options, std::string transfer_id, InstancePicker picker)
    : options_(std::move(options)),
      transfer_id_(std::move(transfer_id)),
      picker_(std::move(picker)),
      first_transfer_id_(transfer_id_) {
  if (options_.max_attempts < 1) options_.max_attempts = 1;
}

std::vector<LegRecord> PdFlow::legs() const {
  std::vector<LegRecord> out;
  out.reserve(legs_.size());
  for (const Leg& leg : legs_) out.push_back(leg.record);
  return out;
}

bool PdFlow::done() const {
  if (!client_done_) return false;
  for (const Leg& leg : legs_) {
    if (leg.open) return false;
  }
  return true;
}

std::optional<TimePoint> PdFlow::deadline() const {
  if (client_done_) return std::nullopt;
  std::optional<TimePoint> next;
  if (deadline_ >= 0) next = deadline_;
  if (waiting_ != Waiting::kNone && (!next || repick_at_ < *next)) next = repick_at_;
  return next;
}

bool PdFlow::WaitForInstance(Role role, TimePoint now) {
  if (options_.instance_wait <= 0) return false;
  if (waiting_ == Waiting::kNone) wait_until_ = now + options_.instance_wait;
  if (now >= wait_until_) return false;
  waiting_role_ = role;
  repick_at_ = std::min(wait_until_, now + std::max<DurationUs>(1, options_.instance_poll));
  return true;
}

void PdFlow::FailNoInstance(Role role, std::vector<Action>& out) {
  waiting_ = Waiting::kNone;
  Release(out);
  FailWithError(Outcome::kNoInstance, 503, "service_unavailable",
                options_.colocated ? std::string("no instance available")
                                   : "no " + std::string(RoleName(role)) + " instance available",
                out);
}

bool PdFlow::StartFirstLegs(TimePoint now, std::vector<Action>& out, Role* missing) {
  if (options_.colocated) {
    *missing = Role::kDecode;
    return SendDecode(now, out);
  }
  if (options_.mode == KvTransferMode::kRead) {
    *missing = Role::kPrefill;
    return SendPrefill(now, out);
  }
  // WRITE: the decode leg names the prefill, so pick the prefill first, then send both legs.
  *missing = Role::kPrefill;
  std::optional<Endpoint> prefill = picker_(Role::kPrefill, tried_prefill_);
  if (!prefill) return false;
  hold_prefill_ = *prefill;
  if (!SendDecode(now, out)) {
    hold_prefill_.reset();  // nothing was sent to it
    *missing = Role::kDecode;
    return false;
  }
  tried_prefill_.push_back(prefill->id);
  prefill_leg_ = StartLeg(Role::kPrefill, *prefill, prefill_body_, /*stream=*/false, now, out);
  return true;
}

PdFlow::Leg* PdFlow::FindLeg(int leg_id) {
  for (Leg& leg : legs_) {
    if (leg.record.leg_id == leg_id) return &leg;
  }
  return nullptr;
}

PdFlow::Leg* PdFlow::FindOpenLeg(int leg_id) {
  Leg* leg = FindLeg(leg_id);
  return leg != nullptr && leg->open ? leg : nullptr;
}

int PdFlow::StartLeg(Role role, const Endpoint& instance, std::string body, bool stream,
                     TimePoint now, std::vector<Action>& out) {
  Leg leg;
  leg.record.leg_id = next_leg_id_++;
  leg.record.role = role;
  leg.record.instance_id = instance.id;
  leg.record.sent_at = now;
  leg.instance = instance;
  legs_.push_back(std::move(leg));
  SendLeg send;
  send.leg_id = legs_.back().record.leg_id;
  send.role = role;
  send.instance = instance;
  send.path = path_;
  send.body = std::move(body);
  send.stream = stream;
  out.emplace_back(std::move(send));
  return legs_.back().record.leg_id;
}

bool PdFlow::SendPrefill(TimePoint now, std::vector<Action>& out) {
  if (static_cast<int>(tried_prefill_.size()) >= options_.max_attempts) return false;
  std::optional<Endpoint> ep = picker_(Role::kPrefill, tried_prefill_);
  if (!ep) return false;
  tried_prefill_.push_back(ep->id);
  hold_prefill_ = *ep;
  prefill_leg_ = StartLeg(Role::kPrefill, *ep, prefill_body_, /*stream=*/false, now, out);
  return true;
}

bool PdFlow::SendDecode(TimePoint now, std::vector<Action>& out) {
  if (static_cast<int>(tried_decode_.size()) >= options_.max_attempts) return false;
  // Not the engine that holds the prefill (a kv_both engine listed in both roles) while another
  // decode is there: an engine cannot READ from itself (or be written by itself), so its load
  // would fail and recompute. When it is the only one (a fake engine answering both legs, a
  // one-engine setup) it still gets the leg.
  std::optional<Endpoint> ep;
  if (!options_.colocated && hold_prefill_) {
    std::vector<std::string> exclude = tried_decode_;
    exclude.push_back(hold_prefill_->url);
    ep = picker_(Role::kDecode, exclude);
  }
  if (!ep) ep = picker_(Role::kDecode, tried_decode_);
  if (!ep) return false;
  tried_decode_.push_back(ep->id);
  if (options_.colocated) {
    decode_leg_ = StartLeg(Role::kDecode, *ep, client_body_, client_stream_, now, out);
    return true;
  }
  std::string params = prefill_kv_params_;  // READ: ready-made in OnPrefillDone
  if (options_.mode == KvTransferMode::kWrite) {
    params = json{{"do_remote_prefill", true},
                  {"transfer_id", transfer_id_},
                  {"mode", "write"},
                  {"remote_engine_id", hold_prefill_->engine_id},
                  {"remote_host", hold_prefill_->transfer_host},
                  {"remote_port", hold_prefill_->transfer_port},
                  // The decode pairs its ranks with the prefill's (TP plan) before it answers.
                  {"tp_size", hold_prefill_->tp_size}}
                 .dump();
  }
  decode_leg_ = StartLeg(Role::kDecode, *ep, WithMember(client_body_, "kv_transfer_params", params),
                         client_stream_, now, out);
  return true;
}

void PdFlow::Fail(Outcome outcome, int status, std::string content_type, std::string body,
                  std::vector<Action>& out) {
  if (client_done_) return;
  client_done_ = true;
  outcome_ = outcome;
  if (stream_started_) {
    // The status line is gone; tell an SSE client in its own format, then end the stream.
    out.emplace_back(StreamChunk{"data: " + body + "\n\n"});
    out.emplace_back(EndStream{});
    return;
  }
  if (content_type.empty()) content_type = kJson;
  out.emplace_back(Respond{status, std::move(content_type), std::move(body)});
}

void PdFlow::FailWithError(Outcome outcome, int status, std::string_view type,
                           std::string_view message, std::vector<Action>& out) {
  Fail(outcome, status, kJson, ErrorBody(status, type, message), out);
}

void PdFlow::Release(std::vector<Action>& out) {
  if (released_ || decode_succeeded_ || !hold_prefill_) return;
  released_ = true;
  out.emplace_back(ReleaseHold{*hold_prefill_, transfer_id_});
}

void PdFlow::Cancel(Leg& leg, std::vector<Action>& out) {
  if (!leg.open) return;
  leg.open = false;
  leg.record.cancelled = true;
  out.emplace_back(CancelLeg{leg.record.leg_id});
}

void PdFlow::CancelAll(std::vector<Action>& out) {
  for (Leg& leg : legs_) Cancel(leg, out);
}

bool PdFlow::RetryRefused(Leg& leg, TimePoint now, std::vector<Action>& out) {
  if (ClientHasBytes()) return false;
  if (leg.record.role == Role::kPrefill && options_.mode == KvTransferMode::kWrite) {
    // Cancels the refused leg with the pair's decode leg.
    return RetryWritePair(/*prefill_may_hold=*/false, now, out);
  }
  // The leg admitted nothing (a prefill holds nothing, a decode offered no block and read
  // nothing): the same body goes to another instance; the refused leg is cancelled after.
  std::vector<Action> sent;
  const bool prefill = leg.record.role == Role::kPrefill;
  if (!(prefill ? SendPrefill(now, sent) : SendDecode(now, sent))) return false;
  Cancel(leg, out);
  out.insert(out.end(), std::make_move_iterator(sent.begin()), std::make_move_iterator(sent.end()));
  return true;
}

bool PdFlow::RetryWritePair(bool prefill_may_hold, TimePoint now, std::vector<Action>& out) {
  if (ClientHasBytes() || pair_attempts_ >= options_.max_attempts) return false;
  std::optional<Endpoint> prefill = picker_(Role::kPrefill, tried_prefill_);
  if (!prefill) return false;
  CancelAll(out);  // the decode leg named the failed prefill
  if (prefill_may_hold) {
    Release(out);
  } else {
    hold_prefill_.reset();
  }
  // The decode was not at fault: it may serve the new pair too.
  if (!tried_decode_.empty()) tried_decode_.pop_back();
  ++pair_attempts_;
  transfer_id_ = options_.mint_transfer_id
                     ? options_.mint_transfer_id()
                     : first_transfer_id_ + "-" + std::to_string(pair_attempts_);
  released_ = false;
  json j = json::parse(client_body_, nullptr, false);
  json prefill_params = {
      {"do_remote_decode", true}, {"transfer_id", transfer_id_}, {"mode", "write"}};
  prefill_body_ =
      ShapePrefillJson(std::move(j), options_.prefill_forward_n, std::move(prefill_params)).dump();
  tried_prefill_.push_back(prefill->id);
  hold_prefill_ = *prefill;
  if (!SendDecode(now, out)) {
    hold_prefill_.reset();  // nothing was sent to it
    FailWithError(Outcome::kNoInstance, 503, "service_unavailable", "no decode instance available",
                  out);
    return true;
  }
  prefill_leg_ = StartLeg(Role::kPrefill, *prefill, prefill_body_, /*stream=*/false, now, out);
  return true;
}

std::vector<Action> PdFlow::OnClientRequest(const ClientRequest& request, TimePoint now) {
  std::vector<Action> out;
  if (started_) return out;
  started_ = true;
  path_ = request.path;
  DurationUs timeout = options_.timeout;
  if (request.timeout > 0 && (timeout <= 0 || request.timeout < timeout)) timeout = request.timeout;
  if (timeout > 0) deadline_ = now + timeout;
  json j = json::parse(request.body, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    FailWithError(Outcome::kBadRequest, 400, "invalid_request_error",
                  j.is_discarded() ? "the request body is not valid JSON"
                                   : "the request body must be a JSON object",
                  out);
    return out;
  }
  if (auto bad = CheckFieldsThePrefillLegOverrides(j)) {
    FailWithError(Outcome::kBadRequest, 400, "invalid_request_error", *bad, out);
    return out;
  }
  if (j.contains("stream") && !j["stream"].is_boolean() && !j["stream"].is_null()) {
    FailWithError(Outcome::kBadRequest, 400, "invalid_request_error", "'stream' must be a boolean",
                  out);
    return out;
  }
  // Clients never steer the KV protocol: their kv_transfer_params are dropped.
  const bool stripped = j.erase("kv_transfer_params") > 0;
  if (auto it = j.find("stream"); it != j.end() && it->is_boolean()) {
    client_stream_ = it->get<bool>();
  }
  // Serialized again only when it changed: else the client's own text goes on (no dump of a long
  // prompt). It must end with the object's '}' (WithMember splices before it) and not be empty.
  const std::string& raw = request.body;
  const bool raw_ok =
      !stripped && !j.empty() && !raw.empty() && raw.front() == '{' && raw.back() == '}';
  client_body_ = raw_ok ? raw : j.dump();
  if (!options_.colocated) {
    json prefill_params = {{"do_remote_decode", true}, {"transfer_id", transfer_id_}};
    if (options_.mode == KvTransferMode::kWrite) prefill_params["mode"] = "write";
    prefill_body_ =
        ShapePrefillJson(std::move(j), options_.prefill_forward_n, std::move(prefill_params))
            .dump();
  }
  Role missing = Role::kPrefill;
  if (!StartFirstLegs(now, out, &missing)) {
    if (WaitForInstance(missing, now)) {
      waiting_ = Waiting::kFirstLegs;
    } else {
      FailNoInstance(missing, out);
    }
  }
  return out;
}

std::vector<Action> PdFlow::OnLegStatus(int leg_id, int status, std::string_view content_type,
                                        TimePoint now) {
  std::vector<Action> out;
  Leg* leg = FindOpenLeg(leg_id);
  if (leg == nullptr || leg->record.first_byte_at >= 0) return out;
  leg->record.first_byte_at = now;
  leg->record.status = status;
  leg->content_type = std::string(content_type);
  if (client_done_) return out;
  if (IsRefusal(status) && RetryRefused(*leg, now, out)) return out;
  if (leg->record.role != Role::kDecode) return out;
  if (!Is2xx(status)) {
    // The decode refused: the prefill's hold is released now, not when the body arrives.
    Release(out);
    return out;
  }
  if (client_stream_) {
    // The stream starts with the first bytes (OnLegData): until then a failed pair is retried.
    leg->passthrough = true;
    stream_status_ = status;
    stream_content_type_ =
        leg->content_type.empty() ? std::string("text/event-stream") : leg->content_type;
  }
  return out;
}

std::vector<Action> PdFlow::OnLegData(int leg_id, std::string_view data, TimePoint now) {
  std::vector<Action> out;
  Leg* leg = FindOpenLeg(leg_id);
  if (leg == nullptr || data.empty()) return out;
  if (leg->passthrough) {
    if (client_done_) return out;
    if (!stream_started_) {
      stream_started_ = true;
      out.emplace_back(StartStream{stream_status_, stream_content_type_});
    }
    out.emplace_back(StreamChunk{std::string(data)});
  } else {
    leg->body.append(data);
  }
  return out;
}

std::vector<Action> PdFlow::OnLegDone(int leg_id, TimePoint now) {
  std::vector<Action> out;
  Leg* leg = FindOpenLeg(leg_id);
  if (leg == nullptr) return out;
  leg->open = false;
  leg->record.ended_at = now;
  if (leg->record.first_byte_at < 0) {
    // A response without a status line is a broken leg.
    leg->open = true;
    leg->record.ended_at = -1;
    return OnLegError(leg_id, LegFailure::kBroken, InternalError("response without status"), now);
  }
  if (leg->record.role == Role::kPrefill) {
    OnPrefillDone(*leg, now, out);
  } else {
    OnDecodeDone(*leg, now, out);
  }
  return out;
}

void PdFlow::OnPrefillDone(Leg& leg, TimePoint now, std::vector<Action>& out) {
  if (client_done_) return;
  int status = leg.record.status;
  if (options_.mode == KvTransferMode::kWrite) {
    if (Is2xx(status)) return;  // the decode leg carries the answer
    // A 5xx may come from the pair (the decode's blocks never came): the pair goes again. A 4xx
    // is the request's own fault and goes to the client.
    const bool may_hold = status >= 500 && !IsRefusal(status);
    if (status >= 500 && RetryWritePair(may_hold, now, out)) return;
    CancelAll(out);
    if (may_hold) Release(out);
    Fail(Outcome::kPrefillError, status, leg.content_type, std::move(leg.body), out);
    return;
  }
  if (!Is2xx(status)) {
    // The prefill refused: it holds nothing; its status and body go to the client as they are.
    hold_prefill_.reset();
    Fail(Outcome::kPrefillError, status, leg.content_type, std::move(leg.body), out);
    return;
  }
  json j = json::parse(leg.body, nullptr, false);
  const json* params = nullptr;
  if (!j.is_discarded() && j.is_object()) {
    auto it = j.find("kv_transfer_params");
    if (it != j.end() && it->is_object()) params = &*it;
  }
  if (params == nullptr) {
    Release(out);
    FailWithError(Outcome::kPrefillError, 502, "bad_gateway",
                  "prefill response lacks kv_transfer_params", out);
    return;
  }
  auto tid = params->find("transfer_id");
  if (tid != params->end() && (!tid->is_string() || tid->get<std::string>() != transfer_id_)) {
    Release(out);
    FailWithError(Outcome::kPrefillError, 502, "bad_gateway",
                  "prefill answered for another transfer_id", out);
    return;
  }
  json p = *params;
  p["transfer_id"] = transfer_id_;
  p.erase("do_remote_decode");
  p["do_remote_prefill"] = true;
  prefill_kv_params_ = p.dump();
  if (!SendDecode(now, out)) {
    if (WaitForInstance(Role::kDecode, now)) {
      waiting_ = Waiting::kReadDecode;  // the hold stays for the decode to come
    } else {
      FailNoInstance(Role::kDecode, out);
    }
  }
}

void PdFlow::OnDecodeDone(Leg& leg, TimePoint now, std::vector<Action>& out) {
  if (client_done_) return;
  int status = leg.record.status;
  if (leg.passthrough) {
    decode_succeeded_ = true;
    client_done_ = true;
    outcome_ = Outcome::kOk;
    if (!stream_started_) {  // a stream without one byte: still a (empty) stream
      stream_started_ = true;
      out.emplace_back(StartStream{stream_status_, stream_content_type_});
    }
    out.emplace_back(EndStream{});
    return;
  }
  if (!Is2xx(status)) {
    Release(out);  // normally already done at the status line
    Fail(Outcome::kDecodeError, status, leg.content_type, std::move(leg.body), out);
    return;
  }
  if (leg.body.empty()) {
    Release(out);
    FailWithError(Outcome::kDecodeError, 502, "bad_gateway", "decode returned an empty response",
                  out);
    return;
  }
  decode_succeeded_ = true;
  client_done_ = true;
  outcome_ = Outcome::kOk;
  out.emplace_back(Respond{status, leg.content_type.empty() ? std::string(kJson) : leg.content_type,
                           std::move(leg.body)});
}

std::vector<Action> PdFlow::OnLegError(int leg_id, LegFailure failure, const Status& error,
                                       TimePoint now) {
  std::vector<Action> out;
  Leg* leg = FindOpenLeg(leg_id);
  if (leg == nullptr) return out;
  leg->open = false;
  leg->record.failed = true;
  leg->record.ended_at = now;
  if (client_done_) return out;
  std::string what =
      std::string(RoleName(leg->record.role)) + " " + leg->instance.url + ": " + error.ToString();
  if (leg->record.role == Role::kPrefill) {
    if (options_.mode == KvTransferMode::kRead && failure == LegFailure::kUnreachable) {
      hold_prefill_.reset();  // the request never reached it
      if (SendPrefill(now, out)) return out;
      FailWithError(Outcome::kUnreachable, 502, "bad_gateway", "no prefill reachable: " + what,
                    out);
      return out;
    }
    // WRITE: the decode leg names this prefill; the pair goes again elsewhere. READ: broken.
    const bool may_hold = failure != LegFailure::kUnreachable;
    if (options_.mode == KvTransferMode::kWrite && RetryWritePair(may_hold, now, out)) return out;
    if (!may_hold) hold_prefill_.reset();
    CancelAll(out);
    Release(out);
    FailWithError(
        failure == LegFailure::kUnreachable ? Outcome::kUnreachable : Outcome::kPrefillError, 502,
        "bad_gateway", "prefill leg failed: " + what, out);
    return out;
  }
  // Decode leg.
  if (failure == LegFailure::kUnreachable && !stream_started_) {
    if (SendDecode(now, out)) return out;
    CancelAll(out);
    Release(out);
    FailWithError(Outcome::kUnreachable, 502, "bad_gateway", "no decode reachable: " + what, out);
    return out;
  }
  CancelAll(out);
  Release(out);
  FailWithError(Outcome::kDecodeError, 502, "bad_gateway", "decode leg failed: " + what, out);
  return out;
}

std::vector<Action> PdFlow::OnClientDisconnect(TimePoint now) {
  std::vector<Action> out;
  if (client_done_ || !started_) return out;
  client_done_ = true;
  outcome_ = Outcome::kClientDisconnected;
  CancelAll(out);
  Release(out);
  return out;
}

std::vector<Action> PdFlow::OnTick(TimePoint now) {
  std::vector<Action> out;
  if (client_done_) return out;
  if (waiting_ != Waiting::kNone && now >= repick_at_ && (deadline_ < 0 || now < deadline_)) {
    const Waiting step = waiting_;
    Role missing = waiting_role_;
    const bool sent =
        step == Waiting::kFirstLegs ? StartFirstLegs(now, out, &missing) : SendDecode(now, out);
    if (sent) {
      waiting_ = Waiting::kNone;
    } else if (!WaitForInstance(missing, now)) {
      FailNoInstance(missing, out);
    }
    return out;
  }
  if (deadline_ < 0 || now < deadline_) return out;
  waiting_ = Waiting::kNone;
  CancelAll(out);
  Release(out);
  FailWithError(Outcome::kTimeout, 504, "timeout", "request timed out in the proxy", out);
  return out;
}

}  // namespace kvbridge::proxy
