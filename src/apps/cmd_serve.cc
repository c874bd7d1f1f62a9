// `kvbridge serve MODEL_DIR`: one engine behind the OpenAI-compatible HTTP API (docs/api.md).
#include <pthread.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "apps/command_registry.h"
#include "apps/model_source.h"
#include "apps/port_file.h"
#include "kvbridge/common/logging.h"
#include "kvbridge/connector/kvbridge_connector.h"
#include "kvbridge/engine/engine.h"
#include "kvbridge/engine/kv_event_log.h"
#include "kvbridge/model/chat_template.h"
#include "kvbridge/model/config.h"
#include "kvbridge/model/cuda_model.h"
#include "kvbridge/model/generation_config.h"
#include "kvbridge/model/model.h"
#include "kvbridge/proxy/etcd_client.h"
#include "kvbridge/proxy/registration.h"
#include "kvbridge/server/api_server.h"

namespace kvbridge::apps {
namespace {

struct ServeOptions {
  std::string model_dir;
  std::string host = "127.0.0.1";
  int port = 8000;
  std::string served_model_name;
  int max_model_len = 0;
  int max_num_seqs = 64;
  int max_num_batched_tokens = 2048;
  int block_size = 16;
  int64_t kv_cache_memory = 256ll << 20;
  int64_t num_kv_blocks = 0;
  std::string kv_cache_dtype = "auto";
  std::string dtype = "auto";              // resident weight type (vLLM's --dtype)
  std::string chat_template;               // vLLM's --chat-template: a file, or the template itself
  std::string generation_config = "auto";  // vLLM's --generation-config: auto | vllm | DIR
  bool enable_auto_tool_choice = false;    // vLLM's tool-call flags
  std::string tool_call_parser;
  std::string reasoning_parser;
  std::vector<std::string> ignored_vllm_flags;  // given vLLM flags with no effect here
  bool enable_prefix_caching = true;
  uint64_t seed = 0;
  std::string api_key;
  std::string ssl_certfile, ssl_keyfile, ssl_ca_certs;  // vLLM's TLS options
  std::string ssl_peer_ca_certs;  // verifies the https peers and proxy this engine calls
  int max_waiting_requests = 1024;
  int http_threads = 128;
  int max_queued_connections = 1024;
  int model_threads = 0;
  int tensor_parallel_size = 1;
  std::string device = "cpu";  // cpu | cuda | cuda:N
  double gpu_memory_utilization = 0.9;
  std::string kv_transfer_config;
  std::string cluster_token;
  bool insecure_no_cluster_token = false;  // P/D on a non-loopback host without a token
  std::string advertise_host;
  std::string proxy;          // HOST:PORT of a `kvbridge proxy` to register with; empty = none
  std::string port_file;      // where to write the bound port once listening; empty = nowhere
  std::string instance_name;  // stable name across restarts, in the proxy registration
  int restart_count = 0;      // times `kvbridge up` restarted this engine
  // The etcd control plane (docs/proxy.md "Control plane on etcd"): members, cluster, auth.
  std::string etcd;
  std::string etcd_cluster = "default";
  std::string etcd_user;
  std::string etcd_ca;
  int etcd_lease_ttl_s = 5;
  double drain_timeout_s = 30;
};

Result<KvDtype> ParseKvDtype(const std::string& s) {
  if (s == "auto" || s == "fp32") return KvDtype::kFp32;
  if (s == "bf16") return KvDtype::kBf16;
  if (s == "fp8") return KvDtype::kFp8E4M3;
  return InvalidArgumentError("--kv-cache-dtype must be auto|fp32|bf16|fp8, got '" + s + "'");
}

// 127.0.0.0/8, ::1 and "localhost": reachable from this host only.
bool IsLoopbackHost(const std::string& h) {
  return h == "localhost" || h == "::1" || h == "[::1]" || h.rfind("127.", 0) == 0;
}

int Fail(const Status& s) {
  std::fprintf(stderr, "kvbridge serve: %s\n", s.ToString().c_str());
  return 1;
}

int RunServe(const ServeOptions& o) {
  for (const std::string& flag : o.ignored_vllm_flags) {
    KVB_LOG_INFO("{}: accepted for vLLM compatibility, no effect on this engine (ignored)", flag);
  }
  // SIGINT/SIGTERM are taken by a watcher thread (sigwait), so blocked in every thread.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);

  auto device = ParseDeviceSpec(o.device);
  if (!device.ok()) return Fail(device.status());
  // auto = fp32 on the CPU (the reference), bf16 on the GPU (the model's dtype, as vLLM).
  auto dtype = ParseKvDtype(*device >= 0 && o.kv_cache_dtype == "auto" ? "bf16" : o.kv_cache_dtype);
  if (!dtype.ok()) return Fail(dtype.status());
  if (*device >= 0) {
    if (Status s = CudaDeviceAvailable(*device); !s.ok()) return Fail(s.WithPrefix("--device"));
  }
  auto weight_dtype = ParseWeightDtype(o.dtype);
  if (!weight_dtype.ok()) return Fail(weight_dtype.status().WithPrefix("--dtype"));
  if (!o.kv_transfer_config.empty() && o.cluster_token.empty() && !IsLoopbackHost(o.host)) {
    // No open P/D engine by accident (issue 22): kv_transfer_params, /v1/kv/* and the KV
    // transfer ports would take anyone who can reach --host.
    if (!o.insecure_no_cluster_token) {
      return Fail(FailedPreconditionError(
          "a P/D engine (--kv-transfer-config) on the non-loopback --host " + o.host +
          " needs --cluster-token (the secret proxy and engines share); "
          "--insecure-no-cluster-token starts it open to anyone who can reach that address"));
    }
    KVB_LOG_WARN(
        "serve: --insecure-no-cluster-token: P/D engine on {} without a cluster token: "
        "kv_transfer_params, /v1/kv/* and the KV transfer ports accept anyone who can "
        "reach it",
        o.host);
  }
  // The engine's own calls (a peer's /v1/kv/metadata, --proxy's registration) verify HTTPS
  // nodes with --ssl-peer-ca-certs, else --ssl-ca-certs (the cluster's CA), else the system's CAs;
  // they show this engine's certificate to nodes that ask for one (mutual TLS).
  HttpClientTls peer_tls;
  peer_tls.ca_file = !o.ssl_peer_ca_certs.empty() ? o.ssl_peer_ca_certs : o.ssl_ca_certs;
  peer_tls.cert_file = o.ssl_certfile;
  peer_tls.key_file = o.ssl_keyfile;
  if (!o.ssl_peer_ca_certs.empty()) {
    std::FILE* f = std::fopen(o.ssl_peer_ca_certs.c_str(), "rb");
    if (f == nullptr) {
      return Fail(
          InvalidArgumentError("--ssl-peer-ca-certs: cannot read '" + o.ssl_peer_ca_certs + "'"));
    }
    std::fclose(f);
  }
  bool weightless = false;
  auto model =
      LoadModelOrPreset(o.model_dir, *device >= 0,
                        {.num_threads = o.model_threads, .dtype = *weight_dtype}, &weightless);
  if (!model.ok()) return Fail(model.status());
  if (weightless) {
    KVB_LOG_INFO(
        "model: preset '{}' (seed 0) without a directory: no host weights; the GPU "
        "engine generates them in device memory",
        o.model_dir);
  } else {
    KVB_LOG_INFO("model: weights {} resident: {} bytes ({:.1f} MiB; safetensors files {:.1f} MiB)",
                 (*model)->weight_types(), (*model)->weight_bytes(),
                 static_cast<double>((*model)->weight_bytes()) / (1 << 20),
                 static_cast<double>((*model)->weight_file_bytes()) / (1 << 20));
  }
  const int model_max_len = (*model)->config().max_position_embeddings;
  if (o.max_model_len > model_max_len) {
    return Fail(InvalidArgumentError("--max-model-len " + std::to_string(o.max_model_len) +
                                     " exceeds the model's max_position_embeddings " +
                                     std::to_string(model_max_len)));
  }

  EngineConfig ec;
  ec.block_size = o.block_size;
  ec.num_blocks = o.num_kv_blocks;
  ec.kv_cache_memory_bytes = o.kv_cache_memory;
  ec.kv_dtype = *dtype;
  ec.enable_prefix_caching = o.enable_prefix_caching;
  ec.max_num_seqs = o.max_num_seqs;
  ec.max_num_batched_tokens = o.max_num_batched_tokens;
  ec.max_model_len = o.max_model_len;
  ec.max_waiting_requests = o.max_waiting_requests;
  ec.seed = o.seed;
  ec.tensor_parallel_size = o.tensor_parallel_size;
  ec.cuda_device = *device;
  ec.gpu_memory_utilization = o.gpu_memory_utilization;

  server::ServerConfig sc;
  sc.host = o.host;
  sc.port = o.port;
  sc.served_model_name =
      o.served_model_name.empty()
          ? std::filesystem::path(o.model_dir).lexically_normal().filename().string()
          : o.served_model_name;
  if (sc.served_model_name.empty()) sc.served_model_name = "kvbridge";
  ec.served_model_name = sc.served_model_name;
  sc.max_model_len = o.max_model_len > 0 ? o.max_model_len : model_max_len;
  sc.api_key = o.api_key;
  sc.num_http_threads = o.http_threads;
  sc.max_queued_connections = o.max_queued_connections;
  sc.cluster_token = o.cluster_token;
  sc.ssl_certfile = o.ssl_certfile;
  sc.ssl_keyfile = o.ssl_keyfile;
  sc.ssl_ca_certs = o.ssl_ca_certs;
  // (A weightless preset's name is no existing path: no template or generation config is found.)
  auto templates = LoadChatTemplates(o.model_dir, o.chat_template);
  if (!templates.ok()) return Fail(templates.status().WithPrefix("chat template"));
  if (!templates->empty()) {
    KVB_LOG_INFO("chat template: {} ({} template(s))", templates->templates[0].second.origin(),
                 templates->templates.size());
    sc.chat_templates = std::make_shared<const ChatTemplates>(*std::move(templates));
  }

  // generation_config.json as vLLM reads it: its EOS ids stop in every mode, its sampling
  // values are the defaults of requests that leave them out unless --generation-config vllm.
  auto gen = LoadGenerationConfig(o.model_dir, o.generation_config);
  if (!gen.ok()) return Fail(gen.status().WithPrefix("generation config"));
  if (gen->eos_token_ids) ec.eos_token_ids = *gen->eos_token_ids;
  SamplingDefaults defaults = gen->defaults;
  // No repetition penalty or min_p in this engine's sampler: not applied, and said so.
  if (defaults.repetition_penalty || defaults.min_p) {
    KVB_LOG_WARN(
        "generation config {}: repetition_penalty / min_p defaults are not applied (this "
        "engine's sampler has neither)",
        gen->path);
    defaults.repetition_penalty.reset();
    defaults.min_p.reset();
  }
  if (!defaults.empty()) {
    KVB_LOG_WARN(
        "Default sampling parameters have been overridden by the model's Hugging Face "
        "generation config recommended from the model creator. If this is not intended, please "
        "relaunch with `--generation-config vllm`.");
    KVB_LOG_INFO("Using default sampling params from {}: {}", gen->path, defaults.ToString());
  }
  sc.sampling_defaults = defaults;
  sc.enable_auto_tool_choice = o.enable_auto_tool_choice;
  sc.tool_call_parser = o.tool_call_parser;
  sc.reasoning_parser = o.reasoning_parser;

  std::shared_ptr<KvBridgeRuntime> kv;
  KvTransferConfig kv_cfg;
  if (!o.proxy.empty() && o.kv_transfer_config.empty())
    return Fail(InvalidArgumentError("--proxy needs --kv-transfer-config (the engine's P/D role)"));
  if (!o.etcd.empty() && o.kv_transfer_config.empty())
    return Fail(InvalidArgumentError("--etcd needs --kv-transfer-config (the engine's P/D role)"));
  proxy::EtcdClientOptions etcd_options;
  std::string etcd_prefix;
  if (!o.etcd.empty()) {
    auto eo = proxy::ParseEtcdOptions(o.etcd, o.etcd_user, o.etcd_ca);
    if (!eo.ok()) return Fail(eo.status());
    etcd_options = *eo;
    auto prefix = proxy::EtcdInstancesPrefix(o.etcd_cluster);
    if (!prefix.ok()) return Fail(prefix.status().WithPrefix("--etcd-cluster"));
    etcd_prefix = *prefix;
  }
  if (!o.kv_transfer_config.empty()) {
    auto cfg = ParseKvTransferConfig(o.kv_transfer_config);
    if (!cfg.ok()) return Fail(cfg.status().WithPrefix("--kv-transfer-config"));
    kv_cfg = *cfg;
    KvBridgeOptions ko;
    ko.config = *cfg;
    ko.cluster_token = o.cluster_token;
    ko.advertise_host = o.advertise_host.empty() ? o.host : o.advertise_host;
    ko.bind_host = o.host;
    // The engines of one P/D cluster all serve https or all http: peers are called as we serve.
    ko.peer_https = !o.ssl_certfile.empty();
    ko.peer_tls = peer_tls;
    // Test-only (the GPU P/D check's "a corrupted block changes the logprobs"): never in use.
    if (const char* v = std::getenv("KVBRIDGE_DEBUG_CORRUPT_FIRST_READ_BLOCK"); v && v[0] == '1') {
      KVB_LOG_WARN(
          "serve: test-only: the first block of every KV READ is corrupted after it lands");
      ko.debug_corrupt_first_read_block = true;
    }
    auto created = KvBridgeRuntime::Create(ko);
    if (!created.ok()) return Fail(created.status());
    kv = *created;
    ec.connector_factory = kv->Factory();
    sc.validate_kv_transfer_params = kv->ValidateHook();
  }

  // KV events (GET /v1/kv/events): what this engine's prefix cache holds, for KV-aware routing.
  auto kv_events = std::make_shared<KvEventLog>(
      KvEventLogOptions{.block_size = o.block_size, .model_fingerprint = (*model)->fingerprint()});
  ec.kv_cache_listener = kv_events;

  auto engine = Engine::Create(ec, std::shared_ptr<const Model>(*model));
  if (!engine.ok()) return Fail(engine.status());
  const EngineStats st = (*engine)->Stats();
  KVB_LOG_INFO("engine: model '{}' ({}), {} KV blocks of {} tokens ({}), max_model_len {}",
               o.model_dir, (*model)->fingerprint(), st.kv_blocks_total, o.block_size,
               KvDtypeName(*dtype), sc.max_model_len);

  auto srv = server::ApiServer::Create(sc, engine->get(), (*model)->tokenizer());
  if (!srv.ok()) return Fail(srv.status());
  if (Status s = (*srv)->RegisterRoute(KvEventsRoute(kv_events, o.cluster_token)); !s.ok())
    return Fail(s);
  if (kv) {
    for (Route& route : kv->Routes()) {
      Status s = (*srv)->RegisterRoute(std::move(route));
      if (!s.ok()) return Fail(s);
    }
  }
  // POST /drain (docs/proxy.md "Drain"): the watcher below sees draining() and drains. With a
  // cluster token, only its holders may drain the engine.
  Status drain_route = (*srv)->RegisterRoute(
      "POST", "/drain", [srv_ptr = srv->get(), token = o.cluster_token](const HttpRequest& req) {
        if (!ClusterTokenMatches(req, token)) {
          return OpenAiErrorResponse(403, "POST /drain needs the cluster token");
        }
        srv_ptr->BeginDrain();
        return HttpResponse{.status = 200, .body = R"({"status":"draining"})"};
      });
  if (!drain_route.ok()) return Fail(drain_route);
  bool drain_timed_out = false;
  Status started = (*srv)->Start();
  if (!started.ok()) return Fail(started);
  if (!o.port_file.empty()) {
    Status written = WritePortFile(o.port_file, (*srv)->port());
    if (!written.ok()) return Fail(written);
  }
  if (kv)
    kv->SetAdvertisedEndpoint(o.advertise_host.empty() ? o.host : o.advertise_host, (*srv)->port());

  // Registration with the proxy (`--proxy`): role and mode from --kv-transfer-config; load
  // (running/waiting requests, KV usage) from the engine's stats at each heartbeat.
  std::unique_ptr<proxy::RegistrationClient> registration;
  std::unique_ptr<proxy::EtcdRegistration> etcd_registration;
  if (!o.proxy.empty() || !o.etcd.empty()) {
    proxy::RegistrationOptions ro;
    ro.proxy = o.proxy;
    ro.cluster_token = o.cluster_token;
    ro.tls = peer_tls;
    ro.info.role = kv_cfg.role == KvRole::kProducer ? proxy::Role::kPrefill : proxy::Role::kDecode;
    // kv_both registers as a decode that kv-aware routing may also send prefill legs.
    ro.info.kv_both = kv_cfg.role == KvRole::kBoth;
    ro.info.mode = kv_cfg.mode;
    ro.info.url = std::string(o.ssl_certfile.empty() ? "http://" : "https://") +
                  (o.advertise_host.empty() ? o.host : o.advertise_host) + ":" +
                  std::to_string((*srv)->port());
    ro.info.engine_id = kv->engine_id();
    // WRITE mode: the proxy names this endpoint (where GET /v1/kv/metadata answers) to decodes.
    ro.info.transfer_endpoints = {ro.info.url};
    // WRITE mode: the proxy names this to decodes as the prefill's tp_size (they pair ranks).
    ro.info.tp_size = std::max(1, o.tensor_parallel_size);
    ro.info.name = o.instance_name;
    ro.info.restarts = o.restart_count;
    if (!o.etcd.empty()) {
      // The record: the registration JSON + this process's incarnation, under its name (or
      // engine id), with an HMAC keyed by the cluster token; static for the engine's life (its
      // load goes point to point: GET /health). The lease's expiry removes it when we die.
      ro.info.id = ro.info.url;
      const std::string key =
          etcd_prefix + (o.instance_name.empty() ? kv->engine_id() : o.instance_name);
      nlohmann::json record = nlohmann::json::parse(
          proxy::RegistrationJson(ro.info, proxy::InstanceLoad{}), nullptr, false);
      record["incarnation"] = kv->engine_id();
      etcd_registration = proxy::EtcdRegistration::Start(
          etcd_options, key, proxy::EtcdRecordValue(key, record.dump(), o.cluster_token),
          o.etcd_lease_ttl_s);
      KVB_LOG_INFO("registering in etcd {} as {} ({})", o.etcd, key, ro.info.url);
    }
    if (!o.proxy.empty()) {
      Engine* eng = engine->get();
      registration = proxy::RegistrationClient::Start(ro, [eng] {
        const EngineStats st = eng->Stats();
        proxy::InstanceLoad load;
        load.running = st.running;
        load.waiting = st.waiting + st.waiting_for_remote_kv;
        load.kv_usage = st.kv_blocks_total > 0 ? static_cast<double>(st.kv_blocks_active) /
                                                     static_cast<double>(st.kv_blocks_total)
                                               : 0.0;
        return load;
      });
      KVB_LOG_INFO("registering with proxy {} as {}", o.proxy, ro.info.url);
    }
  }

  // Graceful drain on SIGTERM/SIGINT or POST /drain: new requests get 503, the proxy is told
  // (deregister) and routes around this engine, what was admitted finishes — holds for decodes
  // included — within --drain-timeout, then the server stops and serve exits 0. A second
  // signal stops at once.
  std::thread watcher([&] {
    using WatchClock = std::chrono::steady_clock;
    auto wait_signal = [&](int ms) {
      timespec ts{ms / 1000, (ms % 1000) * 1'000'000L};
      return sigtimedwait(&signals, nullptr, &ts);
    };
    for (;;) {
      const int sig = wait_signal(100);
      if (sig > 0) {
        KVB_LOG_INFO("kvbridge serve: signal {}, draining (a second signal stops at once)", sig);
        break;
      }
      if ((*srv)->draining()) break;  // POST /drain
    }
    (*srv)->BeginDrain();
    if (registration) registration->Stop();            // deregisters: the proxy stops routing here
    if (etcd_registration) etcd_registration->Stop();  // revokes: every proxy drops it
    const auto t0 = WatchClock::now();
    const auto deadline =
        t0 + std::chrono::milliseconds(static_cast<int64_t>(o.drain_timeout_s * 1000));
    int idle_polls = 0;
    for (;;) {
      const EngineStats st = (*engine)->Stats();
      const bool idle = (*srv)->in_flight() == 0 && st.running == 0 && st.waiting == 0 &&
                        st.waiting_for_remote_kv == 0 && st.kv_blocks_active == 0;
      // Idle twice in a row, 50 ms apart: a hold released as a response is written is seen.
      idle_polls = idle ? idle_polls + 1 : 0;
      if (idle_polls >= 2) {
        KVB_LOG_INFO(
            "kvbridge serve: drained in {} ms",
            std::chrono::duration_cast<std::chrono::milliseconds>(WatchClock::now() - t0).count());
        break;
      }
      if (WatchClock::now() >= deadline) {
        drain_timed_out = true;
        KVB_LOG_WARN(
            "kvbridge serve: drain timed out after {} s ({} HTTP requests, {} running, {} "
            "waiting, {} KV blocks in use); stopping",
            o.drain_timeout_s, (*srv)->in_flight(), st.running,
            st.waiting + st.waiting_for_remote_kv, st.kv_blocks_active);
        break;
      }
      if (wait_signal(50) > 0) {
        KVB_LOG_WARN("kvbridge serve: second signal, stopping without waiting");
        break;
      }
    }
    kv_events->Close();  // long polls answer now, not at their timeout
    (*srv)->Stop();
  });
  (*srv)->Wait();
  watcher.join();
  if (registration) registration->Stop();
  if (etcd_registration) etcd_registration->Stop();
  (*engine)->Shutdown();
  srv->reset();
  KVB_LOG_INFO("kvbridge serve: stopped");
  return drain_timed_out ? 3 : 0;
}

const bool kRegistered = RegisterCommand(
    "serve", "Serve one engine with the OpenAI-compatible HTTP API", [](CLI::App& sub) {
      auto o = std::make_shared<ServeOptions>();
      sub.add_option("model_dir", o->model_dir,
                     "Model directory (config.json + model.safetensors), e.g. from make-model; "
                     "with --device cuda also a preset name (qwen2.5-7b, ...: random weights "
                     "generated on the GPU, seed 0, no directory)")
          ->required();
      sub.add_option("--host", o->host, "Address to listen on")->capture_default_str();
      sub.add_option("--port", o->port, "TCP port to listen on (0: any free port)")
          ->capture_default_str();
      sub.add_option("--port-file", o->port_file,
                     "Write the bound port (a number and a newline) to this file once listening");
      sub.add_option("--generation-config", o->generation_config,
                     "Where sampling defaults come from, as vLLM: auto (the checkpoint's "
                     "generation_config.json), vllm (none: the OpenAI defaults), or a directory "
                     "holding a generation_config.json. Its eos_token_id stops in every mode")
          ->capture_default_str();
      sub.add_flag("--enable-auto-tool-choice", o->enable_auto_tool_choice,
                   "Parse the model's tool calls for tool_choice \"auto\" (needs "
                   "--tool-call-parser), as vLLM");
      sub.add_option("--tool-call-parser", o->tool_call_parser,
                     "How tool calls are written: hermes (<tool_call>{...}</tool_call>: Qwen, "
                     "Hermes) | llama3_json (Llama 3's JSON), as vLLM");
      sub.add_option("--reasoning-parser", o->reasoning_parser,
                     "Split <think>...</think> into message.reasoning_content: qwen3 | "
                     "deepseek_r1, as vLLM");
      sub.add_option("--chat-template", o->chat_template,
                     "Chat template (a file, or the Jinja text itself) instead of the "
                     "checkpoint's (chat_template.jinja / tokenizer_config.json); as vLLM");
      sub.add_option("--served-model-name", o->served_model_name,
                     "Model name clients send in \"model\" (default: the model directory's name)");
      sub.add_option("--max-model-len", o->max_model_len,
                     "Most tokens a request may span, prompt + completion (0: the model's "
                     "max_position_embeddings)")
          ->capture_default_str();
      sub.add_option("--max-num-seqs", o->max_num_seqs,
                     "Most sequences (siblings count one each) scheduled in one step")
          ->capture_default_str();
      sub.add_option("--max-num-batched-tokens", o->max_num_batched_tokens,
                     "Most tokens computed in one step (long prompts are prefilled in chunks)")
          ->capture_default_str();
      sub.add_option("--block-size", o->block_size, "Tokens per KV cache block")
          ->capture_default_str();
      sub.add_option("--kv-cache-memory", o->kv_cache_memory,
                     "KV cache size in BYTES (the block count follows); ignored with "
                     "--num-kv-blocks")
          ->capture_default_str();
      sub.add_option("--num-kv-blocks", o->num_kv_blocks,
                     "Exact number of KV blocks (0: from --kv-cache-memory)")
          ->capture_default_str();
      sub.add_option("--kv-cache-dtype", o->kv_cache_dtype,
                     "KV cache element type: auto (= fp32 on cpu, bf16 on cuda), fp32, bf16, fp8 "
                     "(e4m3, per-layer scales)")
          ->capture_default_str();
      sub.add_option("--device", o->device,
                     "Where the model runs: cpu, or cuda[:N] (weights and KV cache in GPU N's "
                     "memory; the KV pool from --gpu-memory-utilization unless --num-kv-blocks)")
          ->capture_default_str();
      sub.add_option("--gpu-memory-utilization", o->gpu_memory_utilization,
                     "With --device cuda: fraction of the GPU's memory for weights + activations + "
                     "KV cache (as vLLM)")
          ->check(CLI::Range(0.01, 1.0))
          ->capture_default_str();
      sub.add_option("--dtype", o->dtype,
                     "Weight type kept in memory: auto (as stored: bf16/fp16 files are used in "
                     "place, memory-mapped), bfloat16, float16, float32 (converted at load). "
                     "Compute is fp32 either way")
          ->capture_default_str();
      sub.add_flag("--enable-prefix-caching,!--no-enable-prefix-caching", o->enable_prefix_caching,
                   "Reuse the KV of full blocks of earlier prompts (on by default)");
      sub.add_option("--seed", o->seed,
                     "Default sampling seed for requests that give none (reproducible runs)")
          ->capture_default_str();
      sub.add_option(
          "--api-key", o->api_key,
          "Require \"Authorization: Bearer KEY\" on /v1/* (health and metrics stay open)");
      sub.add_option("--ssl-certfile", o->ssl_certfile,
                     "PEM certificate (chain): serve HTTPS only (with --ssl-keyfile), as vLLM");
      sub.add_option("--ssl-keyfile", o->ssl_keyfile, "PEM private key of --ssl-certfile");
      sub.add_option("--ssl-ca-certs", o->ssl_ca_certs,
                     "PEM CA bundle: require client certificates it signed (mutual TLS; "
                     "vLLM's --ssl-ca-certs with --ssl-cert-reqs 2); also verifies the https "
                     "peers this engine calls unless --ssl-peer-ca-certs");
      sub.add_option("--ssl-peer-ca-certs", o->ssl_peer_ca_certs,
                     "PEM CA bundle that verifies the https nodes this engine calls (P/D peers' "
                     "/v1/kv/metadata, --proxy https://H:P); default --ssl-ca-certs, else the "
                     "system's CAs");
      sub.add_option("--max-waiting-requests", o->max_waiting_requests,
                     "Queued requests beyond which new ones get HTTP 503")
          ->capture_default_str();
      sub.add_option("--http-threads", o->http_threads,
                     "HTTP worker threads = most concurrent connections served")
          ->capture_default_str();
      sub.add_option("--max-queued-connections", o->max_queued_connections,
                     "Connections waiting for an HTTP thread beyond which new ones get HTTP 503 "
                     "(Retry-After) at once")
          ->capture_default_str();
      sub.add_option("--model-threads", o->model_threads,
                     "Threads inside one forward pass (0: hardware concurrency, at most 8)")
          ->capture_default_str();
      sub.add_option("--tensor-parallel-size,--tp", o->tensor_parallel_size,
                     "Tensor-parallel ranks inside this engine (one thread each, own weight "
                     "slices and KV heads); must divide 8 and the model's head count. Output is "
                     "bitwise the same at every size")
          ->capture_default_str();
      sub.add_option("--kv-transfer-config", o->kv_transfer_config,
                     "P/D connector JSON, e.g. '{\"kv_connector\":\"KVBridgeConnector\","
                     "\"kv_role\":\"kv_both\"}' (docs/protocol.md); absent: no P/D");
      sub.add_option("--cluster-token", o->cluster_token,
                     "Secret that P/D callers must send as X-KVBridge-Cluster-Token; the KV "
                     "transfer handshakes (shm, tcp, ucx, cuda_ipc) prove it too. Required with "
                     "--kv-transfer-config on a non-loopback --host");
      sub.add_flag("--insecure-no-cluster-token", o->insecure_no_cluster_token,
                   "Start a P/D engine on a non-loopback --host without --cluster-token (open "
                   "to anyone who can reach it; logged at startup)");
      sub.add_option("--proxy", o->proxy,
                     "HOST:PORT of a kvbridge proxy to register with and heartbeat to (role and "
                     "mode from --kv-transfer-config; kv_producer registers as prefill, else "
                     "decode; kv_both as a decode that kv-aware routing may send prefill legs)");
      sub.add_option("--etcd", o->etcd,
                     "etcd members http(s)://H:P[,...]: write this engine's instance record "
                     "under /kvbridge/<--etcd-cluster>/instances/<name> on a kept-alive lease "
                     "(docs/proxy.md \"Control plane on etcd\")");
      sub.add_option("--etcd-cluster", o->etcd_cluster, "Cluster name of the etcd key prefix")
          ->capture_default_str();
      sub.add_option("--etcd-user", o->etcd_user,
                     "USER:PASSWORD for etcd auth (required, or https + --etcd-ca, for a member "
                     "off loopback)");
      sub.add_option("--etcd-ca", o->etcd_ca, "PEM CA that verifies https:// etcd members");
      sub.add_option("--etcd-lease-ttl-s", o->etcd_lease_ttl_s,
                     "TTL of the lease the record hangs on: proxies drop this engine this long "
                     "after it dies")
          ->capture_default_str()
          ->check(CLI::Range(1, 3600));
      sub.add_option("--drain-timeout", o->drain_timeout_s,
                     "Seconds a drain (SIGTERM, SIGINT or POST /drain) waits for admitted "
                     "requests and held KV to finish before stopping anyway (exit code 3)")
          ->capture_default_str()
          ->check(CLI::Range(0.0, 86400.0));
      sub.add_option("--instance-name", o->instance_name,
                     "Stable name sent with the --proxy registration (kvbridge up: prefill-0, "
                     "decode-1, ...); a new registration under it replaces the old one");
      sub.add_option("--restart-count", o->restart_count,
                     "Times this engine was restarted (set by kvbridge up; in the registration)")
          ->check(CLI::Range(0, 1000000));
      sub.add_option("--advertise-host", o->advertise_host,
                     "Host that prefill answers give decodes as remote_host (default: --host)");
      // vLLM flags that mean nothing on this engine or device: accepted (a vLLM command line
      // runs unchanged) and logged once as ignored.
      for (const char* flag :
           {"--trust-remote-code", "--disable-log-requests", "--disable-log-stats",
            "--enforce-eager", "--disable-custom-all-reduce",
            "--disable-frontend-multiprocessing"}) {
        sub.add_flag_callback(
            flag, [o, flag] { o->ignored_vllm_flags.emplace_back(flag); },
            "vLLM flag, accepted and ignored (no effect here)");
      }
      for (const char* opt : {"--swap-space", "--uvicorn-log-level", "--download-dir",
                              "--load-format", "--tokenizer-mode"}) {
        sub.add_option_function<std::string>(
            opt,
            [o, opt](const std::string& v) {
              o->ignored_vllm_flags.push_back(std::string(opt) + " " + v);
            },
            "vLLM option, accepted and ignored (no effect here)");
      }
      return [o]() -> int { return RunServe(*o); };
    });

}  // namespace
}  // namespace kvbridge::apps
