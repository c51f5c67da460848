// SPDX-License-Identifier: Apache-2.0
#include "daemon/control/admission.h"

#include <algorithm>
#include <cstring>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/time/clock.h"
#include "daemon/common/log.h"

namespace microd::control {

absl::Status Admission::Admit(const std::string& token_proof, const std::string& job_id,
                              const std::string& node_name, const std::string& peer_host,
                              const std::vector<std::string>& certificate_uris) {
  if (absl::Status s = CheckToken(token_proof, job_id, node_name, peer_host); !s.ok()) {
    if (absl::IsUnauthenticated(s)) LogWrongToken(node_name, peer_host);
    return s;
  }
  // The certificate's job, where it names one: the job id the caller sent
  // is only its word.
  if (absl::Status s = CheckCertificate(certificate_uris, node_name, peer_host); !s.ok()) {
    MICROD_LOG(Warning, "coordinator: refused %s", std::string(s.message()).c_str());
    return s;
  }
  return absl::OkStatus();
}

void Admission::LogWrongToken(const std::string& node_name, const std::string& peer_host) {
  absl::MutexLock lock(&mu_);
  const absl::Time now = absl::Now();
  if (now - last_log_ < absl::Seconds(1)) {
    ++unlogged_;
    return;
  }
  std::string more;
  if (unlogged_ > 0) {
    more = absl::StrCat(" (and ", unlogged_, " more refusals not shown)");
  }
  MICROD_LOG(Warning, "coordinator: refused node '%s' from %s: wrong job token%s",
             node_name.c_str(), peer_host.empty() ? "(unknown)" : peer_host.c_str(), more.c_str());
  last_log_ = now;
  unlogged_ = 0;
}

absl::Status Admission::CheckToken(const std::string& token_proof, const std::string& job_id,
                                   const std::string& node_name, const std::string& peer_host) {
  if (token_ == nullptr) return absl::OkStatus();
  const absl::Time now = absl::Now();
  {
    absl::MutexLock lock(&mu_);
    auto it = failures_.find(peer_host);
    if (it != failures_.end() && now < it->second.refused_until) {
      return absl::UnavailableError(absl::StrCat(
          "too many wrong job tokens from ", peer_host.empty() ? "this caller" : peer_host,
          ": its joins are refused for another ",
          absl::ToInt64Milliseconds(it->second.refused_until - now), " ms"));
    }
  }
  const bool right = token_->Proves(token_proof, job_id, node_name);
  absl::MutexLock lock(&mu_);
  if (right) {
    failures_.erase(peer_host);
    return absl::OkStatus();
  }
  if (failures_.size() >= kMaxHosts) {
    // Forget the hosts no longer refused; if every one still is, the oldest pause.
    for (auto it = failures_.begin(); it != failures_.end();) {
      it = it->second.refused_until <= now ? failures_.erase(it) : std::next(it);
    }
    if (failures_.size() >= kMaxHosts) failures_.clear();
  }
  Failures& f = failures_[peer_host];
  if (++f.wrong >= kFreeTries) {
    const int doublings = std::min(f.wrong - kFreeTries, 6);  // 1 s .. 64 s
    f.refused_until = now + absl::Seconds(1 << doublings);
  }
  return absl::UnauthenticatedError("wrong job token");
}

absl::Status Admission::CheckCertificate(const std::vector<std::string>& uris,
                                         const std::string& node_name,
                                         const std::string& peer_host) const {
  std::vector<std::string> jobs;
  for (const std::string& uri : uris) {
    if (absl::StartsWith(uri, kJobUriPrefix)) jobs.push_back(uri.substr(strlen(kJobUriPrefix)));
  }
  const std::string who =
      absl::StrCat("node '", node_name, "' (", peer_host.empty() ? "?" : peer_host, ")");
  if (jobs.empty()) {
    if (!certificate_names_job_) return absl::OkStatus();
    return absl::PermissionDeniedError(absl::StrCat(
        who, ": its certificate names no job, and job '", job_id_,
        "' has no job token: it admits only certificates that name it (a URI subjectAltName ",
        JobUri(job_id_), ")"));
  }
  if (std::find(jobs.begin(), jobs.end(), job_id_) != jobs.end()) return absl::OkStatus();
  return absl::PermissionDeniedError(absl::StrCat(who, ": its certificate is for job(s) '",
                                                  absl::StrJoin(jobs, "', '"), "', not job '",
                                                  job_id_, "'"));
}

}  // namespace microd::control
