// kvbridge/engine/scheduler.h — the sans-IO continuous-batching scheduler.
//
// Decides, step by step, which sequences run and how many of their tokens (chunked prefill and
// single-token decodes share one token budget), allocates their KV blocks from the BlockPool
// (prefix-cache hits, copy on write, preemption by recompute when blocks run out), forks the n
// siblings of a parallel-sampling request once its prompt is computed, samples tokens from the
// logits the model returns, applies stop conditions and produces RequestOutputs. It also drives
// the P/D KvConnector hooks (kv_connector.h). It never reads a clock, touches a socket or starts
// a thread: every call takes `now` (DESIGN.md "Sans-IO cores").
//
//   Scheduler sched(config, pool.get(), connector, &metrics);
//   RETURN_IF_ERROR(sched.AddRequest(std::move(request), now));
//   while (sched.HasUnfinished()) {
//     sched.PollConnector(now);
//     ScheduledBatch batch = sched.Schedule(now);
//     for (auto [src, dst] : batch.block_copies) storage.CopyBlock(src, dst);
//     std::vector<float> logits;
//     RETURN_IF_ERROR(model.Forward(batch.ToForwardBatch(), storage.view(), &logits));
//     sched.UpdateFromOutput(batch, logits, now);
//     for (RequestOutput& out : sched.TakeOutputs()) deliver(out);
//   }
//
// Request state machine (docs/engine.md "Request states" has the diagram); a sequence is one
// scheduled unit: the client request before its fork, or one sibling "{i}_{id}" after it.
// CheckTransition implements exactly this table:
// clang-format off
//   from \ to               WAITING  WAITING_FOR_ RUNNING  PREEMPTED  FINISHED_ FINISHED_ FINISHED_
//                                    REMOTE_KVS                       STOPPED/  ABORTED   ERROR
//                                                                     LENGTH
//   WAITING                 -        yes          yes      -          -         yes       yes
//   WAITING_FOR_REMOTE_KVS  yes      -            -        -          -         yes       yes
//   RUNNING                 -        -            yes*     yes        yes       yes       yes
//   PREEMPTED               -        -            yes      -          -         yes       yes
//   FINISHED_*              -        -            -        -          -         -         -
// clang-format on
//   (* RUNNING -> RUNNING is the fork: the parent's row becomes its n siblings.)
//   ERROR is reached from a connector error or a failed remote load with recompute = false
//   (from WAITING / WAITING_FOR_REMOTE_KVS), or a forward-pass error (from RUNNING).
//
// Thread-safety: not thread-safe; the engine thread owns it.
#pragma once

#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "kvbridge/common/clock.h"
#include "kvbridge/common/metrics.h"
#include "kvbridge/common/status.h"
#include "kvbridge/engine/block_pool.h"
#include "kvbridge/engine/kv_connector.h"
#include "kvbridge/engine/request.h"
#include "kvbridge/engine/vllm_metrics.h"
#include "kvbridge/model/forward.h"
#include "kvbridge/model/tokenizer.h"

namespace kvbridge {

/// States of one scheduled sequence; transitions in the table above.
enum class RequestState : uint8_t {
  kWaiting = 0,
  kWaitingForRemoteKvs = 1,
  kRunning = 2,
  kPreempted = 3,
  kFinishedStopped = 4,
  kFinishedLength = 5,
  kFinishedAborted = 6,
  kFinishedError = 7,
};
/// "WAITING", "WAITING_FOR_REMOTE_KVS", "RUNNING", "PREEMPTED", "FINISHED_STOPPED", ...
std::string_view RequestStateName(RequestState s);
bool IsFinishedState(RequestState s);
/// OK when `from -> to` is in the table above; FailedPrecondition naming both otherwise.
Status CheckTransition(RequestState from, RequestState to);

struct SchedulerConfig {
  int max_num_seqs = 64;               ///< running sequences (a pre-fork request counts n)
  int max_num_batched_tokens = 2048;   ///< tokens per step over all chunks
  int max_model_len = 2048;            ///< prompt + output tokens per sequence
  int vocab_size = 0;                  ///< > 0
  std::vector<int32_t> eos_token_ids;  ///< stop on these unless ignore_eos
  /// The tokenizer's EOS (-1: none): finishing on it reports stop_reason null; finishing on
  /// another of eos_token_ids (generation_config.json's or config.json's list) reports the id,
  /// as vLLM, which makes those stop_token_ids.
  int32_t tokenizer_eos_token_id = -1;
  std::string model_fingerprint;  ///< seeds the prefix-cache hash chain
  uint64_t default_seed = 0;      ///< requests without a seed use a hash of (this, id)
  /// The model's tokenizer, for stop strings: a sequence's output text is what an
  /// IncrementalDecoder (skip_special_tokens) made final so far — the text the server returns,
  /// not one-id decodes (which lose a BPE tokenizer's multi-byte characters and a
  /// SentencePiece decoder's spaces). When unset, requests with stop strings are rejected
  /// (InvalidArgument).
  std::optional<Tokenizer> tokenizer;
  /// The `model_name` label of the vllm:* metric families.
  std::string served_model_name = "kvbridge";
};

/// One chunk of one sequence in a step (pointers stay valid until UpdateFromOutput).
struct ScheduledChunk {
  std::string request_id;  ///< scheduled id ("{i}_{parent}" for a sibling)
  const int32_t* tokens = nullptr;
  int num_tokens = 0;
  int start_pos = 0;
  const int32_t* block_table = nullptr;
  int num_blocks = 0;
  bool compute_logits = false;
};

struct ScheduledBatch {
  std::vector<ScheduledChunk> chunks;
  /// (src, dst) block copies to run before the forward pass (copy on write).
  std::vector<std::pair<int32_t, int32_t>> block_copies;
  int num_tokens = 0;      ///< sum of chunk tokens
  int num_logit_rows = 0;  ///< chunks with compute_logits
  bool empty() const { return chunks.empty(); }
  /// The model's view of this batch (on_layer_kv_written left empty).
  ForwardBatch ToForwardBatch() const;
};

class Scheduler {
 public:
  /// `pool` must outlive the scheduler; `connector` and `metrics` may be null.
  Scheduler(SchedulerConfig config, BlockPool* pool, KvConnector* connector = nullptr,
            MetricsRegistry* metrics = nullptr);
  ~Scheduler();
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  void set_connector(KvConnector* connector) { connector_ = connector; }
  const SchedulerConfig& config() const { return config_; }

  /// Validates and queues a request (state WAITING). Errors (nothing queued): InvalidArgument
  /// (empty prompt, token outside the vocabulary, prompt_len >= max_model_len, bad sampling
  /// params, n > max_num_seqs, a request that cannot fit in the pool even alone),
  /// AlreadyExists (an unfinished request — or a sibling still held/draining — with this id).
  Status AddRequest(EngineRequest request, TimePoint now);
  /// The checks of AddRequest that need no scheduler state (InvalidArgument); reads only the
  /// immutable config and pool size, so any thread may call it.
  Status ValidateRequest(const EngineRequest& request) const;
  /// Ids of unfinished client requests, sorted.
  std::vector<std::string> RequestIds() const;
  /// Aborts a client request in any state: every unfinished sequence ends FINISHED_ABORTED and
  /// frees exactly the blocks it holds — unless the connector's RequestAborted keeps them until
  /// Poll reports the sequence. One final output (finish_reason "abort"). Returns false for
  /// unknown ids (no-op). Must not be called between Schedule and UpdateFromOutput.
  bool Abort(const std::string& request_id, TimePoint now);

  /// Calls KvConnector::Poll and applies its report: finished_sending/finished_recving/
  /// failed_recving. No-op without a connector.
  void PollConnector(TimePoint now);
  /// Picks this step's chunks (running first, then waiting in FCFS order), allocating blocks.
  ScheduledBatch Schedule(TimePoint now);
  /// Applies a forward pass: `logits` is [batch.num_logit_rows][vocab_size]. Advances computed
  /// tokens, caches full blocks, forks, samples, checks stops, queues outputs.
  /// Errors: InvalidArgument when logits has the wrong size (then FailBatch is applied).
  Status UpdateFromOutput(const ScheduledBatch& batch, std::span<const float> logits,
                          TimePoint now);
  /// Ends every request with a chunk in `batch` with `error` (forward failure); the connector
  /// hears of each live sequence through RequestAborted (and may keep its blocks).
  void FailBatch(const ScheduledBatch& batch, const Status& error, TimePoint now);
  /// Outputs produced since the last call, in production order.
  std::vector<RequestOutput> TakeOutputs();

  /// Sequences RUNNING.
  int num_running() const { return static_cast<int>(running_.size()); }
  /// Sequences WAITING or PREEMPTED.
  int num_waiting() const { return static_cast<int>(waiting_.size()); }
  int num_waiting_for_remote() const { return static_cast<int>(remote_wait_.size()); }
  /// Unfinished client requests.
  size_t num_requests() const { return groups_.size(); }
  bool HasUnfinished() const { return !groups_.empty(); }
  /// Aborted sequences whose blocks wait for a connector report.
  size_t num_draining() const { return draining_.size(); }
  /// Finished sequences whose blocks are held for a transfer.
  size_t num_held() const { return held_.size(); }
  /// The vllm:* families (null without a metrics registry).
  VllmMetrics* vllm_metrics() { return vllm_.get(); }
  /// Preemptions so far.
  int64_t num_preemptions() const { return num_preemptions_; }

  /// State of a scheduled sequence (parent id before the fork, "{i}_{id}" after); nullopt when
  /// unknown or finished and gone. For tests and debugging.
  std::optional<RequestState> GetState(const std::string& seq_id) const;
  /// Block table of a live sequence (empty when unknown).
  std::vector<int32_t> GetBlockTable(const std::string& seq_id) const;
  /// Computed tokens of a live sequence (-1 when unknown).
  int GetNumComputed(const std::string& seq_id) const;

 private:
  struct Seq;
  struct Group;

  Seq* FindSeq(const std::string& seq_id) const;
  ConnectorRequestInfo Info(const Seq& s) const;
  // The checked transition (CheckTransition): an illegal one changes nothing and returns the
  // FailedPrecondition.
  [[nodiscard]] Status SetState(Seq* s, RequestState to);
  // SetState; an illegal transition (a bug here) fails the request's group with that status
  // (FailGroup: the client gets the error) and returns false: the caller stops there.
  bool Transition(Seq* s, RequestState to, TimePoint now);
  // Blocks a seq needs to compute `num_new` more tokens (fresh + copy on write).
  int BlocksNeeded(const Seq& s, int num_new) const;
  // Allocates them (caller checked); records copies.
  void AllocateSlots(Seq* s, int num_new, ScheduledBatch* batch);
  void Preempt(Seq* s, TimePoint now);
  // Admission of a waiting seq: returns true when scheduled, false to stop admitting.
  enum class Admit { kScheduled, kStop, kSkipped };
  Admit TryAdmit(Seq* s, int* budget, ScheduledBatch* batch, TimePoint now);
  void CacheComputedBlocks(Seq* s);
  void Fork(Seq* parent, TimePoint now);
  void AppendToken(Seq* s, int32_t token, std::span<const float> logits_row, TimePoint now);
  void FinishSeq(Seq* s, RequestState state, TimePoint now);
  // Counts a sequence that just finished (metrics; the group's finish time).
  void ObserveFinished(Seq* s, TimePoint now);
  // Ends every live sequence of `g` with `error`. `tell_connector`: call RequestAborted for each
  // (failures the connector did not originate, e.g. a forward error).
  void FailGroup(Group* g, const Status& error, TimePoint now, bool tell_connector = false);
  void ReleaseBlocks(std::vector<int32_t>* blocks);
  void RemoveFromQueues(Seq* s);
  void MarkDirty(Group* g);
  void FlushOutputs();
  void OnRemoteDone(Seq* s, TimePoint now);
  void OnRemoteFailed(Seq* s, const KvConnector::LoadFailure& f, TimePoint now);
  bool ReleaseDrainingOrHeld(const std::string& id);
  int RunningSlots(const Seq& s) const;

  SchedulerConfig config_;
  BlockPool* pool_;
  KvConnector* connector_;
  BlockHash root_hash_;

  std::unordered_map<std::string, std::unique_ptr<Group>> groups_;
  std::deque<Seq*> waiting_;   // WAITING and PREEMPTED, FCFS (preempted and loaded go first)
  std::vector<Seq*> running_;  // admission order; preemption takes from the back
  int running_slots_ = 0;
  std::unordered_map<std::string, Seq*> remote_wait_;  // WAITING_FOR_REMOTE_KVS by seq id
  std::unordered_map<std::string, std::vector<int32_t>> draining_;  // aborted, blocks kept
  std::unordered_set<std::string> held_;         // finished, pool hold keyed by seq id
  std::vector<Seq*> scheduled_;                  // this step's chunks, parallel to batch.chunks
  std::vector<std::unique_ptr<Seq>> graveyard_;  // forked parents, freed after the update
  std::vector<Group*> dirty_;
  std::vector<RequestOutput> outputs_;
  std::vector<double> scratch_;
  int64_t num_preemptions_ = 0;

  // Metrics (null when no registry).
  Counter* m_prompt_tokens_ = nullptr;
  Counter* m_generation_tokens_ = nullptr;
  Counter* m_prompt_computed_ = nullptr;
  Counter* m_prefix_queries_ = nullptr;
  Counter* m_prefix_hits_ = nullptr;
  Counter* m_preemptions_ = nullptr;
  Counter* m_remote_load_failures_ = nullptr;
  Histogram* m_ttft_ = nullptr;
  Histogram* m_itl_ = nullptr;
  std::unordered_map<std::string, Counter*> m_finished_;  // by reason
  std::unique_ptr<VllmMetrics> vllm_;
};

}  // namespace kvbridge
