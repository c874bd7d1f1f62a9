#include "kvbridge/engine/scheduler.h"

#include <xxhash.h>

#include <algorithm>
#include <cassert>

#include "kvbridge/common/logging.h"
#include "kvbridge/engine/sampler.h"

namespace kvbridge {

// One scheduled unit: the client request before its fork, or one sibling after it.
struct Scheduler::Seq {
  Group* group = nullptr;
  std::string id;
  int index = 0;
  RequestState state = RequestState::kWaiting;
  std::vector<int32_t> tokens;  // prompt + sampled
  int num_computed = 0;         // tokens whose KV is in the blocks
  std::vector<int32_t> blocks;
  std::vector<BlockHash> hashes;  // chain over full blocks of `tokens`
  int num_cached_blocks = 0;      // leading blocks offered to the prefix cache
  // Output.
  std::vector<TokenLogprob> logprobs;             // parallel to output tokens when requested
  std::optional<IncrementalDecoder> text_stream;  // only with stop strings
  std::string text;                               // text_stream's final output so far
  // Text size once each output token's text is final (npos while the decoder holds it back,
  // e.g. the first byte of a UTF-8 character).
  std::vector<size_t> text_end;
  size_t text_final_tokens = 0;  // output tokens whose text_end is known
  int num_output_final = -1;     // output tokens kept at finish
  nlohmann::json stop_reason;    // CompletionOutput::stop_reason
  bool drop_last_text = false;   // a stop token / EOS ended it and its text is not kept
  int64_t text_len = -1;         // CompletionOutput::text_len
  int num_emitted = 0;
  bool finish_emitted = false;
  std::string finish_reason;
  TimePoint last_token_time = -1;

  int num_output() const;
};

struct Scheduler::Group {
  EngineRequest req;
  int num_prompt = 0;
  uint64_t seed = 0;
  std::vector<std::unique_ptr<Seq>> seqs;  // 1 before the fork, n after
  bool forked = false;                     // n == 1 counts as forked
  bool connector_asked = false;
  KvConnector::Match match;
  int local_hit_tokens = 0;  // at the connector call
  int num_cached_tokens = 0;
  int num_unfinished = 0;
  bool first_token = false;
  RequestTimes times;  // scheduled / first token / remote KV wait / finished, as they happen
  bool final_emitted = false;
  bool dirty = false;
  Status error;
  nlohmann::json kv_params_out;
  std::vector<int32_t> min_tokens_banned;  // EOS + stop_token_ids
  size_t max_stop_len = 0;
};

int Scheduler::Seq::num_output() const {
  return static_cast<int>(tokens.size()) - group->num_prompt;
}

namespace {

const char* const kReasons[] = {"stop", "length", "abort", "error"};

int CeilDiv(int64_t a, int64_t b) { return static_cast<int>((a + b - 1) / b); }

}  // namespace

std::string_view RequestStateName(RequestState s) {
  switch (s) {
    case RequestState::kWaiting:
      return "WAITING";
    case RequestState::kWaitingForRemoteKvs:
      return "WAITING_FOR_REMOTE_KVS";
    case RequestState::kRunning:
      return "RUNNING";
    case RequestState::kPreempted:
      return "PREEMPTED";
    case RequestState::kFinishedStopped:
      return "FINISHED_STOPPED";
    case RequestState::kFinishedLength:
      return "FINISHED_LENGTH";
    case RequestState::kFinishedAborted:
      return "FINISHED_ABORTED";
    case RequestState::kFinishedError:
      return "FINISHED_ERROR";
  }
  return "UNKNOWN";
}

bool IsFinishedState(RequestState s) {
  switch (s) {
    case RequestState::kWaiting:
    case RequestState::kWaitingForRemoteKvs:
    case RequestState::kRunning:
    case RequestState::kPreempted:
      return false;
    case RequestState::kFinishedStopped:
    case RequestState::kFinishedLength:
    case RequestState::kFinishedAborted:
    case RequestState::kFinishedError:
      return true;
  }
  return false;
}

Status CheckTransition(RequestState from, RequestState to) {
  using S = RequestState;
  bool ok = false;
  switch (from) {
    case S::kWaiting:
      ok = to == S::kWaitingForRemoteKvs || to == S::kRunning || to == S::kFinishedAborted ||
           to == S::kFinishedError;
      break;
    case S::kWaitingForRemoteKvs:
      ok = to == S::kWaiting || to == S::kFinishedAborted || to == S::kFinishedError;
      break;
    case S::kRunning:
      ok = to == S::kRunning || to == S::kPreempted || IsFinishedState(to);
      break;
    case S::kPreempted:
      ok = to == S::kRunning || to == S::kFinishedAborted || to == S::kFinishedError;
      break;
    default:
      ok = false;
  }
  if (ok) return OkStatus();
  return FailedPreconditionError("illegal request state transition " +
                                 std::string(RequestStateName(from)) + " -> " +
                                 std::string(RequestStateName(to)));
}

ForwardBatch ScheduledBatch::ToForwardBatch() const {
  ForwardBatch fb;
  fb.sequences.reserve(chunks.size());
  for (const ScheduledChunk& c : chunks) {
    fb.sequences.push_back(
        {c.tokens, c.num_tokens, c.start_pos, c.block_table, c.num_blocks, c.compute_logits});
  }
  return fb;
}

Scheduler::Scheduler(SchedulerConfig config, BlockPool* pool, KvConnector* connector,
                     MetricsRegistry* metrics)
    : config_(std::move(config)),
      pool_(pool),
      connector_(connector),
      root_hash_(RootBlockHash(config_.model_fingerprint)) {
  if (metrics != nullptr) {
    m_prompt_tokens_ = &metrics->AddCounter("kvbridge_prompt_tokens_total",
                                            "Prompt tokens of requests whose prefill completed.");
    m_generation_tokens_ =
        &metrics->AddCounter("kvbridge_generation_tokens_total", "Generated (sampled) tokens.");
    m_prompt_computed_ = &metrics->AddCounter(
        "kvbridge_prompt_tokens_computed_total",
        "Prompt tokens run through the forward pass (not prefix-cache hits, not remote KV).");
    m_prefix_queries_ = &metrics->AddCounter("kvbridge_prefix_cache_queries_total",
                                             "Tokens looked up in the prefix cache.");
    m_prefix_hits_ = &metrics->AddCounter("kvbridge_prefix_cache_hits_total",
                                          "Tokens found in the prefix cache.");
    m_preemptions_ = &metrics->AddCounter("kvbridge_preemptions_total",
                                          "Sequences preempted (recompute) for lack of blocks.");
    m_remote_load_failures_ = &metrics->AddCounter(
        "kvbridge_remote_kv_load_failures_total",
        "Remote KV loads that failed (recomputed locally or failed per policy).");
    m_ttft_ = &metrics->AddHistogram("kvbridge_time_to_first_token_seconds",
                                     "Arrival to first sampled token.",
                                     Histogram::LatencyBucketsSeconds());
    m_itl_ = &metrics->AddHistogram("kvbridge_inter_token_latency_seconds",
                                    "Time between consecutive tokens of a sequence.",
                                    Histogram::FineLatencyBucketsSeconds());
    for (const char* r : kReasons) {
      m_finished_[r] =
          &metrics->AddCounter("kvbridge_requests_finished_total", "Finished sequences by reason.",
                               std::string("reason=\"") + r + "\"");
    }
    vllm_ =
        std::make_unique<VllmMetrics>(metrics, config_.served_model_name, config_.max_model_len);
  }
}

Scheduler::~Scheduler() = default;

Scheduler::Seq* Scheduler::FindSeq(const std::string& seq_id) const {
  // Sibling ids are "{i}_{parent}"; try the id itself as a parent first.
  auto it = groups_.find(seq_id);
  if (it != groups_.end()) {
    for (auto& s : it->second->seqs) {
      if (s->id == seq_id) return s.get();
    }
  }
  size_t us = seq_id.find('_');
  if (us != std::string::npos) {
    auto git = groups_.find(seq_id.substr(us + 1));
    if (git != groups_.end()) {
      for (auto& s : git->second->seqs) {
        if (s->id == seq_id) return s.get();
      }
    }
  }
  return nullptr;
}

std::optional<RequestState> Scheduler::GetState(const std::string& seq_id) const {
  Seq* s = FindSeq(seq_id);
  if (s == nullptr) return std::nullopt;
  return s->state;
}

std::vector<int32_t> Scheduler::GetBlockTable(const std::string& seq_id) const {
  Seq* s = FindSeq(seq_id);
  return s ? s->blocks : std::vector<int32_t>{};
}

int Scheduler::GetNumComputed(const std::string& seq_id) const {
  Seq* s = FindSeq(seq_id);
  return s ? s->num_computed : -1;
}

ConnectorRequestInfo Scheduler::Info(const Seq& s) const {
  ConnectorRequestInfo info;
  info.request_id = s.id;
  info.parent_id = s.group->req.request_id;
  info.sibling_index = s.index;
  info.n = s.group->req.sampling.n;
  info.num_prompt_tokens = s.group->num_prompt;
  info.prompt_token_ids = &s.group->req.prompt_token_ids;
  info.kv_transfer_params = &s.group->req.kv_transfer_params;
  return info;
}

Status Scheduler::SetState(Seq* s, RequestState to) {
  RETURN_IF_ERROR(CheckTransition(s->state, to).WithPrefix(s->id));
  s->state = to;
  return OkStatus();
}

bool Scheduler::Transition(Seq* s, RequestState to, TimePoint now) {
  Status st = SetState(s, to);
  if (st.ok()) return true;
  // A bug in this file, never an input error: the request fails with the FailedPrecondition
  // (its client gets the error; the connector drops its state as for an abort).
  FailGroup(s->group, st, now, /*tell_connector=*/true);
  return false;
}

int Scheduler::RunningSlots(const Seq& s) const {
  return s.group->forked ? 1 : s.group->req.sampling.n;
}

Status Scheduler::ValidateRequest(const EngineRequest& request) const {
  const std::string& id = request.request_id;
  if (id.empty()) return InvalidArgumentError("request_id must not be empty");
  if (request.prompt_token_ids.empty()) return InvalidArgumentError("prompt must not be empty");
  const int64_t plen = static_cast<int64_t>(request.prompt_token_ids.size());
  if (plen >= config_.max_model_len) {
    return InvalidArgumentError("prompt of " + std::to_string(plen) +
                                " tokens leaves no room under max_model_len " +
                                std::to_string(config_.max_model_len));
  }
  for (int32_t t : request.prompt_token_ids) {
    if (t < 0 || t >= config_.vocab_size) {
      return InvalidArgumentError("prompt token " + std::to_string(t) +
                                  " outside the vocabulary [0, " +
                                  std::to_string(config_.vocab_size) + ")");
    }
  }
  const SamplingParams& sp = request.sampling;
  RETURN_IF_ERROR(ValidateSamplingParams(sp, config_.vocab_size));
  if (sp.n > config_.max_num_seqs) {
    return InvalidArgumentError("n = " + std::to_string(sp.n) + " exceeds max_num_seqs " +
                                std::to_string(config_.max_num_seqs));
  }
  if (!sp.stop.empty() && !config_.tokenizer) {
    return InvalidArgumentError("stop strings need a tokenizer");
  }
  // One sequence alone must fit, else it would wait forever.
  const int64_t max_len = std::min<int64_t>(plen + sp.max_tokens, config_.max_model_len);
  if (CeilDiv(max_len, pool_->block_size()) > pool_->num_blocks()) {
    return InvalidArgumentError("request needs up to " +
                                std::to_string(CeilDiv(max_len, pool_->block_size())) +
                                " KV blocks; the pool has " + std::to_string(pool_->num_blocks()));
  }
  return OkStatus();
}

Status Scheduler::AddRequest(EngineRequest request, TimePoint now) {
  RETURN_IF_ERROR(ValidateRequest(request));
  const std::string& id = request.request_id;
  const SamplingParams& sp = request.sampling;
  const int64_t plen = static_cast<int64_t>(request.prompt_token_ids.size());
  if (groups_.count(id) || draining_.count(id) || held_.count(id)) {
    return AlreadyExistsError("request id '" + id + "' is already in use");
  }
  for (int i = 0; sp.n > 1 && i < sp.n; ++i) {
    std::string sid = std::to_string(i) + "_" + id;
    if (draining_.count(sid) || held_.count(sid)) {
      return AlreadyExistsError("request id '" + sid + "' is still draining");
    }
  }

  auto g = std::make_unique<Group>();
  g->num_prompt = static_cast<int>(plen);
  g->seed = sp.seed.has_value()
                ? *sp.seed
                : SplitMix64(config_.default_seed ^ XXH3_64bits(id.data(), id.size()));
  g->forked = sp.n == 1;
  g->num_unfinished = 1;
  if (sp.min_tokens > 0) {
    if (!sp.ignore_eos) g->min_tokens_banned = config_.eos_token_ids;
    for (int32_t t : sp.stop_token_ids) g->min_tokens_banned.push_back(t);
  }
  for (const std::string& s : sp.stop) g->max_stop_len = std::max(g->max_stop_len, s.size());
  if (request.arrival_time == 0) request.arrival_time = now;
  g->times.arrival = request.arrival_time;
  g->req = std::move(request);
  auto seq = std::make_unique<Seq>();
  seq->group = g.get();
  seq->id = g->req.request_id;
  seq->tokens = g->req.prompt_token_ids;
  waiting_.push_back(seq.get());
  g->seqs.push_back(std::move(seq));
  Seq* queued = waiting_.back();
  groups_.emplace(g->req.request_id, std::move(g));
  if (connector_ != nullptr && !queued->group->req.kv_transfer_params.is_null()) {
    connector_->RequestQueued(Info(*queued), now);
  }
  return OkStatus();
}

int Scheduler::BlocksNeeded(const Seq& s, int num_new) const {
  const int bs = pool_->block_size();
  const int end = s.num_computed + num_new;
  int need = std::max(0, CeilDiv(end, bs) - static_cast<int>(s.blocks.size()));
  const int first = s.num_computed / bs;
  if (s.num_computed % bs != 0 && first < static_cast<int>(s.blocks.size()) &&
      pool_->RefCount(s.blocks[first]) > 1) {
    ++need;  // copy on write of the shared partial block we are about to write into
  }
  return need;
}

void Scheduler::AllocateSlots(Seq* s, int num_new, ScheduledBatch* batch) {
  const int bs = pool_->block_size();
  const int end = s->num_computed + num_new;
  const int first = s->num_computed / bs;
  const bool cow = s->num_computed % bs != 0 && first < static_cast<int>(s->blocks.size()) &&
                   pool_->RefCount(s->blocks[first]) > 1;
  const int fresh = std::max(0, CeilDiv(end, bs) - static_cast<int>(s->blocks.size()));
  std::vector<int32_t> got;
  Status st = pool_->Allocate(fresh + (cow ? 1 : 0), {}, &got);
  assert(st.ok() && "caller checked CanAllocate");
  (void)st;
  size_t k = 0;
  if (cow) {
    int32_t src = s->blocks[first];
    int32_t dst = got[k++];
    batch->block_copies.emplace_back(src, dst);
    const int32_t one[] = {src};
    pool_->Release(one).IgnoreError();  // ref > 1 was checked: it stays active
    s->blocks[first] = dst;
  }
  for (; k < got.size(); ++k) s->blocks.push_back(got[k]);
}

void Scheduler::ReleaseBlocks(std::vector<int32_t>* blocks) {
  // Reverse order: a prompt's tail goes to the LRU first, so its head is evicted last.
  std::vector<int32_t> rev(blocks->rbegin(), blocks->rend());
  Status st = pool_->Release(rev);
  if (!st.ok()) KVB_LOG_ERROR("scheduler: release failed: {}", st.ToString());
  blocks->clear();
}

void Scheduler::Preempt(Seq* s, TimePoint now) {
  auto it = std::find(running_.begin(), running_.end(), s);
  assert(it != running_.end());
  running_.erase(it);
  running_slots_ -= RunningSlots(*s);
  ReleaseBlocks(&s->blocks);
  s->num_computed = 0;
  s->num_cached_blocks = 0;
  if (!Transition(s, RequestState::kPreempted, now)) return;
  waiting_.push_front(s);
  ++num_preemptions_;
  if (m_preemptions_) m_preemptions_->Inc();
  if (vllm_) vllm_->OnPreemption();
}

void Scheduler::CacheComputedBlocks(Seq* s) {
  if (!pool_->prefix_caching_enabled()) return;
  const int bs = pool_->block_size();
  const int full = std::min<int>(s->num_computed / bs, static_cast<int>(s->blocks.size()));
  if (full <= s->num_cached_blocks) return;
  AppendBlockHashes(root_hash_, std::span<const int32_t>(s->tokens.data(), full * bs), bs,
                    &s->hashes);
  for (int j = s->num_cached_blocks; j < full; ++j)
    pool_->CacheFullBlock(s->blocks[j], s->hashes[j]);
  s->num_cached_blocks = full;
}

Scheduler::Admit Scheduler::TryAdmit(Seq* s, int* budget, ScheduledBatch* batch, TimePoint now) {
  Group* g = s->group;
  const int bs = pool_->block_size();
  const int slots = RunningSlots(*s);
  if (running_slots_ + slots > config_.max_num_seqs) return Admit::kStop;

  if (s->blocks.empty()) {
    // Fresh start (new, preempted, or a failed load without a local prefix): look up the
    // prefix cache. At least one token is left to compute so the step yields logits.
    std::vector<int32_t> hits;
    if (pool_->prefix_caching_enabled()) {
      AppendBlockHashes(root_hash_, s->tokens, bs, &s->hashes);
      const size_t max_hit = (s->tokens.size() - 1) / bs;
      pool_->MatchPrefix(
          std::span<const BlockHash>(s->hashes.data(), std::min(max_hit, s->hashes.size())), &hits);
    }
    const int local = static_cast<int>(hits.size()) * bs;
    int total = local;  // tokens whose KV will be in the blocks once allocated
    if (connector_ != nullptr && !g->connector_asked) {
      // Ask only when the whole prompt could be allocated, so the answer is acted on at once
      // (GetNumNewMatchedTokens is called once per request).
      if (!pool_->CanAllocate(CeilDiv(g->num_prompt, bs) - static_cast<int>(hits.size()), hits)) {
        return Admit::kStop;
      }
      g->connector_asked = true;
      g->local_hit_tokens = local;
      Result<KvConnector::Match> m = connector_->GetNumNewMatchedTokens(Info(*s), local, now);
      if (!m.ok()) {
        FailGroup(g, m.status(), now);
        return Admit::kSkipped;
      }
      g->match = *m;
      if (g->match.num_external_tokens < 0 ||
          local + g->match.num_external_tokens > g->num_prompt) {
        FailGroup(
            g,
            InternalError("connector matched " + std::to_string(g->match.num_external_tokens) +
                          " external tokens beyond the prompt"),
            now);
        return Admit::kSkipped;
      }
      total = local + g->match.num_external_tokens;
    }
    const int last = static_cast<int>(s->tokens.size()) - 1;  // the token that yields logits
    const int num_new = std::min(last + 1 - std::min(total, last), *budget);
    const int need_tokens = std::max(total, std::min(total, last) + num_new);
    const int need = CeilDiv(need_tokens, bs) - static_cast<int>(hits.size());
    if (!pool_->CanAllocate(need, hits)) return Admit::kStop;  // connector path checked above
    if (m_prefix_queries_) m_prefix_queries_->Inc(static_cast<double>(s->tokens.size()));
    if (m_prefix_hits_) m_prefix_hits_->Inc(local);
    if (vllm_) vllm_->OnPrefixCacheLookup(static_cast<int>(s->tokens.size()), local);
    s->blocks = hits;
    // Take the hits now and only the blocks the KV of `total` tokens lives in; the chunk's
    // blocks come from AllocateSlots below.
    const int now_blocks = CeilDiv(total, bs) - static_cast<int>(hits.size());
    Status st = pool_->Allocate(now_blocks, hits, &s->blocks);
    assert(st.ok());
    (void)st;
    s->num_computed = local;
    s->num_cached_blocks = static_cast<int>(hits.size());
    if (s->state == RequestState::kWaiting) g->num_cached_tokens = total;
    if (total > local) {
      connector_->UpdateStateAfterAlloc(Info(*s), s->blocks, local, g->match.num_external_tokens,
                                        now);
      if (g->match.load_async) {
        waiting_.pop_front();
        if (!Transition(s, RequestState::kWaitingForRemoteKvs, now)) return Admit::kSkipped;
        if (g->times.remote_kv_wait_start < 0) g->times.remote_kv_wait_start = now;
        remote_wait_[s->id] = s;
        return Admit::kSkipped;
      }
      // Synchronous load: the connector filled the blocks inside UpdateStateAfterAlloc.
      s->num_computed = std::min(total, last);
      CacheComputedBlocks(s);
    }
  }

  const int num_new = std::min(static_cast<int>(s->tokens.size()) - s->num_computed, *budget);
  if (num_new <= 0) return Admit::kStop;
  if (!pool_->CanAllocate(BlocksNeeded(*s, num_new))) return Admit::kStop;
  waiting_.pop_front();
  if (!Transition(s, RequestState::kRunning, now)) return Admit::kSkipped;
  if (s->group->times.scheduled < 0) s->group->times.scheduled = now;
  running_.push_back(s);
  running_slots_ += slots;
  AllocateSlots(s, num_new, batch);
  ScheduledChunk c;
  c.request_id = s->id;
  c.num_tokens = num_new;
  c.start_pos = s->num_computed;
  c.compute_logits = s->num_computed + num_new == static_cast<int>(s->tokens.size());
  batch->chunks.push_back(c);
  scheduled_.push_back(s);
  *budget -= num_new;
  return Admit::kScheduled;
}

ScheduledBatch Scheduler::Schedule(TimePoint now) {
  ScheduledBatch batch;
  scheduled_.clear();
  int budget = config_.max_num_batched_tokens;
  bool preempted = false;

  for (size_t i = 0; i < running_.size() && budget > 0;) {
    Seq* s = running_[i];
    const int num_new = std::min(static_cast<int>(s->tokens.size()) - s->num_computed, budget);
    if (num_new <= 0) {
      ++i;
      continue;
    }
    bool self_preempted = false;
    while (!pool_->CanAllocate(BlocksNeeded(*s, num_new))) {
      Seq* victim = running_.back();
      Preempt(victim, now);
      preempted = true;
      if (victim == s) {
        self_preempted = true;
        break;
      }
    }
    if (self_preempted) break;
    AllocateSlots(s, num_new, &batch);
    ScheduledChunk c;
    c.request_id = s->id;
    c.num_tokens = num_new;
    c.start_pos = s->num_computed;
    c.compute_logits = s->num_computed + num_new == static_cast<int>(s->tokens.size());
    batch.chunks.push_back(c);
    scheduled_.push_back(s);
    budget -= num_new;
    ++i;
  }

  // Admit waiting sequences in FCFS order, unless this step had to preempt (no room).
  while (!preempted && budget > 0 && !waiting_.empty()) {
    Seq* s = waiting_.front();
    Admit a = TryAdmit(s, &budget, &batch, now);
    if (a == Admit::kStop) break;
  }

  // Pointers last: no vector of a scheduled seq changes until UpdateFromOutput.
  for (size_t k = 0; k < batch.chunks.size(); ++k) {
    Seq* s = scheduled_[k];
    ScheduledChunk& c = batch.chunks[k];
    c.tokens = s->tokens.data() + c.start_pos;
    c.block_table = s->blocks.data();
    c.num_blocks = static_cast<int>(s->blocks.size());
    batch.num_tokens += c.num_tokens;
    batch.num_logit_rows += c.compute_logits ? 1 : 0;
    if (m_prompt_computed_) {
      const int in_prompt =
          std::min(c.start_pos + c.num_tokens, s->group->num_prompt) - c.start_pos;
      if (in_prompt > 0) m_prompt_computed_->Inc(in_prompt);
    }
  }
  FlushOutputs();
  return batch;
}

void Scheduler::Fork(Seq* parent, TimePoint now) {
  // RUNNING -> RUNNING: the fork (checked before anything changes).
  if (!Transition(parent, RequestState::kRunning, now)) return;
  Group* g = parent->group;
  const int n = g->req.sampling.n;
  std::vector<std::unique_ptr<Seq>> sibs;
  for (int i = 0; i < n; ++i) {
    auto s = std::make_unique<Seq>();
    s->group = g;
    s->id = std::to_string(i) + "_" + g->req.request_id;
    s->index = i;
    s->state = RequestState::kRunning;
    s->tokens = parent->tokens;
    s->num_computed = parent->num_computed;
    s->blocks = parent->blocks;
    s->hashes = parent->hashes;
    s->num_cached_blocks = parent->num_cached_blocks;
    if (i > 0) {
      Status st = pool_->Share(s->blocks);  // the parent's own reference passes to sibling 0
      assert(st.ok());
      (void)st;
    }
    sibs.push_back(std::move(s));
  }
  auto it = std::find(running_.begin(), running_.end(), parent);
  assert(it != running_.end());
  const size_t pos = static_cast<size_t>(it - running_.begin());
  running_.erase(it);
  std::vector<Seq*> raw;
  for (auto& s : sibs) raw.push_back(s.get());
  running_.insert(running_.begin() + static_cast<std::ptrdiff_t>(pos), raw.begin(), raw.end());
  // running_slots_ is unchanged: the parent counted n.
  g->forked = true;
  g->num_unfinished = n;
  for (auto& owned : g->seqs) {
    if (owned.get() == parent) graveyard_.push_back(std::move(owned));
  }
  g->seqs = std::move(sibs);
}

void Scheduler::AppendToken(Seq* s, int32_t token, std::span<const float> row, TimePoint now) {
  Group* g = s->group;
  const SamplingParams& sp = g->req.sampling;
  s->tokens.push_back(token);
  if (sp.logprobs >= 0) s->logprobs.push_back(ComputeLogprobs(row, token, sp.logprobs));
  if (m_generation_tokens_) m_generation_tokens_->Inc();
  if (vllm_) vllm_->OnGenerationTokens(1);
  if (!g->first_token) {
    g->first_token = true;
    g->times.first_token = now;
    if (m_ttft_) m_ttft_->Observe(static_cast<double>(now - g->req.arrival_time) / kSecond);
    if (m_prompt_tokens_) m_prompt_tokens_->Inc(g->num_prompt);
    if (vllm_) vllm_->OnPromptTokens(g->num_prompt);
  } else if (s->last_token_time >= 0) {
    const double itl = static_cast<double>(now - s->last_token_time) / kSecond;
    if (m_itl_) m_itl_->Observe(itl);
    if (vllm_) vllm_->OnInterToken(itl);
  }
  // vLLM counts each of n siblings as a request: each has its own first token (all in the step
  // that forked them).
  if (vllm_ && s->num_output() == 1) {
    vllm_->OnFirstToken(static_cast<double>(now - g->req.arrival_time) / kSecond);
  }
  s->last_token_time = now;

  const int num_out = s->num_output();
  const bool min_reached = num_out > sp.min_tokens;  // this token is past min_tokens
  std::optional<RequestState> stop;
  if (min_reached && !sp.ignore_eos &&
      std::find(config_.eos_token_ids.begin(), config_.eos_token_ids.end(), token) !=
          config_.eos_token_ids.end()) {
    stop = RequestState::kFinishedStopped;
    // vLLM: the tokenizer's EOS has no stop_reason; the generation config's other EOS ids are
    // stop_token_ids and report themselves.
    if (token != config_.tokenizer_eos_token_id) s->stop_reason = token;
    s->drop_last_text = !sp.include_stop_str_in_output;
  }
  if (!stop && min_reached &&
      std::find(sp.stop_token_ids.begin(), sp.stop_token_ids.end(), token) !=
          sp.stop_token_ids.end()) {
    stop = RequestState::kFinishedStopped;
    s->stop_reason = token;
    s->drop_last_text = !sp.include_stop_str_in_output;
  }
  if (g->max_stop_len > 0) {
    const size_t old = s->text.size();
    if (!s->text_stream) s->text_stream.emplace(*config_.tokenizer, /*skip_special_tokens=*/true);
    const std::string delta = s->text_stream->Push(token);
    s->text += delta;
    s->text_end.push_back(std::string::npos);
    if (!delta.empty()) {  // every held-back token's text is final now
      std::fill(s->text_end.begin() + static_cast<std::ptrdiff_t>(s->text_final_tokens),
                s->text_end.end(), s->text.size());
      s->text_final_tokens = s->text_end.size();
    }
    if (!stop && min_reached && s->text.size() > old) {
      // vLLM's check: the first stop string (in the request's order) that ends in the new text.
      for (const std::string& st : sp.stop) {
        const size_t from = old >= st.size() - 1 ? old - (st.size() - 1) : 0;
        const size_t p = s->text.find(st, from);
        if (p == std::string::npos) continue;
        s->stop_reason = st;
        s->text_len = static_cast<int64_t>(sp.include_stop_str_in_output ? p + st.size() : p);
        stop = RequestState::kFinishedStopped;
        break;
      }
    }
  }
  if (!stop &&
      (num_out >= sp.max_tokens || static_cast<int>(s->tokens.size()) >= config_.max_model_len)) {
    stop = RequestState::kFinishedLength;
  }
  MarkDirty(g);
  if (stop) FinishSeq(s, *stop, now);
}

void Scheduler::RemoveFromQueues(Seq* s) {
  auto r = std::find(running_.begin(), running_.end(), s);
  if (r != running_.end()) {
    running_.erase(r);
    running_slots_ -= RunningSlots(*s);
  }
  auto w = std::find(waiting_.begin(), waiting_.end(), s);
  if (w != waiting_.end()) waiting_.erase(w);
  remote_wait_.erase(s->id);
}

void Scheduler::FinishSeq(Seq* s, RequestState state, TimePoint now) {
  Group* g = s->group;
  RemoveFromQueues(s);
  if (!Transition(s, state, now)) return;
  s->finish_reason = state == RequestState::kFinishedLength    ? "length"
                     : state == RequestState::kFinishedStopped ? "stop"
                     : state == RequestState::kFinishedAborted ? "abort"
                                                               : "error";
  if (s->num_output_final < 0) s->num_output_final = std::max(0, s->num_output());
  if (connector_ != nullptr &&
      (state == RequestState::kFinishedLength || state == RequestState::kFinishedStopped)) {
    KvConnector::FinishDecision d =
        connector_->RequestFinished(Info(*s), s->blocks, s->finish_reason, now);
    if (!d.kv_transfer_params.is_null()) g->kv_params_out = std::move(d.kv_transfer_params);
    if (d.hold_blocks) {
      Status st = pool_->Hold(s->id, s->blocks);
      if (st.ok()) {
        held_.insert(s->id);
      } else {
        KVB_LOG_ERROR("scheduler: cannot hold blocks of {}: {}", s->id, st.ToString());
      }
    }
  }
  ReleaseBlocks(&s->blocks);
  --g->num_unfinished;
  ObserveFinished(s, now);
  MarkDirty(g);
}

void Scheduler::ObserveFinished(Seq* s, TimePoint now) {
  Group* g = s->group;
  g->times.finished = now;
  auto m = m_finished_.find(s->finish_reason);
  if (m != m_finished_.end()) m->second->Inc();
  if (!vllm_) return;
  VllmMetrics::Finished f;
  f.arrival = g->req.arrival_time;
  f.scheduled = g->times.scheduled;
  f.first_token = g->times.first_token;
  f.finished = now;
  f.prompt_tokens = g->num_prompt;
  f.generation_tokens = std::max(0, s->num_output());
  f.finish_reason = s->finish_reason;
  vllm_->OnFinished(f);
}

void Scheduler::FailGroup(Group* g, const Status& error, TimePoint now, bool tell_connector) {
  g->error = error;
  for (auto& s : g->seqs) {
    if (IsFinishedState(s->state)) continue;
    RemoveFromQueues(s.get());
    // A failure the connector did not report itself reaches it as an abort, so it can drop its
    // state; it may keep the blocks like an abort (a send may still read them).
    if (tell_connector && connector_ != nullptr && connector_->RequestAborted(Info(*s), now)) {
      std::vector<int32_t>& d = draining_[s->id];
      d.insert(d.end(), s->blocks.begin(), s->blocks.end());
      s->blocks.clear();
    }
    ReleaseBlocks(&s->blocks);
    s->state = RequestState::kFinishedError;  // from any live state (see the table)
    s->finish_reason = "error";
    if (s->num_output_final < 0) s->num_output_final = std::max(0, s->num_output());
    --g->num_unfinished;
    ObserveFinished(s.get(), now);
  }
  MarkDirty(g);
}

bool Scheduler::Abort(const std::string& request_id, TimePoint now) {
  auto it = groups_.find(request_id);
  if (it == groups_.end()) return false;
  Group* g = it->second.get();
  for (auto& owned : g->seqs) {
    Seq* s = owned.get();
    if (IsFinishedState(s->state)) continue;
    RemoveFromQueues(s);
    bool keep = connector_ != nullptr && connector_->RequestAborted(Info(*s), now);
    if (keep) {
      std::vector<int32_t>& d = draining_[s->id];
      d.insert(d.end(), s->blocks.begin(), s->blocks.end());
      s->blocks.clear();
    } else {
      ReleaseBlocks(&s->blocks);
    }
    if (!Transition(s, RequestState::kFinishedAborted, now)) continue;
    s->finish_reason = "abort";
    if (s->num_output_final < 0) s->num_output_final = std::max(0, s->num_output());
    --g->num_unfinished;
    ObserveFinished(s, now);
  }
  MarkDirty(g);
  FlushOutputs();
  return true;
}

bool Scheduler::ReleaseDrainingOrHeld(const std::string& id) {
  auto d = draining_.find(id);
  if (d != draining_.end()) {
    ReleaseBlocks(&d->second);
    draining_.erase(d);
    return true;
  }
  if (held_.erase(id)) {
    Status st = pool_->ReleaseHold(id);
    if (!st.ok()) KVB_LOG_ERROR("scheduler: {}", st.ToString());
    return true;
  }
  return false;
}

void Scheduler::OnRemoteDone(Seq* s, TimePoint now) {
  Group* g = s->group;
  remote_wait_.erase(s->id);
  g->times.remote_kv_wait_end = now;
  // Everything but the last prompt token is now in the blocks; the last one is recomputed so
  // this engine produces the logits of the first token itself.
  s->num_computed = std::min(g->local_hit_tokens + g->match.num_external_tokens, g->num_prompt - 1);
  CacheComputedBlocks(s);
  if (!Transition(s, RequestState::kWaiting, now)) return;
  waiting_.push_front(s);
}

void Scheduler::OnRemoteFailed(Seq* s, const KvConnector::LoadFailure& f, TimePoint now) {
  Group* g = s->group;
  if (m_remote_load_failures_) m_remote_load_failures_->Inc();
  g->times.remote_kv_wait_end = now;
  KVB_LOG_WARN("scheduler: remote KV load of {} failed ({}): {}", s->id,
               f.recompute ? "recomputing" : "failing the request", f.status.ToString());
  if (!f.recompute) {
    Status err = f.status.ok() ? UnavailableError("remote KV load failed") : f.status;
    FailGroup(g, err, now);
    return;
  }
  remote_wait_.erase(s->id);
  // Keep the local prefix hit; the destination blocks hold nothing trustworthy.
  const int keep = g->local_hit_tokens / pool_->block_size();
  std::vector<int32_t> tail(s->blocks.begin() + keep, s->blocks.end());
  s->blocks.resize(keep);
  ReleaseBlocks(&tail);
  s->num_computed = g->local_hit_tokens;
  g->num_cached_tokens = g->local_hit_tokens;
  if (s->blocks.empty()) {
    // Admission treats an empty table as a fresh start (prefix lookup again).
    s->num_computed = 0;
  }
  if (!Transition(s, RequestState::kWaiting, now)) return;
  waiting_.push_front(s);
}

void Scheduler::PollConnector(TimePoint now) {
  if (connector_ == nullptr) return;
  KvConnector::StepReport rep = connector_->Poll(now);
  for (const std::string& id : rep.finished_sending) {
    if (!ReleaseDrainingOrHeld(id)) KVB_LOG_DEBUG("scheduler: finished_sending for unknown {}", id);
  }
  for (const std::string& id : rep.finished_recving) {
    if (ReleaseDrainingOrHeld(id)) continue;
    auto it = remote_wait_.find(id);
    if (it == remote_wait_.end()) {
      KVB_LOG_DEBUG("scheduler: finished_recving for unknown {}", id);
      continue;
    }
    OnRemoteDone(it->second, now);
  }
  for (const KvConnector::LoadFailure& f : rep.failed_recving) {
    if (ReleaseDrainingOrHeld(f.request_id)) continue;
    auto it = remote_wait_.find(f.request_id);
    if (it == remote_wait_.end()) {
      KVB_LOG_DEBUG("scheduler: failed_recving for unknown {}", f.request_id);
      continue;
    }
    OnRemoteFailed(it->second, f, now);
  }
  FlushOutputs();
}

Status Scheduler::UpdateFromOutput(const ScheduledBatch& batch, std::span<const float> logits,
                                   TimePoint now) {
  const size_t v = static_cast<size_t>(config_.vocab_size);
  if (logits.size() != static_cast<size_t>(batch.num_logit_rows) * v ||
      scheduled_.size() != batch.chunks.size()) {
    Status err = InvalidArgumentError("logits of " + std::to_string(logits.size()) +
                                      " floats for " + std::to_string(batch.num_logit_rows) +
                                      " rows of vocab " + std::to_string(v));
    FailBatch(batch, err, now);
    return err;
  }
  size_t row = 0;
  for (size_t k = 0; k < batch.chunks.size(); ++k) {
    Seq* s = scheduled_[k];
    const ScheduledChunk& c = batch.chunks[k];
    s->num_computed += c.num_tokens;
    CacheComputedBlocks(s);
    if (!c.compute_logits) continue;
    std::span<const float> r = logits.subspan(row * v, v);
    ++row;
    Group* g = s->group;
    std::vector<Seq*> targets;
    if (!g->forked) {
      Fork(s, now);
      for (auto& sib : g->seqs) targets.push_back(sib.get());
    } else {
      targets.push_back(s);
    }
    const SamplingParams& sp = g->req.sampling;
    for (Seq* t : targets) {
      std::span<const int32_t> banned;
      if (t->num_output() < sp.min_tokens) banned = g->min_tokens_banned;
      int32_t tok = SampleToken(r, sp, g->seed, t->index, static_cast<int>(t->tokens.size()),
                                banned, &scratch_);
      AppendToken(t, tok, r, now);
    }
  }
  scheduled_.clear();
  graveyard_.clear();
  FlushOutputs();
  return OkStatus();
}

void Scheduler::FailBatch(const ScheduledBatch& batch, const Status& error, TimePoint now) {
  std::vector<Group*> gs;
  for (Seq* s : scheduled_) {
    if (std::find(gs.begin(), gs.end(), s->group) == gs.end()) gs.push_back(s->group);
  }
  scheduled_.clear();
  for (Group* g : gs) FailGroup(g, error, now, /*tell_connector=*/true);
  graveyard_.clear();
  FlushOutputs();
}

void Scheduler::MarkDirty(Group* g) {
  if (!g->dirty) {
    g->dirty = true;
    dirty_.push_back(g);
  }
}

void Scheduler::FlushOutputs() {
  std::vector<std::string> done;
  for (Group* g : dirty_) {
    g->dirty = false;
    if (g->final_emitted) continue;
    RequestOutput out;
    out.request_id = g->req.request_id;
    out.num_prompt_tokens = g->num_prompt;
    out.num_cached_tokens = g->num_cached_tokens;
    const SamplingParams& sp = g->req.sampling;
    for (auto& owned : g->seqs) {
      Seq* s = owned.get();
      const bool fin = IsFinishedState(s->state);
      if (s->finish_emitted) continue;
      int upto;
      if (fin) {
        upto = s->num_output_final;
      } else {
        upto = s->num_output();
        if (g->max_stop_len > 1 && !sp.include_stop_str_in_output) {
          // Hold back tokens whose text could still start a stop string (vLLM holds back
          // max_stop_len - 1 characters; whole tokens here, so the deltas differ in where they
          // split, never in what they add up to). A kept stop string needs no hold-back: the
          // text is cut only past it, inside the finishing token.
          const size_t safe =
              s->text.size() >= g->max_stop_len - 1 ? s->text.size() - (g->max_stop_len - 1) : 0;
          upto = 0;
          while (upto < s->num_output() && s->text_end[upto] <= safe) ++upto;
        }
      }
      if (upto <= s->num_emitted && !fin) continue;
      CompletionOutput co;
      co.index = s->index;
      for (int i = s->num_emitted; i < upto; ++i) {
        co.new_token_ids.push_back(s->tokens[g->num_prompt + i]);
        if (sp.logprobs >= 0 && i < static_cast<int>(s->logprobs.size())) {
          co.new_logprobs.push_back(s->logprobs[i]);
        }
      }
      s->num_emitted = std::max(s->num_emitted, upto);
      if (fin) {
        co.finished = true;
        co.finish_reason = s->finish_reason;
        if (s->state == RequestState::kFinishedStopped) {
          co.stop_reason = s->stop_reason;
          if (s->drop_last_text) co.text_tokens = std::max(0, s->num_output_final - 1);
          co.text_len = s->text_len;
        }
        s->finish_emitted = true;
      }
      out.outputs.push_back(std::move(co));
    }
    if (g->num_unfinished == 0) {
      out.finished = true;
      out.error = g->error;
      out.kv_transfer_params = g->kv_params_out;
      out.times = std::move(g->times);
      if (connector_ != nullptr && !g->req.kv_transfer_params.is_null()) {
        out.times.kv_load = connector_->TakeLoadRecord(g->req.request_id);
      }
      g->final_emitted = true;
      done.push_back(g->req.request_id);
    }
    if (!out.outputs.empty() || out.finished) outputs_.push_back(std::move(out));
  }
  dirty_.clear();
  for (const std::string& id : done) groups_.erase(id);
}

std::vector<std::string> Scheduler::RequestIds() const {
  std::vector<std::string> ids;
  for (const auto& [id, g] : groups_) ids.push_back(id);
  std::sort(ids.begin(), ids.end());
  return ids;
}

std::vector<RequestOutput> Scheduler::TakeOutputs() {
  std::vector<RequestOutput> out;
  out.swap(outputs_);
  return out;
}

}  // namespace kvbridge
