// SPDX-License-Identifier: Apache-2.0
// The wire format of microd's Gloo device (device.h): the handshake that
// authenticates a connection before anything else is read from it, and the
// records every later byte travels in. Pure functions and small types, no
// I/O: the fuzz target and the unit tests drive them directly.
//
// A connection joins a listening pair (the lower rank) and a dialing one:
//   dialer -> listener  Hello (64 bytes): magic, the listener pair's id,
//                       both ranks, the lane, sealed or not, a fresh nonce
//   listener -> dialer  Reply (64 bytes): a fresh nonce, MAC "listener"
//   dialer -> listener  Finish (32 bytes): MAC "dialer"
// Both MACs are HMAC-SHA256 over the transcript (Hello and the listener's
// nonce) under the link's authentication key: HKDF of the link's secret
// (the epoch's, from the data-plane keys; none unsealed) and the listening
// pair's ticket (16 random bytes its address carries through the
// rendezvous), bound to the pair id, the ranks, the lane and the mode.
// Whoever lacks them cannot finish a handshake; the secret never travels.
// Sealed, each direction's key is HKDF of the authentication key over the
// transcript: fresh per connection, so no nonce repeats under a key however
// often an epoch connects.
//
// After it, every record is
//   length (4 bytes, little-endian) | header (32 bytes) | payload | tag
// Sealed, header and payload are AES-256-GCM encrypted under the
// direction's key and record number (the nonce), the length authenticated
// with them (the tag, 16 bytes); open, there is no tag. The length is
// checked against the most a record may hold before a byte of the record
// is read, and the header's every field before its payload goes anywhere.
#pragma once

#include <openssl/evp.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace microd::transport::record {

constexpr size_t kLengthBytes = 4;
constexpr size_t kHeaderBytes = 32;
constexpr size_t kTagBytes = 16;
// The most payload one record carries (a message longer goes in several):
// large enough that a record's own cost (its syscalls, its cipher's set-up)
// disappears beside its bytes; what a sealed connection stages per
// direction.
constexpr size_t kMaxPayload = size_t{256} << 10;
// The most a record's length may say (header, payload, tag).
constexpr size_t kMaxRecordBytes = kHeaderBytes + kMaxPayload + kTagBytes;
// The most bytes one message may carry (48 bits).
constexpr uint64_t kMaxMessageBytes = uint64_t{1} << 48;

enum class RecordType : uint8_t {
  // The receiver posted a receive of up to `total` bytes for `slot`.
  kRecvReady = 1,
  // Bytes [offset, offset + payload) of a message of `total` bytes to `slot`.
  kData = 2,
};

struct Header {
  RecordType type = RecordType::kData;
  uint32_t payload = 0;  // payload bytes in this record
  uint64_t slot = 0;
  uint64_t total = 0;
  uint64_t offset = 0;
};

void EncodeHeader(const Header& h, unsigned char out[kHeaderBytes]);
// Every field checked: the type, zero reserved bytes, the payload at most
// kMaxPayload and (data) within `total`, which is at most
// kMaxMessageBytes; a notice carries no payload and no offset.
absl::StatusOr<Header> DecodeHeader(const unsigned char in[kHeaderBytes]);

void EncodeLength(uint32_t length, unsigned char out[kLengthBytes]);
uint32_t DecodeLength(const unsigned char in[kLengthBytes]);
// The length a record of `payload` bytes has on the wire (after its length).
size_t RecordLength(size_t payload, bool sealed);
// Whether a record's length can be one (before any byte of it is read).
absl::Status CheckRecordLength(uint32_t length, bool sealed);

// One direction of a sealed connection: AES-256-GCM under the direction's
// key, record i under nonce i (a counter the other side keeps alike, so a
// record replayed, dropped or reordered does not open). Not thread-safe.
class RecordCipher {
 public:
  static absl::StatusOr<std::unique_ptr<RecordCipher>> Create(absl::string_view key);
  ~RecordCipher();

  // Seals the next record: header and payload into `out` (kHeaderBytes +
  // payload + kTagBytes bytes), the record's length prefix authenticated.
  absl::Status Seal(const unsigned char length[kLengthBytes], const unsigned char* header,
                    const void* payload, size_t payload_bytes, unsigned char* out);
  // Opens the next record (`size` bytes after its length, tag last) into
  // `plain` (size - kTagBytes bytes). False when it does not verify; then
  // `plain` holds nothing to use, and the connection can only end.
  bool Open(const unsigned char length[kLengthBytes], const unsigned char* sealed, size_t size,
            unsigned char* plain);
  uint64_t records() const { return sequence_; }

 private:
  explicit RecordCipher(EVP_CIPHER_CTX* ctx) : ctx_(ctx) {}
  void Nonce(unsigned char out[12]) const;

  EVP_CIPHER_CTX* const ctx_;
  uint64_t sequence_ = 0;
};

// The handshake's messages.
constexpr size_t kHelloBytes = 64;
constexpr size_t kReplyBytes = 64;
constexpr size_t kFinishBytes = 32;
constexpr size_t kNonceBytes = 32;
constexpr size_t kTicketBytes = 16;

struct Hello {
  uint64_t pair_id = 0;  // the listening pair's (from its address)
  uint32_t dialer_rank = 0;
  uint32_t listener_rank = 0;
  uint32_t lane = 0;
  bool sealed = false;
  std::array<unsigned char, kNonceBytes> nonce{};

  std::string Encode() const;
  // The magic and every field checked (no rank above 2^24, no unknown flag).
  static absl::StatusOr<Hello> Decode(absl::string_view bytes);
};

// A pair's address as the rendezvous carries it: where its device listens,
// the pair's id and ticket.
struct PairAddress {
  std::array<unsigned char, 16> ip{};  // IPv6, or IPv4-mapped
  uint16_t port = 0;
  uint64_t pair_id = 0;
  std::array<unsigned char, kTicketBytes> ticket{};

  static constexpr size_t kBytes = 1 + 1 + 2 + 16 + 8 + kTicketBytes;
  std::string Encode() const;
  static absl::StatusOr<PairAddress> Decode(absl::string_view bytes);
};

// The link's authentication key (see the top of this file).
absl::StatusOr<std::string> AuthKey(absl::string_view link_secret, const PairAddress& listener,
                                    const Hello& hello);
// What each side proves over `transcript` (the Hello, then the listener's
// nonce): "listener" and "dialer" MACs.
absl::StatusOr<std::string> HandshakeMac(absl::string_view auth_key, absl::string_view transcript,
                                         bool listener);
struct TrafficKeys {
  std::string dialer_to_listener;
  std::string listener_to_dialer;
};
absl::StatusOr<TrafficKeys> DeriveTrafficKeys(absl::string_view auth_key,
                                              absl::string_view transcript);

}  // namespace microd::transport::record
