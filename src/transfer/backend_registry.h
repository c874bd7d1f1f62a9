// src/transfer/backend_registry.h — the one place that knows every backend implementation.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/transfer/backend.h"

namespace kvbridge::transfer {

/// Creates backend `name`; NotFound when not compiled in.
Result<std::unique_ptr<Backend>> MakeBackend(std::string_view name, const BackendContext& ctx);

}  // namespace kvbridge::transfer
