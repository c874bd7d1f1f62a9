// kvbridge — the command-line front end. Thin: every command is a library call.
#include <CLI/CLI.hpp>
#include <map>
#include <memory>
#include <vector>

#include "apps/command_registry.h"
#include "kvbridge/common/logging.h"

namespace kvbridge::apps {
namespace {

struct Entry {
  std::string description;
  CommandSetup setup;
};

std::map<std::string, Entry>& Registry() {
  static auto* r = new std::map<std::string, Entry>();
  return *r;
}

}  // namespace

bool RegisterCommand(const std::string& name, const std::string& description, CommandSetup setup) {
  Registry()[name] = Entry{description, std::move(setup)};
  return true;
}

}  // namespace kvbridge::apps

int main(int argc, char** argv) {
  kvbridge::InitLogging();
  CLI::App app{
      "kvbridge — disaggregated prefill/decode LLM serving.\n"
      "Run `kvbridge <command> --help` for a command's options."};
  app.require_subcommand(1);
  std::string log_level;
  app.add_option("--log-level", log_level, "trace|debug|info|warn|error|off (env KVBRIDGE_LOG_LEVEL)");
  std::map<CLI::App*, kvbridge::apps::CommandMain> mains;
  for (auto& [name, entry] : kvbridge::apps::Registry()) {
    CLI::App* sub = app.add_subcommand(name, entry.description);
    mains[sub] = entry.setup(*sub);
  }
  CLI11_PARSE(app, argc, argv);
  if (!log_level.empty() && !kvbridge::SetLogLevel(log_level)) {
    std::fprintf(stderr, "error: unknown --log-level '%s'\n", log_level.c_str());
    return 2;
  }
  for (auto& [sub, run] : mains) {
    if (sub->parsed()) return run();
  }
  return 2;
}
