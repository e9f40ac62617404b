// The libstdc++ pieces a build with GCC >= 11 headers would take from a libstdc++.so newer
// than the one of glibc-2.28 systems (GLIBCXX_3.4.26 and 3.4.29: C++20's stringbuf::str()
// overloads, the string streams' default constructors, __throw_bad_array_new_length),
// compiled into the library instead, as the manylinux toolchains' libstdc++_nonshared.a does.
// The linker version script (CMakeLists.txt) keeps them local: references from this library
// bind here and no other library sees them. Also the glibc 2.32 `__libc_single_threaded` flag
// that libstdc++'s headers read: defined here as 0, "threads may exist", so shared_ptr and
// friends always take their atomic path (correct, and what they do under any threaded torch).
#include <new>
#include <sstream>

#if defined(__GLIBCXX__) && defined(__linux__)
template class std::basic_stringbuf<char>;
template class std::basic_stringstream<char>;
template class std::basic_ostringstream<char>;

namespace std {
[[noreturn]] void __throw_bad_array_new_length() { throw std::bad_array_new_length(); }
}  // namespace std

extern "C" {
char __libc_single_threaded = 0;
}
#endif
