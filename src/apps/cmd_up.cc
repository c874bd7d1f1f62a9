// `kvbridge up 1p3d`: bring up a P/D topology (proxy + engines as child processes) on this host.
//
// Makes the default model when absent, starts the engines and the proxy (this same binary, via
// /proc/self/exe) with their logs in --log-dir, waits until every instance is healthy and known
// to the proxy, prints the endpoints, and then supervises: a child that dies is reported (exit
// status, the tail of its log) and restarted with backoff while the others keep serving
// (--restart, --restart-budget; the decisions are proxy::Supervisor's, supervisor.h). On
// SIGINT/SIGTERM it stops every child and exits 0; when a child's restart budget is spent it stops
// every child and exits 1. A child that dies before the topology is ready stops it (exit 1).
// Every engine binds a free port itself (`serve --port 0 --port-file F`) and up reads the port
// back from F, so no other process can take it between a choice and a bind; the proxy does the
// same with --port 0. See docs/proxy.md.
#include <arpa/inet.h>
#include <fcntl.h>
#include <httplib.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <toml++/toml.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "apps/command_registry.h"
#include "apps/port_file.h"
#include "kvbridge/model/random_model.h"
#include "kvbridge/proxy/flow.h"
#include "kvbridge/proxy/proxy_server.h"
#include "kvbridge/proxy/supervisor.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct UpOptions {
  std::string topology = "1p1d";
  int num_prefill = 1;
  int num_decode = 1;
  int port = 10001;
  std::string log_dir;
  std::string mode = "read";
  std::string transport = "auto";
  std::string model_dir;
  bool prefill_forward_n = false;
  bool no_prefix_caching = false;
  int64_t prefill_kv_blocks = 0;
  std::vector<std::string> engine_args;
  std::vector<std::string> prefill_args;
  std::vector<std::string> decode_args;
  std::vector<std::string> proxy_args;  ///< extra `kvbridge proxy` arguments (--max-pending 64)
  std::string cluster_token;
  std::string routing = "least-loaded";
  int pd_skip_threshold = -1;  ///< the proxy's --pd-skip-threshold (< 0: off)
  /// kv_role of the decode engines: kv_consumer, or kv_both (kv-aware routing may then send a
  /// decode the prefill leg of a prompt it holds more of than any prefill).
  std::string decode_kv_role = "kv_consumer";
  double ready_timeout_s = 180;
  int prefill_tp = 1;  ///< --tensor-parallel-size of each prefill engine
  int decode_tp = 1;   ///< --tensor-parallel-size of each decode engine
  /// cpu, or cuda[:N] / a comma list cuda:0,cuda:1,... (engine i on entry i % size: prefills
  /// first, then decodes).
  std::string device = "cpu";
  /// Each GPU engine's --gpu-memory-utilization; 0 = 0.9 / (engines on that GPU).
  double gpu_memory_utilization = 0;
  std::string prometheus_config;       ///< write a Prometheus config for the topology here
  double prometheus_interval_s = 5;    ///< its scrape (and discovery refresh) interval
  std::string restart = "on-failure";  ///< on-failure|always|never (supervisor.h)
  int restart_budget = 5;              ///< restarts per child per minute
  /// "proxy" (engines register with the one proxy, the default) or "etcd" (a local etcd holds
  /// the instance records; `proxies` proxies watch it: docs/proxy.md "Control plane on etcd").
  std::string control_plane = "proxy";
  int proxies = 1;
};

// A Prometheus config that scrapes the proxy and every engine it knows, found through the
// proxy's HTTP service discovery (GET /v1/prometheus/targets), so engines that restart on other
// ports or register later are followed (docs/metrics.md "Prometheus").
bool WritePrometheusConfig(const std::string& path, const std::string& proxy_addr,
                           double interval_s) {
  const std::string iv = std::to_string(std::max(1, static_cast<int>(interval_s * 1000))) + "ms";
  std::FILE* f = std::fopen(path.c_str(), "w");
  if (f == nullptr) return false;
  std::fprintf(f,
               "# Written by kvbridge up: scrapes the proxy and every engine it knows.\n"
               "global:\n  scrape_interval: %s\n  scrape_timeout: %s\n"
               "  evaluation_interval: %s\n"
               "scrape_configs:\n  - job_name: kvbridge\n    http_sd_configs:\n"
               "      - url: http://%s/v1/prometheus/targets\n        refresh_interval: %s\n",
               iv.c_str(), iv.c_str(), iv.c_str(), proxy_addr.c_str(), iv.c_str());
  return std::fclose(f) == 0;
}

// The --device list: "cpu" -> {"cpu"}; "cuda:0,cuda:1" -> {"cuda:0", "cuda:1"}. Empty on a bad
// entry (every entry cuda[:N], or the single word cpu).
std::vector<std::string> ParseDeviceList(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) {
    static const std::regex re("^cuda(:[0-9]+)?$");
    if (item == "cpu" && s == "cpu") return {"cpu"};
    if (!std::regex_match(item, re)) return {};
    out.push_back(item);
  }
  return out;
}

// A random-model preset name given as --model with --device cuda: the engines generate it on the
// GPU (serve PRESET), no directory to make.
bool IsPresetName(const std::string& m) { return kvbridge::RandomModelPreset(m, 0).ok(); }

struct Child {
  std::string name;
  std::string url;  ///< http://127.0.0.1:PORT once `port` is known
  std::string log;
  std::string port_file;  ///< where the child writes the port it bound (apps/port_file.h)
  int port = 0;           ///< 0 until read from port_file
  pid_t pid = -1;
  bool exited = false;
  bool prefill = false;           ///< an engine's role (the proxy is neither)
  int engine_index = -1;          ///< its place among the engines (prefills first), for --device
  int restarts = 0;               ///< times up restarted it
  bool proxy = false;             ///< a proxy (restarted on the port it had)
  std::vector<std::string> argv;  ///< how to restart a proxy or etcd (engines: engine_argv)
};

// A port free now (bound and released; for etcd, which cannot report a port it chose itself).
int FreePort() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = 0;
  socklen_t len = sizeof(a);
  int port = 0;
  if (fd >= 0 && ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0 &&
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0) {
    port = ntohs(a.sin_port);
  }
  if (fd >= 0) ::close(fd);
  return port;
}

std::string SelfExe() {
  std::error_code ec;
  auto p = fs::read_symlink("/proc/self/exe", ec);
  return ec ? std::string("kvbridge") : p.string();
}

pid_t Spawn(const std::vector<std::string>& argv, const std::string& log_path) {
  std::vector<char*> args;
  std::vector<std::string> copy = argv;
  for (auto& a : copy) args.push_back(a.data());
  args.push_back(nullptr);
  pid_t parent = ::getpid();
  pid_t pid = ::fork();
  if (pid != 0) return pid;
  // Child: die with `up`, never outlive it; signals unblocked again.
  ::prctl(PR_SET_PDEATHSIG, SIGTERM);
  if (::getppid() != parent) ::_exit(1);
  sigset_t none;
  sigemptyset(&none);
  ::sigprocmask(SIG_SETMASK, &none, nullptr);
  int fd = ::open(log_path.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (fd >= 0) {
    ::dup2(fd, 1);
    ::dup2(fd, 2);
    ::close(fd);
  }
  ::execv(args[0], args.data());
  ::_exit(127);
}

std::string Tail(const std::string& path, size_t max_bytes = 2000) {
  std::ifstream f(path, std::ios::binary);
  std::stringstream ss;
  ss << f.rdbuf();
  std::string s = ss.str();
  return s.size() > max_bytes ? "..." + s.substr(s.size() - max_bytes) : s;
}

std::string RunCapture(const std::string& cmd) {
  std::string out;
  FILE* p = ::popen(cmd.c_str(), "r");
  if (p == nullptr) return out;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  ::pclose(p);
  return out;
}

std::string DescribeExit(int status) {
  if (WIFEXITED(status)) return "exited with code " + std::to_string(WEXITSTATUS(status));
  if (WIFSIGNALED(status)) return "killed by signal " + std::to_string(WTERMSIG(status));
  return "stopped";
}

// Reaps children that exited; returns the first that died (nullptr when all alive).
Child* ReapDead(std::vector<Child>& children, int* status_out) {
  for (Child& c : children) {
    if (c.exited || c.pid <= 0) continue;
    int status = 0;
    if (::waitpid(c.pid, &status, WNOHANG) == c.pid) {
      c.exited = true;
      *status_out = status;
      return &c;
    }
  }
  return nullptr;
}

void StopAll(std::vector<Child>& children) {
  for (auto it = children.rbegin(); it != children.rend(); ++it) {
    if (!it->exited && it->pid > 0) ::kill(it->pid, SIGTERM);
  }
  auto deadline = Clock::now() + std::chrono::seconds(10);
  for (Child& c : children) {
    while (!c.exited && c.pid > 0) {
      int status = 0;
      if (::waitpid(c.pid, &status, WNOHANG) == c.pid) {
        c.exited = true;
        break;
      }
      if (Clock::now() >= deadline) {
        std::fprintf(stderr, "kvbridge up: %s (pid %d) ignored SIGTERM; killing it\n",
                     c.name.c_str(), c.pid);
        ::kill(c.pid, SIGKILL);
        ::waitpid(c.pid, &status, 0);
        c.exited = true;
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

bool HttpOk(int port, const std::string& path, std::string* body = nullptr) {
  httplib::Client cli("127.0.0.1", port);
  cli.set_connection_timeout(1, 0);
  cli.set_read_timeout(2, 0);
  auto res = cli.Get(path.c_str());
  if (!res || res->status != 200) return false;
  if (body) *body = res->body;
  return true;
}

std::string Usage(const std::string& why) {
  std::fprintf(stderr, "kvbridge up: %s\n", why.c_str());
  return why;
}

bool ParseTopology(const std::string& t, int* p, int* d) {
  std::smatch m;
  static const std::regex re("^([0-9]+)p([0-9]+)d$");
  if (!std::regex_match(t, m, re)) return false;
  *p = std::atoi(m[1].str().c_str());
  *d = std::atoi(m[2].str().c_str());
  return *p >= 1 && *d >= 1 && *p <= 16 && *d <= 16;
}

// Loads FILE.toml into `o` (keys: topology, model, port, mode, transport, log_dir,
// prefill_forward_n, prefix_caching, prefill_kv_blocks, engine_args, prefill_args, decode_args,
// proxy_args, cluster_token, routing, ready_timeout_s, prefill_tp, decode_tp, device,
// gpu_memory_utilization, restart, restart_budget). Unknown keys are an error.
bool LoadConfig(const std::string& path, UpOptions& o) {
  toml::table t;
  try {
    t = toml::parse_file(path);
  } catch (const toml::parse_error& e) {
    Usage("--config " + path + ": " + std::string(e.description()));
    return false;
  }
  static const std::vector<std::string> kKeys = {"topology",
                                                 "model",
                                                 "port",
                                                 "mode",
                                                 "transport",
                                                 "log_dir",
                                                 "prefill_forward_n",
                                                 "prefix_caching",
                                                 "prefill_kv_blocks",
                                                 "engine_args",
                                                 "prefill_args",
                                                 "decode_args",
                                                 "proxy_args",
                                                 "cluster_token",
                                                 "routing",
                                                 "pd_skip_threshold",
                                                 "decode_kv_role",
                                                 "ready_timeout_s",
                                                 "prefill_tp",
                                                 "decode_tp",
                                                 "device",
                                                 "gpu_memory_utilization",
                                                 "restart",
                                                 "restart_budget"};
  for (auto&& [k, v] : t) {
    if (std::find(kKeys.begin(), kKeys.end(), std::string(k.str())) == kKeys.end()) {
      Usage("--config " + path + ": unknown key '" + std::string(k.str()) + "'");
      return false;
    }
  }
  auto strs = [&](const char* key, std::vector<std::string>& out) {
    if (auto* arr = t[key].as_array()) {
      for (auto&& e : *arr) {
        if (auto s = e.value<std::string>()) out.push_back(*s);
      }
    }
  };
  o.topology = t["topology"].value_or(o.topology);
  o.model_dir = t["model"].value_or(o.model_dir);
  o.port = static_cast<int>(t["port"].value_or(static_cast<int64_t>(o.port)));
  o.mode = t["mode"].value_or(o.mode);
  o.transport = t["transport"].value_or(o.transport);
  o.log_dir = t["log_dir"].value_or(o.log_dir);
  o.prefill_forward_n = t["prefill_forward_n"].value_or(o.prefill_forward_n);
  o.no_prefix_caching = !t["prefix_caching"].value_or(!o.no_prefix_caching);
  o.prefill_kv_blocks = t["prefill_kv_blocks"].value_or(static_cast<int64_t>(o.prefill_kv_blocks));
  o.cluster_token = t["cluster_token"].value_or(o.cluster_token);
  o.routing = t["routing"].value_or(o.routing);
  o.pd_skip_threshold =
      static_cast<int>(t["pd_skip_threshold"].value_or(static_cast<int64_t>(o.pd_skip_threshold)));
  o.decode_kv_role = t["decode_kv_role"].value_or(o.decode_kv_role);
  o.ready_timeout_s = t["ready_timeout_s"].value_or(o.ready_timeout_s);
  o.prefill_tp = static_cast<int>(t["prefill_tp"].value_or(static_cast<int64_t>(o.prefill_tp)));
  o.decode_tp = static_cast<int>(t["decode_tp"].value_or(static_cast<int64_t>(o.decode_tp)));
  o.device = t["device"].value_or(o.device);
  o.gpu_memory_utilization = t["gpu_memory_utilization"].value_or(o.gpu_memory_utilization);
  o.restart = t["restart"].value_or(o.restart);
  o.restart_budget =
      static_cast<int>(t["restart_budget"].value_or(static_cast<int64_t>(o.restart_budget)));
  strs("engine_args", o.engine_args);
  strs("prefill_args", o.prefill_args);
  strs("decode_args", o.decode_args);
  strs("proxy_args", o.proxy_args);
  return true;
}

std::string DefaultModelDir() {
  const char* xdg = std::getenv("XDG_CACHE_HOME");
  const char* home = std::getenv("HOME");
  std::string base = xdg ? xdg : (home ? std::string(home) + "/.cache" : std::string("/tmp"));
  return base + "/kvbridge/models/small-seed0";
}

int RunUp(UpOptions o) {
  if (!ParseTopology(o.topology, &o.num_prefill, &o.num_decode)) {
    Usage("topology must look like 1p3d (1..16 of each), got '" + o.topology + "'");
    return 2;
  }
  if (o.prefill_tp < 1 || o.prefill_tp > 64 || o.decode_tp < 1 || o.decode_tp > 64) {
    Usage("--prefill-tp and --decode-tp must be in [1, 64]");
    return 2;
  }
  if (o.decode_kv_role != "kv_consumer" && o.decode_kv_role != "kv_both") {
    Usage("--decode-kv-role must be kv_consumer|kv_both, got '" + o.decode_kv_role + "'");
    return 2;
  }
  if (!kvbridge::ParseKvTransferMode(o.mode).ok()) {
    Usage("--mode must be read|write");
    return 2;
  }
  if (o.port < 0 || o.port > 65535) {
    Usage("--port must be in [0, 65535] (0: any free port)");
    return 2;
  }
  const std::vector<std::string> devices = ParseDeviceList(o.device);
  if (devices.empty()) {
    Usage("--device must be cpu, cuda[:N] or a list cuda:0,cuda:1,..., got '" + o.device + "'");
    return 2;
  }
  const bool gpu = devices[0] != "cpu";
  if (gpu && (o.prefill_tp > 1 || o.decode_tp > 1)) {
    Usage("--device cuda runs engines at tensor-parallel size 1 (--prefill-tp/--decode-tp 1)");
    return 2;
  }
  auto restart_policy = kvbridge::proxy::ParseRestartPolicy(o.restart);
  if (!restart_policy.ok()) {
    Usage(restart_policy.status().message());
    return 2;
  }
  if (o.restart_budget < 0 || o.restart_budget > 1000) {
    Usage("--restart-budget must be in [0, 1000] (restarts per child per minute)");
    return 2;
  }
  const std::string exe = SelfExe();
  if (o.model_dir.empty()) o.model_dir = DefaultModelDir();
  if (o.log_dir.empty()) {
    o.log_dir =
        (fs::temp_directory_path() / ("kvbridge-up-" + std::to_string(::getpid()))).string();
  }
  std::error_code ec;
  fs::create_directories(o.log_dir, ec);
  if (ec) {
    Usage("cannot create --log-dir " + o.log_dir + ": " + ec.message());
    return 1;
  }
  if (o.cluster_token.empty()) o.cluster_token = kvbridge::proxy::MintTransferId();

  // SIGINT/SIGTERM are taken synchronously below; children get them unblocked (Spawn).
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);

  // The engine must speak P/D.
  std::string serve_help = RunCapture("'" + exe + "' serve --help 2>&1");
  if (serve_help.find("--kv-transfer-config") == std::string::npos) {
    Usage("this build's `kvbridge serve` has no --kv-transfer-config: P/D is not available");
    return 1;
  }
  const bool registration = serve_help.find("--proxy") != std::string::npos;
  const bool etcd_mode = o.control_plane == "etcd";
  if (o.control_plane != "proxy" && !etcd_mode) {
    Usage("--control-plane must be proxy|etcd");
    return 2;
  }
  if (o.proxies < 1 || o.proxies > 16 || (!etcd_mode && o.proxies != 1)) {
    Usage("--proxies N (1..16) needs --control-plane etcd (one proxy is the registry otherwise)");
    return 2;
  }
  if (etcd_mode && serve_help.find("--etcd") == std::string::npos) {
    Usage("this build's `kvbridge serve` has no --etcd");
    return 1;
  }
  // --control-plane etcd: a local etcd (Debian's etcd-server), data in the log dir.
  std::string etcd_url;
  const std::string etcd_cluster = "up";

  if (gpu && !fs::exists(o.model_dir, ec) && IsPresetName(o.model_dir)) {
    // serve PRESET --device cuda: weights generated on the GPU, nothing to make.
  } else if (!fs::exists(fs::path(o.model_dir) / "config.json")) {
    std::printf("kvbridge up: making the default model in %s\n", o.model_dir.c_str());
    std::fflush(stdout);
    fs::create_directories(fs::path(o.model_dir).parent_path(), ec);
    std::string log = o.log_dir + "/make-model.log";
    pid_t pid =
        Spawn({exe, "make-model", "--preset", "small", "--seed", "0", "--out", o.model_dir}, log);
    int status = 0;
    ::waitpid(pid, &status, 0);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      std::fprintf(stderr, "kvbridge up: make-model %s; log %s:\n%s\n",
                   DescribeExit(status).c_str(), log.c_str(), Tail(log).c_str());
      return 1;
    }
  }

  std::vector<Child> children;
  std::string proxy_addr;  // 127.0.0.1:PORT once the proxy has bound
  // GPU engines: engine i on devices[i % size]; each takes its share of its GPU (per instance,
  // as vLLM's --gpu-memory-utilization): 0.9 split evenly between the engines on it.
  auto gpu_share = [&](int engine_index) {
    if (o.gpu_memory_utilization > 0) return o.gpu_memory_utilization;
    const int engines = o.num_prefill + o.num_decode;
    const std::string& mine = devices[engine_index % devices.size()];
    int on_it = 0;
    for (int i = 0; i < engines; ++i) on_it += devices[i % devices.size()] == mine ? 1 : 0;
    return 0.9 / std::max(1, on_it);
  };
  auto engine_argv = [&](bool prefill, int engine_index, const std::string& port_file,
                         const std::string& name, int restarts) {
    nlohmann::json cfg = {
        {"kv_connector", "KVBridgeConnector"},
        {"kv_role", prefill ? std::string("kv_producer") : o.decode_kv_role},
        {"kv_connector_extra_config", {{"mode", o.mode}, {"transport", o.transport}}}};
    std::vector<std::string> a = {exe,
                                  "serve",
                                  o.model_dir,
                                  "--host",
                                  "127.0.0.1",
                                  "--port",
                                  "0",
                                  "--port-file",
                                  port_file,
                                  "--kv-transfer-config",
                                  cfg.dump(),
                                  "--cluster-token",
                                  o.cluster_token};
    if (o.no_prefix_caching) a.push_back("--no-enable-prefix-caching");
    if (const int tp = prefill ? o.prefill_tp : o.decode_tp; tp > 1) {
      a.push_back("--tensor-parallel-size");  // ranks are threads of the engine
      a.push_back(std::to_string(tp));
    }
    if (prefill && o.prefill_kv_blocks > 0) {
      a.push_back("--num-kv-blocks");
      a.push_back(std::to_string(o.prefill_kv_blocks));
    }
    if (etcd_mode) {
      a.insert(a.end(), {"--etcd", etcd_url, "--etcd-cluster", etcd_cluster, "--instance-name",
                         name, "--restart-count", std::to_string(restarts)});
    } else if (registration) {
      a.push_back("--proxy");
      a.push_back(proxy_addr);
      // The proxy shows the restarts and replaces the old incarnation registered under the name.
      a.push_back("--instance-name");
      a.push_back(name);
      a.push_back("--restart-count");
      a.push_back(std::to_string(restarts));
    }
    if (gpu) {
      a.push_back("--device");
      a.push_back(devices[engine_index % devices.size()]);
      a.push_back("--gpu-memory-utilization");
      a.push_back(std::to_string(gpu_share(engine_index)));
    }
    for (const auto& x : o.engine_args) a.push_back(x);
    for (const auto& x : prefill ? o.prefill_args : o.decode_args) a.push_back(x);
    return a;
  };
  std::vector<std::string> proxy_argv = {exe,
                                         "proxy",
                                         "--host",
                                         "127.0.0.1",
                                         "--port",
                                         std::to_string(o.port),
                                         "--port-file",
                                         o.log_dir + "/proxy.port",
                                         "--mode",
                                         o.mode,
                                         "--routing",
                                         o.routing,
                                         "--cluster-token",
                                         o.cluster_token};
  if (o.prefill_forward_n) proxy_argv.push_back("--prefill-forward-n");
  for (const auto& x : o.proxy_args) proxy_argv.push_back(x);
  // KV-aware routing and the P/D skip hash the prompt ids: the proxy tokenizes with the model's
  // own tokenizer and chat template (docs/proxy.md "KV-aware routing").
  if (o.routing == "kv-aware" || o.pd_skip_threshold >= 0) {
    proxy_argv.insert(proxy_argv.end(), {"--model", o.model_dir, "--pd-skip-threshold",
                                         std::to_string(o.pd_skip_threshold)});
  }
  std::vector<std::string> proxy_addrs;  // every proxy's 127.0.0.1:PORT (etcd mode: several)

  auto report_death = [&](Child* c, int status) {
    std::fprintf(stderr, "kvbridge up: %s (pid %d) %s; its log %s ends:\n%s\n", c->name.c_str(),
                 c->pid, DescribeExit(status).c_str(), c->log.c_str(), Tail(c->log).c_str());
  };
  const auto t0 = Clock::now();
  const auto deadline =
      t0 + std::chrono::milliseconds(static_cast<int64_t>(o.ready_timeout_s * 1000));
  // Starts a child whose argv names `c.port_file` (a stale file from an earlier run goes first).
  auto start = [&](Child c, const std::vector<std::string>& argv) {
    fs::remove(c.port_file, ec);
    c.pid = Spawn(argv, c.log);
    children.push_back(std::move(c));
  };
  // Waits until every started child has written its port file (it bound its port): -1 then, else
  // the exit code after a child died, a signal or the deadline (everything stopped).
  auto await_ports = [&]() -> int {
    for (;;) {
      std::string waiting_for;
      for (Child& c : children) {
        if (c.port != 0) continue;
        kvbridge::Result<int> port = kvbridge::apps::ReadPortFile(c.port_file);
        if (port.ok()) {
          c.port = *port;
          c.url = "http://127.0.0.1:" + std::to_string(c.port);
        } else if (port.status().code() == kvbridge::StatusCode::kNotFound) {
          waiting_for += " " + c.name;
        } else {
          std::fprintf(stderr, "kvbridge up: %s: %s\n", c.name.c_str(),
                       port.status().ToString().c_str());
          StopAll(children);
          return 1;
        }
      }
      if (waiting_for.empty()) return -1;
      int status = 0;
      if (Child* dead = ReapDead(children, &status)) {
        report_death(dead, status);
        StopAll(children);
        return 1;
      }
      if (Clock::now() >= deadline) {
        std::fprintf(stderr, "kvbridge up: not listening after %.0f s:%s (logs in %s)\n",
                     o.ready_timeout_s, waiting_for.c_str(), o.log_dir.c_str());
        StopAll(children);
        return 1;
      }
      timespec ts{0, 50'000'000};
      int sig = sigtimedwait(&sigs, nullptr, &ts);
      if (sig == SIGINT || sig == SIGTERM) {
        std::printf("kvbridge up: signal %d before ready; stopping\n", sig);
        StopAll(children);
        return 0;
      }
    }
  };
  auto start_proxy = [&]() -> int {
    Child p;
    p.name = "proxy";
    p.proxy = true;
    p.log = o.log_dir + "/proxy.log";
    p.port_file = o.log_dir + "/proxy.port";
    p.argv = proxy_argv;
    start(p, proxy_argv);
    if (int rc = await_ports(); rc >= 0) return rc;
    proxy_addr = "127.0.0.1:" + std::to_string(children.back().port);
    proxy_addrs = {proxy_addr};
    return -1;
  };
  // etcd mode: etcd first (every other process talks to it), then the proxies, then engines.
  auto start_etcd = [&]() -> int {
    const int client_port = FreePort(), peer_port = FreePort();
    if (client_port == 0 || peer_port == 0 || client_port == peer_port) {
      std::fprintf(stderr, "kvbridge up: no free port for etcd\n");
      return 1;
    }
    etcd_url = "http://127.0.0.1:" + std::to_string(client_port);
    const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port);
    Child e;
    e.name = "etcd";
    e.log = o.log_dir + "/etcd.log";
    e.port = client_port;
    e.url = etcd_url;
    e.argv = {"/usr/bin/etcd",
              "--name",
              "kvbridge-up",
              "--data-dir",
              o.log_dir + "/etcd-data",
              "--listen-client-urls",
              etcd_url,
              "--advertise-client-urls",
              etcd_url,
              "--listen-peer-urls",
              peer,
              "--initial-advertise-peer-urls",
              peer,
              "--initial-cluster",
              "kvbridge-up=" + peer,
              "--auto-compaction-retention",
              "1"};
    if (!fs::exists(e.argv[0], ec)) {
      std::fprintf(stderr, "kvbridge up: --control-plane etcd needs %s (apt install etcd-server)\n",
                   e.argv[0].c_str());
      return 1;
    }
    std::vector<std::string> argv = e.argv;
    e.pid = Spawn(argv, e.log);
    children.push_back(std::move(e));
    for (;;) {
      if (HttpOk(client_port, "/health")) return -1;
      int status = 0;
      if (Child* dead = ReapDead(children, &status)) {
        report_death(dead, status);
        StopAll(children);
        return 1;
      }
      if (Clock::now() >= deadline) {
        std::fprintf(stderr, "kvbridge up: etcd not healthy after %.0f s (log %s)\n",
                     o.ready_timeout_s, o.log_dir.c_str());
        StopAll(children);
        return 1;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  };
  auto start_etcd_proxies = [&]() -> int {
    for (int i = 0; i < o.proxies; ++i) {
      Child p;
      p.name = "proxy-" + std::to_string(i);
      p.proxy = true;
      p.log = o.log_dir + "/" + p.name + ".log";
      p.port_file = o.log_dir + "/" + p.name + ".port";
      p.argv = proxy_argv;
      for (size_t k = 0; k + 1 < p.argv.size(); ++k) {
        if (p.argv[k] == "--port") p.argv[k + 1] = i == 0 ? std::to_string(o.port) : "0";
        if (p.argv[k] == "--port-file") p.argv[k + 1] = p.port_file;
      }
      p.argv.insert(p.argv.end(), {"--etcd", etcd_url, "--etcd-cluster", etcd_cluster});
      std::vector<std::string> argv = p.argv;
      start(p, argv);
    }
    if (int rc = await_ports(); rc >= 0) return rc;
    for (const Child& c : children) {
      if (c.proxy) proxy_addrs.push_back("127.0.0.1:" + std::to_string(c.port));
    }
    proxy_addr = proxy_addrs.front();
    return -1;
  };
  // With registration the proxy comes first (engines register with its bound port as they
  // start); with static lists it comes last, given the engines' bound ports (its first health
  // probes then find the engines up).
  if (etcd_mode) {
    if (int rc = start_etcd(); rc >= 0) return rc;
    if (int rc = start_etcd_proxies(); rc >= 0) return rc;
  } else if (registration) {
    if (int rc = start_proxy(); rc >= 0) return rc;
  }
  for (int i = 0; i < o.num_prefill + o.num_decode; ++i) {
    const bool prefill = i < o.num_prefill;
    Child c;
    c.name =
        prefill ? "prefill-" + std::to_string(i) : "decode-" + std::to_string(i - o.num_prefill);
    c.log = o.log_dir + "/" + c.name + ".log";
    c.port_file = o.log_dir + "/" + c.name + ".port";
    c.prefill = prefill;
    c.engine_index = i;
    start(c, engine_argv(prefill, i, c.port_file, c.name, 0));
  }
  if (int rc = await_ports(); rc >= 0) return rc;
  if (!registration && !etcd_mode) {
    for (const Child& c : children) {
      proxy_argv.push_back(c.name.rfind("prefill", 0) == 0 ? "--prefill" : "--decode");
      proxy_argv.push_back(c.url);
    }
    if (int rc = start_proxy(); rc >= 0) return rc;
  }
  const int proxy_port = std::atoi(proxy_addr.c_str() + proxy_addr.rfind(':') + 1);

  const size_t want = static_cast<size_t>(o.num_prefill + o.num_decode);
  std::string waiting_for;
  for (;;) {
    int status = 0;
    if (Child* dead = ReapDead(children, &status)) {
      report_death(dead, status);
      StopAll(children);
      return 1;
    }
    waiting_for.clear();
    for (const Child& c : children) {
      if (!c.proxy && !HttpOk(c.port, "/health")) waiting_for += " " + c.name;
    }
    bool all_ready = waiting_for.empty();
    for (const Child& c : children) {
      if (!c.proxy) continue;
      std::string body;
      if (!HttpOk(c.port, "/instances", &body)) {
        waiting_for += " " + c.name;
        all_ready = false;
      } else if (waiting_for.empty()) {
        auto j = nlohmann::json::parse(body, nullptr, false);
        size_t healthy = 0;
        if (j.is_object() && j["instances"].is_array()) {
          for (auto& i : j["instances"]) healthy += i.value("healthy", false) ? 1 : 0;
        }
        if (healthy < want) {
          all_ready = false;
          waiting_for += " " + c.name + " registration (" + std::to_string(healthy) + "/" +
                         std::to_string(want) + " instances)";
        }
      }
    }
    if (all_ready) break;
    if (Clock::now() >= deadline) {
      std::fprintf(stderr, "kvbridge up: not ready after %.0f s, waiting for:%s (logs in %s)\n",
                   o.ready_timeout_s, waiting_for.c_str(), o.log_dir.c_str());
      StopAll(children);
      return 1;
    }
    timespec ts{0, 200'000'000};
    int sig = sigtimedwait(&sigs, nullptr, &ts);
    if (sig == SIGINT || sig == SIGTERM) {
      std::printf("kvbridge up: signal %d before ready; stopping\n", sig);
      StopAll(children);
      return 0;
    }
  }
  double ready_s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("kvbridge up %s: ready in %.1f s (mode %s, transport %s, %s, model %s, device %s)\n",
              o.topology.c_str(), ready_s, o.mode.c_str(), o.transport.c_str(),
              etcd_mode      ? "control plane etcd"
              : registration ? "engines registered"
                             : "static instance lists",
              o.model_dir.c_str(), o.device.c_str());
  for (const Child& c : children) {
    std::printf("  %-10s %-24s pid %-7d log %s\n", c.name.c_str(), c.url.c_str(), c.pid,
                c.log.c_str());
  }
  std::printf("OpenAI API: http://%s/v1/completions  (instances: http://%s/instances)\n",
              proxy_addr.c_str(), proxy_addr.c_str());
  if (etcd_mode) {
    // One line per proxy, each a front door to the same cluster (clients may use any).
    for (const std::string& a : proxy_addrs) std::printf("proxy http://%s\n", a.c_str());
    std::printf("etcd %s (prefix /kvbridge/%s/instances/)\n", etcd_url.c_str(),
                etcd_cluster.c_str());
  }
  if (!o.prometheus_config.empty()) {
    if (!WritePrometheusConfig(o.prometheus_config, proxy_addr, o.prometheus_interval_s)) {
      std::fprintf(stderr, "kvbridge up: cannot write %s\n", o.prometheus_config.c_str());
      StopAll(children);
      return 1;
    }
    std::printf("Prometheus config: %s (prometheus --config.file=%s)\n",
                o.prometheus_config.c_str(), o.prometheus_config.c_str());
  }
  std::printf("Ctrl-C or SIGTERM stops everything.\n");
  std::fflush(stdout);

  std::printf("Supervising: --restart %s, --restart-budget %d per child per minute.\n",
              o.restart.c_str(), o.restart_budget);
  std::fflush(stdout);

  // Supervision (supervisor.h decides; this loop spawns, reaps and reports).
  kvbridge::proxy::SupervisorOptions so;
  so.policy = *restart_policy;
  so.restart_budget = o.restart_budget;
  kvbridge::proxy::Supervisor sup(so, static_cast<int>(children.size()));
  auto now_us = [&] {
    return std::chrono::duration_cast<std::chrono::microseconds>(Clock::now() - t0).count();
  };
  for (size_t i = 0; i < children.size(); ++i) sup.OnStarted(static_cast<int>(i), now_us());
  // A proxy keeps its bound port across restarts: the engines' --proxy (or the clients) name it.
  for (Child& c : children) {
    for (size_t i = 0; c.proxy && i + 1 < c.argv.size(); ++i) {
      if (c.argv[i] == "--port") c.argv[i + 1] = std::to_string(c.port);
    }
  }
  // Tells the proxy a dead engine is gone (its heartbeats would stop only after the timeout).
  auto deregister = [&](const Child& c) {
    if (!registration || etcd_mode || c.url.empty()) return;  // etcd: proxies probe + lease
    httplib::Client cli("127.0.0.1", proxy_port);
    cli.set_connection_timeout(1, 0);
    cli.set_read_timeout(1, 0);
    httplib::Headers h = {{kvbridge::proxy::kClusterTokenHeader, o.cluster_token}};
    cli.Post("/v1/instances/deregister", h, nlohmann::json{{"instance_id", c.url}}.dump(),
             "application/json");
  };
  auto respawn = [&](int index, int restarts) {
    Child& c = children[static_cast<size_t>(index)];
    c.restarts = restarts;
    fs::remove(c.port_file, ec);
    {
      std::ofstream log(c.log, std::ios::app);
      log << "\n---- kvbridge up: restart " << restarts << " of " << c.name << " ----\n";
    }
    std::vector<std::string> argv;
    if (c.proxy) {
      argv = c.argv;
      argv.push_back("--restart-count");
      argv.push_back(std::to_string(restarts));
    } else if (!c.argv.empty()) {  // etcd: same ports, same data
      argv = c.argv;
    } else {
      argv = engine_argv(c.prefill, c.engine_index, c.port_file, c.name, restarts);
      if (!registration) {  // static lists: the proxy knows this engine by its old port
        for (size_t i = 0; i + 1 < argv.size(); ++i) {
          if (argv[i] == "--port") argv[i + 1] = std::to_string(c.port);
        }
      }
    }
    c.pid = Spawn(argv, c.log);
    c.exited = false;
    if (!c.port_file.empty()) c.port = 0;  // until its port file says
    sup.OnStarted(index, now_us());
    std::printf("kvbridge up: %s restarted (restart %d, pid %d)\n", c.name.c_str(), restarts,
                c.pid);
    std::fflush(stdout);
  };
  int exit_code = -1;
  auto run_actions = [&](std::vector<kvbridge::proxy::SupervisorAction> actions) {
    for (auto& a : actions) {
      if (auto* r = std::get_if<kvbridge::proxy::RestartScheduled>(&a)) {
        std::printf("kvbridge up: restarting %s in %.1f s (restart %d)\n",
                    children[static_cast<size_t>(r->child)].name.c_str(),
                    static_cast<double>(r->at - now_us()) / 1e6, r->restart);
      } else if (auto* st = std::get_if<kvbridge::proxy::StartChild>(&a)) {
        respawn(st->child, st->restarts);
      } else if (auto* d = std::get_if<kvbridge::proxy::LeaveDown>(&a)) {
        std::printf("kvbridge up: %s stays down: %s\n",
                    children[static_cast<size_t>(d->child)].name.c_str(), d->reason.c_str());
      } else if (auto* stop = std::get_if<kvbridge::proxy::StopAll>(&a)) {
        std::fprintf(stderr, "kvbridge up: %s; stopping %zu processes\n", stop->reason.c_str(),
                     children.size());
        exit_code = stop->exit_code;
      }
    }
    std::fflush(stdout);
  };
  while (exit_code < 0) {
    timespec ts{0, 100'000'000};
    int sig = sigtimedwait(&sigs, nullptr, &ts);
    if (sig == SIGINT || sig == SIGTERM) {
      std::printf("kvbridge up: signal %d; stopping %zu processes\n", sig, children.size());
      std::fflush(stdout);
      sup.OnStopRequested();
      StopAll(children);
      std::printf("kvbridge up: stopped (%d restarts)\n", sup.total_restarts());
      return 0;
    }
    int status = 0;
    while (Child* dead = ReapDead(children, &status)) {
      report_death(dead, status);
      if (!dead->proxy) deregister(*dead);
      const bool clean = WIFEXITED(status) && WEXITSTATUS(status) == 0;
      run_actions(
          sup.OnExit(static_cast<int>(dead - children.data()),
                     clean ? kvbridge::proxy::ExitKind::kClean : kvbridge::proxy::ExitKind::kFailed,
                     now_us()));
      if (exit_code >= 0) break;
    }
    if (exit_code >= 0) break;
    if (auto due = sup.deadline(); due && now_us() >= *due) run_actions(sup.OnTick(now_us()));
    // A restarted child's port, once it has bound one.
    for (Child& c : children) {
      if (c.exited || c.port != 0 || c.port_file.empty()) continue;
      kvbridge::Result<int> port = kvbridge::apps::ReadPortFile(c.port_file);
      if (!port.ok()) continue;
      c.port = *port;
      c.url = "http://127.0.0.1:" + std::to_string(c.port);
      std::printf("kvbridge up: %s listening again at %s\n", c.name.c_str(), c.url.c_str());
      std::fflush(stdout);
    }
  }
  StopAll(children);
  std::printf("kvbridge up: stopped (%d restarts)\n", sup.total_restarts());
  return exit_code;
}

const bool kRegistered = kvbridge::apps::RegisterCommand(
    "up", "Bring up a P/D topology (proxy + engines) on this host: kvbridge up 1p3d",
    [](CLI::App& sub) -> kvbridge::apps::CommandMain {
      auto o = std::make_shared<UpOptions>();
      auto cfg = std::make_shared<std::string>();
      auto* topo = sub.add_option("topology", o->topology, "NpMd: 1p1d, 1p3d, 2p2d, ...");
      auto* port = sub.add_option("--port", o->port,
                                  "The proxy's port (0: any free port; the bound one is printed)")
                       ->capture_default_str();
      auto* log = sub.add_option("--log-dir", o->log_dir, "Directory for the children's logs");
      auto* mode = sub.add_option("--mode", o->mode, "read|write")->capture_default_str();
      auto* transport =
          sub.add_option("--transport", o->transport, "KV transport (auto|shm|tcp|ucx|cuda_ipc)")
              ->capture_default_str();
      auto* model = sub.add_option("--model", o->model_dir,
                                   "Model directory (default: made with make-model --preset small "
                                   "--seed 0 under ~/.cache/kvbridge/models)");
      auto* fwd = sub.add_flag("--prefill-forward-n", o->prefill_forward_n,
                               "Send the client's n to the prefill leg");
      sub.add_option("--config", *cfg, "TOML file (keys as the flags, snake_case); flags win");
      auto* eargs =
          sub.add_option("--engine-arg", o->engine_args, "Extra argument for every engine (repeat)")
              ->allow_extra_args(false);
      auto* pargs = sub.add_option("--prefill-arg", o->prefill_args, "Extra prefill argument")
                        ->allow_extra_args(false);
      auto* dargs = sub.add_option("--decode-arg", o->decode_args, "Extra decode argument")
                        ->allow_extra_args(false);
      auto* xargs =
          sub.add_option("--proxy-arg", o->proxy_args,
                         "Extra argument for the proxy (repeat: --proxy-arg=--max-pending "
                         "--proxy-arg=64)")
              ->allow_extra_args(false);
      auto* npc = sub.add_flag("--no-prefix-caching", o->no_prefix_caching,
                               "Engines run without prefix caching");
      auto* pkb = sub.add_option("--prefill-kv-blocks", o->prefill_kv_blocks,
                                 "KV blocks of each prefill (--num-kv-blocks)");
      auto* rt = sub.add_option("--ready-timeout", o->ready_timeout_s,
                                "Seconds to wait for every instance")
                     ->capture_default_str();
      auto* routing = sub.add_option("--routing", o->routing, "kv-aware|least-loaded|round-robin")
                          ->capture_default_str();
      auto* skip = sub.add_option("--pd-skip-threshold", o->pd_skip_threshold,
                                  "Send a request to its decode alone when that decode lacks at "
                                  "most N of its prompt tokens (-1: never)")
                       ->capture_default_str();
      auto* dkr = sub.add_option("--decode-kv-role", o->decode_kv_role,
                                 "kv_role of the decode engines: kv_consumer, or kv_both (with "
                                 "--routing kv-aware a decode then also takes the prefill leg of "
                                 "a prompt it holds more of than any prefill, e.g. a "
                                 "conversation's next turn after the answer it generated)")
                      ->check(CLI::IsMember({"kv_consumer", "kv_both"}))
                      ->capture_default_str();
      auto* ptp = sub.add_option("--prefill-tp", o->prefill_tp,
                                 "Tensor-parallel size of each prefill engine")
                      ->capture_default_str();
      auto* dtp =
          sub.add_option("--decode-tp", o->decode_tp, "Tensor-parallel size of each decode engine")
              ->capture_default_str();
      auto* dev = sub.add_option("--device", o->device,
                                 "cpu, cuda[:N], or cuda:0,cuda:1,... (engine i on entry i; "
                                 "prefills first). GPU engines move KV with cuda_ipc; --model may "
                                 "then name a preset (qwen2.5-7b: generated on the GPU)")
                      ->capture_default_str();
      auto* gmu = sub.add_option("--gpu-memory-utilization", o->gpu_memory_utilization,
                                 "Each GPU engine's share of its GPU (default 0.9 / engines on "
                                 "that GPU)");
      auto* prom = sub.add_option("--prometheus-config", o->prometheus_config,
                                  "Write a Prometheus config scraping the topology to FILE");
      auto* prom_iv = sub.add_option("--prometheus-scrape-interval", o->prometheus_interval_s,
                                     "Its scrape interval, seconds")
                          ->capture_default_str();
      auto* restart = sub.add_option("--restart", o->restart,
                                     "Restart a child that dies: on-failure (a signal or a "
                                     "non-zero exit) | always | never (any death stops all)")
                          ->capture_default_str();
      auto* budget = sub.add_option("--restart-budget", o->restart_budget,
                                    "Restarts allowed per child per minute; past them up stops "
                                    "everything and exits 1")
                         ->capture_default_str();
      auto* cp = sub.add_option("--control-plane", o->control_plane,
                                "proxy (engines register with the proxy) | etcd (a local etcd "
                                "holds the instance records; --proxies proxies watch it)")
                     ->capture_default_str();
      auto* nproxies = sub.add_option("--proxies", o->proxies,
                                      "Proxies (with --control-plane etcd), each on its own port "
                                      "(the first on --port); each printed on a line 'proxy URL'")
                           ->capture_default_str();
      return [=]() -> int {
        UpOptions eff;
        if (cp->count()) eff.control_plane = o->control_plane;
        if (nproxies->count()) eff.proxies = o->proxies;
        if (!cfg->empty() && !LoadConfig(*cfg, eff)) return 2;
        // Flags given on the command line override the config file.
        if (topo->count() || cfg->empty()) eff.topology = o->topology;
        if (port->count()) eff.port = o->port;
        if (log->count()) eff.log_dir = o->log_dir;
        if (mode->count()) eff.mode = o->mode;
        if (transport->count()) eff.transport = o->transport;
        if (model->count()) eff.model_dir = o->model_dir;
        if (fwd->count()) eff.prefill_forward_n = true;
        if (npc->count()) eff.no_prefix_caching = true;
        if (pkb->count()) eff.prefill_kv_blocks = o->prefill_kv_blocks;
        if (rt->count()) eff.ready_timeout_s = o->ready_timeout_s;
        if (routing->count()) eff.routing = o->routing;
        if (skip->count()) eff.pd_skip_threshold = o->pd_skip_threshold;
        if (dkr->count()) eff.decode_kv_role = o->decode_kv_role;
        if (ptp->count()) eff.prefill_tp = o->prefill_tp;
        if (dtp->count()) eff.decode_tp = o->decode_tp;
        if (dev->count()) eff.device = o->device;
        if (gmu->count()) eff.gpu_memory_utilization = o->gpu_memory_utilization;
        if (prom->count()) eff.prometheus_config = o->prometheus_config;
        if (prom_iv->count()) eff.prometheus_interval_s = o->prometheus_interval_s;
        if (restart->count()) eff.restart = o->restart;
        if (budget->count()) eff.restart_budget = o->restart_budget;
        for (const auto& a : o->engine_args) eff.engine_args.push_back(a);
        for (const auto& a : o->prefill_args) eff.prefill_args.push_back(a);
        for (const auto& a : o->decode_args) eff.decode_args.push_back(a);
        for (const auto& a : o->proxy_args) eff.proxy_args.push_back(a);
        (void)eargs;
        (void)pargs;
        (void)dargs;
        (void)xargs;
        return RunUp(eff);
      };
    });

}  // namespace
