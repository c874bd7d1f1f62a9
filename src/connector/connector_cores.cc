#include "kvbridge/connector/connector_cores.h"

#include <algorithm>
#include <iterator>
#include <utility>

namespace kvbridge {

ConnectorCores::ConnectorCores(const KvTransferConfig& config, const Shape& shape)
    : prefill({.engine_id = shape.engine_id,
               .tp_size = shape.tp_size,
               .num_kv_heads = shape.num_kv_heads,
               .lease = config.lease,
               .claim_lease = config.EffectiveClaimLease(),
               .max_parked_messages = config.max_parked_messages}),
      decode({.engine_id = shape.engine_id,
              .tp_size = shape.tp_size,
              .num_kv_heads = shape.num_kv_heads,
              .block_size = shape.block_size,
              .reply_timeout = config.reply_timeout,
              .read_timeout = config.read_timeout,
              .heartbeat_interval = config.EffectiveHeartbeat(),
              .load_failure_policy = config.load_failure_policy}),
      wprefill({.engine_id = shape.engine_id,
                .tp_size = shape.tp_size,
                .num_kv_heads = shape.num_kv_heads,
                .block_size = shape.block_size,
                .num_layers = shape.num_layers,
                .lease = config.lease,
                .max_parked_messages = config.max_parked_messages}),
      wdecode({.engine_id = shape.engine_id,
               .tp_size = shape.tp_size,
               .num_kv_heads = shape.num_kv_heads,
               .block_size = shape.block_size,
               .write_timeout = WriteTimeout(config),
               .load_failure_policy = config.load_failure_policy}) {}

DurationUs ConnectorCores::WriteTimeout(const KvTransferConfig& config) {
  return config.lease + std::max<DurationUs>(2 * kSecond, config.lease / 4);
}

std::vector<ConnectorAction> ConnectorCores::TakeActions() {
  std::vector<ConnectorAction> acts = prefill.TakeActions();
  auto append = [&acts](std::vector<ConnectorAction> more) {
    acts.insert(acts.end(), std::make_move_iterator(more.begin()),
                std::make_move_iterator(more.end()));
  };
  append(decode.TakeActions());
  append(wprefill.TakeActions());
  append(wdecode.TakeActions());
  return acts;
}

void ConnectorCores::OnTick(TimePoint now) {
  prefill.OnTick(now);
  decode.OnTick(now);
  wprefill.OnTick(now);
  wdecode.OnTick(now);
}

bool ConnectorCores::OnRequestAborted(const std::string& request_id, TimePoint now) {
  bool keep = prefill.OnRequestAborted(request_id, now);
  keep = decode.OnRequestAborted(request_id, now) || keep;
  keep = wprefill.OnRequestAborted(request_id, now) || keep;
  keep = wdecode.OnRequestAborted(request_id, now) || keep;
  return keep;
}

int64_t ConnectorCores::OnPeerLost(const std::string& engine_id, PeerLoss loss, TimePoint now) {
  int64_t n = prefill.OnPeerLost(engine_id, now);
  n += decode.OnPeerLost(engine_id, now);
  n += wprefill.OnPeerLost(engine_id, now);
  n += wdecode.OnPeerLost(engine_id, loss, now);
  return n;
}

std::pair<int64_t, int64_t> ConnectorCores::BoundTo(const std::string& engine_id) const {
  auto [holds, held_blocks] = prefill.BoundTo(engine_id);
  auto [writes, write_blocks] = wdecode.BoundTo(engine_id);
  return {holds + writes, held_blocks + write_blocks};
}

std::optional<TimePoint> ConnectorCores::NextDeadline() const {
  std::optional<TimePoint> best;
  for (auto d : {prefill.NextDeadline(), decode.NextDeadline(), wprefill.NextDeadline(),
                 wdecode.NextDeadline()}) {
    if (d && (!best || *d < *best)) best = d;
  }
  return best;
}

bool ConnectorCores::Idle() const {
  return prefill.Idle() && decode.Idle() && wprefill.Idle() && wdecode.Idle();
}

}  // namespace kvbridge
