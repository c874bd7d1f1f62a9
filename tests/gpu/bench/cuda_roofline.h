// The roofline ceilings measured on the bench's GPU (cuda_roofline.cu).
#pragma once

#include <cstddef>
#include <string>

namespace kvbridge::bench {

/// Read bandwidth in bytes/s: best of `reps` passes of a read-only streaming kernel over `bytes`
/// (>= 4 GiB for the ceiling) of device memory. On a CUDA error: 0, *error set.
double MeasureReadBandwidth(size_t bytes, int reps, std::string* error);
/// Dense bf16 mma.sync rate in FLOP/s: best of `reps` runs of a register-only tensor-core loop.
double MeasureMmaPeak(int reps, std::string* error);

}  // namespace kvbridge::bench
