#include "internal.h"

// ------------------------------------------------------------- quantized-weight matmul, AVX2
// The row layout (quantized.c describes it) with AVX2 and FMA: x as float32 rows, 8 lanes a
// vector. quantized.c takes these where AVX-512 has no better form (choose_path).
//
// A few x rows (at most AVX2_ROWS_MAX): each weight row is streamed once, every x row against it
// (QROWS at a time: a second group of rows finds the row in L1); one x row (batch 1) meets
// several weight rows at a time (batch1_rows). bf16 x is rounded to int16 per 32 columns
// (scale max|x| / 32767: 15 bits against bf16's 8, so within bf16's own rounding) and meets
// the integers widened to 16 bits in vpmaddwd, 16 exact products an instruction; each 32
// columns' int32 sum is scaled by the weight group's scale times the x block's (an int4 row
// took half the instructions of converting its integers to float32, which bound it at 2 cores).
// Float32 x stays exact: 8 bits: each 8 weights dequantized to float32 (q * scale + min, one
// rounding, as dequant_row) and multiplied into the rows' accumulators; 4 bits: each half of a
// 64-column block (low nibbles: columns 0..31, high: 32..63) summed, then scaled by its group's
// scale. The offsets of either come from each x row's group sums.
// More x rows: a block of 16 weight rows dequantized to float32 into the thread's scratch (L2),
// transposed (16 rows' weights at each column side by side), then tiles of 6 x rows by the 16
// weight rows: per column two weight loads and six broadcast x values feed twelve accumulators,
// which hold finished outputs (no horizontal sums).

#ifdef HAVE_AVX2_FMA
#define TILE_X 6  // x rows a tile of the many-rows kernel takes
// Rows ahead whose bytes the int16 kernels prefetch (Zen 2: +15% for 8 bits, +4% for 4 at batch 1)
#define PREFETCH_ROWS 4

static inline float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// The 8 signed bytes at q as float32 lanes.
static inline __m256 int8x8(const int8_t* q) {
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)q)));
}

// The 8 bytes at q as 32-bit lanes (a 4-bit block's bytes: both nibbles still in each).
static inline __m256i bytes8(const uint8_t* q) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)q));
}

// sum_g a[g] * b[g] (the offsets' part of a 4-bit row's sums).
static inline float dot_floats(const float* a, const float* b, int64_t count) {
    __m256 acc = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= count; g += 8)
        acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + g), _mm256_loadu_ps(b + g), acc);
    float sum = hsum8(acc);
    for (; g < count; g++) sum += a[g] * b[g];
    return sum;
}

// A 4-bit row's 64-column blocks in order: the group of the next block's low half (its high
// half's: g_lo + (group == 32)), counted from this one's (a division a block cost as much as the
// block's FMAs): groups of 32 are a block's two, larger groups whole blocks, blocks_left of them.
static inline void next_block_group(int64_t group, int64_t* g_lo, int64_t* blocks_left) {
    if (group == 32) {
        *g_lo += 2;
    } else if (--*blocks_left == 0) {
        *g_lo += 1, *blocks_left = group / 64;
    }
}

MINISGL_INTERNAL void dequant_row_avx2(const quantized_weight* w, int64_t n, int64_t K,
                                       const float* scales, const float* mins, float* out) {
    const int64_t group = w->group;
    if (w->bits == 8) {
        const int8_t* q = (const int8_t*)w->values + n * K;
        for (int64_t g = 0, k = 0; g < K / group; g++) {
            const __m256 scale = _mm256_set1_ps(scales[g]);
            const __m256 offset = mins ? _mm256_set1_ps(mins[g]) : _mm256_setzero_ps();
            for (const int64_t end = k + group; k < end; k += 8)
                _mm256_storeu_ps(out + k, _mm256_fmadd_ps(int8x8(q + k), scale, offset));
        }
        return;
    }
    const uint8_t* q = (const uint8_t*)w->values + n * (K / 2);
    int64_t g_lo = 0, blocks_left = group == 32 ? 1 : group / 64;  // next_block_group's
    for (int64_t b = 0; b < K / 64; b++) {
        const int64_t g_hi = g_lo + (group == 32);
        const __m256 s_lo = _mm256_set1_ps(scales[g_lo]), s_hi = _mm256_set1_ps(scales[g_hi]);
        const __m256 m_lo = mins ? _mm256_set1_ps(mins[g_lo]) : _mm256_setzero_ps();
        const __m256 m_hi = mins ? _mm256_set1_ps(mins[g_hi]) : _mm256_setzero_ps();
        for (int j = 0; j < 32; j += 8) {
            const __m256i both = bytes8(q + b * 32 + j);
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(both, _mm256_set1_epi32(15)));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(both, 4));
            _mm256_storeu_ps(out + b * 64 + j, _mm256_fmadd_ps(lo, s_lo, m_lo));
            _mm256_storeu_ps(out + b * 64 + 32 + j, _mm256_fmadd_ps(hi, s_hi, m_hi));
        }
        next_block_group(group, &g_lo, &blocks_left);
    }
}

// 8 bits, M x rows (a constant where inlined): sums[r] = x row r . weight row n. Four
// accumulator chains a row for one or two rows (an FMA's latency would bound a single chain),
// two for more (the registers).
static inline FORM_INLINE void row_sums_int8(
    const float* xf, const quantized_weight* w, int64_t n, int64_t K, const float* scales,
    const float* mins, float* sums, const int M) {
    enum { CHAINS = 4 };
    const int chains = M <= 2 ? 4 : 2;
    const int64_t group = w->group;
    const int8_t* q = (const int8_t*)w->values + n * K;
    __m256 acc[QROWS][CHAINS];
    for (int r = 0; r < M; r++)
        for (int c = 0; c < CHAINS; c++) acc[r][c] = _mm256_setzero_ps();
    for (int64_t g = 0, k = 0; g < K / group; g++) {
        const __m256 scale = _mm256_set1_ps(scales[g]);
        const __m256 offset = mins ? _mm256_set1_ps(mins[g]) : _mm256_setzero_ps();
        const int64_t end = k + group;
        for (; k + 32 <= end; k += 32)
            for (int v = 0; v < 4; v++) {
                const __m256 wv = _mm256_fmadd_ps(int8x8(q + k + 8 * v), scale, offset);
                for (int r = 0; r < M; r++)
                    acc[r][v % chains] = _mm256_fmadd_ps(
                        wv, _mm256_loadu_ps(xf + r * K + k + 8 * v), acc[r][v % chains]);
            }
        for (; k < end; k += 8) {  // a group of 16 (or a 16-column tail)
            const __m256 wv = _mm256_fmadd_ps(int8x8(q + k), scale, offset);
            for (int r = 0; r < M; r++)
                acc[r][0] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(xf + r * K + k), acc[r][0]);
        }
    }
    for (int r = 0; r < M; r++) {
        __m256 total = acc[r][0];
        for (int c = 1; c < chains; c++) total = _mm256_add_ps(total, acc[r][c]);
        sums[r] = hsum8(total);
    }
}

// 4 bits, M x rows (a constant where inlined): per 64-column block the two halves' products
// summed (from zero: chains of four), then scaled into the row's accumulators by their groups'
// scales; separate accumulators for the halves with one or two rows. xsums [M, groups]: the
// x rows' group sums, for the offsets (where w has mins).
static inline FORM_INLINE void row_sums_int4(
    const float* xf, const float* xsums, const quantized_weight* w, int64_t n, int64_t K,
    const float* scales, const float* mins, float* sums, const int M) {
    const int64_t group = w->group, groups = K / group;
    const int split = M <= 2 ? 1 : 0;  // the high halves' accumulator: 1, or the low one's
    const uint8_t* q = (const uint8_t*)w->values + n * (K / 2);
    __m256 acc[QROWS][2];
    for (int r = 0; r < M; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t g_lo = 0, blocks_left = group == 32 ? 1 : group / 64;  // next_block_group's
    for (int64_t b = 0; b < K / 64; b++) {
        __m256 lo_sum[QROWS], hi_sum[QROWS];
        for (int j = 0; j < 32; j += 8) {
            const __m256i both = bytes8(q + b * 32 + j);
            const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(both, _mm256_set1_epi32(15)));
            const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(both, 4));
            for (int r = 0; r < M; r++) {
                const float* xm = xf + r * K + b * 64 + j;
                const __m256 x_lo = _mm256_loadu_ps(xm), x_hi = _mm256_loadu_ps(xm + 32);
                lo_sum[r] = j == 0 ? _mm256_mul_ps(lo, x_lo) : _mm256_fmadd_ps(lo, x_lo, lo_sum[r]);
                hi_sum[r] = j == 0 ? _mm256_mul_ps(hi, x_hi) : _mm256_fmadd_ps(hi, x_hi, hi_sum[r]);
            }
        }
        const __m256 s_lo = _mm256_set1_ps(scales[g_lo]);
        const __m256 s_hi = _mm256_set1_ps(scales[g_lo + (group == 32)]);
        for (int r = 0; r < M; r++) {
            acc[r][0] = _mm256_fmadd_ps(lo_sum[r], s_lo, acc[r][0]);
            acc[r][split] = _mm256_fmadd_ps(hi_sum[r], s_hi, acc[r][split]);
        }
        next_block_group(group, &g_lo, &blocks_left);
    }
    for (int r = 0; r < M; r++) {
        sums[r] = hsum8(split ? _mm256_add_ps(acc[r][0], acc[r][1]) : acc[r][0]);
        if (mins) sums[r] += dot_floats(mins, xsums + r * groups, groups);
    }
}

static inline FORM_INLINE void row_sums(const float* xf, const float* xsums,
                                                           const quantized_weight* w, int64_t n,
                                                           int64_t K, const float* scales,
                                                           const float* mins, float* sums,
                                                           const int M) {
    if (w->bits == 8)
        row_sums_int8(xf, w, n, K, scales, mins, sums, M);
    else
        row_sums_int4(xf, xsums, w, n, K, scales, mins, sums, M);
}

MINISGL_INTERNAL int avx2_int16_rows(const quantized_weight* w, int64_t M, int64_t K,
                                     int x_dtype) {
    const int blocks_fit = w->group % 32 == 0 || (w->bits == 8 && w->group == 16);
    return x_dtype == 1 && M <= AVX2_ROWS_MAX && K % 32 == 0 && blocks_fit;
}

MINISGL_INTERNAL void avx2_x_int16(const bf16_t* x, int64_t M, int64_t K, int16_t* x16,
                                   float* xscale) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / 32; b++) {
            __m256i ints[4];
            xscale[m * (K / 32) + b] = bf16_block_round(x + m * K + b * 32, 32767.0f, ints);
            // packs interleaves the 128-bit halves: 0xD8 puts the columns back in order
            const __m256i lo = _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[0], ints[1]), 0xD8);
            const __m256i hi = _mm256_permute4x64_epi64(_mm256_packs_epi32(ints[2], ints[3]), 0xD8);
            _mm256_storeu_si256((__m256i*)(x16 + m * K + b * 32), lo);
            _mm256_storeu_si256((__m256i*)(x16 + m * K + b * 32 + 16), hi);
        }
}

// 8 bits against int16 x (M rows, a constant where inlined): per 32 columns two vpmaddwd a row
// (exact int32 sums), scaled by the weight group's scale times the x block's.
static inline FORM_INLINE void row_sums_int8_i16(
    const int16_t* x16, const float* xscale, const float* xsums, const quantized_weight* w,
    int64_t n, int64_t K, const float* scales, const float* mins, float* sums, const int M) {
    const int64_t group = w->group, groups = K / group, xblocks = K / 32;
    const int8_t* q = (const int8_t*)w->values + n * K;
    __m256 acc[QROWS][2];
    for (int r = 0; r < M; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t g = 0, blocks_left = group / 32;  // group 16: two groups a block
    for (int64_t b = 0; b < xblocks; b++) {
        _mm_prefetch((const char*)(q + PREFETCH_ROWS * K + b * 32), _MM_HINT_T0);
        const __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + b * 32)));
        const __m256i w1 =
            _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(q + b * 32 + 16)));
        for (int r = 0; r < M; r++) {
            const __m256i* xr = (const __m256i*)(x16 + r * K + b * 32);
            const __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256(xr));
            const __m256i p1 = _mm256_madd_epi16(w1, _mm256_loadu_si256(xr + 1));
            const float xs = xscale[r * xblocks + b];
            if (group == 16) {
                acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p0),
                                            _mm256_set1_ps(scales[2 * b] * xs), acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p1),
                                            _mm256_set1_ps(scales[2 * b + 1] * xs), acc[r][1]);
            } else {
                acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(p0, p1)),
                                            _mm256_set1_ps(scales[g] * xs), acc[r][0]);
            }
        }
        if (group != 16 && --blocks_left == 0) g++, blocks_left = group / 32;
    }
    for (int r = 0; r < M; r++) {
        sums[r] = hsum8(_mm256_add_ps(acc[r][0], acc[r][1]));
        if (mins) sums[r] += dot_floats(mins, xsums + r * groups, groups);
    }
}

// Lane j: the sum of v[j]'s lanes.
static inline __m128 hsum4x8(__m256 v0, __m256 v1, __m256 v2, __m256 v3) {
    const __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(v0, v1), _mm256_hadd_ps(v2, v3));
    return _mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1));
}

// 4 bits against int16 x (M rows, a constant where inlined): a 64-column block's 32 bytes as
// two vectors of 16 bytes widened to 16 bits (low nibbles: columns 0..15 and 16..31, high:
// 32..47 and 48..63), two vpmaddwd a half and row, each half scaled by its group's scale times
// its x block's.
static inline FORM_INLINE void row_sums_int4_i16(
    const int16_t* x16, const float* xscale, const float* xsums, const quantized_weight* w,
    int64_t n, int64_t K, const float* scales, const float* mins, float* sums, const int M) {
    const int64_t group = w->group, groups = K / group, xblocks = K / 32;
    const uint8_t* q = (const uint8_t*)w->values + n * (K / 2);
    const __m256i low4 = _mm256_set1_epi16(15);
    __m256 acc[QROWS][2];
    for (int r = 0; r < M; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    int64_t g_lo = 0, blocks_left = group == 32 ? 1 : group / 64;  // next_block_group's
    for (int64_t b = 0; b < K / 64; b++) {
        _mm_prefetch((const char*)(q + PREFETCH_ROWS * (K / 2) + b * 32), _MM_HINT_T0);
        const __m256i v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(q + b * 32)));
        const __m256i v1 =
            _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(q + b * 32 + 16)));
        const __m256i lo0 = _mm256_and_si256(v0, low4), lo1 = _mm256_and_si256(v1, low4);
        const __m256i hi0 = _mm256_srli_epi16(v0, 4), hi1 = _mm256_srli_epi16(v1, 4);
        const float s_lo = scales[g_lo], s_hi = scales[g_lo + (group == 32)];
        for (int r = 0; r < M; r++) {
            const __m256i* xr = (const __m256i*)(x16 + r * K + b * 64);
            const __m256i p_lo =
                _mm256_add_epi32(_mm256_madd_epi16(lo0, _mm256_loadu_si256(xr)),
                                 _mm256_madd_epi16(lo1, _mm256_loadu_si256(xr + 1)));
            const __m256i p_hi =
                _mm256_add_epi32(_mm256_madd_epi16(hi0, _mm256_loadu_si256(xr + 2)),
                                 _mm256_madd_epi16(hi1, _mm256_loadu_si256(xr + 3)));
            const float* xs = xscale + r * xblocks + 2 * b;
            acc[r][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_lo), _mm256_set1_ps(s_lo * xs[0]),
                                        acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_hi), _mm256_set1_ps(s_hi * xs[1]),
                                        acc[r][1]);
        }
        next_block_group(group, &g_lo, &blocks_left);
    }
    // The lanes summed as batch1_sums sums them, then the offsets: a row's output is the same
    // bits alone (batch 1) or among others (a verify step's rows, a decode batch). (Folding the
    // offsets into the lanes, as batch 1 had, slowed this loop 1.6x at four rows on Zen 2.)
    for (int r = 0; r < M; r++) {
        const __m256 total = _mm256_add_ps(acc[r][0], acc[r][1]);
        sums[r] = _mm_cvtss_f32(hsum4x8(total, total, total, total));
        if (mins) sums[r] += dot_floats(mins, xsums + r * groups, groups);
    }
}

// Batch 1 (one int16 x row), 4 bits: BATCH1_ROWS weight rows n.. at a time, each x block loaded
// once for all of them, their chains overlapping; a row of K 576 had spent 40% of its time
// outside its blocks, which the rows now share: their scales converted in one pass (row j's at
// scales + j * groups) and one horizontal sum for the four.
#define BATCH1_ROWS 4

// The rows' sums from their accumulators (two a row) plus their offsets' dot products, each
// row's in the order row_sums_int4_i16 sums a row (the same bits at every batch size).
static inline void batch1_sums(__m256 acc[BATCH1_ROWS][2], const float* mins, const float* xsums,
                               int64_t groups, float sums[BATCH1_ROWS]) {
    __m256 total[BATCH1_ROWS];
    for (int j = 0; j < BATCH1_ROWS; j++) total[j] = _mm256_add_ps(acc[j][0], acc[j][1]);
    _mm_storeu_ps(sums, hsum4x8(total[0], total[1], total[2], total[3]));
    for (int j = 0; j < (mins ? BATCH1_ROWS : 0); j++)
        sums[j] += dot_floats(mins + j * groups, xsums, groups);
}

static void batch1_int4_i16(const int16_t* x16, const float* xscale, const float* xsums,
                            const quantized_weight* w, int64_t n, int64_t K, const float* scales,
                            const float* mins, float sums[BATCH1_ROWS]) {
    enum { R = BATCH1_ROWS };
    const int64_t group = w->group, groups = K / group, row_bytes = K / 2;
    const uint8_t* q = (const uint8_t*)w->values + n * row_bytes;
    const __m256i low4 = _mm256_set1_epi16(15);
    __m256 acc[R][2];
    for (int j = 0; j < R; j++) acc[j][0] = acc[j][1] = _mm256_setzero_ps();
    int64_t g_lo = 0, blocks_left = group == 32 ? 1 : group / 64;  // next_block_group's
    for (int64_t b = 0; b < K / 64; b++) {
        for (int j = 0; j < R; j++)
            _mm_prefetch((const char*)(q + (PREFETCH_ROWS + j) * row_bytes + b * 32),
                         _MM_HINT_T0);
        const __m256i* xr = (const __m256i*)(x16 + b * 64);
        const __m256i x0 = _mm256_loadu_si256(xr), x1 = _mm256_loadu_si256(xr + 1);
        const __m256i x2 = _mm256_loadu_si256(xr + 2), x3 = _mm256_loadu_si256(xr + 3);
        const float xs_lo = xscale[2 * b], xs_hi = xscale[2 * b + 1];
        const int64_t g_hi = g_lo + (group == 32);
        for (int j = 0; j < R; j++) {
            const uint8_t* qj = q + j * row_bytes + b * 32;
            const float* sj = scales + j * groups;
            const __m256i v0 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)qj));
            const __m256i v1 = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(qj + 16)));
            const __m256i p_lo =
                _mm256_add_epi32(_mm256_madd_epi16(_mm256_and_si256(v0, low4), x0),
                                 _mm256_madd_epi16(_mm256_and_si256(v1, low4), x1));
            const __m256i p_hi =
                _mm256_add_epi32(_mm256_madd_epi16(_mm256_srli_epi16(v0, 4), x2),
                                 _mm256_madd_epi16(_mm256_srli_epi16(v1, 4), x3));
            acc[j][0] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_lo),
                                        _mm256_set1_ps(sj[g_lo] * xs_lo), acc[j][0]);
            acc[j][1] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p_hi),
                                        _mm256_set1_ps(sj[g_hi] * xs_hi), acc[j][1]);
        }
        next_block_group(group, &g_lo, &blocks_left);
    }
    batch1_sums(acc, mins, xsums, groups, sums);
}

// 4-bit weight rows n0..n1 against one int16 x row, BATCH1_ROWS at a time (8-bit rows stream
// at the memory's rate one at a time: two at a time were 15-25% slower on Qwen3's shapes);
// returns the first row it left.
static int64_t batch1_rows(const int16_t* x16, const float* xscale, const float* xsums,
                           const quantized_weight* w, const void* bias, void* y, int64_t K,
                           int64_t n0, int64_t n1, int x_dtype, int out_f32, float* scales,
                           float* mins) {
    const int64_t groups = K / w->group, elem = w->scales_f32 ? 4 : 2;
    for (; n0 + BATCH1_ROWS <= n1; n0 += BATCH1_ROWS) {
        // consecutive rows' scales (and mins) are consecutive values
        const int64_t first = n0 * groups * elem, count = BATCH1_ROWS * groups;
        group_floats(w, (const char*)w->scales + first, 0, count, scales);
        if (w->mins) group_floats(w, (const char*)w->mins + first, 0, count, mins);
        float sums[BATCH1_ROWS];
        batch1_int4_i16(x16, xscale, xsums, w, n0, K, scales, w->mins ? mins : NULL, sums);
        for (int j = 0; j < BATCH1_ROWS; j++)
            store_out(y, n0 + j, sums[j], bias, n0 + j, x_dtype, out_f32);
    }
    return n0;
}

static inline FORM_INLINE void row_sums_i16(
    const int16_t* x16, const float* xscale, const float* xsums, const quantized_weight* w,
    int64_t n, int64_t K, const float* scales, const float* mins, float* sums, const int M) {
    if (w->bits == 8)
        row_sums_int8_i16(x16, xscale, xsums, w, n, K, scales, mins, sums, M);
    else
        row_sums_int4_i16(x16, xscale, xsums, w, n, K, scales, mins, sums, M);
}

// Weight rows n0..n0+15 (zeros past n1) dequantized into wt [K, AVX2_BLOCK]: column k's 16
// weights side by side. rows: AVX2_BLOCK * K floats of scratch for the rows as they dequantize.
static void dequant_block_transposed(const quantized_weight* w, int64_t n0, int64_t n1,
                                     int64_t K, float* scales, float* mins, float* rows,
                                     float* wt) {
    const int64_t groups = K / w->group;
    for (int64_t i = 0; i < AVX2_BLOCK; i++) {
        if (n0 + i >= n1) {
            memset(rows + i * K, 0, (size_t)K * sizeof(float));
            continue;
        }
        group_floats(w, w->scales, n0 + i, groups, scales);
        if (w->mins) group_floats(w, w->mins, n0 + i, groups, mins);
        dequant_row_avx2(w, n0 + i, K, scales, w->mins ? mins : NULL, rows + i * K);
    }
    for (int64_t k = 0; k < K; k += 8)
        for (int half = 0; half < AVX2_BLOCK; half += 8) {
            __m256 block[8];
            for (int i = 0; i < 8; i++) block[i] = _mm256_loadu_ps(rows + (half + i) * K + k);
            transpose8(block);
            for (int j = 0; j < 8; j++)
                _mm256_storeu_ps(wt + (k + j) * AVX2_BLOCK + half, block[j]);
        }
}

// A tile: sums[r][c] = x row r . weight row c of the transposed block wt [K, 16], for R x rows
// (a constant where inlined).
static inline FORM_INLINE void tile_sums(const float* xf, const float* wt,
                                                            int64_t K, float sums[][AVX2_BLOCK],
                                                            const int R) {
    __m256 acc[TILE_X][2];
    for (int r = 0; r < R; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < K; k++) {
        const __m256 w0 = _mm256_loadu_ps(wt + k * AVX2_BLOCK);
        const __m256 w1 = _mm256_loadu_ps(wt + k * AVX2_BLOCK + 8);
        for (int r = 0; r < R; r++) {
            const __m256 xv = _mm256_broadcast_ss(xf + r * K + k);
            acc[r][0] = _mm256_fmadd_ps(w0, xv, acc[r][0]);
            acc[r][1] = _mm256_fmadd_ps(w1, xv, acc[r][1]);
        }
    }
    for (int r = 0; r < R; r++) {
        _mm256_storeu_ps(sums[r], acc[r][0]);
        _mm256_storeu_ps(sums[r] + 8, acc[r][1]);
    }
}

MINISGL_INTERNAL void quantized_rows_avx2(const float* xf, const float* xscale,
                                          const float* xsums, const quantized_weight* w,
                                          const void* bias, void* y, int64_t M, int64_t N,
                                          int64_t K, int64_t n0, int64_t n1, int x_dtype,
                                          int out_f32, float* scratch) {
    const int64_t groups = K / w->group;
    float *scales = scratch, *mins = scales + padded(groups), *wrows = mins + padded(groups);
    const float* row_mins = w->mins ? mins : NULL;
    if (M == 1 && xscale && w->bits == 4)  // the rows left (fewer than 4) below
        n0 = batch1_rows((const int16_t*)xf, xscale, xsums, w, bias, y, K, n0, n1, x_dtype,
                         out_f32, wrows, wrows + BATCH1_ROWS * padded(groups));
    if (M <= AVX2_ROWS_MAX) {
        for (int64_t n = n0; n < n1; n++) {
            group_floats(w, w->scales, n, groups, scales);
            if (w->mins) group_floats(w, w->mins, n, groups, mins);
            for (int64_t m = 0; m < M; m += QROWS) {
                const float* xsums_m = xsums + m * groups;
                float sums[QROWS];
                if (xscale) {  // int16 x (avx2_x_int16)
                    const int16_t* xm = (const int16_t*)xf + m * K;
                    const float* xs = xscale + m * (K / 32);
                    switch (M - m) {
                        case 1:
                            row_sums_i16(xm, xs, xsums_m, w, n, K, scales, row_mins, sums, 1);
                            break;
                        case 2:
                            row_sums_i16(xm, xs, xsums_m, w, n, K, scales, row_mins, sums, 2);
                            break;
                        case 3:
                            row_sums_i16(xm, xs, xsums_m, w, n, K, scales, row_mins, sums, 3);
                            break;
                        default:
                            row_sums_i16(xm, xs, xsums_m, w, n, K, scales, row_mins, sums, 4);
                    }
                } else {
                    const float* xm = xf + m * K;
                    switch (M - m) {
                        case 1: row_sums(xm, xsums_m, w, n, K, scales, row_mins, sums, 1); break;
                        case 2: row_sums(xm, xsums_m, w, n, K, scales, row_mins, sums, 2); break;
                        case 3: row_sums(xm, xsums_m, w, n, K, scales, row_mins, sums, 3); break;
                        default: row_sums(xm, xsums_m, w, n, K, scales, row_mins, sums, 4);
                    }
                }
                for (int64_t r = m; r < M && r < m + QROWS; r++)
                    store_out(y, r * N + n, sums[r - m], bias, n, x_dtype, out_f32);
            }
        }
        return;
    }
    float* wt = wrows + AVX2_BLOCK * K;
    dequant_block_transposed(w, n0, n1, K, scales, mins, wrows, wt);
    avx2_block_rows(xf, wt, bias, y, M, N, K, n0, n1, x_dtype, out_f32);
}

MINISGL_INTERNAL void avx2_block_rows(const float* xf, const float* wt, const void* bias, void* y,
                                      int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1,
                                      int x_dtype, int out_f32) {
    for (int64_t m = 0; m < M; m += TILE_X) {
        float sums[TILE_X][AVX2_BLOCK];
        const int64_t rows = M - m < TILE_X ? M - m : TILE_X;
        switch (rows) {
            case 1: tile_sums(xf + m * K, wt, K, sums, 1); break;
            case 2: tile_sums(xf + m * K, wt, K, sums, 2); break;
            case 3: tile_sums(xf + m * K, wt, K, sums, 3); break;
            case 4: tile_sums(xf + m * K, wt, K, sums, 4); break;
            case 5: tile_sums(xf + m * K, wt, K, sums, 5); break;
            default: tile_sums(xf + m * K, wt, K, sums, 6);
        }
        for (int64_t r = 0; r < rows; r++)
            for (int64_t c = 0; c < n1 - n0; c++)
                store_out(y, (m + r) * N + n0 + c, sums[r][c], bias, n0 + c, x_dtype, out_f32);
    }
}
#endif
