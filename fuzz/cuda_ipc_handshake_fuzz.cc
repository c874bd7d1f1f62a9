// libFuzzer target: cuda_ipc's cluster-token handshake (src/transfer/backends/cuda_ipc/
// ipc_handshake.h, no CUDA) against a stranger's frames, both roles. Input: byte 0 picks the
// role, the rest is the frames the stranger sends, each as: a type byte t (frame type 100 + t % 8,
// or t == 0xff: a raw little-endian u32 follows), a little-endian u16 length, the payload
// (truncated at the input's end); when they run out the stranger is gone (Unavailable).
// Invariant: bytes from someone who does not know the token never pass — the nonces are fresh
// random bytes, so no input can hold a valid proof: a server that accepts, a server that sends its
// own proof, or a client with a token that returns a table all trap. Without a token a client may
// take a table (the old handshake), but only from an accepting kHelloAck. Build: scripts/fuzz.sh.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "transfer/auth.h"
#include "transfer/backends/cuda_ipc/ipc_handshake.h"

namespace {

using namespace kvbridge;
using namespace kvbridge::transfer;

constexpr std::string_view kToken = "fuzz-cluster-token";
constexpr uint64_t kServerInc = 0x1234;
constexpr std::string_view kClient = "fuzz-client";

std::vector<cuda_ipc_auth::Frame> ParseFrames(std::string_view in) {
  std::vector<cuda_ipc_auth::Frame> frames;
  size_t at = 0;
  while (at < in.size() && frames.size() < 16) {
    const auto t = static_cast<uint8_t>(in[at++]);
    uint32_t type = 100 + t % 8;
    if (t == 0xff) {
      if (in.size() - at < 4) break;
      type = 0;
      for (int i = 0; i < 4; ++i)
        type |= static_cast<uint32_t>(static_cast<uint8_t>(in[at++])) << (8 * i);
    }
    if (in.size() - at < 2) break;
    size_t len =
        static_cast<uint8_t>(in[at]) | (static_cast<size_t>(static_cast<uint8_t>(in[at + 1])) << 8);
    at += 2;
    if (len > in.size() - at) len = in.size() - at;
    frames.push_back({type, std::string(in.substr(at, len))});
    at += len;
  }
  return frames;
}

HandshakeCrypto Crypto() {
  HandshakeCrypto c;
  c.nonce = [] { return auth::RandomNonce(); };
  c.proof = [](std::string_view ctx, std::string_view n) { return auth::Proof(kToken, ctx, n); };
  c.matches = [](std::string_view ctx, std::string_view n, std::string_view p) {
    return auth::ProofMatches(kToken, ctx, n, p);
  };
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t role = data[0] % 3;
  const std::vector<cuda_ipc_auth::Frame> in =
      ParseFrames(std::string_view(reinterpret_cast<const char*>(data) + 1, size - 1));
  size_t next = 0;
  std::vector<cuda_ipc_auth::Frame> sent;
  cuda_ipc_auth::FrameIo io;
  io.send = [&sent](uint32_t type, std::string_view payload) {
    sent.push_back({type, std::string(payload)});
    return OkStatus();
  };
  io.recv = [&](int) -> Result<cuda_ipc_auth::Frame> {
    if (next == in.size()) return UnavailableError("the stranger is gone");
    return in[next++];
  };
  if (role == 0) {  // we serve with a token: the input is a client's answer to our challenge
    if (cuda_ipc_auth::ServeChallenge(io, Crypto(), kServerInc, kClient, 100).ok())
      __builtin_trap();
    for (const auto& f : sent) {
      if (f.type != cuda_ipc_auth::kChallenge) __builtin_trap();  // e.g. our proof to a stranger
    }
    return 0;
  }
  // We connect (role 1 with the token, role 2 without): the input is the server's frames.
  const HandshakeCrypto crypto = role == 1 ? Crypto() : HandshakeCrypto();
  Result<cuda_ipc_auth::Frame> ack =
      cuda_ipc_auth::AwaitHelloAck(io, crypto, kServerInc, kClient, 100);
  if (sent.size() > 1) __builtin_trap();  // at most the one answer to one challenge
  if (!ack.ok()) return 0;
  if (role == 1) __builtin_trap();  // a stranger proved the token
  if (ack->type != cuda_ipc_auth::kHelloAck || ack->payload.size() < 4 ||
      ack->payload.compare(0, 4, std::string(4, '\0')) != 0)
    __builtin_trap();  // only an accepting HelloAck is a table
  return 0;
}
