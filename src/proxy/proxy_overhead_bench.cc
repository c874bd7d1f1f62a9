// proxy_overhead_bench: the latency the P/D proxy adds, against nginx as a reverse proxy, in one
// run against the same upstream (docs/proxy.md has the figures and the command).
//
//   build/bin/proxy_overhead_bench --kvbridge build/bin/kvbridge [--requests 2000] [--rounds 5]
//       [--nginx PATH] [--only kvbridge-colo]   (one path alone, to profile its process under load)
//
// The upstream is a fake OpenAI engine in this process that answers at once (so what is measured
// is the proxies, not a model): a prefill-shaped request (kv_transfer_params.do_remote_decode)
// gets kv_transfer_params back, anything else a fixed completion. One client (keep-alive,
// concurrency 1) sends rounds of one request per path, interleaved so drift hits all alike:
//   direct        straight to the upstream;
//   nginx         nginx (1 worker, access log off) with its default upstream settings: HTTP/1.0,
//                 a new connection per request;
//   nginx-ka      the same nginx, a second server block whose upstream keeps 16 connections alive
//                 (`keepalive 16`, HTTP/1.1) — nginx at its best;
//   kvbridge      `kvbridge proxy` (own process, 1 event-loop thread), the fake as prefill and
//                 decode, keep-alive upstream pool on (the default);
//   kvbridge-np   the same with --upstream-max-idle 0 (a new connection per leg, as before);
//   kvbridge-colo `kvbridge proxy --colocated` (1 event-loop thread, pool on): one leg per
//                 request, the same single upstream call nginx makes — the like-for-like path.
//   kvbridge-rr   P/D as kvbridge with --routing round-robin, and a body whose prompt is 512 token
//                 ids (32 blocks of 16);
//   kvbridge-kv   the same body through --routing kv-aware: the proxy parses the ids, hashes the
//                 32 blocks and looks each candidate up in its index, which follows the fake's
//                 GET /v1/kv/events (a snapshot holding the prompt's blocks, then long polls that
//                 answer no change) — the price of the feature, next to kvbridge-rr.
// A P/D request through kvbridge makes two upstream calls (prefill leg, then decode leg) by design,
// where nginx makes one; the report gives the added latency raw and beyond the second call, and
// compares kvbridge-colo (one call) with nginx for the goal. The requests are split into --rounds
// rounds; each round gives its added p50 per path and the ratios colo / nginx-ka and
// P/D / (2 x nginx-ka); the verdict is on the median ratio over rounds (printed with its min-max).
#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/common/block_hash.h"
#include "kvbridge/common/metrics.h"

namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  int port = -1;
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  ::close(fd);
  return port;
}

pid_t Spawn(std::vector<std::string> argv, const std::string& log) {
  std::vector<char*> args;
  for (auto& a : argv) args.push_back(a.data());
  args.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid != 0) return pid;
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  int fd = ::open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
  if (fd >= 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::close(fd);
  }
  ::execv(args[0], args.data());
  ::_exit(127);
}

bool WaitHttp(int port, const std::string& path, int ms) {
  auto end = Clock::now() + std::chrono::milliseconds(ms);
  while (Clock::now() < end) {
    httplib::Client c("127.0.0.1", port);
    auto r = c.Get(path.c_str());
    if (r && r->status < 500) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}
double Quantile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[std::min(v.size() - 1, static_cast<size_t>(q * v.size()))];
}

}  // namespace

int main(int argc, char** argv) {
  std::string kvbridge = "build/bin/kvbridge", nginx = "/usr/sbin/nginx";
  int requests = 2000, rounds = 5;
  std::string only;  // one path alone (e.g. kvbridge-colo), to profile that process under load
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i];
    if (k == "--kvbridge")
      kvbridge = argv[i + 1];
    else if (k == "--nginx")
      nginx = argv[i + 1];
    else if (k == "--requests")
      requests = std::atoi(argv[i + 1]);
    else if (k == "--rounds")
      rounds = std::max(1, std::atoi(argv[i + 1]));
    else if (k == "--only")
      only = argv[i + 1];
    else {
      std::fprintf(stderr,
                   "usage: %s [--kvbridge PATH] [--nginx PATH] [--requests N] [--rounds R] "
                   "[--only PATH_NAME]\n",
                   argv[0]);
      return 2;
    }
  }
  if (::access(nginx.c_str(), X_OK) != 0 || ::access(kvbridge.c_str(), X_OK) != 0) {
    std::fprintf(stderr, "need nginx (%s) and kvbridge (%s)\n", nginx.c_str(), kvbridge.c_str());
    return 2;
  }
  const std::string completion =
      R"({"id":"cmpl-1","object":"text_completion","model":"fake","choices":[{"index":0,)"
      R"("text":" hello world","finish_reason":"length"}],"usage":{"prompt_tokens":8,)"
      R"("completion_tokens":2,"total_tokens":10}})";
  httplib::Server upstream;
  upstream.Post("/v1/completions", [&](const httplib::Request& req, httplib::Response& res) {
    json b = json::parse(req.body, nullptr, false);
    if (b.is_object() && b.contains("kv_transfer_params") &&
        b["kv_transfer_params"].value("do_remote_decode", false)) {
      json out = {{"choices", {{{"text", "x"}}}},
                  {"kv_transfer_params",
                   {{"transfer_id", b["kv_transfer_params"]["transfer_id"]},
                    {"remote_engine_id", "fake"},
                    {"remote_host", "127.0.0.1"},
                    {"remote_port", 1},
                    {"remote_block_ids", {1}},
                    {"remote_num_tokens", 8},
                    {"tp_size", 1}}}};
      res.set_content(out.dump(), "application/json");
      return;
    }
    res.set_content(completion, "application/json");
  });
  upstream.Get("/health", [](const httplib::Request&, httplib::Response& res) {
    res.set_content("ok", "text/plain");
  });
  // The kv-aware proxy's index: the first poll gets a snapshot holding the ids prompt's blocks;
  // later polls (this incarnation, at the head) wait their timeout and answer no change.
  std::vector<int32_t> ids_prompt(512);
  for (size_t i = 0; i < ids_prompt.size(); ++i) ids_prompt[i] = static_cast<int32_t>(1000 + i);
  const kvbridge::BlockHash root = kvbridge::RootBlockHash("proxy-overhead-fake");
  std::vector<kvbridge::BlockHash> prompt_hashes;
  kvbridge::AppendBlockHashes(root, ids_prompt, 16, &prompt_hashes);
  std::mutex stop_mu;
  std::condition_variable stop_cv;
  bool stopping = false;
  upstream.Get("/v1/kv/events", [&](const httplib::Request& req, httplib::Response& res) {
    json out = {{"incarnation", "0123456789abcdef"},
                {"block_size", 16},
                {"root", kvbridge::BlockHashHex(root)},
                {"head_seq", prompt_hashes.size()},
                {"next_since", prompt_hashes.size()},
                {"reset", false},
                {"events", json::array()}};
    if (req.get_param_value("incarnation") != "0123456789abcdef") {
      out["reset"] = true;
      out["snapshot"] = json::array();
      for (const auto& h : prompt_hashes) out["snapshot"].push_back(kvbridge::BlockHashHex(h));
    } else {
      const int ms = std::clamp(std::atoi(req.get_param_value("timeout_ms").c_str()), 0, 30000);
      std::unique_lock<std::mutex> l(stop_mu);
      stop_cv.wait_for(l, std::chrono::milliseconds(ms), [&] { return stopping; });
    }
    res.set_content(out.dump(), "application/json");
  });
  // Each keep-alive connection (ours, nginx-ka's, the proxies' pools) and each KV-events long
  // poll holds one of httplib's workers: more than its default 8.
  upstream.new_task_queue = [] { return new httplib::ThreadPool(64); };
  upstream.set_tcp_nodelay(true);
  upstream.set_keep_alive_max_count(1 << 30);  // keep-alive clients (ours, nginx-ka) keep theirs
  int up_port = upstream.bind_to_any_port("127.0.0.1");
  std::thread up_thread([&] { upstream.listen_after_bind(); });
  // stop() before the listen loop runs would be lost (cpp-httplib) and the join would hang.
  for (int i = 0; i < 5000 && !upstream.is_running(); ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }

  std::string dir =
      (std::filesystem::temp_directory_path() / ("kvb-overhead-" + std::to_string(::getpid())))
          .string();
  std::filesystem::create_directories(dir);
  int nginx_port = FreePort(), nginx_ka_port = FreePort(), proxy_port = FreePort(),
      proxy_np_port = FreePort(), proxy_colo_port = FreePort(), proxy_rr_port = FreePort(),
      proxy_kv_port = FreePort();
  {
    std::ofstream conf(dir + "/nginx.conf");
    conf << "worker_processes 1;\ndaemon off;\npid " << dir << "/nginx.pid;\nerror_log " << dir
         << "/error.log;\nevents { worker_connections 1024; }\nhttp {\n  access_log off;\n"
         << "  client_body_temp_path " << dir << "/body;\n  proxy_temp_path " << dir
         << "/proxy;\n  fastcgi_temp_path " << dir << "/fcgi;\n  uwsgi_temp_path " << dir
         << "/uwsgi;\n  scgi_temp_path " << dir << "/scgi;\n"
         << "  server {\n    listen 127.0.0.1:" << nginx_port << ";\n"
         << "    location / { proxy_pass http://127.0.0.1:" << up_port
         << "; proxy_buffering off; }\n  }\n"
         << "  upstream engine { server 127.0.0.1:" << up_port << "; keepalive 16; }\n"
         << "  server {\n    listen 127.0.0.1:" << nginx_ka_port << ";\n"
         << "    location / { proxy_pass http://engine; proxy_http_version 1.1;"
         << " proxy_set_header Connection \"\"; proxy_buffering off; }\n  }\n}\n";
  }
  std::string up_url = "http://127.0.0.1:" + std::to_string(up_port);
  pid_t nginx_pid = Spawn({nginx, "-p", dir, "-c", dir + "/nginx.conf"}, dir + "/nginx.out");
  pid_t proxy_pid = Spawn({kvbridge, "proxy", "--port", std::to_string(proxy_port), "--prefill",
                           up_url, "--decode", up_url, "--threads", "1"},
                          dir + "/proxy.out");
  pid_t proxy_np_pid =
      Spawn({kvbridge, "proxy", "--port", std::to_string(proxy_np_port), "--prefill", up_url,
             "--decode", up_url, "--threads", "1", "--upstream-max-idle", "0"},
            dir + "/proxy-np.out");
  pid_t proxy_colo_pid = Spawn({kvbridge, "proxy", "--port", std::to_string(proxy_colo_port),
                                "--colocated", "--decode", up_url, "--threads", "1"},
                               dir + "/proxy-colo.out");
  pid_t proxy_rr_pid =
      Spawn({kvbridge, "proxy", "--port", std::to_string(proxy_rr_port), "--prefill", up_url,
             "--decode", up_url, "--threads", "1", "--routing", "round-robin"},
            dir + "/proxy-rr.out");
  pid_t proxy_kv_pid =
      Spawn({kvbridge, "proxy", "--port", std::to_string(proxy_kv_port), "--prefill", up_url,
             "--decode", up_url, "--threads", "1", "--routing", "kv-aware"},
            dir + "/proxy-kv.out");
  int rc = 0;
  if (!WaitHttp(nginx_port, "/health", 10000) || !WaitHttp(nginx_ka_port, "/health", 10000) ||
      !WaitHttp(proxy_port, "/health", 10000) || !WaitHttp(proxy_np_port, "/health", 10000) ||
      !WaitHttp(proxy_colo_port, "/health", 10000) || !WaitHttp(proxy_rr_port, "/health", 10000) ||
      !WaitHttp(proxy_kv_port, "/health", 10000)) {
    std::fprintf(stderr, "nginx or kvbridge proxy did not start; logs kept in %s\n", dir.c_str());
    rc = 1;
  } else {
    const std::string body = R"({"model":"fake","prompt":"hello","max_tokens":2})";
    const std::string ids_body =
        json{{"model", "fake"}, {"prompt", ids_prompt}, {"max_tokens", 2}}.dump();
    struct Path {
      const char* name;
      int port;
      const std::string* body;
      std::vector<double> us;
      std::vector<std::vector<double>> per_round;
    } paths[] = {{"direct", up_port, &body},
                 {"nginx", nginx_port, &body},
                 {"nginx-ka", nginx_ka_port, &body},
                 {"kvbridge", proxy_port, &body},
                 {"kvbridge-np", proxy_np_port, &body},
                 {"kvbridge-colo", proxy_colo_port, &body},
                 {"kvbridge-rr", proxy_rr_port, &ids_body},
                 {"kvbridge-kv", proxy_kv_port, &ids_body}};
    constexpr size_t kPaths = sizeof(paths) / sizeof(paths[0]);
    std::vector<std::unique_ptr<httplib::Client>> clients;
    for (auto& p : paths) {
      clients.push_back(std::make_unique<httplib::Client>("127.0.0.1", p.port));
      clients.back()->set_keep_alive(true);
      clients.back()->set_tcp_nodelay(true);  // else Nagle + delayed ACK add ~40 ms
    }
    int errors = 0;
    for (int i = 0; i < requests + 100; ++i) {
      for (size_t k = 0; k < kPaths; ++k) {
        if (!only.empty() && only != paths[k].name) continue;
        auto t0 = Clock::now();
        auto r = clients[k]->Post("/v1/completions", *paths[k].body, "application/json");
        double us = std::chrono::duration<double, std::micro>(Clock::now() - t0).count();
        if (!r || r->status != 200 || r->body != completion) {
          ++errors;
          continue;
        }
        if (i >= 100) {  // the first 100 rounds warm up
          paths[k].us.push_back(us);
          const size_t r = static_cast<size_t>(i - 100) * rounds / requests;
          if (paths[k].per_round.size() <= r) paths[k].per_round.resize(r + 1);
          paths[k].per_round[r].push_back(us);
        }
      }
    }
    if (!only.empty()) {
      for (auto& p : paths) {
        if (p.name != only) continue;
        std::printf("%s alone: %zu requests, %d errors, p50 %.1f us, p90 %.1f us, p99 %.1f us\n",
                    p.name, p.us.size(), errors, Median(p.us), Quantile(p.us, 0.90),
                    Quantile(p.us, 0.99));
      }
    }
    if (only.empty()) {
      const double direct = Median(paths[0].us);
      std::printf("%d requests per path (after 100 warm-up rounds), %d errors\n", requests, errors);
      std::printf("%-14s %10s %10s %10s %16s %14s\n", "path", "p50_us", "p90_us", "p99_us",
                  "added_p50_us", "added_p99_us");
      const double direct_p99 = Quantile(paths[0].us, 0.99);
      for (auto& p : paths) {
        std::printf("%-14s %10.1f %10.1f %10.1f %16.1f %14.1f\n", p.name, Median(p.us),
                    Quantile(p.us, 0.90), Quantile(p.us, 0.99), Median(p.us) - direct,
                    Quantile(p.us, 0.99) - direct_p99);
      }
      double ours = Median(paths[3].us) - direct, theirs = Median(paths[1].us) - direct,
             theirs_ka = Median(paths[2].us) - direct, colo = Median(paths[5].us) - direct;
      std::printf(
          "added median latency: nginx %.1f us, nginx-ka %.1f us, kvbridge-colo %.1f us (1 "
          "upstream call each); kvbridge P/D %.1f us (2 upstream calls; %.1f us beyond a second "
          "direct call)\n",
          theirs, theirs_ka, colo, ours, ours - direct);
      // Per round: added p50 of each path, ratios against nginx keep-alive's.
      std::vector<double> r_colo, r_pd, r_colo_def, r_kv;
      for (size_t r = 0; r < paths[0].per_round.size(); ++r) {
        auto added = [&](size_t k) {
          return r < paths[k].per_round.size()
                     ? Median(paths[k].per_round[r]) - Median(paths[0].per_round[r])
                     : 0.0;
        };
        const double ka = added(2);
        std::printf(
            "round %zu: added p50 nginx %.1f, nginx-ka %.1f, kvbridge-colo %.1f, kvbridge "
            "P/D %.1f us; 512-id prompt: round-robin %.1f, kv-aware %.1f us\n",
            r + 1, added(1), ka, added(5), added(3), added(6), added(7));
        r_kv.push_back(added(7) - added(6));
        if (ka > 0) {
          r_colo.push_back(added(5) / ka);
          r_pd.push_back(added(3) / (2 * ka));
        }
        if (added(1) > 0) r_colo_def.push_back(added(5) / added(1));
      }
      auto spread = [](const std::vector<double>& v) {
        char b[96];
        if (v.empty()) return std::string("n/a");
        std::snprintf(b, sizeof(b), "%.2f (min-max %.2f-%.2f)", Median(v),
                      *std::min_element(v.begin(), v.end()), *std::max_element(v.begin(), v.end()));
        return std::string(b);
      };
      const bool colo_met = !r_colo.empty() && Median(r_colo) <= 1.0,
                 pd_met = !r_pd.empty() && Median(r_pd) <= 1.0;
      std::printf(
          "ratios over %zu rounds, median: kvbridge-colo / nginx-ka added p50 %s -> goal <= 1: "
          "%s; kvbridge P/D / (2 x nginx-ka) %s -> goal <= 1: %s; kvbridge-colo / nginx "
          "(default) %s\n",
          r_colo.size(), spread(r_colo).c_str(), colo_met ? "met" : "NOT met", spread(r_pd).c_str(),
          pd_met ? "met" : "NOT met", spread(r_colo_def).c_str());
      std::printf(
          "goal, like for like (1 upstream call, all requests): kvbridge-colo <= nginx (default): "
          "%s; <= nginx-ka: %s\n",
          colo <= theirs ? "met" : "NOT met", colo <= theirs_ka ? "met" : "NOT met");
      {
        auto spread_us = [](const std::vector<double>& v) {
          char b[96];
          if (v.empty()) return std::string("n/a");
          std::snprintf(b, sizeof(b), "%.1f us (min-max %.1f-%.1f)", Median(v),
                        *std::min_element(v.begin(), v.end()),
                        *std::max_element(v.begin(), v.end()));
          return std::string(b);
        };
        std::printf(
            "kv-aware routing (512-id prompt, P/D): p50 kvbridge-kv %.1f us vs kvbridge-rr %.1f "
            "us; "
            "kv-aware adds %s per request (median over rounds of the p50 difference)\n",
            Median(paths[7].us), Median(paths[6].us), spread_us(r_kv).c_str());
        httplib::Client kc("127.0.0.1", proxy_kv_port);
        if (auto m = kc.Get("/metrics"); m && m->status == 200) {
          auto mean_us = [&](const std::string& name) {
            double sum = kvbridge::ScrapeMetric(m->body, name + "_sum");
            double count = kvbridge::ScrapeMetric(m->body, name + "_count");
            return count > 0 ? 1e6 * sum / count : -1.0;
          };
          std::printf(
              "kvbridge-kv inside (means): prompt ids %.1f us, decision %.1f us; routes pd %.0f, "
              "no_prompt_ids %.0f; index %.0f hashes\n",
              mean_us("kvbridge_proxy_prompt_ids_seconds"),
              mean_us("kvbridge_proxy_kv_route_seconds"),
              kvbridge::ScrapeMetric(m->body, "kvbridge_proxy_kv_routes_total", "path=\"pd\""),
              kvbridge::ScrapeMetric(m->body, "kvbridge_proxy_kv_routes_total",
                                     "path=\"no_prompt_ids\""),
              kvbridge::ScrapeMetric(m->body, "kvbridge_proxy_kv_index_blocks"));
        }
      }
      // Where kvbridge's time goes, from its own histograms (means over every request it served).
      httplib::Client mc("127.0.0.1", proxy_port);
      if (auto m = mc.Get("/metrics"); m && m->status == 200) {
        auto mean_us = [&](const std::string& name, const std::string& labels) {
          double sum = kvbridge::ScrapeMetric(m->body, name + "_sum", labels);
          double count = kvbridge::ScrapeMetric(m->body, name + "_count", labels);
          return count > 0 ? 1e6 * sum / count : -1.0;
        };
        std::printf(
            "kvbridge inside (means): request %.1f us; prefill leg %.1f us; decode leg %.1f us; "
            "legs on new/reused connections %.0f/%.0f\n",
            mean_us("kvbridge_proxy_request_seconds", ""),
            mean_us("kvbridge_proxy_leg_seconds", "role=\"prefill\""),
            mean_us("kvbridge_proxy_leg_seconds", "role=\"decode\""),
            kvbridge::ScrapeMetric(m->body, "kvbridge_proxy_leg_connections_total", "kind=\"new\""),
            kvbridge::ScrapeMetric(m->body, "kvbridge_proxy_leg_connections_total",
                                   "kind=\"reused\""));
      }
    }
    if (errors > 0) rc = 1;
  }
  ::kill(nginx_pid, SIGTERM);
  ::kill(proxy_pid, SIGTERM);
  ::kill(proxy_np_pid, SIGTERM);
  ::kill(proxy_colo_pid, SIGTERM);
  ::kill(proxy_rr_pid, SIGTERM);
  ::kill(proxy_kv_pid, SIGTERM);
  ::waitpid(nginx_pid, nullptr, 0);
  ::waitpid(proxy_pid, nullptr, 0);
  ::waitpid(proxy_np_pid, nullptr, 0);
  ::waitpid(proxy_colo_pid, nullptr, 0);
  ::waitpid(proxy_rr_pid, nullptr, 0);
  ::waitpid(proxy_kv_pid, nullptr, 0);
  {
    std::lock_guard<std::mutex> l(stop_mu);
    stopping = true;
  }
  stop_cv.notify_all();
  upstream.stop();
  up_thread.join();
  if (rc == 0) std::filesystem::remove_all(dir);
  return rc;
}
