// tests/support/free_port.h — ports for multi-process tests, so `ctest -j2` never collides.
#pragma once

namespace kvbridge::testing {

/// Returns a TCP port on 127.0.0.1 that was free a moment ago (bound to port 0, read back,
/// closed). Ports are handed out from the kernel's ephemeral range, so parallel tests differ.
int FreePort();

}  // namespace kvbridge::testing
