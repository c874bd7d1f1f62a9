// UpstreamPool with socketpairs standing in for upstream connections.
#include "proxy/upstream_pool.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <unistd.h>

namespace kvbridge::proxy {
namespace {

// One end goes to the pool, the other plays the engine.
struct Pair {
  Pair() { EXPECT_EQ(::socketpair(AF_UNIX, SOCK_STREAM, 0, fds), 0); }
  ~Pair() {
    if (fds[1] >= 0) ::close(fds[1]);
  }
  PooledConnection Conn() const { return {fds[0], AF_UNIX}; }
  int fds[2] = {-1, -1};
};

bool IsOpen(int fd) { return ::fcntl(fd, F_GETFD) != -1; }

TEST(UpstreamPool, ReusesTheMostRecentConnectionOfItsHostOnly) {
  UpstreamPool pool({.max_idle_per_host = 4, .idle_timeout = kSecond});
  Pair a, b, c;
  pool.Put("h:1", a.Conn(), 0);
  pool.Put("h:1", b.Conn(), 10);
  pool.Put("h:2", c.Conn(), 20);
  EXPECT_EQ(pool.IdleCount(), 3u);
  auto got = pool.Take("h:1", 100);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->fd, b.fds[0]);
  EXPECT_EQ(got->family, AF_UNIX);
  got = pool.Take("h:1", 100);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->fd, a.fds[0]);
  EXPECT_FALSE(pool.Take("h:1", 100).has_value());
  EXPECT_FALSE(pool.Take("h:3", 100).has_value());
  EXPECT_EQ(pool.IdleCount("h:2"), 1u);
  ::close(a.fds[0]);
  ::close(b.fds[0]);
}

TEST(UpstreamPool, BoundedIdleCountClosesTheSurplus) {
  UpstreamPool pool({.max_idle_per_host = 2, .idle_timeout = kSecond});
  Pair a, b, c;
  pool.Put("h:1", a.Conn(), 0);
  pool.Put("h:1", b.Conn(), 0);
  pool.Put("h:1", c.Conn(), 0);
  EXPECT_EQ(pool.IdleCount("h:1"), 2u);
  EXPECT_FALSE(IsOpen(c.fds[0]));
  EXPECT_TRUE(IsOpen(a.fds[0]));
}

TEST(UpstreamPool, DisabledPoolClosesWhatItIsGiven) {
  UpstreamPool pool({.max_idle_per_host = 0, .idle_timeout = kSecond});
  EXPECT_FALSE(pool.enabled());
  Pair a;
  pool.Put("h:1", a.Conn(), 0);
  EXPECT_EQ(pool.IdleCount(), 0u);
  EXPECT_FALSE(IsOpen(a.fds[0]));
  EXPECT_FALSE(pool.Take("h:1", 0).has_value());
}

TEST(UpstreamPool, IdleTimeoutOnTakeAndSweep) {
  UpstreamPool pool({.max_idle_per_host = 4, .idle_timeout = 100});
  Pair a, b, c;
  pool.Put("h:1", a.Conn(), 0);
  pool.Put("h:1", b.Conn(), 50);
  pool.Put("h:2", c.Conn(), 0);
  // At 120 a (idle 120) is too old, b (idle 70) is fine.
  auto got = pool.Take("h:1", 120);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->fd, b.fds[0]);
  ::close(got->fd);
  EXPECT_FALSE(pool.Take("h:1", 120).has_value());
  EXPECT_FALSE(IsOpen(a.fds[0]));
  EXPECT_EQ(pool.Sweep(100), 0);  // c idle exactly the timeout: kept
  EXPECT_EQ(pool.Sweep(101), 1);
  EXPECT_FALSE(IsOpen(c.fds[0]));
  EXPECT_EQ(pool.IdleCount(), 0u);
}

TEST(UpstreamPool, ConnectionClosedOrWrittenByThePeerIsNotReused) {
  UpstreamPool pool({.max_idle_per_host = 4, .idle_timeout = kSecond});
  Pair closed, chatty, good;
  pool.Put("h:1", good.Conn(), 0);
  pool.Put("h:1", chatty.Conn(), 0);
  pool.Put("h:1", closed.Conn(), 0);
  ::close(closed.fds[1]);
  closed.fds[1] = -1;
  ASSERT_EQ(::write(chatty.fds[1], "x", 1), 1);
  auto got = pool.Take("h:1", 1);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->fd, good.fds[0]);
  EXPECT_FALSE(IsOpen(closed.fds[0]));
  EXPECT_FALSE(IsOpen(chatty.fds[0]));
  ::close(got->fd);
}

}  // namespace
}  // namespace kvbridge::proxy
