// SPDX-License-Identifier: Apache-2.0
// The messages of a batched step's rounds (batch_step.h): fixed-width
// fields in host byte order, one after another, per bucket of the batch.
// A peer's message is untrusted: every read is checked against what is left,
// and a short or long message is the peer's error, never an overread.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <type_traits>
#include <vector>

namespace microd::sparsify {

class RoundWriter {
 public:
  template <typename T>
  void Put(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>, "plain fields only");
    bytes_.append(reinterpret_cast<const char*>(&v), sizeof v);
  }
  template <typename T>
  void PutArray(const T* p, size_t n) {
    static_assert(std::is_trivially_copyable_v<T>, "plain fields only");
    if (n > 0) bytes_.append(reinterpret_cast<const char*>(p), n * sizeof(T));
  }
  size_t size() const { return bytes_.size(); }
  void Reserve(size_t bytes) { bytes_.reserve(bytes); }
  std::string Take() { return std::move(bytes_); }

 private:
  std::string bytes_;
};

// n elements of a message, read in place (unaligned: through memcpy).
template <typename T>
struct ArrayView {
  const char* at = nullptr;
  uint64_t n = 0;
  T Get(uint64_t j) const {
    T v;
    std::memcpy(&v, at + j * sizeof(T), sizeof(T));
    return v;
  }
  void CopyTo(T* out) const {
    if (n > 0) std::memcpy(out, at, n * sizeof(T));
  }
};

class RoundReader {
 public:
  explicit RoundReader(std::string_view bytes) : bytes_(bytes) {}
  // False (and nothing read) when fewer bytes are left than asked for.
  template <typename T>
  bool Get(T* v) {
    static_assert(std::is_trivially_copyable_v<T>, "plain fields only");
    if (left() < sizeof(T)) return false;
    std::memcpy(v, bytes_.data() + at_, sizeof(T));
    at_ += sizeof(T);
    return true;
  }
  template <typename T>
  bool GetArray(uint64_t n, std::vector<T>* out) {
    static_assert(std::is_trivially_copyable_v<T>, "plain fields only");
    if (n > left() / sizeof(T)) return false;
    out->resize(n);
    if (n > 0) std::memcpy(out->data(), bytes_.data() + at_, n * sizeof(T));
    at_ += n * sizeof(T);
    return true;
  }
  // The same, without a copy: `out` views the n elements in the message.
  template <typename T>
  bool GetView(uint64_t n, ArrayView<T>* out) {
    static_assert(std::is_trivially_copyable_v<T>, "plain fields only");
    if (n > left() / sizeof(T)) return false;
    out->at = bytes_.data() + at_;
    out->n = n;
    at_ += n * sizeof(T);
    return true;
  }
  size_t left() const { return bytes_.size() - at_; }

 private:
  std::string_view bytes_;
  size_t at_ = 0;
};

}  // namespace microd::sparsify
