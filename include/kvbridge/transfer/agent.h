// kvbridge/transfer/agent.h — the KV transfer agent: one per engine rank.
//
// Moves KV blocks between engines (P/D): READ pulls a peer's blocks into local ones, WRITE
// pushes local blocks into a peer's. Backends: shm (same host, one-sided memcpy between memfd
// mappings), tcp (two-sided readv/writev straight from/into registered memory, asks the owner
// whether blocks are held), ucx (when built), cuda_ipc (CUDA device memory of processes on one
// host, one gather/scatter kernel per transfer; when built with KVBRIDGE_WITH_CUDA; register
// with KvRegistration::FromDeviceMemory). DESIGN.md "Transfer agent"; docs/transfer.md,
// docs/gpu.md.
//
//   AgentConfig cfg; cfg.name = "prefill-0/rank0"; cfg.model_fingerprint = fp;
//   ASSIGN_OR_RETURN(auto agent, TransferAgent::Create(cfg));
//   RETURN_IF_ERROR(agent->RegisterMemory(KvRegistration::FromHostBuffer(layout, kv_buffer)));
//   std::string blob = EncodeMetadata(*agent->Metadata());        // ship to the peer
//   ...
//   ASSIGN_OR_RETURN(AgentMetadata peer, DecodeMetadata(peer_blob));
//   ASSIGN_OR_RETURN(std::string backend, agent->AddPeer(peer));
//   TransferSpec spec{TransferOp::kRead, peer.agent_name, {{3, 17}, {4, 18}}};
//   ASSIGN_OR_RETURN(auto prepared, agent->Prepare(spec));        // reusable
//   PostOptions opt; opt.transfer_id = "req-1"; opt.notification = "read-done rank0";
//   opt.on_reply = [](Result<std::string> r) { /* "hold still valid?" answer */ };
//   ASSIGN_OR_RETURN(TransferHandle h, agent->Post(prepared, opt));
//   h.Wait(10'000);  // or poll h.state()
//
// Threads: each agent runs its own progress threads (accept, per-connection readers/senders,
// copy workers, a timer); no engine thread is needed for progress. Callbacks (notification
// handler, on_reply, hold check) run on those threads: keep them short, never block on the
// agent itself.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "kvbridge/common/status.h"
#include "kvbridge/transfer/backend.h"
#include "kvbridge/transfer/memory.h"
#include "kvbridge/transfer/metadata.h"

namespace kvbridge::transfer {

struct AgentConfig {
  std::string name;  ///< Required; unique per rank (peer id).
  /// Backends to start, in preference order ("shm", "tcp", "ucx" / "cuda_ipc" when built).
  /// Only those that move the registered MemoryKind are started (device memory: cuda_ipc).
  std::vector<std::string> backends = {"shm", "tcp"};
  /// When set, every peer uses this backend (AddPeer fails if either side lacks it).
  std::string force_backend;
  std::string bind_host = "127.0.0.1";  ///< tcp listen address.
  int tcp_port = 0;                     ///< 0 = ephemeral.
  int tcp_connections = 2;              ///< Connections per tcp peer (data striped over them).
  int copy_threads = 1;                 ///< shm copy workers.
  /// Bound on peer-failure detection for two-sided backends: a request without progress for
  /// this long fails with Unavailable and the peer is marked dead.
  int peer_timeout_ms = 5000;
  int reply_timeout_ms = 5000;  ///< A notification's reply not received by then: DeadlineExceeded.
  int tp_size = 1;
  int tp_rank = 0;
  int head_begin = 0;  ///< First global KV head of this rank.
  std::string model_fingerprint;
  /// The cluster's shared secret (serve --cluster-token). When set, proven both ways on every
  /// handshake (HMAC-SHA256 challenge-response; the token never crosses the wire): our servers
  /// accept a peer only after it proves the token (a peer without it or with another is refused
  /// with Unauthenticated before any memory is reachable), and AddPeer accepts a serving peer
  /// only after it proved the token back (Unauthenticated otherwise: a peer impersonating the
  /// agent its metadata names gets nothing). shm also accepts only peers of this process's uid
  /// (SO_PEERCRED, both ends), token or not. "" = no token check (the behaviour before issue 22).
  /// Covered: shm, tcp, ucx (active-message handshake; rkeys are sent only after it, see
  /// docs/transfer.md "Threat model" for what UCX's tcp RMA still trusts); cuda_ipc does not
  /// check it.
  std::string cluster_token;
  /// Asked by two-sided backends before serving a peer's request (nullptr = allow all).
  HoldCheck hold_check;
};

/// Terminal states are kDone and kFailed (status() says why: Cancelled, Unavailable, ...).
/// Transitions: kPending -> kDone | kFailed, once.
enum class TransferState : uint8_t { kPending = 0, kDone = 1, kFailed = 2 };

/// A contiguous byte range inside each K half and each V half of a block (a head range).
struct ByteRange {
  uint64_t offset = 0;
  uint64_t length = 0;
};
/// The byte range of KV heads [head_begin, head_begin + head_count) (rank-local head indices)
/// inside one half block of `layout`.
ByteRange HeadRangeBytes(const PagedKvLayout& layout, int head_begin, int head_count);

struct BlockPair {
  int local = 0;
  int remote = 0;
};

struct TransferSpec {
  TransferOp op = TransferOp::kRead;
  std::string peer;               ///< Peer agent_name (AddPeer first).
  std::vector<BlockPair> blocks;  ///< (local block id, remote block id) pairs.
  int layer = -1;                 ///< -1 = all layers; else one layer index.
  /// Optional sub-range of each half block (both or neither; equal lengths).
  std::optional<ByteRange> local_range;
  std::optional<ByteRange> remote_range;
};

/// A validated, coalesced descriptor list; immutable, reusable, thread-safe.
class PreparedTransfer {
 public:
  TransferOp op() const { return op_; }
  const std::string& peer() const { return peer_; }
  uint64_t bytes() const { return bytes_; }
  /// Segments after coalescing (adjacent block pairs merge).
  size_t segment_count() const { return segments_->size(); }
  const std::vector<Segment>& segments() const { return *segments_; }

 private:
  friend class TransferAgent;
  TransferOp op_ = TransferOp::kRead;
  std::string peer_;
  uint64_t bytes_ = 0;
  std::shared_ptr<const std::vector<Segment>> segments_;
};

/// Handle of one posted transfer. Copyable; all copies share the state. Thread-safe.
class TransferHandle {
 public:
  struct State;
  TransferHandle() = default;
  explicit TransferHandle(std::shared_ptr<State> s) : s_(std::move(s)) {}
  TransferState state() const;
  /// OK while pending or done; the failure (Cancelled, Unavailable, InvalidArgument, ...).
  Status status() const;
  /// Waits until terminal or `timeout_ms` passes; returns true when terminal. On shm the
  /// waiting thread first runs the parts of the copy no copy thread has started yet (no thread
  /// hand-off, no wake-up to complete), so it can return later than `timeout_ms` by the time of
  /// those copies; the notification (if any) is then sent from this thread.
  bool Wait(int timeout_ms) const;
  /// Requests cancellation. The transfer turns terminal (kFailed/Cancelled, or kDone if it
  /// finished first) only when no more of its bytes can land; its notification is not sent.
  void Cancel() const;
  const std::string& transfer_id() const;

 private:
  std::shared_ptr<State> s_;
};

/// Called with a notification's reply: the payload, Unavailable (peer lost), or
/// DeadlineExceeded (no reply within reply_timeout_ms).
using ReplyCallback = std::function<void(Result<std::string>)>;

struct PostOptions {
  std::string transfer_id;  ///< Names the transfer to the peer (hold check, notification).
  /// Sent to the peer after all of this transfer's data has landed (READ: locally; WRITE: at
  /// the peer, acknowledged by it). Not sent when the transfer fails or is cancelled.
  std::optional<std::string> notification;
  ReplyCallback on_reply;  ///< When set, the notification asks for a reply.
};

/// A notification received from a peer.
struct Notification {
  std::string peer;  ///< Sender's agent_name.
  uint64_t id = 0;
  std::string transfer_id;
  std::string payload;
  bool wants_reply = false;
};
using NotificationHandler = std::function<void(Notification)>;

/// Thread-safety: every method may be called from any thread concurrently.
class TransferAgent {
 public:
  static Result<std::unique_ptr<TransferAgent>> Create(AgentConfig config);
  ~TransferAgent();
  TransferAgent(const TransferAgent&) = delete;
  TransferAgent& operator=(const TransferAgent&) = delete;

  /// Registers the rank's KV cache, once, and starts the backends. InvalidArgument for a bad
  /// registration; FailedPrecondition when called twice.
  Status RegisterMemory(const KvRegistration& reg);
  /// This agent's metadata (after RegisterMemory, else FailedPrecondition).
  Result<AgentMetadata> Metadata() const;
  /// Imports a peer: checks compatibility (FailedPrecondition naming the field), chooses the
  /// backend (forced, or the first of ours the peer also offers and can reach), connects.
  /// Returns the backend name. Re-adding a peer with a new incarnation replaces the old one.
  Result<std::string> AddPeer(const AgentMetadata& peer);
  Status RemovePeer(const std::string& peer_name);
  /// Backend used for `peer_name`; NotFound if unknown.
  Result<std::string> PeerBackend(const std::string& peer_name) const;

  /// Validates `spec` against both layouts (InvalidArgument for out-of-range blocks, layers or
  /// ranges; NotFound for an unknown peer) and coalesces adjacent pairs. Cost O(pairs x layers).
  Result<std::shared_ptr<const PreparedTransfer>> Prepare(const TransferSpec& spec) const;
  /// Posts asynchronously. Unavailable at once when the peer is known dead.
  Result<TransferHandle> Post(std::shared_ptr<const PreparedTransfer> prepared,
                              PostOptions options = {});

  /// Handler for notifications from peers (replaces the previous one).
  void SetNotificationHandler(NotificationHandler handler);
  /// Sends a standalone notification (no transfer). Unavailable when the peer is unreachable.
  Status Notify(const std::string& peer_name, const std::string& transfer_id, std::string payload,
                ReplyCallback on_reply = nullptr);
  /// Replies to a notification that wants_reply. Unavailable if its sender is gone.
  Status Reply(const Notification& n, std::string payload);
  /// Replaces the hold check (see AgentConfig::hold_check).
  void SetHoldCheck(HoldCheck check);
  /// Called with a peer's agent_name when a connection to or from it was lost (the peer died or
  /// closed it — shm: its control socket closed; not when we removed it), on a backend thread,
  /// after its pending replies failed. Replaces the previous one; nullptr: none.
  void SetPeerLostHandler(std::function<void(const std::string& peer_name)> handler);

  /// Handshakes refused since Create (monotonic; for metrics).
  struct HandshakeRefusals {
    int64_t peers = 0;    ///< Peers our servers refused (no / wrong cluster token, another uid).
    int64_t servers = 0;  ///< Serving peers AddPeer refused (unproven token, wrong token, uid).
    /// ucx: refused peers whose reverse endpoint has been closed since (about a second after
    /// the refusal; shm and tcp close a refused connection at once and leave this 0).
    int64_t released = 0;
  };
  HandshakeRefusals HandshakeRefusalCounts() const;

  class Impl;

 private:
  explicit TransferAgent(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

/// Names of the backends compiled into this build ("shm", "tcp", maybe "ucx").
std::vector<std::string> AvailableBackends();

}  // namespace kvbridge::transfer
