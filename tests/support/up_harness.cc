#include "support/up_harness.h"

#include <gtest/gtest.h>
#include <httplib.h>
#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <regex>

#include "kvbridge/common/metrics.h"
#include "support/free_port.h"

namespace kvbridge::testing {

using nlohmann::json;

namespace {

json Answer(const httplib::Result& r) {
  if (!r) return json{{"transport_error", httplib::to_string(r.error())}};
  json j = json::parse(r->body, nullptr, false);
  if (j.is_discarded()) j = json{{"raw", r->body}};
  j["_status"] = r->status;
  return j;
}

}  // namespace

json PostRaw(int port, const std::string& path, const std::string& body, int read_timeout_s) {
  httplib::Client c("127.0.0.1", port);
  c.set_read_timeout(read_timeout_s, 0);
  return Answer(c.Post(path.c_str(), body, "application/json"));
}

json PostJson(int port, const std::string& path, const json& body, int read_timeout_s) {
  return PostRaw(port, path, body.dump(), read_timeout_s);
}

int PortOf(const std::string& url) { return std::atoi(url.c_str() + url.rfind(':') + 1); }

std::string GetBody(const std::string& url, const std::string& path) {
  httplib::Client c("127.0.0.1", PortOf(url));
  c.set_read_timeout(10, 0);
  auto r = c.Get(path.c_str());
  return r && r->status == 200 ? r->body : std::string();
}

UpTopology::UpTopology(const std::string& dir, std::vector<std::string> args) {
  auto has = [&](const char* flag) {
    return std::find(args.begin(), args.end(), flag) != args.end();
  };
  auto it = std::find(args.begin(), args.end(), "--port");
  if (it != args.end() && it + 1 != args.end()) {
    port_ = std::atoi((it + 1)->c_str());
  } else {
    port_ = FreePort();
    args.insert(args.end(), {"--port", std::to_string(port_)});
  }
  if (!has("--log-dir")) args.insert(args.end(), {"--log-dir", dir + "/logs"});
  if (!has("--ready-timeout")) args.insert(args.end(), {"--ready-timeout", "240"});
  args.insert(args.begin(), {KvbridgeBin(), "up"});
  process_ = std::make_unique<Subprocess>(std::move(args), dir + "/up.log");
}

bool UpTopology::WaitReady() {
  for (int i = 0; i < 2400 && process_->Running(); ++i) {
    if (process_->ReadLog().find("ready in") != std::string::npos) return true;
    usleep(100'000);
  }
  return false;
}

std::map<std::string, int> UpTopology::Pids() const {
  const std::string log = ReadLog();
  std::map<std::string, int> pids;
  static const std::regex re(R"((\S+)\s+http://127\.0\.0\.1:\d+\s+pid (\d+))");
  for (auto m = std::sregex_iterator(log.begin(), log.end(), re); m != std::sregex_iterator();
       ++m) {
    pids.emplace((*m)[1].str(), std::stoi((*m)[2].str()));
  }
  return pids;
}

int UpTopology::Stop(int timeout_ms) {
  process_->Signal(SIGTERM);
  return process_->Wait(timeout_ms);
}

json InstanceNamed(const std::string& host, const std::string& name) {
  json inst = json::parse(GetBody(host, "/instances"), nullptr, false);
  if (!inst.is_object() || !inst.contains("instances")) return nullptr;
  for (const auto& i : inst["instances"]) {
    if (i.value("name", "") == name) return i;
  }
  return nullptr;
}

bool WaitRestarted(const std::string& host, const std::string& name, int restarts) {
  for (int i = 0; i < 1200; ++i) {
    json e = InstanceNamed(host, name);
    if (!e.is_null() && e.value("restarts", -1) == restarts && e.value("healthy", false) &&
        !e.value("draining", true)) {
      return true;
    }
    usleep(100'000);
  }
  return false;
}

json ExpectEveryInstanceDrained(const std::string& host) {
  json inst = json::parse(GetBody(host, "/instances"), nullptr, false);
  EXPECT_TRUE(inst.is_object() && inst.contains("instances")) << inst.dump();
  if (!inst.is_object() || !inst.contains("instances")) return json::array();
  for (const auto& i : inst["instances"]) {
    const std::string url = i["url"];
    std::string m;
    for (int w = 0; w < 100; ++w) {
      m = GetBody(url, "/metrics");
      if (!m.empty() && ScrapeMetric(m, "kvbridge_kv_blocks_active") == 0.0 &&
          ScrapeMetric(m, "kvbridge_kv_blocks_held_for_transfer") == 0.0) {
        break;
      }
      usleep(100'000);
    }
    EXPECT_FALSE(m.empty()) << url;
    EXPECT_EQ(ScrapeMetric(m, "kvbridge_kv_blocks_active"), 0.0) << url;
    EXPECT_EQ(ScrapeMetric(m, "kvbridge_kv_blocks_held_for_transfer"), 0.0) << url;
    EXPECT_EQ(ScrapeMetric(m, "kvbridge_kv_lease_expired_total"), 0.0) << url;
    EXPECT_EQ(ScrapeMetric(m, "kvbridge_kv_notifications_ignored_total"), 0.0) << url;
  }
  return inst["instances"];
}

LoadLoop::LoadLoop(int port, json body, int clients) {
  for (int c = 0; c < clients; ++c) {
    threads_.emplace_back([this, port, body] {
      while (!stop_) {
        json got = PostJson(port, "/v1/completions", body);
        if (got["_status"] == 200) {
          ++ok_;
        } else {
          std::lock_guard<std::mutex> lock(mu_);
          failures_.push_back(got.dump());
        }
      }
    });
  }
}

void LoadLoop::WaitOk(int n) {
  for (int i = 0; i < 600 && ok_ < n; ++i) usleep(100'000);
}

void LoadLoop::Stop() {
  stop_ = true;
  for (auto& t : threads_) t.join();
  threads_.clear();
}

std::vector<std::string> LoadLoop::failures() const {
  std::lock_guard<std::mutex> lock(mu_);
  return failures_;
}

}  // namespace kvbridge::testing
