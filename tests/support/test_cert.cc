#include "support/test_cert.h"

#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509v3.h>

#include <cstdio>
#include <cstdlib>
#include <utility>

namespace kvbridge::testing {

TestCert MakeSelfSignedCert(const std::string& dir, const std::string& name) {
  TestCert out{dir + "/" + name + ".crt", dir + "/" + name + ".key"};
  EVP_PKEY* pkey = EVP_EC_gen("P-256");
  X509* x = X509_new();
  if (pkey == nullptr || x == nullptr) std::abort();
  X509_set_version(x, 2);
  ASN1_INTEGER_set(X509_get_serialNumber(x), 1);
  X509_gmtime_adj(X509_getm_notBefore(x), -60);
  X509_gmtime_adj(X509_getm_notAfter(x), 3600);
  X509_set_pubkey(x, pkey);
  X509_NAME* n = X509_get_subject_name(x);
  X509_NAME_add_entry_by_txt(n, "CN", MBSTRING_ASC,
                             reinterpret_cast<const unsigned char*>(name.c_str()), -1, -1, 0);
  X509_set_issuer_name(x, n);
  X509V3_CTX ctx;
  X509V3_set_ctx_nodb(&ctx);
  X509V3_set_ctx(&ctx, x, x, nullptr, nullptr, 0);
  for (auto [nid, value] : {std::pair{NID_subject_alt_name, "IP:127.0.0.1"},
                            std::pair{NID_basic_constraints, "critical,CA:TRUE"}}) {
    X509_EXTENSION* e = X509V3_EXT_conf_nid(nullptr, &ctx, nid, value);
    if (e == nullptr) std::abort();
    X509_add_ext(x, e, -1);
    X509_EXTENSION_free(e);
  }
  if (X509_sign(x, pkey, EVP_sha256()) == 0) std::abort();
  FILE* f = std::fopen(out.cert.c_str(), "w");
  if (f == nullptr || PEM_write_X509(f, x) != 1) std::abort();
  std::fclose(f);
  f = std::fopen(out.key.c_str(), "w");
  if (f == nullptr || PEM_write_PrivateKey(f, pkey, nullptr, nullptr, 0, nullptr, nullptr) != 1)
    std::abort();
  std::fclose(f);
  X509_free(x);
  EVP_PKEY_free(pkey);
  return out;
}

}  // namespace kvbridge::testing
