#include "daemon/transport/seal.h"

#include <openssl/evp.h>

#include <algorithm>
#include <cstring>
#include <memory>

#include "absl/strings/str_cat.h"
#include "daemon/common/crypto.h"

namespace microd::transport {
namespace {

constexpr size_t kNonceBytes = 12;

void PutLe(uint64_t v, size_t bytes, unsigned char* out) {
  for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}

// The nonce: the collective's tag and the direction's transfer number
// (unique per direction key as long as the sequence never repeats).
void Nonce(uint32_t tag, uint64_t sequence, unsigned char out[kNonceBytes]) {
  PutLe(tag, 4, out);
  PutLe(sequence, 8, out + 4);
}

struct CipherCtx {
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  ~CipherCtx() { EVP_CIPHER_CTX_free(ctx); }
};

std::string LinkName(int sender, int receiver, int reader = SealKeys::kAll) {
  if (receiver != SealKeys::kAll) return absl::StrCat("node ", sender, " to node ", receiver);
  if (reader == SealKeys::kAll) return absl::StrCat("node ", sender, " to every node");
  return absl::StrCat("node ", sender, " to node ", reader, " (sealed for every node)");
}

// EVP updates take an int: longer transfers go through in pieces.
constexpr size_t kPieceBytes = size_t{1} << 30;
template <typename Update>
bool InPieces(Update update, unsigned char* out, const unsigned char* in, size_t size) {
  for (size_t at = 0; at < size; at += kPieceBytes) {
    int len = 0;
    if (update(out + at, &len, in + at, static_cast<int>(std::min(kPieceBytes, size - at))) != 1) {
      return false;
    }
  }
  return true;
}

}  // namespace

absl::StatusOr<std::unique_ptr<SealKeys>> SealKeys::Derive(absl::string_view salt,
                                                           absl::string_view secret,
                                                           absl::string_view job_id, uint64_t epoch,
                                                           int nodes) {
  if (salt.size() != kSaltBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("seal: the epoch's salt has ", salt.size(), " bytes, not ", kSaltBytes));
  }
  if (nodes < 1) return absl::InvalidArgumentError("seal: no nodes");
  std::unique_ptr<SealKeys> k(new SealKeys(std::string(job_id), epoch, nodes));
  auto master = crypto::Hkdf(absl::StrCat(salt, secret),
                             absl::StrCat("microd seal v1\n", job_id, "\n", epoch), "master");
  if (!master.ok()) return master.status();
  k->master_ = std::move(master).value();
  return k;
}

absl::Status SealKeys::CheckLink(int sender, int receiver) const {
  if (sender < 0 || sender >= nodes_ || receiver < kAll || receiver >= nodes_ ||
      sender == receiver) {
    return absl::InvalidArgumentError(absl::StrCat("seal: no link from node ", sender, " to node ",
                                                   receiver, " in a job of ", nodes_));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::string> SealKeys::DirectionKey(int sender, int receiver) const {
  absl::MutexLock lock(&mu_);
  auto it = keys_.find({sender, receiver});
  if (it != keys_.end()) return it->second;
  auto key = crypto::Hkdf(master_, "", absl::StrCat("direction\n", sender, "\n", receiver));
  if (!key.ok()) return key.status();
  keys_[{sender, receiver}] = *key;
  return key;
}

std::string SealKeys::Aad(int sender, int receiver, uint32_t tag, uint64_t sequence) const {
  return absl::StrCat("microd seal v1\n", job_id_, "\n", epoch_, "\n", sender, "\n", receiver, "\n",
                      tag, "\n", sequence);
}

absl::Status SealKeys::Seal(int sender, int receiver, uint32_t tag, uint64_t sequence,
                            const void* plain, size_t size, void* out) const {
  if (absl::Status s = CheckLink(sender, receiver); !s.ok()) return s;
  auto key = DirectionKey(sender, receiver);
  if (!key.ok()) return key.status();
  unsigned char nonce[kNonceBytes];
  Nonce(tag, sequence, nonce);
  const std::string aad = Aad(sender, receiver, tag, sequence);
  CipherCtx c;
  int len = 0;
  auto* dst = static_cast<unsigned char*>(out);
  const bool ok =
      c.ctx != nullptr &&
      EVP_EncryptInit_ex(c.ctx, EVP_aes_256_gcm(), nullptr,
                         reinterpret_cast<const unsigned char*>(key->data()), nonce) == 1 &&
      EVP_EncryptUpdate(c.ctx, nullptr, &len, reinterpret_cast<const unsigned char*>(aad.data()),
                        static_cast<int>(aad.size())) == 1 &&
      InPieces([&](unsigned char* o, int* l, const unsigned char* i,
                   int n) { return EVP_EncryptUpdate(c.ctx, o, l, i, n); },
               dst, static_cast<const unsigned char*>(plain), size) &&
      EVP_EncryptFinal_ex(c.ctx, dst + size, &len) == 1 &&
      EVP_CIPHER_CTX_ctrl(c.ctx, EVP_CTRL_GCM_GET_TAG, kOverhead, dst + size) == 1;
  if (!ok) {
    return absl::InternalError(
        absl::StrCat("seal: sealing a transfer from ", LinkName(sender, receiver), " failed"));
  }
  return absl::OkStatus();
}

absl::Status SealKeys::Open(int sender, int receiver, uint32_t tag, uint64_t sequence,
                            const void* sealed, size_t sealed_size, void* out, int reader) const {
  if (absl::Status s = CheckLink(sender, receiver); !s.ok()) return s;
  auto refused = [&](const std::string& why) {
    return absl::DataLossError(absl::StrCat(
        "the sealed transfer from ", LinkName(sender, receiver, reader), " (tag ", tag,
        ", transfer ", sequence, ", epoch ", epoch_, ") ", why, ": nothing of it was used"));
  };
  if (sealed_size < kOverhead) return refused("is shorter than its tag");
  auto key = DirectionKey(sender, receiver);
  if (!key.ok()) return key.status();
  const size_t size = sealed_size - kOverhead;
  const auto* src = static_cast<const unsigned char*>(sealed);
  unsigned char nonce[kNonceBytes];
  Nonce(tag, sequence, nonce);
  const std::string aad = Aad(sender, receiver, tag, sequence);
  // Decrypted aside (this thread's buffer, kept: no zeroing or faulting in
  // pages each time), and written out only once the tag verified.
  thread_local std::unique_ptr<unsigned char[]> aside;
  thread_local size_t aside_size = 0;
  if (aside_size < size) {
    aside.reset(new unsigned char[size]);
    aside_size = size;
  }
  unsigned char* plain = aside.get();
  unsigned char expected[kOverhead];
  std::memcpy(expected, src + size, kOverhead);
  CipherCtx c;
  int len = 0;
  const bool ok =
      c.ctx != nullptr &&
      EVP_DecryptInit_ex(c.ctx, EVP_aes_256_gcm(), nullptr,
                         reinterpret_cast<const unsigned char*>(key->data()), nonce) == 1 &&
      EVP_DecryptUpdate(c.ctx, nullptr, &len, reinterpret_cast<const unsigned char*>(aad.data()),
                        static_cast<int>(aad.size())) == 1 &&
      InPieces([&](unsigned char* o, int* l, const unsigned char* i,
                   int n) { return EVP_DecryptUpdate(c.ctx, o, l, i, n); },
               plain, src, size) &&
      EVP_CIPHER_CTX_ctrl(c.ctx, EVP_CTRL_GCM_SET_TAG, kOverhead, expected) == 1 &&
      EVP_DecryptFinal_ex(c.ctx, plain + size, &len) == 1;
  if (!ok)
    return refused(
        "failed verification (altered, replayed, reordered, or not sealed by "
        "that node for this epoch)");
  if (size > 0) std::memcpy(out, plain, size);
  return absl::OkStatus();
}

}  // namespace microd::transport
