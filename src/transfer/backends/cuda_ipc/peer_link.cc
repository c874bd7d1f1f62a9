#include "transfer/backends/cuda_ipc/peer_link.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <cstring>
#include <thread>

extern char** environ;

namespace kvbridge::cuda_ipc {

namespace {
constexpr uint64_t kMaxFrame = uint64_t{1} << 30;

Status WriteAll(int fd, const char* p, size_t n) {
  while (n > 0) {
    ssize_t w = send(fd, p, n, MSG_NOSIGNAL);
    if (w < 0) {
      if (errno == EINTR) continue;
      if (errno == EPIPE || errno == ECONNRESET) return UnavailableError("peer gone (send)");
      return ErrnoToStatus(errno, "send");
    }
    p += w;
    n -= static_cast<size_t>(w);
  }
  return OkStatus();
}

Status ReadAll(int fd, char* p, size_t n, int timeout_ms) {
  while (n > 0) {
    pollfd pfd{fd, POLLIN, 0};
    int r = poll(&pfd, 1, timeout_ms);
    if (r < 0) {
      if (errno == EINTR) continue;
      return ErrnoToStatus(errno, "poll");
    }
    if (r == 0) return DeadlineExceededError("peer did not answer in time");
    ssize_t got = recv(fd, p, n, 0);
    if (got == 0) return UnavailableError("peer gone (connection closed)");
    if (got < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      if (errno == ECONNRESET) return UnavailableError("peer gone (reset)");
      return ErrnoToStatus(errno, "recv");
    }
    p += got;
    n -= static_cast<size_t>(got);
  }
  return OkStatus();
}
}  // namespace

Channel::~Channel() {
  if (fd_ >= 0) close(fd_);
}

Status Channel::Send(MsgType type, std::string_view payload) {
  char hdr[12];
  const auto t = static_cast<uint32_t>(type);
  const uint64_t len = payload.size();
  std::memcpy(hdr, &t, 4);
  std::memcpy(hdr + 4, &len, 8);
  RETURN_IF_ERROR(WriteAll(fd_, hdr, sizeof(hdr)));
  return WriteAll(fd_, payload.data(), payload.size());
}

Result<Message> Channel::Recv(int timeout_ms) {
  char hdr[12];
  RETURN_IF_ERROR(ReadAll(fd_, hdr, sizeof(hdr), timeout_ms));
  uint32_t t = 0;
  uint64_t len = 0;
  std::memcpy(&t, hdr, 4);
  std::memcpy(&len, hdr + 4, 8);
  if (len > kMaxFrame) return InvalidArgumentError("frame of " + std::to_string(len) + " bytes");
  Message m;
  m.type = static_cast<MsgType>(t);
  m.payload.resize(len);
  RETURN_IF_ERROR(ReadAll(fd_, m.payload.data(), len, timeout_ms));
  return m;
}

void Channel::Shutdown() { ::shutdown(fd_, SHUT_RDWR); }

bool Channel::PeerAlive() const {
  pollfd pfd{fd_, POLLIN | POLLRDHUP, 0};
  if (poll(&pfd, 1, 0) <= 0) return true;
  return (pfd.revents & (POLLHUP | POLLRDHUP | POLLERR)) == 0;
}

PeerProcess::PeerProcess(PeerProcess&& o) noexcept : pid(o.pid), channel(std::move(o.channel)) {
  o.pid = -1;
}
PeerProcess& PeerProcess::operator=(PeerProcess&& o) noexcept {
  if (this != &o) {
    Kill();
    pid = o.pid;
    channel = std::move(o.channel);
    o.pid = -1;
  }
  return *this;
}
PeerProcess::~PeerProcess() { Kill(); }

void PeerProcess::Kill() {
  if (pid > 0) {
    kill(pid, SIGKILL);
    waitpid(pid, nullptr, 0);
    pid = -1;
  }
}

Status PeerProcess::Stop(int timeout_ms) {
  if (pid <= 0) return OkStatus();
  Status st = channel ? channel->Send(MsgType::kExit, {}) : OkStatus();
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  while (std::chrono::steady_clock::now() < deadline) {
    int wstatus = 0;
    pid_t r = waitpid(pid, &wstatus, WNOHANG);
    if (r == pid) {
      pid = -1;
      if (WIFEXITED(wstatus) && WEXITSTATUS(wstatus) == 0) return st;
      return InternalError("peer exited abnormally (status " + std::to_string(wstatus) + ")");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  Kill();
  return DeadlineExceededError("peer did not exit in time; killed");
}

Result<PeerProcess> SpawnPeer(const std::string& binary, int device) {
  int sv[2];
  if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0)
    return ErrnoToStatus(errno, "socketpair");
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, sv[1], 3);  // dup2 clears CLOEXEC on fd 3
  std::string dev = std::to_string(device);
  std::vector<char*> argv = {const_cast<char*>(binary.c_str()),
                             const_cast<char*>("--fd"),
                             const_cast<char*>("3"),
                             const_cast<char*>("--device"),
                             dev.data(),
                             nullptr};
  pid_t pid = -1;
  int rc = posix_spawn(&pid, binary.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  close(sv[1]);
  if (rc != 0) {
    close(sv[0]);
    return ErrnoToStatus(rc, "posix_spawn " + binary);
  }
  PeerProcess p;
  p.pid = pid;
  p.channel = std::make_unique<Channel>(sv[0]);
  return p;
}

std::string DefaultPeerBinary() {
  if (const char* env = std::getenv("KVBRIDGE_CUDA_IPC_PEER"); env != nullptr && *env) return env;
  char buf[4096];
  ssize_t n = readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  if (n <= 0) return "cuda_ipc_peer";
  std::string self(buf, static_cast<size_t>(n));
  return self.substr(0, self.rfind('/') + 1) + "cuda_ipc_peer";
}

std::string VerifySpec::Encode() const {
  std::string s;
  const uint64_t hdr[4] = {src_seed, poison_seed, block_bytes, src_of.size()};
  s.append(reinterpret_cast<const char*>(hdr), sizeof(hdr));
  s.append(reinterpret_cast<const char*>(src_of.data()), src_of.size() * sizeof(int32_t));
  return s;
}

Result<VerifySpec> VerifySpec::Decode(std::string_view b) {
  uint64_t hdr[4];
  if (b.size() < sizeof(hdr)) return InvalidArgumentError("VerifySpec: short");
  std::memcpy(hdr, b.data(), sizeof(hdr));
  if (b.size() != sizeof(hdr) + hdr[3] * sizeof(int32_t))
    return InvalidArgumentError("VerifySpec: size mismatch");
  VerifySpec v;
  v.src_seed = hdr[0];
  v.poison_seed = hdr[1];
  v.block_bytes = hdr[2];
  v.src_of.resize(hdr[3]);
  std::memcpy(v.src_of.data(), b.data() + sizeof(hdr), hdr[3] * sizeof(int32_t));
  return v;
}

std::string EncodeU64s(std::span<const uint64_t> v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size_bytes());
}

Result<std::vector<uint64_t>> DecodeU64s(std::string_view b) {
  if (b.size() % 8 != 0) return InvalidArgumentError("u64 list: size not a multiple of 8");
  std::vector<uint64_t> v(b.size() / 8);
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

Result<PendingTransfer> PostToPeer(CopyEngine& engine, Channel& channel, CopyOp op,
                                   const BlockRegion& local, const BlockRegion& remote,
                                   std::span<const BlockPair> pairs, std::string notification) {
  if (!channel.PeerAlive()) return UnavailableError("cuda_ipc peer gone; transfer not started");
  ASSIGN_OR_RETURN(CopyHandle h, engine.Post(op, local, remote, pairs));
  PendingTransfer t;
  t.copy = std::move(h);
  t.notification = std::move(notification);
  return t;
}

CopyState Progress(PendingTransfer& t, Channel& channel, Status* status) {
  if (t.finished) {
    *status = t.status;
    return t.status.ok() ? CopyState::kDone : CopyState::kFailed;
  }
  CopyState s = t.copy.Poll();
  // In progress until the event completes, even when the peer is gone: a transfer fails only
  // once no more bytes of it can land; then the notification's send reports Unavailable.
  if (s == CopyState::kInProgress) {
    return s;
  }
  t.finished = true;
  t.status =
      s == CopyState::kDone ? channel.Send(MsgType::kNotify, t.notification) : t.copy.status();
  *status = t.status;
  return t.status.ok() ? CopyState::kDone : CopyState::kFailed;
}

}  // namespace kvbridge::cuda_ipc
