// libFuzzer target: the cluster-token handshake (src/transfer/auth.h) against a stranger's
// bytes, both roles, over a real socket pair. Input: byte 0 picks the role, the rest is what
// the peer sends (then it closes). Invariant: bytes from someone who does not know the token
// never pass the handshake (the nonces are fresh random bytes, so no input can hold a valid
// proof) — a pass traps. Build: scripts/fuzz.sh (-DKVBRIDGE_FUZZ=ON, clang).
#include <sys/socket.h>
#include <unistd.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "transfer/auth.h"
#include "transfer/socket_util.h"
#include "transfer/wire.h"

namespace {

using namespace kvbridge::transfer;

constexpr std::string_view kToken = "fuzz-cluster-token";

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t role = data[0] % 4;
  const std::string_view peer_bytes(reinterpret_cast<const char*>(data) + 1, size - 1);
  const auth::HandshakeIds ids{"tcp", 0x1234, "fuzz-client"};
  if (role == 3) {  // the pure codecs
    auto a = auth::DecodeChallengeAnswer(peer_bytes);
    if (a.ok() && !a->proof.empty()) {
      if (a->proof.size() != auth::kProofBytes || a->client_nonce.size() != auth::kNonceBytes)
        __builtin_trap();
      (void)auth::ProofMatches(kToken, "ctx", a->client_nonce, a->proof);
    }
    return 0;
  }
  int sv[2];
  if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return 0;
  net::Fd us(sv[0]), them(sv[1]);
  net::SetTimeouts(us.get(), 200, 200);
  // The peer's bytes are queued, then it half-closes: every read past them sees EOF.
  if (!peer_bytes.empty() && !net::SendAll(them.get(), peer_bytes.data(), peer_bytes.size()).ok())
    return 0;
  ::shutdown(them.get(), SHUT_WR);
  if (role == 0) {  // we serve: the input is a client's answer to our challenge
    if (auth::ServerChallenge(us.get(), kToken, ids).ok()) __builtin_trap();
    return 0;
  }
  // We connect (role 1 with the token, role 2 without): the input is the server's frames.
  const std::string_view token = role == 1 ? kToken : std::string_view();
  wire::FrameHeader h;
  std::string meta;
  if (!net::RecvFrameHead(us.get(), &h, &meta).ok()) return 0;
  bool answered = false;
  kvbridge::Status st = auth::ClientAnswer(us.get(), h, meta, token, ids, &answered);
  if (role == 1) {
    // With a token, passing means the server proved it: impossible for a stranger.
    if (st.ok() && answered) __builtin_trap();
    // A server that never challenged is refused once its ack accepts us.
    if (st.ok() && !answered && auth::RequireServerProof(token, answered, "tcp").ok())
      __builtin_trap();
  }
  return 0;
}
