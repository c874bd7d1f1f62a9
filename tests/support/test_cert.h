// tests/support/test_cert.h — TLS certificates made at test time (OpenSSL API, no CLI).
#pragma once

#include <string>

namespace kvbridge::testing {

struct TestCert {
  std::string cert;  ///< PEM certificate file
  std::string key;   ///< PEM private key file
};

/// A self-signed certificate for 127.0.0.1 (P-256, subjectAltName IP:127.0.0.1, valid one hour,
/// CA:TRUE so that it can also serve as the client CA of a mutual-TLS test): writes
/// <dir>/<name>.crt and <dir>/<name>.key. Aborts the test binary if OpenSSL fails.
TestCert MakeSelfSignedCert(const std::string& dir, const std::string& name);

}  // namespace kvbridge::testing
