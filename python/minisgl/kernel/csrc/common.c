// The library's runtime: the tests' allocation-failure hook and the allocator every kernel
// goes through, and the feature queries (what this build has, whether the OS grants the AMX
// tiles).
#include "common.h"

#include <cpuid.h>

// Allocations made through kernel_alloc fail while this is positive (the tests' hook, each
// failure counting it down), so that every error path is exercised.
static int64_t failing_allocations = 0;

void minisgl_fail_allocations(int64_t count) {
    __atomic_store_n(&failing_allocations, count, __ATOMIC_SEQ_CST);
}

// Every allocation of the kernels: 64-byte aligned (whole lines, as the AVX-512 loads and tile
// rows want), rounded up to whole lines as aligned_alloc requires, never of 0 bytes. NULL on
// failure: the caller returns MINISGL_ERR_NOMEM (or takes a path that needs no memory).
void* kernel_alloc(size_t bytes) {
    if (__atomic_load_n(&failing_allocations, __ATOMIC_RELAXED) > 0 &&
        __atomic_sub_fetch(&failing_allocations, 1, __ATOMIC_SEQ_CST) >= 0)
        return NULL;
    return aligned_alloc(64, bytes == 0 ? 64 : (bytes + 63) / 64 * 64);
}

int amx_granted = 0;
#ifdef HAVE_AMX_INT8
int amx_int8_granted = 0;
#endif

int minisgl_has_avx512_bf16(void) {
#ifdef HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

int minisgl_has_avx512(void) {
#ifdef HAVE_AVX512
    return 1;
#else
    return 0;
#endif
}

int minisgl_has_avx2(void) {
#ifdef HAVE_AVX2_FMA
    return 1;
#else
    return 0;
#endif
}

int minisgl_has_vnni(void) {
#ifdef HAVE_AVX512_VNNI
    return 1;
#else
    return 0;
#endif
}

#ifdef MINISGL_EMULATED_AMX
__thread uint8_t emulated_tiles[8][16][64];
#endif

int minisgl_has_amx(void) {
#ifdef MINISGL_EMULATED_AMX
    amx_granted = amx_int8_granted = 1;  // tiles in memory need no grant
    return 1;
#elif defined(HAVE_AMX)
    // Linux hands out the tile state only to processes that ask (ARCH_REQ_XCOMP_PERM, 18 =
    // XFEATURE_XTILEDATA); asking again is harmless.
    amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
#ifdef HAVE_AMX_INT8
    // A fixed target's build has the int8 tiles compiled in; this CPU's CPUID leaf 7 says
    // whether it runs them (EDX bit 25, AMX-INT8).
    unsigned int eax, ebx, ecx, edx;
    amx_int8_granted = amx_granted && __get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) &&
                       (edx >> 25 & 1u);
#endif
    return amx_granted;
#else
    return 0;
#endif
}

int minisgl_has_amx_int8(void) {
#ifdef HAVE_AMX_INT8
    return amx_int8_granted;
#else
    return 0;
#endif
}
