#include "kvbridge/common/http_client.h"

#include <httplib.h>
#include <openssl/x509.h>

#include <cstdlib>

namespace kvbridge {

std::string HttpTarget::Url() const {
  return std::string(https ? "https://" : "http://") + host + ":" + std::to_string(port);
}

Result<HttpTarget> ParseHttpTarget(std::string_view text) {
  HttpTarget t;
  std::string rest(text);
  if (rest.rfind("http://", 0) == 0) {
    rest = rest.substr(7);
  } else if (rest.rfind("https://", 0) == 0) {
    rest = rest.substr(8);
    t.https = true;
  } else if (rest.find("://") != std::string::npos) {
    return InvalidArgumentError("'" + std::string(text) + "': the scheme must be http or https");
  }
  if (auto slash = rest.find('/'); slash != std::string::npos) rest = rest.substr(0, slash);
  auto colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == rest.size()) {
    return InvalidArgumentError(
        "'" + std::string(text) +
        "' must look like HOST:PORT, http://HOST:PORT or https://HOST:PORT");
  }
  char* end = nullptr;
  const long port = std::strtol(rest.c_str() + colon + 1, &end, 10);
  if (*end != '\0' || port < 1 || port > 65535) {
    return InvalidArgumentError("bad port in '" + std::string(text) + "'");
  }
  t.host = rest.substr(0, colon);
  t.port = static_cast<int>(port);
  return t;
}

std::unique_ptr<httplib::Client> MakeHttpClient(const HttpTarget& target,
                                                const HttpClientTls& tls) {
  if (!target.https) return std::make_unique<httplib::Client>(target.host, target.port);
  auto cli = std::make_unique<httplib::Client>(target.Url(), tls.cert_file, tls.key_file);
  cli->enable_server_certificate_verification(true);
  if (!tls.ca_file.empty()) cli->set_ca_cert_path(tls.ca_file.c_str());
  return cli;
}

std::string HttpErrorText(const httplib::Client& client, httplib::Error error,
                          const HttpClientTls& tls) {
  if (error != httplib::Error::SSLServerVerification) return httplib::to_string(error);
  const long verify = client.get_openssl_verify_result();
  std::string why = verify != X509_V_OK ? X509_verify_cert_error_string(verify)
                                        : "its subjectAltName does not name the host";
  return "TLS: the server's certificate did not verify (" + why + ") against " +
         (tls.ca_file.empty() ? std::string("the system's CA store") : "'" + tls.ca_file + "'");
}

}  // namespace kvbridge
