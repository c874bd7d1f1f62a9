// The cuda_ipc handshake's uid and cluster-token checks (backends/cuda_ipc/ipc_handshake.h),
// driven over a socket pair: they need no GPU. The serving side here is the real ServeChallenge or
// a fake that sends what a stranger would; the table stands for the IPC handles.
#include <grp.h>
#include <gtest/gtest.h>
#include <pwd.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <functional>
#include <thread>

#include "transfer/auth.h"
#include "transfer/backends/cuda_ipc/ipc_handshake.h"
#include "transfer/socket_util.h"

namespace kvbridge::transfer {
namespace {

using cuda_ipc_auth::Frame;
using cuda_ipc_auth::FrameIo;

constexpr uint64_t kServerInc = 0x1234abcd;
constexpr const char* kClient = "decode-0/rank0";
const std::string kTable = std::string(4, '\0') + "TABLE";  // status 0 + the "handles"

// Frames as the backend's Channel sends them: u32 type, u64 length, payload.
FrameIo Io(int fd) {
  FrameIo io;
  io.send = [fd](uint32_t type, std::string_view payload) -> Status {
    std::string b(12, '\0');
    const uint64_t len = payload.size();
    std::memcpy(b.data(), &type, 4);
    std::memcpy(b.data() + 4, &len, 8);
    b += payload;
    return ::send(fd, b.data(), b.size(), MSG_NOSIGNAL) == static_cast<ssize_t>(b.size())
               ? OkStatus()
               : UnavailableError("send");
  };
  io.recv = [fd](int) -> Result<Frame> {
    char h[12];
    if (::recv(fd, h, 12, MSG_WAITALL) != 12) return UnavailableError("peer gone");
    Frame f;
    uint64_t len = 0;
    std::memcpy(&f.type, h, 4);
    std::memcpy(&len, h + 4, 8);
    if (len > (1u << 20)) return InvalidArgumentError("frame too large");
    f.payload.resize(len);
    if (len > 0 && ::recv(fd, f.payload.data(), len, MSG_WAITALL) != static_cast<ssize_t>(len)) {
      return UnavailableError("peer gone");
    }
    return f;
  };
  return io;
}

HandshakeCrypto CryptoFor(const std::string& token) {
  HandshakeCrypto c;
  if (token.empty()) return c;
  c.nonce = [] { return auth::RandomNonce(); };
  c.proof = [token](std::string_view ctx, std::string_view n) {
    return auth::Proof(token, ctx, n);
  };
  c.matches = [token](std::string_view ctx, std::string_view n, std::string_view p) {
    return auth::ProofMatches(token, ctx, n, p);
  };
  return c;
}

struct Outcome {
  Status server;            // ServeChallenge's result
  bool table_sent = false;  // the server sent the "handles"
  Result<Frame> client = UnavailableError("not run");
};

// The real server (ServeChallenge, then the table or a refusal) against the real client.
Outcome Handshake(const std::string& server_token, const std::string& client_token) {
  int sv[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  Outcome out;
  std::thread server([&] {
    FrameIo io = Io(sv[1]);
    out.server = cuda_ipc_auth::CheckPeerUid(sv[1], "peer");
    if (out.server.ok()) {
      out.server =
          cuda_ipc_auth::ServeChallenge(io, CryptoFor(server_token), kServerInc, kClient, 1000);
    }
    if (out.server.ok()) {
      out.table_sent = io.send(cuda_ipc_auth::kHelloAck, kTable).ok();
    } else {
      (void)io.send(cuda_ipc_auth::kHelloAck, cuda_ipc_auth::RefusalPayload(out.server));
    }
  });
  FrameIo io = Io(sv[0]);
  EXPECT_TRUE(cuda_ipc_auth::CheckPeerUid(sv[0], "server").ok());
  out.client = cuda_ipc_auth::AwaitHelloAck(io, CryptoFor(client_token), kServerInc, kClient, 1000);
  server.join();
  ::close(sv[0]);
  ::close(sv[1]);
  return out;
}

TEST(CudaIpcHandshake, SameTokenBothSidesProveAndTheTableArrives) {
  Outcome o = Handshake("secret", "secret");
  ASSERT_TRUE(o.server.ok()) << o.server.ToString();
  ASSERT_TRUE(o.client.ok()) << o.client.status().ToString();
  EXPECT_EQ(o.client->payload, kTable);
}

TEST(CudaIpcHandshake, NoTokenAnywhereIsTheOldHandshake) {
  Outcome o = Handshake("", "");
  ASSERT_TRUE(o.client.ok()) << o.client.status().ToString();
  EXPECT_EQ(o.client->payload, kTable);
}

TEST(CudaIpcHandshake, ATokenlessClientIsRefusedAndGetsNoTable) {
  Outcome o = Handshake("secret", "");
  EXPECT_EQ(o.server.code(), StatusCode::kUnauthenticated);
  EXPECT_FALSE(o.table_sent);
  ASSERT_FALSE(o.client.ok());
  EXPECT_EQ(o.client.status().code(), StatusCode::kUnauthenticated);
  EXPECT_NE(o.client.status().message().find("the peer has none"), std::string::npos)
      << o.client.status().ToString();
}

TEST(CudaIpcHandshake, AWrongTokenIsRefusedBothWays) {
  Outcome o = Handshake("secret", "guess");
  EXPECT_EQ(o.server.code(), StatusCode::kUnauthenticated);
  EXPECT_FALSE(o.table_sent);
  ASSERT_FALSE(o.client.ok());
  EXPECT_EQ(o.client.status().code(), StatusCode::kUnauthenticated);
  EXPECT_NE(o.client.status().message().find("wrong cluster token"), std::string::npos);
}

TEST(CudaIpcHandshake, AClientWithATokenRefusesAServerThatNeverChallenges) {
  Outcome o = Handshake("", "secret");
  EXPECT_TRUE(o.table_sent);  // the tokenless server sent it; the client must not take it
  ASSERT_FALSE(o.client.ok());
  EXPECT_EQ(o.client.status().code(), StatusCode::kUnauthenticated);
  EXPECT_NE(o.client.status().message().find("did not prove"), std::string::npos);
}

// A fake server: challenges, then answers `after` (a wrong proof, a replayed client proof, ...)
// and a table. The client must never return the table.
Result<Frame> AgainstFake(const std::function<void(FrameIo&, const Frame& answer)>& after) {
  int sv[2];
  EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  std::thread server([&] {
    FrameIo io = Io(sv[1]);
    (void)io.send(cuda_ipc_auth::kChallenge, std::string(auth::kNonceBytes, 'n'));
    Result<Frame> answer = io.recv(1000);
    if (answer.ok()) after(io, *answer);
    (void)io.send(cuda_ipc_auth::kHelloAck, kTable);
  });
  FrameIo io = Io(sv[0]);
  Result<Frame> r =
      cuda_ipc_auth::AwaitHelloAck(io, CryptoFor("secret"), kServerInc, kClient, 1000);
  ::shutdown(sv[0], SHUT_RDWR);
  server.join();
  ::close(sv[0]);
  ::close(sv[1]);
  return r;
}

TEST(CudaIpcHandshake, AFakeServersProofsAreRefused) {
  // A wrong proof.
  Result<Frame> r = AgainstFake([](FrameIo& io, const Frame&) {
    (void)io.send(cuda_ipc_auth::kServerProof, std::string(auth::kProofBytes, 'x'));
  });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnauthenticated);
  EXPECT_NE(r.status().message().find("proof of the cluster token is wrong"), std::string::npos);
  // The client's own proof reflected back (a proof is bound to one direction).
  r = AgainstFake([](FrameIo& io, const Frame& answer) {
    (void)io.send(cuda_ipc_auth::kServerProof, answer.payload.substr(0, auth::kProofBytes));
  });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnauthenticated);
  // No proof at all, the table straight after the challenge.
  r = AgainstFake([](FrameIo&, const Frame&) {});
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnauthenticated);
  // Garbage instead of a proof.
  r = AgainstFake([](FrameIo& io, const Frame&) { (void)io.send(777, "garbage"); });
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kUnavailable);
}

TEST(CudaIpcHandshake, AStrangersAnswersAreRefusedBeforeAnyTable) {
  const HandshakeCrypto crypto = CryptoFor("secret");
  for (const std::string& answer :
       {std::string(), std::string(5, 'x'), std::string(64, 'x'), std::string(1000, 'x')}) {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
    FrameIo client = Io(sv[0]), server = Io(sv[1]);
    std::thread stranger([&] {
      (void)client.recv(1000);  // the challenge
      (void)client.send(cuda_ipc_auth::kChallengeResp, answer);
    });
    Status s = cuda_ipc_auth::ServeChallenge(server, crypto, kServerInc, kClient, 1000);
    stranger.join();
    EXPECT_EQ(s.code(), StatusCode::kUnauthenticated) << answer.size();
    ::close(sv[0]);
    ::close(sv[1]);
  }
  // Another frame type than the answer.
  int sv[2];
  ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
  FrameIo client = Io(sv[0]), server = Io(sv[1]);
  std::thread stranger([&] {
    (void)client.recv(1000);
    (void)client.send(cuda_ipc_auth::kHelloAck, kTable);
  });
  EXPECT_EQ(cuda_ipc_auth::ServeChallenge(server, crypto, kServerInc, kClient, 1000).code(),
            StatusCode::kUnauthenticated);
  stranger.join();
  ::close(sv[0]);
  ::close(sv[1]);
}

TEST(CudaIpcHandshake, ARefusalCarriesItsCodeAndReason) {
  const std::string p = cuda_ipc_auth::RefusalPayload(PermissionDeniedError("uid 65534"));
  ASSERT_GE(p.size(), 4u);
  EXPECT_EQ(static_cast<uint8_t>(p[0]), static_cast<uint8_t>(StatusCode::kPermissionDenied));
  EXPECT_EQ(p.substr(4), "uid 65534");
}

// Runs `body` in a forked child that dropped to nobody/nogroup the way the shm foreign-uid test
// (transfer_conformance_test ShmRefusesForeignUidPeer) does — setgroups + setresgid + setresuid,
// what `setpriv --reuid=nobody --regid=nogroup --clear-groups` does — and returns its pid; the
// child exits with body's value (10: dropping failed). Needs root (callers skip otherwise).
pid_t ForkAsNobody(const std::function<int()>& body) {
  const struct passwd* nobody = ::getpwnam("nobody");
  if (nobody == nullptr) return -1;
  const uid_t uid = nobody->pw_uid;
  const gid_t gid = nobody->pw_gid;
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  if (::setgroups(0, nullptr) != 0 || ::setresgid(gid, gid, gid) != 0 ||
      ::setresuid(uid, uid, uid) != 0 || ::geteuid() != uid)
    ::_exit(10);
  ::_exit(body());
}

int WaitExit(pid_t pid) {
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid || !WIFEXITED(status)) return -1;
  return WEXITSTATUS(status);
}

std::string ForeignUidSkipReason() {
  if (::geteuid() != 0) return "needs root to run a peer as another uid (nobody)";
  if (::getpwnam("nobody") == nullptr) return "no 'nobody' user on this host";
  return "";
}

// A client running as `nobody` reaches a serving agent (with a token: the uid check comes
// first) and is refused with PermissionDenied naming both uids: its first and only frame is the
// refusing HelloAck — no challenge, no table — then the server closes.
TEST(CudaIpcHandshake, AForeignUidClientIsRefusedAndSentNothingElse) {
  if (const std::string why = ForeignUidSkipReason(); !why.empty()) GTEST_SKIP() << why;
  const std::string name = "kvb-cuda-ipc-uid-test-" + std::to_string(::getpid());
  auto listen = net::UnixListen(name);
  ASSERT_TRUE(listen.ok()) << listen.status().ToString();
  const pid_t pid = ForkAsNobody([&] {
    auto sock = net::UnixConnect(name);
    if (!sock.ok()) return 11;
    net::SetTimeouts(sock->get(), 5000, 5000);
    FrameIo io = Io(sock->get());
    Result<Frame> r =
        cuda_ipc_auth::AwaitHelloAck(io, HandshakeCrypto(), kServerInc, kClient, 5000);
    if (r.ok()) return 1;  // took a table
    if (r.status().code() != StatusCode::kPermissionDenied) return 12;
    if (r.status().message().find("must be processes of the same user") == std::string::npos)
      return 13;
    char byte = 0;
    if (::recv(sock->get(), &byte, 1, 0) != 0) return 2;  // anything after the refusal
    return 0;
  });
  ASSERT_GT(pid, 0);
  const int fd = ::accept4(listen->get(), nullptr, nullptr, SOCK_CLOEXEC);
  ASSERT_GE(fd, 0);
  // The agent's order (cuda_ipc_backend.cc): the uid, then the challenge, then the table.
  FrameIo io = Io(fd);
  Status admitted = cuda_ipc_auth::CheckPeerUid(fd, "peer");
  bool challenged = false;
  if (admitted.ok()) {
    challenged = true;
    admitted = cuda_ipc_auth::ServeChallenge(io, CryptoFor("secret"), kServerInc, kClient, 5000);
  }
  bool table_sent = false;
  if (admitted.ok()) {
    table_sent = io.send(cuda_ipc_auth::kHelloAck, kTable).ok();
  } else {
    (void)io.send(cuda_ipc_auth::kHelloAck, cuda_ipc_auth::RefusalPayload(admitted));
  }
  ::close(fd);
  const int child = WaitExit(pid);
  EXPECT_FALSE(challenged);
  EXPECT_FALSE(table_sent);
  EXPECT_EQ(admitted.code(), StatusCode::kPermissionDenied);
  const std::string uid = std::to_string(::getpwnam("nobody")->pw_uid);
  EXPECT_NE(admitted.message().find("cuda_ipc peer runs as uid " + uid), std::string::npos)
      << admitted.ToString();
  EXPECT_NE(admitted.message().find("this agent as uid 0"), std::string::npos)
      << admitted.ToString();
  EXPECT_EQ(child, 0) << "1 = the foreign-uid client took a table; 2 = it was sent more after "
                         "the refusal; 10.. = the probe failed at step "
                      << child - 10;
}

// An abstract name can be bound by anyone: a "server" running as `nobody` is refused by the
// connecting side before it sends a byte (no Hello, no agent name, no answer).
TEST(CudaIpcHandshake, AForeignUidServerIsRefusedBeforeAnyByteIsSent) {
  if (const std::string why = ForeignUidSkipReason(); !why.empty()) GTEST_SKIP() << why;
  const std::string name = "kvb-cuda-ipc-uid-srv-" + std::to_string(::getpid());
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  const pid_t pid = ForkAsNobody([&] {
    ::close(ready[0]);
    auto listen = net::UnixListen(name);
    if (!listen.ok()) return 11;
    if (::write(ready[1], "r", 1) != 1) return 12;
    const int fd = ::accept4(listen->get(), nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) return 13;
    net::SetTimeouts(fd, 5000, 5000);
    char buf[64];
    const ssize_t n = ::recv(fd, buf, sizeof(buf), 0);
    return n == 0 ? 0 : n > 0 ? 1 : 14;  // 0: EOF with nothing sent
  });
  ASSERT_GT(pid, 0);
  ::close(ready[1]);
  char r = 0;
  ASSERT_EQ(::read(ready[0], &r, 1), 1);
  ::close(ready[0]);
  auto sock = net::UnixConnect(name);
  ASSERT_TRUE(sock.ok()) << sock.status().ToString();
  // The agent's order (cuda_ipc_backend.cc Connect): the uid, then the Hello, then the answer.
  Status st = cuda_ipc_auth::CheckPeerUid(sock->get(), "server");
  if (st.ok()) {
    FrameIo io = Io(sock->get());
    (void)io.send(101, std::string(16, '\0') + kClient);  // the Hello: incarnations, our name
    (void)cuda_ipc_auth::AwaitHelloAck(io, CryptoFor("secret"), kServerInc, kClient, 1000);
  }
  sock->Reset();  // AddPeer returns the error and closes
  const int child = WaitExit(pid);
  EXPECT_EQ(st.code(), StatusCode::kPermissionDenied);
  EXPECT_NE(st.message().find("cuda_ipc server runs as uid " +
                              std::to_string(::getpwnam("nobody")->pw_uid)),
            std::string::npos)
      << st.ToString();
  EXPECT_NE(st.message().find("must be processes of the same user"), std::string::npos);
  EXPECT_EQ(child, 0) << "1 = the client sent bytes to a foreign-uid server; 10.. = the fake "
                         "server failed at step "
                      << child - 10;
}

}  // namespace
}  // namespace kvbridge::transfer
