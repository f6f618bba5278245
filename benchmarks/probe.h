// What the VNNI probes (vnni_tile_probe.cpp, heads_cache_probe.cpp) share: the thread's CPU time and vpdpbusd as the
// kernel issues it (register operands).
#pragma once
#include <immintrin.h>
#include <time.h>

inline double cpu_ms() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %[b], %[a], %[acc]" : [acc] "+v"(acc) : [a] "v"(a), [b] "v"(b));
  return acc;
}
