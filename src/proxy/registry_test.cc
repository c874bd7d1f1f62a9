#include "kvbridge/proxy/registry.h"

#include <gtest/gtest.h>

namespace kvbridge::proxy {
namespace {

InstanceInfo Info(const std::string& id, Role role, KvTransferMode mode = KvTransferMode::kRead) {
  InstanceInfo i;
  i.id = id;
  i.role = role;
  i.url = "http://127.0.0.1:" + std::to_string(9000 + id.size() * 7 + id.back());
  i.mode = mode;
  i.engine_id = "e-" + id;
  i.transfer_endpoints = {"tcp://127.0.0.2:7777"};
  return i;
}

TEST(InstanceRegistry, StaticInstancesValidated) {
  InstanceRegistry reg({});
  EXPECT_TRUE(reg.AddStatic(Role::kPrefill, "http://127.0.0.1:8000/").ok());
  EXPECT_EQ(reg.AddStatic(Role::kPrefill, "http://127.0.0.1:8000").code(),
            StatusCode::kAlreadyExists);
  EXPECT_EQ(reg.AddStatic(Role::kDecode, "127.0.0.1:8000").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.AddStatic(Role::kDecode, "http://h:x").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.AddStatic(Role::kDecode, "http://a\"b:80").code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(reg.AddStatic(Role::kDecode, "http://h:123456").code(), StatusCode::kInvalidArgument);
  auto ep = reg.Pick(Role::kPrefill, {});
  ASSERT_TRUE(ep.has_value());
  EXPECT_EQ(ep->url, "http://127.0.0.1:8000");
  EXPECT_FALSE(reg.Pick(Role::kDecode, {}).has_value());
  // The same engine may also be listed as a decode (kv_both).
  ASSERT_TRUE(reg.AddStatic(Role::kDecode, "http://127.0.0.1:8000").ok());
  EXPECT_EQ(reg.Pick(Role::kDecode, {})->url, "http://127.0.0.1:8000");
  EXPECT_EQ(reg.Pick(Role::kDecode, {})->id, "http://127.0.0.1:8000#decode");
  EXPECT_EQ(reg.AddStatic(Role::kDecode, "http://127.0.0.1:8000").code(),
            StatusCode::kAlreadyExists);
}

TEST(InstanceRegistry, MixedModeRefusedWithReason) {
  InstanceRegistry reg({.mode = KvTransferMode::kRead});
  Status s = reg.Register(Info("w", Role::kDecode, KvTransferMode::kWrite), {}, 0);
  EXPECT_EQ(s.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(s.message().find("mixed READ/WRITE"), std::string::npos);
  EXPECT_TRUE(reg.List().empty());
}

TEST(InstanceRegistry, HeartbeatKeepsAliveAndExpiryDrops) {
  InstanceRegistry reg({.heartbeat_timeout = 3 * kSecond});
  ASSERT_TRUE(reg.Register(Info("d1", Role::kDecode), {}, 0).ok());
  ASSERT_TRUE(reg.AddStatic(Role::kDecode, "http://127.0.0.1:1").ok());
  EXPECT_TRUE(reg.Expire(3 * kSecond).empty());
  ASSERT_TRUE(reg.Heartbeat("d1", {1, 2, 0.5}, 2 * kSecond).ok());
  EXPECT_TRUE(reg.Expire(5 * kSecond).empty());
  EXPECT_EQ(reg.Get("d1")->load.waiting, 2);
  auto dropped = reg.Expire(5 * kSecond + 1);
  ASSERT_EQ(dropped, std::vector<std::string>{"d1"});
  EXPECT_EQ(reg.Heartbeat("d1", {}, 6 * kSecond).code(), StatusCode::kNotFound);
  EXPECT_EQ(reg.List().size(), 1u);  // the static one stays
}

TEST(InstanceRegistry, LeastLoadedUsesHeartbeatAndInFlight) {
  InstanceRegistry reg({});
  ASSERT_TRUE(reg.Register(Info("a", Role::kDecode), {5, 0, 0.1}, 0).ok());
  ASSERT_TRUE(reg.Register(Info("b", Role::kDecode), {1, 1, 0.9}, 0).ok());
  ASSERT_TRUE(reg.Register(Info("c", Role::kDecode), {0, 3, 0.0}, 0).ok());
  EXPECT_EQ(reg.Pick(Role::kDecode, {})->id, "b");  // 2 < 3 < 5
  reg.LegStarted("b");
  reg.LegStarted("b");
  EXPECT_EQ(reg.Pick(Role::kDecode, {})->id, "c");  // b now 4
  EXPECT_EQ(reg.Pick(Role::kDecode, {"c"})->id, "b");
  reg.LegFinished("b");
  reg.LegFinished("b");
  EXPECT_EQ(reg.Get("b")->in_flight, 0);
  reg.SetHealthy("b", false);
  EXPECT_EQ(reg.Pick(Role::kDecode, {})->id, "c");
  EXPECT_FALSE(reg.Pick(Role::kDecode, {"a", "c"}).has_value());
}

TEST(InstanceRegistry, RoundRobinCycles) {
  InstanceRegistry reg({.policy = RoutingPolicy::kRoundRobin});
  ASSERT_TRUE(reg.Register(Info("a", Role::kDecode), {9, 9, 1}, 0).ok());
  ASSERT_TRUE(reg.Register(Info("b", Role::kDecode), {}, 0).ok());
  std::vector<std::string> got;
  for (int i = 0; i < 4; ++i) got.push_back(reg.Pick(Role::kDecode, {})->id);
  EXPECT_EQ(got, (std::vector<std::string>{"a", "b", "a", "b"}));
}

TEST(InstanceRegistry, EndpointCarriesTransferAddress) {
  InstanceRegistry reg({});
  ASSERT_TRUE(reg.Register(Info("p", Role::kPrefill), {}, 0).ok());
  Endpoint ep = *reg.Pick(Role::kPrefill, {});
  EXPECT_EQ(ep.engine_id, "e-p");
  EXPECT_EQ(ep.transfer_host, "127.0.0.2");
  EXPECT_EQ(ep.transfer_port, 7777);
}

TEST(Registration, JsonRoundTripAndErrors) {
  InstanceInfo i = Info("x", Role::kPrefill, KvTransferMode::kWrite);
  auto r = ParseRegistration(RegistrationJson(i, {3, 4, 0.25}));
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->first.id, "x");
  EXPECT_EQ(r->first.role, Role::kPrefill);
  EXPECT_EQ(r->first.mode, KvTransferMode::kWrite);
  EXPECT_EQ(r->first.url, i.url);
  EXPECT_EQ(r->first.transfer_endpoints, i.transfer_endpoints);
  EXPECT_EQ(r->first.tp_size, 1);
  EXPECT_EQ(r->second.running, 3);
  EXPECT_EQ(r->second.waiting, 4);
  EXPECT_DOUBLE_EQ(r->second.kv_usage, 0.25);
  EXPECT_EQ(ParseRegistration("nope").status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(ParseRegistration(R"({"url":"http://a:1"})").status().message().find("role"),
            std::string::npos);
  EXPECT_FALSE(ParseRegistration(R"({"url":"http://a:1","role":"both"})").ok());
  EXPECT_FALSE(ParseRegistration(R"({"url":1,"role":"decode"})").ok());
  EXPECT_FALSE(
      ParseRegistration(R"({"url":"http://a:1","role":"decode","load":{"running":-1}})").ok());
  EXPECT_FALSE(ParseLoad(R"({"kv_usage":"x"})").ok());
  EXPECT_EQ(ParseLoad("{}")->running, 0);
}

TEST(Registration, KvRoleKvBoth) {
  InstanceInfo i = Info("d", Role::kDecode, KvTransferMode::kRead);
  EXPECT_FALSE(ParseRegistration(RegistrationJson(i, {}))->first.kv_both);
  i.kv_both = true;
  const std::string text = RegistrationJson(i, {});
  EXPECT_NE(text.find(R"("kv_role":"kv_both")"), std::string::npos) << text;
  auto r = ParseRegistration(text);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_TRUE(r->first.kv_both);
  EXPECT_EQ(r->first.role, Role::kDecode);
  EXPECT_FALSE(ParseRegistration(R"({"url":"http://a:1","role":"decode","kv_role":"kv_consumer"})")
                   ->first.kv_both);
  auto bad = ParseRegistration(R"({"url":"http://a:1","role":"decode","kv_role":"both"})");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("kv_role"), std::string::npos);
  EXPECT_FALSE(ParseRegistration(R"({"url":"http://a:1","role":"decode","kv_role":1})").ok());
}

TEST(Registration, TpSizeIsRegisteredAndReachesTheEndpoint) {
  InstanceInfo i = Info("p", Role::kPrefill, KvTransferMode::kWrite);
  i.tp_size = 2;
  const std::string text = RegistrationJson(i, {});
  EXPECT_NE(text.find(R"("tp_size":2)"), std::string::npos) << text;
  auto r = ParseRegistration(text);
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->first.tp_size, 2);
  InstanceRegistry reg({.mode = KvTransferMode::kWrite});
  ASSERT_TRUE(reg.Register(r->first, {}, 0).ok());
  EXPECT_EQ(reg.Pick(Role::kPrefill, {})->tp_size, 2);
  EXPECT_EQ(reg.Get("p")->info.tp_size, 2);
  // Absent: 1 (engines that predate the field). Static instances: 1.
  EXPECT_EQ(ParseRegistration(R"({"url":"http://a:1","role":"decode"})")->first.tp_size, 1);
  ASSERT_TRUE(reg.AddStatic(Role::kDecode, "http://127.0.0.1:8000").ok());
  EXPECT_EQ(reg.Pick(Role::kDecode, {})->tp_size, 1);
  for (const char* bad : {"0", "65", "-1", "1.5", "\"2\"", "true"}) {
    auto b = ParseRegistration(std::string(R"({"url":"http://a:1","role":"decode","tp_size":)") +
                               bad + "}");
    EXPECT_EQ(b.status().code(), StatusCode::kInvalidArgument) << bad;
    EXPECT_NE(b.status().message().find("tp_size"), std::string::npos) << bad;
  }
  EXPECT_EQ(
      ParseRegistration(R"({"url":"http://a:1","role":"decode","tp_size":64})")->first.tp_size, 64);
}

// Issue 21: `up` restarts an engine at a new url under the same name; the new incarnation's
// registration replaces the old one, and restarts reach GET /instances.
TEST(InstanceRegistry, ANameRegisteredAgainReplacesTheEarlierIncarnation) {
  InstanceRegistry reg({});
  InstanceInfo old_one = Info("http://127.0.0.1:9001", Role::kDecode);
  old_one.url = "http://127.0.0.1:9001";
  old_one.name = "decode-0";
  InstanceInfo other = Info("http://127.0.0.1:9002", Role::kDecode);
  other.url = "http://127.0.0.1:9002";
  other.name = "decode-1";
  ASSERT_TRUE(reg.Register(old_one, {}, 0).ok());
  ASSERT_TRUE(reg.Register(other, {}, 0).ok());
  InstanceInfo fresh = old_one;
  fresh.id = fresh.url = "http://127.0.0.1:9003";
  fresh.restarts = 1;
  std::vector<std::string> replaced;
  ASSERT_TRUE(reg.Register(fresh, {}, 1, &replaced).ok());
  EXPECT_EQ(replaced, std::vector<std::string>{"http://127.0.0.1:9001"});
  ASSERT_EQ(reg.List().size(), 2u);
  EXPECT_FALSE(reg.Get("http://127.0.0.1:9001").has_value());
  EXPECT_EQ(reg.Find("decode-0")->info.url, "http://127.0.0.1:9003");
  EXPECT_EQ(reg.Find("decode-0")->info.restarts, 1);
  EXPECT_EQ(reg.Find("http://127.0.0.1:9002")->info.name, "decode-1");
  EXPECT_FALSE(reg.Find("decode-7").has_value());
  // Re-registering the same id (a heartbeat 404) replaces nothing else.
  replaced.clear();
  ASSERT_TRUE(reg.Register(fresh, {}, 2, &replaced).ok());
  EXPECT_TRUE(replaced.empty());
  InstanceInfo bad = fresh;
  bad.name = "no spaces";
  EXPECT_EQ(reg.Register(bad, {}, 3).code(), StatusCode::kInvalidArgument);
}

TEST(InstanceRegistry, DrainingInstanceIsNeverPicked) {
  InstanceRegistry reg({.policy = RoutingPolicy::kRoundRobin});
  ASSERT_TRUE(reg.Register(Info("a", Role::kDecode), {}, 0).ok());
  ASSERT_TRUE(reg.Register(Info("b", Role::kDecode), {}, 0).ok());
  ASSERT_TRUE(reg.SetDraining("a").ok());
  for (int i = 0; i < 4; ++i) EXPECT_EQ(reg.Pick(Role::kDecode, {})->id, "b");
  // A heartbeat does not undo it.
  ASSERT_TRUE(reg.Heartbeat("a", {}, 1).ok());
  EXPECT_TRUE(reg.Get("a")->draining);
  EXPECT_EQ(reg.Pick(Role::kDecode, {})->id, "b");
  ASSERT_TRUE(reg.SetDraining("b").ok());
  EXPECT_FALSE(reg.Pick(Role::kDecode, {}).has_value());
  EXPECT_EQ(reg.SetDraining("zz").code(), StatusCode::kNotFound);
}

TEST(Registration, NameAndRestartsRoundTrip) {
  InstanceInfo info = Info("x", Role::kPrefill);
  info.name = "prefill-0";
  info.restarts = 3;
  auto parsed = ParseRegistration(RegistrationJson(info, {}));
  ASSERT_TRUE(parsed.ok()) << parsed.status().ToString();
  EXPECT_EQ(parsed->first.name, "prefill-0");
  EXPECT_EQ(parsed->first.restarts, 3);
  EXPECT_EQ(
      ParseRegistration(R"({"role":"decode","url":"http://h:1","restarts":-1})").status().code(),
      StatusCode::kInvalidArgument);
  EXPECT_EQ(ParseRegistration(R"({"role":"decode","url":"http://h:1","name":7})").status().code(),
            StatusCode::kInvalidArgument);
  auto plain = ParseRegistration(R"({"role":"decode","url":"http://h:1"})");
  ASSERT_TRUE(plain.ok());
  EXPECT_EQ(plain->first.name, "");
  EXPECT_EQ(plain->first.restarts, 0);
}

}  // namespace
}  // namespace kvbridge::proxy
