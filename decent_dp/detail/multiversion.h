// DECENT_DP_MULTIVERSION: builds a hot loop for AVX-512, AVX2 and baseline x86-64, and the
// loader picks the best the CPU has (GCC's target_clones). Off under clang and with
// DECENT_DP_NO_MULTIVERSION (ThreadSanitizer: the clone resolvers run before its runtime).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && \
    !defined(DECENT_DP_NO_MULTIVERSION)
#define DECENT_DP_MULTIVERSION __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define DECENT_DP_MULTIVERSION
#endif
