// What every kernel file shares: the system headers, what the target flags enable
// (HAVE_AVX512_BF16, HAVE_AVX512_VNNI, HAVE_AMX, HAVE_QUANTIZED_AMX), the checked allocator,
// whether the tiles may be used, and the scalar bf16, half and exp helpers. Functions one file
// defines for others are hidden (MINISGL_INTERNAL): the library exports only what kernels.h
// declares.
#pragma once

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// HAVE_AVX512: AVX-512 F, BW, VL and DQ (x86-64-v4), what every AVX-512 kernel assumes.
#if defined(MINISGL_EMULATED_AVX512)
// An emulated build (emulated.h): the instructions the macros below name, in software.
#include "emulated.h"
#define HAVE_AVX512 1
#define HAVE_AVX2_FMA 1
#ifdef MINISGL_EMULATED_BF16
#define HAVE_AVX512_BF16 1
#endif
#ifdef MINISGL_EMULATED_VNNI
#define HAVE_AVX512_VNNI 1
#endif
#if defined(MINISGL_EMULATED_AMX) && defined(HAVE_AVX512_BF16)
#define HAVE_AMX 1
#define HAVE_QUANTIZED_AMX 1
#define HAVE_AMX_INT8 1
#endif
#else
#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && \
    defined(__AVX512DQ__)
#define HAVE_AVX512 1
#include <immintrin.h>
#endif
// AVX2 and FMA: the quantized row layout's float32 kernels (quantized_avx2.c), all of them on
// CPUs without AVX-512 (Zen 2 and 3, Intel before Skylake-SP), the many-rows one where there
// are no bf16 dot products to take those rows.
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define HAVE_AVX2_FMA 1
#include <immintrin.h>
#endif
#if defined(HAVE_AVX512) && defined(__AVX512BF16__)
#define HAVE_AVX512_BF16 1
#endif
// vpdpbusd (AVX-512 VNNI): the tiled quantized matmul's int8 products.
#if defined(HAVE_AVX512) && defined(__AVX512VNNI__)
#define HAVE_AVX512_VNNI 1
#endif
#if defined(HAVE_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__linux__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

// A tiled quantized weight dequantized block by block onto the tiles (quantized_amx.c): vpermb
// (AVX-512 VBMI, which every CPU with AMX has) moves its bytes into place.
#if defined(HAVE_AMX) && defined(__AVX512VBMI__)
#define HAVE_QUANTIZED_AMX 1
#endif
// The int8 tiles (tdpbsud): W8A8 matmuls of a tiled 8-bit weight (quantized_w8a8.c).
#if defined(HAVE_AMX) && defined(__AMX_INT8__)
#define HAVE_AMX_INT8 1
#endif
#endif

#include "kernels.h"

#define MINISGL_INTERNAL __attribute__((visibility("hidden")))

// A kernel form's body, inlined into each caller that fixes its constants (rows, tiles, bits):
// one compiled form each. An emulated build compiles each body once instead (the forms' code
// then takes the constants at run time): inlined, its emulated lanes took minutes to compile.
#ifdef MINISGL_EMULATED_AVX512
#define FORM_INLINE __attribute__((noinline))
#else
#define FORM_INLINE __attribute__((always_inline))
#endif

// The one allocator of the kernels (common.c): 64-byte aligned, NULL on failure.
MINISGL_INTERNAL void* kernel_alloc(size_t bytes);

// Whether minisgl_has_amx got this process the tile state: the tiles are used only then (a
// tile instruction without it kills the process), whatever a caller asks for.
MINISGL_INTERNAL extern int amx_granted;

static inline int tiles_usable(int use_tiles) { return use_tiles && amx_granted; }

static inline float bf16_to_f32(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// IEEE half to float32 (exact).
static inline float half_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exp = (h >> 10) & 0x1fu, mant = h & 0x3ffu, bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (mant << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (mant << 13);
    } else if (mant == 0) {
        bits = sign;
    } else {  // subnormal: normalise
        exp = 113;
        while (!(mant & 0x400u)) mant <<= 1, exp--;
        bits = sign | (exp << 23) | ((mant & 0x3ffu) << 13);
    }
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

// Round to nearest even, as torch does when it stores a float32 result as bfloat16.
static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// exp(x) in plain float arithmetic, exp512's steps lane by lane (2^n * poly(r), x = n ln2 + r,
// clamped to [-87, 88]): no libm call, so gcc vectorises the loops that use it on any target.
// The portable SiLU and attention softmax called expf per element: 10% and most of the 20% of
// an AVX2 build's W1 that they took.
static inline float exp_portable(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float n = __builtin_rintf(x * 1.44269504f);
    float r = x - n * 0.693145752f;
    r = r - n * 1.42860677e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline void load_row(const void* base, int64_t offset, int dtype, float* dst, int64_t n) {
    if (dtype == 0) {
        memcpy(dst, (const float*)base + offset, (size_t)n * sizeof(float));
    } else {
        const bf16_t* src = (const bf16_t*)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    }
}

static inline void store_row(void* base, int64_t offset, int dtype, const float* src, int64_t n) {
    if (dtype == 0) {
        memcpy((float*)base + offset, src, (size_t)n * sizeof(float));
    } else {
        bf16_t* dst = (bf16_t*)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    }
}

// Rounds a float32 value to the storage dtype and back (identity for float32).
static inline float round_to(int dtype, float x) {
    return dtype == 0 ? x : bf16_to_f32(f32_to_bf16(x));
}

// round(silu(gate)) * up in the dtype's rounding (the product unrounded): minisgl_silu_and_mul's
// portable loop and the AVX2 gated matmul's epilogue, so the two agree bit for bit.
static inline float silu_times_portable(int dtype, float gate, float up) {
    return round_to(dtype, gate / (1.0f + exp_portable(-gate))) * up;
}
