#include "transfer/auth.h"

#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>
#include <openssl/rand.h>

#include <cstdio>

#include "transfer/socket_util.h"

namespace kvbridge::transfer::auth {

Result<std::string> RandomNonce() {
  std::string n(kNonceBytes, '\0');
  if (RAND_bytes(reinterpret_cast<unsigned char*>(n.data()), static_cast<int>(n.size())) != 1) {
    return InternalError("handshake: RAND_bytes failed");
  }
  return n;
}

std::string HandshakeContext(std::string_view backend, uint64_t server_incarnation,
                             std::string_view client_name) {
  char inc[17];
  std::snprintf(inc, sizeof(inc), "%016llx", static_cast<unsigned long long>(server_incarnation));
  std::string c = "kvbridge-";
  c += backend;
  c += "-v1|";
  c += inc;
  c += "|";
  c += client_name;
  return c;
}

std::string Proof(std::string_view token, std::string_view context, std::string_view nonce) {
  std::string data(context);
  data += nonce;
  unsigned char out[EVP_MAX_MD_SIZE];
  unsigned int len = 0;
  HMAC(EVP_sha256(), token.data(), static_cast<int>(token.size()),
       reinterpret_cast<const unsigned char*>(data.data()), data.size(), out, &len);
  return std::string(reinterpret_cast<char*>(out), len);
}

bool ProofMatches(std::string_view token, std::string_view context, std::string_view nonce,
                  std::string_view proof) {
  if (proof.size() != kProofBytes) return false;
  const std::string want = Proof(token, context, nonce);
  return want.size() == kProofBytes && CRYPTO_memcmp(want.data(), proof.data(), kProofBytes) == 0;
}

Status ServerChallenge(int fd, std::string_view token, std::string_view context) {
  if (token.empty()) return OkStatus();
  ASSIGN_OR_RETURN(std::string nonce, RandomNonce());
  wire::FrameHeader c;
  c.type = wire::FrameType::kChallenge;
  RETURN_IF_ERROR(net::SendFrame(fd, c, nonce));
  wire::FrameHeader h;
  std::string proof;
  RETURN_IF_ERROR(net::RecvFrameHead(fd, &h, &proof));
  if (h.type != wire::FrameType::kChallengeResp || h.payload_len != 0) {
    return UnauthenticatedError("handshake: expected the answer to the cluster-token challenge");
  }
  if (proof.empty()) {
    return UnauthenticatedError(
        "this agent requires the cluster token (--cluster-token); the peer has none");
  }
  if (!ProofMatches(token, context, nonce, proof)) {
    return UnauthenticatedError("wrong cluster token (the peer's --cluster-token differs)");
  }
  return OkStatus();
}

Status ClientAnswer(int fd, const wire::FrameHeader& h, std::string_view meta,
                    std::string_view token, std::string_view context, bool* answered) {
  *answered = false;
  if (h.type != wire::FrameType::kChallenge) return OkStatus();
  if (meta.size() != kNonceBytes || h.payload_len != 0) {
    return UnavailableError("handshake: malformed cluster-token challenge");
  }
  wire::FrameHeader r;
  r.type = wire::FrameType::kChallengeResp;
  RETURN_IF_ERROR(
      net::SendFrame(fd, r, token.empty() ? std::string() : Proof(token, context, meta)));
  *answered = true;
  return OkStatus();
}

}  // namespace kvbridge::transfer::auth
