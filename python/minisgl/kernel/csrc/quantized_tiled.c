#include "common.h"
#include "internal.h"
#include "simd.h"

// ------------------------------------------------------------------ tiled quantized matmul
// The quantized weight in the tile layout (layers/quant_tiles.py writes it) against int8
// activations, with AVX-512 VNNI's vpdpbusd: 64 products of unsigned 8-bit weights and signed
// 8-bit activations a step, summed exactly in int32 lanes. A tile is 16 weight rows, one per
// lane, so a step multiplies 16 rows by 4 columns and nothing is transposed at run time:
//   8 bits: [tiles][K/4][64] bytes, byte 4l+i of quad q = q[16t+l, 4q+i] + 128;
//   4 bits: [tiles][K/32][4][64] bytes, byte 4l+i of vector j of chunk c holds column
//           32c+4j+i of row 16t+l in its low nibble and column 32c+4j+16+i in its high one;
//   6 bits (8-bit integers within -32..31, +32; groups of 16 or more): [tiles][K/32][6][64],
//           vectors 0-3 the low 4
//           bits as 4 bits', vector 4 + h the top 2 bits of column 32c+16h+4j+i in bits 2j..2j+1
//           of byte 4l+i;
//   scales, mins: [tiles][groups][16], the 16 rows' values per group (float16 or float32).
// The activations are rounded to int8 per 32 columns (llama.cpp's Q8_0: scale = max|x| / 127,
// nearest even; for a precise weight their remainders too, a second pass), so within
// one unit of columns (32, or 16 where groups are 16) a row's sum is exact in integers:
// y = sum_units scale_w * scale_x * sum(q * xq) + sum_groups min * sum(x), the offsets' x sums
// taken from x itself. 8-bit values carry +128 (vpdpbusd's unsigned side): each unit's integer
// sum starts at -128 * sum(xq) (6 bits: -32 * sum(xq)). Float32 activations are multiplied
// exactly instead, against each tile dequantized to float32.

#define TILE TILE_ROWS     // weight rows a tile holds, one per int32 lane
// Activation rows one pass over two tiles multiplies: 6 (24 sums in registers) ran 1.04-1.10x
// as fast as 4 at 12-128 rows (Zen 4), each weight vector's unpacking shared by more rows.
#define TILE_MR 6
#define ONE_TILE_MR 8  // the same over one tile
#define PRECISE_MR 3   // over two tiles with x to 16 bits (two sums a tile and row)
// Rows from ONE_TILE_MIN_ROWS up to ONE_TILE_MAX_ROWS: each task takes one tile (ONE_TILE_MR rows
// a pass), not a pair: measured on Zen 4, 1.07-1.36x at 5-8 rows against passes of 4 rows over
// pairs for 8-, 6- and 4-bit tiles, and 1.1-1.3x against one pass of 5-6 rows over pairs. At
// 9-16 rows the two forms measured alike (8 bits with one scale a row) or the pair's x
// broadcasts, each feeding two tiles, won (4 bits: its products are compute-bound there).
#define ONE_TILE_MIN_ROWS 5
#define ONE_TILE_MAX_ROWS 8
// Rows every task goes through before any goes on to the next ones: the tiles meet a block of
// x's int8 rows while it sits in L2 (512 x K bytes), where a long prefill's whole x streamed
// from L3 for each pair of tiles (Zen 4, the default model's layer, block sizes alternated in
// one process: 2,048 rows 3% faster, 4,096 rows 6%; 256 and 768 gained less).
#define ROW_BLOCK 512
#define PREFETCH_UNITS 8  // how far ahead a tile's values are fetched

#ifdef HAVE_AVX512_VNNI
// The activations as the tiled kernel takes them (per row m).
typedef struct {
    int8_t* xq;    // [M, K]: x rounded to int8, each 32 columns by its own scale
    int8_t* xlo;   // [M, K]: precise: what xq left, in 256ths of its step; else NULL
    float* xd;     // [M, units]: each unit's x scale (precise: its 256th)
    int32_t* neg;  // [M, units]: -128 * the unit's sum of x's integers (8-bit weights' +128)
    float* xsum;   // [M, groups]: each group's sum of x (the offsets' term), or NULL
} tiled_x;

// Columns k..k+15 of a row (as t = x / step) rounded: into xq, and (xlo given) the remainder
// in 256ths of a step; the integers as stored (x / step in 256ths where precise), to be summed.
static inline __m512i round_half_block(__m512 t, int8_t* xq, int8_t* xlo) {
    const __m512i q = _mm512_cvtps_epi32(t);
    _mm_storeu_si128((__m128i*)xq, _mm512_cvtsepi32_epi8(q));
    if (!xlo) return q;
    const __m512 rest = _mm512_mul_ps(_mm512_sub_ps(t, _mm512_cvtepi32_ps(q)), _mm512_set1_ps(256));
    const __m512i q_lo = _mm512_cvtps_epi32(rest);  // |rest| <= 128: 128 saturates to 127
    _mm_storeu_si128((__m128i*)xlo, _mm512_cvtsepi32_epi8(q_lo));
    const __m512i stored = _mm512_min_epi32(q_lo, _mm512_set1_epi32(127));
    return _mm512_add_epi32(_mm512_slli_epi32(q, 8), stored);
}

// Row x [K] (bf16) rounded to int8 per 32 columns (and, xlo given, its remainders), with its
// unit scales and sums.
static void quantize_x_row(const bf16_t* x, int64_t K, int64_t unit, int64_t group, int8_t* xq,
                           int8_t* xlo, float* xd, int32_t* neg, float* xsum) {
    if (xsum) memset(xsum, 0, (size_t)(K / group) * sizeof(float));
    for (int64_t k = 0; k < K; k += 32) {
        const __m512 lo = bf16x16_to_f32(_mm256_loadu_si256((const __m256i*)(x + k)));
        const __m512 hi = bf16x16_to_f32(_mm256_loadu_si256((const __m256i*)(x + k + 16)));
        const __m512 larger = _mm512_max_ps(_mm512_abs_ps(lo), _mm512_abs_ps(hi));
        const float amax = _mm512_reduce_max_ps(larger);
        const float d = amax / 127.0f, id = d > 0.0f ? 1.0f / d : 0.0f;
        const __m512i ints_lo = round_half_block(_mm512_mul_ps(lo, _mm512_set1_ps(id)), xq + k,
                                                 xlo ? xlo + k : NULL);
        const __m512i ints_hi = round_half_block(_mm512_mul_ps(hi, _mm512_set1_ps(id)),
                                                 xq + k + 16, xlo ? xlo + k + 16 : NULL);
        const int64_t u = k / unit;
        xd[u] = xlo ? d / 256.0f : d;
        if (unit == 16) xd[u + 1] = xd[u];
        if (neg && unit == 32) {
            neg[u] = -128 * _mm512_reduce_add_epi32(_mm512_add_epi32(ints_lo, ints_hi));
        } else if (neg) {
            neg[u] = -128 * _mm512_reduce_add_epi32(ints_lo);
            neg[u + 1] = -128 * _mm512_reduce_add_epi32(ints_hi);
        }
        if (xsum) {
            xsum[k / group] += _mm512_reduce_add_ps(lo);
            xsum[(k + 16) / group] += _mm512_reduce_add_ps(hi);
        }
    }
}

// x's 4 bytes at p as the 16 lanes of vpdpbusd's signed operand.
static inline __m512i quad_x(const int8_t* p) {
    int32_t v;
    memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// Rows m0..m0+MR-1 of y for the 16 weight rows of tiles t..t+TP-1 (MR, TP and PRECISE
// constants where inlined). Each x broadcast feeds TP tiles' products (one a product cost as
// much as the product itself). Precise: a second sum per tile, of the remainders, the first
// shifted 8 bits at the end; the +128's correction goes to the unshifted one.
static inline FORM_INLINE void tile_rows_impl(
    const quantized_weight* w, const tiled_x* xs, const bf16_t* bias, void* y, int64_t N,
    int64_t K, int64_t t, int64_t m0, const uint8_t* next, int out_f32, const int MR,
    const int TP, const int PRECISE, const int BITS, const int QUADS) {
    const int64_t group = w->group, groups = K / group, unit = 4 * QUADS;
    const int64_t units = K / unit, units_per_group = group / unit;
    const int64_t bytes = tile_bytes(BITS, K);
    const uint8_t* values = (const uint8_t*)w->values + t * bytes;
    // What the unit loop fetches ahead: these tiles PREFETCH_UNITS units on, or (`next`: the
    // second pass, which finds these tiles cached) the next tiles' same unit.
    const uint8_t* fetch_from = next ? next : values + PREFETCH_UNITS * QUADS * BITS * 8;
    const __m512i nibble = _mm512_set1_epi8(15);
    __m512 acc[2][ONE_TILE_MR];
    for (int p = 0; p < TP; p++)
        for (int r = 0; r < MR; r++) acc[p][r] = _mm512_setzero_ps();
    // Scales and mins are fetched as far ahead as the values: unfetched, their misses took
    // a tenth of a batch of 1's time.
    const int64_t groups_ahead = (PREFETCH_UNITS * unit + group - 1) / group;
    for (int64_t g = 0; g < groups; g++) {
        __m512 scale[2];
        for (int p = 0; p < TP; p++) {
            const int64_t index = (t + p) * groups + g;
            if (g + groups_ahead < groups) {
                const int64_t ahead = index + groups_ahead;
                __builtin_prefetch(tile_group_at(w->scales, w->scales_f32, ahead));
                if (w->mins) __builtin_prefetch(tile_group_at(w->mins, w->scales_f32, ahead));
            }
            scale[p] = tile_floats(w->scales, w->scales_f32, index);
        }
        for (int64_t u = g * units_per_group; u < (g + 1) * units_per_group; u++) {
            const int64_t at = m0 * K + u * unit;  // row m0's first column of the unit
            const int8_t *xu = xs->xq + at, *xl = PRECISE ? xs->xlo + at : NULL;
            // Per tile: the hardware's streams alone left a batch of 1 at ~60% of the memory's
            // bandwidth. The second pass fetches the next tiles instead, so that the memory
            // streams while the passes after the first compute (as many prefetches a unit:
            // more of them cost a 4-bit weight's products 5% in cache).
            for (int p = 0; p < TP; p++) {
                const uint8_t* ahead = fetch_from + p * bytes + u * QUADS * BITS * 8;
                for (int line = 0; line < QUADS * BITS * 8; line += 64)
                    _mm_prefetch((const char*)(ahead + line), _MM_HINT_T0);
            }
            __m512i sums[2][ONE_TILE_MR], rests[2][ONE_TILE_MR];
            for (int r = 0; r < MR; r++) {
                // -128 * x's sum: 8 bits' offset; 6 bits' is +32, a quarter of it.
                const int32_t offset = xs->neg ? xs->neg[(m0 + r) * units + u] : 0;
                const __m512i neg = _mm512_set1_epi32(BITS == 6 ? offset / 4 : offset);
                for (int p = 0; p < TP; p++) {
                    sums[p][r] = PRECISE ? _mm512_setzero_si512() : neg;
                    if (PRECISE) rests[p][r] = neg;
                }
            }
            // Quad q of the unit (columns 4q..4q+3): its weights per tile, then every row.
#pragma GCC unroll 8
            for (int q = 0; q < QUADS; q++) {
                __m512i wq[2];
                for (int p = 0; p < TP; p++) {
                    const uint8_t* tile = values + p * bytes;
                    if (BITS == 8) {
                        wq[p] = _mm512_loadu_si512(tile + (u * unit / 4 + q) * 64);
                    } else {  // vector q % 4 of the unit's chunk: low nibbles, then high
                        // (16-column units, 6 bits only: unit u is half u % 2 of chunk u / 2)
                        const int64_t half = QUADS == 8 ? q / 4 : u % 2;
                        const uint8_t* chunk = tile + (QUADS == 8 ? u : u / 2) * 64 * BITS;
                        const __m512i v = _mm512_loadu_si512(chunk + (q % 4) * 64);
                        wq[p] = half == 0 ? _mm512_and_si512(v, nibble)
                                          : _mm512_and_si512(_mm512_srli_epi16(v, 4), nibble);
                        if (BITS == 6)  // the top 2 bits: vector 4 + half, crumb q % 4
                            wq[p] = six_bits(wq[p], _mm512_loadu_si512(chunk + 256 + half * 64),
                                             q % 4);
                    }
                }
                for (int r = 0; r < MR; r++) {
                    const __m512i xv = quad_x(xu + r * K + 4 * q);
                    for (int p = 0; p < TP; p++)
                        sums[p][r] = _mm512_dpbusd_epi32(sums[p][r], wq[p], xv);
                    if (PRECISE) {
                        const __m512i lv = quad_x(xl + r * K + 4 * q);
                        for (int p = 0; p < TP; p++)
                            rests[p][r] = _mm512_dpbusd_epi32(rests[p][r], wq[p], lv);
                    }
                }
            }
            for (int r = 0; r < MR; r++) {
                const __m512 xd = _mm512_set1_ps(xs->xd[(m0 + r) * units + u]);
                for (int p = 0; p < TP; p++) {
                    const __m512i total =
                        PRECISE ? _mm512_add_epi32(_mm512_slli_epi32(sums[p][r], 8), rests[p][r])
                                : sums[p][r];
                    acc[p][r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(total),
                                                _mm512_mul_ps(scale[p], xd), acc[p][r]);
                }
            }
        }
        if (w->mins) {
            for (int p = 0; p < TP; p++) {
                const __m512 mins = tile_floats(w->mins, w->scales_f32, (t + p) * groups + g);
                for (int r = 0; r < MR; r++)
                    acc[p][r] = _mm512_fmadd_ps(
                        mins, _mm512_set1_ps(xs->xsum[(m0 + r) * groups + g]), acc[p][r]);
            }
        }
    }
    for (int p = 0; p < TP; p++) {
        const int64_t n0 = (t + p) * TILE, count = N - n0 < TILE ? N - n0 : TILE;
        const __mmask16 mask = count == TILE ? (__mmask16)0xffff : (__mmask16)((1u << count) - 1u);
        const __m512 b = bias ? bf16x16_to_f32(_mm256_maskz_loadu_epi16(mask, bias + n0))
                              : _mm512_setzero_ps();
        for (int r = 0; r < MR; r++) {
            const __m512 v = _mm512_add_ps(acc[p][r], b);
            const int64_t index = (m0 + r) * N + n0;
            if (out_f32) {
                _mm512_mask_storeu_ps((float*)y + index, mask, v);
            } else {
                const __m512i top = _mm512_srli_epi32(_mm512_castps_si512(round_bf16_512(v)), 16);
                _mm256_mask_storeu_epi16((bf16_t*)y + index, mask, _mm512_cvtepi32_epi16(top));
            }
        }
    }
}

// Rows m_begin..m_end-1 of y for tiles t..t+tiles-1 (1 or 2): passes of TILE_MR rows (one
// tile, from ONE_TILE_MIN_ROWS rows: ONE_TILE_MR; precise: PRECISE_MR, its sums twice the
// registers).
// Each (rows, tiles, precision, bits, unit) is its own compiled form: the unit's quads
// unrolled, the sums in registers.
static void tile_rows(const quantized_weight* w, const tiled_x* xs, const bf16_t* bias, void* y,
                      int64_t m_begin, int64_t m_end, int64_t N, int64_t K, int64_t t,
                      int64_t tiles, int out_f32) {
    const int64_t M = m_end - m_begin;
    const int precise = xs->xlo != NULL;
    const int64_t pass = precise                                   ? PRECISE_MR
                         : tiles == 1 && M >= ONE_TILE_MIN_ROWS ? ONE_TILE_MR
                                                                : TILE_MR;
    const int wide = unit_cols(w->group) == 32;
    const int form = w->bits == 4 ? 0 : w->bits == 6 ? 3 + !wide : wide ? 1 : 2;
    // As many tiles after these (a thread's pairs are consecutive), for the second pass to
    // fetch; none where the weight has fewer left.
    const int64_t all_tiles = (N + TILE - 1) / TILE;
    const uint8_t* following = t + 2 * tiles <= all_tiles ? (const uint8_t*)w->values +
                                                                (t + tiles) * tile_bytes(w->bits, K)
                                                          : NULL;
    for (int64_t m0 = m_begin; m0 < m_end; m0 += pass) {
        const int64_t rows = m_end - m0 < pass ? m_end - m0 : pass;
        const uint8_t* next = m0 == m_begin + pass ? following : NULL;
        switch ((((rows * 2 + (tiles - 1)) * 2 + precise) * 5) + form) {
#define TILE_FORM(r, tp, exact, f, bits, quads)                                                \
    case (((r * 2 + tp - 1) * 2 + exact) * 5) + f:                                             \
        tile_rows_impl(w, xs, bias, y, N, K, t, m0, next, out_f32, r, tp, exact, bits, quads); \
        break;
#define TILE_CASE(r, tp, exact)                                       \
    TILE_FORM(r, tp, exact, 0, 4, 8) TILE_FORM(r, tp, exact, 1, 8, 8) \
    TILE_FORM(r, tp, exact, 2, 8, 4) TILE_FORM(r, tp, exact, 3, 6, 8) \
    TILE_FORM(r, tp, exact, 4, 6, 4)
#define TILE_CASES(r, exact) TILE_CASE(r, 1, exact) TILE_CASE(r, 2, exact)
            TILE_CASES(1, 0) TILE_CASES(2, 0) TILE_CASES(3, 0) TILE_CASES(4, 0)
            TILE_CASES(5, 0) TILE_CASES(6, 0) TILE_CASE(7, 1, 0) TILE_CASE(8, 1, 0)
            TILE_CASES(1, 1) TILE_CASES(2, 1) TILE_CASES(3, 1)
#undef TILE_CASES
#undef TILE_CASE
#undef TILE_FORM
        }
    }
}

// Bytes 16p..16p+15 of v (the extract takes a constant).
static inline __m128i quarter(__m512i v, int p) {
    switch (p) {
        case 0: return _mm512_extracti32x4_epi32(v, 0);
        case 1: return _mm512_extracti32x4_epi32(v, 1);
        case 2: return _mm512_extracti32x4_epi32(v, 2);
        default: return _mm512_extracti32x4_epi32(v, 3);
    }
}

// A tile's scale (or min) of row lane l, group g (index (t * groups + g) * TILE + l).
static inline float tile_float(const void* src, int64_t scales_f32, int64_t at) {
    return scales_f32 ? ((const float*)src)[at] : half_to_f32(((const uint16_t*)src)[at]);
}

// tiled_row for a 6-bit tile: each 32 columns' integers put together from the lane's 4 bytes
// of the chunk's 6 vectors, then scaled 16 at a time (an embedding lookup's rows; float32 x).
static void tiled_row_6(const quantized_weight* w, int64_t n, int64_t K, void* out, int bf16_out) {
    const int64_t t = n / TILE, lane = n % TILE, groups = K / w->group;
    const uint8_t* tile = (const uint8_t*)w->values + t * tile_bytes(6, K);
    for (int64_t c = 0; c < K / 32; c++) {
        const uint8_t* chunk = tile + c * 384 + 4 * lane;
        int8_t ints[32];
        for (int half = 0; half < 2; half++)
            for (int j = 0; j < 4; j++)
                for (int i = 0; i < 4; i++) {
                    const int low = (chunk[64 * j + i] >> (4 * half)) & 15;
                    const int top = (chunk[256 + 64 * half + i] >> (2 * j)) & 3;
                    ints[16 * half + 4 * j + i] = (int8_t)(low + 16 * top - 32);
                }
        for (int half = 0; half < 2; half++) {
            const int64_t col = 32 * c + 16 * half;
            const int64_t at = (t * groups + col / w->group) * TILE + lane;
            const __m512 scale = _mm512_set1_ps(tile_float(w->scales, w->scales_f32, at));
            const __m512 offset =
                _mm512_set1_ps(w->mins ? tile_float(w->mins, w->scales_f32, at) : 0.0f);
            const __m128i bytes = _mm_loadu_si128((const __m128i*)(ints + 16 * half));
            const __m512 v =
                _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(bytes)), scale, offset);
            if (bf16_out)
                store16(out, col, 1, round_bf16_512(v));
            else
                _mm512_storeu_ps((float*)out + col, v);
        }
    }
}

// Row n of a tiled weight dequantized (q * scale + min in float32, one rounding) into out [K]:
// float32, or rounded to bf16 where bf16_out.
static void tiled_row(const quantized_weight* w, int64_t n, int64_t K, void* out, int bf16_out) {
    if (w->bits == 6) {
        tiled_row_6(w, n, K, out, bf16_out);
        return;
    }
    const int64_t t = n / TILE, lane = n % TILE, groups = K / w->group;
    const uint8_t* values = (const uint8_t*)w->values + t * tile_bytes(w->bits, K);
    // Dword i of a gather: 4 columns of row n (8 bits: quad i; 4 bits: vector i % 4 of chunk
    // i / 4, whose low nibbles are 4 columns and high nibbles 4 columns 16 further on).
    const __m512i quad = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512i index = _mm512_add_epi32(_mm512_mullo_epi32(quad, _mm512_set1_epi32(64)),
                                           _mm512_set1_epi32((int)(4 * lane)));
    float ints[64];
    for (int64_t k = 0; k < K; k += 64) {
        // 16-column pieces this step: 4, or 2 in an 8-bit weight's last 32 columns (K % 64 = 32;
        // 4-bit weights are whole 64-column blocks).
        const int pieces = K - k >= 64 ? 4 : 2;
        if (w->bits == 8) {
            __m128i quarters[4];
            if (pieces == 4) {
                const __m512i v = _mm512_i32gather_epi32(index, values + k * 16, 1);
                for (int p = 0; p < 4; p++) quarters[p] = quarter(v, p);
            } else {  // quads 0..7 only: the 8 dwords of the tail
                const __m256i v = _mm256_i32gather_epi32((const int*)(values + k * 16),
                                                         _mm512_castsi512_si256(index), 1);
                quarters[0] = _mm256_castsi256_si128(v);
                quarters[1] = _mm256_extracti128_si256(v, 1);
            }
            for (int p = 0; p < pieces; p++) {
                const __m512i q = _mm512_sub_epi32(_mm512_cvtepu8_epi32(quarters[p]),
                                                   _mm512_set1_epi32(128));
                _mm512_storeu_ps(ints + 16 * p, _mm512_cvtepi32_ps(q));
            }
        } else {  // two chunks: dwords 0..3 of chunk k / 32, 4..7 of the next
            const __m256i v = _mm256_i32gather_epi32((const int*)(values + k * 8),
                                                     _mm512_castsi512_si256(index), 1);
            const __m512i bytes = _mm512_cvtepu8_epi16(v);
            const __m512i lo = _mm512_and_si512(bytes, _mm512_set1_epi16(15));
            const __m512i hi = _mm512_srli_epi16(bytes, 4);
            // lo/hi words 0..15: chunk 0's columns 0..15 / 16..31; words 16..31: chunk 1's.
            const __m256i parts[4] = {_mm512_castsi512_si256(lo), _mm512_castsi512_si256(hi),
                                      _mm512_extracti64x4_epi64(lo, 1),
                                      _mm512_extracti64x4_epi64(hi, 1)};
            for (int p = 0; p < 4; p++)
                _mm512_storeu_ps(ints + 16 * p,
                                 _mm512_cvtepi32_ps(_mm512_cvtepu16_epi32(parts[p])));
        }
        for (int p = 0; p < pieces; p++) {
            const int64_t col = k + 16 * p, g = col / w->group;
            const int64_t at = (t * groups + g) * TILE + lane;
            const float scale = tile_float(w->scales, w->scales_f32, at);
            const float offset = w->mins ? tile_float(w->mins, w->scales_f32, at) : 0.0f;
            const __m512 v = _mm512_fmadd_ps(_mm512_loadu_ps(ints + 16 * p), _mm512_set1_ps(scale),
                                             _mm512_set1_ps(offset));
            if (bf16_out)
                store16(out, col, 1, round_bf16_512(v));
            else
                _mm512_storeu_ps((float*)out + col, v);
        }
    }
}

// Tile t's rows (those below N) dequantized into out [N, K] (float32, or bf16 where bf16_out):
// each 64 columns' 16 quads transposed in registers to 16 rows of 64 bytes.
static void tiled_block(const quantized_weight* w, int64_t t, int64_t N, int64_t K, void* out,
                        int bf16_out) {
    const int64_t groups = K / w->group, n0 = t * TILE, count = N - n0 < TILE ? N - n0 : TILE;
    if (w->bits == 6) {  // row by row (a prefill's output head, with prompt logprobs)
        const size_t elem = bf16_out ? 2 : 4;
        for (int64_t l = 0; l < count; l++)
            tiled_row(w, n0 + l, K, (char*)out + (size_t)((n0 + l) * K) * elem, bf16_out);
        return;
    }
    const uint8_t* values = (const uint8_t*)w->values + t * tile_bytes(w->bits, K);
    float scales[TILE], mins[TILE];
    for (int64_t k = 0; k < K; k += 64) {
        // 16-column pieces: 2 in an 8-bit weight's last 32 columns (8 quads, the rest zeros).
        const int pieces = K - k >= 64 ? 4 : 2;
        __m512i rows[16];  // quad q of the 64 columns, then (transposed) row l of them
        if (w->bits == 8) {
            for (int q = 0; q < 16; q++)
                rows[q] = q < 4 * pieces ? _mm512_loadu_si512(values + k * 16 + 64 * q)
                                         : _mm512_setzero_si512();
        } else {
            for (int c = 0; c < 2; c++)
                for (int j = 0; j < 4; j++) {
                    const __m512i v = _mm512_loadu_si512(values + k * 8 + 256 * c + 64 * j);
                    rows[8 * c + j] = _mm512_and_si512(v, _mm512_set1_epi8(15));
                    rows[8 * c + 4 + j] =
                        _mm512_and_si512(_mm512_srli_epi16(v, 4), _mm512_set1_epi8(15));
                }
        }
        transpose16(rows);
        for (int p = 0; p < pieces; p++) {
            const int64_t col = k + 16 * p, at = (t * groups + col / w->group) * TILE;
            _mm512_storeu_ps(scales, tile_floats(w->scales, w->scales_f32, at / TILE));
            if (w->mins) _mm512_storeu_ps(mins, tile_floats(w->mins, w->scales_f32, at / TILE));
            for (int64_t l = 0; l < count; l++) {
                __m512i ints = _mm512_cvtepu8_epi32(quarter(rows[l], p));
                if (w->bits == 8) ints = _mm512_sub_epi32(ints, _mm512_set1_epi32(128));
                const __m512 offset = _mm512_set1_ps(w->mins ? mins[l] : 0.0f);
                const __m512 v =
                    _mm512_fmadd_ps(_mm512_cvtepi32_ps(ints), _mm512_set1_ps(scales[l]), offset);
                const int64_t index = (n0 + l) * K + col;
                if (bf16_out)
                    store16(out, index, 1, round_bf16_512(v));
                else
                    _mm512_storeu_ps((float*)out + index, v);
            }
        }
    }
}

// Float32 activations, exactly: each tile's 16 rows dequantized to float32 (scratch [16 * K]),
// then every x row's 16 dot products in float32.
static void tile_rows_f32(const quantized_weight* w, const float* x, const float* bias, float* y,
                          int64_t M, int64_t N, int64_t K, int64_t t, float* scratch) {
    const int64_t n0 = t * TILE, count = N - n0 < TILE ? N - n0 : TILE;
    for (int64_t r = 0; r < count; r++) tiled_row(w, n0 + r, K, scratch + r * K, 0);
    for (int64_t m = 0; m < M; m++)
        for (int64_t r = 0; r < count; r++) {
            __m512 acc = _mm512_setzero_ps();
            for (int64_t k = 0; k < K; k += 16)
                acc = _mm512_fmadd_ps(_mm512_loadu_ps(x + m * K + k),
                                      _mm512_loadu_ps(scratch + r * K + k), acc);
            y[m * N + n0 + r] = _mm512_reduce_add_ps(acc) + (bias ? bias[n0 + r] : 0.0f);
        }
}

int quantized_tiled_linear(const void* x, const quantized_weight* w, const void* bias, void* y,
                           int64_t M, int64_t N, int64_t K, int path, int out_f32,
                           int nthreads) {
    if (path == QPATH_TILED_W8A8 || path == QPATH_TILED_W8A8_VNNI)
        return quantized_w8a8_linear((const bf16_t*)x, w, (const bf16_t*)bias, y, M, N, K,
                                     out_f32 ? EPILOGUE_F32 : EPILOGUE_BF16,
                                     path == QPATH_TILED_W8A8, nthreads);
#ifdef HAVE_QUANTIZED_AMX
    if (path == QPATH_TILED_AMX)
        return quantized_amx_linear((const bf16_t*)x, w, (const bf16_t*)bias, y, M, N, K,
                                    out_f32 ? EPILOGUE_F32 : EPILOGUE_BF16, nthreads);
#endif
    const int x_dtype = path == QPATH_TILED_F32 ? 0 : 1;
    const int64_t group = w->group, groups = K / group, unit = unit_cols(group);
    const int64_t units = K / unit, tiles = (N + TILE - 1) / TILE;
    // x's int8 rows (and remainders), unit scales, unit sums and group sums; or (float32 x) a
    // tile per thread.
    const int precise = path == QPATH_TILED_PRECISE;
    const int64_t per_task = !precise && M >= ONE_TILE_MIN_ROWS && M <= ONE_TILE_MAX_ROWS ? 1 : 2;
    const int64_t xq_floats = (M * K + 3) / 4, unit_floats = M * units, sum_floats = M * groups;
    const int64_t total = x_dtype == 1
                              ? (1 + precise) * xq_floats + 2 * unit_floats + sum_floats
                              : (int64_t)nthreads * TILE * K;
    float* buffer = kernel_alloc((size_t)total * sizeof(float));
    if (!buffer) return MINISGL_ERR_NOMEM;
    if (x_dtype == 0) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t t = 0; t < tiles; t++)
            tile_rows_f32(w, (const float*)x, (const float*)bias, (float*)y, M, N, K, t,
                          buffer + (int64_t)omp_get_thread_num() * TILE * K);
        free(buffer);
        return MINISGL_OK;
    }
    float* floats = buffer + (1 + precise) * xq_floats;
    tiled_x xs = {
        .xq = (int8_t*)buffer,
        .xlo = precise ? (int8_t*)(buffer + xq_floats) : NULL,
        .xd = floats,
        .neg = w->bits != 4 ? (int32_t*)(floats + unit_floats) : NULL,
        .xsum = w->mins ? floats + 2 * unit_floats : NULL,
    };
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++)
            quantize_x_row((const bf16_t*)x + m * K, K, unit, group, xs.xq + m * K,
                           precise ? xs.xlo + m * K : NULL, xs.xd + m * units,
                           xs.neg ? xs.neg + m * units : NULL,
                           xs.xsum ? xs.xsum + m * groups : NULL);
        for (int64_t m_begin = 0; m_begin < M; m_begin += ROW_BLOCK) {
            const int64_t m_end = M - m_begin < ROW_BLOCK ? M : m_begin + ROW_BLOCK;
#pragma omp for schedule(static)
            for (int64_t task = 0; task < (tiles + per_task - 1) / per_task; task++)
                tile_rows(w, &xs, (const bf16_t*)bias, y, m_begin, m_end, N, K, per_task * task,
                          tiles - per_task * task < per_task ? 1 : per_task, out_f32);
        }
    }
    free(buffer);
    return MINISGL_OK;
}

int quantized_tiled_rows(const quantized_weight* w, const int64_t* ids, void* out, int64_t count,
                         int64_t K, int dtype, int nthreads) {
    const size_t elem = dtype == 0 ? 4 : 2;
    int64_t in_order = 0;  // every row, in order: tile by tile (a prefill's whole weight)
    while (in_order < count && ids[in_order] == in_order) in_order++;
    if (in_order == count) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t t = 0; t < (count + TILE - 1) / TILE; t++)
            tiled_block(w, t, count, K, out, dtype == 1);
        return MINISGL_OK;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (count * K >= (1 << 16))
    for (int64_t i = 0; i < count; i++)
        tiled_row(w, ids[i], K, (char*)out + (size_t)(i * K) * elem, dtype == 1);
    return MINISGL_OK;
}
#endif
