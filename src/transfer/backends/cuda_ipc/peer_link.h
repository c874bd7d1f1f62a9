// cuda_ipc/peer_link.h — the host-side path between the two processes of a cuda_ipc pair:
// framed messages over a Unix stream socket (IPC handles, notifications, test commands), a
// peer-process launcher, and "post, then notify once the data has landed".
//
//   ASSIGN_OR_RETURN(PeerProcess peer, SpawnPeer(peer_binary, /*device=*/0));
//   ASSIGN_OR_RETURN(PendingTransfer t, PostToPeer(*engine, *peer.channel, CopyOp::kWrite,
//                                                  local, remote, pairs, EncodeNotify(7, 0)));
//   Status st;
//   while (Progress(t, *peer.channel, &st) == CopyState::kInProgress) {}
//
// Thread-safety: a Channel is used by one thread at a time.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/status.h"
#include "transfer/backends/cuda_ipc/block_copy.h"

namespace kvbridge::cuda_ipc {

/// Message types of the peer protocol (tests, bench and the peer helper binary).
enum class MsgType : uint32_t {
  kAlloc = 1,  // u64 bytes                        -> kHandle (IpcHandle::Serialize)
  kHandle = 2,
  kFill = 3,    // u64 seed                         -> kOk
  kVerify = 4,  // VerifySpec                       -> kCount (u64 mismatched words)
  kCount = 5,
  kNotify = 6,  // u64 transfer_id, i64 t0_ns [, VerifySpec checked on arrival]; no reply
  kReport = 7,  // -> kReportList: per notify {u64 id, i64 latency_ns, i64 mismatches|-1}
  kReportList = 8,
  kOk = 9,
  kError = 10,  // text
  kExit = 11,   // -> kOk, then the peer exits 0
  // kServeBackend: u64 layers -> kEndpoint (u64 incarnation + endpoint text): starts a
  // cuda_ipc transfer Backend over the pool split into that many layers.
  kServeBackend = 12,
  kEndpoint = 13,
  kMessages = 14,  // -> kMessages: agent messages the backend received, "from:bytes\n" each
  // 100..199 are the cuda_ipc transfer backend's own frames (cuda_ipc_backend.cc).
};

struct Message {
  MsgType type = MsgType::kOk;
  std::string payload;
};

/// Move-only framed-message channel over a connected stream socket (owns the fd).
class Channel {
 public:
  explicit Channel(int fd) : fd_(fd) {}
  ~Channel();
  Channel(const Channel&) = delete;
  Channel& operator=(const Channel&) = delete;

  /// Unavailable once the peer has closed or died.
  Status Send(MsgType type, std::string_view payload);
  /// Waits up to `timeout_ms` (< 0: forever). Unavailable on EOF, DeadlineExceeded on timeout,
  /// InvalidArgument on a malformed frame (> 1 GiB).
  Result<Message> Recv(int timeout_ms);
  /// False once the other end is closed (process gone); non-blocking.
  bool PeerAlive() const;
  /// Shuts the socket down both ways (wakes a blocked Recv with Unavailable); idempotent.
  void Shutdown();
  int fd() const { return fd_; }

 private:
  int fd_;
};

/// A helper process (the cuda_ipc_peer binary) connected over a socketpair.
struct PeerProcess {
  pid_t pid = -1;
  std::unique_ptr<Channel> channel;
  PeerProcess() = default;
  PeerProcess(PeerProcess&&) noexcept;
  PeerProcess& operator=(PeerProcess&&) noexcept;
  /// Kills (SIGKILL) and reaps a still-running peer.
  ~PeerProcess();
  /// Sends kExit and reaps the process (SIGKILL after `timeout_ms`).
  Status Stop(int timeout_ms);
  /// SIGKILL and reap: simulates a crashed peer.
  void Kill();
};

/// Starts `binary --fd 3 --device N` with one end of a socketpair on fd 3.
Result<PeerProcess> SpawnPeer(const std::string& binary, int device);
/// `$KVBRIDGE_CUDA_IPC_PEER`, else cuda_ipc_peer beside the running executable.
std::string DefaultPeerBinary();

/// What a verifier must find in a region (see VerifyBlocks).
struct VerifySpec {
  uint64_t src_seed = 0;
  uint64_t poison_seed = 0;
  uint64_t block_bytes = 0;
  std::vector<int32_t> src_of;
  std::string Encode() const;
  static Result<VerifySpec> Decode(std::string_view bytes);
};

std::string EncodeU64s(std::span<const uint64_t> v);
Result<std::vector<uint64_t>> DecodeU64s(std::string_view bytes);

/// A posted copy whose notification is sent once its data has landed.
struct PendingTransfer {
  CopyHandle copy;
  std::string notification;
  bool finished = false;
  Status status;
};

/// Unavailable (nothing launched) when the peer is gone; otherwise CopyEngine::Post's result.
Result<PendingTransfer> PostToPeer(CopyEngine& engine, Channel& channel, CopyOp op,
                                   const BlockRegion& local, const BlockRegion& remote,
                                   std::span<const BlockPair> pairs, std::string notification);
/// Non-blocking. kDone only after the copy's event completed AND the notification was sent;
/// kFailed (with `*status` set) when the kernel failed or the peer is gone (Unavailable).
CopyState Progress(PendingTransfer& t, Channel& channel, Status* status);

}  // namespace kvbridge::cuda_ipc
