#include "transfer/stream_copy.h"

#include <cstdint>
#include <cstring>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace kvbridge::transfer {
namespace {

// Below this a copy is memcpy: a few lines gain nothing from bypassing the cache, and the
// destination of a short copy is likelier to be read soon.
constexpr size_t kStreamMinBytes = 1024;

#if defined(__x86_64__)
// `d` is 64-byte aligned, `n` a multiple of 64. Four lines per step: the loads of a step are
// independent, so they overlap in the memory system.
__attribute__((target("avx512f"))) void StreamLines(uint8_t* d, const uint8_t* s, size_t n) {
  size_t i = 0;
  for (; i + 256 <= n; i += 256) {
    const __m512i a = _mm512_loadu_si512(s + i);
    const __m512i b = _mm512_loadu_si512(s + i + 64);
    const __m512i c = _mm512_loadu_si512(s + i + 128);
    const __m512i e = _mm512_loadu_si512(s + i + 192);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), a);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 64), b);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 128), c);
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i + 192), e);
  }
  for (; i < n; i += 64) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(d + i), _mm512_loadu_si512(s + i));
  }
}

bool Detect() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f");
}
#endif

}  // namespace

bool StreamCopyUsesStreamingStores() {
#if defined(__x86_64__)
  static const bool yes = Detect();
  return yes;
#else
  return false;
#endif
}

void StreamCopy(void* dst, const void* src, size_t n) {
#if defined(__x86_64__)
  if (n >= kStreamMinBytes && StreamCopyUsesStreamingStores()) {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    // Unaligned head and tail (a sub-block head range can start anywhere) with memcpy.
    const size_t head = (64 - (reinterpret_cast<uintptr_t>(d) & 63)) & 63;
    const size_t bulk = (n - head) & ~size_t{63};
    std::memcpy(d, s, head);
    StreamLines(d + head, s + head, bulk);
    std::memcpy(d + head + bulk, s + head + bulk, n - head - bulk);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

void StreamCopyFence() {
#if defined(__x86_64__)
  if (StreamCopyUsesStreamingStores()) _mm_sfence();
#endif
}

}  // namespace kvbridge::transfer
