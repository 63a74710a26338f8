/* thread_stack_shim.so: an LD_PRELOAD work-around used by build_and_serve.sh on the GPU host.
 *
 * Debian's civetweb 1.15 (the HTTP server behind prometheus-cpp's Exposer) creates its threads with
 * a fixed 100 KiB stack (pthread_attr_setstacksize(&attr, 102400)). glibc places a thread's static
 * TLS on its stack, and a process that has loaded the pip LibTorch's CUDA libraries has more static
 * TLS than fits, so pthread_create fails and the exporter reports "null context when constructing
 * CivetServer. Possible problem binding to port." (Debian's CPU LibTorch leaves enough room.)
 * This shim raises every requested stack size below STOWAGE_MIN_THREAD_STACK_BYTES (default 8 MiB)
 * to that minimum. Build: cc -shared -fPIC -O2 -o thread_stack_shim.so thread_stack_shim.c -ldl
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>

int pthread_attr_setstacksize(pthread_attr_t *attr, size_t size) {
  static int (*real)(pthread_attr_t *, size_t);
  static size_t minimum;
  static int reported;
  if (real == NULL) {
    real = (int (*)(pthread_attr_t *, size_t))dlsym(RTLD_NEXT, "pthread_attr_setstacksize");
    const char *env = getenv("STOWAGE_MIN_THREAD_STACK_BYTES");
    minimum = env != NULL ? (size_t)strtoull(env, NULL, 10) : (size_t)8 << 20;
  }
  if (size < minimum) {
    if (!reported) {
      reported = 1;
      fprintf(stderr, "thread_stack_shim: raising %zu-byte thread stacks to %zu bytes\n", size, minimum);
    }
    size = minimum;
  }
  return real(attr, size);
}
