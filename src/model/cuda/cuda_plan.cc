#include "model/cuda/cuda_plan.h"

#include <algorithm>
#include <cstdio>
#include <string>

#include "kvbridge/model/cuda_model.h"
#include "model/forward_internal.h"

namespace kvbridge::cuda_internal {

MatmulPlan PlanMatmul(int m, int n, int k, int shards) {
  MatmulPlan p;
  p.grid_x = (n + kTileN - 1) / kTileN;
  p.grid_y = (m + kTileM - 1) / kTileM;
  p.grid_z = shards;
  for (int s = 0; s < shards; ++s) {
    const int b = static_cast<int>(int64_t{s} * k / shards);
    const int e = static_cast<int>(int64_t{s + 1} * k / shards);
    p.k_begin.push_back(b);
    p.k_end.push_back(e);
    p.k_steps.push_back((e - b + kTileK - 1) / kTileK * (kTileK / kMmaK));
  }
  return p;
}

Result<AttentionPlan> PlanAttention(int rows, int num_heads, int num_kv_heads, int head_dim) {
  if (num_kv_heads <= 0 || num_heads % num_kv_heads != 0) {
    return InvalidArgumentError("attention: num_attention_heads " + std::to_string(num_heads) +
                                " is not a multiple of num_key_value_heads " +
                                std::to_string(num_kv_heads));
  }
  const int group = num_heads / num_kv_heads;
  if (group > 32) {
    return InvalidArgumentError("attention: " + std::to_string(group) +
                                " query heads per KV head; the CUDA kernel takes at most 32");
  }
  if (head_dim <= 0 || head_dim > kMaxHeadDim || head_dim % 2 != 0) {
    return InvalidArgumentError("attention: head_dim " + std::to_string(head_dim) +
                                " must be even and at most " + std::to_string(kMaxHeadDim));
  }
  AttentionPlan p;
  p.grid_x = rows;
  p.grid_y = num_kv_heads;
  p.threads = 32 * group;
  p.smem_bytes = 2 * static_cast<size_t>(kAttentionChunk) * head_dim * sizeof(float);
  p.dims_per_lane = (head_dim + 31) / 32;
  return p;
}

Status PackStep(const ModelConfig& config, const PagedKvLayout& layout, const ForwardBatch& batch,
                const StepLimits& limits, PackedStep* out) {
  std::vector<model_internal::Row> rows;
  std::vector<int> logit_rows;
  RETURN_IF_ERROR(model_internal::BuildRows(config, layout, batch, &rows, &logit_rows));
  const int m = static_cast<int>(rows.size());
  if (m > limits.max_rows) {
    return InvalidArgumentError("Forward: " + std::to_string(m) +
                                " tokens in the step, more than max_num_batched_tokens " +
                                std::to_string(limits.max_rows));
  }
  if (static_cast<int>(batch.sequences.size()) > limits.max_seqs) {
    return InvalidArgumentError("Forward: " + std::to_string(batch.sequences.size()) +
                                " sequences in the step, more than max_num_seqs " +
                                std::to_string(limits.max_seqs));
  }
  std::vector<int> seq_off(batch.sequences.size());
  int entries = 0;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceChunk& q = batch.sequences[s];
    seq_off[s] = entries;
    entries += BlocksFor(q.start_pos + q.num_tokens, layout.block_size);
  }
  if (entries > limits.max_table_blocks) {
    return InvalidArgumentError("Forward: the step's block tables hold " + std::to_string(entries) +
                                " blocks, more than the " +
                                std::to_string(limits.max_table_blocks) +
                                " the device buffers hold (max_num_seqs x max_model_len)");
  }
  out->rows = m;
  out->logit_rows = static_cast<int>(logit_rows.size());
  out->table_entries = entries;
  out->buf.assign(3 * static_cast<size_t>(m) + logit_rows.size() + entries, 0);
  int32_t* b = out->buf.data();
  for (int i = 0; i < m; ++i) {
    b[out->TokensAt() + i] = rows[i].token;
    b[out->PosAt() + i] = rows[i].pos;
    b[out->TableOffAt() + i] = seq_off[rows[i].seq];
  }
  for (size_t r = 0; r < logit_rows.size(); ++r) b[out->LogitRowsAt() + r] = logit_rows[r];
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceChunk& q = batch.sequences[s];
    const int nb = BlocksFor(q.start_pos + q.num_tokens, layout.block_size);
    std::copy(q.block_table, q.block_table + nb, b + out->TablesAt() + seq_off[s]);
  }
  return OkStatus();
}

size_t ActivationSizes::Total() const {
  return x + hb + qkv + attn + partial + gu + act + logits + meta + attn_scratch;
}

ActivationSizes ActivationBytes(const ModelConfig& c, const StepLimits& limits) {
  const size_t m = static_cast<size_t>(limits.max_rows);
  ActivationSizes a;
  a.x = AlignUp256(m * c.hidden_size * 4);
  a.hb = AlignUp256(m * c.hidden_size * 2);
  a.qkv = AlignUp256(m * (c.q_dim() + 2 * static_cast<size_t>(c.kv_dim())) * 4);
  a.attn = AlignUp256(m * c.q_dim() * 2);
  a.partial = AlignUp256(kRowParallelShards * m * c.hidden_size * 4);
  a.gu = AlignUp256(m * 2 * static_cast<size_t>(c.intermediate_size) * 4);
  a.act = AlignUp256(m * c.intermediate_size * 2);
  a.logits = AlignUp256(static_cast<size_t>(limits.max_seqs) * c.vocab_size * 4);
  a.meta = AlignUp256((3 * m + limits.max_seqs + limits.max_table_blocks) * 4);
  const size_t parts = static_cast<size_t>(std::max(limits.max_len, 1) + kAttentionPartition - 1) /
                       kAttentionPartition;
  a.attn_scratch =
      parts > 1
          ? AlignUp256(std::min(kAttentionScratchMaxBytes, m * parts * c.num_attention_heads *
                                                               (c.head_dim + 2) * sizeof(float)))
          : 0;
  return a;
}

}  // namespace kvbridge::cuda_internal

namespace kvbridge {

Result<int> ParseDeviceSpec(std::string_view spec) {
  if (spec == "cpu") return -1;
  if (spec == "cuda") return 0;
  if (spec.starts_with("cuda:") && spec.size() > 5 && spec.size() <= 8) {
    int n = 0;
    for (char ch : spec.substr(5)) {
      if (ch < '0' || ch > '9') n = -1;
      if (n >= 0) n = n * 10 + (ch - '0');
    }
    if (n >= 0) return n;
  }
  return InvalidArgumentError("--device must be cpu, cuda or cuda:N, got '" + std::string(spec) +
                              "'");
}

Result<int64_t> CudaKvBlocksForUtilization(size_t device_total, size_t free_after_static,
                                           size_t own_static_bytes, double utilization,
                                           size_t bytes_per_block) {
  if (!(utilization > 0.0 && utilization <= 1.0)) {
    return InvalidArgumentError("gpu_memory_utilization must be in (0, 1], got " +
                                std::to_string(utilization));
  }
  if (bytes_per_block == 0) return InvalidArgumentError("KV block of 0 bytes");
  const double mib = 1048576.0;
  const double budget = utilization * static_cast<double>(device_total);
  const double own = static_cast<double>(own_static_bytes);
  const double free_now = static_cast<double>(free_after_static);
  const double margin = static_cast<double>(kCudaFreeMargin);
  // This instance's share (vLLM's per-instance limit), and no more than is free on the device.
  const double left = std::min(budget - own, free_now - margin);
  auto fmt = [&](double b) {
    char s[32];
    std::snprintf(s, sizeof(s), "%.0f MiB", b / mib);
    return std::string(s);
  };
  if (left < static_cast<double>(bytes_per_block)) {
    if (budget - own <= free_now - margin) {
      return ResourceExhaustedError(
          "KV cache: gpu_memory_utilization " + std::to_string(utilization) + " of " +
          fmt(static_cast<double>(device_total)) + " is " + fmt(budget) + ", but this engine's " +
          "weights and activations take " + fmt(own) + ", leaving less than one KV block (" +
          std::to_string(bytes_per_block) +
          " bytes over all layers): raise "
          "--gpu-memory-utilization");
    }
    return ResourceExhaustedError(
        "KV cache: only " + fmt(free_now) + " of " + fmt(static_cast<double>(device_total)) +
        " is free on the device after the weights and activations (other processes hold the "
        "rest; " +
        fmt(margin) + " is kept free), less than one KV block (" + std::to_string(bytes_per_block) +
        " bytes over all layers)");
  }
  return static_cast<int64_t>(left / static_cast<double>(bytes_per_block));
}

}  // namespace kvbridge
