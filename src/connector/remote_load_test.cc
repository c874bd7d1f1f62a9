#include "connector/remote_load.h"

#include <gtest/gtest.h>

#include <map>
#include <string>
#include <utility>

namespace kvbridge {
namespace {

TEST(RemoteLoad, ExternalPromptTokensLeavesTheLastTokenAndTheLocalHit) {
  EXPECT_EQ(ExternalPromptTokens(40, 0), 39);
  EXPECT_EQ(ExternalPromptTokens(40, 16), 23);
  EXPECT_EQ(ExternalPromptTokens(33, 32), 0);  // only the last token is left: computed here
  EXPECT_EQ(ExternalPromptTokens(16, 16), 0);  // never negative
  EXPECT_EQ(ExternalPromptTokens(1, 0), 0);
}

TEST(RemoteLoad, BlockSpanRunsFromPastTheHitToTheLastLoadedToken) {
  BlockSpan s = ExternalBlockSpan(16, 0, 39);
  EXPECT_EQ(s.first, 0);
  EXPECT_EQ(s.end, 3);
  s = ExternalBlockSpan(16, 32, 7);  // tokens 32..38: block 2 only
  EXPECT_EQ(s.first, 2);
  EXPECT_EQ(s.end, 3);
  s = ExternalBlockSpan(16, 16, 16);  // tokens 16..31 fill block 1 exactly
  EXPECT_EQ(s.first, 1);
  EXPECT_EQ(s.end, 2);
}

TEST(RemoteLoad, AllocationCoversLoad) {
  const BlockSpan s = ExternalBlockSpan(16, 16, 23);  // blocks [1, 3)
  EXPECT_TRUE(AllocationCoversLoad(s, 16, 23, 3));
  EXPECT_TRUE(AllocationCoversLoad(s, 16, 23, 4));
  EXPECT_FALSE(AllocationCoversLoad(s, 16, 23, 2));  // the table stops short
  EXPECT_FALSE(AllocationCoversLoad(s, 16, 0, 3));   // nothing to load
  EXPECT_FALSE(AllocationCoversLoad(s, -16, 23, 3));
  EXPECT_EQ(UncoveredLoadError(2).code(), StatusCode::kInternal);
  EXPECT_EQ(UncoveredLoadError(2).message(),
            "block table of 2 blocks does not cover the remote load");
}

TEST(RemoteLoad, CheckNewRemoteLoad) {
  std::map<std::string, int> requests = {{"r1", 0}};
  std::map<std::pair<std::string, std::string>, std::string> by_transfer = {{{"p0", "t1"}, "r1"}};
  EXPECT_TRUE(CheckNewRemoteLoad(requests, by_transfer, "r2", {"p0", "t2"}, 32, 16).ok());
  // The same transfer id from another prefill engine is another transfer.
  EXPECT_TRUE(CheckNewRemoteLoad(requests, by_transfer, "r2", {"p1", "t1"}, 0, 16).ok());

  Status st = CheckNewRemoteLoad(requests, by_transfer, "r2", {"p0", "t2"}, 8, 16);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(st.message(), "local prefix hit must be a non-negative multiple of block_size");
  EXPECT_EQ(CheckNewRemoteLoad(requests, by_transfer, "r2", {"p0", "t2"}, -16, 16).code(),
            StatusCode::kInvalidArgument);
  st = CheckNewRemoteLoad(requests, by_transfer, "r1", {"p0", "t2"}, 0, 16);
  EXPECT_EQ(st.code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(st.message(), "request r1 is loading");
  st = CheckNewRemoteLoad(requests, by_transfer, "r2", {"p0", "t1"}, 0, 16);
  EXPECT_EQ(st.code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(st.message(), "transfer t1 is already being loaded");
  // The prefix check comes first.
  EXPECT_EQ(CheckNewRemoteLoad(requests, by_transfer, "r1", {"p0", "t1"}, 8, 16).code(),
            StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvbridge
