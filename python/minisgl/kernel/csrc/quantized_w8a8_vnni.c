#include "common.h"
#include "internal.h"
#include "simd.h"

// ------------------------------------------------------------------ W8A8 in vpdpbusd
// quantized_w8a8.c's W8A8 where there are no int8 tiles (Zen 4/5; Ice Lake and Cascade Lake
// Xeons; an AMX Xeon whose OS keeps its tiles): a tile's k-quad vector (16 weight rows by 4
// columns, +128, as the tile layout holds it) meets each x row's 4 int8 values broadcast in one
// vpdpbusd, 64 exact products (vdpbf16ps: 32), summed in int32 over the whole of k. A register
// block is VNNI_ROWS x rows by the tiles of up to W8A8_VNNI_BLOCKS 32-column blocks: per k-quad
// 4 weight loads and 4 broadcasts feed 16 products. The outlier columns meet the weight's
// integers there as int16 pairs in vpdpwssd (x's values to int16 per row), the weight's pairs
// gathered once a task.

#ifdef HAVE_AVX512_VNNI
#define VNNI_ROWS 4                         // x rows a register block takes
#define VNNI_TILES (2 * W8A8_VNNI_BLOCKS)  // 16-row weight tiles a task takes, at most

// A tile's integers at the outlier columns as vpdpwssd's int16 pairs: lane n of pairs[p] holds
// row n's integers at outliers 2p (low half) and 2p + 1 (high half; zero past the count).
static void gather_outlier_pairs(const uint8_t* tile, const int8_rows* xs, int32_t (*pairs)[16]) {
    const __m512i low = _mm512_set1_epi32(0xffff);
    for (int64_t j = 0; j < xs->count; j += 2) {
        __m512i pair = _mm512_and_si512(tile_column_integers(tile, xs->outliers[j]), low);
        if (j + 1 < xs->count)
            pair = _mm512_or_si512(
                pair, _mm512_slli_epi32(tile_column_integers(tile, xs->outliers[j + 1]), 16));
        _mm512_store_si512(pairs[j / 2], pair);
    }
}

// Rows m.. m + VNNI_ROWS - 1 of xs times TILES tiles (values at tile[t], outlier pairs at
// pairs[t], row scales wscale[t]): ((int8 sum - offset) * scale + outlier sum * oscale) * wscale
// into out[t][r0 + r], float32.
static inline FORM_INLINE void vnni_rows(const int8_rows* xs, int64_t m, int64_t quads,
                                         const uint8_t* const* tile,
                                         int32_t (*const* pairs)[16], const __m512* wscale,
                                         float (*out)[16][16], int r0, const int TILES) {
    __m512i acc[VNNI_ROWS][VNNI_TILES];
    for (int r = 0; r < VNNI_ROWS; r++)
        for (int t = 0; t < TILES; t++) acc[r][t] = _mm512_setzero_si512();
    const int8_t* a = xs->xq + m * xs->ldx;
    for (int64_t q = 0; q < quads; q++) {
        __m512i wq[VNNI_TILES];
        for (int t = 0; t < TILES; t++) wq[t] = _mm512_loadu_si512(tile[t] + q * 64);
        for (int r = 0; r < VNNI_ROWS; r++) {
            int32_t quad;
            memcpy(&quad, a + r * xs->ldx + 4 * q, 4);
            const __m512i xq = _mm512_set1_epi32(quad);
            for (int t = 0; t < TILES; t++) acc[r][t] = _mm512_dpbusd_epi32(acc[r][t], wq[t], xq);
        }
    }
    for (int r = 0; r < VNNI_ROWS; r++) {
        const __m512i offset = _mm512_set1_epi32(xs->offset[m + r]);
        const __m512 scale = _mm512_set1_ps(xs->scale[m + r]);
        for (int t = 0; t < TILES; t++)
            _mm512_store_ps(out[t][r0 + r],
                            _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][t], offset)),
                                          scale));
    }
    for (int r = 0; r < VNNI_ROWS; r++)
        for (int t = 0; t < TILES; t++) acc[r][t] = _mm512_setzero_si512();
    const int16_t* o = xs->xout16 + m * W8A8_OUTLIERS;
    for (int64_t p = 0; p < (xs->count + 1) / 2; p++) {
        __m512i wo[VNNI_TILES];
        for (int t = 0; t < TILES; t++) wo[t] = _mm512_load_si512(pairs[t][p]);
        for (int r = 0; r < VNNI_ROWS; r++) {
            int32_t pair;
            memcpy(&pair, o + r * W8A8_OUTLIERS + 2 * p, 4);
            const __m512i xo = _mm512_set1_epi32(pair);
            for (int t = 0; t < TILES; t++) acc[r][t] = _mm512_dpwssd_epi32(acc[r][t], wo[t], xo);
        }
    }
    for (int r = 0; r < VNNI_ROWS; r++) {
        const __m512 oscale = _mm512_set1_ps(xs->oscale[m + r]);
        for (int t = 0; t < TILES; t++) {
            const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), oscale,
                                               _mm512_load_ps(out[t][r0 + r]));
            _mm512_store_ps(out[t][r0 + r], _mm512_mul_ps(sum, wscale[t]));
        }
    }
}

void w8a8_vnni_task(const int8_rows* xs, const quantized_weight* w, const bf16_t* bias, void* y,
                    int64_t M, int64_t N, int64_t K, int64_t b, int64_t blocks, int64_t m0,
                    int64_t m1, int epilogue) {
    int32_t outlier_pairs[VNNI_TILES][W8A8_OUTLIERS / 2][16] __attribute__((aligned(64)));
    float out[VNNI_TILES][16][16] __attribute__((aligned(64)));
    const uint8_t* tile[VNNI_TILES];
    int32_t(*pairs[VNNI_TILES])[16];
    __m512 wscale[VNNI_TILES];
    int64_t ids[VNNI_TILES];
    for (int64_t j = 0; j < blocks; j++)
        block_tiles(b + j, N, epilogue == EPILOGUE_GATED, &ids[2 * j], &ids[2 * j + 1]);
    // Only the last block of the weight lacks its right tile (N mod 32 up to 16).
    int tiles = 0;
    while (tiles < 2 * blocks && ids[tiles] >= 0) {
        tile[tiles] = (const uint8_t*)w->values + ids[tiles] * tile_bytes(8, K);
        pairs[tiles] = outlier_pairs[tiles];
        wscale[tiles] = tile_floats(w->scales, w->scales_f32, ids[tiles]);
        gather_outlier_pairs(tile[tiles], xs, outlier_pairs[tiles]);
        tiles++;
    }
    if (tiles % 2) memset(out[tiles], 0, sizeof out[0]);
    const int64_t quads = K / 4;
    for (int64_t m = m0; m < m1 && m < M; m += 16) {
        for (int r0 = 0; r0 < 16 && m + r0 < M; r0 += VNNI_ROWS) {
            const int64_t first = m + r0;
            if (tiles == 4)
                vnni_rows(xs, first, quads, tile, pairs, wscale, out, r0, 4);
            else if (tiles == 3)
                vnni_rows(xs, first, quads, tile, pairs, wscale, out, r0, 3);
            else if (tiles == 2)
                vnni_rows(xs, first, quads, tile, pairs, wscale, out, r0, 2);
            else
                vnni_rows(xs, first, quads, tile, pairs, wscale, out, r0, 1);
        }
        const int64_t rows = M - m < 16 ? M - m : 16;
        for (int64_t j = 0; j < blocks; j++)
            packed_store(out[2 * j], out[2 * j + 1], bias, y, N, m, rows, 32 * (b + j), epilogue);
    }
}
#endif
