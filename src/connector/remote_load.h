// src/connector/remote_load.h — what the decode side of both modes (DecodeCore for READ,
// WriteDecodeCore for WRITE) computes alike for a remote load: which prompt tokens arrive
// remotely, which blocks of the engine's block table they fill, and the checks before a request
// is taken. Internal to kvbridge_connector_core.
//
//   RETURN_IF_ERROR(CheckNewRemoteLoad(requests_, by_transfer_, id, key, local_hit, 16));
//   const int external = ExternalPromptTokens(40, 0);           // 39: the last token is local
//   const BlockSpan s = ExternalBlockSpan(16, 0, external);     // blocks [0, 3)
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <utility>

#include "kvbridge/common/status.h"

namespace kvbridge {

/// Prompt tokens loaded remotely: all but the last (it is always computed here, its logits give
/// the first decode token) and the `num_local_computed_tokens` of the local prefix hit; >= 0.
inline int ExternalPromptTokens(int num_prompt_tokens, int num_local_computed_tokens) {
  return std::max(0, num_prompt_tokens - 1 - num_local_computed_tokens);
}

/// The blocks [first, end) of the request's block table (and of the prefill's, same indices) that
/// a remote load fills.
struct BlockSpan {
  int first = 0;
  int end = 0;
};

/// The span for `num_external_tokens` loaded after `num_local_computed_tokens` local ones
/// (a multiple of `block_size` > 0): from the first block past the local hit to the block of the
/// last loaded token.
inline BlockSpan ExternalBlockSpan(int block_size, int num_local_computed_tokens,
                                   int num_external_tokens) {
  return {num_local_computed_tokens / block_size,
          (num_local_computed_tokens + num_external_tokens + block_size - 1) / block_size};
}

/// True when the engine's allocation can take the load: some tokens to load, a non-negative local
/// hit, and a block table of `num_blocks` reaching `span.end`.
inline bool AllocationCoversLoad(const BlockSpan& span, int num_local_computed_tokens,
                                 int num_external_tokens, size_t num_blocks) {
  return num_external_tokens > 0 && num_local_computed_tokens >= 0 &&
         static_cast<int64_t>(num_blocks) >= span.end;
}

/// The error for a block table of `num_blocks` that does not cover the load.
inline Status UncoveredLoadError(size_t num_blocks) {
  return InternalError("block table of " + std::to_string(num_blocks) +
                       " blocks does not cover the remote load");
}

/// The checks before a decode core takes `request_id` loading transfer `key` (remote engine id,
/// transfer id): InvalidArgument when the local prefix hit is negative or not a multiple of
/// `block_size`; AlreadyExists when the request or the transfer is already loading.
template <typename Request>
Status CheckNewRemoteLoad(
    const std::map<std::string, Request>& requests,
    const std::map<std::pair<std::string, std::string>, std::string>& by_transfer,
    const std::string& request_id, const std::pair<std::string, std::string>& key,
    int num_local_computed_tokens, int block_size) {
  if (num_local_computed_tokens < 0 || num_local_computed_tokens % block_size != 0) {
    return InvalidArgumentError("local prefix hit must be a non-negative multiple of block_size");
  }
  if (requests.count(request_id))
    return AlreadyExistsError("request " + request_id + " is loading");
  if (by_transfer.count(key)) {
    return AlreadyExistsError("transfer " + key.second + " is already being loaded");
  }
  return OkStatus();
}

}  // namespace kvbridge
