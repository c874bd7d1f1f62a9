// kvbridge/server/api_server.h — one engine behind the OpenAI-compatible HTTP API.
//
// The server module turns HTTP requests into EngineRequests and engine outputs into OpenAI
// responses: POST /v1/completions, POST /v1/chat/completions (both with SSE streaming),
// POST /tokenize and POST /detokenize (vLLM's), GET /v1/models, GET /health, GET /metrics
// (Prometheus text: the engine's registry followed by the server's own kvbridge_http_* families).
//
// Text: prompts are encoded with the model's Tokenizer (special tokens such as BOS added as
// the tokenizer's post-processor says; a text the tokenizer refuses is a 400); completion text
// is the tokenizer's Decode(ids, skip_special_tokens=true) and a stream's deltas come from an
// IncrementalDecoder, so the deltas of a streamed answer concatenate to the whole answer's text.
// Errors use OpenAI's shape
// {"error":{"message","type","param","code"}} (docs/api.md lists every status). Requests,
// responses, routes and the error helpers are plain data in kvbridge/common/http_route.h.
//
//   ServerConfig cfg;
//   cfg.port = 8000;
//   cfg.served_model_name = "tiny";
//   ASSIGN_OR_RETURN(auto server, ApiServer::Create(cfg, engine.get(), model->tokenizer()));
//   server->RegisterRoute("POST", "/v1/kv/release", [](const HttpRequest& r) {
//     return HttpResponse{.status = 200, .body = "{}"};
//   });
//   RETURN_IF_ERROR(server->Start());   // listening when it returns
//   server->Wait();                     // until Stop() (e.g. from a signal-watching thread)
//
// P/D: a request body may carry "kv_transfer_params" (an object). Without a
// `validate_kv_transfer_params` hook such a request gets 400 "P/D is not configured on this
// engine". With one, the cluster token (when configured) is checked first (header
// "X-KVBridge-Cluster-Token", else 403), then the hook validates/normalizes the object in place;
// its non-OK Status becomes the HTTP error (see HttpStatusFromStatus). The object then goes to
// EngineRequest::kv_transfer_params, and the engine's final RequestOutput::kv_transfer_params is
// returned at the top level of the response body as "kv_transfer_params" (non-streaming), or of
// the last streamed chunk that carries a finish_reason (streaming).
//
// Client disconnects (streaming or not) abort the engine request; its blocks are freed.
//
// Thread-safety: RegisterRoute before Start; Start/Stop/Wait from one controlling thread;
// port(), metrics() and CheckClusterToken from any thread. Route handlers run on the HTTP
// thread pool (config.num_http_threads threads), concurrently.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/http_route.h"
#include "kvbridge/common/metrics.h"
#include "kvbridge/common/status.h"
#include "kvbridge/model/chat_template.h"
#include "kvbridge/model/generation_config.h"
#include "kvbridge/model/tokenizer.h"

namespace kvbridge {

class Engine;

namespace server {

struct ServerConfig {
  std::string host = "127.0.0.1";
  int port = 8000;  ///< 0: any free port (read it back with port())
  std::string served_model_name = "kvbridge";
  /// Tokens a request may span (prompt + max_tokens); 0 = leave the check to the engine.
  int max_model_len = 0;
  int max_n = 128;             ///< largest accepted `n` (and `best_of`)
  int max_logprobs = 20;       ///< largest accepted `logprobs` / `top_logprobs`
  std::string api_key;         ///< non-empty: /v1/* require "Authorization: Bearer <key>"
  int num_http_threads = 128;  ///< concurrent requests (each connection holds one)
  /// Connections waiting for one of the num_http_threads (each serves one connection at a time);
  /// a connection past this many is answered 503 with Retry-After at once and closed.
  int max_queued_connections = 1024;
  int keep_alive_timeout_s = 2;  ///< idle keep-alive connections close after this
  /// P/D (see the header comment). Empty: requests carrying kv_transfer_params get 400.
  std::function<Status(nlohmann::json& kv_transfer_params)> validate_kv_transfer_params;
  /// The checkpoint's chat templates (LoadChatTemplates); null or empty: chat prompts use
  /// kvbridge's plain format (docs/api.md).
  std::shared_ptr<const ChatTemplates> chat_templates;
  /// Values of temperature, top_p, top_k and max_tokens for requests that leave them out
  /// (the generation config's, LoadGenerationConfig; empty: the OpenAI defaults).
  SamplingDefaults sampling_defaults;
  /// vLLM's --enable-auto-tool-choice / --tool-call-parser ("hermes" | "llama3_json"):
  /// tool_choice "auto" parses the chat answer's tool calls into message.tool_calls (docs/api.md
  /// "Tools"). The flag needs a parser (InvalidArgument from Create, as vLLM).
  bool enable_auto_tool_choice = false;
  std::string tool_call_parser;
  /// vLLM's --reasoning-parser ("qwen3" | "deepseek_r1"): chat answers split into
  /// message.reasoning_content and content.
  std::string reasoning_parser;
  /// Non-empty: kv_transfer_params (and routes that call CheckClusterToken) need header
  /// "X-KVBridge-Cluster-Token: <token>".
  std::string cluster_token;
  /// TLS, as vLLM names it (--ssl-certfile / --ssl-keyfile, PEM files): both set = the server
  /// speaks HTTPS only (OpenSSL via cpp-httplib). Create fails with InvalidArgument when only one
  /// is set or they do not load (a missing file, a key that does not match the certificate).
  std::string ssl_certfile;
  std::string ssl_keyfile;
  /// PEM CA bundle (--ssl-ca-certs): with TLS, clients must present a certificate it signed
  /// (mutual TLS; vLLM's --ssl-ca-certs with --ssl-cert-reqs 2). Needs ssl_certfile.
  std::string ssl_ca_certs;
};

class ApiServer {
 public:
  /// `engine` must outlive the server. Ignores SIGPIPE process-wide (the HTTP library writes to
  /// sockets without MSG_NOSIGNAL; a client that disconnects must not kill the process).
  /// `tokenizer` is the model's (text <-> ids for every endpoint).
  /// Errors: InvalidArgument (bad config: num_http_threads < 1, max_n < 1, null engine).
  static Result<std::unique_ptr<ApiServer>> Create(ServerConfig config, Engine* engine,
                                                   Tokenizer tokenizer);
  ~ApiServer();  ///< Stop()s.
  ApiServer(const ApiServer&) = delete;
  ApiServer& operator=(const ApiServer&) = delete;

  /// Adds a route. `method` is GET|POST|PUT|DELETE; `pattern` an ECMAScript regex matched
  /// against the whole path (captures land in HttpRequest::path_matches). Routes under /v1/ get
  /// the API-key check. Errors: FailedPrecondition after Start, InvalidArgument (method, regex).
  Status RegisterRoute(std::string_view method, const std::string& pattern, RouteHandler handler);
  /// RegisterRoute(route.method, route.pattern, route.handler): a route another module hands
  /// out as data (e.g. KvBridgeRuntime::Routes()).
  Status RegisterRoute(Route route);

  /// Binds host:port and serves on background threads; returns once listening.
  /// Errors: Unavailable (cannot bind), FailedPrecondition (already started).
  Status Start();
  /// The bound port (after Start).
  int port() const;
  /// Stops accepting, aborts every in-flight engine request, and joins the HTTP threads.
  /// Idempotent; safe from any thread except an HTTP handler.
  void Stop();
  /// Blocks until Stop() was called (from another thread).
  void Wait();

  /// Graceful drain, step one: from now on generation requests (/v1/completions,
  /// /v1/chat/completions) get 503 "the server is draining" (a proxy sends them elsewhere) and
  /// GET /health answers 503 {"status":"draining"}; requests already admitted go on, and so do
  /// the other routes (a drained prefill still serves its holds' /v1/kv/* calls). Idempotent;
  /// thread-safe. The caller waits until in_flight() is 0 and the engine is idle, then Stop()s.
  void BeginDrain();
  bool draining() const;
  /// Generation requests being served now (admitted, response not finished). Thread-safe.
  int in_flight() const;

  /// True when no cluster token is configured or `req` carries the right one.
  bool CheckClusterToken(const HttpRequest& req) const;
  /// The server's own metrics (kvbridge_http_*); /metrics renders the engine's registry then this.
  MetricsRegistry& metrics();

 private:
  struct Impl;
  explicit ApiServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace server
}  // namespace kvbridge
