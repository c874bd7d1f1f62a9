// kvbridge/common/http_client.h — the engines' outgoing HTTP calls, plain or HTTPS (library
// kvbridge_http_client: cpp-httplib with OpenSSL).
//
// An engine calls other nodes of its P/D cluster: a decode fetches a prefill's
// /v1/kv/metadata (and a WRITE prefill a decode's), `serve --proxy` registers and heartbeats.
// Those calls speak HTTPS when the node they call does, and then verify it:
//
//   ASSIGN_OR_RETURN(HttpTarget t, ParseHttpTarget("https://127.0.0.1:8100"));
//   HttpClientTls tls{.ca_file = "ca.pem"};            // empty: the system's CA store
//   std::unique_ptr<httplib::Client> cli = MakeHttpClient(t, tls);
//   auto res = cli->Get("/health");
//   if (!res) return UnavailableError(HttpErrorText(*cli, res.error(), tls));
//
// With https the server's certificate must chain to `ca_file` and carry the target's host name or
// IP address (subjectAltName): else the call fails before any request byte is sent, and
// HttpErrorText says "TLS: the server's certificate did not verify (<OpenSSL's reason>) against
// <ca_file>". `cert_file`/`key_file` (both or neither) are presented when the server asks for a
// client certificate (a server started with --ssl-ca-certs: mutual TLS).
//
// Thread-safety: the functions are; a client is used by one thread at a time.
#pragma once

#include <memory>
#include <string>
#include <string_view>

#include "kvbridge/common/status.h"

namespace httplib {
class Client;
enum class Error;
}  // namespace httplib

namespace kvbridge {

/// How an engine verifies the HTTPS nodes it calls, and the certificate it shows them.
struct HttpClientTls {
  std::string ca_file;    ///< PEM CA bundle; empty = the system's default CA paths
  std::string cert_file;  ///< PEM client certificate (chain), sent when a server asks; optional
  std::string key_file;   ///< its key
};

/// Where to call: scheme, host, port.
struct HttpTarget {
  bool https = false;
  std::string host;
  int port = 0;
  /// "http://host:port" or "https://host:port".
  std::string Url() const;
};

/// Parses "http://HOST:PORT", "https://HOST:PORT" (a trailing path or '/' ignored) or a bare
/// "HOST:PORT" (http). InvalidArgument on anything else (no host, a port outside [1, 65535]).
Result<HttpTarget> ParseHttpTarget(std::string_view text);

/// A client for `target`: plain, or HTTPS with server verification per `tls` (a CA file that
/// cannot be loaded fails every call with an SSL error; ParseHttpTarget + the server options check
/// the files at startup).
std::unique_ptr<httplib::Client> MakeHttpClient(const HttpTarget& target, const HttpClientTls& tls);

/// A failed call's error in words; a certificate that did not verify names OpenSSL's reason and
/// the CA bundle used.
std::string HttpErrorText(const httplib::Client& client, httplib::Error error,
                          const HttpClientTls& tls);

}  // namespace kvbridge
