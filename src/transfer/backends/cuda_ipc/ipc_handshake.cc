#include "transfer/backends/cuda_ipc/ipc_handshake.h"

#include <sys/socket.h>
#include <unistd.h>

#include "transfer/auth.h"

namespace kvbridge::transfer::cuda_ipc_auth {
namespace {

constexpr std::string_view kBackend = "cuda_ipc";

uint32_t StatusWord(std::string_view payload, bool* ok) {
  *ok = payload.size() >= 4;
  if (!*ok) return 0;
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i)
    v |= static_cast<uint32_t>(static_cast<uint8_t>(payload[i])) << (8 * i);
  return v;
}

}  // namespace

Status CheckPeerUid(int fd, const char* who) {
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return PermissionDeniedError(std::string("cuda_ipc: cannot read the ") + who +
                                 "'s credentials");
  }
  const uid_t self = ::geteuid();
  if (cred.uid != self) {
    return PermissionDeniedError(std::string("cuda_ipc ") + who + " runs as uid " +
                                 std::to_string(cred.uid) + " (pid " + std::to_string(cred.pid) +
                                 "), this agent as uid " + std::to_string(self) +
                                 ": cuda_ipc peers must be processes of the same user");
  }
  return OkStatus();
}

std::string RefusalPayload(const Status& why) {
  std::string s;
  const auto code = static_cast<uint32_t>(why.code());
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((code >> (8 * i)) & 0xff));
  s += why.message();
  return s;
}

Status ServeChallenge(FrameIo& io, const HandshakeCrypto& crypto, uint64_t server_incarnation,
                      std::string_view client_name, int timeout_ms) {
  if (!crypto) return OkStatus();
  ASSIGN_OR_RETURN(std::string nonce, crypto.nonce());
  RETURN_IF_ERROR(io.send(kChallenge, nonce));
  ASSIGN_OR_RETURN(Frame answer, io.recv(timeout_ms));
  if (answer.type != kChallengeResp) {
    return UnauthenticatedError("cuda_ipc handshake: expected the challenge's answer");
  }
  Result<auth::ChallengeAnswer> a = auth::DecodeChallengeAnswer(answer.payload);
  if (!a.ok()) return UnauthenticatedError("cuda_ipc handshake: malformed challenge answer");
  if (a->proof.empty()) {
    return UnauthenticatedError(
        "this agent requires the cluster token (--cluster-token); the peer has none");
  }
  const std::string context = auth::HandshakeContext(kBackend, server_incarnation, client_name);
  if (!crypto.matches(context, nonce, a->proof)) {
    return UnauthenticatedError("wrong cluster token (the peer's --cluster-token differs)");
  }
  const std::string server_context = auth::ServerContext(kBackend, server_incarnation, client_name);
  return io.send(kServerProof, crypto.proof(server_context, a->client_nonce));
}

Result<Frame> AwaitHelloAck(FrameIo& io, const HandshakeCrypto& crypto, uint64_t server_incarnation,
                            std::string_view client_name, int timeout_ms) {
  bool proven = false;
  std::string my_nonce;
  for (int frames = 0; frames < 3; ++frames) {
    ASSIGN_OR_RETURN(Frame f, io.recv(timeout_ms));
    if (f.type == kHelloAck) {
      bool ok = false;
      const uint32_t status = StatusWord(f.payload, &ok);
      if (!ok) return UnavailableError("cuda_ipc handshake: short reply");
      if (status != 0) {
        return Status(static_cast<StatusCode>(status),
                      "cuda_ipc handshake refused: " + f.payload.substr(4));
      }
      if (crypto && !proven) {
        return UnauthenticatedError(
            "the serving agent did not prove the cluster token (cuda_ipc): it has none, or is "
            "not the agent its metadata names");
      }
      return f;
    }
    if (f.type == kChallenge && frames == 0) {
      if (!crypto) {
        RETURN_IF_ERROR(io.send(kChallengeResp, ""));  // the server then refuses us
        continue;
      }
      if (f.payload.size() != auth::kNonceBytes) {
        return UnavailableError("cuda_ipc handshake: malformed challenge");
      }
      ASSIGN_OR_RETURN(my_nonce, crypto.nonce());
      const std::string context = auth::HandshakeContext(kBackend, server_incarnation, client_name);
      RETURN_IF_ERROR(io.send(kChallengeResp, crypto.proof(context, f.payload) + my_nonce));
      continue;
    }
    if (f.type == kServerProof && frames == 1 && crypto && !my_nonce.empty()) {
      const std::string context = auth::ServerContext(kBackend, server_incarnation, client_name);
      if (!crypto.matches(context, my_nonce, f.payload)) {
        return UnauthenticatedError(
            "the serving agent's proof of the cluster token is wrong (cuda_ipc): it holds "
            "another token");
      }
      proven = true;
      continue;
    }
    return UnavailableError("cuda_ipc handshake: unexpected frame " + std::to_string(f.type));
  }
  return UnavailableError("cuda_ipc handshake: no HelloAck");
}

}  // namespace kvbridge::transfer::cuda_ipc_auth
