#include "transfer/wire.h"

#include <algorithm>
#include <limits>

namespace kvbridge::transfer::wire {

void EncodeFrameHeader(const FrameHeader& h, uint8_t out[kFrameHeaderBytes]) {
  std::memset(out, 0, kFrameHeaderBytes);
  uint32_t magic = kFrameMagic;
  std::memcpy(out, &magic, 4);
  out[4] = kFrameVersion;
  out[5] = static_cast<uint8_t>(h.type);
  std::memcpy(out + 6, &h.status, 2);
  std::memcpy(out + 8, &h.request_id, 8);
  std::memcpy(out + 16, &h.meta_len, 4);
  std::memcpy(out + 24, &h.payload_len, 8);
}

Result<FrameHeader> DecodeFrameHeader(const uint8_t* data, size_t size) {
  if (size < kFrameHeaderBytes) return InvalidArgumentError("frame header truncated");
  uint32_t magic;
  std::memcpy(&magic, data, 4);
  if (magic != kFrameMagic) return InvalidArgumentError("bad frame magic");
  if (data[4] != kFrameVersion) {
    return InvalidArgumentError("unsupported frame version " + std::to_string(data[4]));
  }
  FrameHeader h;
  uint8_t type = data[5];
  if (type < static_cast<uint8_t>(FrameType::kHello) ||
      type > static_cast<uint8_t>(FrameType::kServerProof)) {
    return InvalidArgumentError("unknown frame type " + std::to_string(type));
  }
  h.type = static_cast<FrameType>(type);
  std::memcpy(&h.status, data + 6, 2);
  if (h.status > static_cast<uint16_t>(StatusCode::kUnauthenticated)) {
    return InvalidArgumentError("bad status code in frame");
  }
  std::memcpy(&h.request_id, data + 8, 8);
  std::memcpy(&h.meta_len, data + 16, 4);
  std::memcpy(&h.payload_len, data + 24, 8);
  if (h.meta_len > kMaxMetaBytes) return InvalidArgumentError("frame meta too large");
  if (h.payload_len > (uint64_t{1} << 48)) return InvalidArgumentError("frame payload too large");
  return h;
}

std::string EncodeHello(const Hello& h) {
  Writer w;
  w.Str(h.agent_name);
  w.U64(h.incarnation);
  w.U64(h.expect_incarnation);
  w.U32(h.connection_index);
  return w.Take();
}

Result<Hello> DecodeHello(std::string_view meta) {
  Reader r(meta);
  Hello h;
  if (!r.Str(h.agent_name, kMaxNameBytes) || !r.U64(h.incarnation) ||
      !r.U64(h.expect_incarnation) || !r.U32(h.connection_index) || !r.done()) {
    return InvalidArgumentError("malformed hello");
  }
  if (h.agent_name.empty()) return InvalidArgumentError("hello without agent name");
  return h;
}

void EncodeDataRequest(std::string_view transfer_id, const Segment* segs, size_t n, Writer& w) {
  w.buf().reserve(w.buf().size() + 8 + transfer_id.size() + n * 20);
  w.Str(transfer_id);
  w.U32(static_cast<uint32_t>(n));
  for (size_t i = 0; i < n; ++i) {
    w.U32(segs[i].remote_layer);
    w.U64(segs[i].remote_offset);
    w.U64(segs[i].length);
  }
}

Result<DataRequest> DecodeDataRequest(std::string_view meta) {
  Reader r(meta);
  DataRequest req;
  uint32_t n;
  if (!r.Str(req.transfer_id, kMaxNameBytes) || !r.U32(n)) {
    return InvalidArgumentError("malformed data request header");
  }
  if (n > kMaxSegmentsPerRequest || static_cast<uint64_t>(n) * 20 != r.remaining()) {
    return InvalidArgumentError("data request segment count does not match its size");
  }
  req.segments.resize(n);
  for (uint32_t i = 0; i < n; ++i) {
    RemoteSegment& s = req.segments[i];
    r.U32(s.layer);
    r.U64(s.offset);
    r.U64(s.length);
    if (s.length == 0) return InvalidArgumentError("empty segment in data request");
    if (s.length > std::numeric_limits<uint64_t>::max() - req.total_bytes) {
      return InvalidArgumentError("data request length overflows");
    }
    req.total_bytes += s.length;
  }
  return req;
}

Status ValidateSegments(const DataRequest& req, const KvRegistration& reg,
                        std::vector<int>* blocks) {
  const uint64_t layer_bytes = reg.layout.LayerBytes();
  const uint64_t block_bytes = reg.layout.BlockBytes();
  if (blocks) blocks->clear();
  for (const RemoteSegment& s : req.segments) {
    if (s.layer >= reg.layers.size()) {
      return InvalidArgumentError("segment layer " + std::to_string(s.layer) + " out of range (" +
                                  std::to_string(reg.layers.size()) + " layers)");
    }
    if (s.offset > layer_bytes || s.length > layer_bytes - s.offset) {
      return InvalidArgumentError("segment [" + std::to_string(s.offset) + ", +" +
                                  std::to_string(s.length) + ") outside the layer's " +
                                  std::to_string(layer_bytes) + " registered bytes");
    }
    if (blocks && block_bytes > 0) {
      int first = static_cast<int>(s.offset / block_bytes);
      int last = static_cast<int>((s.offset + s.length - 1) / block_bytes);
      for (int b = first; b <= last; ++b) blocks->push_back(b);
    }
  }
  if (blocks) {
    std::sort(blocks->begin(), blocks->end());
    blocks->erase(std::unique(blocks->begin(), blocks->end()), blocks->end());
  }
  return OkStatus();
}

std::string EncodeAgentMessage(const AgentMessage& m) {
  Writer w;
  w.U8(static_cast<uint8_t>(m.kind));
  w.U64(m.id);
  w.U8(m.wants_reply ? 1 : 0);
  w.Str(m.transfer_id);
  w.Str(m.payload);
  return w.Take();
}

Result<AgentMessage> DecodeAgentMessage(std::string_view bytes) {
  Reader r(bytes);
  AgentMessage m;
  uint8_t kind, wants;
  if (!r.U8(kind) || !r.U64(m.id) || !r.U8(wants) || !r.Str(m.transfer_id, kMaxNameBytes) ||
      !r.Str(m.payload, kMaxMessagePayload) || !r.done()) {
    return InvalidArgumentError("malformed agent message");
  }
  if (kind != static_cast<uint8_t>(MessageKind::kNotify) &&
      kind != static_cast<uint8_t>(MessageKind::kReply)) {
    return InvalidArgumentError("unknown agent message kind " + std::to_string(kind));
  }
  if (wants > 1) return InvalidArgumentError("bad wants_reply flag");
  m.kind = static_cast<MessageKind>(kind);
  m.wants_reply = wants == 1;
  return m;
}

}  // namespace kvbridge::transfer::wire
