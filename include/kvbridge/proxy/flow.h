// kvbridge/proxy/flow.h — the proxy's P→D flow for one client request, as a sans-IO state machine.
//
// One PdFlow joins one client request to a prefill leg and a decode leg (DESIGN.md "READ mode",
// "WRITE mode", "Failures"). It reads no clock, socket or random source: the runtime (the proxy
// server, or the simulator) feeds it events — the client request, each leg's status, body bytes,
// end or error, the client's disconnect, timer ticks — with `now`, and executes the actions it
// returns, in order: send a leg, cancel a leg, release a hold at a prefill, answer the client
// (whole, or as a stream).
//
//   PdFlow flow(FlowOptions{}, /*transfer_id=*/"9f0c...", picker);
//   auto actions = flow.OnClientRequest({"/v1/completions", body}, now);
//   // execute actions; then, as bytes arrive from the legs:
//   actions = flow.OnLegStatus(leg_id, 200, "application/json", now);
//   actions = flow.OnLegData(leg_id, bytes, now);
//   actions = flow.OnLegDone(leg_id, now);
//   ... until flow.done().
//
// READ mode: the prefill leg goes first (max_tokens=1, stream=false, n=1 unless
// prefill_forward_n, no output-shaping fields, kv_transfer_params{do_remote_decode, transfer_id});
// when it answers 2xx, the decode leg carries the client's body plus the prefill's
// kv_transfer_params with do_remote_prefill=true. WRITE mode: both legs start together; the
// decode leg names the prefill (remote_engine_id/host/port, its tp_size, mode "write").
//
// Failure rules: client-supplied kv_transfer_params are dropped; a leg that could not be reached
// (connect failed, nothing sent) or that an engine refused with 503 (draining, queue full: it
// admitted nothing) is sent to another instance of its role. WRITE mode, where the decode leg
// names the prefill: when the prefill leg fails (unreachable, broken, 503 or any 5xx) before the
// client got a byte, the pair's decode leg is cancelled at once, what the failed prefill may hold
// is released, and the pair is sent again to another prefill with a fresh transfer_id
// (FlowOptions::mint_transfer_id), up to max_attempts pairs. Otherwise a leg's non-2xx status and
// body reach the client as they are; once a prefill leg was sent, every path that does not end
// in a successful decode emits ReleaseHold(transfer_id) at once (the prefill parks a release that
// arrives before its transfer registers); a client disconnect or the deadline (FlowOptions::
// timeout, or the client's own ClientRequest::timeout when shorter) cancels every leg in flight.
// A streamed answer starts (StartStream) with the decode's first body bytes, not its status line,
// so a pair that fails before any token can still be retried. The client never gets an empty 200.
//
// Thread-safety: none; one owner drives a flow (the runtime serialises its events).
#pragma once

#include <deque>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/kv_transfer_mode.h"
#include "kvbridge/common/status.h"

namespace kvbridge::proxy {

/// How KV moves from prefill to decode (DESIGN.md): READ = decode pulls, WRITE = prefill pushes.

enum class Role { kPrefill, kDecode };
std::string_view RoleName(Role role);  // "prefill" / "decode"
/// Parses "prefill" / "decode"; InvalidArgument otherwise.
Result<Role> ParseRole(std::string_view text);

/// How to reach one engine instance. `url` is its HTTP base ("http://127.0.0.1:8100", no
/// trailing slash). engine_id / transfer_host / transfer_port are its transfer-engine identity,
/// needed by WRITE mode's decode leg (empty / 0 when unknown); tp_size is its tensor-parallel
/// size (from its registration; 1 for static instances), which WRITE mode's decode leg names as
/// the prefill's `tp_size` since that leg is built before the prefill answers.
struct Endpoint {
  std::string id;
  std::string url;
  std::string engine_id;
  std::string transfer_host;
  int transfer_port = 0;
  int tp_size = 1;
};

/// Chooses an instance of `role`, not one whose id or url is in `exclude` (instances already
/// tried by this flow, ids; a decode leg asks first with the url of the prefill holding its KV
/// added — one engine cannot READ from itself — then, when that finds none, without it);
/// nullopt when none is available. Must be deterministic for the simulator.
using InstancePicker =
    std::function<std::optional<Endpoint>(Role role, const std::vector<std::string>& exclude)>;

struct FlowOptions {
  KvTransferMode mode = KvTransferMode::kRead;
  /// Send the client's `n` to the prefill leg (exercises the prefill's 1:many sibling path);
  /// default sends n=1 since every sibling shares the prompt's KV.
  bool prefill_forward_n = false;
  /// Attempts per role when an instance cannot be reached or refuses with 503, and (WRITE mode)
  /// attempts of the prefill/decode pair when its prefill leg fails.
  int max_attempts = 3;
  /// Mints the transfer_id of a retried WRITE pair (the runtime: MintTransferId). Null: the
  /// first transfer_id + "-" + the pair's number ("...-2"), deterministic for the simulator.
  std::function<std::string()> mint_transfer_id;
  /// Bound on the whole request, from OnClientRequest; past it the flow answers 504 (or ends the
  /// stream with an error event) and cancels the legs. 0 = no bound.
  DurationUs timeout = 0;
  /// When no instance of a role is routable (every one draining or restarting), how long the
  /// request waits for one — picking again every instance_poll, driven by OnTick — before it
  /// gets 503. 0 = 503 at once. (A rolling restart of the only prefill loses no request.)
  DurationUs instance_wait = 0;
  DurationUs instance_poll = 50 * kMillisecond;
  /// No P/D: each request goes whole (client kv_transfer_params still dropped) to one instance of
  /// the decode role, which prefills and decodes it itself; no prefill leg, nothing to release.
  /// For comparing P/D with the same engines serving alone behind the same proxy.
  bool colocated = false;
};

/// Why a leg failed without an HTTP status: kUnreachable = the request never reached the instance
/// (connect refused / timed out; safe to retry elsewhere); kBroken = the connection failed after
/// the request was sent (the instance may have acted on it).
enum class LegFailure { kUnreachable, kBroken };

/// The client's request: path ("/v1/completions" or "/v1/chat/completions") and JSON body.
/// `timeout` is the client's own bound on the whole request (the X-Request-Timeout header, see
/// ParseRequestTimeout; 0 = none): the flow's deadline is the earlier of it and
/// FlowOptions::timeout.
struct ClientRequest {
  std::string path;
  std::string body;
  DurationUs timeout = 0;
};

/// The header a client bounds its request with, end to end: seconds, a decimal > 0 and at most
/// 86400 ("2.5"). Past it the proxy cancels both legs, releases the hold and answers 504.
inline constexpr const char* kRequestTimeoutHeader = "X-Request-Timeout";
/// Parses an X-Request-Timeout value into microseconds. InvalidArgument (the message says why)
/// for anything but a plain decimal number of seconds in (0, 86400].
Result<DurationUs> ParseRequestTimeout(std::string_view value);

// Actions the runtime executes, in the order returned.
/// Send a POST of `body` (JSON) to instance.url + path. Report its events under `leg_id`.
struct SendLeg {
  int leg_id = 0;
  Role role = Role::kPrefill;
  Endpoint instance;
  std::string path;
  std::string body;
  bool stream = false;  // the response is SSE; report body bytes as they arrive
};
/// Abort the leg (close its connection); no more events for it will be used.
struct CancelLeg {
  int leg_id = 0;
};
/// POST {prefill.url}/v1/kv/release {"transfer_id": transfer_id} with the cluster token.
struct ReleaseHold {
  Endpoint prefill;
  std::string transfer_id;
};
/// Answer the client with a whole response.
struct Respond {
  int status = 200;
  std::string content_type;
  std::string body;
};
/// Start a streamed (chunked) response to the client.
struct StartStream {
  int status = 200;
  std::string content_type;
};
/// Pass bytes to the client as they are (SSE from the decode).
struct StreamChunk {
  std::string data;
};
/// End the streamed response.
struct EndStream {};

using Action =
    std::variant<SendLeg, CancelLeg, ReleaseHold, Respond, StartStream, StreamChunk, EndStream>;

/// How a request ended (for the requests-by-outcome metric).
enum class Outcome {
  kPending,
  kOk,
  kBadRequest,          // the client's body was invalid (400)
  kNoInstance,          // no prefill or decode available (503)
  kPrefillError,        // the prefill answered non-2xx / unusable (forwarded or 502)
  kDecodeError,         // the decode answered non-2xx (forwarded) or broke
  kUnreachable,         // every attempt at a role failed to connect (502)
  kClientDisconnected,  // the client went away first
  kTimeout,             // FlowOptions::timeout passed (504)
};
std::string_view OutcomeName(Outcome outcome);  // "ok", "bad_request", ...

/// One leg's record, for per-leg latency metrics: times are the `now` values of its events.
struct LegRecord {
  int leg_id = 0;
  Role role = Role::kPrefill;
  std::string instance_id;
  TimePoint sent_at = 0;
  TimePoint first_byte_at = -1;  // -1: no status yet
  TimePoint ended_at = -1;       // -1: still open (or cancelled: see cancelled)
  int status = 0;                // HTTP status, 0 when none
  bool cancelled = false;
  bool failed = false;  // OnLegError
};

class PdFlow {
 public:
  /// `transfer_id` is minted by the runtime (unique per client request, e.g. 128-bit random hex).
  PdFlow(FlowOptions options, std::string transfer_id, InstancePicker picker);

  // Events. Each returns the actions to execute now. Events for an unknown, cancelled or
  // finished leg and events after done() return nothing.
  std::vector<Action> OnClientRequest(const ClientRequest& request, TimePoint now);
  /// The leg's HTTP status line and Content-Type arrived.
  std::vector<Action> OnLegStatus(int leg_id, int status, std::string_view content_type,
                                  TimePoint now);
  /// Body bytes of the leg (de-chunked), in order.
  std::vector<Action> OnLegData(int leg_id, std::string_view data, TimePoint now);
  /// The leg's response is complete.
  std::vector<Action> OnLegDone(int leg_id, TimePoint now);
  /// The leg failed without (or after part of) a response.
  std::vector<Action> OnLegError(int leg_id, LegFailure failure, const Status& error,
                                 TimePoint now);
  /// The client closed its connection before the response completed.
  std::vector<Action> OnClientDisconnect(TimePoint now);
  /// Time passed; call at or after deadline().
  std::vector<Action> OnTick(TimePoint now);

  /// When the runtime should call OnTick next (nullopt: no timer needed).
  std::optional<TimePoint> deadline() const;
  /// The client's response has been fully emitted (Respond or EndStream) or the client is gone.
  bool client_done() const { return client_done_; }
  /// client_done() and no leg is in flight: the flow can be destroyed.
  bool done() const;
  Outcome outcome() const { return outcome_; }
  /// The current transfer_id (a retried WRITE pair has a fresh one).
  const std::string& transfer_id() const { return transfer_id_; }
  /// Every leg this flow started, in order.
  std::vector<LegRecord> legs() const;
  /// Pairs sent (1, or more after WRITE pair retries).
  int pair_attempts() const { return pair_attempts_; }
  /// True when the client asked for a streamed response.
  bool client_stream() const { return client_stream_; }

 private:
  struct Leg {
    LegRecord record;
    Endpoint instance;
    std::string content_type;
    std::string body;  // accumulated body (unless passed through as a stream)
    bool open = true;
    bool passthrough = false;  // bytes go straight to the client
  };
  Leg* FindOpenLeg(int leg_id);
  Leg* FindLeg(int leg_id);
  int StartLeg(Role role, const Endpoint& instance, std::string body, bool stream, TimePoint now,
               std::vector<Action>& out);
  bool SendPrefill(TimePoint now, std::vector<Action>& out);
  bool SendDecode(TimePoint now, std::vector<Action>& out);
  void OnPrefillDone(Leg& leg, TimePoint now, std::vector<Action>& out);
  void OnDecodeDone(Leg& leg, TimePoint now, std::vector<Action>& out);
  void Fail(Outcome outcome, int status, std::string content_type, std::string body,
            std::vector<Action>& out);
  void FailWithError(Outcome outcome, int status, std::string_view type, std::string_view message,
                     std::vector<Action>& out);
  void Release(std::vector<Action>& out);
  void Cancel(Leg& leg, std::vector<Action>& out);
  void CancelAll(std::vector<Action>& out);
  // A leg an engine refused with 503 (nothing admitted), before the client got a byte: sent to
  // another instance of its role (WRITE prefill: the pair again). False when none is left.
  bool RetryRefused(Leg& leg, TimePoint now, std::vector<Action>& out);
  // WRITE: the prefill leg failed before the client got a byte; cancels the decode leg, releases
  // what the failed prefill may hold, and sends a new pair with a fresh transfer_id (or answers
  // 503 when no decode is left). False, having done nothing, when no attempt or prefill is left.
  bool RetryWritePair(bool prefill_may_hold, TimePoint now, std::vector<Action>& out);
  bool ClientHasBytes() const { return stream_started_ || client_done_; }
  // The first leg(s): READ's prefill, WRITE's pair, colocated's one leg. False when an instance
  // was missing (nothing sent); `missing` says which role.
  bool StartFirstLegs(TimePoint now, std::vector<Action>& out, Role* missing);
  // No instance of `role` now: wait for one (instance_wait) or answer 503. True when waiting.
  bool WaitForInstance(Role role, TimePoint now);
  void FailNoInstance(Role role, std::vector<Action>& out);

  FlowOptions options_;
  std::string transfer_id_;
  InstancePicker picker_;
  std::string path_;
  std::string client_body_;  // the client's JSON, kv_transfer_params stripped (dumped)
  std::string prefill_body_;
  bool client_stream_ = false;
  bool started_ = false;
  bool client_done_ = false;
  bool stream_started_ = false;
  bool decode_succeeded_ = false;
  bool released_ = false;
  std::optional<Endpoint> hold_prefill_;  // the prefill that may hold KV for this transfer
  std::vector<std::string> tried_prefill_;
  std::vector<std::string> tried_decode_;
  std::string prefill_kv_params_;  // READ: the decode leg's kv_transfer_params (dumped JSON)
  int prefill_leg_ = -1;
  int decode_leg_ = -1;
  int next_leg_id_ = 1;
  int pair_attempts_ = 1;
  std::string first_transfer_id_;
  // The decode's streamed status and Content-Type, sent with its first body bytes.
  int stream_status_ = 200;
  std::string stream_content_type_;
  TimePoint deadline_ = -1;
  // Waiting for an instance (FlowOptions::instance_wait): which step picks again, when, until.
  enum class Waiting { kNone, kFirstLegs, kReadDecode };
  Waiting waiting_ = Waiting::kNone;
  Role waiting_role_ = Role::kPrefill;
  TimePoint repick_at_ = -1;
  TimePoint wait_until_ = -1;
  Outcome outcome_ = Outcome::kPending;
  std::deque<Leg> legs_;  // deque: references stay valid as legs are added
};

/// Builds the prefill leg's body from the client's JSON object (kv_transfer_params already
/// stripped): max_tokens=1 (max_completion_tokens removed), stream=false, n=1 unless
/// `forward_n`, without min_tokens, stream_options, logprobs, top_logprobs, echo, best_of.
/// InvalidArgument when `client_body` is not a JSON object. Exposed for tests and the simulator.
Result<std::string> ShapePrefillBody(std::string_view client_body, bool forward_n,
                                     std::string_view kv_transfer_params_json);

/// 128 random bits as 32 lowercase hex characters, from the kernel's CSPRNG (getrandom, fetched in
/// batches of 32 ids per thread; std::random_device where getrandom fails). Runtime helper.
std::string MintTransferId();

}  // namespace kvbridge::proxy
