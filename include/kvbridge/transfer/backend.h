// kvbridge/transfer/backend.h — the one interface every transport backend implements.
//
// The agent (agent.h) owns policy: metadata, peer choice, descriptor preparation, coalescing,
// notifications, replies, transfer state. A backend only moves bytes and small messages:
//   * Start(registration) makes the local KV regions reachable and returns the endpoint string
//     advertised in the metadata ("" = this backend cannot serve this registration);
//   * Connect(peer metadata) opens a BackendPeer; BackendPeer::Submit moves the segments of one
//     TransferJob and calls job->finish exactly once, when no more bytes of it can land;
//   * messages are opaque bytes delivered in order to BackendContext::on_message.
// This header never names an implementation: backends live in src/transfer/backends/<name>/,
// one CMake target each, and are instantiated by name in src/transfer/backend_registry.cc.
// A new backend (e.g. cuda_ipc) implements Backend + BackendPeer, declares which MemoryKinds it
// moves, and adds one line to the registry.
//
// Thread-safety: Backend and BackendPeer methods may be called from any thread concurrently;
// callbacks in BackendContext are invoked on backend threads and must not block for long.
#pragma once

#include <atomic>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/status.h"
#include "kvbridge/transfer/memory.h"
#include "kvbridge/transfer/metadata.h"

namespace kvbridge::transfer {

/// READ pulls remote blocks into local memory; WRITE pushes local blocks into the peer's.
enum class TransferOp : uint8_t { kRead = 0, kWrite = 1 };

/// One contiguous run: `length` bytes at `local` <-> remote layer `remote_layer` at byte
/// `remote_offset` of that layer's registered region.
struct Segment {
  uint8_t* local = nullptr;
  uint32_t remote_layer = 0;
  uint64_t remote_offset = 0;
  uint64_t length = 0;
};

/// One posted transfer as a backend sees it.
struct TransferJob {
  TransferOp op = TransferOp::kRead;
  std::string transfer_id;
  std::shared_ptr<const std::vector<Segment>> segments;
  uint64_t total_bytes = 0;
  /// Set by TransferHandle::Cancel; backends poll it between chunks.
  std::atomic<bool> cancel{false};
  /// Called exactly once by the backend: OK (all bytes landed), Cancelled (stopped early; no
  /// more bytes can land), Unavailable (peer lost), or another error from the peer.
  std::function<void(Status)> finish;
  /// Optional, set by the backend in Submit (before it returns): runs the parts of this job no
  /// backend thread has started yet on the calling thread, then returns (finish may have been
  /// called by it). TransferHandle::Wait calls it before blocking, so a waiter copies instead of
  /// paying two thread hand-offs (shm). Safe to call from any thread, any number of times, also
  /// after the backend is gone (then it does nothing).
  std::function<void()> help;
};

/// Answers "may a peer do `op` on these blocks for this transfer_id?" for two-sided backends
/// (tcp), on the serving side, before any byte moves. `op` is the peer's (initiator's) op:
/// kRead = the peer reads these local blocks (allow only blocks held for that transfer);
/// kWrite = the peer writes into them (allow only blocks this side offered for that transfer).
/// `blocks` are sorted, distinct block ids of one layer-agnostic request. false = refused:
/// the peer gets PermissionDenied naming the op and transfer, no byte is read or written.
using HoldCheck = std::function<bool(TransferOp op, std::string_view transfer_id,
                                     const std::vector<int>& blocks)>;

class BackendPeer;

/// What the agent hands each backend.
/// The cluster-token handshake's primitives (transfer/auth.h), bound to the agent's token: a
/// fresh nonce, HMAC-SHA256(token, context || nonce), and its constant-time check. The agent
/// fills them when it has a token (empty = none); a backend built apart from the transfer
/// library (cuda_ipc: its CUDA-only build has no OpenSSL) proves the token through them.
struct HandshakeCrypto {
  std::function<Result<std::string>()> nonce;
  std::function<std::string(std::string_view context, std::string_view nonce)> proof;
  std::function<bool(std::string_view context, std::string_view nonce, std::string_view proof)>
      matches;
  explicit operator bool() const { return static_cast<bool>(proof); }
};

struct BackendContext {
  std::string agent_name;
  uint64_t incarnation = 0;
  std::string bind_host = "127.0.0.1";
  int tcp_port = 0;
  int tcp_connections = 2;
  int copy_threads = 1;
  int peer_timeout_ms = 5000;
  /// Shared secret of the cluster (AgentConfig::cluster_token); "" = handshakes unauthenticated.
  std::string cluster_token;
  /// cluster_token's proofs (set by the agent when cluster_token is).
  HandshakeCrypto crypto;
  /// A message from peer `peer_name` (in the order sent on that path).
  std::function<void(const std::string& peer_name, std::string bytes)> on_message;
  /// A peer connected to us; `channel` can send messages back (Submit is not supported on it).
  std::function<void(const std::string& peer_name, std::shared_ptr<BackendPeer> channel)>
      on_inbound;
  /// A connection to/from `peer_name` was lost (peer dead or closed).
  std::function<void(const std::string& peer_name)> on_peer_lost;
  /// Two-sided backends call this before serving a request; nullptr = allow.
  HoldCheck hold_check;
  /// The serving side refused a peer at the handshake (no / wrong cluster token, another uid);
  /// `peer_name` as the peer claimed it. nullptr = not counted.
  std::function<void(const std::string& peer_name, const Status& why)> on_refused;
  /// A refused peer's connection was released later than the refusal (ucx closes a refused
  /// reverse endpoint after a grace period; shm and tcp close at once and do not call this).
  std::function<void(const std::string& peer_name)> on_refused_released;
};

class BackendPeer {
 public:
  virtual ~BackendPeer() = default;
  /// Moves the job's segments; job->finish is called exactly once (maybe before return).
  virtual void Submit(std::shared_ptr<TransferJob> job) = 0;
  /// Sends one opaque message; Unavailable once the peer is known dead.
  virtual Status SendMessage(std::string_view bytes) = 0;
  virtual bool alive() const = 0;
  /// Closes the connection; pending jobs finish with Unavailable.
  virtual void Close() = 0;
};

class Backend {
 public:
  virtual ~Backend() = default;
  virtual std::string_view name() const = 0;
  /// True for one-sided backends (the target is not asked; trusted peers only).
  virtual bool one_sided() const = 0;
  virtual bool Supports(MemoryKind kind) const = 0;
  /// Makes `reg` reachable; returns the endpoint to advertise or "" when this backend cannot
  /// serve `reg` (e.g. shm with memory that is not memfd-backed). `reg` outlives the backend.
  virtual Result<std::string> Start(const KvRegistration& reg) = 0;
  /// Fills backend-specific metadata (optional).
  virtual void Describe(AgentMetadata& m) const {}
  /// Whether `peer` (which advertised this backend) is reachable from `local`.
  virtual bool CanReach(const AgentMetadata& local, const AgentMetadata& peer) const = 0;
  /// Connects and handshakes (expects the peer's incarnation); Unavailable on failure.
  virtual Result<std::shared_ptr<BackendPeer>> Connect(const AgentMetadata& peer) = 0;
  /// Stops threads and closes connections. Idempotent.
  virtual void Shutdown() = 0;
};

}  // namespace kvbridge::transfer
