// The BPE model of tokenizer.json, as Hugging Face tokenizers' models::bpe (merge_word +
// Word::merge_all with dropout none): symbols are the characters of the word (with
// continuing_subword_prefix / end_of_word_suffix, byte_fallback to <0xNN>, unk fusing), then the
// pair of lowest merge rank is merged first, the leftmost on ties, until no pair has a rank.
#include <algorithm>
#include <mutex>
#include <queue>

#include "model/hf_internal.h"

namespace kvbridge::model_internal::hf {

size_t StringHash::operator()(std::string_view s) const noexcept {
  // FNV-1a over 8-byte words: fast for the short strings of a vocabulary.
  uint64_t h = 0xcbf29ce484222325ULL ^ s.size();
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t w;
    __builtin_memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0x100000001b3ULL;
    h ^= h >> 29;
  }
  uint64_t tail = 0;
  __builtin_memcpy(&tail, s.data() + i, s.size() - i);
  h = (h ^ tail) * 0x100000001b3ULL;
  h ^= h >> 32;
  return static_cast<size_t>(h);
}

namespace {
constexpr uint64_t kEmptyKey = ~0ULL;
inline uint64_t PairKey(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}
inline uint64_t MixKey(uint64_t k) {
  k ^= k >> 33;
  k *= 0xff51afd7ed558ccdULL;
  k ^= k >> 33;
  return k;
}
}  // namespace

const BpeModel::MergeValue* BpeModel::FindMerge(int32_t a, int32_t b) const {
  if (merge_slots_.empty()) return nullptr;
  const uint64_t key = PairKey(a, b);
  uint64_t i = MixKey(key) & merge_mask_;
  while (true) {
    const MergeSlot& slot = merge_slots_[i];
    if (slot.key == key) return &slot.value;
    if (slot.key == kEmptyKey) return nullptr;
    i = (i + 1) & merge_mask_;
  }
}

Result<std::unique_ptr<BpeModel>> BpeModel::Parse(const JsonCtx& ctx, const Json& j,
                                                  const std::string& path) {
  auto m = std::unique_ptr<BpeModel>(new BpeModel());
  if (j.contains("dropout") && !j["dropout"].is_null()) {
    if (!j["dropout"].is_number()) return ctx.Invalid(path + ".dropout", "expected a number");
    const double d = j["dropout"].get<double>();
    if (d != 0.0) {
      return ctx.Unsupported(path + ".dropout",
                             "(BPE dropout " + std::to_string(d) + ") is not supported");
    }
  }
  ASSIGN_OR_RETURN(std::string unk, OptStringField(ctx, j, path, "unk_token", ""));
  ASSIGN_OR_RETURN(m->continuing_subword_prefix_,
                   OptStringField(ctx, j, path, "continuing_subword_prefix", ""));
  ASSIGN_OR_RETURN(m->end_of_word_suffix_, OptStringField(ctx, j, path, "end_of_word_suffix", ""));
  m->has_prefix_ = !m->continuing_subword_prefix_.empty();
  m->has_suffix_ = !m->end_of_word_suffix_.empty();
  ASSIGN_OR_RETURN(m->fuse_unk_, OptBoolField(ctx, j, path, "fuse_unk", false));
  ASSIGN_OR_RETURN(m->byte_fallback_, OptBoolField(ctx, j, path, "byte_fallback", false));
  ASSIGN_OR_RETURN(m->ignore_merges_, OptBoolField(ctx, j, path, "ignore_merges", false));

  ASSIGN_OR_RETURN(const Json* vocab, Field(ctx, j, path, "vocab"));
  if (!vocab->is_object()) return ctx.Invalid(path + ".vocab", "expected an object");
  m->vocab_.reserve(vocab->size());
  int64_t max_id = -1;
  for (auto it = vocab->begin(); it != vocab->end(); ++it) {
    if (!it->is_number_integer() || it->get<int64_t>() < 0 ||
        it->get<int64_t>() > std::numeric_limits<int32_t>::max() / 2) {
      return ctx.Invalid(path + ".vocab[\"" + it.key() + "\"]", "expected an id >= 0");
    }
    const int64_t id = it->get<int64_t>();
    m->vocab_[it.key()] = static_cast<int32_t>(id);
    max_id = std::max(max_id, id);
  }
  if (max_id >= 16 * 1024 * 1024) return ctx.Invalid(path + ".vocab", "ids above 2^24");
  m->id_to_token_.assign(static_cast<size_t>(max_id + 1), std::string());
  for (const auto& [tok, id] : m->vocab_) m->id_to_token_[static_cast<size_t>(id)] = tok;
  m->char_ids_.assign(0x10000, -1);
  for (const auto& [tok, id] : m->vocab_) {
    if (tok.empty() || !IsValidUtf8(tok)) continue;
    int len = 0;
    const char32_t c = DecodeUtf8(tok, 0, &len);
    if (static_cast<size_t>(len) == tok.size() && c < 0x10000) m->char_ids_[c] = id;
  }
  if (!unk.empty()) {
    auto it = m->vocab_.find(unk);
    // Rust only fails when the unk token is needed; it is then an error too.
    if (it != m->vocab_.end()) m->unk_id_ = it->second;
  }

  ASSIGN_OR_RETURN(const Json* merges, Field(ctx, j, path, "merges"));
  const std::string mpath = path + ".merges";
  if (!merges->is_array()) return ctx.Invalid(mpath, "expected an array");
  size_t cap = 16;
  while (cap < merges->size() * 2 + 2) cap <<= 1;
  m->merge_slots_.assign(cap, MergeSlot{kEmptyKey, MergeValue{0, 0}});
  m->merge_mask_ = cap - 1;
  const size_t prefix_len = m->continuing_subword_prefix_.size();
  std::string joined;
  for (size_t r = 0; r < merges->size(); ++r) {
    const Json& e = (*merges)[r];
    const std::string epath = mpath + "[" + std::to_string(r) + "]";
    std::string_view a, b;
    std::string s;
    if (e.is_string()) {
      s = e.get<std::string>();
      const size_t sp = s.find(' ');
      if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos) {
        return ctx.Invalid(epath, "expected \"left right\" (two tokens and one space)");
      }
      a = std::string_view(s).substr(0, sp);
      b = std::string_view(s).substr(sp + 1);
    } else if (e.is_array() && e.size() == 2 && e[0].is_string() && e[1].is_string()) {
      a = e[0].get_ref<const std::string&>();
      b = e[1].get_ref<const std::string&>();
    } else {
      return ctx.Invalid(epath, "expected \"left right\" or [left, right]");
    }
    auto ia = m->vocab_.find(a);
    auto ib = m->vocab_.find(b);
    if (ia == m->vocab_.end()) {
      return ctx.Invalid(epath, "token \"" + std::string(a) + "\" is not in the vocab");
    }
    if (ib == m->vocab_.end()) {
      return ctx.Invalid(epath, "token \"" + std::string(b) + "\" is not in the vocab");
    }
    joined.assign(a);
    if (prefix_len > 0 && b.starts_with(m->continuing_subword_prefix_)) {
      joined.append(b.substr(prefix_len));
    } else {
      joined.append(b);
    }
    auto inew = m->vocab_.find(joined);
    if (inew == m->vocab_.end()) {
      return ctx.Invalid(epath, "merged token \"" + joined + "\" is not in the vocab");
    }
    // Later duplicates overwrite earlier ones (Rust collects the merges into a HashMap).
    const uint64_t key = PairKey(ia->second, ib->second);
    uint64_t i = MixKey(key) & m->merge_mask_;
    while (m->merge_slots_[i].key != kEmptyKey && m->merge_slots_[i].key != key) {
      i = (i + 1) & m->merge_mask_;
    }
    m->merge_slots_[i] = MergeSlot{key, MergeValue{static_cast<uint32_t>(r), inew->second}};
  }
  return m;
}

Status BpeModel::InitialSymbols(std::string_view w, std::vector<int32_t>* ids,
                                std::vector<uint32_t>* lens) const {
  // Rust merge_word: one symbol per character (prefix on all but the first, suffix on the
  // last); unknown characters go to byte fallback, else to unk (fused when fuse_unk).
  int32_t pending_unk = -1;
  uint32_t pending_unk_len = 0;
  std::string buf;
  size_t i = 0;
  while (i < w.size()) {
    const size_t clen = static_cast<size_t>(Utf8Len(static_cast<uint8_t>(w[i])));
    const bool is_first = i == 0;
    const bool is_last = i + clen >= w.size();
    std::string_view s = w.substr(i, clen);
    if ((!is_first && has_prefix_) || (is_last && has_suffix_)) {
      buf.clear();
      if (!is_first && has_prefix_) buf += continuing_subword_prefix_;
      buf += s;
      if (is_last && has_suffix_) buf += end_of_word_suffix_;
      s = buf;
    }
    i += clen;
    if (s.size() == clen && clen <= 3) {
      // Fast path: a plain character (no prefix/suffix) of the BMP.
      int len = 0;
      const char32_t c = DecodeUtf8(s, 0, &len);
      const int32_t id = c < char_ids_.size() ? char_ids_[c] : -1;
      if (id >= 0) {
        if (pending_unk >= 0) {
          ids->push_back(pending_unk);
          lens->push_back(pending_unk_len);
          pending_unk = -1;
        }
        ids->push_back(id);
        lens->push_back(static_cast<uint32_t>(clen));
        continue;
      }
    }
    auto it = vocab_.find(s);
    if (it != vocab_.end()) {
      if (pending_unk >= 0) {
        ids->push_back(pending_unk);
        lens->push_back(pending_unk_len);
        pending_unk = -1;
      }
      ids->push_back(it->second);
      lens->push_back(static_cast<uint32_t>(clen));
      continue;
    }
    if (byte_fallback_) {
      bool all = true;
      const size_t mark = ids->size();
      for (unsigned char byte : s) {
        static constexpr char kHex[] = "0123456789ABCDEF";
        const char code[7] = {'<', '0', 'x', kHex[byte >> 4], kHex[byte & 15], '>', 0};
        auto bt = vocab_.find(std::string_view(code, 6));
        if (bt == vocab_.end()) {
          all = false;
          break;
        }
        ids->push_back(bt->second);
        lens->push_back(1);
      }
      if (all) continue;
      ids->resize(mark);
      lens->resize(mark);
    }
    if (unk_id_ < 0) {
      return InvalidArgumentError("BPE: no token for \"" + std::string(s) +
                                  "\" and the model has no unk_token in its vocab");
    }
    if (pending_unk >= 0 && fuse_unk_) {
      pending_unk_len += static_cast<uint32_t>(clen);
    } else {
      if (pending_unk >= 0) {
        ids->push_back(pending_unk);
        lens->push_back(pending_unk_len);
      }
      pending_unk = unk_id_;
      pending_unk_len = static_cast<uint32_t>(clen);
    }
  }
  if (pending_unk >= 0) {
    ids->push_back(pending_unk);
    lens->push_back(pending_unk_len);
  }
  return OkStatus();
}

void BpeModel::MergeWord(std::string_view, std::vector<int32_t>* ids) const {
  // Word::merge_all: a min-heap of (rank, pos), lowest rank first, leftmost on ties. Each
  // position remembers the merge of the pair it starts (rank, new id), refreshed whenever the
  // pair changes; a heap entry whose rank is no longer its position's is stale (ranks are
  // unique per pair).
  const int n = static_cast<int>(ids->size());
  if (n < 2) return;
  struct Sym {
    int32_t c;
    int prev, next;
    uint32_t rank;  // of the pair (this, next); kNone when it has no merge
    int32_t new_id;
  };
  static constexpr uint32_t kNone = ~0u;
  thread_local std::vector<Sym> sym;
  thread_local std::vector<uint64_t> heap;  // rank << 32 | pos, smallest first
  sym.resize(static_cast<size_t>(n));
  heap.clear();
  auto entry = [](uint32_t rank, int pos) {
    return (static_cast<uint64_t>(rank) << 32) | static_cast<uint32_t>(pos);
  };
  for (int k = 0; k < n; ++k) sym[k] = Sym{(*ids)[k], k - 1, k + 1 < n ? k + 1 : -1, kNone, 0};
  for (int k = 0; k + 1 < n; ++k) {
    if (const MergeValue* mv = FindMerge(sym[k].c, sym[k + 1].c)) {
      sym[k].rank = mv->rank;
      sym[k].new_id = mv->new_id;
      heap.push_back(entry(mv->rank, k));
    }
  }
  std::greater<uint64_t> cmp;
  std::make_heap(heap.begin(), heap.end(), cmp);
  auto refresh = [&](int pos) {  // the pair starting at pos changed
    Sym& s = sym[pos];
    const MergeValue* mv = s.next >= 0 ? FindMerge(s.c, sym[s.next].c) : nullptr;
    if (mv == nullptr) {
      s.rank = kNone;
      return;
    }
    s.rank = mv->rank;
    s.new_id = mv->new_id;
    heap.push_back(entry(mv->rank, pos));
    std::push_heap(heap.begin(), heap.end(), cmp);
  };
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), cmp);
    const uint64_t top = heap.back();
    heap.pop_back();
    const uint32_t rank = static_cast<uint32_t>(top >> 32);
    const int pos = static_cast<int>(static_cast<uint32_t>(top));
    Sym& cur = sym[pos];
    if (cur.c < 0 || cur.next < 0 || cur.rank != rank) continue;  // removed or stale
    const int next_pos = cur.next;
    cur.c = cur.new_id;
    sym[next_pos].c = -1;
    cur.next = sym[next_pos].next;
    if (cur.next >= 0) sym[cur.next].prev = pos;
    if (cur.prev >= 0) refresh(cur.prev);
    refresh(pos);
  }
  ids->clear();
  for (int k = 0; k >= 0; k = sym[k].next) ids->push_back(sym[k].c);
}

Status BpeModel::Tokenize(std::string_view word, std::vector<int32_t>* out) const {
  if (word.empty()) return OkStatus();
  if (ignore_merges_) {
    auto it = vocab_.find(word);
    if (it != vocab_.end()) {
      out->push_back(it->second);
      return OkStatus();
    }
  }
  const bool cacheable = word.size() < kCacheMaxWord;
  if (cacheable) {
    std::shared_lock lock(cache_mu_);
    auto it = cache_.find(word);
    if (it != cache_.end()) {
      out->insert(out->end(), it->second.begin(), it->second.end());
      return OkStatus();
    }
  }
  std::vector<int32_t> ids;
  std::vector<uint32_t> lens;
  ids.reserve(word.size());
  lens.reserve(word.size());
  RETURN_IF_ERROR(InitialSymbols(word, &ids, &lens));
  MergeWord(word, &ids);
  out->insert(out->end(), ids.begin(), ids.end());
  if (cacheable) {
    std::unique_lock lock(cache_mu_);
    if (cache_.size() < kCacheCapacity) cache_.emplace(std::string(word), std::move(ids));
  }
  return OkStatus();
}

}  // namespace kvbridge::model_internal::hf
