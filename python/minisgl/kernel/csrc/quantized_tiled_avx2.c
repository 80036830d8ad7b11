#include "common.h"
#include "internal.h"

// ------------------------------------------------------------ tiled quantized matmul, AVX2
// The tile layout (quantized_tiled.c describes it, layers/quant_tiles.py writes it) where there
// is no vpdpbusd: a vector holds 8 of a tile's 16 rows (a half), 4 columns of a row a lane.
// bf16 x of up to AVX2_TILED_MAX_ROWS rows is rounded to int16 per 32 columns (avx2_x_int16: 15
// bits, within bf16's own rounding) and meets the weight's integers as 16-bit pairs in vpmaddwd:
// a lane's two words are its row's columns 4q and 4q+2 (then 4q+1 and 4q+3), x's same two
// columns broadcast against them (and against the other half's), 16 exact products an
// instruction, summed in int32 over a unit (32 columns; 16 where groups are not whole 32s) and
// scaled once per unit for 8 rows at once. The row layout scaled each row's 8 partial sums
// apart, as many operations as the products: on Zen 2 this form takes 1.4-1.9x less time at 2-8
// rows (SmolLM2's layer, benchmark/kernels_quantized.py). A row's arithmetic is the same at
// every row count, so a speculative verify step's rows give what decoding one by one gives.
// Float32 x, and more bf16 rows (a prefill): each tile dequantized to float32, its 16 rows side
// by side per column (the block quantized_avx2.c's FMA tile takes), nothing transposed.

#ifdef HAVE_AVX2_FMA
#define PREFETCH_UNITS 8  // how far ahead a tile's values are fetched
#define AVX2_ROW_BLOCK 128  // x rows multiplied by every tile before the next rows

// x as the int16 kernel takes it (rows m: M of them).
typedef struct {
    const int16_t* x16;  // [M, K]: each 4 columns in the order 0, 2, 1, 3 (a pair a dword)
    const float* xd;     // [M, K / 32]: each 32 columns' scale
    const int32_t* neg;  // [M, units]: minus the stored offset (8 bits: 128, 6: 32) times the
                         // unit's integer sum; NULL for 4 bits (no offset)
    const float* xsum;   // [M, groups]: x's group sums (the mins' term), or NULL
} tiled_x16;

// x's dword (two int16 columns) at p, broadcast.
static inline __m256i pair_x(const int16_t* p) {
    return _mm256_castps_si256(_mm256_broadcast_ss((const float*)p));
}

// The 6-bit values' pairs of a quad vector v: nibble half hh (0: columns 4j.., 1: 16 + 4j..),
// words from bytes 0 and 2 (odd: 1 and 3) of each lane, each with its top 2 bits (crumb j of
// the same bytes of tops, the half's top-bits vector) above its low 4.
static inline __m256i six_bit_pair(__m256i v, __m256i tops, int hh, int j, int odd) {
    const __m256i low = _mm256_and_si256(_mm256_srli_epi16(v, 4 * hh + 8 * odd),
                                         _mm256_set1_epi32(0x000F000F));
    const __m256i top = _mm256_slli_epi16(_mm256_srli_epi16(tops, 2 * j + 8 * odd), 4);
    return _mm256_or_si256(low, _mm256_and_si256(top, _mm256_set1_epi32(0x00300030)));
}

// Each of R rows' sums for the tile's two halves (x row r at xq + r * K: its quad's two pairs)
// plus their products with the halves' even and odd pairs, each x pair broadcast once for both,
// a quad's two products summed before they meet the sum (3-10% over adding each on its own).
// The empty asm keeps each sum in its register as it goes: integer adds reassociate, and gcc
// summed a unit's products as a tree at its end, every product held until then and spilled
// (half the speed).
static inline void accumulate_pairs(__m256i sums[2][AVX2_TILE_MR], const __m256i* even,
                                    const __m256i* odd, const int16_t* xq, int64_t K,
                                    const int R) {
#pragma GCC unroll 4
    for (int r = 0; r < R; r++) {
        const __m256i x_even = pair_x(xq + r * K), x_odd = pair_x(xq + r * K + 2);
#pragma GCC unroll 2
        for (int p = 0; p < 2; p++) {
            const __m256i pair = _mm256_add_epi32(_mm256_madd_epi16(even[p], x_even),
                                                  _mm256_madd_epi16(odd[p], x_odd));
            sums[p][r] = _mm256_add_epi32(sums[p][r], pair);
            __asm__("" : "+x"(sums[p][r]));
        }
    }
}

// Rows m0..m0+R-1 of y for tile t (R, BITS, QUADS constants where inlined): both halves at
// once, each x broadcast feeding two products (one half a pass: 12% slower at 4 and 8 rows).
static inline FORM_INLINE void tile_rows_impl(const quantized_weight* w, const tiled_x16* xs,
                                              const void* bias, void* y, int64_t N, int64_t K,
                                              int64_t t, int64_t m0, int out_f32, const int R,
                                              const int BITS, const int QUADS) {
    const int64_t group = w->group, groups = K / group, unit = 4 * QUADS;
    const int64_t units = K / unit, units_per_group = group / unit, xblocks = K / 32;
    const uint8_t* tile = (const uint8_t*)w->values + t * tile_bytes(BITS, K);
    const __m256i low4 = _mm256_set1_epi32(0x000F000F), low8 = _mm256_set1_epi32(0x00FF00FF);
    // The scales and mins as far ahead as the values.
    const int64_t groups_ahead = (PREFETCH_UNITS * unit + group - 1) / group;
    __m256 acc[2][AVX2_TILE_MR];
    for (int p = 0; p < 2; p++)
        for (int r = 0; r < R; r++) acc[p][r] = _mm256_setzero_ps();
    // One loop over the units, a group's scales loaded where it starts: a loop per group cost
    // 8-bit weights in groups of 64 4-8% at 16-512 rows against one scale a row.
    __m256 scale[2] = {_mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int64_t u = 0, g = 0, in_group = 0; u < units; u++) {
        if (in_group == 0) group_scales(scale, w, t, g, groups, groups_ahead, m0);
        const int16_t* xu = xs->x16 + m0 * K + u * unit;  // row m0's first column of u
        prefetch_unit(tile, u, PREFETCH_UNITS, unit * BITS * 2, m0);
        __m256i sums[2][AVX2_TILE_MR];
        for (int r = 0; r < R; r++) {
            const __m256i start = xs->neg ? _mm256_set1_epi32(xs->neg[(m0 + r) * units + u])
                                          : _mm256_setzero_si256();
            for (int p = 0; p < 2; p++) sums[p][r] = start;
        }
        if (BITS == 8) {
#pragma GCC unroll 8
            for (int q = 0; q < QUADS; q++) {
                __m256i even[2], odd[2];
                for (int p = 0; p < 2; p++) {
                    const __m256i v = _mm256_loadu_si256(
                        (const __m256i*)(tile + (u * QUADS + q) * 64 + p * 32));
                    even[p] = _mm256_and_si256(v, low8), odd[p] = _mm256_srli_epi16(v, 8);
                }
                accumulate_pairs(sums, even, odd, xu + 4 * q, K, R);
            }
        } else {
            // 4 and 6 bits: the unit's chunk (a 16-column unit: nibble half u % 2 of it)
            const int64_t chunk = QUADS == 8 ? u : u / 2;
            const uint8_t* at = tile + chunk * 64 * BITS;
            const int64_t xoff = chunk * 32 - u * unit;  // the chunk's column 0, from xu's
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) {
                __m256i v[2];
                for (int p = 0; p < 2; p++)
                    v[p] = _mm256_loadu_si256((const __m256i*)(at + j * 64 + p * 32));
#pragma GCC unroll 2
                for (int hh = 0; hh < 2; hh++) {
                    if (QUADS == 4 && hh != u % 2) continue;
                    __m256i even[2], odd[2];
                    for (int p = 0; p < 2; p++) {
                        if (BITS == 4) {
                            even[p] = _mm256_and_si256(_mm256_srli_epi16(v[p], 4 * hh), low4);
                            odd[p] = hh ? _mm256_srli_epi16(v[p], 12)
                                        : _mm256_and_si256(_mm256_srli_epi16(v[p], 8), low4);
                        } else {
                            const __m256i tops = _mm256_loadu_si256(
                                (const __m256i*)(at + 256 + hh * 64 + p * 32));
                            even[p] = six_bit_pair(v[p], tops, hh, j, 0);
                            odd[p] = six_bit_pair(v[p], tops, hh, j, 1);
                        }
                    }
                    accumulate_pairs(sums, even, odd, xu + xoff + 16 * hh + 4 * j, K, R);
                }
            }
        }
        for (int r = 0; r < R; r++) {
            const __m256 xd = _mm256_set1_ps(xs->xd[(m0 + r) * xblocks + u * unit / 32]);
            for (int p = 0; p < 2; p++)
                acc[p][r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[p][r]),
                                            _mm256_mul_ps(scale[p], xd), acc[p][r]);
        }
        if (++in_group == units_per_group) in_group = 0, g++;
    }
    if (w->mins) add_offsets(acc, w, xs->xsum, t, groups, m0, R);
    store_tile_rows(acc, bias, y, N, t, m0, out_f32, R);
}

// Every row of y for tile t, in even passes of up to AVX2_TILE_MR rows (even_pass_rows). Each
// (rows, bits, unit) is its own compiled form.
static void tile_rows_i16(const quantized_weight* w, const tiled_x16* xs, const void* bias,
                          void* y, int64_t M, int64_t N, int64_t K, int64_t t, int out_f32) {
    const int form = w->bits == 4 ? 0 : (w->bits == 8 ? 1 : 3) + (unit_cols(w->group) == 16);
    for (int64_t m0 = 0, rows; m0 < M; m0 += rows) {
        rows = even_pass_rows(M, m0, AVX2_TILE_MR);
        switch (rows * 5 + form) {
#define ROWS_FORM(r, f, bits, quads)                                             \
    case r * 5 + f:                                                              \
        tile_rows_impl(w, xs, bias, y, N, K, t, m0, out_f32, r, bits, quads);    \
        break;
#define ROWS_CASES(r) \
    ROWS_FORM(r, 0, 4, 8) ROWS_FORM(r, 1, 8, 8) ROWS_FORM(r, 2, 8, 4) ROWS_FORM(r, 3, 6, 8) \
    ROWS_FORM(r, 4, 6, 4)
            ROWS_CASES(1) ROWS_CASES(2) ROWS_CASES(3) ROWS_CASES(4)
#undef ROWS_CASES
#undef ROWS_FORM
        }
    }
}

// bf16 x [M, K] as tiled_x16 wants it, into x16 / xd / neg / xsum (neg, xsum: where given).
static void prepare_x16(const bf16_t* x, const quantized_weight* w, int64_t M, int64_t K,
                        int16_t* x16, float* xd, int32_t* neg, float* xsum) {
    avx2_x_int16(x, M, K, x16, xd);
    const int64_t unit = unit_cols(w->group), units = K / unit;
    const int32_t offset = w->bits == 8 ? 128 : 32;
    // words 0, 1, 2, 3 of each 4 -> 0, 2, 1, 3 (in each 128-bit lane)
    const __m256i order = _mm256_setr_epi8(0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15,
                                           0, 1, 4, 5, 2, 3, 6, 7, 8, 9, 12, 13, 10, 11, 14, 15);
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t m = 0; m < M; m++)
        for (int64_t u = 0; u < units; u++) {
            int32_t total = 0;
            for (int64_t k = u * unit; k < (u + 1) * unit; k += 16) {
                __m256i* at = (__m256i*)(x16 + m * K + k);
                const __m256i v = _mm256_loadu_si256(at);
                _mm256_storeu_si256(at, _mm256_shuffle_epi8(v, order));
                if (!neg) continue;  // 4 bits: no offset to correct
                const __m256i pairs = _mm256_madd_epi16(v, ones);
                const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(pairs),
                                                _mm256_extracti128_si256(pairs, 1));
                const __m128i s2 = _mm_add_epi32(s, _mm_unpackhi_epi64(s, s));
                total += _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 1)));
            }
            if (neg) neg[m * units + u] = -offset * total;
        }
    if (xsum) x_group_sums(x, 1, M, K, w->group, xsum);
}

// Tile t dequantized (q * scale + min in float32, one rounding, as QuantizedWeight.dequantize)
// into wt [K, 16]: column k's 16 rows side by side.
static void tile_floats_avx2(const quantized_weight* w, int64_t t, int64_t K, float* wt) {
    const int64_t bits = w->bits, groups = K / w->group;
    const uint8_t* tile = (const uint8_t*)w->values + t * tile_bytes(bits, K);
    const __m256i byte = _mm256_set1_epi32(255), nibble = _mm256_set1_epi32(15);
    for (int64_t k = 0; k < K; k += 16) {  // groups are whole 16s: one scale a piece per row
        const int64_t g = k / w->group;
        for (int64_t h = 0; h < 2; h++) {
            const __m256 scale = half_floats(w->scales, w->scales_f32, t * groups + g, h);
            const __m256 offset = w->mins ? half_floats(w->mins, w->scales_f32, t * groups + g, h)
                                          : _mm256_setzero_ps();
            for (int64_t c = k; c < k + 16; c += 4) {  // columns c..c+3: a quad of each lane
                __m256i v, tops = _mm256_setzero_si256();
                int shift = 0, j = 0;
                if (bits == 8) {
                    v = _mm256_loadu_si256((const __m256i*)(tile + c / 4 * 64 + h * 32));
                } else {  // vector j of chunk c / 32; columns 16..31 in the high nibbles
                    const int64_t in_chunk = c % 32;
                    const uint8_t* chunk = tile + c / 32 * 64 * bits;
                    j = (int)(in_chunk % 16 / 4), shift = in_chunk >= 16 ? 4 : 0;
                    v = _mm256_loadu_si256((const __m256i*)(chunk + j * 64 + h * 32));
                    if (bits == 6)
                        tops = _mm256_loadu_si256(
                            (const __m256i*)(chunk + 256 + (in_chunk >= 16) * 64 + h * 32));
                }
                for (int i = 0; i < 4; i++) {
                    __m256i ints;
                    if (bits == 8) {
                        ints = _mm256_sub_epi32(
                            _mm256_and_si256(_mm256_srli_epi32(v, 8 * i), byte),
                            _mm256_set1_epi32(128));
                    } else {
                        ints = _mm256_and_si256(_mm256_srli_epi32(v, 8 * i + shift), nibble);
                        if (bits == 6) {
                            const __m256i top = _mm256_and_si256(
                                _mm256_srli_epi32(tops, 8 * i + 2 * j), _mm256_set1_epi32(3));
                            ints = _mm256_sub_epi32(_mm256_or_si256(ints, _mm256_slli_epi32(top, 4)),
                                                    _mm256_set1_epi32(32));
                        }
                    }
                    const __m256 value = _mm256_fmadd_ps(_mm256_cvtepi32_ps(ints), scale, offset);
                    _mm256_storeu_ps(wt + (c + i) * TILE_ROWS + 8 * h, value);
                }
            }
        }
    }
}

// The integer at row lane l, column k of tile `tile` (bits 8, 6 or 4), as the source's.
static inline int tile_integer(const uint8_t* tile, int64_t bits, int64_t l, int64_t k) {
    if (bits == 8) return (int)tile[k / 4 * 64 + 4 * l + k % 4] - 128;
    const int64_t in_chunk = k % 32, high = in_chunk >= 16, j = in_chunk % 16 / 4, i = k % 4;
    const uint8_t* chunk = tile + k / 32 * 64 * bits;
    const int low = (chunk[j * 64 + 4 * l + i] >> (4 * high)) & 15;
    if (bits == 4) return low;
    return low + 16 * ((chunk[256 + high * 64 + 4 * l + i] >> (2 * j)) & 3) - 32;
}

MINISGL_INTERNAL int quantized_tiled_avx2_linear(const void* x, const quantized_weight* w,
                                                 const void* bias, void* y, int64_t M, int64_t N,
                                                 int64_t K, int x_dtype, int path, int out_f32,
                                                 int nthreads) {
    const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS, groups = K / w->group;
    if (path == QPATH_AVX2_TILED_INT16) {
        const int64_t units = K / unit_cols(w->group);
        const int64_t x16_floats = padded((M * K + 1) / 2), xd_floats = padded(M * (K / 32));
        const int64_t neg_floats = w->bits != 4 ? padded(M * units) : 0;
        const int64_t sum_floats = w->mins ? M * groups : 0;
        float* buffer = kernel_alloc(
            (size_t)(x16_floats + xd_floats + neg_floats + sum_floats) * sizeof(float));
        if (!buffer) return MINISGL_ERR_NOMEM;
        int16_t* x16 = (int16_t*)buffer;
        float* xd = buffer + x16_floats;
        int32_t* neg = neg_floats ? (int32_t*)(xd + xd_floats) : NULL;
        float* xsum = sum_floats ? xd + xd_floats + neg_floats : NULL;
        prepare_x16((const bf16_t*)x, w, M, K, x16, xd, neg, xsum);
        // A prefill's rows in blocks, each block against every tile: a block's x stays in L2
        // while the weight streams past it (a thread's tasks are consecutive blocks).
        const int64_t blocks = (M + AVX2_ROW_BLOCK - 1) / AVX2_ROW_BLOCK, xblocks = K / 32;
#pragma omp parallel for num_threads(nthreads) schedule(static)
        for (int64_t task = 0; task < blocks * tiles; task++) {
            const int64_t m0 = task / tiles * AVX2_ROW_BLOCK, t = task % tiles;
            const int64_t rows = M - m0 < AVX2_ROW_BLOCK ? M - m0 : AVX2_ROW_BLOCK;
            const tiled_x16 xs = {.x16 = x16 + m0 * K,
                                  .xd = xd + m0 * xblocks,
                                  .neg = neg ? neg + m0 * units : NULL,
                                  .xsum = xsum ? xsum + m0 * groups : NULL};
            void* y_rows = (char*)y + m0 * N * (out_f32 ? sizeof(float) : sizeof(bf16_t));
            tile_rows_i16(w, &xs, bias, y_rows, rows, N, K, t, out_f32);
        }
        free(buffer);
        return MINISGL_OK;
    }
    // Float32 products: x as float32 rows (bf16 converted once), a dequantized tile a thread.
    const int64_t x_floats = x_dtype == 1 ? padded(M * K) : 0, per_thread = TILE_ROWS * K;
    float* buffer = kernel_alloc((size_t)(x_floats + nthreads * per_thread) * sizeof(float));
    if (!buffer) return MINISGL_ERR_NOMEM;
    const float* xf = x_dtype == 1 ? buffer : (const float*)x;
#pragma omp parallel num_threads(nthreads)
    {
        float* wt = buffer + x_floats + omp_get_thread_num() * per_thread;
#pragma omp for schedule(static)
        for (int64_t m = 0; m < (x_dtype == 1 ? M : 0); m++)
            load_row(x, m * K, 1, buffer + m * K, K);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) {
            const int64_t n0 = t * TILE_ROWS, n1 = n0 + TILE_ROWS < N ? n0 + TILE_ROWS : N;
            tile_floats_avx2(w, t, K, wt);
            avx2_block_rows(xf, wt, bias, y, M, N, K, n0, n1, x_dtype, out_f32);
        }
    }
    free(buffer);
    return MINISGL_OK;
}

MINISGL_INTERNAL int quantized_tiled_avx2_rows(const quantized_weight* w, const int64_t* ids,
                                               void* out, int64_t count, int64_t K, int dtype,
                                               int nthreads) {
    const int64_t groups = K / w->group, bytes = tile_bytes(w->bits, K);
    int64_t in_order = 0;  // every row, in order: tile by tile (a prefill's whole weight)
    while (in_order < count && ids[in_order] == in_order) in_order++;
    if (in_order == count && count >= TILE_ROWS) {
        float* buffer = kernel_alloc((size_t)(nthreads * TILE_ROWS * K) * sizeof(float));
        if (!buffer) return MINISGL_ERR_NOMEM;
#pragma omp parallel num_threads(nthreads)
        {
            float* wt = buffer + omp_get_thread_num() * TILE_ROWS * K;
#pragma omp for schedule(static)
            for (int64_t t = 0; t < (count + TILE_ROWS - 1) / TILE_ROWS; t++) {
                tile_floats_avx2(w, t, K, wt);
                // each 8 columns of 8 rows transposed back into the rows (those below count)
                for (int64_t k = 0; k < K; k += 8)
                    for (int64_t h = 0; h < 2; h++) {
                        __m256 block[8];
                        for (int i = 0; i < 8; i++)
                            block[i] = _mm256_loadu_ps(wt + (k + i) * TILE_ROWS + 8 * h);
                        transpose8(block);
                        for (int64_t l = 0; l < 8; l++) {
                            const int64_t n = t * TILE_ROWS + 8 * h + l;
                            if (n >= count) break;
                            if (dtype == 1) {
                                float values[8];
                                _mm256_storeu_ps(values, block[l]);
                                for (int i = 0; i < 8; i++)
                                    ((bf16_t*)out)[n * K + k + i] = f32_to_bf16(values[i]);
                            } else {
                                _mm256_storeu_ps((float*)out + n * K + k, block[l]);
                            }
                        }
                    }
            }
        }
        free(buffer);
        return MINISGL_OK;
    }
#pragma omp parallel for num_threads(nthreads) schedule(static) if (count * K >= (1 << 16))
    for (int64_t i = 0; i < count; i++) {
        const int64_t t = ids[i] / TILE_ROWS, l = ids[i] % TILE_ROWS;
        const uint8_t* tile = (const uint8_t*)w->values + t * bytes;
        for (int64_t k = 0; k < K; k++) {
            const int64_t at = (t * groups + k / w->group) * TILE_ROWS + l;
            const float scale = w->scales_f32 ? ((const float*)w->scales)[at]
                                              : half_to_f32(((const uint16_t*)w->scales)[at]);
            const float offset = !w->mins        ? 0.0f
                                 : w->scales_f32 ? ((const float*)w->mins)[at]
                                                 : half_to_f32(((const uint16_t*)w->mins)[at]);
            const float value = fmaf((float)tile_integer(tile, w->bits, l, k), scale, offset);
            if (dtype == 1)
                ((bf16_t*)out)[i * K + k] = f32_to_bf16(value);
            else
                ((float*)out)[i * K + k] = value;
        }
    }
    return MINISGL_OK;
}
#endif
