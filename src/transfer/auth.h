// src/transfer/auth.h — the cluster-token challenge-response of the backend handshakes
// (internal; issue 22). Mutual: the client proves the token to the server, then the server to
// the client.
//
// Stream backends (shm, tcp), after the client's Hello, when the server has a cluster token:
//   server -> kChallenge      meta = server nonce (32 random bytes)
//   client -> kChallengeResp  meta = HMAC-SHA256(token, ClientContext || server nonce)
//                                    || client nonce (32 random bytes); empty when it has no token
//   server checks the proof in constant time; refused -> HelloAck(Unauthenticated), nothing else
//   server -> kServerProof    meta = HMAC-SHA256(token, ServerContext || client nonce)
//   server -> HelloAck        (the shm memfds, the tcp acceptance)
// A client with a token accepts a HelloAck only after a valid kServerProof: a serving side
// that sends no challenge (no token) or a wrong proof is refused before anything it sent is
// used (shm: its fds are closed unmapped). The token never crosses the socket. The contexts
// ("kvbridge-<backend>-v1|<server incarnation hex>|<client agent name>" and the same with
// "-v1-server|") bind each proof to one direction, one server incarnation and one client, so a
// proof cannot be replayed to another server or reflected back. A server without a token sends
// no challenge (the behaviour before issue 22), and a client without one accepts that.
//
// ucx carries the same proofs in active messages (ucx_backend.cc), cuda_ipc in its own frames
// (cuda_ipc/ipc_handshake.h); the pure functions below are shared. The contexts and the answer
// codec are inline: cuda_ipc's CUDA-only build links no OpenSSL and gets the HMAC through
// BackendContext::crypto.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "kvbridge/common/status.h"
#include "transfer/wire.h"

namespace kvbridge::transfer::auth {

constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;

/// `kNonceBytes` bytes from OpenSSL's CSPRNG; Internal when it fails.
Result<std::string> RandomNonce();

inline std::string Context(std::string_view backend, std::string_view role,
                           uint64_t server_incarnation, std::string_view client_name) {
  char inc[17];
  std::snprintf(inc, sizeof(inc), "%016llx", static_cast<unsigned long long>(server_incarnation));
  std::string c = "kvbridge-";
  c += backend;
  c += "-v1";
  c += role;
  c += "|";
  c += inc;
  c += "|";
  c += client_name;
  return c;
}
/// The context the client's proof covers (see the header comment).
inline std::string HandshakeContext(std::string_view backend, uint64_t server_incarnation,
                                    std::string_view client_name) {
  return Context(backend, "", server_incarnation, client_name);
}
/// The context the server's proof covers (distinct from the client's: no reflection).
inline std::string ServerContext(std::string_view backend, uint64_t server_incarnation,
                                 std::string_view client_name) {
  return Context(backend, "-server", server_incarnation, client_name);
}
/// HMAC-SHA256(token, context || nonce), raw 32 bytes.
std::string Proof(std::string_view token, std::string_view context, std::string_view nonce);
/// Constant-time check of a `proof` (false unless exactly kProofBytes and equal).
bool ProofMatches(std::string_view token, std::string_view context, std::string_view nonce,
                  std::string_view proof);

/// The pieces of a kChallengeResp meta: proof || client nonce (both kProofBytes / kNonceBytes),
/// or empty (no token). InvalidArgument for any other length.
struct ChallengeAnswer {
  std::string proof;         ///< "" when the client has no token.
  std::string client_nonce;  ///< "" when the client has no token.
};
inline Result<ChallengeAnswer> DecodeChallengeAnswer(std::string_view meta) {
  if (meta.empty()) return ChallengeAnswer{};
  if (meta.size() != kProofBytes + kNonceBytes) {
    return InvalidArgumentError("handshake: malformed answer to the cluster-token challenge");
  }
  return ChallengeAnswer{std::string(meta.substr(0, kProofBytes)),
                         std::string(meta.substr(kProofBytes))};
}

/// The identity of one handshake: which backend, the server's incarnation, the client's name.
struct HandshakeIds {
  std::string_view backend;
  uint64_t server_incarnation = 0;
  std::string_view client_name;
};

/// Server side, after a valid Hello: when `token` is empty, OK at once (no frames). Else sends the
/// challenge, reads the answer, checks it and sends its own proof; returns OK, Unauthenticated
/// (no proof / wrong proof / malformed answer, with a message for the peer; nothing of ours was
/// sent but the nonce) or Unavailable (socket).
Status ServerChallenge(int fd, std::string_view token, const HandshakeIds& ids);

/// Client side: `h`/`meta` is the frame read after sending Hello. When it is a kChallenge,
/// answers it (the proof and a fresh nonce, or an empty answer when `token` is empty) and sets
/// *answered; with a token it then reads the server's kServerProof and checks it
/// (Unauthenticated when wrong or missing; a HelloAck refusal read in its place is returned as
/// "<backend> handshake refused: <reason>"). The caller then reads the HelloAck. Anything else
/// than a challenge: nothing sent, *answered false (then RequireServerProof decides).
Status ClientAnswer(int fd, const wire::FrameHeader& h, std::string_view meta,
                    std::string_view token, const HandshakeIds& ids, bool* answered);

/// Client side, on an accepting HelloAck: a client with a token refuses a server that never
/// challenged it (it did not prove the token) with Unauthenticated; OK otherwise.
Status RequireServerProof(std::string_view token, bool answered, std::string_view backend);

}  // namespace kvbridge::transfer::auth
