#include "kvbridge/common/logging.h"

#include <cstdlib>
#include <mutex>
#include <string>

namespace kvbridge {

bool SetLogLevel(std::string_view level) {
  auto lvl = spdlog::level::from_str(std::string(level));
  if (lvl == spdlog::level::off && level != "off") return false;
  spdlog::set_level(lvl);
  return true;
}

void InitLogging() {
  static std::once_flag once;
  std::call_once(once, [] {
    spdlog::set_pattern("[%Y-%m-%d %H:%M:%S.%e] [%^%l%$] [%t] %v");
    if (const char* env = std::getenv("KVBRIDGE_LOG_LEVEL")) SetLogLevel(env);
  });
}

}  // namespace kvbridge
