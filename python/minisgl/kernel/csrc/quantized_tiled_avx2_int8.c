#include "common.h"
#include "internal.h"

// ------------------------------------------------- tiled quantized matmul, AVX2, int8 x
// The AVX2 tile layout's one-pass form for 4- and 6-bit weights (quantized_tiled_avx2.c has the
// 16-bit one): bf16 x rounded to int8 per 32 columns exactly as the VNNI kernels round it
// (llama.cpp's Q8_0: scale max|x| / 127, nearest even), meeting the weight's unsigned integers
// in vpmaddubsw: 32 products an instruction, where vpmaddwd takes 16, and no pair reordering.
// The products' pairs are summed in int16 lanes, exactly: 4-bit integers (0..15) times |x| <=
// 127 keep a whole unit's 8 quads within int16 (8 * 2 * 15 * 127 < 2^15), 6-bit ones (0..63,
// stored +32) two quads; vpmaddwd by ones then widens them to int32. A unit's int32 sum is scaled
// once for 8 weight rows, as the 16-bit form's. A row's rounding is its own, so its output is the
// same at every row count, and its integers are the VNNI kernels' (tiled-int8).

#ifdef HAVE_AVX2_FMA
#define I8_PREFETCH_UNITS 8  // how far ahead a tile's values are fetched

// x as the int8 kernel takes it (rows m: M of them).
typedef struct {
    const int8_t* xq;    // [M, K]: x rounded, each 32 columns by its own scale
    const float* xd;     // [M, K / 32]: each 32 columns' scale
    const int32_t* neg;  // [M, units]: -32 * the unit's integer sum (6 bits' +32), or NULL
    const float* xsum;   // [M, groups]: x's group sums (the mins' term), or NULL
} tiled_x8;

// x's 4 bytes at p, broadcast to every lane.
static inline __m256i quad_x8(const int8_t* p) {
    return _mm256_castps_si256(_mm256_broadcast_ss((const float*)p));
}

// The 8 rows' integers (one a byte, 0..15 or 0..63) of quad vector v of a chunk: nibble half hh
// (0: columns 4j.., 1: 16 + 4j..), for 6 bits with crumb j of tops (the half's top-bits vector)
// as bits 4..5.
static inline __m256i tile_bytes_at(__m256i v, __m256i tops, int hh, int j, const int BITS) {
    const __m256i nibble = _mm256_set1_epi8(0x0F);
    const __m256i low = _mm256_and_si256(hh ? _mm256_srli_epi16(v, 4) : v, nibble);
    if (BITS == 4) return low;
    const __m256i top = j == 0   ? _mm256_slli_epi16(tops, 4)
                        : j == 1 ? _mm256_slli_epi16(tops, 2)
                        : j == 2 ? tops
                                 : _mm256_srli_epi16(tops, 2);
    return _mm256_or_si256(low, _mm256_and_si256(top, _mm256_set1_epi8(0x30)));
}

// Rows m0..m0+R-1 of y for tile t (R, BITS, QUADS constants where inlined), both halves of the
// tile at once: each x broadcast feeds both halves' products.
static inline FORM_INLINE void tile_rows_i8_impl(const quantized_weight* w, const tiled_x8* xs,
                                                 const void* bias, void* y, int64_t N, int64_t K,
                                                 int64_t t, int64_t m0, int out_f32, const int R,
                                                 const int BITS, const int QUADS) {
    const int64_t group = w->group, groups = K / group, unit = 4 * QUADS;
    const int64_t units = K / unit, units_per_group = group / unit, xblocks = K / 32;
    const uint8_t* tile = (const uint8_t*)w->values + t * tile_bytes(BITS, K);
    const int8_t* xq = xs->xq + m0 * K;
    const float* xd = xs->xd + m0 * xblocks;
    const __m256i ones = _mm256_set1_epi16(1);
    const int64_t groups_ahead = (I8_PREFETCH_UNITS * unit + group - 1) / group;
    // The float sums stay in memory, loaded and stored once a unit: they do not fit the
    // registers beside 4 rows' int16 sums, and gcc's own spills kept two copies of each.
    float acc_at[2][AVX2_TILE_MR][8] __attribute__((aligned(32))) = {{{0}}};
    __m256 scale[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t u = 0, g = 0, in_group = 0; u < units; u++) {
        if (in_group == 0) group_scales(scale, w, t, g, groups, groups_ahead, m0);
        // The unit's chunk (a 16-column unit: nibble half u % 2 of it).
        const int64_t chunk = QUADS == 8 ? u : u / 2;
        const uint8_t* at = tile + chunk * 64 * BITS;
        const int8_t* xc = xq + chunk * 32;  // row m0's column 0 of the chunk
        prefetch_unit(tile, u, I8_PREFETCH_UNITS, unit * BITS * 2, m0);
        __m256i sums[2][AVX2_TILE_MR], pairs[2][AVX2_TILE_MR];
        for (int r = 0; r < R; r++) {
            const __m256i start = BITS == 6 ? _mm256_set1_epi32(xs->neg[(m0 + r) * units + u])
                                            : _mm256_setzero_si256();
            for (int p = 0; p < 2; p++) sums[p][r] = start, pairs[p][r] = _mm256_setzero_si256();
        }
        // A 16-column unit is one nibble half of its chunk (u % 2), a 32-column one both.
        const int first_half = QUADS == 4 ? (int)(u % 2) : 0, halves = QUADS == 4 ? 1 : 2;
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) {
            __m256i v[2];
            for (int p = 0; p < 2; p++)
                v[p] = _mm256_loadu_si256((const __m256i*)(at + j * 64 + p * 32));
#pragma GCC unroll 2
            for (int hh = first_half; hh < first_half + halves; hh++) {
                __m256i ints[2];
                for (int p = 0; p < 2; p++) {
                    const __m256i tops =
                        BITS == 6
                            ? _mm256_loadu_si256((const __m256i*)(at + 256 + hh * 64 + p * 32))
                            : _mm256_setzero_si256();
                    ints[p] = tile_bytes_at(v[p], tops, hh, j, BITS);
                }
#pragma GCC unroll 4
                for (int r = 0; r < R; r++) {
                    const __m256i xb = quad_x8(xc + r * K + 16 * hh + 4 * j);
                    for (int p = 0; p < 2; p++) {
                        pairs[p][r] =
                            _mm256_add_epi16(pairs[p][r], _mm256_maddubs_epi16(ints[p], xb));
                        // each sum kept in its register as it goes (accumulate_pairs says
                        // why: gcc otherwise held every product for a tree at the end)
                        __asm__("" : "+x"(pairs[p][r]));
                    }
                }
            }
            // 6 bits: two quads fill int16 (a 32-column unit's j, a 16-column one's j pair)
            if (BITS == 6 && (QUADS == 8 || j % 2 == 1)) {
                for (int r = 0; r < R; r++)
                    for (int p = 0; p < 2; p++) {
                        sums[p][r] =
                            _mm256_add_epi32(sums[p][r], _mm256_madd_epi16(pairs[p][r], ones));
                        pairs[p][r] = _mm256_setzero_si256();
                    }
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256 x_scale = _mm256_set1_ps(xd[r * xblocks + u * unit / 32]);
            for (int p = 0; p < 2; p++) {
                const __m256i sum = BITS == 4 ? _mm256_madd_epi16(pairs[p][r], ones) : sums[p][r];
                const __m256 scaled = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum),
                                                      _mm256_mul_ps(scale[p], x_scale),
                                                      _mm256_load_ps(acc_at[p][r]));
                _mm256_store_ps(acc_at[p][r], scaled);
            }
        }
        if (++in_group == units_per_group) in_group = 0, g++;
    }
    __m256 acc[2][AVX2_TILE_MR];
    for (int p = 0; p < 2; p++)
        for (int r = 0; r < R; r++) acc[p][r] = _mm256_load_ps(acc_at[p][r]);
    if (w->mins) add_offsets(acc, w, xs->xsum, t, groups, m0, R);
    store_tile_rows(acc, bias, y, N, t, m0, out_f32, R);
}

// Every row of y for tile t, in even passes of up to AVX2_TILE_MR rows (even_pass_rows). Each
// (rows, bits, unit) is its own compiled form.
static void tile_rows_i8(const quantized_weight* w, const tiled_x8* xs, const void* bias, void* y,
                         int64_t M, int64_t N, int64_t K, int64_t t, int out_f32) {
    const int form = w->bits == 4 ? 0 : 1 + (unit_cols(w->group) == 16);
    for (int64_t m0 = 0, rows; m0 < M; m0 += rows) {
        rows = even_pass_rows(M, m0, AVX2_TILE_MR);
        switch (rows * 3 + form) {
#define ROWS_FORM(r, f, bits, quads)                                             \
    case r * 3 + f:                                                              \
        tile_rows_i8_impl(w, xs, bias, y, N, K, t, m0, out_f32, r, bits, quads); \
        break;
#define ROWS_CASES(r) ROWS_FORM(r, 0, 4, 8) ROWS_FORM(r, 1, 6, 8) ROWS_FORM(r, 2, 6, 4)
            ROWS_CASES(1) ROWS_CASES(2) ROWS_CASES(3) ROWS_CASES(4)
#undef ROWS_CASES
#undef ROWS_FORM
        }
    }
}

// bf16 x [M, K] rounded to int8 per 32 columns into xq, with each block's scale (xd) and, for
// 6 bits, each unit's -32 * integer sum (neg); the VNNI kernels' rounding, operation for
// operation (float32 max|x| / 127, x times its inverse, nearest even).
static void prepare_x8(const bf16_t* x, const quantized_weight* w, int64_t M, int64_t K,
                       int8_t* xq, float* xd, int32_t* neg, float* xsum) {
    const int64_t unit = unit_cols(w->group), units = K / unit;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < K / 32; b++) {
            __m256i ints[4];
            xd[m * (K / 32) + b] = bf16_block_round(x + m * K + b * 32, 127.0f, ints);
            // packs interleaves the 128-bit halves (twice): this permutation puts them in order
            const __m256i words = _mm256_packs_epi16(_mm256_packs_epi32(ints[0], ints[1]),
                                                     _mm256_packs_epi32(ints[2], ints[3]));
            const __m256i bytes = _mm256_permutevar8x32_epi32(
                words, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256((__m256i*)(xq + m * K + b * 32), bytes);
            if (!neg) continue;
            for (int64_t u = b * 32 / unit; u < (b + 1) * 32 / unit; u++) {
                int32_t total = 0;
                for (int64_t k = u * unit; k < (u + 1) * unit; k++) total += xq[m * K + k];
                neg[m * units + u] = -32 * total;
            }
        }
    if (xsum) x_group_sums(x, 1, M, K, w->group, xsum);
}

MINISGL_INTERNAL int quantized_tiled_avx2_int8_linear(const bf16_t* x, const quantized_weight* w,
                                                      const void* bias, void* y, int64_t M,
                                                      int64_t N, int64_t K, int out_f32,
                                                      int nthreads) {
    const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS, groups = K / w->group;
    const int64_t units = K / unit_cols(w->group);
    const int64_t xq_floats = padded((M * K + 3) / 4), xd_floats = padded(M * (K / 32));
    const int64_t neg_floats = w->bits == 6 ? padded(M * units) : 0;
    const int64_t sum_floats = w->mins ? M * groups : 0;
    float* buffer =
        kernel_alloc((size_t)(xq_floats + xd_floats + neg_floats + sum_floats) * sizeof(float));
    if (!buffer) return MINISGL_ERR_NOMEM;
    int8_t* xq = (int8_t*)buffer;
    float* xd = buffer + xq_floats;
    int32_t* neg = neg_floats ? (int32_t*)(xd + xd_floats) : NULL;
    float* xsum = sum_floats ? xd + xd_floats + neg_floats : NULL;
    prepare_x8(x, w, M, K, xq, xd, neg, xsum);
    const tiled_x8 xs = {.xq = xq, .xd = xd, .neg = neg, .xsum = xsum};
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t t = 0; t < tiles; t++) tile_rows_i8(w, &xs, bias, y, M, N, K, t, out_f32);
    free(buffer);
    return MINISGL_OK;
}
#endif
