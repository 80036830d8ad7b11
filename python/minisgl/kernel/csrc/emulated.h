// The AVX-512 and AMX instructions the kernels use, emulated on a CPU without them, so that every
// kernel path (vpdpbusd tiles, vdpbf16ps, the AMX tiles) runs, is fuzzed and is sanitized on any
// x86-64 machine with AVX2 (build.py's *-emulated targets: -march=x86-64-v3 plus
// -DMINISGL_EMULATED_AVX512 and the extensions' macros). SIMDe (simde-py) provides most lanes;
// this file adds those it lacks, replaces its masked loads and stores (which touch every lane's
// memory: a sanitizer would report, and hardware would not fault on, the masked-off ones) with
// lane-by-lane ones that touch only the selected elements, and keeps the eight AMX tiles of a
// thread in memory. Values are those of the instructions up to rounding order; speed is not
// the point.
#pragma once

#include <immintrin.h>

#define SIMDE_ENABLE_NATIVE_ALIASES
#include <simde/x86/avx512.h>

typedef float emu_f32x16 __attribute__((vector_size(64)));
typedef int32_t emu_i32x16 __attribute__((vector_size(64)));
typedef int16_t emu_i16x32 __attribute__((vector_size(64)));
typedef int16_t emu_i16x16 __attribute__((vector_size(32)));
typedef uint16_t emu_u16x16 __attribute__((vector_size(32)));
typedef uint16_t emu_u16x32 __attribute__((vector_size(64)));
typedef int8_t emu_i8x16 __attribute__((vector_size(16)));
typedef uint8_t emu_u8x16 __attribute__((vector_size(16)));
typedef uint8_t emu_u8x32 __attribute__((vector_size(32)));

// ------------------------------------------------------------ masked memory, lane by lane
static inline __m512 emu_maskz_loadu_ps(uint16_t mask, const void* p) {
    emu_f32x16 v = {0};
    for (int i = 0; i < 16; i++)
        if (mask >> i & 1) memcpy((float*)&v + i, (const float*)p + i, 4);
    return (__m512)v;
}

static inline void emu_mask_storeu_ps(void* p, uint16_t mask, __m512 a) {
    const emu_f32x16 v = (emu_f32x16)a;
    for (int i = 0; i < 16; i++)
        if (mask >> i & 1) memcpy((float*)p + i, (const float*)&v + i, 4);
}

static inline __m512i emu_maskz_loadu_epi16(uint32_t mask, const void* p) {
    emu_u16x32 v = {0};
    for (int i = 0; i < 32; i++)
        if (mask >> i & 1) memcpy((uint16_t*)&v + i, (const uint16_t*)p + i, 2);
    return (__m512i)v;
}

static inline __m256i emu_maskz_loadu_epi16_256(uint16_t mask, const void* p) {
    emu_u16x16 v = {0};
    for (int i = 0; i < 16; i++)
        if (mask >> i & 1) memcpy((uint16_t*)&v + i, (const uint16_t*)p + i, 2);
    return (__m256i)v;
}

static inline void emu_mask_storeu_epi16(void* p, uint32_t mask, __m512i a) {
    const emu_u16x32 v = (emu_u16x32)a;
    for (int i = 0; i < 32; i++)
        if (mask >> i & 1) memcpy((uint16_t*)p + i, (const uint16_t*)&v + i, 2);
}

static inline void emu_mask_storeu_epi16_256(void* p, uint16_t mask, __m256i a) {
    const emu_u16x16 v = (emu_u16x16)a;
    for (int i = 0; i < 16; i++)
        if (mask >> i & 1) memcpy((uint16_t*)p + i, (const uint16_t*)&v + i, 2);
}

// Lane i reads the 4 bytes at base + index[i] * scale (and only those).
static inline __m512i emu_i32gather_epi32(__m512i index, const void* base, int scale) {
    const emu_i32x16 at = (emu_i32x16)index;
    emu_i32x16 v;
    for (int i = 0; i < 16; i++) memcpy((int32_t*)&v + i, (const char*)base + at[i] * scale, 4);
    return (__m512i)v;
}

// ------------------------------------------------------------ conversions and reductions
static inline __m256i emu_cvtepi32_epi16(__m512i a) {
    return (__m256i)__builtin_convertvector((emu_i32x16)a, emu_i16x16);
}

static inline __m512i emu_cvtepi8_epi32(__m128i a) {
    return (__m512i)__builtin_convertvector((emu_i8x16)a, emu_i32x16);
}

static inline __m512i emu_cvtepu8_epi32(__m128i a) {
    return (__m512i)__builtin_convertvector((emu_u8x16)a, emu_i32x16);
}

static inline __m512i emu_cvtepu8_epi16(__m256i a) {
    return (__m512i)__builtin_convertvector((emu_u8x32)a, emu_i16x32);
}

static inline __m512i emu_cvtepu16_epi32(__m256i a) {
    return (__m512i)__builtin_convertvector((emu_u16x16)a, emu_i32x16);
}

static inline __m512 emu_cvtepi32_ps(__m512i a) {
    return (__m512)__builtin_convertvector((emu_i32x16)a, emu_f32x16);
}

// Nearest even; out of range and NaN give the integer indefinite, as vcvtps2dq does.
static inline __m512i emu_cvtps_epi32(__m512 a) {
    const emu_f32x16 v = (emu_f32x16)a;
    emu_i32x16 out;
    for (int i = 0; i < 16; i++) {
        const float r = __builtin_rintf(v[i]);
        out[i] = r >= -2147483648.0f && r < 2147483648.0f ? (int32_t)r : INT32_MIN;
    }
    return (__m512i)out;
}

static inline __m512 emu_cvtph_ps(__m256i a) {
    __m256 halves[2] = {_mm256_cvtph_ps(_mm256_castsi256_si128(a)),
                        _mm256_cvtph_ps(_mm256_extracti128_si256(a, 1))};
    __m512 out;
    memcpy(&out, halves, sizeof out);
    return out;
}

// vcvtneps2bf16: nearest even, denormal inputs as zero, NaN kept quiet.
static inline uint16_t emu_bf16_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40u);
    if ((u & 0x7f800000u) == 0) return (uint16_t)((u >> 16) & 0x8000u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

static inline __m256bh emu_cvtneps_pbh(__m512 a) {
    const emu_f32x16 v = (emu_f32x16)a;
    emu_u16x16 out;
    for (int i = 0; i < 16; i++) out[i] = emu_bf16_bits(v[i]);
    return (__m256bh)out;
}

// Lanes 0-15 from b, 16-31 from a.
static inline __m512bh emu_cvtne2ps_pbh(__m512 a, __m512 b) {
    const emu_f32x16 va = (emu_f32x16)a, vb = (emu_f32x16)b;
    emu_u16x32 out;
    for (int i = 0; i < 16; i++) {
        out[i] = emu_bf16_bits(vb[i]);
        out[16 + i] = emu_bf16_bits(va[i]);
    }
    return (__m512bh)out;
}

static inline __m512 emu_div_round_ps(__m512 a, __m512 b, int rounding) {
    (void)rounding;  // the current direction: nearest even
    return (__m512)((emu_f32x16)a / (emu_f32x16)b);
}

static inline float emu_reduce_add_ps(__m512 a) {
    const emu_f32x16 v = (emu_f32x16)a;
    float sum = 0.0f;
    for (int i = 0; i < 16; i++) sum += v[i];
    return sum;
}

static inline int32_t emu_reduce_add_epi32(__m512i a) {
    const emu_i32x16 v = (emu_i32x16)a;
    uint32_t sum = 0;  // wraps, as the lanes' adds do
    for (int i = 0; i < 16; i++) sum += (uint32_t)v[i];
    return (int32_t)sum;
}

static inline float emu_reduce_max_ps(__m512 a) {
    const emu_f32x16 v = (emu_f32x16)a;
    float best = v[0];
    for (int i = 1; i < 16; i++) best = v[i] > best ? v[i] : best;
    return best;
}

#undef _mm512_maskz_loadu_ps
#define _mm512_maskz_loadu_ps emu_maskz_loadu_ps
#undef _mm512_mask_storeu_ps
#define _mm512_mask_storeu_ps emu_mask_storeu_ps
#undef _mm512_maskz_loadu_epi16
#define _mm512_maskz_loadu_epi16 emu_maskz_loadu_epi16
#undef _mm256_maskz_loadu_epi16
#define _mm256_maskz_loadu_epi16 emu_maskz_loadu_epi16_256
#undef _mm512_mask_storeu_epi16
#define _mm512_mask_storeu_epi16 emu_mask_storeu_epi16
#undef _mm256_mask_storeu_epi16
#define _mm256_mask_storeu_epi16 emu_mask_storeu_epi16_256
#undef _mm512_i32gather_epi32
#define _mm512_i32gather_epi32 emu_i32gather_epi32
#undef _mm512_cvtepi32_epi16
#define _mm512_cvtepi32_epi16 emu_cvtepi32_epi16
#undef _mm512_cvtepi8_epi32
#define _mm512_cvtepi8_epi32 emu_cvtepi8_epi32
#undef _mm512_cvtepu8_epi32
#define _mm512_cvtepu8_epi32 emu_cvtepu8_epi32
#undef _mm512_cvtepu8_epi16
#define _mm512_cvtepu8_epi16 emu_cvtepu8_epi16
#undef _mm512_cvtepu16_epi32
#define _mm512_cvtepu16_epi32 emu_cvtepu16_epi32
#undef _mm512_cvtepi32_ps
#define _mm512_cvtepi32_ps emu_cvtepi32_ps
#undef _mm512_cvtps_epi32
#define _mm512_cvtps_epi32 emu_cvtps_epi32
#undef _mm512_cvtph_ps
#define _mm512_cvtph_ps emu_cvtph_ps
#undef _mm512_cvtneps_pbh
#define _mm512_cvtneps_pbh emu_cvtneps_pbh
#undef _mm512_cvtne2ps_pbh
#define _mm512_cvtne2ps_pbh emu_cvtne2ps_pbh
#undef _mm512_div_round_ps
#define _mm512_div_round_ps emu_div_round_ps
#undef _mm512_reduce_add_ps
#define _mm512_reduce_add_ps emu_reduce_add_ps
#undef _mm512_reduce_add_epi32
#define _mm512_reduce_add_epi32 emu_reduce_add_epi32
#undef _mm512_reduce_max_ps
#define _mm512_reduce_max_ps emu_reduce_max_ps

// ------------------------------------------------------------ AMX: eight tiles in memory
// Every tile as simd.h's amx_configure sets it: 16 rows of 64 bytes. The state is the thread's
// (common.c defines it), as the hardware's is.
#ifdef MINISGL_EMULATED_AMX
extern __thread uint8_t emulated_tiles[8][16][64];

static inline void emu_tile_loadd(int tile, const void* base, int64_t stride) {
    for (int r = 0; r < 16; r++)
        memcpy(emulated_tiles[tile][r], (const char*)base + r * stride, 64);
}

static inline void emu_tile_stored(int tile, void* base, int64_t stride) {
    for (int r = 0; r < 16; r++) memcpy((char*)base + r * stride, emulated_tiles[tile][r], 64);
}

static inline void emu_tile_zero(int tile) { memset(emulated_tiles[tile], 0, 16 * 64); }

static inline float emu_bf16_float(const uint8_t* p) {
    uint16_t h;
    memcpy(&h, p, 2);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return (u & 0x7f800000u) == 0 ? 0.0f : f;  // denormals as zero, as tdpbf16ps
}

// c[m][n] += sum_k a[m][2k] * b[k][2n] + a[m][2k + 1] * b[k][2n + 1] (float32 c, bf16 pairs).
static inline void emu_tile_dpbf16ps(int c, int a, int b) {
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            float acc;
            memcpy(&acc, &emulated_tiles[c][m][4 * n], 4);
            for (int k = 0; k < 16; k++) {
                const uint8_t* pa = &emulated_tiles[a][m][4 * k];
                const uint8_t* pb = &emulated_tiles[b][k][4 * n];
                acc += emu_bf16_float(pa) * emu_bf16_float(pb) +
                       emu_bf16_float(pa + 2) * emu_bf16_float(pb + 2);
            }
            memcpy(&emulated_tiles[c][m][4 * n], &acc, 4);
        }
}

// c[m][n] += sum_k sum_i a[m][4k + i] * b[k][4n + i] (int32 c; a signed, b unsigned bytes).
static inline void emu_tile_dpbsud(int c, int a, int b) {
    for (int m = 0; m < 16; m++)
        for (int n = 0; n < 16; n++) {
            int32_t acc;
            memcpy(&acc, &emulated_tiles[c][m][4 * n], 4);
            for (int k = 0; k < 16; k++)
                for (int i = 0; i < 4; i++)
                    acc += (int32_t)(int8_t)emulated_tiles[a][m][4 * k + i] *
                           (int32_t)emulated_tiles[b][k][4 * n + i];
            memcpy(&emulated_tiles[c][m][4 * n], &acc, 4);
        }
}

#undef _tile_loadd
#define _tile_loadd(tile, base, stride) emu_tile_loadd(tile, base, stride)
#undef _tile_stored
#define _tile_stored(tile, base, stride) emu_tile_stored(tile, base, stride)
#undef _tile_zero
#define _tile_zero(tile) emu_tile_zero(tile)
#undef _tile_dpbf16ps
#define _tile_dpbf16ps(c, a, b) emu_tile_dpbf16ps(c, a, b)
#undef _tile_dpbsud
#define _tile_dpbsud(c, a, b) emu_tile_dpbsud(c, a, b)
#undef _tile_loadconfig
#define _tile_loadconfig(config) ((void)(config))
#undef _tile_release
#define _tile_release() ((void)0)
#endif
