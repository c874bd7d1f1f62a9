// UpstreamPool with loopback TCP connections: the pool's end is an Asio socket, the other end
// plays the engine.
#include "proxy/upstream_pool.h"

#include <gtest/gtest.h>

#include <boost/asio/connect.hpp>
#include <boost/asio/io_context.hpp>
#include <boost/asio/read.hpp>
#include <boost/asio/write.hpp>
#include <chrono>

namespace kvbridge::proxy {
namespace {

namespace net = boost::asio;
using net::ip::tcp;

class UpstreamPoolTest : public ::testing::Test {
 protected:
  // A connected pair: .first for the pool, .second the engine's end.
  std::pair<tcp::socket, tcp::socket> Connect() {
    tcp::socket client(ioc_), server(ioc_);
    client.connect(acceptor_.local_endpoint());
    acceptor_.accept(server);
    return {std::move(client), std::move(server)};
  }
  // Runs the event loop until `done` holds (bounded: 2 s).
  template <typename F>
  bool RunUntil(F done) {
    auto end = std::chrono::steady_clock::now() + std::chrono::seconds(2);
    while (!done() && std::chrono::steady_clock::now() < end) {
      ioc_.run_for(std::chrono::milliseconds(5));
      ioc_.restart();
    }
    return done();
  }
  // The client end's local port, to tell connections apart.
  static unsigned short Port(const tcp::socket& s) { return s.local_endpoint().port(); }

  net::io_context ioc_;
  tcp::acceptor acceptor_{ioc_, tcp::endpoint(net::ip::make_address("127.0.0.1"), 0)};
};

TEST_F(UpstreamPoolTest, ReusesTheMostRecentConnectionOfItsHostOnly) {
  UpstreamPool pool({.max_idle_per_host = 4, .idle_timeout = kSecond});
  auto a = Connect(), b = Connect(), c = Connect();
  const unsigned short pa = Port(a.first), pb = Port(b.first);
  pool.Put("h:1", std::move(a.first), 0);
  pool.Put("h:1", std::move(b.first), 10);
  pool.Put("h:2", std::move(c.first), 20);
  EXPECT_EQ(pool.IdleCount(), 3u);
  EXPECT_EQ(pool.IdleCount("h:1"), 2u);
  EXPECT_EQ(pool.Sweep(30), 0);  // starts watching all three
  auto got = pool.Take("h:1", 100);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(Port(*got), pb);
  auto got2 = pool.Take("h:1", 100);
  ASSERT_TRUE(got2.has_value());
  EXPECT_EQ(Port(*got2), pa);
  EXPECT_FALSE(pool.Take("h:1", 100).has_value());
  EXPECT_FALSE(pool.Take("h:3", 100).has_value());
  EXPECT_EQ(pool.IdleCount("h:2"), 1u);
  // A taken connection still works: a request out, an answer back, both on the same socket.
  net::write(*got, net::buffer("ping", 4));
  char buf[4];
  net::read(b.second, net::buffer(buf, 4));
  EXPECT_EQ(std::string(buf, 4), "ping");
  net::write(b.second, net::buffer("pong", 4));
  net::read(*got, net::buffer(buf, 4));
  EXPECT_EQ(std::string(buf, 4), "pong");
  // ... and the watch that was armed on it while idle (cancelled by Take) does not drop it from
  // the pool when it is back, nor does its new watch.
  ioc_.poll();
  pool.Put("h:1", std::move(*got), 200);
  EXPECT_EQ(pool.Sweep(210), 0);
  ioc_.poll();
  EXPECT_EQ(pool.IdleCount("h:1"), 1u);
}

TEST_F(UpstreamPoolTest, BoundedIdleCountClosesTheSurplus) {
  UpstreamPool pool({.max_idle_per_host = 2, .idle_timeout = kSecond});
  auto a = Connect(), b = Connect(), c = Connect();
  pool.Put("h:1", std::move(a.first), 0);
  pool.Put("h:1", std::move(b.first), 0);
  pool.Put("h:1", std::move(c.first), 0);
  EXPECT_EQ(pool.IdleCount("h:1"), 2u);
  // The surplus (c) was closed: its engine end reads EOF; a's does not.
  char ch;
  boost::system::error_code ec;
  c.second.read_some(net::buffer(&ch, 1), ec);
  EXPECT_EQ(ec, net::error::eof);
  a.second.non_blocking(true);
  a.second.read_some(net::buffer(&ch, 1), ec);
  EXPECT_EQ(ec, net::error::would_block);
}

TEST_F(UpstreamPoolTest, DisabledPoolClosesWhatItIsGiven) {
  UpstreamPool pool({.max_idle_per_host = 0, .idle_timeout = kSecond});
  EXPECT_FALSE(pool.enabled());
  auto a = Connect();
  pool.Put("h:1", std::move(a.first), 0);
  EXPECT_EQ(pool.IdleCount(), 0u);
  char ch;
  boost::system::error_code ec;
  a.second.read_some(net::buffer(&ch, 1), ec);
  EXPECT_EQ(ec, net::error::eof);
  EXPECT_FALSE(pool.Take("h:1", 0).has_value());
}

TEST_F(UpstreamPoolTest, IdleTimeoutOnTakeAndSweep) {
  UpstreamPool pool({.max_idle_per_host = 4, .idle_timeout = 100});
  auto a = Connect(), b = Connect(), c = Connect();
  const unsigned short pb = Port(b.first);
  pool.Put("h:1", std::move(a.first), 0);
  pool.Put("h:1", std::move(b.first), 50);
  pool.Put("h:2", std::move(c.first), 0);
  // At 120 a (idle 120) is too old, b (idle 70) is fine.
  auto got = pool.Take("h:1", 120);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(Port(*got), pb);
  auto none = pool.Take("h:1", 120);
  EXPECT_FALSE(none.has_value());
  char ch;
  boost::system::error_code ec;
  a.second.read_some(net::buffer(&ch, 1), ec);  // a was closed by the pool
  EXPECT_EQ(ec, net::error::eof);
  EXPECT_EQ(pool.Sweep(100), 0);  // c idle exactly the timeout: kept
  EXPECT_EQ(pool.Sweep(101), 1);
  c.second.read_some(net::buffer(&ch, 1), ec);
  EXPECT_EQ(ec, net::error::eof);
  EXPECT_EQ(pool.IdleCount(), 0u);
}

TEST_F(UpstreamPoolTest, ConnectionClosedOrWrittenByThePeerIsDroppedWhileIdle) {
  UpstreamPool pool({.max_idle_per_host = 4, .idle_timeout = kSecond});
  auto closed = Connect(), chatty = Connect(), good = Connect();
  const unsigned short pgood = Port(good.first);
  pool.Put("h:1", std::move(good.first), 0);
  pool.Put("h:1", std::move(chatty.first), 0);
  pool.Put("h:1", std::move(closed.first), 0);
  EXPECT_EQ(pool.Sweep(1), 0);  // starts watching all three
  ioc_.poll();
  EXPECT_EQ(pool.IdleCount("h:1"), 3u);  // nothing happened yet: all three stay
  closed.second.close();
  net::write(chatty.second, net::buffer("x", 1));
  ASSERT_TRUE(RunUntil([&] { return pool.IdleCount("h:1") == 1; }));
  // The dropped ones were closed: the chatty one's engine end reads a reset (its "x" was never
  // read, so the close resets the connection).
  char ch;
  boost::system::error_code ec;
  chatty.second.read_some(net::buffer(&ch, 1), ec);
  EXPECT_EQ(ec, net::error::connection_reset);
  auto got = pool.Take("h:1", 1);
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(Port(*got), pgood);
}

TEST_F(UpstreamPoolTest, UnwatchedConnectionIsOnlyNoticedOnceSwept) {
  UpstreamPool pool({.max_idle_per_host = 4, .idle_timeout = kSecond});
  auto a = Connect();
  pool.Put("h:1", std::move(a.first), 0);
  a.second.close();
  ioc_.run_for(std::chrono::milliseconds(20));
  ioc_.restart();
  EXPECT_EQ(pool.IdleCount("h:1"), 1u);  // not watched until a sweep: a Put costs no syscall
  EXPECT_EQ(pool.Sweep(1), 0);
  ASSERT_TRUE(RunUntil([&] { return pool.IdleCount("h:1") == 0; }));
}

TEST_F(UpstreamPoolTest, WatchesOutliveThePool) {
  auto a = Connect();
  {
    UpstreamPool pool({.max_idle_per_host = 4, .idle_timeout = kSecond});
    pool.Put("h:1", std::move(a.first), 0);
    EXPECT_EQ(pool.Sweep(1), 0);  // watched
  }
  // The pool closed its socket; the cancelled watch runs after the pool is gone, harmlessly.
  ioc_.poll();
  char ch;
  boost::system::error_code ec;
  a.second.read_some(net::buffer(&ch, 1), ec);
  EXPECT_EQ(ec, net::error::eof);
}

}  // namespace
}  // namespace kvbridge::proxy
