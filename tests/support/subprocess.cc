#include "support/subprocess.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <stdexcept>
#include <thread>

namespace kvbridge::testing {

std::string KvbridgeBin() {
  const char* b = std::getenv("KVBRIDGE_BIN");
  return b ? b : "build/bin/kvbridge";
}

std::string MakeTempDir(const std::string& prefix) {
  const char* tmp = std::getenv("TMPDIR");
  std::string tmpl = std::string(tmp ? tmp : "/tmp") + "/" + prefix + "XXXXXX";
  if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
  return tmpl;
}

Subprocess::Subprocess(std::vector<std::string> argv, std::string log_path)
    : log_path_(std::move(log_path)) {
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  pid_ = ::fork();
  if (pid_ < 0) throw std::runtime_error("fork failed");
  if (pid_ == 0) {
    ::setpgid(0, 0);
    if (!log_path_.empty()) {
      int fd = ::open(log_path_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        ::dup2(fd, 1);
        ::dup2(fd, 2);
        ::close(fd);
      }
    }
    ::execv(args[0], args.data());
    ::_exit(127);
  }
}

Subprocess::~Subprocess() {
  if (pid_ > 0 && Running()) {
    Signal(SIGTERM);
    if (Wait(5000) < 0) {
      Signal(SIGKILL);
      Wait(5000);
    }
  }
}

void Subprocess::Signal(int sig) {
  if (pid_ > 0) ::kill(pid_, sig);
}

int Subprocess::Wait(int timeout_ms) {
  if (exit_code_ >= 0) return exit_code_;
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (true) {
    int status = 0;
    pid_t r = ::waitpid(pid_, &status, WNOHANG);
    if (r == pid_) {
      exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
      return exit_code_;
    }
    if (std::chrono::steady_clock::now() >= deadline) return -1;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

bool Subprocess::Running() { return Wait(0) < 0; }

std::string Subprocess::ReadLog() const {
  std::ifstream in(log_path_);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

namespace {
// A minimal blocking GET so the support library needs no HTTP dependency.
int HttpGetStatus(const std::string& host, int port, const std::string& path) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return -1;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  ::inet_pton(AF_INET, host.c_str(), &addr.sin_addr);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) != 0) {
    ::close(fd);
    return -1;
  }
  std::string req = "GET " + path + " HTTP/1.1\r\nHost: " + host + "\r\nConnection: close\r\n\r\n";
  if (::send(fd, req.data(), req.size(), MSG_NOSIGNAL) < 0) {
    ::close(fd);
    return -1;
  }
  char buf[64] = {0};
  ssize_t n = ::recv(fd, buf, sizeof(buf) - 1, 0);
  ::close(fd);
  if (n < 12) return -1;
  return std::atoi(buf + 9);
}
}  // namespace

bool WaitForHttpOk(const std::string& host, int port, const std::string& path, int timeout_ms) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    if (HttpGetStatus(host, port, path) == 200) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

}  // namespace kvbridge::testing
