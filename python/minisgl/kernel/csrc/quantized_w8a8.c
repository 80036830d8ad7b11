#include "common.h"
#include "internal.h"
#include "simd.h"

// ------------------------------------------------ W8A8: int8 activations on the AMX int8 tiles
// A prefill's bf16 rows against an 8-bit tiled weight with one scale per output row
// (`--quantization int8`): each x row is rounded to int8 with one scale (max|x| / 127, dynamic
// and symmetric: SmoothQuant's per-token activations) and meets the weight in int8 products on
// the tiles, summed in int32 over the whole of k and scaled once by the two rows' scales. The
// call's W8A8_OUTLIERS columns of largest magnitude (over all its rows) are left out of the
// rounding and meet the weight's columns (dequantized to bf16) on the bf16 tiles instead, one
// k-step, LLM.int8()'s decomposition: on the default model per-row rounding alone cost 3.6% of
// perplexity, with 32 columns apart 0.4% (benchmark/quantized_quality.py). The tile layout's
// 8-bit values are the int8 tiles' B operand as they lie (a 64-column step of a 16-row tile is
// 16 k-quads of 16 rows: 1 KB, stride 64), stored +128: tdpbsud takes x signed and the weight
// unsigned, and 128 * sum(xq) comes off each row's sums. The int8 tiles do twice the bf16
// tiles' products a cycle, and nothing else of the weight is dequantized.

#ifdef HAVE_AMX_INT8
#define W8A8_PANEL 128    // x rows a task takes against one 32-column block (L2-resident)
#define W8A8_KSTEP 64     // columns an int8 tile product takes
#define W8A8_OUTLIERS 32  // columns kept in bf16: one bf16 tile product (AMX_KSTEP)

// x rounded to int8 per row: xq [mpad, ldx] (columns past K, outlier columns and rows past M
// zero), each row's scale and 128 times its integers' sum (the weight's +128 meets it); the
// outlier columns' indices and x's values there, xout [mpad, 32] bf16 (zeros past K and M);
// and the weight's values at those columns, a bf16 B tile (16 k-pairs of 16 rows) per tile.
typedef struct {
    int8_t* xq;
    float* scale;
    int32_t* offset;
    int64_t ldx;
    int64_t outliers[W8A8_OUTLIERS];
    int64_t count;  // outlier columns (K when K < W8A8_OUTLIERS)
    bf16_t* xout;
    bf16_t* wout;
} int8_rows;

// Row m of bf16 x [*, K] (K a multiple of 16) into xs: its outlier columns into xout, the rest
// rounded with scale max|x| / 127, nearest even. skip: 0 on the outlier columns, else -1.
static void quantize_row(const bf16_t* x, int64_t K, const int8_rows* xs, const int16_t* skip,
                         int64_t m) {
    bf16_t* out = xs->xout + m * W8A8_OUTLIERS;
    for (int64_t j = 0; j < W8A8_OUTLIERS; j++) out[j] = j < xs->count ? x[xs->outliers[j]] : 0;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16) {
        const __m256i kept = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(x + k)),
                                              _mm256_loadu_si256((const __m256i*)(skip + k)));
        amax = _mm512_max_ps(amax, _mm512_abs_ps(bf16x16_to_f32(kept)));
    }
    const float largest = _mm512_reduce_max_ps(amax);
    const __m512 inverse = _mm512_set1_ps(largest > 0.0f ? 127.0f / largest : 0.0f);
    int8_t* row = xs->xq + m * xs->ldx;
    __m512i sum = _mm512_setzero_si512();
    for (int64_t k = 0; k < K; k += 16) {
        const __m256i kept = _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(x + k)),
                                              _mm256_loadu_si256((const __m256i*)(skip + k)));
        const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(bf16x16_to_f32(kept), inverse));
        sum = _mm512_add_epi32(sum, q);
        _mm_storeu_si128((__m128i*)(row + k), _mm512_cvtsepi32_epi8(q));
    }
    memset(row + K, 0, (size_t)(xs->ldx - K));
    xs->scale[m] = largest > 0.0f ? largest / 127.0f : 0.0f;
    xs->offset[m] = 128 * _mm512_reduce_add_epi32(sum);
}

// Thread `tid`'s share of x [M, K]'s column maxima of magnitude into its K floats of colmax.
static void column_maxima(const bf16_t* x, int64_t M, int64_t K, float* mine) {
    for (int64_t k = 0; k < K; k++) mine[k] = 0.0f;
#pragma omp for schedule(static)
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k += 16) {
            const __m512 v = _mm512_abs_ps(
                bf16x16_to_f32(_mm256_loadu_si256((const __m256i*)(x + m * K + k))));
            _mm512_storeu_ps(mine + k, _mm512_max_ps(v, _mm512_loadu_ps(mine + k)));
        }
}

// The W8A8_OUTLIERS columns of largest magnitude over every row (the threads' maxima, `team`
// slices of K in colmax; ties: the lowest column first) into xs, their entries of skip 0 (the
// others -1).
static void pick_outliers(float* colmax, int team, int64_t K, int16_t* skip, int8_rows* xs) {
    for (int t = 1; t < team; t++)
        for (int64_t k = 0; k < K; k++)
            colmax[k] = colmax[k] > colmax[t * K + k] ? colmax[k] : colmax[t * K + k];
    for (int64_t k = 0; k < K; k++) skip[k] = -1;
    xs->count = K < W8A8_OUTLIERS ? K : W8A8_OUTLIERS;
    for (int64_t j = 0; j < xs->count; j++) {
        int64_t best = -1;
        for (int64_t k = 0; k < K; k++)
            if (skip[k] && (best < 0 || colmax[k] > colmax[best])) best = k;
        xs->outliers[j] = best;
        skip[best] = 0;
    }
}

// Tile t's values at the outlier columns as a bf16 B tile: k-pair row p holds, for each of the
// 16 weight rows n, columns outliers[2p] and outliers[2p + 1] (zeros past count).
static void outlier_tile(const quantized_weight* w, int64_t t, int64_t K, const int8_rows* xs,
                         bf16_t* dst) {
    const uint8_t* values = (const uint8_t*)w->values + t * tile_bytes(8, K);
    float scales[16];
    _mm512_storeu_ps(scales, tile_floats(w->scales, w->scales_f32, t));
    for (int64_t j = 0; j < W8A8_OUTLIERS; j++) {
        const int64_t k = xs->outliers[j];
        for (int n = 0; n < 16; n++) {
            const float v = j < xs->count ? (values[k / 4 * 64 + 4 * n + k % 4] - 128) * scales[n]
                                          : 0.0f;
            dst[j / 2 * 32 + 2 * n + j % 2] = f32_to_bf16(v);
        }
    }
}

// Tile t's k-step s (64 columns) as a B tile: in place, or for a last step of 32 columns (K
// 32 mod 64) its 8 k-quad rows copied into tail with 8 rows of zeros (never read past the tile).
static inline const uint8_t* weight_step(const quantized_weight* w, int64_t t, int64_t K,
                                         int64_t s, uint8_t (*tail)[64]) {
    const uint8_t* step = (const uint8_t*)w->values + t * tile_bytes(8, K) + s * 16 * 64;
    if ((s + 1) * W8A8_KSTEP <= K) return step;
    memcpy(tail, step, 8 * 64);
    memset(tail + 8, 0, 8 * 64);
    return (const uint8_t*)tail;
}

// One 16 x 16 tile of y's sums: (int8 sum - offset[m]) * xscale[m] * wscale[n] + the outlier
// columns' float32 sum.
static inline void scale_tile(const int32_t (*sums)[16], const float (*outlier)[16],
                              const int8_rows* xs, int64_t m0, __m512 wscale, float (*out)[16]) {
    for (int r = 0; r < 16; r++) {
        const __m512i s = _mm512_sub_epi32(_mm512_load_si512(sums[r]),
                                           _mm512_set1_epi32(xs->offset[m0 + r]));
        const __m512 scale = _mm512_mul_ps(wscale, _mm512_set1_ps(xs->scale[m0 + r]));
        _mm512_store_ps(out[r],
                        _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), scale, _mm512_load_ps(outlier[r])));
    }
}

// Rows [m0, m1) of xs (whole 32-row pairs but the last, which may be one 16-row tile) times
// block b (tiles left, right; right -1: none) through the epilogue.
static void w8a8_task(const int8_rows* xs, const quantized_weight* w, const bf16_t* bias, void* y,
                      int64_t M, int64_t N, int64_t K, int64_t left, int64_t right, int64_t n0,
                      int64_t m0, int64_t m1, int epilogue) {
    int32_t sums[4][16][16] __attribute__((aligned(64)));
    float outlier[4][16][16] __attribute__((aligned(64)));
    float block[4][16][16] __attribute__((aligned(64)));
    uint8_t tails[2][16][64] __attribute__((aligned(64)));
    const int64_t ksteps = xs->ldx / W8A8_KSTEP;
    const __m512 wleft = tile_floats(w->scales, w->scales_f32, left);
    const __m512 wright = right >= 0 ? tile_floats(w->scales, w->scales_f32, right) : wleft;
    const bf16_t* wout_left = xs->wout + left * 512;
    const bf16_t* wout_right = xs->wout + (right >= 0 ? right : left) * 512;
    for (int64_t m = m0; m < m1; m += 32) {
        const int pair = m1 - m >= 32;
        const int8_t* a0 = xs->xq + m * xs->ldx;
        const int8_t* a1 = a0 + 16 * xs->ldx;
        // (the tile intrinsics take their registers as literals)
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < ksteps; s++) {
            _tile_loadd(4, a0 + s * W8A8_KSTEP, xs->ldx);
            _tile_loadd(6, weight_step(w, left, K, s, tails[0]), 64);
            _tile_dpbsud(0, 4, 6);
            if (pair) {
                _tile_loadd(5, a1 + s * W8A8_KSTEP, xs->ldx);
                _tile_dpbsud(2, 5, 6);
            }
            if (right >= 0) {
                _tile_loadd(7, weight_step(w, right, K, s, tails[1]), 64);
                _tile_dpbsud(1, 4, 7);
                if (pair) _tile_dpbsud(3, 5, 7);
            }
        }
        _tile_stored(0, sums[0], 64);
        _tile_stored(1, sums[1], 64);
        if (pair) {
            _tile_stored(2, sums[2], 64);
            _tile_stored(3, sums[3], 64);
        }
        // The outlier columns: one bf16 k-step into the same tiles, now float32.
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, xs->xout + m * W8A8_OUTLIERS, 2 * W8A8_OUTLIERS);
        _tile_loadd(6, wout_left, 64);
        _tile_loadd(7, wout_right, 64);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        _tile_stored(0, outlier[0], 64);
        _tile_stored(1, outlier[1], 64);
        if (pair) {
            _tile_loadd(5, xs->xout + (m + 16) * W8A8_OUTLIERS, 2 * W8A8_OUTLIERS);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            _tile_stored(2, outlier[2], 64);
            _tile_stored(3, outlier[3], 64);
        }
        for (int mt = 0; mt < 1 + pair; mt++) {
            const int64_t first = m + 16 * mt;
            if (first >= M) break;
            scale_tile(sums[2 * mt], outlier[2 * mt], xs, first, wleft, block[2 * mt]);
            if (right >= 0)
                scale_tile(sums[2 * mt + 1], outlier[2 * mt + 1], xs, first, wright,
                           block[2 * mt + 1]);
            else
                memset(block[2 * mt + 1], 0, sizeof block[0]);
            packed_store(block[2 * mt], block[2 * mt + 1], bias, y, N, first,
                         M - first < 16 ? M - first : 16, n0, epilogue);
        }
    }
}

int quantized_w8a8_linear(const bf16_t* x, const quantized_weight* w, const bf16_t* bias, void* y,
                          int64_t M, int64_t N, int64_t K, int epilogue, int nthreads) {
    const int gated = epilogue == EPILOGUE_GATED;
    const int64_t mpad = (M + 15) / 16 * 16, ldx = (K + W8A8_KSTEP - 1) / W8A8_KSTEP * W8A8_KSTEP;
    const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS, blocks = (N + AMX_NBLOCK - 1) / AMX_NBLOCK;
    const int64_t panels = (mpad + W8A8_PANEL - 1) / W8A8_PANEL;
    // xq, then (64-byte aligned pieces) the weight's outlier tiles, xout, scales and offsets,
    // the column maxima and the skip mask.
    const size_t xq_bytes = (size_t)(mpad * ldx), wout_bytes = (size_t)tiles * 1024;
    const size_t xout_bytes = (size_t)mpad * W8A8_OUTLIERS * 2, rows_bytes = (size_t)mpad * 8;
    const size_t col_bytes = (size_t)(K * (4 * nthreads + 2) + 63) / 64 * 64;
    char* buffer = kernel_alloc(xq_bytes + wout_bytes + xout_bytes + rows_bytes + col_bytes);
    if (!buffer) return MINISGL_ERR_NOMEM;
    int8_rows xs = {.xq = (int8_t*)buffer, .ldx = ldx};
    xs.wout = (bf16_t*)(buffer + xq_bytes);
    xs.xout = (bf16_t*)(buffer + xq_bytes + wout_bytes);
    xs.scale = (float*)(buffer + xq_bytes + wout_bytes + xout_bytes);
    xs.offset = (int32_t*)xs.scale + mpad;
    float* colmax = (float*)(buffer + xq_bytes + wout_bytes + xout_bytes + rows_bytes);
    int16_t* skip = (int16_t*)(colmax + nthreads * K);
#pragma omp parallel num_threads(nthreads)
    {
        column_maxima(x, M, K, colmax + omp_get_thread_num() * K);
#pragma omp single
        pick_outliers(colmax, omp_get_num_threads(), K, skip, &xs);
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tiles; t++) outlier_tile(w, t, K, &xs, xs.wout + t * 512);
#pragma omp for schedule(static)
        for (int64_t m = 0; m < mpad; m++) {
            if (m < M) {
                quantize_row(x + m * K, K, &xs, skip, m);
            } else {
                memset(xs.xq + m * ldx, 0, (size_t)ldx);
                memset(xs.xout + m * W8A8_OUTLIERS, 0, W8A8_OUTLIERS * 2);
                xs.scale[m] = 0.0f;
                xs.offset[m] = 0;
            }
        }
        amx_configure();
        // Panel-major: consecutive tasks of a thread share its x panel in L2.
#pragma omp for schedule(guided)
        for (int64_t task = 0; task < panels * blocks; task++) {
            const int64_t panel = task / blocks, b = task % blocks;
            int64_t left, right;
            block_tiles(b, N, gated, &left, &right);
            const int64_t m0 = panel * W8A8_PANEL;
            const int64_t m1 = m0 + W8A8_PANEL < mpad ? m0 + W8A8_PANEL : mpad;
            w8a8_task(&xs, w, bias, y, M, N, K, left, right, 32 * b, m0, m1, epilogue);
        }
        _tile_release();
    }
    free(buffer);
    return MINISGL_OK;
}
#endif
