// src/transfer/auth.h — the cluster-token challenge-response of the backend handshakes
// (internal; issue 22).
//
// After the client's Hello, a server configured with a cluster token sends a kChallenge frame
// (meta = 32 random bytes); the client answers kChallengeResp (meta = HMAC-SHA256(token,
// context || nonce), 32 bytes; empty when it has no token); the server compares in constant
// time and only then sends its HelloAck (the shm memfds, the tcp acceptance). The token never
// crosses the socket. `context` binds the proof to one handshake direction and server
// ("kvbridge-<backend>-v1|<server incarnation hex>|<client agent name>"), so a proof cannot be
// replayed to another server or reflected. A server without a token sends no challenge (the
// behaviour before issue 22). The client is not asked to check the server (one-way proof).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "kvbridge/common/status.h"
#include "transfer/wire.h"

namespace kvbridge::transfer::auth {

constexpr size_t kNonceBytes = 32;
constexpr size_t kProofBytes = 32;

/// `kNonceBytes` bytes from OpenSSL's CSPRNG; Internal when it fails.
Result<std::string> RandomNonce();
/// The context string of one handshake (see the header comment).
std::string HandshakeContext(std::string_view backend, uint64_t server_incarnation,
                             std::string_view client_name);
/// HMAC-SHA256(token, context || nonce), raw 32 bytes.
std::string Proof(std::string_view token, std::string_view context, std::string_view nonce);
/// Constant-time check of a client's `proof`.
bool ProofMatches(std::string_view token, std::string_view context, std::string_view nonce,
                  std::string_view proof);

/// Server side, after a valid Hello: when `token` is empty, OK at once (no frames). Else sends the
/// challenge, reads the answer and returns OK, Unauthenticated (no proof / wrong proof, with a
/// message for the peer) or Unavailable (socket).
Status ServerChallenge(int fd, std::string_view token, std::string_view context);

/// Client side: `h` is the frame read after sending Hello. When it is a kChallenge, answers it
/// (the proof, or an empty answer when `token` is empty) and sets *answered; the caller then
/// reads the next frame (the HelloAck). Anything else: nothing sent, *answered false.
Status ClientAnswer(int fd, const wire::FrameHeader& h, std::string_view meta,
                    std::string_view token, std::string_view context, bool* answered);

}  // namespace kvbridge::transfer::auth
