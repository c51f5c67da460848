// SPDX-License-Identifier: Apache-2.0
// A fuzz input read front to back; zeros (and empty spans) once it is used up.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace microd::fuzz {

class Input {
 public:
  Input(const uint8_t* data, size_t size) : data_(data), size_(size) {}

  size_t left() const { return size_ - at_; }
  uint8_t Byte() { return at_ < size_ ? data_[at_++] : 0; }
  // Two bytes, little-endian.
  uint16_t U16() {
    const uint16_t lo = Byte();
    return static_cast<uint16_t>(lo | Byte() << 8);
  }
  // Up to eight bytes, big-endian, modulo n (0 when n is 0).
  uint64_t Below(uint64_t n) {
    uint64_t v = 0;
    for (int i = 0; i < 8 && at_ < size_; ++i) v = v << 8 | data_[at_++];
    return n == 0 ? 0 : v % n;
  }
  // The next n bytes (fewer at the end), in place.
  const uint8_t* Span(size_t* n) {
    *n = std::min(*n, left());
    const uint8_t* p = data_ + at_;
    at_ += *n;
    return p;
  }
  std::vector<uint8_t> Bytes(size_t n) {
    const uint8_t* p = Span(&n);
    return std::vector<uint8_t>(p, p + n);
  }

 private:
  const uint8_t* const data_;
  const size_t size_;
  size_t at_ = 0;
};

}  // namespace microd::fuzz
