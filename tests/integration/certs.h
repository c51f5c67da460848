// SPDX-License-Identifier: Apache-2.0
// Test certificates made with openssl: CAs, and node certificates signed by
// one with the addresses they are reached on (subjectAltName IP entries),
// usable both as TLS server and client identities.
#pragma once

#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "gtest/gtest.h"
#include "tests/integration/process_util.h"

namespace microd::testing {

class TestCerts {
 public:
  explicit TestCerts(std::string dir) : dir_(std::move(dir)) {}

  // A self-signed CA `name` (dir/name.pem, dir/name.key).
  void Ca(const std::string& name) {
    Run(
        absl::StrCat("openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes "
                     "-keyout ",
                     name, ".key -out ", name, ".pem -days 2 -subj /CN=", name));
  }
  // A certificate `name` signed by CA `ca`, naming the IP addresses `ips`
  // and the jobs `jobs` (URI microd://job/<id>; the daemons' default job).
  void Cert(const std::string& name, const std::string& ca, const std::vector<std::string>& ips,
            const std::vector<std::string>& jobs = {"microd"}) {
    std::vector<std::string> san;
    for (const auto& ip : ips) san.push_back("IP:" + ip);
    for (const auto& job : jobs) san.push_back("URI:microd://job/" + job);
    Run(absl::StrCat("openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout ",
                     name, ".key -out ", name, ".csr -subj /CN=", name,
                     " && printf 'subjectAltName=", absl::StrJoin(san, ","),
                     "\\nbasicConstraints=CA:FALSE\\nextendedKeyUsage=serverAuth,clientAuth\\n' > ",
                     name, ".ext && openssl x509 -req -in ", name, ".csr -CA ", ca, ".pem -CAkey ",
                     ca, ".key -CAcreateserial -out ", name, ".pem -days 2 -extfile ", name,
                     ".ext"));
  }
  std::string pem(const std::string& name) const { return dir_ + "/" + name + ".pem"; }
  std::string key(const std::string& name) const { return dir_ + "/" + name + ".key"; }
  // The daemon flags for identity `name` trusting CA `ca`.
  std::vector<std::string> Flags(const std::string& name, const std::string& ca) const {
    return {"--tls_cert=" + pem(name), "--tls_key=" + key(name), "--tls_ca=" + pem(ca)};
  }
  // The same as MICROD_TLS_* environment entries.
  std::vector<std::string> Env(const std::string& name, const std::string& ca) const {
    return {"MICROD_TLS_CERT=" + pem(name), "MICROD_TLS_KEY=" + key(name),
            "MICROD_TLS_CA=" + pem(ca)};
  }
  // The serial number of the certificate served at 127.0.0.1:port, as
  // `openssl x509 -serial` prints it ("serial=..."), presenting `name`.
  std::string ServedSerial(int port, const std::string& name, const std::string& ca) const {
    const std::string out = absl::StrCat(dir_, "/served-", port);
    Run(absl::StrCat("openssl s_client -connect 127.0.0.1:", port, " -alpn h2 -CAfile ", pem(ca),
                     " -cert ", pem(name), " -key ", key(name),
                     " </dev/null 2>/dev/null | openssl x509 -noout -serial > ", out));
    const auto lines = ReadLines(out);
    return lines.empty() ? "" : lines[0];
  }

 private:
  void Run(const std::string& script) const {
    const pid_t pid =
        Spawn({"/bin/sh", "-c", "cd '" + dir_ + "' && " + script}, dir_ + "/openssl.log");
    ASSERT_EQ(WaitAll({pid}, std::chrono::seconds(30))[0], 0)
        << script << " failed (see " << dir_ << "/openssl.log)";
  }
  const std::string dir_;
};

}  // namespace microd::testing
