#include "transfer/stream_copy.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace kvbridge::transfer {
namespace {

// Every byte of every length/alignment mix around the streaming path's edges (the 1 KiB floor,
// 64-byte lines, 256-byte steps): the copy lands exactly and nothing outside it is touched.
TEST(StreamCopy, EveryByteAtEveryAlignmentAndLength) {
  const size_t lengths[] = {0,    1,    63,   64,   65,   255,   1023,      1024,
                            1025, 1087, 4095, 4096, 4097, 16448, 65536 + 37};
  std::vector<uint8_t> src(70000), dst(70000 + 256), want(dst.size());
  for (size_t i = 0; i < src.size(); ++i) src[i] = static_cast<uint8_t>(i * 131 + 7);
  for (size_t n : lengths) {
    for (size_t so : {0, 1, 17, 64}) {
      for (size_t doff : {0, 1, 31, 63, 64, 100}) {
        std::memset(dst.data(), 0xAB, dst.size());
        std::memset(want.data(), 0xAB, want.size());
        for (size_t i = 0; i < n; ++i) want[doff + i] = src[so + i];
        StreamCopy(dst.data() + doff, src.data() + so, n);
        StreamCopyFence();
        ASSERT_EQ(std::memcmp(dst.data(), want.data(), dst.size()), 0)
            << "n=" << n << " src+" << so << " dst+" << doff;
      }
    }
  }
}

TEST(StreamCopy, ReportsWhetherItStreams) {
  // Informational: the figures in docs/transfer.md are for a CPU where this is true.
  std::printf("streaming stores: %s\n", StreamCopyUsesStreamingStores() ? "yes (AVX-512F)" : "no");
  SUCCEED();
}

}  // namespace
}  // namespace kvbridge::transfer
