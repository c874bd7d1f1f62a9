// cuda_ipc/ipc_handshake.h — the cluster-token and uid checks of the cuda_ipc handshake
// (issue 22), apart from CUDA so that they build and are tested on machines without it.
//
// The cuda_ipc serving agent answers a client's Hello with its IPC handle table (every layer of
// the KV pool, read-write to whoever opens it). Before that table is sent:
//   both sides check the other end's uid (SO_PEERCRED on the abstract socket): another uid is
//   refused with PermissionDenied naming both (CUDA itself lets only the same uid, or
//   CAP_SYS_PTRACE, open an IPC handle; anyone can bind an abstract name);
//   with a cluster token, the same mutual challenge-response as shm/tcp (transfer/auth.h):
//     server -> kChallenge      server nonce
//     client -> kChallengeResp  HMAC(token, "kvbridge-cuda_ipc-v1|<server inc>|<client>" || nonce)
//                               || client nonce  (empty when the client has no token)
//     server -> kServerProof    HMAC(token, "kvbridge-cuda_ipc-v1-server|..." || client nonce)
//     server -> kHelloAck       the table
//   a refused client gets kHelloAck with the status and the reason and nothing else; a client
//   with a token takes a table only after a valid server proof (else Unauthenticated, and no
//   handle is opened).
// The frames travel over the backend's Channel (peer_link.h); FrameIo is that channel's send and
// receive, so tests can drive these functions over a plain socket pair.
//
// Thread-safety: none needed (one handshake per call, on the caller's thread).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>

#include "kvbridge/common/status.h"
#include "kvbridge/transfer/backend.h"

namespace kvbridge::transfer::cuda_ipc_auth {

// Frame types of the backend's handshake (cuda_ipc_backend.cc has 101..103).
inline constexpr uint32_t kHelloAck = 102;
inline constexpr uint32_t kChallenge = 104;
inline constexpr uint32_t kChallengeResp = 105;
inline constexpr uint32_t kServerProof = 106;

struct Frame {
  uint32_t type = 0;
  std::string payload;
};

/// One connection's frames: send one, receive one (Unavailable / DeadlineExceeded as Channel).
struct FrameIo {
  std::function<Status(uint32_t type, std::string_view payload)> send;
  std::function<Result<Frame>(int timeout_ms)> recv;
};

/// The uid at the other end of the connected unix socket `fd` must be this process's:
/// PermissionDenied naming both uids (and the peer's pid) otherwise. `who` names the other end.
Status CheckPeerUid(int fd, const char* who);

/// Server side, after a valid Hello from `client_name`: OK at once when `crypto` is empty (no
/// token). Else challenges, checks the answer in constant time and sends its own proof. Not OK:
/// Unauthenticated (no token / wrong token / malformed answer: the reason to send the client in
/// a refusing HelloAck) or the channel's error.
Status ServeChallenge(FrameIo& io, const HandshakeCrypto& crypto, uint64_t server_incarnation,
                      std::string_view client_name, int timeout_ms);

/// A refusing HelloAck's payload: u32 status code (little-endian), then the reason.
std::string RefusalPayload(const Status& why);

/// Client side, after its Hello: reads frames until the HelloAck and returns it when it accepts
/// (its status word 0). Answers a challenge (the proof and a fresh nonce with a token, an empty
/// answer without). With a token, a HelloAck that follows no valid kServerProof is refused:
/// Unauthenticated ("the serving agent did not prove the cluster token ..." / "... proof of the
/// cluster token is wrong ..."). A refusing HelloAck is returned as its status ("cuda_ipc
/// handshake refused: <reason>"); anything else malformed is Unavailable.
Result<Frame> AwaitHelloAck(FrameIo& io, const HandshakeCrypto& crypto, uint64_t server_incarnation,
                            std::string_view client_name, int timeout_ms);

}  // namespace kvbridge::transfer::cuda_ipc_auth
