// TLS for the proxy (internal to src/proxy): its HTTPS port and its HTTPS legs to engines.
//
//   ASSIGN_OR_RETURN(auto server_ctx, MakeServerTlsContext(cert, key));      //
//   --ssl-certfile/-keyfile ASSIGN_OR_RETURN(auto client_ctx, MakeClientTlsContext(ca, cert, key));
//   // --ssl-ca-certs Stream s(std::move(socket), *client_ctx);
//   RETURN_IF_ERROR(PrepareClientTls(*s.tls(), host));  // SNI + the name or IP to verify
//   co_await s.tls()->async_handshake(ssl::stream_base::client, ...);
//   if (ec) ... TlsErrorText(ec, *s.tls()) ...          // "certificate verify failed (...)"
//
// The client context verifies the engine's certificate chain against `ca_file` (the system's CA
// store when empty) and its name: the URL's host, a DNS name or an IP literal, must be in the
// certificate's subjectAltName (OpenSSL's X509_check_host / X509_check_ip rules). A failure fails
// the handshake before any HTTP byte is sent. With `cert_file`/`key_file` the proxy presents that
// certificate when an engine asks for one (engines started with --ssl-ca-certs: mutual TLS).
//
// Thread-safety: a context is read-only once made and is shared by every connection.
#pragma once

#include <boost/asio/ip/tcp.hpp>
#include <boost/asio/ssl.hpp>
#include <boost/system/error_code.hpp>
#include <memory>
#include <string>

#include "kvbridge/common/status.h"

namespace kvbridge::proxy {

/// A TLS server context with `cert_file` (PEM chain) and `key_file` (PEM key). InvalidArgument
/// naming the file when one cannot be read or the key does not match the certificate.
Result<std::shared_ptr<boost::asio::ssl::context>> MakeServerTlsContext(
    const std::string& cert_file, const std::string& key_file);
/// A TLS client context that verifies peers against `ca_file` (PEM bundle; empty = the system's
/// default CA paths) and presents `cert_file`/`key_file` when both are set. InvalidArgument
/// naming the file on a bad one.
Result<std::shared_ptr<boost::asio::ssl::context>> MakeClientTlsContext(
    const std::string& ca_file, const std::string& cert_file, const std::string& key_file);
/// Sets SNI (for a name) and the host name or IP address the peer's certificate must carry.
Status PrepareClientTls(boost::asio::ssl::stream<boost::asio::ip::tcp::socket>& stream,
                        const std::string& host);
/// The error of a TLS operation in words; for a certificate that did not verify, OpenSSL's reason
/// ("certificate verify failed: self-signed certificate in certificate chain").
std::string TlsErrorText(const boost::system::error_code& ec,
                         boost::asio::ssl::stream<boost::asio::ip::tcp::socket>& stream);

}  // namespace kvbridge::proxy
