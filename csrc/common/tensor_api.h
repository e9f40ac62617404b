// fastattn's one tensor vocabulary for host code, on libtorch's stable ABI (torch/csrc/stable,
// targeted at torch 2.11 through TORCH_TARGET_VERSION, see CMakeLists.txt): op bodies use
// fastattn::Tensor, fastattn::empty, fastattn::parallel_for, FASTATTN_CHECK, ... and never at::
// or c10:: functions, so the shared object calls only the stable C shim of libtorch
// (aoti_torch_*, torch_*) and runs under every torch from the targeted one on
// (docs/design/stable_abi.md; tests/test_stable_abi.py checks the symbols).
//
// Tensor is torch::stable::Tensor with the few at::Tensor-style methods the op bodies use
// (contiguous, to, narrow, view, zero_, ...), each one call of the stable API; ATen ops the
// stable API has no helper for (mm, bmm, cat, sort, aminmax, expand, as_strided) go through
// the dispatcher's stable entry point (torch_call_dispatcher), which has no Scalar arguments:
// additions use subtract(a, b, -1).
#pragma once

#include <torch/csrc/stable/library.h>
#include <torch/csrc/stable/ops.h>
#include <torch/csrc/stable/tensor.h>
#include <torch/headeronly/core/ScalarType.h>
#include <torch/headeronly/util/BFloat16.h>
#include <torch/headeronly/util/Exception.h>
#include <torch/headeronly/util/Half.h>

#include "common/check.h"
#include "common/parallel.h"

#include <array>
#include <cstdint>
#include <optional>
#include <ostream>
#include <sstream>
#include <stdexcept>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace fastattn {

using ScalarType = torch::headeronly::ScalarType;
constexpr ScalarType kFloat = ScalarType::Float;
constexpr ScalarType kDouble = ScalarType::Double;
constexpr ScalarType kHalf = ScalarType::Half;
constexpr ScalarType kBFloat16 = ScalarType::BFloat16;
constexpr ScalarType kLong = ScalarType::Long;
constexpr ScalarType kInt = ScalarType::Int;
constexpr ScalarType kBool = ScalarType::Bool;
constexpr ScalarType kByte = ScalarType::Byte;

inline bool is_floating_type(ScalarType t) {
  return t == kFloat || t == kDouble || t == kHalf || t == kBFloat16;
}

inline size_t element_size(ScalarType t) {
  switch (t) {
    case kDouble:
    case kLong:
      return 8;
    case kFloat:
    case kInt:
      return 4;
    case kHalf:
    case kBFloat16:
      return 2;
    case kBool:
    case kByte:
      return 1;
    default:
      STD_TORCH_CHECK(false, "fastattn: no element size for dtype ", t);
  }
  return 0;
}

// A shape (or strides) as the stable API returns it, printable in check messages.
struct IntArrayRef : torch::headeronly::IntHeaderOnlyArrayRef {
  using torch::headeronly::IntHeaderOnlyArrayRef::IntHeaderOnlyArrayRef;
  IntArrayRef(torch::headeronly::IntHeaderOnlyArrayRef r)  // NOLINT: implicit on purpose
      : torch::headeronly::IntHeaderOnlyArrayRef(r) {}
  // Elementwise (torch 2.11's HeaderOnlyArrayRef has no operator==).
  friend bool operator==(const IntArrayRef& a, const IntArrayRef& b) {
    if (a.size() != b.size()) return false;
    for (size_t i = 0; i < a.size(); ++i) {
      if (a[i] != b[i]) return false;
    }
    return true;
  }
  friend bool operator!=(const IntArrayRef& a, const IntArrayRef& b) { return !(a == b); }
  friend std::ostream& operator<<(std::ostream& os, const IntArrayRef& r) {
    os << "[";
    for (size_t i = 0; i < r.size(); ++i) os << (i ? ", " : "") << r[i];
    return os << "]";
  }
};

struct Device : torch::stable::Device {
  Device(torch::stable::Device d) : torch::stable::Device(d) {}  // NOLINT: implicit on purpose
  friend std::ostream& operator<<(std::ostream& os, const Device& d) {
    os << (d.is_cuda() ? "cuda" : d.is_cpu() ? "cpu" : "device");
    if (d.index() >= 0 && !d.is_cpu()) os << ":" << d.index();
    return os;
  }
  bool operator==(const Device& o) const {
    return static_cast<const torch::stable::Device&>(*this) ==
           static_cast<const torch::stable::Device&>(o);
  }
};

// What at::TensorOptions was for the op bodies: the dtype and device of a new tensor.
struct Options {
  ScalarType dtype_;
  torch::stable::Device device_;
  Options dtype(ScalarType t) const { return {t, device_}; }
  ScalarType dtype() const { return dtype_; }
  Device device() const { return device_; }
};

class Tensor : public torch::stable::Tensor {
 public:
  Tensor() = default;
  Tensor(torch::stable::Tensor t)  // NOLINT: implicit on purpose (results of stable ops)
      : torch::stable::Tensor(std::move(t)) {}

  IntArrayRef sizes() const { return torch::stable::Tensor::sizes(); }
  IntArrayRef strides() const { return torch::stable::Tensor::strides(); }
  Device device() const { return torch::stable::Tensor::device(); }
  Options options() const { return {scalar_type(), torch::stable::Tensor::device()}; }
  bool is_floating_point() const { return is_floating_type(scalar_type()); }
  using torch::stable::Tensor::data_ptr;
  template <class T>
  T* data_ptr() const {
    return static_cast<T*>(torch::stable::Tensor::data_ptr());
  }
  // Bytes from the first element to the end of the last (a fresh tensor's whole storage).
  size_t nbytes() const { return static_cast<size_t>(numel()) * element_size(); }

  // Both return the tensor itself when there is nothing to do, as at::Tensor's do, without a
  // dispatcher call.
  Tensor contiguous() const {
    return is_contiguous() ? *this : Tensor(torch::stable::contiguous(*this));
  }
  Tensor to(ScalarType t) const {
    return scalar_type() == t ? *this : Tensor(torch::stable::to(*this, t));
  }
  Tensor clone() const { return torch::stable::clone(*this); }
  Tensor narrow(int64_t dim, int64_t start, int64_t length) const {
    torch::stable::Tensor self = *this;
    return torch::stable::narrow(self, dim, start, length);
  }
  Tensor view(torch::headeronly::IntHeaderOnlyArrayRef size) const {
    return torch::stable::view(*this, size);
  }
  Tensor view(std::initializer_list<int64_t> size) const {
    return torch::stable::view(*this, torch::headeronly::IntHeaderOnlyArrayRef(size));
  }
  Tensor view(ScalarType t) const;  // reinterpreted as another dtype of the same size
  Tensor transpose(int64_t a, int64_t b) const { return torch::stable::transpose(*this, a, b); }
  Tensor t() const { return transpose(0, 1); }
  Tensor operator[](int64_t i) const { return select(0, i); }
  // The same elements (a stable handle is per reference, so it cannot be compared itself).
  bool is_same(const Tensor& o) const {
    return defined() == o.defined() &&
           (!defined() || (data_ptr() == o.data_ptr() && scalar_type() == o.scalar_type() &&
                           sizes() == o.sizes() && strides() == o.strides()));
  }
  Tensor unsqueeze(int64_t dim) const { return torch::stable::unsqueeze(*this, dim); }
  Tensor select(int64_t dim, int64_t index) const {
    return torch::stable::select(*this, dim, index);
  }
  Tensor expand(std::initializer_list<int64_t> size) const;
  Tensor as_strided(std::initializer_list<int64_t> size,
                    std::initializer_list<int64_t> stride) const;
  Tensor index_select(int64_t dim, const Tensor& index) const;
  Tensor sum(int64_t dim, bool keepdim = false) const {
    const int64_t dims[1] = {dim};
    return torch::stable::sum(*this, torch::headeronly::IntHeaderOnlyArrayRef(dims, 1), keepdim);
  }
  Tensor reshape(torch::headeronly::IntHeaderOnlyArrayRef shape) const {
    return torch::stable::reshape(*this, shape);
  }
  // this + other (broadcast), a new tensor.
  Tensor add(const Tensor& other) const { return torch::stable::subtract(*this, other, -1.0); }
  const Tensor& zero_() const {
    torch::stable::Tensor self = *this;
    torch::stable::zero_(self);
    return *this;
  }
  const Tensor& fill_(double value) const {
    torch::stable::fill_(*this, value);
    return *this;
  }
  const Tensor& copy_(const Tensor& src) const {
    torch::stable::Tensor self = *this;
    torch::stable::copy_(self, src);
    return *this;
  }
  const Tensor& add_(const Tensor& other) const { return copy_(add(other)); }
  // this += a @ b (2-D): a product and an addition (aten::addmm_ takes Scalar arguments, which
  // the stable dispatcher call cannot pass).
  const Tensor& addmm_(const Tensor& a, const Tensor& b) const;
  // A CPU copy's element (the tensor is copied to the CPU when it is not there).
  template <class T>
  T item() const;
};

namespace detail {

// Calls aten::<name>.<overload> through the dispatcher's stable entry point; returns the stack,
// whose first NOut entries are the outputs (owning handles: take each with take_tensor).
template <size_t NOut, class... Args>
std::array<StableIValue, (NOut > sizeof...(Args) ? NOut : sizeof...(Args))> call_aten(
    const char* name, const char* overload, const Args&... args) {
  std::array<StableIValue, (NOut > sizeof...(Args) ? NOut : sizeof...(Args))> stack{
      torch::stable::detail::from(args)...};
  TORCH_ERROR_CODE_CHECK(torch_call_dispatcher(name, overload, stack.data(), TORCH_ABI_VERSION));
  return stack;
}

inline Tensor take_tensor(StableIValue v) {
  return Tensor(torch::stable::detail::to<torch::stable::Tensor>(v));
}

inline torch::stable::Tensor base(const Tensor& t) { return t; }

}  // namespace detail

// A new contiguous tensor: the shim's empty_strided (one C call, where torch::stable::empty
// goes through the boxed dispatcher: a few microseconds per op body's output).
inline Tensor empty(torch::headeronly::IntHeaderOnlyArrayRef sizes, const Options& o) {
  constexpr size_t kMaxDims = 8;
  if (sizes.size() > kMaxDims)
    return torch::stable::empty(sizes, o.dtype_, std::nullopt, o.device_);
  int64_t strides[kMaxDims];
  int64_t stride = 1;
  for (size_t d = sizes.size(); d-- > 0;) {  // at::empty's strides: sizes of 0 count as 1
    strides[d] = stride;
    stride *= sizes[d] > 1 ? sizes[d] : 1;
  }
  const auto dtype = torch::stable::detail::to<int32_t>(torch::stable::detail::from(o.dtype_));
  const auto device_type =
      torch::stable::detail::to<int32_t>(torch::stable::detail::from(o.device_.type()));
  AtenTensorHandle handle = nullptr;
  TORCH_ERROR_CODE_CHECK(aoti_torch_empty_strided(static_cast<int64_t>(sizes.size()), sizes.data(),
                                                  strides, dtype, device_type, o.device_.index(),
                                                  &handle));
  return Tensor(torch::stable::Tensor(handle));
}
inline Tensor empty(std::initializer_list<int64_t> sizes, const Options& o) {
  return empty(torch::headeronly::IntHeaderOnlyArrayRef(sizes), o);
}
inline Tensor empty_like(const Tensor& t) { return torch::stable::empty_like(t); }
inline Tensor zeros(torch::headeronly::IntHeaderOnlyArrayRef sizes, const Options& o) {
  Tensor t = empty(sizes, o);
  t.zero_();
  return t;
}
inline Tensor zeros(std::initializer_list<int64_t> sizes, const Options& o) {
  return zeros(torch::headeronly::IntHeaderOnlyArrayRef(sizes), o);
}
inline Tensor zeros_like(const Tensor& t) {
  Tensor z = empty_like(t);
  z.zero_();
  return z;
}

// a @ b (2-D), through ATen (MKL/cuBLAS) by the dispatcher.
inline Tensor mm(const Tensor& a, const Tensor& b) {
  return detail::take_tensor(
      detail::call_aten<1>("aten::mm", "", detail::base(a), detail::base(b))[0]);
}
inline void mm_out(const Tensor& out, const Tensor& a, const Tensor& b) {
  detail::take_tensor(detail::call_aten<1>("aten::mm", "out", detail::base(a), detail::base(b),
                                           detail::base(out))[0]);
}
inline void bmm_out(const Tensor& out, const Tensor& a, const Tensor& b) {
  detail::take_tensor(detail::call_aten<1>("aten::bmm", "out", detail::base(a), detail::base(b),
                                           detail::base(out))[0]);
}
// out = bias + a @ b (bias broadcast over rows).
inline void addmm_out(const Tensor& out, const Tensor& bias, const Tensor& a, const Tensor& b) {
  mm_out(out, a, b);
  out.add_(bias);
}
inline Tensor cat(const std::vector<Tensor>& tensors, int64_t dim) {
  std::vector<torch::stable::Tensor> list(tensors.begin(), tensors.end());
  return detail::take_tensor(detail::call_aten<1>("aten::cat", "", list, dim)[0]);
}
// (values, indices) of t sorted along dim (stable: equal values keep their order).
inline std::tuple<Tensor, Tensor> sort(const Tensor& t, std::optional<bool> stable, int64_t dim,
                                       bool descending) {
  auto s = detail::call_aten<2>("aten::sort", "stable", detail::base(t), stable, dim, descending);
  return {detail::take_tensor(s[0]), detail::take_tensor(s[1])};
}
// (min, max) over all elements, as 0-d tensors.
inline std::tuple<Tensor, Tensor> aminmax(const Tensor& t) {
  auto s = detail::call_aten<2>("aten::aminmax", "", detail::base(t),
                                std::optional<int64_t>(std::nullopt), false);
  return {detail::take_tensor(s[0]), detail::take_tensor(s[1])};
}
inline Tensor from_blob(void* data, torch::headeronly::IntHeaderOnlyArrayRef sizes,
                        torch::headeronly::IntHeaderOnlyArrayRef strides, const Options& o) {
  return torch::stable::from_blob(data, sizes, strides, o.device_, o.dtype_);
}

inline const Tensor& Tensor::addmm_(const Tensor& a, const Tensor& b) const {
  return add_(mm(a, b));
}

inline Tensor Tensor::view(ScalarType t) const {
  return detail::take_tensor(
      detail::call_aten<1>("aten::view", "dtype", detail::base(*this), t)[0]);
}
inline Tensor Tensor::expand(std::initializer_list<int64_t> size) const {
  return detail::take_tensor(detail::call_aten<1>("aten::expand", "", detail::base(*this),
                                                  torch::headeronly::IntHeaderOnlyArrayRef(size),
                                                  false)[0]);
}
inline Tensor Tensor::as_strided(std::initializer_list<int64_t> size,
                                 std::initializer_list<int64_t> stride) const {
  return detail::take_tensor(detail::call_aten<1>(
      "aten::as_strided", "", detail::base(*this), torch::headeronly::IntHeaderOnlyArrayRef(size),
      torch::headeronly::IntHeaderOnlyArrayRef(stride), std::optional<int64_t>(std::nullopt))[0]);
}
inline Tensor Tensor::index_select(int64_t dim, const Tensor& index) const {
  return detail::take_tensor(detail::call_aten<1>("aten::index_select", "", detail::base(*this),
                                                  dim, detail::base(index))[0]);
}
template <class T>
T Tensor::item() const {
  Tensor host = is_cpu() ? *this
                         : Tensor(torch::stable::to(
                               *this, torch::stable::Device(torch::headeronly::DeviceType::CPU)));
  return *host.data_ptr<T>();
}

}  // namespace fastattn

// fastattn::Tensor crosses the op boundary as torch::stable::Tensor does (TORCH_BOX unboxes
// the op bodies' Tensor, std::optional<Tensor> and tuple arguments and results with these).
HIDDEN_NAMESPACE_BEGIN(torch, stable, detail)
template <>
struct FromImpl<fastattn::Tensor> {
  static StableIValue call(const fastattn::Tensor& val, uint64_t extension_build_version,
                           bool is_internal) {
    return FromImpl<torch::stable::Tensor>::call(val, extension_build_version, is_internal);
  }
};
template <>
struct ToImpl<fastattn::Tensor> {
  static fastattn::Tensor call(StableIValue val, uint64_t extension_build_version,
                               bool is_internal) {
    return fastattn::Tensor(
        ToImpl<torch::stable::Tensor>::call(val, extension_build_version, is_internal));
  }
};
HIDDEN_NAMESPACE_END(torch, stable, detail)

// Calls `__VA_ARGS__` (a lambda body using scalar_t) for float, double, half and bfloat16.
#define FASTATTN_DISPATCH_FLOATING(TYPE, NAME, ...)                         \
  [&] {                                                                     \
    switch (TYPE) {                                                         \
      case ::fastattn::kFloat: {                                            \
        using scalar_t = float;                                             \
        return __VA_ARGS__();                                               \
      }                                                                     \
      case ::fastattn::kDouble: {                                           \
        using scalar_t = double;                                            \
        return __VA_ARGS__();                                               \
      }                                                                     \
      case ::fastattn::kHalf: {                                             \
        using scalar_t = c10::Half;                                         \
        return __VA_ARGS__();                                               \
      }                                                                     \
      case ::fastattn::kBFloat16: {                                         \
        using scalar_t = c10::BFloat16;                                     \
        return __VA_ARGS__();                                               \
      }                                                                     \
      default:                                                              \
        STD_TORCH_CHECK(false, NAME, ": not implemented for dtype ", TYPE); \
    }                                                                       \
  }()
