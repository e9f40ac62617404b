// FASTATTN_CHECK: argument checks of the op bodies, CPU and CUDA, host code and launchers (a
// light header: no torch, no CUDA).
#pragma once
#include <sstream>
#include <stdexcept>
#include <string>

// Argument checks: every failure names the op, the argument and the rule it broke
// ("<op>: <rule>"). Raises RuntimeError in Python (a std::runtime_error crossing the stable
// boundary), with that message alone (STD_TORCH_CHECK would prefix the C++ function and file).
#define FASTATTN_CHECK(cond, op, ...)                                             \
  if (__builtin_expect(!(cond), 0)) {                                             \
    throw std::runtime_error(::fastattn::detail::message(op, ": ", __VA_ARGS__)); \
  }

namespace fastattn::detail {
template <class... Args>
std::string message(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace fastattn::detail
