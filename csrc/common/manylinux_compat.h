// Force-included into every translation unit (CMakeLists.txt): binds the C library functions
// whose default symbol version is newer than glibc 2.28 to their glibc 2.2.5 versions, so the
// libraries built on a newer Linux load on glibc 2.28 and later (the wheel's manylinux_2_28
// tag, torch's own floor). The old versions compute the same results: glibc 2.29 gave
// exp/log/pow/exp2/log2 new entry points without the SVID error handling. manylinux_compat.cpp
// does the same for libstdc++.
#pragma once

#if defined(__x86_64__) && defined(__linux__) && !defined(__CUDA_ARCH__)
#include <features.h>
#if defined(__GLIBC__)
__asm__(".symver exp,exp@GLIBC_2.2.5");
__asm__(".symver log,log@GLIBC_2.2.5");
__asm__(".symver pow,pow@GLIBC_2.2.5");
__asm__(".symver exp2,exp2@GLIBC_2.2.5");
__asm__(".symver log2,log2@GLIBC_2.2.5");
// glibc 2.34 moved libpthread and libdl into libc under a new default version; the old ones
// remain (the std::call_once of the CUDA recurrent engine binds pthread_once, for one).
__asm__(".symver dlsym,dlsym@GLIBC_2.2.5");
__asm__(".symver dlopen,dlopen@GLIBC_2.2.5");
__asm__(".symver dlclose,dlclose@GLIBC_2.2.5");
__asm__(".symver dlerror,dlerror@GLIBC_2.2.5");
__asm__(".symver dladdr,dladdr@GLIBC_2.2.5");
__asm__(".symver pthread_once,pthread_once@GLIBC_2.2.5");
__asm__(".symver pthread_key_create,pthread_key_create@GLIBC_2.2.5");
__asm__(".symver pthread_key_delete,pthread_key_delete@GLIBC_2.2.5");
__asm__(".symver pthread_getspecific,pthread_getspecific@GLIBC_2.2.5");
__asm__(".symver pthread_setspecific,pthread_setspecific@GLIBC_2.2.5");
__asm__(".symver pthread_create,pthread_create@GLIBC_2.2.5");
__asm__(".symver pthread_join,pthread_join@GLIBC_2.2.5");
__asm__(".symver pthread_detach,pthread_detach@GLIBC_2.2.5");
__asm__(".symver pthread_mutex_trylock,pthread_mutex_trylock@GLIBC_2.2.5");
#endif
#endif
