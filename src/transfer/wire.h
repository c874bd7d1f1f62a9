// src/transfer/wire.h — byte codecs shared by the backends and the agent (internal).
//
// Frame on a stream socket (tcp data connections, shm control socket), little-endian:
//   FrameHeader (32 bytes) | meta (meta_len bytes) | payload (payload_len bytes)
// Every decoder here takes untrusted bytes and returns InvalidArgument on anything malformed.
#pragma once

#include <sys/uio.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/status.h"
#include "kvbridge/transfer/backend.h"

namespace kvbridge::transfer::wire {

constexpr uint32_t kFrameMagic = 0x4642564b;  // "KVBF"
constexpr uint8_t kFrameVersion = 1;
constexpr uint32_t kMaxMetaBytes = 64u << 20;
constexpr size_t kFrameHeaderBytes = 32;
constexpr size_t kMaxNameBytes = 4096;
constexpr uint32_t kMaxSegmentsPerRequest = 1u << 20;

enum class FrameType : uint8_t {
  kHello = 1,
  kHelloAck = 2,
  kReadReq = 3,
  kReadResp = 4,
  kWriteReq = 5,
  kWriteAck = 6,
  kMsg = 7,
  kChallenge = 8,      ///< Handshake: server's nonce (auth.h).
  kChallengeResp = 9,  ///< Handshake: client's HMAC proof + client nonce (auth.h).
  kServerProof = 10,   ///< Handshake: server's HMAC proof over the client nonce (auth.h).
};

struct FrameHeader {
  FrameType type = FrameType::kMsg;
  uint16_t status = 0;  ///< StatusCode of a response.
  uint64_t request_id = 0;
  uint32_t meta_len = 0;
  uint64_t payload_len = 0;
};

void EncodeFrameHeader(const FrameHeader& h, uint8_t out[kFrameHeaderBytes]);
Result<FrameHeader> DecodeFrameHeader(const uint8_t* data, size_t size);

/// Appends little-endian values and length-prefixed strings.
class Writer {
 public:
  void U8(uint8_t v) { buf_.push_back(static_cast<char>(v)); }
  void U16(uint16_t v) { Raw(&v, 2); }
  void U32(uint32_t v) { Raw(&v, 4); }
  void U64(uint64_t v) { Raw(&v, 8); }
  void Str(std::string_view s) {
    U32(static_cast<uint32_t>(s.size()));
    buf_.append(s.data(), s.size());
  }
  void Raw(const void* p, size_t n) { buf_.append(static_cast<const char*>(p), n); }
  std::string& buf() { return buf_; }
  std::string Take() { return std::move(buf_); }

 private:
  std::string buf_;
};

/// Bounds-checked reader over untrusted bytes; every getter returns false when short.
class Reader {
 public:
  Reader(const void* p, size_t n) : p_(static_cast<const uint8_t*>(p)), n_(n) {}
  explicit Reader(std::string_view s) : Reader(s.data(), s.size()) {}
  bool U8(uint8_t& v) { return Raw(&v, 1); }
  bool U16(uint16_t& v) { return Raw(&v, 2); }
  bool U32(uint32_t& v) { return Raw(&v, 4); }
  bool U64(uint64_t& v) { return Raw(&v, 8); }
  bool Str(std::string& s, size_t max_len) {
    uint32_t n;
    if (!U32(n) || n > max_len || n > n_ - pos_) return false;
    s.assign(reinterpret_cast<const char*>(p_ + pos_), n);
    pos_ += n;
    return true;
  }
  bool Raw(void* out, size_t n) {
    if (n > n_ - pos_) return false;
    std::memcpy(out, p_ + pos_, n);
    pos_ += n;
    return true;
  }
  size_t remaining() const { return n_ - pos_; }
  bool done() const { return pos_ == n_; }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
};

/// Handshake sent by the connecting side.
struct Hello {
  std::string agent_name;
  uint64_t incarnation = 0;         ///< Sender's.
  uint64_t expect_incarnation = 0;  ///< Target's, from its metadata (stale metadata refused).
  uint32_t connection_index = 0;
};
std::string EncodeHello(const Hello& h);
Result<Hello> DecodeHello(std::string_view meta);

/// A READ or WRITE request: transfer_id and remote segments (layer, offset, length).
struct RemoteSegment {
  uint32_t layer = 0;
  uint64_t offset = 0;
  uint64_t length = 0;
};
struct DataRequest {
  std::string transfer_id;
  std::vector<RemoteSegment> segments;
  uint64_t total_bytes = 0;  ///< Sum of lengths (checked for overflow).
};
void EncodeDataRequest(std::string_view transfer_id, const Segment* segs, size_t n, Writer& w);
Result<DataRequest> DecodeDataRequest(std::string_view meta);

/// Checks segments against a registration: layer exists, [offset, offset+length) inside the
/// layer's LayerBytes(). Fills the sorted distinct block ids touched. InvalidArgument if not.
Status ValidateSegments(const DataRequest& req, const KvRegistration& reg,
                        std::vector<int>* blocks);

/// Agent-level messages (payload of kMsg frames / shm control / ucx active messages).
enum class MessageKind : uint8_t { kNotify = 1, kReply = 2 };
struct AgentMessage {
  MessageKind kind = MessageKind::kNotify;
  uint64_t id = 0;
  bool wants_reply = false;
  std::string transfer_id;
  std::string payload;
};
constexpr size_t kMaxMessagePayload = 16u << 20;
std::string EncodeAgentMessage(const AgentMessage& m);
Result<AgentMessage> DecodeAgentMessage(std::string_view bytes);

}  // namespace kvbridge::transfer::wire
