// SPDX-License-Identifier: Apache-2.0
// The coordinator's door: who may join the job. A join proves the job's
// token (job_token.h) and, where its TLS certificate names jobs, is one of
// them; a host that keeps guessing the token wrong is refused for a while
// (1 s, doubling to 64 s, after kFreeTries), and wrong guesses are logged
// at most once a second. Its own lock: no join waits on the job's.
#pragma once

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"
#include "daemon/control/job_token.h"

namespace microd::control {

class Admission {
 public:
  // `token`: null for a job without one (every proof is taken).
  // `certificate_names_job`: a certificate that names no job is refused.
  Admission(std::string job_id, std::shared_ptr<const JobToken> token, bool certificate_names_job)
      : job_id_(std::move(job_id)),
        token_(std::move(token)),
        certificate_names_job_(certificate_names_job) {}

  // The join of `node_name` from `peer_host` (for messages and the pause):
  // its token proof for `job_id` (Unauthenticated when wrong, Unavailable
  // while its host is paused), then the jobs its certificate's URIs name
  // (PermissionDenied when they are not this one's).
  absl::Status Admit(const std::string& token_proof, const std::string& job_id,
                     const std::string& node_name, const std::string& peer_host,
                     const std::vector<std::string>& certificate_uris);

  static constexpr int kFreeTries = 5;
  static constexpr size_t kMaxHosts = 4096;

 private:
  absl::Status CheckToken(const std::string& token_proof, const std::string& job_id,
                          const std::string& node_name, const std::string& peer_host);
  absl::Status CheckCertificate(const std::vector<std::string>& uris, const std::string& node_name,
                                const std::string& peer_host) const;
  void LogWrongToken(const std::string& node_name, const std::string& peer_host);

  struct Failures {
    int wrong = 0;  // wrong tokens in a row
    absl::Time refused_until = absl::InfinitePast();
  };
  const std::string job_id_;
  const std::shared_ptr<const JobToken> token_;
  const bool certificate_names_job_;
  absl::Mutex mu_;
  std::map<std::string, Failures> failures_ ABSL_GUARDED_BY(mu_);  // by host
  absl::Time last_log_ ABSL_GUARDED_BY(mu_) = absl::InfinitePast();
  int unlogged_ ABSL_GUARDED_BY(mu_) = 0;
};

}  // namespace microd::control
