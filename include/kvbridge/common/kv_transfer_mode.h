// kvbridge/common/kv_transfer_mode.h — the P/D transfer mode, one spelling for every module (the
// connector's cores and config, the proxy's flow and registry, the simulator).
//
//   ASSIGN_OR_RETURN(KvTransferMode m, ParseKvTransferMode("write"));
//   KvTransferModeName(m);  // "write"
//
// READ: the decode pulls the prompt's KV from the prefill after the prefill leg finished. WRITE:
// the prefill pushes each layer as it computes it, both legs run at once (DESIGN.md). A
// connector transfer's op is the mode too: a READ is posted by a READ-mode decode, a WRITE by a
// WRITE-mode prefill.
//
// Thread-safety: values and pure functions.
#pragma once

#include <cstdint>
#include <string_view>

#include "kvbridge/common/status.h"

namespace kvbridge {

enum class KvTransferMode : uint8_t { kRead = 0, kWrite = 1 };

/// "read" | "write".
std::string_view KvTransferModeName(KvTransferMode m);
/// "read" | "write"; InvalidArgument ("unknown KV mode 'x' (read|write)") otherwise.
Result<KvTransferMode> ParseKvTransferMode(std::string_view text);

}  // namespace kvbridge
