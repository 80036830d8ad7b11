#include "common.h"
#include "internal.h"
#include "simd.h"

// ------------------------------------------------------------------ quantized-weight matmul
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows m, where w is stored as small
// integers and a float scale (and offset) per group of columns (layers/quant_weight.py's
// QuantizedWeight): w[n, k] = q[n, k] * scale[n, g] + min[n, g], g = k / group. A decode step
// reads every weight once, so it is bound by the weight bytes: 8 bits halve bf16's, 4 bits
// (with a float16 scale and offset per 32) take 0.625 of a byte per weight.
//
// A few x rows (choose_path has the rest), exactly: 8 bits: each 16 weights are made float32 as
// the dequantization does (q * scale + min, one rounding) and multiplied with the x rows in
// float32. 4 bits with bf16 x: the nibbles become bf16 integers through a 16-entry table
// (exact), vdpbf16ps takes 32 a step against the bf16 x rows, and the sums are scaled per
// group: sum_g scale_g * sum_k q_k x_k + sum_g min_g * sum_k x_k, the second from each x row's
// group sums (computed once a call). Each thread takes blocks of weight rows (guided, as the
// bf16 GEMV), every x row against the block.

#define QROWS_WIDE 8  // QROWS on bf16 weights dequantized in registers (rows_wide)
#define WIDE_MAX_ROWS 16  // x rows up to which rows_wide beats the packed-block path

#ifdef HAVE_AVX512
// The 16 integers of row n at columns k..k+15 (k a multiple of 16) as float32 lanes: 8 bits
// straight; 4 bits from the 64-column block's bytes (k & 31) on, low nibbles for the block's
// first 32 columns, high ones for the last 32.
static inline __m512 ints16(const quantized_weight* w, int64_t n, int64_t K, int64_t k) {
    if (w->bits == 8) {
        const int8_t* q = (const int8_t*)w->values + n * K + k;
        return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)q)));
    }
    const uint8_t* q = (const uint8_t*)w->values + n * (K / 2) + (k >> 6) * 32 + (k & 31);
    const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)q));
    const __m512i ints = (k & 32) ? _mm512_srli_epi32(bytes, 4)
                                  : _mm512_and_si512(bytes, _mm512_set1_epi32(15));
    return _mm512_cvtepi32_ps(ints);
}
#endif

// Weight row n dequantized (q * scale + min in float32, one rounding: the product is exact)
// into out [K], float32 or (bf16_out) rounded to bf16; tmp: K floats of scratch.
static void dequant_row(const quantized_weight* w, int64_t n, int64_t K, const float* scales,
                        const float* mins, void* out, int bf16_out, float* tmp) {
    const int64_t group = w->group, groups = K / group;
#ifdef HAVE_AVX512
    for (int64_t g = 0, k = 0; g < groups; g++) {
        const __m512 scale = _mm512_set1_ps(scales[g]);
        const __m512 offset = mins ? _mm512_set1_ps(mins[g]) : _mm512_setzero_ps();
        for (const int64_t end = k + group; k < end; k += 16) {
            const __m512 v = _mm512_fmadd_ps(ints16(w, n, K, k), scale, offset);
            if (bf16_out)
                store16(out, k, 1, round_bf16_512(v));
            else
                _mm512_storeu_ps((float*)out + k, v);
        }
    }
    (void)tmp;
#else
    float* row = bf16_out ? tmp : (float*)out;
#ifdef HAVE_AVX2_FMA
    dequant_row_avx2(w, n, K, scales, mins, row);
    if (bf16_out) store_row(out, 0, 1, row, K);
    return;
#endif
    for (int64_t g = 0; g < groups; g++) {
        const float scale = scales[g], offset = mins ? mins[g] : 0.0f;
        for (int64_t k = g * group; k < (g + 1) * group; k++) {
            int q;
            if (w->bits == 8) {
                q = ((const int8_t*)w->values)[n * K + k];
            } else {
                const uint8_t byte =
                    ((const uint8_t*)w->values)[n * (K / 2) + (k / 64) * 32 + (k % 32)];
                q = (k % 64) < 32 ? (byte & 15) : (byte >> 4);
            }
            row[k] = (float)q * scale + offset;
        }
    }
    if (bf16_out) store_row(out, 0, 1, row, K);
#endif
}

// Any target: the weight row dequantized once, then every x row against it.
static void rows_generic(const void* x, const quantized_weight* w, const void* bias, void* y,
                         int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1, int x_dtype,
                         int out_f32, float* scratch) {
    const int64_t groups = K / w->group;
    float *scales = scratch, *mins = scratch + padded(groups), *row = mins + padded(groups);
    for (int64_t n = n0; n < n1; n++) {
        group_floats(w, w->scales, n, groups, scales);
        if (w->mins) group_floats(w, w->mins, n, groups, mins);
        dequant_row(w, n, K, scales, w->mins ? mins : NULL, row, 0, NULL);
        for (int64_t m = 0; m < M; m++) {
            float sum = 0.0f;
            if (x_dtype == 0) {
                const float* xm = (const float*)x + m * K;
                for (int64_t k = 0; k < K; k++) sum += xm[k] * row[k];
            } else {
                const bf16_t* xm = (const bf16_t*)x + m * K;
                for (int64_t k = 0; k < K; k++) sum += bf16_to_f32(xm[k]) * row[k];
            }
            store_out(y, m * N + n, sum, bias, n, x_dtype, out_f32);
        }
    }
}

#ifdef HAVE_AVX512
// Float32 x rows (M, at most QROWS, a constant where inlined): 16 weights at a time dequantized
// to float32 (as dequant_row) and multiplied into two accumulators per x row (alternate 16s:
// two independent chains).
static inline FORM_INLINE void rows_f32_impl(
    const float* xf, const quantized_weight* w, const void* bias, void* y, int64_t N, int64_t K,
    int64_t n0, int64_t n1, int x_dtype, int out_f32, float* scratch, const int M) {
    const int64_t group = w->group, groups = K / group;
    float *scales = scratch, *mins = scratch + padded(groups);
    // No software prefetch: the rows are read in order, and the hardware's prefetcher does
    // better alone (prefetching 2 rows ahead cost 28% on a 150 MB head from memory).
    for (int64_t n = n0; n < n1; n++) {
        group_floats(w, w->scales, n, groups, scales);
        if (w->mins) group_floats(w, w->mins, n, groups, mins);
        __m512 even[QROWS], odd[QROWS];
        for (int r = 0; r < M; r++) even[r] = odd[r] = _mm512_setzero_ps();
        for (int64_t g = 0, k = 0; g < groups; g++) {
            const __m512 scale = _mm512_set1_ps(scales[g]);
            const __m512 offset = w->mins ? _mm512_set1_ps(mins[g]) : _mm512_setzero_ps();
            const int64_t end = k + group;
            for (; k + 32 <= end; k += 32) {
                const __m512 w0 = _mm512_fmadd_ps(ints16(w, n, K, k), scale, offset);
                const __m512 w1 = _mm512_fmadd_ps(ints16(w, n, K, k + 16), scale, offset);
                for (int r = 0; r < M; r++) {
                    even[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + r * K + k), even[r]);
                    odd[r] = _mm512_fmadd_ps(w1, _mm512_loadu_ps(xf + r * K + k + 16), odd[r]);
                }
            }
            if (k < end) {  // a group of 16
                const __m512 w0 = _mm512_fmadd_ps(ints16(w, n, K, k), scale, offset);
                for (int r = 0; r < M; r++)
                    even[r] = _mm512_fmadd_ps(w0, _mm512_loadu_ps(xf + r * K + k), even[r]);
                k += 16;
            }
        }
        for (int r = 0; r < M; r++)
            store_out(y, r * N + n, _mm512_reduce_add_ps(_mm512_add_ps(even[r], odd[r])), bias,
                      n, x_dtype, out_f32);
    }
}

static void rows_f32(const float* xf, const quantized_weight* w, const void* bias, void* y,
                     int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1, int x_dtype,
                     int out_f32, float* scratch) {
    switch (M) {
        case 1: rows_f32_impl(xf, w, bias, y, N, K, n0, n1, x_dtype, out_f32, scratch, 1); break;
        case 2: rows_f32_impl(xf, w, bias, y, N, K, n0, n1, x_dtype, out_f32, scratch, 2); break;
        case 3: rows_f32_impl(xf, w, bias, y, N, K, n0, n1, x_dtype, out_f32, scratch, 3); break;
        default: rows_f32_impl(xf, w, bias, y, N, K, n0, n1, x_dtype, out_f32, scratch, 4);
    }
}
#endif

#ifdef HAVE_AVX512_BF16
// sum_g a[g] * b[g] in vectors (a scalar loop's chain of dependent adds cost as much as
// streaming a 4-bit row of 1,024 columns).
static inline float dot_groups(const float* a, const float* b, int64_t groups) {
    __m512 acc = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; g += 16) {
        const __mmask16 mask =
            groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1u);
        acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(mask, a + g),
                              _mm512_maskz_loadu_ps(mask, b + g), acc);
    }
    return _mm512_reduce_add_ps(acc);
}

// bf16 of the integers 0..15, the nibbles' lookup table.
static inline __m512i nibble_table(void) {
    uint16_t table[32] = {0};
    for (int i = 0; i < 16; i++) {
        const float f = (float)i;
        uint32_t bits;
        memcpy(&bits, &f, sizeof bits);
        table[i] = (uint16_t)(bits >> 16);
    }
    return _mm512_loadu_si512(table);
}

// A 64-column block's 32 bytes as two vectors of 32 bf16 integers: columns 0..31 and 32..63.
static inline void nibbles_bf16(const uint8_t* bytes, __m512i table, __m512bh* lo, __m512bh* hi) {
    const __m512i both = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)bytes));
    *lo = (__m512bh)_mm512_permutexvar_epi16(_mm512_and_si512(both, _mm512_set1_epi16(15)), table);
    *hi = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(both, 4), table);
}

// 4 bits, bf16 x (M rows, at most QROWS, a constant where inlined): per block the nibbles as
// bf16 integers (exact), one vdpbf16ps per 32 columns and x row, each scaled by its group's
// scale; the offsets from the x rows' group sums.
static inline FORM_INLINE void rows_int4_impl(
    const bf16_t* x, const float* xsums, const quantized_weight* w, const void* bias, void* y,
    int64_t N, int64_t K, int64_t n0, int64_t n1, int out_f32, float* scratch, const int M) {
    const int64_t group = w->group, groups = K / group;
    const int64_t blocks_per_group = group == 32 ? 1 : group / 64;
    const __m512i table = nibble_table();
    float *scales = scratch, *mins = scratch + padded(groups);
    for (int64_t n = n0; n < n1; n++) {
        const uint8_t* q = (const uint8_t*)w->values + n * (K / 2);
        group_floats(w, w->scales, n, groups, scales);
        if (w->mins) group_floats(w, w->mins, n, groups, mins);
        __m512 lo_acc[QROWS], hi_acc[QROWS];
        for (int r = 0; r < M; r++) lo_acc[r] = hi_acc[r] = _mm512_setzero_ps();
        // Each half block's sums scaled into its accumulator (a dot product from zero, then a
        // multiply-add: chains of one), by its group's scale: a block's two with groups of 32.
        int64_t g = 0, blocks_left = blocks_per_group;
        for (int64_t b = 0; b < K / 64; b++) {
            float scale_lo, scale_hi;
            if (group == 32) {
                scale_lo = scales[2 * b], scale_hi = scales[2 * b + 1];
            } else {
                scale_lo = scale_hi = scales[g];
                if (--blocks_left == 0) g++, blocks_left = blocks_per_group;
            }
            __m512bh wlo, whi;
            nibbles_bf16(q + b * 32, table, &wlo, &whi);
            const __m512 s_lo = _mm512_set1_ps(scale_lo), s_hi = _mm512_set1_ps(scale_hi);
            for (int r = 0; r < M; r++) {
                const bf16_t* xm = x + r * K + b * 64;
                const __m512 plo = _mm512_dpbf16_ps(_mm512_setzero_ps(), wlo,
                                                    (__m512bh)_mm512_loadu_si512(xm));
                const __m512 phi = _mm512_dpbf16_ps(_mm512_setzero_ps(), whi,
                                                    (__m512bh)_mm512_loadu_si512(xm + 32));
                lo_acc[r] = _mm512_fmadd_ps(plo, s_lo, lo_acc[r]);
                hi_acc[r] = _mm512_fmadd_ps(phi, s_hi, hi_acc[r]);
            }
        }
        for (int r = 0; r < M; r++) {
            float sum = _mm512_reduce_add_ps(_mm512_add_ps(lo_acc[r], hi_acc[r]));
            if (w->mins) sum += dot_groups(mins, xsums + r * groups, groups);
            store_out(y, r * N + n, sum, bias, n, 1, out_f32);
        }
    }
}

static void rows_int4_bf16(const bf16_t* x, const float* xsums, const quantized_weight* w,
                           const void* bias, void* y, int64_t M, int64_t N, int64_t K,
                           int64_t n0, int64_t n1, int out_f32, float* scratch) {
    switch (M) {
        case 1: rows_int4_impl(x, xsums, w, bias, y, N, K, n0, n1, out_f32, scratch, 1); break;
        case 2: rows_int4_impl(x, xsums, w, bias, y, N, K, n0, n1, out_f32, scratch, 2); break;
        case 3: rows_int4_impl(x, xsums, w, bias, y, N, K, n0, n1, out_f32, scratch, 3); break;
        default: rows_int4_impl(x, xsums, w, bias, y, N, K, n0, n1, out_f32, scratch, 4);
    }
}
#endif

#ifdef HAVE_AVX512_BF16
// Weight rows n0..n0+31 (zeros past N) dequantized, rounded to bf16 and laid out as a block of
// the packed copy (packing.c: per k-step of 32, two tiles of 16 columns' k-pairs), into wblock
// [K * 32]. scales/mins: 32 rows of padded(groups) floats; chunk_group: each 16 columns' group.
static void dequant_block_packed(const quantized_weight* w, int64_t n0, int64_t N, int64_t K,
                                 float* scales, float* mins, const int32_t* chunk_group,
                                 bf16_t* wblock) {
    const int64_t groups = K / w->group, stride = padded(groups);
    for (int64_t r = 0; r < 32 && n0 + r < N; r++) {
        group_floats(w, w->scales, n0 + r, groups, scales + r * stride);
        if (w->mins) group_floats(w, w->mins, n0 + r, groups, mins + r * stride);
    }
    for (int64_t kb = 0; kb < K / 32; kb++) {
        const int32_t g0 = chunk_group[2 * kb], g1 = chunk_group[2 * kb + 1];
        for (int tile = 0; tile < 2; tile++) {
            __m512i rows[16];
            for (int c = 0; c < 16; c++) {
                const int64_t r = tile * 16 + c, n = n0 + r;
                if (n >= N) {
                    rows[c] = _mm512_setzero_si512();
                    continue;
                }
                const float* s = scales + r * stride;
                const float* m = mins + r * stride;
                const __m512 zero = _mm512_setzero_ps();
                const __m512 lo =
                    _mm512_fmadd_ps(ints16(w, n, K, kb * 32), _mm512_set1_ps(s[g0]),
                                    w->mins ? _mm512_set1_ps(m[g0]) : zero);
                const __m512 hi =
                    _mm512_fmadd_ps(ints16(w, n, K, kb * 32 + 16), _mm512_set1_ps(s[g1]),
                                    w->mins ? _mm512_set1_ps(m[g1]) : zero);
                rows[c] = (__m512i)_mm512_cvtne2ps_pbh(hi, lo);  // k-pairs 0..15 in k order
            }
            transpose16(rows);
            bf16_t* dst = wblock + kb * 32 * 32 + tile * 512;
            for (int p = 0; p < 16; p++) _mm512_store_si512(dst + p * 32, rows[p]);
        }
    }
}
#endif

#ifdef HAVE_AVX512_BF16
// More x rows (M, at most QROWS_WIDE, a constant where inlined), bf16: each 32 weights of a row
// dequantized to bf16 once in registers (as dequant_row rounds them), then one vdpbf16ps per x
// row. 4 bits through a table of the group's 16 values (fma of 0..15 with its scale and
// offset, rounded): one lookup per 32 weights. chunk_group: each 16 columns' group.
// Columns k..k+31 of weight row n dequantized and rounded to bf16 (its scales and mins given as
// float32 per group): 8 bits through float32, 4 bits through the group's table of 16 values.
static inline FORM_INLINE __m512bh wide_weights(
    const quantized_weight* w, int64_t n, int64_t K, int64_t k, int32_t g0, int32_t g1,
    const float* scales, const float* mins) {
    const __m512 zero = _mm512_setzero_ps();
    if (w->bits == 8) {
        const __m512 lo = _mm512_fmadd_ps(ints16(w, n, K, k), _mm512_set1_ps(scales[g0]),
                                          mins ? _mm512_set1_ps(mins[g0]) : zero);
        const __m512 hi = _mm512_fmadd_ps(ints16(w, n, K, k + 16), _mm512_set1_ps(scales[g1]),
                                          mins ? _mm512_set1_ps(mins[g1]) : zero);
        return _mm512_cvtne2ps_pbh(hi, lo);
    }
    // A group of 32 or more: one table for the 32 columns.
    const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 values = _mm512_fmadd_ps(iota, _mm512_set1_ps(scales[g0]),
                                          mins ? _mm512_set1_ps(mins[g0]) : zero);
    const __m512i table = _mm512_castsi256_si512((__m256i)_mm512_cvtneps_pbh(values));
    const uint8_t* q = (const uint8_t*)w->values + n * (K / 2) + (k >> 6) * 32;
    const __m512i bytes = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)q));
    const __m512i idx = (k & 32) ? _mm512_srli_epi16(bytes, 4)
                                 : _mm512_and_si512(bytes, _mm512_set1_epi16(15));
    return (__m512bh)_mm512_permutexvar_epi16(idx, table);
}

// More x rows (M, at most QROWS_WIDE, a constant where inlined), bf16: each 32 weights of a row
// dequantized to bf16 once in registers (as dequant_row rounds them), then one vdpbf16ps per x
// row; two weight rows at a time (PAIR 2), so each x load feeds two dot products (one a load
// was as many instructions as the bf16 GEMV's 4 x 4 blocks need for both). chunk_group: each
// 16 columns' group.
static inline FORM_INLINE void rows_wide_impl(
    const bf16_t* x, const quantized_weight* w, const void* bias, void* y, int64_t N, int64_t K,
    int64_t n, int out_f32, float* scratch, const int32_t* chunk_group, const int M,
    const int PAIR) {
    const int64_t groups = K / w->group, stride = padded(groups);
    __m512 acc[2][QROWS_WIDE];
    for (int p = 0; p < PAIR; p++) {
        group_floats(w, w->scales, n + p, groups, scratch + 2 * p * stride);
        if (w->mins) group_floats(w, w->mins, n + p, groups, scratch + (2 * p + 1) * stride);
        for (int r = 0; r < M; r++) acc[p][r] = _mm512_setzero_ps();
    }
    for (int64_t k = 0; k < K; k += 32) {
        const int32_t g0 = chunk_group[k / 16], g1 = chunk_group[k / 16 + 1];
        __m512bh wv[2];
        for (int p = 0; p < PAIR; p++)
            wv[p] = wide_weights(w, n + p, K, k, g0, g1, scratch + 2 * p * stride,
                                 w->mins ? scratch + (2 * p + 1) * stride : NULL);
        for (int r = 0; r < M; r++) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + r * K + k);
            for (int p = 0; p < PAIR; p++) acc[p][r] = _mm512_dpbf16_ps(acc[p][r], wv[p], xv);
        }
    }
    for (int p = 0; p < PAIR; p++)
        for (int r = 0; r < M; r++)
            store_out(y, r * N + n + p, _mm512_reduce_add_ps(acc[p][r]), bias, n + p, 1, out_f32);
}

static void rows_wide(const bf16_t* x, const quantized_weight* w, const void* bias, void* y,
                      int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1, int out_f32,
                      float* scratch, const int32_t* chunk_group) {
    for (int64_t m0 = 0; m0 < M; m0 += QROWS_WIDE) {
        const bf16_t* xm = x + m0 * K;
        void* ym = out_f32 ? (void*)((float*)y + m0 * N) : (void*)((bf16_t*)y + m0 * N);
        const int64_t rows = M - m0 < QROWS_WIDE ? M - m0 : QROWS_WIDE;
        for (int64_t n = n0; n < n1;) {
            const int pair = n + 1 < n1 ? 2 : 1;
            switch (rows * 2 + pair - 1) {  // (rows, pair) as one constant each
#define WIDE_CASE(r, p)                                                                      \
    case r * 2 + p - 1:                                                                      \
        rows_wide_impl(xm, w, bias, ym, N, K, n, out_f32, scratch, chunk_group, r, p); \
        break;
                WIDE_CASE(1, 1) WIDE_CASE(1, 2) WIDE_CASE(2, 1) WIDE_CASE(2, 2)
                WIDE_CASE(3, 1) WIDE_CASE(3, 2) WIDE_CASE(4, 1) WIDE_CASE(4, 2)
                WIDE_CASE(5, 1) WIDE_CASE(5, 2) WIDE_CASE(6, 1) WIDE_CASE(6, 2)
                WIDE_CASE(7, 1) WIDE_CASE(7, 2) WIDE_CASE(8, 1)
                default:
                WIDE_CASE(8, 2)
#undef WIDE_CASE
            }
            n += pair;
        }
    }
}
#endif

// Scratch floats a thread needs (a multiple of 16: each thread's part stays 64-byte aligned):
// scales and mins of 32 rows, a packed block of 32 rows in bf16 (or a row in float32 and
// QBLOCK rows in bf16; AVX2: 16 rows in float32, then transposed), each 16 columns' group.
static inline int64_t thread_scratch(int64_t K, int64_t group) {
    return 64 * padded(K / group) + 32 * K + padded(K / 16);
}

// Whether w (K columns) is a layout these kernels take: the one rule, minisgl_quantized_fits.
static inline int weight_fits(const quantized_weight* w, int64_t K) {
    return minisgl_quantized_fits(w->bits, w->group, K, w->tiled);
}

int minisgl_quantized_fits(int64_t bits, int64_t group, int64_t K, int64_t tiled) {
    if (K <= 0 || group <= 0 || K % group != 0) return 0;
    // Row layout: 8 bits in groups of 16s; 4 bits in 64-column blocks, groups of 32 or of 64s.
    // Tile layout: also whole 32-column x blocks (an 8-bit weight's last 32 columns of a
    // 64-column step are a tail the tiled kernels take; 4 bits are whole blocks anyway), and
    // 6 bits (8-bit integers within -32..31) in groups of 16s.
    if (tiled && bits == 6) return group % 16 == 0 && K % 32 == 0;
    const int rows_fit = (bits == 8 && group % 16 == 0) ||
                         (bits == 4 && K % 64 == 0 && (group == 32 || group % 64 == 0));
    return rows_fit && (!tiled || K % 32 == 0);
}

// A tiled weight's matmul and rows: where vpdpbusd or AVX2 was compiled in (quant_tiles.py
// tiles only then).
static int tiled_linear(const void* x, const quantized_weight* w, const void* bias, void* y,
                        int64_t M, int64_t N, int64_t K, int x_dtype, int path, int out_f32,
                        int nthreads) {
#ifdef HAVE_AVX512_VNNI
    (void)x_dtype;
    return quantized_tiled_linear(x, w, bias, y, M, N, K, path, out_f32, nthreads);
#elif defined(HAVE_AVX2_FMA)
    if (path == QPATH_AVX2_TILED_INT8)
        return quantized_tiled_avx2_int8_linear(x, w, bias, y, M, N, K, out_f32, nthreads);
    return quantized_tiled_avx2_linear(x, w, bias, y, M, N, K, x_dtype, path, out_f32, nthreads);
#else
    (void)x, (void)w, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)x_dtype, (void)path;
    (void)out_f32, (void)nthreads;
    return MINISGL_ERR_SHAPE;
#endif
}

static int tiled_rows(const quantized_weight* w, const int64_t* ids, void* out, int64_t count,
                      int64_t K, int dtype, int nthreads) {
#ifdef HAVE_AVX512_VNNI
    return quantized_tiled_rows(w, ids, out, count, K, dtype, nthreads);
#elif defined(HAVE_AVX2_FMA)
    return quantized_tiled_avx2_rows(w, ids, out, count, K, dtype, nthreads);
#else
    (void)w, (void)ids, (void)out, (void)count, (void)K, (void)dtype, (void)nthreads;
    return MINISGL_ERR_SHAPE;
#endif
}

// How x meets the weight, the one choice (minisgl_quantized_path; kernels.h names the paths). A
// tiled weight (quantized_tiled.c): float32 x against its tiles dequantized; bf16 x in int8
// products (x to 16 bits where the weight is precise), or with AMX from QUANTIZED_AMX_MIN_ROWS rows
// on the tiles (quantized_amx.c). The row layout: with bf16 x, up to QROWS rows exactly (4 bits:
// the nibbles as bf16 integers; 8 bits: dequantized to float32, x converted); up to
// WIDE_MAX_ROWS rows against each 32 weights dequantized to bf16 in registers (rows_wide); more
// against blocks of 32 weight rows dequantized into the packed tile layout (the packed matmul's
// kernel), or, where K is not a multiple of 32, QBLOCK rows at a time into the bf16 GEMV's block
// kernel. Float32 x (or bf16 without bf16 dots): up to QROWS rows in float32 with AVX-512;
// otherwise, with AVX2, the kernels of quantized_avx2.c (every row count: layers/quantized.py
// sends it prefills too where the CPU has no bf16 dots; a few bf16 rows as int16); else row by
// row (generic). Layers/quantized.py takes batches above QUANTIZED_GEMV_MAX_ROWS to dequantize +
// oneDNN instead where the CPU has bf16 dots, but for a tiled weight in one int8 pass.
int minisgl_quantized_path(const quantized_weight* w, int64_t M, int64_t K, int x_dtype) {
    if (!weight_fits(w, K) || M < 0 || (x_dtype != 0 && x_dtype != 1)) return -1;
    if (w->tiled) {
#ifdef HAVE_AVX512_VNNI
        if (x_dtype == 0) return QPATH_TILED_F32;
        if (M > W8A8_MIN_ROWS && w8a8_fits(w, K) && w->int8_x) {
#ifdef HAVE_AMX_INT8
            if (tiles_usable((int)w->amx) && amx_int8_granted) return QPATH_TILED_W8A8;
#endif
            return QPATH_TILED_W8A8_VNNI;
        }
#ifdef HAVE_QUANTIZED_AMX
        if (M >= QUANTIZED_AMX_MIN_ROWS && tiles_usable((int)w->amx)) return QPATH_TILED_AMX;
#endif
        return w->precise ? QPATH_TILED_PRECISE : QPATH_TILED_INT8;
#elif defined(HAVE_AVX2_FMA)
        if (x_dtype == 0) return QPATH_AVX2_TILED_F32;
        if (w->bits == 8) return QPATH_AVX2_TILED_INT16;  // every row count: see internal.h
        if (M > AVX2_TILED_MAX_ROWS) return QPATH_AVX2_TILED_F32;
        return w->precise ? QPATH_AVX2_TILED_INT16 : QPATH_AVX2_TILED_INT8;
#else
        return -1;  // only a build with AVX2 (or vpdpbusd) reads the tile layout
#endif
    }
#ifdef HAVE_AVX512_BF16
    if (x_dtype == 1 && M > QROWS && K % 32 == 0)
        return M <= WIDE_MAX_ROWS ? QPATH_WIDE : QPATH_PACKED;
    if (x_dtype == 1 && M > QROWS) return QPATH_BF16_BLOCK;
    if (x_dtype == 1 && w->bits == 4) return QPATH_NIBBLES;
#endif
#ifdef HAVE_AVX512
    if (M <= QROWS) return QPATH_F32;
#endif
#ifdef HAVE_AVX2_FMA
    if (M > AVX2_ROWS_MAX) return QPATH_AVX2_TILE;
    return avx2_int16_rows(w, M, K, x_dtype) ? QPATH_AVX2_INT16 : QPATH_AVX2_ROWS;
#endif
    return QPATH_GENERIC;
}

// How many calls took each path in this process (minisgl_quantized_path_runs).
static int64_t path_runs[QPATH_COUNT];

void minisgl_quantized_path_runs(int64_t* out) {
    for (int p = 0; p < QPATH_COUNT; p++)
        out[p] = __atomic_load_n(&path_runs[p], __ATOMIC_RELAXED);
}

int minisgl_quantized_linear(const void* x, const quantized_weight* w, const void* bias, void* y,
                             int64_t M, int64_t N, int64_t K, int x_dtype, int out_f32,
                             int nthreads) {
    const int path = minisgl_quantized_path(w, M, K, x_dtype);
    if (path < 0 || N <= 0 || nthreads < 1) return MINISGL_ERR_SHAPE;
    __atomic_add_fetch(&path_runs[path], 1, __ATOMIC_RELAXED);
    if (w->tiled) return tiled_linear(x, w, bias, y, M, N, K, x_dtype, path, out_f32, nthreads);
    const int64_t groups = K / w->group;
    // x as float32 (QPATH_F32, the AVX2 paths) or, on AVX2 with bf16 x and a few rows, as int16
    // per 32 columns with their scales; and its per-group sums where the kernel takes the offsets
    // from them (QPATH_NIBBLES, the AVX2 paths' 4 bits and int16 forms).
    int int16_x = 0;
#ifdef HAVE_AVX2_FMA
    int16_x = path == QPATH_AVX2_INT16;
#endif
    const int avx2 = path == QPATH_AVX2_ROWS || path == QPATH_AVX2_INT16 || path == QPATH_AVX2_TILE;
    const int64_t x_rows = path == QPATH_F32 || avx2 ? M * K : 0;
    const int64_t x_scales = int16_x ? M * (K / 32) : 0;
    // (the many-rows AVX2 tile dequantizes with the mins: a prefill's x needs no sums)
    int few_rows_4bit = 0;
#ifdef HAVE_AVX2_FMA
    few_rows_4bit = avx2 && w->bits == 4 && M <= AVX2_ROWS_MAX;
#endif
    const int64_t x_sums =
        (path == QPATH_NIBBLES || few_rows_4bit || int16_x) && w->mins ? M * groups : 0;
    const int64_t x_floats = x_rows + x_scales + x_sums;
    const int64_t per_thread = thread_scratch(K, w->group);
    float* buffer =
        kernel_alloc((size_t)(padded(x_floats) + nthreads * per_thread) * sizeof(float));
    if (!buffer) return MINISGL_ERR_NOMEM;
    float *xf = buffer, *xscale = buffer + x_rows, *xsums = xscale + x_scales;
#ifdef HAVE_AVX2_FMA
    if (int16_x) avx2_x_int16((const bf16_t*)x, M, K, (int16_t*)xf, xscale);
#endif
    for (int64_t m = 0; m < (x_rows && !int16_x ? M : 0); m++)
        load_row(x, m * K, x_dtype, xf + m * K, K);
    if (x_sums) x_group_sums(x, x_dtype, M, K, w->group, xsums);
    int64_t row_block = path == QPATH_PACKED ? 32 : QBLOCK;
#ifdef HAVE_AVX2_FMA
    if (avx2) row_block = AVX2_BLOCK;
#endif
    const int64_t blocks = (N + row_block - 1) / row_block;
    // The scratch after x's floats starts 64-byte aligned too.
    const int64_t x_padded = padded(x_floats);
#pragma omp parallel num_threads(nthreads)
    {
        float* scratch = buffer + x_padded + omp_get_thread_num() * per_thread;
#ifdef HAVE_AVX512_BF16
        int32_t* chunk_group = (int32_t*)(scratch + 64 * padded(groups) + 32 * K);
        if (path == QPATH_PACKED || path == QPATH_WIDE)
            for (int64_t c = 0; c < K / 16; c++) chunk_group[c] = (int32_t)(c * 16 / w->group);
#endif
#pragma omp for schedule(guided)
        for (int64_t blk = 0; blk < blocks; blk++) {
            const int64_t n0 = blk * row_block, n1 = n0 + row_block < N ? n0 + row_block : N;
            switch (path) {
#ifdef HAVE_AVX512_BF16
                case QPATH_PACKED: {
                    float* mins = scratch + 32 * padded(groups);
                    bf16_t* wblock = (bf16_t*)(scratch + 64 * padded(groups));
                    dequant_block_packed(w, n0, N, K, scratch, mins, chunk_group, wblock);
                    packed_block_rows((const bf16_t*)x, wblock, (const bf16_t*)bias, y, M, N,
                                      K / 32, n0, out_f32);
                    break;
                }
                case QPATH_BF16_BLOCK:
                    if (n1 - n0 == QBLOCK) {
                        float *scales = scratch, *mins = scratch + padded(groups);
                        bf16_t* block = (bf16_t*)(mins + padded(groups) + K);
                        for (int64_t n = n0; n < n1; n++) {
                            group_floats(w, w->scales, n, groups, scales);
                            if (w->mins) group_floats(w, w->mins, n, groups, mins);
                            dequant_row(w, n, K, scales, w->mins ? mins : NULL,
                                        block + (n - n0) * K, 1, NULL);
                        }
                        gemv_block4((const bf16_t*)x, block, (const bf16_t*)bias, y, M, N, K, n0,
                                    NULL, out_f32);
                    } else {
                        rows_generic(x, w, bias, y, M, N, K, n0, n1, x_dtype, out_f32, scratch);
                    }
                    break;
                case QPATH_WIDE:
                    rows_wide((const bf16_t*)x, w, bias, y, M, N, K, n0, n1, out_f32, scratch,
                              chunk_group);
                    break;
                case QPATH_NIBBLES:
                    rows_int4_bf16((const bf16_t*)x, xsums, w, bias, y, M, N, K, n0, n1,
                                   out_f32, scratch);
                    break;
#endif
#ifdef HAVE_AVX512
                case QPATH_F32:
                    rows_f32(xf, w, bias, y, M, N, K, n0, n1, x_dtype, out_f32, scratch);
                    break;
#endif
#ifdef HAVE_AVX2_FMA
                case QPATH_AVX2_ROWS:
                case QPATH_AVX2_INT16:
                case QPATH_AVX2_TILE:
                    quantized_rows_avx2(xf, int16_x ? xscale : NULL, xsums, w, bias, y, M, N, K,
                                        n0, n1, x_dtype, out_f32, scratch);
                    break;
#endif
                default:
                    rows_generic(x, w, bias, y, M, N, K, n0, n1, x_dtype, out_f32, scratch);
            }
        }
    }
    free(buffer);
    return MINISGL_OK;
}

// silu(gate) * up into y [M, inter] from bf16 x [M, K] and a tiled gate_up weight (2 * inter
// rows: gate, then up), on the AMX tiles from QUANTIZED_AMX_MIN_ROWS rows; elsewhere (fewer
// rows, no tiles) MINISGL_ERR_UNSUPPORTED, and the caller multiplies, then applies SiLU.
int minisgl_quantized_gated_silu(const bf16_t* x, const quantized_weight* w, bf16_t* y, int64_t M,
                                 int64_t inter, int64_t K, int nthreads) {
    if (!w->tiled || !weight_fits(w, K) || M < 0 || inter <= 0 || inter % 16 != 0 ||
        nthreads < 1)
        return MINISGL_ERR_SHAPE;
    const int path = minisgl_quantized_path(w, M, K, 1);
#ifdef HAVE_AVX512_VNNI
    if (path == QPATH_TILED_W8A8 || path == QPATH_TILED_W8A8_VNNI) {
        __atomic_add_fetch(&path_runs[path], 1, __ATOMIC_RELAXED);
        return quantized_w8a8_linear(x, w, NULL, y, M, 2 * inter, K, EPILOGUE_GATED,
                                     path == QPATH_TILED_W8A8, nthreads);
    }
#endif
#ifdef HAVE_QUANTIZED_AMX
    if (path == QPATH_TILED_AMX) {
        __atomic_add_fetch(&path_runs[path], 1, __ATOMIC_RELAXED);
        return quantized_amx_linear(x, w, NULL, y, M, 2 * inter, K, EPILOGUE_GATED, nthreads);
    }
#endif
    (void)path;
    (void)x, (void)y, (void)M, (void)nthreads;
    return MINISGL_ERR_UNSUPPORTED;
}

// A tiled weight [N, K] dequantized into a packed copy (minisgl_packed_elems(N, K) bf16; gated:
// N = 2 * inter gate and up rows paired, for minisgl_packed_gated_silu): a prefill's weight.
int minisgl_quantized_packed(const quantized_weight* w, bf16_t* packed, int64_t N, int64_t K,
                             int gated, int nthreads) {
    if (!w->tiled || !weight_fits(w, K) || N <= 0 || (gated && N % 32 != 0) || nthreads < 1)
        return MINISGL_ERR_SHAPE;
    return quantized_tiled_packed(w, packed, N, K, gated, nthreads);
}

// Rows `ids` of a quantized weight dequantized into out [count, K] (an embedding lookup from
// a quantized table, or the whole weight for a large batch), float32 or bf16 (rounded once).
int minisgl_quantized_rows(const quantized_weight* w, const int64_t* ids, void* out,
                           int64_t count, int64_t N, int64_t K, int dtype, int nthreads) {
    if (!weight_fits(w, K) || count < 0 || nthreads < 1) return MINISGL_ERR_SHAPE;
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= N) return MINISGL_ERR_SHAPE;
    if (w->tiled) return tiled_rows(w, ids, out, count, K, dtype, nthreads);
    const int64_t groups = K / w->group, per_thread = 2 * padded(groups) + K;
    float* buffer = kernel_alloc((size_t)(nthreads * per_thread) * sizeof(float));
    if (!buffer) return MINISGL_ERR_NOMEM;
    const size_t elem = dtype == 0 ? 4 : 2;
#pragma omp parallel num_threads(nthreads) if (count * K >= (1 << 16))
    {
        float* scratch = buffer + omp_get_thread_num() * per_thread;
        float *scales = scratch, *mins = scratch + padded(groups), *tmp = mins + padded(groups);
#pragma omp for schedule(static)
        for (int64_t i = 0; i < count; i++) {
            group_floats(w, w->scales, ids[i], groups, scales);
            if (w->mins) group_floats(w, w->mins, ids[i], groups, mins);
            dequant_row(w, ids[i], K, scales, w->mins ? mins : NULL,
                        (char*)out + (size_t)(i * K) * elem, dtype == 1, tmp);
        }
    }
    free(buffer);
    return MINISGL_OK;
}
