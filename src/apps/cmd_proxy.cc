// `kvbridge proxy`: the P/D proxy (OpenAI front door, registry, P→D flow). See docs/proxy.md.
#include <signal.h>

#include <cstdio>
#include <memory>

#include "apps/command_registry.h"
#include "apps/port_file.h"
#include "kvbridge/common/logging.h"
#include "kvbridge/proxy/proxy_server.h"
#include "kvbridge/server/prompt_tokens.h"

namespace {

using kvbridge::proxy::ProxyOptions;

struct ProxyCliOptions {
  ProxyOptions proxy;
  std::string mode = "read";
  std::string routing = "least-loaded";
  int heartbeat_timeout_ms = 3000;
  int request_timeout_s = 600;
  int upstream_idle_timeout_ms = 1000;
  int instance_wait_ms = 30000;
  std::string port_file;  // where to write the bound port once listening; empty = nowhere
  std::string model_dir;  // tokenizer + chat template for KV-aware routing; empty: /tokenize
  std::string chat_template;
  std::string etcd, etcd_cluster = "default", etcd_user, etcd_ca;
};

int RunProxy(ProxyCliOptions& cli) {
  auto mode = kvbridge::ParseKvTransferMode(cli.mode);
  auto routing = kvbridge::proxy::ParseRoutingPolicy(cli.routing);
  if (!mode.ok() || !routing.ok()) {
    std::fprintf(stderr, "error: %s\n",
                 (!mode.ok() ? mode.status() : routing.status()).ToString().c_str());
    return 2;
  }
  cli.proxy.mode = *mode;
  cli.proxy.routing = *routing;
  cli.proxy.heartbeat_timeout = cli.heartbeat_timeout_ms * kvbridge::kMillisecond;
  cli.proxy.request_timeout = cli.request_timeout_s * kvbridge::kSecond;
  cli.proxy.upstream_idle_timeout = cli.upstream_idle_timeout_ms * kvbridge::kMillisecond;
  cli.proxy.instance_wait = cli.instance_wait_ms * kvbridge::kMillisecond;
  if (!cli.etcd.empty()) {
    auto eo = kvbridge::proxy::ParseEtcdOptions(cli.etcd, cli.etcd_user, cli.etcd_ca);
    auto prefix = kvbridge::proxy::EtcdInstancesPrefix(cli.etcd_cluster);
    if (!eo.ok() || !prefix.ok()) {
      std::fprintf(stderr, "error: %s\n",
                   (!eo.ok() ? eo.status() : prefix.status()).ToString().c_str());
      return 2;
    }
    cli.proxy.etcd = *eo;
    cli.proxy.etcd_prefix = *prefix;
  }
  if (!cli.model_dir.empty()) {
    auto pt = kvbridge::server::PromptTokenizer::Load(cli.model_dir, cli.chat_template);
    if (!pt.ok()) {
      std::fprintf(stderr, "error: --model: %s\n", pt.status().ToString().c_str());
      return 2;
    }
    std::shared_ptr<const kvbridge::server::PromptTokenizer> shared(std::move(*pt));
    cli.proxy.prompt_ids = [shared](std::string_view path, std::string_view body) {
      return shared->PromptIds(path, body);
    };
  }
  // Signals are taken synchronously by this thread; block them before any thread starts.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  auto server = kvbridge::proxy::ProxyServer::Create(cli.proxy);
  if (!server.ok()) {
    std::fprintf(stderr, "error: %s\n", server.status().ToString().c_str());
    return 1;
  }
  (*server)->Start();
  if (!cli.port_file.empty()) {
    kvbridge::Status written = kvbridge::apps::WritePortFile(cli.port_file, (*server)->port());
    if (!written.ok()) {
      std::fprintf(stderr, "error: %s\n", written.ToString().c_str());
      (*server)->Stop();
      return 1;
    }
  }
  std::printf("kvbridge proxy listening on %s://%s:%d (mode %s, routing %s)\n",
              cli.proxy.ssl_certfile.empty() ? "http" : "https", cli.proxy.host.c_str(),
              (*server)->port(), cli.mode.c_str(), cli.routing.c_str());
  std::fflush(stdout);
  int sig = 0;
  sigwait(&set, &sig);
  KVB_LOG_INFO("proxy: signal {}, stopping", sig);
  (*server)->Stop();
  return 0;
}

const bool kRegistered = kvbridge::apps::RegisterCommand(
    "proxy", "Run the P/D proxy (OpenAI API front door for prefill + decode engines)",
    [](CLI::App& sub) -> kvbridge::apps::CommandMain {
      auto o = std::make_shared<ProxyCliOptions>();
      sub.add_option("--host", o->proxy.host, "Address to listen on")->capture_default_str();
      sub.add_option("--port", o->proxy.port, "Port (0 = any free port)")->capture_default_str();
      sub.add_option("--port-file", o->port_file,
                     "Write the bound port (a number and a newline) to this file once listening");
      sub.add_option("--prefill", o->proxy.prefill_urls,
                     "Static prefill instances (http://H:P or https://H:P)");
      sub.add_option("--decode", o->proxy.decode_urls,
                     "Static decode instances (http://H:P or https://H:P)");
      sub.add_option("--ssl-certfile", o->proxy.ssl_certfile,
                     "PEM certificate (chain): serve HTTPS only (with --ssl-keyfile), as serve's; "
                     "also the client certificate shown to engines that ask for one");
      sub.add_option("--ssl-keyfile", o->proxy.ssl_keyfile, "PEM private key of --ssl-certfile");
      sub.add_option("--ssl-ca-certs", o->proxy.ssl_ca_certs,
                     "PEM CA bundle that verifies https:// engines (default: the system's CAs); "
                     "an engine whose certificate does not verify gets no leg");
      sub.add_option("--mode", o->mode, "KV mode of every instance: read|write")
          ->capture_default_str();
      sub.add_option("--routing", o->routing, "kv-aware|least-loaded|round-robin")
          ->capture_default_str();
      sub.add_option("--pd-skip-threshold", o->proxy.pd_skip_threshold,
                     "Send a request to its decode alone (no prefill leg) when that decode's "
                     "prefix cache lacks at most N of its prompt tokens (-1: never)")
          ->capture_default_str();
      sub.add_option("--model", o->model_dir,
                     "Model directory whose tokenizer and chat template give the prompt ids "
                     "for kv-aware routing / the skip (default: ask an engine's /tokenize)");
      sub.add_option("--chat-template", o->chat_template,
                     "Chat template override, as the engines' --chat-template");
      sub.add_option("--kv-events-poll-ms", o->proxy.kv_events_poll_ms,
                     "Long-poll timeout of each engine's /v1/kv/events")
          ->capture_default_str()
          ->check(CLI::Range(0, 30000));
      sub.add_option("--kv-index-max-blocks", o->proxy.kv_index_max_blocks,
                     "Block hashes the KV index keeps (least recently stored go first)")
          ->capture_default_str();
      sub.add_flag("--prefill-forward-n", o->proxy.prefill_forward_n,
                   "Send the client's n to the prefill leg (default n=1)");
      sub.add_flag("--colocated", o->proxy.colocated,
                   "No P/D: send each request whole to one --decode instance (colocated "
                   "engines behind this proxy, e.g. to compare with P/D)");
      sub.add_option("--cluster-token", o->proxy.cluster_token,
                     "Token sent on legs/releases and required from registering engines");
      sub.add_option("--etcd", o->etcd,
                     "etcd members http(s)://H:P[,...]: list and watch the cluster's instance "
                     "records into the registry (docs/proxy.md \"Control plane on etcd\")");
      sub.add_option("--etcd-cluster", o->etcd_cluster, "Cluster name of the etcd key prefix")
          ->capture_default_str();
      sub.add_option("--etcd-user", o->etcd_user,
                     "USER:PASSWORD for etcd auth (required, or https + --etcd-ca, for a member "
                     "off loopback)");
      sub.add_option("--etcd-ca", o->etcd_ca, "PEM CA that verifies https:// etcd members");
      sub.add_option("--heartbeat-timeout-ms", o->heartbeat_timeout_ms,
                     "Drop a registered instance after this long without a heartbeat")
          ->capture_default_str();
      sub.add_option("--request-timeout-s", o->request_timeout_s, "Bound on one client request")
          ->capture_default_str();
      sub.add_option("--max-pending", o->proxy.max_pending,
                     "Client requests in flight past which new ones get 429 with Retry-After "
                     "(0 = no bound)")
          ->capture_default_str()
          ->check(CLI::Range(0, 1 << 20));
      sub.add_option("--retry-after-s", o->proxy.retry_after_s,
                     "Seconds a 429 (overload) or 503 (no instance, every engine refusing) tells "
                     "the client "
                     "to wait (Retry-After)")
          ->capture_default_str()
          ->check(CLI::Range(1, 3600));
      sub.add_option("--instance-wait-ms", o->instance_wait_ms,
                     "How long a request waits for an instance when none of a role is routable "
                     "(all draining or restarting) before its 503 (0 = at once)")
          ->capture_default_str()
          ->check(CLI::Range(0, 3600000));
      sub.add_option("--restart-count", o->proxy.restart_count,
                     "Times this proxy was restarted (set by kvbridge up; shown in /metrics)")
          ->check(CLI::Range(0, 1000000));
      sub.add_option("--threads", o->proxy.threads, "Event-loop threads")->capture_default_str();
      sub.add_option("--upstream-max-idle", o->proxy.upstream_max_idle,
                     "Idle keep-alive connections kept per engine (0 = a new one per leg)")
          ->capture_default_str()
          ->check(CLI::Range(0, 4096));
      sub.add_option("--upstream-idle-timeout-ms", o->upstream_idle_timeout_ms,
                     "Close idle engine connections after this long")
          ->capture_default_str()
          ->check(CLI::Range(1, 3600000));
      return [o] { return RunProxy(*o); };
    });

}  // namespace
