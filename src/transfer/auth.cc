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

Status ServerChallenge(int fd, std::string_view token, const HandshakeIds& ids) {
  if (token.empty()) return OkStatus();
  ASSIGN_OR_RETURN(std::string nonce, RandomNonce());
  wire::FrameHeader c;
  c.type = wire::FrameType::kChallenge;
  RETURN_IF_ERROR(net::SendFrame(fd, c, nonce));
  wire::FrameHeader h;
  std::string meta;
  RETURN_IF_ERROR(net::RecvFrameHead(fd, &h, &meta));
  if (h.type != wire::FrameType::kChallengeResp || h.payload_len != 0) {
    return UnauthenticatedError("handshake: expected the answer to the cluster-token challenge");
  }
  Result<ChallengeAnswer> answer = DecodeChallengeAnswer(meta);
  if (!answer.ok()) return UnauthenticatedError(answer.status().message());
  if (answer->proof.empty()) {
    return UnauthenticatedError(
        "this agent requires the cluster token (--cluster-token); the peer has none");
  }
  if (!ProofMatches(token, HandshakeContext(ids.backend, ids.server_incarnation, ids.client_name),
                    nonce, answer->proof)) {
    return UnauthenticatedError("wrong cluster token (the peer's --cluster-token differs)");
  }
  // Only a proven client gets our proof: we are no HMAC oracle for strangers.
  wire::FrameHeader p;
  p.type = wire::FrameType::kServerProof;
  return net::SendFrame(
      fd, p,
      Proof(token, ServerContext(ids.backend, ids.server_incarnation, ids.client_name),
            answer->client_nonce));
}

Status ClientAnswer(int fd, const wire::FrameHeader& h, std::string_view meta,
                    std::string_view token, const HandshakeIds& ids, bool* answered) {
  *answered = false;
  if (h.type != wire::FrameType::kChallenge) return OkStatus();
  if (meta.size() != kNonceBytes || h.payload_len != 0) {
    return UnavailableError("handshake: malformed cluster-token challenge");
  }
  std::string answer, client_nonce;
  if (!token.empty()) {
    ASSIGN_OR_RETURN(client_nonce, RandomNonce());
    answer =
        Proof(token, HandshakeContext(ids.backend, ids.server_incarnation, ids.client_name), meta);
    answer += client_nonce;
  }
  wire::FrameHeader r;
  r.type = wire::FrameType::kChallengeResp;
  RETURN_IF_ERROR(net::SendFrame(fd, r, answer));
  *answered = true;
  if (token.empty()) return OkStatus();
  wire::FrameHeader s;
  std::string proof;
  RETURN_IF_ERROR(net::RecvFrameHead(fd, &s, &proof));
  const std::string who(ids.backend);
  if (s.type == wire::FrameType::kHelloAck && s.status != 0) {  // it refused our proof
    wire::Reader rd(proof);
    std::string msg;
    rd.Str(msg, 4096);
    return Status(static_cast<StatusCode>(s.status), who + " handshake refused: " + msg);
  }
  if (s.type != wire::FrameType::kServerProof || s.payload_len != 0 ||
      !ProofMatches(token, ServerContext(ids.backend, ids.server_incarnation, ids.client_name),
                    client_nonce, proof)) {
    return UnauthenticatedError(
        who +
        " handshake: the serving agent's proof of the cluster token is wrong (it is not "
        "the agent its metadata names, or its --cluster-token differs); refused");
  }
  return OkStatus();
}

Status RequireServerProof(std::string_view token, bool answered, std::string_view backend) {
  if (token.empty() || answered) return OkStatus();
  return UnauthenticatedError(
      std::string(backend) +
      " handshake: the serving agent did not prove the cluster token (it has no "
      "--cluster-token, or is not the agent its metadata names); refused");
}

}  // namespace kvbridge::transfer::auth
