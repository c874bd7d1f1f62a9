#include "kvbridge/common/status.h"

#include <gtest/gtest.h>

namespace kvbridge {
namespace {

Result<int> Half(int x) {
  if (x % 2) return InvalidArgumentError("odd: " + std::to_string(x));
  return x / 2;
}

Result<int> Quarter(int x) {
  ASSIGN_OR_RETURN(int h, Half(x));
  ASSIGN_OR_RETURN(int q, Half(h));
  return q;
}

Status CheckEven(int x) {
  RETURN_IF_ERROR(Half(x).status());
  return OkStatus();
}

TEST(Status, OkAndErrorStrings) {
  EXPECT_EQ(OkStatus().ToString(), "OK");
  EXPECT_EQ(NotFoundError("x").ToString(), "NOT_FOUND: x");
  EXPECT_EQ(UnavailableError("peer").WithPrefix("agent 3").message(), "agent 3: peer");
}

TEST(Status, MacrosPropagateTheFirstError) {
  EXPECT_EQ(*Quarter(12), 3);
  EXPECT_EQ(Quarter(6).status().message(), "odd: 3");
  EXPECT_EQ(CheckEven(5).code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(CheckEven(4).ok());
}

TEST(Status, ErrnoMapsToCanonicalCodes) {
  EXPECT_EQ(ErrnoToStatus(ECONNREFUSED, "connect").code(), StatusCode::kUnavailable);
  EXPECT_EQ(ErrnoToStatus(ENOENT, "open").code(), StatusCode::kNotFound);
}

}  // namespace
}  // namespace kvbridge
