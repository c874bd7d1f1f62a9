// Bulk host copies for the one-sided transfer paths (shm): memcpy's contract, with streaming
// (non-temporal) stores for the bulk of large copies where the CPU has them.
//
// Why: a KV transfer moves many scattered blocks whose destination is not read again before it
// leaves the cache. Regular stores read every destination line first (read-for-ownership) and
// evict useful lines; streaming stores write whole lines straight to memory. Measured on the
// development VM (issue 28, docs/transfer.md): scattered 4-256 KiB block copies with AVX-512
// streaming stores run 1.2-2.3 x glibc memcpy of the same blocks, where plain memcpy per block
// is 0.6-1.0 x one contiguous memcpy.
#pragma once

#include <cstddef>

namespace kvbridge::transfer {

/// True when StreamCopy uses streaming stores on this CPU (x86-64 with AVX-512F); otherwise
/// StreamCopy is memcpy. Thread-safe.
bool StreamCopyUsesStreamingStores();

/// Copies `n` bytes from `src` to `dst` (no overlap, any alignment, n may be 0), as memcpy.
/// With streaming stores the bytes are weakly ordered until StreamCopyFence(): call it on the
/// copying thread before publishing that the copy is done (a release store, a mutex, a socket
/// write). Thread-safe.
void StreamCopy(void* dst, const void* src, size_t n);

/// Orders every streaming store of this thread before its later stores (x86 `sfence`; a no-op
/// where StreamCopy is memcpy).
void StreamCopyFence();

}  // namespace kvbridge::transfer
