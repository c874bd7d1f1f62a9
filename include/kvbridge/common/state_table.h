// kvbridge/common/state_table.h — a state machine's legal transitions as a table of
// (from, to) pairs, and the one check every sans-IO core uses.
//
//   enum class PairState : uint8_t { kIdle, kReading, kFailed };
//   std::string_view PairStateName(PairState s);
//   // clang-format off
//   inline constexpr StateTransition<PairState> kPairTransitions[] = {
//     // from               to
//     {PairState::kIdle,    PairState::kReading},
//     {PairState::kIdle,    PairState::kFailed},
//     {PairState::kReading, PairState::kFailed},
//   };
//   // clang-format on
//   Status st = CheckStateTransition(kPairTransitions, "READ pair", from, to, PairStateName);
//   Status st = SetCheckedState(kPairTransitions, "READ pair", pair.state, to, PairStateName);
//
// The table is what is allowed; everything else is a FailedPrecondition naming the machine and
// both states (a bug in the core, returned to the caller, never only logged). The table does
// not depend on the enumerators' numeric values.
//
// Thread-safety: pure functions on values.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "kvbridge/common/status.h"

namespace kvbridge {

/// One legal transition of a state machine.
template <typename State>
struct StateTransition {
  State from;
  State to;
};

/// True when `from -> to` is a row of `table`.
template <typename State, size_t N>
constexpr bool IsStateTransition(const StateTransition<State> (&table)[N], State from, State to) {
  for (const StateTransition<State>& t : table) {
    if (t.from == from && t.to == to) return true;
  }
  return false;
}

/// OK when `from -> to` is a row of `table`; FailedPrecondition "illegal <machine> state
/// transition <from> -> <to>" otherwise.
template <typename State, size_t N, typename NameFn>
Status CheckStateTransition(const StateTransition<State> (&table)[N], std::string_view machine,
                            State from, State to, NameFn name) {
  if (IsStateTransition(table, from, to)) return OkStatus();
  return FailedPreconditionError("illegal " + std::string(machine) + " state transition " +
                                 std::string(name(from)) + " -> " + std::string(name(to)));
}

/// Sets `state` to `to` when `state -> to` is a row of `table`; otherwise leaves `state` as it
/// is and returns CheckStateTransition's FailedPrecondition.
template <typename State, size_t N, typename NameFn>
Status SetCheckedState(const StateTransition<State> (&table)[N], std::string_view machine,
                       State& state, State to, NameFn name) {
  Status st = CheckStateTransition(table, machine, state, to, name);
  if (st.ok()) state = to;
  return st;
}

}  // namespace kvbridge
