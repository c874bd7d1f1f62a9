// The etcd control plane (etcd.h, etcd_client.h): the cores alone, and the shells against a fake
// etcd v3 JSON gateway (an httplib server speaking the shapes etcd 3.4.23 answers with, as
// recorded from `etcd` 3.4.23 with curl: docs/proxy.md "Control plane on etcd").
#include "kvbridge/proxy/etcd.h"

#include <gtest/gtest.h>
#include <httplib.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <thread>

#include "kvbridge/proxy/etcd_client.h"

namespace kvbridge::proxy {
namespace {

using nlohmann::json;

// --- pure functions ------------------------------------------------------------------------

TEST(EtcdCodec, Base64MatchesRfc4648Vectors) {
  EXPECT_EQ(Base64Encode(""), "");
  EXPECT_EQ(Base64Encode("f"), "Zg==");
  EXPECT_EQ(Base64Encode("fo"), "Zm8=");
  EXPECT_EQ(Base64Encode("foo"), "Zm9v");
  EXPECT_EQ(Base64Encode("foobar"), "Zm9vYmFy");
  EXPECT_EQ(*Base64Decode("Zm9vYmFy"), "foobar");
  EXPECT_EQ(*Base64Decode("Zm8="), "fo");
  EXPECT_EQ(*Base64Decode("Zg=="), "f");
  EXPECT_FALSE(Base64Decode("Zm9").ok());
  EXPECT_FALSE(Base64Decode("Zm9*").ok());
  EXPECT_FALSE(Base64Decode("Z=9v").ok());
  std::string all;
  for (int i = 0; i < 256; ++i) all += static_cast<char>(i);
  EXPECT_EQ(*Base64Decode(Base64Encode(all)), all);
}

TEST(EtcdCodec, PrefixRangeEndIsEtcdsPrefixPlusOne) {
  EXPECT_EQ(PrefixRangeEnd("/kvbridge/c/instances/"), "/kvbridge/c/instances0");
  EXPECT_EQ(PrefixRangeEnd("foo"), "fop");  // etcd's own example: Zm9v -> Zm9w
  EXPECT_EQ(Base64Encode(PrefixRangeEnd("foo")), "Zm9w");
  EXPECT_EQ(PrefixRangeEnd(std::string("a\xff", 2)), "b");
  EXPECT_EQ(*EtcdInstancesPrefix("prod-1"), "/kvbridge/prod-1/instances/");
  EXPECT_FALSE(EtcdInstancesPrefix("a/b").ok());
  EXPECT_FALSE(EtcdInstancesPrefix("").ok());
}

TEST(EtcdRecord, HmacVerifiesOnlyTheKeyAndRecordItWasMadeFor) {
  const std::string key = "/kvbridge/c/instances/decode-0";
  const std::string v = EtcdRecordValue(key, R"({"role":"decode"})", "tok");
  EXPECT_EQ(*VerifyEtcdRecord(key, v, "tok"), R"({"role":"decode"})");
  EXPECT_EQ(VerifyEtcdRecord(key, v, "other").status().code(), StatusCode::kUnauthenticated);
  // Moved to another key (another name or cluster): refused.
  EXPECT_EQ(VerifyEtcdRecord(key + "x", v, "tok").status().code(), StatusCode::kUnauthenticated);
  json tampered = json::parse(v);
  tampered["record"] = R"({"role":"prefill"})";
  EXPECT_EQ(VerifyEtcdRecord(key, tampered.dump(), "tok").status().code(),
            StatusCode::kUnauthenticated);
  EXPECT_EQ(VerifyEtcdRecord(key, "{not json", "tok").status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(VerifyEtcdRecord(key, R"({"record":1,"hmac":"x"})", "tok").status().code(),
            StatusCode::kInvalidArgument);
  // The HMAC is HMAC-SHA256 over "kvbridge-etcd-v1\n" key "\n" record (openssl dgst -sha256
  // -hmac tok over that text gives the same hex).
  EXPECT_EQ(json::parse(EtcdRecordValue("k", "r", "tok"))["hmac"].get<std::string>().size(), 64u);
}

// --- the cores, driven by hand ---------------------------------------------------------------

std::string WatchEvents(const std::vector<std::tuple<std::string, std::string, int64_t>>& evs) {
  json events = json::array();
  for (const auto& [key, value, rev] : evs) {
    json kv = {{"key", Base64Encode(key)}, {"mod_revision", std::to_string(rev)}};
    json ev;
    if (value.empty()) {
      ev["type"] = "DELETE";
    } else {
      kv["value"] = Base64Encode(value);
    }
    ev["kv"] = kv;
    events.push_back(ev);
  }
  return json{{"result", {{"header", {{"revision", "99"}}}, {"events", events}}}}.dump();
}

TEST(EtcdPrefixWatcher, ListsThenWatchesFromTheNextRevisionAndSkipsReplays) {
  EtcdPrefixWatcher w({.endpoints = 2, .prefix = "/p/"});
  w.Start(0);
  auto calls = w.TakeCalls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].path, "/v3/kv/range");
  EXPECT_EQ(json::parse(calls[0].body)["range_end"], Base64Encode("/p0"));
  json listed = {{"header", {{"revision", "7"}}},
                 {"kvs", {{{"key", Base64Encode("/p/a")}, {"value", Base64Encode("A")}}}}};
  w.OnReply({.id = calls[0].id, .http_status = 200, .body = listed.dump()}, 0);
  auto u = w.TakeUpdates();
  ASSERT_EQ(u.size(), 1u);
  EXPECT_EQ(u[0].kind, EtcdKvUpdate::Kind::kReset);
  ASSERT_EQ(u[0].kvs.size(), 1u);
  EXPECT_EQ(u[0].kvs[0].second, "A");
  calls = w.TakeCalls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_TRUE(calls[0].stream);
  EXPECT_EQ(json::parse(calls[0].body)["create_request"]["start_revision"], "8");
  const uint64_t stream = calls[0].id;
  w.OnStreamMessage(stream, R"({"result":{"header":{"revision":"7"},"created":true}})", 0);
  w.OnStreamMessage(stream, WatchEvents({{"/p/b", "B", 8}, {"/p/a", "", 9}}), 0);
  u = w.TakeUpdates();
  ASSERT_EQ(u.size(), 2u);
  EXPECT_EQ(u[0].kind, EtcdKvUpdate::Kind::kPut);
  EXPECT_EQ(u[0].key, "/p/b");
  EXPECT_EQ(u[1].kind, EtcdKvUpdate::Kind::kDelete);
  EXPECT_EQ(w.revision(), 9);
  // The stream breaks: watch again on the other member from 10; what it replays is skipped.
  w.OnReply({.id = stream, .transport = UnavailableError("eof")}, 1000);
  EXPECT_EQ(w.state(), EtcdPrefixWatcher::State::kBackoff);
  EXPECT_TRUE(w.TakeCalls().empty());
  w.OnTick(*w.next_tick());
  calls = w.TakeCalls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].endpoint, 1);
  EXPECT_EQ(json::parse(calls[0].body)["create_request"]["start_revision"], "10");
  w.OnStreamMessage(calls[0].id, WatchEvents({{"/p/b", "B", 8}, {"/p/c", "C", 10}}), 2000);
  u = w.TakeUpdates();
  ASSERT_EQ(u.size(), 1u);
  EXPECT_EQ(u[0].key, "/p/c");
  // An old stream's message is not applied.
  w.OnStreamMessage(stream, WatchEvents({{"/p/z", "Z", 11}}), 2000);
  EXPECT_TRUE(w.TakeUpdates().empty());
}

TEST(EtcdPrefixWatcher, CompactedStartRevisionListsAgain) {
  EtcdPrefixWatcher w({.endpoints = 1, .prefix = "/p/"});
  w.Start(0);
  auto calls = w.TakeCalls();
  w.OnReply({.id = calls[0].id, .http_status = 200, .body = R"({"header":{"revision":"3"}})"}, 0);
  w.TakeUpdates();
  calls = w.TakeCalls();
  const uint64_t stream = calls[0].id;
  // etcd 3.4.23's answer to a watch from a compacted revision (recorded).
  w.OnStreamMessage(stream, R"({"result":{"header":{"revision":"9"},"created":true}})", 0);
  w.OnStreamMessage(stream,
                    R"({"result":{"header":{"raft_term":"2"},"canceled":true,)"
                    R"("compact_revision":"6"}})",
                    0);
  EXPECT_EQ(w.TakeCloses(), std::vector<uint64_t>{stream});  // etcd keeps the HTTP stream open
  w.OnTick(*w.next_tick());
  calls = w.TakeCalls();
  ASSERT_EQ(calls.size(), 1u);
  EXPECT_EQ(calls[0].path, "/v3/kv/range");
  EXPECT_EQ(w.lists(), 2);
}

TEST(EtcdLeaseKeeper, GrantPutKeepAliveRegrantWhenTheLeaseIsGone) {
  EtcdLeaseKeeper k({.endpoints = 2, .key = "/k", .value = "v", .ttl_s = 3});
  k.Start(0);
  auto c = k.TakeCalls();
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].path, "/v3/lease/grant");
  EXPECT_EQ(json::parse(c[0].body)["TTL"], "3");
  k.OnReply({.id = c[0].id, .http_status = 200, .body = R"({"header":{},"ID":"77","TTL":"3"})"}, 0);
  c = k.TakeCalls();
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].path, "/v3/kv/put");
  EXPECT_EQ(json::parse(c[0].body)["lease"], "77");
  EXPECT_EQ(json::parse(c[0].body)["value"], Base64Encode("v"));
  k.OnReply({.id = c[0].id, .http_status = 200, .body = R"({"header":{}})"}, 0);
  EXPECT_TRUE(k.registered());
  EXPECT_EQ(*k.next_tick(), 1 * kSecond);  // ttl / 3
  k.OnTick(1 * kSecond);
  c = k.TakeCalls();
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].path, "/v3/lease/keepalive");
  // A member without a leader: the next member, after the backoff.
  k.OnReply({.id = c[0].id,
             .http_status = 200,
             .body = R"({"error":{"grpc_code":14,"message":"etcdserver: no leader"}})"},
            1 * kSecond);
  EXPECT_EQ(k.state(), EtcdLeaseKeeper::State::kBackoff);
  EXPECT_EQ(k.last_error(), "keepalive: etcdserver: no leader");
  k.OnTick(*k.next_tick());
  c = k.TakeCalls();
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].endpoint, 1);
  EXPECT_EQ(c[0].path, "/v3/lease/keepalive");
  // The lease expired meanwhile (etcd 3.4.23 answers a keepalive of an unknown lease without
  // TTL): a new lease, the record put again.
  k.OnReply({.id = c[0].id, .http_status = 200, .body = R"({"result":{"header":{},"ID":"77"}})"},
            2 * kSecond);
  EXPECT_FALSE(k.registered());
  c = k.TakeCalls();
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].path, "/v3/lease/grant");
  k.OnReply({.id = c[0].id, .http_status = 200, .body = R"({"ID":"78","TTL":"3"})"}, 2 * kSecond);
  c = k.TakeCalls();
  EXPECT_EQ(json::parse(c[0].body)["lease"], "78");
  // A put that finds its lease gone (etcd: 404 "requested lease not found"): grant again.
  k.OnReply({.id = c[0].id,
             .http_status = 404,
             .body = R"({"error":"etcdserver: requested lease not found","code":5})"},
            2 * kSecond);
  c = k.TakeCalls();
  ASSERT_EQ(c.size(), 1u);
  EXPECT_EQ(c[0].path, "/v3/lease/grant");
  EXPECT_EQ(k.grants(), 2);
}

// --- the shells against a fake gateway --------------------------------------------------------

// The part of etcd's store the control plane uses: keys with leases, a revision, an event log,
// compaction; watch streams as etcd 3.4's gateway writes them (one JSON message per line).
struct FakeStore {
  struct Kv {
    std::string value;
    int64_t lease = 0;
    int64_t mod = 0;
  };
  struct Event {
    std::string key, value;  // value empty: DELETE
    int64_t rev;
  };
  std::mutex mu;
  std::condition_variable cv;
  int64_t revision = 1;
  int64_t compacted = 0;
  int64_t next_lease = 100;
  std::map<std::string, Kv> kvs;
  std::map<int64_t, bool> leases;
  std::vector<Event> log;
  int stream_epoch = 0;  // DropStreams() ends every open watch stream
  int grants = 0, keepalives = 0, puts = 0, revokes = 0;

  void PutLocked(const std::string& k, const std::string& v, int64_t lease) {
    ++revision;
    kvs[k] = {v, lease, revision};
    log.push_back({k, v, revision});
    cv.notify_all();
  }
  void DeleteLocked(const std::string& k) {
    if (kvs.erase(k) == 0) return;
    ++revision;
    log.push_back({k, "", revision});
    cv.notify_all();
  }
  void Put(const std::string& k, const std::string& v) {
    std::lock_guard<std::mutex> lock(mu);
    PutLocked(k, v, 0);
  }
  void Delete(const std::string& k) {
    std::lock_guard<std::mutex> lock(mu);
    DeleteLocked(k);
  }
  void ExpireLease(int64_t id) {
    std::lock_guard<std::mutex> lock(mu);
    leases.erase(id);
    std::vector<std::string> gone;
    for (auto& [k, kv] : kvs)
      if (kv.lease == id) gone.push_back(k);
    for (auto& k : gone) DeleteLocked(k);
  }
  void Compact() {
    std::lock_guard<std::mutex> lock(mu);
    compacted = revision;
  }
  void DropStreams() {
    std::lock_guard<std::mutex> lock(mu);
    ++stream_epoch;
    cv.notify_all();
  }
};

std::string Header(int64_t rev) {
  return R"({"cluster_id":"1","member_id":"2","revision":")" + std::to_string(rev) +
         R"(","raft_term":"2"})";
}

class FakeMember {
 public:
  explicit FakeMember(std::shared_ptr<FakeStore> store) : store_(std::move(store)) {
    auto& s = *store_;
    auto body = [](const httplib::Request& req) {
      json j = json::parse(req.body, nullptr, false);
      return j.is_object() ? j : json::object();
    };
    auto i64 = [](const json& j, const char* k) -> int64_t {
      if (!j.contains(k)) return 0;
      return j[k].is_string() ? std::stoll(j[k].get<std::string>()) : j[k].get<int64_t>();
    };
    auto refuse = [this](httplib::Response& res) {
      if (!no_leader_) return false;
      res.status = 503;
      res.set_content(R"({"error":"etcdserver: no leader","message":"etcdserver: no leader",)"
                      R"("code":14})",
                      "application/json");
      return true;
    };
    svr_.Post("/v3/lease/grant", [&, body, i64, refuse](const auto& req, auto& res) {
      if (refuse(res)) return;
      std::lock_guard<std::mutex> lock(s.mu);
      const int64_t id = ++s.next_lease;
      s.leases[id] = true;
      ++s.grants;
      res.set_content(R"({"header":)" + Header(s.revision) + R"(,"ID":")" + std::to_string(id) +
                          R"(","TTL":")" + std::to_string(i64(body(req), "TTL")) + R"("})",
                      "application/json");
    });
    svr_.Post("/v3/lease/keepalive", [&, body, i64, refuse](const auto& req, auto& res) {
      if (refuse(res)) return;
      std::lock_guard<std::mutex> lock(s.mu);
      const int64_t id = i64(body(req), "ID");
      ++s.keepalives;
      std::string r =
          R"({"result":{"header":)" + Header(s.revision) + R"(,"ID":")" + std::to_string(id) + "\"";
      if (s.leases.count(id)) r += R"(,"TTL":"3")";
      res.set_content(r + "}}\n", "application/json");
    });
    svr_.Post("/v3/lease/revoke", [&, body, i64, refuse](const auto& req, auto& res) {
      if (refuse(res)) return;
      const int64_t id = i64(body(req), "ID");
      {
        std::lock_guard<std::mutex> lock(s.mu);
        ++s.revokes;
      }
      s.ExpireLease(id);
      res.set_content(R"({"header":{}})", "application/json");
    });
    svr_.Post("/v3/kv/put", [&, body, i64, refuse](const auto& req, auto& res) {
      if (refuse(res)) return;
      json j = body(req);
      std::lock_guard<std::mutex> lock(s.mu);
      const int64_t lease = i64(j, "lease");
      if (lease != 0 && !s.leases.count(lease)) {
        res.status = 404;
        res.set_content(R"({"error":"etcdserver: requested lease not found","code":5})",
                        "application/json");
        return;
      }
      ++s.puts;
      s.PutLocked(*Base64Decode(j.value("key", "")), *Base64Decode(j.value("value", "")), lease);
      res.set_content(R"({"header":)" + Header(s.revision) + "}", "application/json");
    });
    svr_.Post("/v3/kv/range", [&, body, refuse](const auto& req, auto& res) {
      if (refuse(res)) return;
      json j = body(req);
      const std::string from = *Base64Decode(j.value("key", ""));
      const std::string to = *Base64Decode(j.value("range_end", ""));
      std::lock_guard<std::mutex> lock(s.mu);
      json kvs = json::array();
      for (auto& [k, kv] : s.kvs) {
        if (k < from || k >= to) continue;
        kvs.push_back({{"key", Base64Encode(k)},
                       {"value", Base64Encode(kv.value)},
                       {"mod_revision", std::to_string(kv.mod)}});
      }
      json out = {{"header", json::parse(Header(s.revision))}};
      if (!kvs.empty()) out["kvs"] = kvs;
      res.set_content(out.dump(), "application/json");
    });
    svr_.Post("/v3/watch", [&, body, i64](const auto& req, auto& res) {
      json cr = body(req).value("create_request", json::object());
      const std::string from = *Base64Decode(cr.value("key", ""));
      const std::string to = *Base64Decode(cr.value("range_end", ""));
      const int64_t start = i64(cr, "start_revision");
      ++watches_;
      int epoch;
      {
        std::lock_guard<std::mutex> lock(s.mu);
        epoch = s.stream_epoch;
      }
      auto next = std::make_shared<int64_t>(start);
      auto sent_created = std::make_shared<bool>(false);
      res.set_chunked_content_provider(
          "application/json", [&, from, to, epoch, next, sent_created](size_t, auto& sink) {
            std::unique_lock<std::mutex> lock(s.mu);
            if (!*sent_created) {
              *sent_created = true;
              std::string m = R"({"result":{"header":)" + Header(s.revision) +
                              R"(,"created":true}})"
                              "\n";
              if (*next <= s.compacted) {
                m += R"({"result":{"header":{"raft_term":"2"},"canceled":true,)"
                     R"("compact_revision":")" +
                     std::to_string(s.compacted) + "\"}}\n";
                *next = INT64_MAX;  // canceled: etcd keeps the stream open, sends nothing more
              }
              lock.unlock();
              return sink.write(m.data(), m.size());
            }
            s.cv.wait_for(lock, std::chrono::milliseconds(50));
            if (s.stream_epoch != epoch || stopping_) {
              sink.done();
              return true;
            }
            json events = json::array();
            for (const auto& e : s.log) {
              if (e.rev < *next || e.key < from || e.key >= to) continue;
              json kv = {{"key", Base64Encode(e.key)}, {"mod_revision", std::to_string(e.rev)}};
              json ev;
              if (e.value.empty()) {
                ev["type"] = "DELETE";
              } else {
                kv["value"] = Base64Encode(e.value);
              }
              ev["kv"] = kv;
              events.push_back(ev);
            }
            if (*next != INT64_MAX) *next = s.revision + 1;
            if (events.empty()) return true;
            std::string m =
                json{{"result", {{"header", json::parse(Header(s.revision))}, {"events", events}}}}
                    .dump() +
                "\n";
            lock.unlock();
            return sink.write(m.data(), m.size());
          });
    });
    port_ = svr_.bind_to_any_port("127.0.0.1");
    thread_ = std::thread([this] { svr_.listen_after_bind(); });
  }
  ~FakeMember() {
    stopping_ = true;
    store_->DropStreams();
    svr_.stop();
    thread_.join();
  }
  int port() const { return port_; }
  void set_no_leader(bool v) { no_leader_ = v; }
  int watches() const { return watches_.load(); }

 private:
  std::shared_ptr<FakeStore> store_;
  httplib::Server svr_;
  int port_ = 0;
  std::atomic<bool> no_leader_{false};
  std::atomic<bool> stopping_{false};
  std::atomic<int> watches_{0};
  std::thread thread_;
};

template <typename F>
bool WaitFor(F pred, int ms = 5000) {
  for (int i = 0; i < ms / 10; ++i) {
    if (pred()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  return pred();
}

EtcdClientOptions Members(const std::vector<int>& ports) {
  std::string list;
  for (int p : ports) list += (list.empty() ? "" : ",") + ("http://127.0.0.1:" + std::to_string(p));
  auto o = ParseEtcdOptions(list, "", "");
  EXPECT_TRUE(o.ok()) << o.status().ToString();
  o->retry_backoff = 20 * kMillisecond;
  o->request_timeout = 1 * kSecond;
  return *o;
}

// What a feed has seen, as the proxy would hold it.
struct Seen {
  std::mutex mu;
  std::map<std::string, std::string> kvs;
  std::vector<std::string> puts;  // every put applied, in order ("key=value")
  int resets = 0;
  void Apply(std::vector<EtcdKvUpdate> us) {
    std::lock_guard<std::mutex> lock(mu);
    for (auto& u : us) {
      if (u.kind == EtcdKvUpdate::Kind::kReset) {
        ++resets;
        kvs.clear();
        for (auto& [k, v] : u.kvs) kvs[k] = v;
      } else if (u.kind == EtcdKvUpdate::Kind::kPut) {
        kvs[u.key] = u.value;
        puts.push_back(u.key + "=" + u.value);
      } else {
        kvs.erase(u.key);
      }
    }
  }
  std::map<std::string, std::string> Kvs() {
    std::lock_guard<std::mutex> lock(mu);
    return kvs;
  }
};

TEST(EtcdWatchFeed, ListsWatchesAndHealsAcrossDisconnectsAndCompaction) {
  auto store = std::make_shared<FakeStore>();
  store->Put("/p/a", "A");
  store->Put("/other", "X");
  FakeMember m(store);
  Seen seen;
  auto feed = EtcdWatchFeed::Start(Members({m.port()}), "/p/",
                                   [&](std::vector<EtcdKvUpdate> u) { seen.Apply(std::move(u)); });
  ASSERT_TRUE(WaitFor([&] { return seen.Kvs().size() == 1; }));
  store->Put("/p/b", "B");
  store->Delete("/p/a");
  ASSERT_TRUE(WaitFor([&] {
    return seen.Kvs() == std::map<std::string, std::string>{{"/p/b", "B"}};
  }));
  // Gap: the stream ends; a change made while no stream is open arrives once it reconnects,
  // exactly once.
  ASSERT_TRUE(WaitFor([&] { return m.watches() == 1; }));
  store->DropStreams();
  store->Put("/p/c", "C");
  ASSERT_TRUE(WaitFor([&] { return seen.Kvs().count("/p/c") == 1; }));
  EXPECT_GE(m.watches(), 2);
  {
    std::lock_guard<std::mutex> lock(seen.mu);
    EXPECT_EQ(seen.puts, (std::vector<std::string>{"/p/b=B", "/p/c=C"}));
    EXPECT_EQ(seen.resets, 1);
  }
  // Compaction past the revision the feed would resume from: etcd cancels the watch with
  // compact_revision; the feed lists again and the result is the store as it is.
  const int watches = m.watches();
  {
    std::lock_guard<std::mutex> lock(store->mu);
    ++store->stream_epoch;             // end the stream...
    store->PutLocked("/p/d", "D", 0);  // ...change what it watches...
    store->DeleteLocked("/p/b");
    store->compacted = store->revision;  // ...and compact those changes away
    store->cv.notify_all();
  }
  ASSERT_TRUE(WaitFor([&] {
    return seen.Kvs() == std::map<std::string, std::string>{{"/p/c", "C"}, {"/p/d", "D"}};
  }));
  EXPECT_GT(m.watches(), watches);
  EXPECT_EQ(feed->lists(), 2);
  {
    std::lock_guard<std::mutex> lock(seen.mu);
    EXPECT_EQ(seen.resets, 2);
  }
  feed->Stop();
}

TEST(EtcdWatchFeed, FailsOverToAMemberThatAnswers) {
  auto store = std::make_shared<FakeStore>();
  store->Put("/p/a", "A");
  FakeMember leaderless(store);
  leaderless.set_no_leader(true);
  FakeMember ok(store);
  // A member that is down altogether (a port nothing listens on) comes first.
  int dead_port;
  {
    httplib::Server probe;
    dead_port = probe.bind_to_any_port("127.0.0.1");
  }
  Seen seen;
  auto feed = EtcdWatchFeed::Start(Members({dead_port, leaderless.port(), ok.port()}), "/p/",
                                   [&](std::vector<EtcdKvUpdate> u) { seen.Apply(std::move(u)); });
  ASSERT_TRUE(WaitFor([&] { return seen.Kvs().size() == 1; }));
  store->Put("/p/b", "B");
  ASSERT_TRUE(WaitFor([&] { return seen.Kvs().size() == 2; }));
  EXPECT_EQ(leaderless.watches(), 0);
  feed->Stop();
}

TEST(EtcdRegistration, KeepsTheRecordUnderALeaseAndPutsItBackAfterTheLeaseIsLost) {
  auto store = std::make_shared<FakeStore>();
  FakeMember a(store);
  FakeMember b(store);
  auto reg = EtcdRegistration::Start(Members({a.port(), b.port()}), "/p/e1", "rec1", 3);
  ASSERT_TRUE(WaitFor([&] { return reg->registered(); }));
  const int64_t first = reg->lease_id();
  {
    std::lock_guard<std::mutex> lock(store->mu);
    ASSERT_EQ(store->kvs.count("/p/e1"), 1u);
    EXPECT_EQ(store->kvs["/p/e1"].value, "rec1");
    EXPECT_EQ(store->kvs["/p/e1"].lease, first);
  }
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(store->mu);
    return store->keepalives >= 1;
  }));
  // The lease is lost (expired while the engine could reach no member): the key went with it;
  // the next keepalive finds it gone and the record is put back under a new lease.
  a.set_no_leader(true);  // and member a has no leader from now on: b serves
  store->ExpireLease(first);
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(store->mu);
    return store->kvs.count("/p/e1") == 1;
  }));
  EXPECT_EQ(reg->grants(), 2);
  EXPECT_NE(reg->lease_id(), first);
  reg->SetValue("rec2");
  ASSERT_TRUE(WaitFor([&] {
    std::lock_guard<std::mutex> lock(store->mu);
    return store->kvs.count("/p/e1") && store->kvs["/p/e1"].value == "rec2";
  }));
  // Stop revokes: the key goes at once.
  reg->Stop();
  std::lock_guard<std::mutex> lock(store->mu);
  EXPECT_EQ(store->kvs.count("/p/e1"), 0u);
  EXPECT_EQ(store->revokes, 1);
}

TEST(EtcdTrust, RefusesAnOpenStoreOffLoopback) {
  EXPECT_TRUE(ParseEtcdOptions("http://127.0.0.1:2379,http://localhost:2380", "", "").ok());
  auto open = ParseEtcdOptions("http://127.0.0.1:2379,http://10.1.2.3:2379", "", "");
  ASSERT_FALSE(open.ok());
  EXPECT_NE(open.status().message().find("refusing etcd member http://10.1.2.3:2379"),
            std::string::npos);
  EXPECT_NE(open.status().message().find("--etcd-user"), std::string::npos);
  EXPECT_FALSE(ParseEtcdOptions("https://10.1.2.3:2379", "", "").ok());  // https, no CA
  EXPECT_TRUE(ParseEtcdOptions("https://10.1.2.3:2379", "", "ca.pem").ok());
  auto user = ParseEtcdOptions("http://10.1.2.3:2379", "kvb:secret", "");
  ASSERT_TRUE(user.ok());
  EXPECT_EQ(user->user, "kvb");
  EXPECT_EQ(user->password, "secret");
  EXPECT_FALSE(ParseEtcdOptions("http://127.0.0.1:2379", "nopassword", "").ok());
  EXPECT_FALSE(ParseEtcdOptions("", "", "").ok());
}

TEST(EtcdRegistrySync, RegistersVerifiedRecordsAndIgnoresBadOnes) {
  InstanceRegistry reg({.mode = KvTransferMode::kRead});
  EtcdRegistrySync sync("tok");
  std::vector<std::string> log;
  InstanceInfo info;
  info.role = Role::kDecode;
  info.url = "http://127.0.0.1:8200";
  info.name = "decode-0";
  const std::string key = "/kvbridge/c/instances/decode-0";
  const std::string good = EtcdRecordValue(key, RegistrationJson(info, {}), "tok");
  sync.Apply({.kind = EtcdKvUpdate::Kind::kPut, .key = key, .value = good}, reg, 0, &log);
  ASSERT_EQ(reg.List().size(), 1u);
  EXPECT_TRUE(reg.List()[0].from_store);
  EXPECT_TRUE(reg.Expire(1000 * kSecond).empty());  // no heartbeat expiry
  // A bad HMAC, malformed JSON, a record the registry refuses: ignored, logged, never routed.
  const std::string forged =
      EtcdRecordValue("/kvbridge/c/instances/evil", RegistrationJson(info, {}), "not-the-token");
  sync.Apply(
      {.kind = EtcdKvUpdate::Kind::kPut, .key = "/kvbridge/c/instances/evil", .value = forged}, reg,
      0, &log);
  sync.Apply({.kind = EtcdKvUpdate::Kind::kPut,
              .key = "/kvbridge/c/instances/junk",
              .value = "{\"record\": "},
             reg, 0, &log);
  InstanceInfo write = info;
  write.mode = KvTransferMode::kWrite;
  write.url = "http://127.0.0.1:8300";
  sync.Apply(
      {.kind = EtcdKvUpdate::Kind::kPut,
       .key = "/kvbridge/c/instances/w",
       .value = EtcdRecordValue("/kvbridge/c/instances/w", RegistrationJson(write, {}), "tok")},
      reg, 0, &log);
  EXPECT_EQ(sync.rejected(), 3);
  ASSERT_EQ(reg.List().size(), 1u);
  EXPECT_EQ(reg.List()[0].info.url, "http://127.0.0.1:8200");
  ASSERT_EQ(log.size(), 4u);
  EXPECT_NE(log[1].find("ignored: its HMAC does not verify"), std::string::npos) << log[1];
  EXPECT_NE(log[2].find("ignored"), std::string::npos);
  // Deleted (lease expired): gone. A reset re-lists.
  sync.Apply({.kind = EtcdKvUpdate::Kind::kDelete, .key = key}, reg, 0, &log);
  EXPECT_TRUE(reg.List().empty());
  sync.Apply({.kind = EtcdKvUpdate::Kind::kReset, .kvs = {{key, good}}}, reg, 0, &log);
  EXPECT_EQ(reg.List().size(), 1u);
  sync.Apply({.kind = EtcdKvUpdate::Kind::kReset}, reg, 0, &log);
  EXPECT_TRUE(reg.List().empty());
}

}  // namespace
}  // namespace kvbridge::proxy
