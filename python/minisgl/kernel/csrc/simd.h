// The lane helpers several kernel files inline. AVX-512: bf16 lanes to float32 and back, exp,
// rounding to the dtype, SiLU, a 16 x 16 transpose, the k-pair broadcast of vdpbf16ps, the AMX
// tile configuration; AVX2: 8 float32 or bf16 values loaded as float32, exp.
#pragma once

#include "common.h"

#ifdef HAVE_AVX512
// 16 bf16 values as float32 (exact).
static inline __m512 bf16x16_to_f32(__m256i packed) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(packed), 16));
}

static inline __m512 load16(const void* base, int64_t offset, int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float*)base + offset);
    __m256i half = _mm256_loadu_si256((const __m256i*)((const bf16_t*)base + offset));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// exp(x) for x <= 88, ~1 ulp: 2^n * poly(r), x = n ln2 + r; below -87 it returns ~0.
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// Round float32 lanes to bfloat16 precision (nearest even), kept as float32.
static inline __m512 round_bf16_512(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

static inline __m512 round_to_512(int dtype, __m512 x) {
    return dtype == 0 ? x : round_bf16_512(x);
}

// Stores 16 lanes already rounded to the dtype (bf16: their top halves).
static inline void store16(void* base, int64_t offset, int dtype, __m512 v) {
    if (dtype == 0) {
        _mm512_storeu_ps((float*)base + offset, v);
    } else {
        __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
        _mm256_storeu_si256((__m256i*)((bf16_t*)base + offset), half);
    }
}

// round(round(silu(gate)) * up) in the dtype, as PyTorch's op-by-op silu(gate) * up rounds.
// A correctly rounded division (the explicit-rounding form, which -ffast-math leaves alone), as
// PyTorch divides: the gated matmul's epilogue and minisgl_silu_and_mul agree bit for bit, and
// a reciprocal estimate's last-bit error would flip bf16 roundings PyTorch does not.
static inline __m512 silu_times(__m512 gate, __m512 up, int dtype) {
    const __m512 neg = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gate),
                                     _mm512_set1_ps(88.0f));
    const __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(neg));
    const __m512 silu = _mm512_div_round_ps(gate, denom, _MM_FROUND_CUR_DIRECTION);
    return round_to_512(dtype, _mm512_mul_ps(round_to_512(dtype, silu), up));
}
#endif

#ifdef HAVE_AVX512
// 16 x 16 32-bit elements transposed in registers: row p of the result is column p of rows.
static inline void transpose16(__m512i rows[16]) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  // u[i + j]: column 4L + j of rows i..i+3, in lane L
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int j = 0; j < 4; j++) {
        const __m512i a_even = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x88);
        const __m512i a_odd = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xdd);
        const __m512i b_even = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x88);
        const __m512i b_odd = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xdd);
        rows[j] = _mm512_shuffle_i32x4(a_even, b_even, 0x88);
        rows[8 + j] = _mm512_shuffle_i32x4(a_even, b_even, 0xdd);
        rows[4 + j] = _mm512_shuffle_i32x4(a_odd, b_odd, 0x88);
        rows[12 + j] = _mm512_shuffle_i32x4(a_odd, b_odd, 0xdd);
    }
}

#endif

#ifdef HAVE_AVX512_BF16
// Two adjacent bf16 values as one 32-bit lane, broadcast to all 16.
static inline __m512bh broadcast_pair(const bf16_t* pair) {
    uint32_t bits;
    memcpy(&bits, pair, 4);
    return (__m512bh)_mm512_set1_epi32((int)bits);
}
#endif

#ifdef HAVE_AMX
typedef struct {
    uint8_t palette_id, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

// This thread's eight tiles as 16 rows of 64 bytes (16 float32 or 32 bf16 a row).
static inline void amx_configure(void) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}
#endif

#ifdef HAVE_AVX2_FMA
// 8 float32 or bf16 (widened exactly) values as float32.
static inline __m256 load8(const void* base, int64_t offset, int dtype) {
    if (dtype == 0) return _mm256_loadu_ps((const float*)base + offset);
    const __m128i half = _mm_loadu_si128((const __m128i*)((const bf16_t*)base + offset));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
}

// exp512's steps on 8 lanes, for x in [-87, 0] (2^n is then a normal float built from its
// exponent bits): the same bits as exp512 and exp_portable there.
static inline __m256 exp256_nonpositive(__m256 x) {
    x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));
    const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                     _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 5040.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 720.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    const __m256i bits = _mm256_slli_epi32(
        _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(bits));
}
#endif

