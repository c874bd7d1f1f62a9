#include "proxy/tls.h"

#include <openssl/ssl.h>
#include <openssl/x509v3.h>

#include <boost/asio/ip/address.hpp>

namespace kvbridge::proxy {

namespace ssl = boost::asio::ssl;

namespace {

std::string Readable(const std::string& file) {
  FILE* f = std::fopen(file.c_str(), "rb");
  if (f == nullptr) return "cannot read '" + file + "'";
  std::fclose(f);
  return "";
}

}  // namespace

Result<std::shared_ptr<ssl::context>> MakeServerTlsContext(const std::string& cert_file,
                                                           const std::string& key_file) {
  if (cert_file.empty() != key_file.empty()) {
    return InvalidArgumentError("TLS needs both --ssl-certfile and --ssl-keyfile");
  }
  for (const std::string* f : {&cert_file, &key_file}) {
    if (std::string e = Readable(*f); !e.empty()) return InvalidArgumentError("TLS: " + e);
  }
  auto ctx = std::make_shared<ssl::context>(ssl::context::tls_server);
  ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                   ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1);
  boost::system::error_code ec;
  ctx->use_certificate_chain_file(cert_file, ec);
  if (!ec) ctx->use_private_key_file(key_file, ssl::context::pem, ec);
  if (ec || SSL_CTX_check_private_key(ctx->native_handle()) != 1) {
    return InvalidArgumentError(
        "TLS: cannot load --ssl-certfile '" + cert_file + "' / --ssl-keyfile '" + key_file +
        "' (PEM; the key must match the certificate)" + (ec ? ": " + ec.message() : ""));
  }
  return ctx;
}

Result<std::shared_ptr<ssl::context>> MakeClientTlsContext(const std::string& ca_file,
                                                           const std::string& cert_file,
                                                           const std::string& key_file) {
  auto ctx = std::make_shared<ssl::context>(ssl::context::tls_client);
  ctx->set_options(ssl::context::default_workarounds | ssl::context::no_sslv2 |
                   ssl::context::no_sslv3 | ssl::context::no_tlsv1 | ssl::context::no_tlsv1_1);
  ctx->set_verify_mode(ssl::verify_peer);
  boost::system::error_code ec;
  if (ca_file.empty()) {
    ctx->set_default_verify_paths(ec);
  } else {
    if (std::string e = Readable(ca_file); !e.empty()) return InvalidArgumentError("TLS: " + e);
    ctx->load_verify_file(ca_file, ec);
  }
  if (ec) {
    return InvalidArgumentError("TLS: cannot load the CA bundle '" +
                                (ca_file.empty() ? std::string("system default") : ca_file) +
                                "': " + ec.message());
  }
  if (!cert_file.empty() && !key_file.empty()) {
    ctx->use_certificate_chain_file(cert_file, ec);
    if (!ec) ctx->use_private_key_file(key_file, ssl::context::pem, ec);
    if (ec) {
      return InvalidArgumentError("TLS: cannot load the client certificate '" + cert_file +
                                  "' / key '" + key_file + "': " + ec.message());
    }
  }
  return ctx;
}

Status PrepareClientTls(ssl::stream<boost::asio::ip::tcp::socket>& stream,
                        const std::string& host) {
  SSL* s = stream.native_handle();
  std::string name = host;
  if (name.size() > 2 && name.front() == '[' && name.back() == ']') {
    name = name.substr(1, name.size() - 2);
  }
  boost::system::error_code ec;
  boost::asio::ip::make_address(name, ec);
  X509_VERIFY_PARAM* param = SSL_get0_param(s);
  if (!ec) {  // an IP literal: checked against the certificate's IP SANs; no SNI (RFC 6066)
    if (X509_VERIFY_PARAM_set1_ip_asc(param, name.c_str()) != 1) {
      return InvalidArgumentError("TLS: bad IP address '" + name + "'");
    }
    return OkStatus();
  }
  X509_VERIFY_PARAM_set_hostflags(param, X509_CHECK_FLAG_NO_PARTIAL_WILDCARDS);
  if (X509_VERIFY_PARAM_set1_host(param, name.c_str(), name.size()) != 1 ||
      SSL_set_tlsext_host_name(s, name.c_str()) != 1) {
    return InvalidArgumentError("TLS: bad host name '" + name + "'");
  }
  return OkStatus();
}

std::string TlsErrorText(const boost::system::error_code& ec,
                         ssl::stream<boost::asio::ip::tcp::socket>& stream) {
  const long verify = SSL_get_verify_result(stream.native_handle());
  std::string text = ec.message();
  if (verify != X509_V_OK) {
    text = std::string("certificate verify failed: ") + X509_verify_cert_error_string(verify);
  }
  return text;
}

}  // namespace kvbridge::proxy
