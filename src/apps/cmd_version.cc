#include <cstdio>

#include "apps/command_registry.h"

namespace {
const bool kRegistered = kvbridge::apps::RegisterCommand(
    "version", "Print the kvbridge version", [](CLI::App&) -> kvbridge::apps::CommandMain {
      return [] {
        std::printf("kvbridge 0.1.0\n");
        return 0;
      };
    });
}  // namespace
