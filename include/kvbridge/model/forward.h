// kvbridge/model/forward.h — one batched forward step over a paged KV cache.
//
// A step takes chunks of several sequences (prefill chunks and single decode tokens alike),
// writes their K/V into the cache through each sequence's block table, attends over everything
// cached before and in the chunk, and returns logits for the rows that ask for them.
//
//   ForwardBatch batch;
//   batch.sequences.push_back({tokens.data(), 5, /*start_pos=*/0, table.data(), 1, true});
//   std::vector<float> logits;  // filled [num_logit_rows][vocab_size]
//   RETURN_IF_ERROR(model.Forward(batch, kv_view, &logits));
//
// Numerics (DESIGN.md "The model and its numerics"): a token's logits are bitwise identical
// whatever else is in the batch, however its prompt was chunked or cached, and wherever its KV
// was computed.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

namespace kvbridge {

struct SequenceChunk {
  const int32_t* tokens = nullptr;  ///< num_tokens token ids (not owned)
  int num_tokens = 0;
  int start_pos = 0;                ///< absolute position of tokens[0]; KV of [0, start_pos) is cached
  const int32_t* block_table = nullptr;  ///< block ids covering positions [0, start_pos + num_tokens)
  int num_blocks = 0;
  bool compute_logits = false;      ///< emit logits for the chunk's last token
};

struct ForwardBatch {
  std::vector<SequenceChunk> sequences;
  /// Called (on the calling thread) right after layer `layer`'s K/V of every chunk are written
  /// to the cache: WRITE-mode transfers start sending that layer then. May be empty.
  std::function<void(int layer)> on_layer_kv_written;
};

}  // namespace kvbridge
