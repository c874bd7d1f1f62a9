// One READ-mode request's timeline, from `kvbridge serve` processes (docs/protocol.md "One
// request's timeline"): prefill compute, hold, transfer, ack, first decode token, over shm and
// tcp. The engines log each transfer's phase timestamps at debug level ("kv timeline {json}",
// CLOCK_MONOTONIC µs, comparable across the processes of one host); the test, playing the proxy,
// adds the client's own times, checks that the phases are in causal order across the three
// processes, and prints the table.
//
//   ctest --test-dir build -R pd_timeline_test -V           # the `small` model, made in a temp dir
//   KVB_TIMELINE_MODEL=$PWD/models/small build/tests/pd_timeline_test   # an existing model
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <httplib.h>
#include <netinet/in.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <thread>

#include "support/serve_harness.h"
#include "support/subprocess.h"

namespace kvbridge {
namespace {

using nlohmann::json;
using testing::MakeModel;
using testing::MakeTempDir;
using testing::SpawnServe;
using testing::WaitForHttpOk;

int64_t NowUs() {
  return std::chrono::duration_cast<std::chrono::microseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

std::string Model() {
  if (const char* m = std::getenv("KVB_TIMELINE_MODEL"); m != nullptr && *m != '\0') return m;
  static const std::string made = [] {
    const std::string m = MakeTempDir("kvb_pd_timeline") + "/small";
    EXPECT_EQ(MakeModel(m, "small"), 0);
    return m;
  }();
  return made;
}

using Proc = testing::ServedEngine;

Proc Serve(const std::string& role, const std::string& transport, const std::string& log) {
  Proc p = SpawnServe({.model_dir = Model(),
                       .served_model_name = "small",
                       .role = role,
                       .extra_config = {{"transport", transport}},
                       .env = {{"KVBRIDGE_LOG_LEVEL", "debug"}},
                       .log_path = log});
  EXPECT_TRUE(WaitForHttpOk("127.0.0.1", p.port, "/health", 60'000)) << p.proc->ReadLog();
  return p;
}

// The "kv timeline" record of `tid` in a log, or null.
json FindRecord(const std::string& log, const std::string& tid) {
  std::istringstream in(log);
  std::string line;
  while (std::getline(in, line)) {
    const size_t at = line.find("kv timeline {");
    if (at == std::string::npos) continue;
    json j = json::parse(line.substr(at + 12), nullptr, false);
    if (!j.is_discarded() && j.value("transfer_id", "") == tid) return j;
  }
  return json();
}

// Streams the decode leg; returns the time (µs) the first token's chunk arrived, -1 on error.
int64_t StreamFirstTokenUs(int port, const std::string& body) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0) {
    close(fd);
    return -1;
  }
  const std::string req =
      "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
      "Content-Length: " +
      std::to_string(body.size()) + "\r\n\r\n" + body;
  (void)!send(fd, req.data(), req.size(), MSG_NOSIGNAL);
  timeval tv{.tv_sec = 1, .tv_usec = 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  std::string got;
  char buf[4096];
  int64_t first = -1;
  const int64_t t0 = NowUs();
  while (got.find("data: [DONE]") == std::string::npos && NowUs() - t0 < 60'000'000) {
    const ssize_t n = recv(fd, buf, sizeof(buf), 0);
    if (n == 0) break;
    if (n < 0) continue;
    got.append(buf, static_cast<size_t>(n));
    if (first < 0 && got.find("data: {") != std::string::npos) first = NowUs();
  }
  close(fd);
  return first;
}

struct Timeline {
  std::map<std::string, int64_t> at;  // phase -> µs since the client sent the prefill leg
};

Timeline RunOne(const std::string& transport) {
  const std::string dir = MakeTempDir("kvb_pd_timeline_" + transport);
  Proc p = Serve("kv_producer", transport, dir + "/prefill.log");
  Proc d = Serve("kv_consumer", transport, dir + "/decode.log");
  // 512 prompt tokens (32 blocks of 16): the byte-level tokenizer maps one character to a token.
  std::string prompt;
  for (int i = 0; prompt.size() < 511; ++i) prompt += "kv block " + std::to_string(i) + ", ";
  prompt.resize(511);
  Timeline tl;
  for (const std::string& tid :
       std::vector<std::string>{"warm-" + transport, "timeline-" + transport}) {
    json pbody{{"model", "small"}, {"prompt", prompt}, {"max_tokens", 1}, {"temperature", 0}};
    pbody["kv_transfer_params"] = {{"do_remote_decode", true}, {"transfer_id", tid}};
    httplib::Client pc("127.0.0.1", p.port);
    pc.set_read_timeout(60, 0);
    const int64_t t0 = NowUs();
    auto pr = pc.Post("/v1/completions", pbody.dump(), "application/json");
    const int64_t t1 = NowUs();
    EXPECT_TRUE(pr && pr->status == 200) << (pr ? pr->body : "no answer");
    if (!pr || pr->status != 200) return tl;
    json dbody{{"model", "small"}, {"prompt", prompt}, {"max_tokens", 4},
               {"temperature", 0}, {"stream", true},   {"ignore_eos", true}};
    dbody["kv_transfer_params"] = json::parse(pr->body).at("kv_transfer_params");
    const int64_t t2 = NowUs();
    const int64_t t3 = StreamFirstTokenUs(d.port, dbody.dump());
    EXPECT_GT(t3, 0);
    // The prefill logs its record when it frees the hold (right after the decode's read_done).
    json prec, drec;
    for (int i = 0; i < 500 && (prec.is_null() || drec.is_null()); ++i) {
      prec = FindRecord(p.proc->ReadLog(), tid);
      drec = FindRecord(d.proc->ReadLog(), tid);
      if (prec.is_null() || drec.is_null())
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    EXPECT_FALSE(prec.is_null()) << "no prefill kv timeline line for " << tid;
    EXPECT_FALSE(drec.is_null()) << "no decode kv timeline line for " << tid;
    if (prec.is_null() || drec.is_null()) return tl;
    auto rel = [&](const json& r, const char* k) {
      return r.contains(k) ? r[k].get<int64_t>() - t0 : int64_t{-1};
    };
    tl.at = {{"a client sends the prefill leg", 0},
             {"b prefill admitted (P)", rel(prec, "admitted_us")},
             {"c prefill computed, hold begins (P)", rel(prec, "held_us")},
             {"d prefill answer at the client", t1 - t0},
             {"e client sends the decode leg", t2 - t0},
             {"f decode admitted (D)", rel(drec, "admitted_us")},
             {"g READ posted (D)", rel(drec, "read_posted_us")},
             {"h READ ended, seen by D's engine (D)", rel(drec, "read_ended_us")},
             {"i read_done at the prefill (P)", rel(prec, "read_done_us")},
             {"j ack: hold reply at the decode (D)", rel(drec, "ack_us")},
             {"k load done, decode proceeds (D)", rel(drec, "load_done_us")},
             {"l hold freed (P)", rel(prec, "freed_us")},
             {"m first decode token at the client", t3 - t0}};
  }
  return tl;
}

TEST(PdTimeline, OneRequestOverShmAndTcpInCausalOrder) {
  std::map<std::string, Timeline> by;
  for (const std::string t : {"shm", "tcp"}) {
    by[t] = RunOne(t);
    const auto& at = by[t].at;
    ASSERT_EQ(at.size(), 13u) << t;
    // Causal order across the client, the prefill and the decode (one monotonic clock).
    const std::vector<std::string> chain = {"a client sends the prefill leg",
                                            "b prefill admitted (P)",
                                            "c prefill computed, hold begins (P)",
                                            "d prefill answer at the client",
                                            "e client sends the decode leg",
                                            "f decode admitted (D)",
                                            "g READ posted (D)",
                                            "h READ ended, seen by D's engine (D)",
                                            "i read_done at the prefill (P)",
                                            "j ack: hold reply at the decode (D)",
                                            "k load done, decode proceeds (D)",
                                            "m first decode token at the client"};
    for (size_t i = 1; i < chain.size(); ++i) {
      EXPECT_LE(at.at(chain[i - 1]), at.at(chain[i]))
          << t << ": " << chain[i - 1] << " -> " << chain[i];
    }
    EXPECT_GE(at.at("l hold freed (P)"), at.at("i read_done at the prefill (P)")) << t;
  }
  std::printf(
      "\nOne request's READ-mode timeline (µs since the client sent the prefill leg; "
      "model %s, 511-token prompt):\n",
      Model().c_str());
  std::printf("| %-40s | %10s | %10s |\n", "phase", "shm", "tcp");
  std::printf("|%s|%s|%s|\n", std::string(42, '-').c_str(), std::string(12, '-').c_str(),
              std::string(12, '-').c_str());
  for (const auto& [phase, v] : by["shm"].at) {
    std::printf("| %-40s | %10lld | %10lld |\n", phase.substr(2).c_str(), static_cast<long long>(v),
                static_cast<long long>(by["tcp"].at[phase]));
  }
}

}  // namespace
}  // namespace kvbridge
