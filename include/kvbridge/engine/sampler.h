// kvbridge/engine/sampler.h — choosing the next token from one row of fp32 logits.
//
// Greedy (temperature 0), temperature, top_k, top_p, banned ids (min_tokens), and log-probs.
// Randomness is counter-based: the uniform draw for a token is a pure function of
// (seed, sibling index, token position) — SplitMix64 mixing (Steele et al., "Fast splittable
// pseudorandom number generators", OOPSLA 2014) — so a seeded request samples the same tokens
// whatever else shares its batch, after preemption, and across runs and hosts.
//
//   std::vector<double> scratch;
//   int32_t tok = SampleToken(logits_row, params, seed, /*sibling=*/0, /*position=*/17, {},
//   &scratch); TokenLogprob lp = ComputeLogprobs(logits_row, tok, /*top_k=*/5);
//
// Tie order is deterministic everywhere: higher value first, then lower token id.
// Thread-safety: pure functions (scratch is the caller's).
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvbridge/common/status.h"
#include "kvbridge/engine/request.h"

namespace kvbridge {

/// SplitMix64 finalizer (bijective 64-bit mix).
uint64_t SplitMix64(uint64_t x);
/// Uniform double in [0, 1) from the key (53 random bits).
double UniformFromKey(uint64_t seed, uint64_t sibling, uint64_t position);

/// Checks `params` against the vocabulary: n >= 1, max_tokens >= 1, 0 <= min_tokens <=
/// max_tokens, temperature >= 0 and finite, top_p in (0, 1], top_k >= 0, logprobs in
/// [-1, vocab_size], stop_token_ids in [0, vocab_size), no empty stop string.
/// Errors: InvalidArgument naming the field.
Status ValidateSamplingParams(const SamplingParams& params, int vocab_size);

/// Samples one token id from `logits` (vocab_size values). Banned ids (min_tokens masking of
/// EOS / stop_token_ids) are never chosen unless every id is banned or non-finite, in which
/// case the lowest id wins. temperature == 0: argmax. Otherwise softmax(logits / temperature)
/// restricted to the top_k highest, then to the smallest most-likely prefix whose mass reaches
/// top_p, sampled by inverse CDF with UniformFromKey(seed, sibling, position).
int32_t SampleToken(std::span<const float> logits, const SamplingParams& params, uint64_t seed,
                    int sibling, int position, std::span<const int32_t> banned,
                    std::vector<double>* scratch);

/// log_softmax(logits) of `token` plus the `top_k` most likely ids (most likely first, ties by
/// lower id). Computed in double, reported as float. NaN logits count as -inf.
TokenLogprob ComputeLogprobs(std::span<const float> logits, int32_t token, int top_k);

}  // namespace kvbridge
