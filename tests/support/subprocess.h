// tests/support/subprocess.h — child processes for multi-process tests.
//
//   Subprocess engine({KvbridgeBin(), "serve", model_dir, "--port", std::to_string(port)},
//                     "/tmp/engine.log");
//   ASSERT_TRUE(WaitForHttpOk("127.0.0.1", port, "/health", 30'000));
//
// The child is killed (SIGTERM, then SIGKILL after 5 s) when the object is destroyed.
#pragma once

#include <string>
#include <vector>

namespace kvbridge::testing {

/// Path of the built `kvbridge` binary (from KVBRIDGE_BIN, set by CTest).
std::string KvbridgeBin();
/// A fresh temporary directory (mkdtemp under TMPDIR or /tmp).
std::string MakeTempDir(const std::string& prefix);

class Subprocess {
 public:
  /// Starts argv[0] with argv; stdout and stderr go to `log_path` (or are inherited when empty).
  Subprocess(std::vector<std::string> argv, std::string log_path = "");
  ~Subprocess();
  Subprocess(const Subprocess&) = delete;
  Subprocess& operator=(const Subprocess&) = delete;

  int pid() const { return pid_; }
  /// Sends `sig` to the child.
  void Signal(int sig);
  /// Waits up to `timeout_ms` for exit; returns the exit code, 128+signal, or -1 on timeout.
  int Wait(int timeout_ms);
  bool Running();
  const std::string& log_path() const { return log_path_; }
  /// The log's contents (empty when none).
  std::string ReadLog() const;

 private:
  int pid_ = -1;
  int exit_code_ = -1;
  std::string log_path_;
};

/// Polls http://host:port/path until it answers 200 or `timeout_ms` passes.
bool WaitForHttpOk(const std::string& host, int port, const std::string& path, int timeout_ms);

}  // namespace kvbridge::testing
