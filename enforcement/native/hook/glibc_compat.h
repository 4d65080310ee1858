/* Symbol versions the interposer binds to, so that one binary loads on glibc 2.17 and later
 * (Ubuntu 20.04 has 2.31, RHEL 8 2.28, RHEL 7 2.17; glibc 2.34 moved dlsym/dlopen and the
 * pthread functions into libc under new versions, which a plain link would require).
 * Every libc symbol the hook references is pinned here to the oldest version that has it;
 * tests/enforcement/adversarial/test_visibility.py checks that the built .so asks for nothing newer
 * than 2.17 (stat/fstat, libc functions only since 2.33, are system calls: qgpu_stat in
 * common/). dlsym, dlvsym, dlopen and dlmopen are not pinned: the hook exports its own, and
 * reaches libc's through its symbol table (libc_sym.c). setup.py includes this file first in every
 * source of the hook. */
#ifndef QGPU_GLIBC_COMPAT_H
#define QGPU_GLIBC_COMPAT_H

#if defined(__x86_64__)
#define QGPU_GLIBC_BASE "GLIBC_2.2.5"
#elif defined(__aarch64__)
#define QGPU_GLIBC_BASE "GLIBC_2.17"
#endif

#ifdef QGPU_GLIBC_BASE
#define QGPU_SYMVER(sym, ver) __asm__(".symver " #sym "," #sym "@" ver)

QGPU_SYMVER(dlclose, QGPU_GLIBC_BASE);
QGPU_SYMVER(dlerror, QGPU_GLIBC_BASE);
QGPU_SYMVER(dladdr, QGPU_GLIBC_BASE);
QGPU_SYMVER(pthread_once, QGPU_GLIBC_BASE);
QGPU_SYMVER(pthread_atfork, QGPU_GLIBC_BASE);
QGPU_SYMVER(pthread_create, QGPU_GLIBC_BASE);
QGPU_SYMVER(pthread_attr_setstacksize, QGPU_GLIBC_BASE);
QGPU_SYMVER(pthread_mutexattr_setpshared, QGPU_GLIBC_BASE);
QGPU_SYMVER(pthread_mutexattr_init, QGPU_GLIBC_BASE);
QGPU_SYMVER(pthread_mutexattr_destroy, QGPU_GLIBC_BASE);
QGPU_SYMVER(pthread_rwlock_rdlock, QGPU_GLIBC_BASE);
QGPU_SYMVER(pthread_rwlock_wrlock, QGPU_GLIBC_BASE);
QGPU_SYMVER(pthread_rwlock_unlock, QGPU_GLIBC_BASE);
#if defined(__x86_64__)
QGPU_SYMVER(dladdr1, "GLIBC_2.3.3");
QGPU_SYMVER(dlinfo, "GLIBC_2.3.3");
QGPU_SYMVER(pthread_mutexattr_setrobust, "GLIBC_2.12");
QGPU_SYMVER(pthread_mutex_consistent, "GLIBC_2.12");
QGPU_SYMVER(clock_gettime, "GLIBC_2.17");
QGPU_SYMVER(clock_nanosleep, "GLIBC_2.17");
#else
QGPU_SYMVER(dladdr1, QGPU_GLIBC_BASE);
QGPU_SYMVER(dlinfo, QGPU_GLIBC_BASE);
QGPU_SYMVER(pthread_mutexattr_setrobust, QGPU_GLIBC_BASE);
QGPU_SYMVER(pthread_mutex_consistent, QGPU_GLIBC_BASE);
QGPU_SYMVER(clock_gettime, QGPU_GLIBC_BASE);
QGPU_SYMVER(clock_nanosleep, QGPU_GLIBC_BASE);
#endif
#endif

#endif
