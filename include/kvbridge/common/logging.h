// kvbridge/common/logging.h — logging through spdlog.
//
//   KVB_LOG_INFO("engine started: {} blocks", n);
//
// Level from the KVBRIDGE_LOG_LEVEL environment variable (trace|debug|info|warn|error|off),
// default info; SetLogLevel overrides it. Thread-safe.
#pragma once

#include <spdlog/spdlog.h>

#include <string_view>

namespace kvbridge {

/// Applies KVBRIDGE_LOG_LEVEL (once; later calls are cheap). Called by the CLI at start.
void InitLogging();
/// Sets the level by name; unknown names leave it unchanged and return false.
bool SetLogLevel(std::string_view level);

}  // namespace kvbridge

#define KVB_LOG_TRACE(...) SPDLOG_TRACE(__VA_ARGS__)
#define KVB_LOG_DEBUG(...) SPDLOG_DEBUG(__VA_ARGS__)
#define KVB_LOG_INFO(...) SPDLOG_INFO(__VA_ARGS__)
#define KVB_LOG_WARN(...) SPDLOG_WARN(__VA_ARGS__)
#define KVB_LOG_ERROR(...) SPDLOG_ERROR(__VA_ARGS__)
