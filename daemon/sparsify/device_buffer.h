// SPDX-License-Identifier: Apache-2.0
// An array of T in a SparseOps device's memory, freed on destruction.
#pragma once

#include <algorithm>
#include <cstddef>
#include <utility>

#include "kernels/sparse_ops.h"

namespace microd::sparsify {

template <typename T>
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(kernels::SparseOps* ops, size_t count) { Reset(ops, count); }
  ~DeviceBuffer() { Release(); }
  DeviceBuffer(DeviceBuffer&& o) noexcept { *this = std::move(o); }
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    if (this != &o) {
      Release();
      ops_ = std::exchange(o.ops_, nullptr);
      ptr_ = std::exchange(o.ptr_, nullptr);
      count_ = std::exchange(o.count_, 0);
    }
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;

  // Allocates `count` zeroed elements, dropping the old contents.
  void Reset(kernels::SparseOps* ops, size_t count) {
    Release();
    ops_ = ops;
    ptr_ = static_cast<T*>(ops->Allocate(count * sizeof(T)));
    count_ = ptr_ != nullptr ? count : 0;
  }
  // Grows to at least `count` elements (contents not kept). False when out of memory.
  bool Reserve(kernels::SparseOps* ops, size_t count) {
    if (ptr_ != nullptr && count_ >= count) return true;
    Reset(ops, count + count / 2);
    return ptr_ != nullptr;
  }

  // Reserve, giving back first room far beyond `count` (over 4x it and over
  // 4 Ki elements): for a step's K, which falls step by step through the
  // warm-up's decay.
  bool Fit(kernels::SparseOps* ops, size_t count) {
    constexpr size_t kKeep = size_t{1} << 12;
    if (ptr_ != nullptr && count_ > 4 * std::max(count, kKeep)) Release();
    return Reserve(ops, count);
  }

  bool ok() const { return ptr_ != nullptr; }
  T* get() const { return ptr_; }
  size_t size() const { return count_; }

 private:
  void Release() {
    if (ops_ != nullptr && ptr_ != nullptr) ops_->Free(ptr_);
    ptr_ = nullptr;
    count_ = 0;
  }
  kernels::SparseOps* ops_ = nullptr;
  T* ptr_ = nullptr;
  size_t count_ = 0;
};

}  // namespace microd::sparsify
