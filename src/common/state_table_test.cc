#include "kvbridge/common/state_table.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string_view>

namespace kvbridge {
namespace {

// Enumerators deliberately out of numeric order: the table, not the values, decides.
enum class Door : uint8_t { kOpen = 7, kClosed = 1, kLocked = 4 };

std::string_view DoorName(Door d) {
  switch (d) {
    case Door::kOpen:
      return "open";
    case Door::kClosed:
      return "closed";
    case Door::kLocked:
      return "locked";
  }
  return "?";
}

// clang-format off
constexpr StateTransition<Door> kDoorTransitions[] = {
  // from           to
  {Door::kOpen,     Door::kClosed},
  {Door::kClosed,   Door::kOpen},
  {Door::kClosed,   Door::kLocked},
  {Door::kLocked,   Door::kClosed},
};
// clang-format on

TEST(StateTable, RowsAreLegalEverythingElseIsAFailedPreconditionNamingBothStates) {
  static_assert(IsStateTransition(kDoorTransitions, Door::kClosed, Door::kLocked));
  static_assert(!IsStateTransition(kDoorTransitions, Door::kOpen, Door::kLocked));
  EXPECT_TRUE(
      CheckStateTransition(kDoorTransitions, "door", Door::kOpen, Door::kClosed, DoorName).ok());
  EXPECT_TRUE(
      CheckStateTransition(kDoorTransitions, "door", Door::kLocked, Door::kClosed, DoorName).ok());
  const Status skip =
      CheckStateTransition(kDoorTransitions, "door", Door::kOpen, Door::kLocked, DoorName);
  EXPECT_EQ(skip.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(skip.message(), "illegal door state transition open -> locked");
  // A self-transition is not implied: it must be a row.
  const Status stay =
      CheckStateTransition(kDoorTransitions, "door", Door::kLocked, Door::kLocked, DoorName);
  EXPECT_EQ(stay.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(stay.message(), "illegal door state transition locked -> locked");
}

TEST(StateTable, SetCheckedStateMovesOnlyAlongARow) {
  Door d = Door::kOpen;
  EXPECT_TRUE(SetCheckedState(kDoorTransitions, "door", d, Door::kClosed, DoorName).ok());
  EXPECT_EQ(d, Door::kClosed);
  EXPECT_TRUE(SetCheckedState(kDoorTransitions, "door", d, Door::kLocked, DoorName).ok());
  EXPECT_EQ(d, Door::kLocked);
  const Status st = SetCheckedState(kDoorTransitions, "door", d, Door::kOpen, DoorName);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_EQ(st.message(), "illegal door state transition locked -> open");
  EXPECT_EQ(d, Door::kLocked);  // an illegal move changes nothing
}

}  // namespace
}  // namespace kvbridge
