// src/apps/command_registry.h — how each `kvbridge <command>` plugs into the CLI.
//
// Each command lives in its own file (cmd_<name>.cc) and registers itself at static-init time:
//
//   static const bool kRegistered = kvbridge::apps::RegisterCommand(
//       "serve", "Serve one engine with the OpenAI API", [](CLI::App& sub) {
//         auto opts = std::make_shared<ServeOptions>();
//         sub.add_option("model_dir", opts->model_dir)->required();
//         return [opts]() -> int { return RunServe(*opts); };
//       });
//
// The setup function declares the command's options and returns the function that runs it
// (its return value is the process exit code). Files are linked straight into the executable,
// so the registrations are never dropped.
#pragma once

#include <CLI/CLI.hpp>
#include <functional>
#include <string>

namespace kvbridge::apps {

using CommandMain = std::function<int()>;
using CommandSetup = std::function<CommandMain(CLI::App&)>;

/// Registers `kvbridge <name>`; returns true so it can initialise a static.
bool RegisterCommand(const std::string& name, const std::string& description, CommandSetup setup);

}  // namespace kvbridge::apps
