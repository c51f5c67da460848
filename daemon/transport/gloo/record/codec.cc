// SPDX-License-Identifier: Apache-2.0
#include "daemon/transport/gloo/record/codec.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "daemon/common/crypto.h"

namespace microd::transport::record {
namespace {

constexpr char kHelloMagic[8] = {'M', 'I', 'C', 'R', 'O', 'D', 'L', '1'};
constexpr uint8_t kAddressVersion = 1;
constexpr uint32_t kMaxRank = 1u << 24;
constexpr uint32_t kSealedFlag = 1;

void PutLe(uint64_t v, size_t bytes, unsigned char* out) {
  for (size_t i = 0; i < bytes; ++i) out[i] = static_cast<unsigned char>(v >> (8 * i));
}
uint64_t GetLe(const unsigned char* in, size_t bytes) {
  uint64_t v = 0;
  for (size_t i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(in[i]) << (8 * i);
  return v;
}

}  // namespace

void EncodeHeader(const Header& h, unsigned char out[kHeaderBytes]) {
  std::memset(out, 0, kHeaderBytes);
  out[0] = static_cast<unsigned char>(h.type);
  PutLe(h.payload, 4, out + 4);
  PutLe(h.slot, 8, out + 8);
  PutLe(h.total, 8, out + 16);
  PutLe(h.offset, 8, out + 24);
}

absl::StatusOr<Header> DecodeHeader(const unsigned char in[kHeaderBytes]) {
  Header h;
  const unsigned char type = in[0];
  if (type != static_cast<unsigned char>(RecordType::kRecvReady) &&
      type != static_cast<unsigned char>(RecordType::kData)) {
    return absl::DataLossError(absl::StrCat("a record of unknown type ", type));
  }
  if (in[1] != 0 || in[2] != 0 || in[3] != 0) {
    return absl::DataLossError("a record whose reserved bytes are not zero");
  }
  h.type = static_cast<RecordType>(type);
  h.payload = static_cast<uint32_t>(GetLe(in + 4, 4));
  h.slot = GetLe(in + 8, 8);
  h.total = GetLe(in + 16, 8);
  h.offset = GetLe(in + 24, 8);
  if (h.total > kMaxMessageBytes) {
    return absl::DataLossError(absl::StrCat("a record for a message of ", h.total,
                                            " bytes (at most ", kMaxMessageBytes, ")"));
  }
  if (h.type == RecordType::kRecvReady) {
    if (h.payload != 0 || h.offset != 0) {
      return absl::DataLossError("a receive's notice with a payload or an offset");
    }
    return h;
  }
  if (h.payload > kMaxPayload || h.offset > h.total || h.payload > h.total - h.offset) {
    return absl::DataLossError(absl::StrCat("a data record of ", h.payload, " bytes at offset ",
                                            h.offset, " of a message of ", h.total, " bytes"));
  }
  return h;
}

void EncodeLength(uint32_t length, unsigned char out[kLengthBytes]) { PutLe(length, 4, out); }
uint32_t DecodeLength(const unsigned char in[kLengthBytes]) {
  return static_cast<uint32_t>(GetLe(in, 4));
}

size_t RecordLength(size_t payload, bool sealed) {
  return kHeaderBytes + payload + (sealed ? kTagBytes : 0);
}

absl::Status CheckRecordLength(uint32_t length, bool sealed) {
  if (length < RecordLength(0, sealed) || length > RecordLength(kMaxPayload, sealed)) {
    return absl::DataLossError(
        absl::StrCat("a record of ", length, " bytes (", sealed ? "sealed " : "", "records have ",
                     RecordLength(0, sealed), " to ", RecordLength(kMaxPayload, sealed), ")"));
  }
  return absl::OkStatus();
}

absl::StatusOr<std::unique_ptr<RecordCipher>> RecordCipher::Create(absl::string_view key) {
  if (key.size() != 32) return absl::InvalidArgumentError("record cipher: the key is not 32 bytes");
  EVP_CIPHER_CTX* ctx = EVP_CIPHER_CTX_new();
  if (ctx == nullptr ||
      EVP_CipherInit_ex(ctx, EVP_aes_256_gcm(), nullptr,
                        reinterpret_cast<const unsigned char*>(key.data()), nullptr, -1) != 1) {
    EVP_CIPHER_CTX_free(ctx);
    return absl::InternalError("record cipher: OpenSSL has no AES-256-GCM");
  }
  return std::unique_ptr<RecordCipher>(new RecordCipher(ctx));
}

RecordCipher::~RecordCipher() { EVP_CIPHER_CTX_free(ctx_); }

void RecordCipher::Nonce(unsigned char out[12]) const {
  std::memset(out, 0, 4);
  PutLe(sequence_, 8, out + 4);
}

absl::Status RecordCipher::Seal(const unsigned char length[kLengthBytes],
                                const unsigned char* header, const void* payload,
                                size_t payload_bytes, unsigned char* out) {
  unsigned char nonce[12];
  Nonce(nonce);
  int len = 0;
  const bool ok =
      EVP_EncryptInit_ex(ctx_, nullptr, nullptr, nullptr, nonce) == 1 &&
      EVP_EncryptUpdate(ctx_, nullptr, &len, length, kLengthBytes) == 1 &&
      EVP_EncryptUpdate(ctx_, out, &len, header, kHeaderBytes) == 1 &&
      (payload_bytes == 0 ||
       EVP_EncryptUpdate(ctx_, out + kHeaderBytes, &len, static_cast<const unsigned char*>(payload),
                         static_cast<int>(payload_bytes)) == 1) &&
      EVP_EncryptFinal_ex(ctx_, out + kHeaderBytes + payload_bytes, &len) == 1 &&
      EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_GET_TAG, kTagBytes,
                          out + kHeaderBytes + payload_bytes) == 1;
  if (!ok) return absl::InternalError("record cipher: sealing a record failed");
  ++sequence_;
  return absl::OkStatus();
}

bool RecordCipher::Open(const unsigned char length[kLengthBytes], const unsigned char* sealed,
                        size_t size, unsigned char* plain) {
  if (size < kTagBytes || size - kTagBytes > kMaxRecordBytes) return false;
  const size_t body = size - kTagBytes;
  unsigned char nonce[12];
  Nonce(nonce);
  unsigned char tag[kTagBytes];
  std::memcpy(tag, sealed + body, kTagBytes);
  int len = 0;
  const bool ok = EVP_DecryptInit_ex(ctx_, nullptr, nullptr, nullptr, nonce) == 1 &&
                  EVP_DecryptUpdate(ctx_, nullptr, &len, length, kLengthBytes) == 1 &&
                  EVP_DecryptUpdate(ctx_, plain, &len, sealed, static_cast<int>(body)) == 1 &&
                  EVP_CIPHER_CTX_ctrl(ctx_, EVP_CTRL_GCM_SET_TAG, kTagBytes, tag) == 1 &&
                  EVP_DecryptFinal_ex(ctx_, plain + body, &len) == 1;
  if (ok) ++sequence_;
  return ok;
}

std::string Hello::Encode() const {
  std::string out(kHelloBytes, '\0');
  auto* p = reinterpret_cast<unsigned char*>(out.data());
  std::memcpy(p, kHelloMagic, 8);
  PutLe(pair_id, 8, p + 8);
  PutLe(dialer_rank, 4, p + 16);
  PutLe(listener_rank, 4, p + 20);
  PutLe(lane, 4, p + 24);
  PutLe(sealed ? kSealedFlag : 0, 4, p + 28);
  std::memcpy(p + 32, nonce.data(), kNonceBytes);
  return out;
}

absl::StatusOr<Hello> Hello::Decode(absl::string_view bytes) {
  if (bytes.size() != kHelloBytes) {
    return absl::InvalidArgumentError(absl::StrCat("a hello of ", bytes.size(), " bytes"));
  }
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  if (std::memcmp(p, kHelloMagic, 8) != 0) {
    return absl::InvalidArgumentError("not a microd data-plane hello");
  }
  Hello h;
  h.pair_id = GetLe(p + 8, 8);
  h.dialer_rank = static_cast<uint32_t>(GetLe(p + 16, 4));
  h.listener_rank = static_cast<uint32_t>(GetLe(p + 20, 4));
  h.lane = static_cast<uint32_t>(GetLe(p + 24, 4));
  const uint32_t flags = static_cast<uint32_t>(GetLe(p + 28, 4));
  if (h.dialer_rank >= kMaxRank || h.listener_rank >= kMaxRank || h.lane >= kMaxRank ||
      (flags & ~kSealedFlag) != 0) {
    return absl::InvalidArgumentError("a hello with a field out of range");
  }
  h.sealed = (flags & kSealedFlag) != 0;
  std::memcpy(h.nonce.data(), p + 32, kNonceBytes);
  return h;
}

std::string PairAddress::Encode() const {
  std::string out(kBytes, '\0');
  auto* p = reinterpret_cast<unsigned char*>(out.data());
  p[0] = kAddressVersion;
  PutLe(port, 2, p + 2);
  std::memcpy(p + 4, ip.data(), ip.size());
  PutLe(pair_id, 8, p + 20);
  std::memcpy(p + 28, ticket.data(), kTicketBytes);
  return out;
}

absl::StatusOr<PairAddress> PairAddress::Decode(absl::string_view bytes) {
  if (bytes.size() != kBytes) {
    return absl::InvalidArgumentError(
        absl::StrCat("a data-plane address of ", bytes.size(), " bytes, not ", kBytes));
  }
  const auto* p = reinterpret_cast<const unsigned char*>(bytes.data());
  if (p[0] != kAddressVersion || p[1] != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("a data-plane address of version ", static_cast<int>(p[0])));
  }
  PairAddress a;
  a.port = static_cast<uint16_t>(GetLe(p + 2, 2));
  std::memcpy(a.ip.data(), p + 4, a.ip.size());
  a.pair_id = GetLe(p + 20, 8);
  std::memcpy(a.ticket.data(), p + 28, kTicketBytes);
  if (a.port == 0) return absl::InvalidArgumentError("a data-plane address without a port");
  return a;
}

absl::StatusOr<std::string> AuthKey(absl::string_view link_secret, const PairAddress& listener,
                                    const Hello& hello) {
  const std::string key = absl::StrCat(
      link_secret,
      absl::string_view(reinterpret_cast<const char*>(listener.ticket.data()), kTicketBytes));
  return crypto::Hkdf(
      key, "",
      absl::StrCat("microd link v1\n", listener.pair_id, "\n", hello.listener_rank, "\n",
                   hello.dialer_rank, "\n", hello.lane, "\n", hello.sealed ? "sealed" : "open"));
}

absl::StatusOr<std::string> HandshakeMac(absl::string_view auth_key, absl::string_view transcript,
                                         bool listener) {
  return crypto::HmacSha256(auth_key,
                            absl::StrCat(listener ? "listener\n" : "dialer\n", transcript));
}

absl::StatusOr<TrafficKeys> DeriveTrafficKeys(absl::string_view auth_key,
                                              absl::string_view transcript) {
  auto d2l = crypto::Hkdf(auth_key, transcript, "dialer to listener");
  auto l2d = crypto::Hkdf(auth_key, transcript, "listener to dialer");
  if (!d2l.ok()) return d2l.status();
  if (!l2d.ok()) return l2d.status();
  return TrafficKeys{*std::move(d2l), *std::move(l2d)};
}

}  // namespace microd::transport::record
