#include "common.h"
#include "internal.h"
#include "simd.h"

// ------------------------------------------------ W8A8: int8 activations on the AMX int8 tiles
// A call's bf16 rows (a decode batch's or a prefill's) against an 8-bit tiled weight with one scale
// per output row (`--quantization int8`): each x row is rounded to int8 with one scale (max|x| /
// 127, dynamic and symmetric: SmoothQuant's per-token activations) and meets the weight in int8
// products on the tiles, summed in int32 over the whole of k and scaled once by the two rows'
// scales. The call's W8A8_OUTLIERS columns of largest magnitude (over all its rows) are left out of
// the rounding and meet the weight's integers at those columns (exact in bf16, the row scale after
// the sum) on the bf16 tiles instead, LLM.int8()'s decomposition: on the default model per-row
// rounding alone cost 3.6% of perplexity, with the columns apart 0.4% over bf16
// (benchmark/quantized_quality.py). The tile layout's 8-bit values are the int8 tiles' B operand as
// they lie (a 64-column step of a 16-row tile is 16 k-quads of 16 rows: 1 KB, stride 64), stored
// +128: tdpbsud takes x signed and the weight unsigned, and 128 * sum(xq) comes off each row's
// sums. The int8 tiles do twice the bf16 tiles' products a cycle, and nothing else of the weight is
// dequantized.

#ifdef HAVE_AMX_INT8
#define W8A8_PANEL_BYTES (512 << 10)  // int8 x rows a task takes against a block (L2-resident)
#define W8A8_KSTEP 64     // columns an int8 tile product takes
// Columns kept in bf16 (bf16 tile products of AMX_KSTEP): up to W8A8_SERIAL_ROWS rows the
// smaller count (its cost is the call's, a decode batch shares it among few rows), above it the
// larger (the default model's whole-text perplexity over bf16: +0.4% with 64).
#define W8A8_OUTLIERS 64
#define W8A8_FEW_OUTLIERS 32
#define W8A8_SERIAL_ROWS 32  // rows up to which one thread quantizes them
#define W8A8_CHUNKS(K) (((K) / 16 + 15) / 16 * 16)  // pick_outliers' 16-column maxima

// x rounded to int8 per row: xq [mpad, ldx] (columns past K, outlier columns and rows past M
// zero), each row's scale and 128 times its integers' sum (the weight's +128 meets it); the
// outlier columns' indices (ascending) and x's values there, xout [mpad, W8A8_OUTLIERS] bf16 (zeros
// past the count and M).
typedef struct {
    int8_t* xq;
    float* scale;
    int32_t* offset;
    int64_t ldx;
    int64_t outliers[W8A8_OUTLIERS];
    int64_t count;  // outlier columns (pick_outliers' count, K when K is fewer)
    bf16_t* xout;
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

// Rows [m0, m1) of x [*, K]'s column maxima of magnitude into mine (K floats).
static void column_maxima(const bf16_t* x, int64_t m0, int64_t m1, int64_t K, float* mine) {
    for (int64_t k = 0; k < K; k++) mine[k] = 0.0f;
    for (int64_t m = m0; m < m1; m++)
        for (int64_t k = 0; k < K; k += 16) {
            const __m512 v = _mm512_abs_ps(
                bf16x16_to_f32(_mm256_loadu_si256((const __m256i*)(x + m * K + k))));
            _mm512_storeu_ps(mine + k, _mm512_max_ps(v, _mm512_loadu_ps(mine + k)));
        }
}

// The W8A8_OUTLIERS (W8A8_FEW_OUTLIERS for M rows up to W8A8_SERIAL_ROWS) columns of largest
// magnitude over every row (the threads' maxima, `team` slices of K in colmax, merged into the
// first; NaN above every number; ties: the lowest column first) into xs in ascending column order
// (the tasks gather them step by step), their entries of skip 0 (the others -1). chunk_max:
// W8A8_CHUNKS(K) floats, each 16 columns' maximum, so a pick reads K / 16 floats: their first
// maximum, then its first column, marked taken (-1: below every magnitude; -2 pads the chunks).
static void pick_outliers(float* colmax, int team, int64_t K, int64_t M, int16_t* skip,
                          int8_rows* xs, float* chunk_max) {
    const __m512 inf = _mm512_set1_ps(__builtin_inff());
    const int64_t chunks = K / 16, padded = W8A8_CHUNKS(K);
    for (int64_t k = 0; k < K; k += 16) {
        __m512 v = _mm512_loadu_ps(colmax + k);
        for (int t = 1; t < team; t++) v = _mm512_max_ps(v, _mm512_loadu_ps(colmax + t * K + k));
        v = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), v, inf);
        _mm512_storeu_ps(colmax + k, v);
        chunk_max[k / 16] = _mm512_reduce_max_ps(v);
    }
    for (int64_t c = chunks; c < padded; c++) chunk_max[c] = -2.0f;
    for (int64_t k = 0; k < K; k++) skip[k] = -1;
    const int64_t limit = M <= W8A8_SERIAL_ROWS ? W8A8_FEW_OUTLIERS : W8A8_OUTLIERS;
    xs->count = K < limit ? K : limit;
    for (int64_t j = 0; j < xs->count; j++) {
        __m512 largest = _mm512_set1_ps(-2.0f);
        for (int64_t c = 0; c < padded; c += 16)
            largest = _mm512_max_ps(largest, _mm512_loadu_ps(chunk_max + c));
        const __m512 top = _mm512_set1_ps(_mm512_reduce_max_ps(largest));
        int64_t chunk = 0;
        for (int64_t c = 0; c < padded; c += 16) {
            const __m512 maxima = _mm512_loadu_ps(chunk_max + c);
            const __mmask16 hit = _mm512_cmp_ps_mask(maxima, top, _CMP_EQ_OQ);
            if (hit) {
                chunk = c + __builtin_ctz(hit);
                break;
            }
        }
        float* columns = colmax + 16 * chunk;
        const __mmask16 at = _mm512_cmp_ps_mask(_mm512_loadu_ps(columns), top, _CMP_EQ_OQ);
        const int64_t best = 16 * chunk + __builtin_ctz(at);
        xs->outliers[j] = best;
        skip[best] = 0;
        colmax[best] = -1.0f;
        chunk_max[chunk] = _mm512_reduce_max_ps(_mm512_loadu_ps(columns));
    }
    for (int64_t j = 1; j < xs->count; j++)
        for (int64_t i = j; i > 0 && xs->outliers[i - 1] > xs->outliers[i]; i--) {
            const int64_t column = xs->outliers[i];
            xs->outliers[i] = xs->outliers[i - 1];
            xs->outliers[i - 1] = column;
        }
}

// One tile's integers at outlier column k (in its k-step `step`, 16 k-quads of 16 lanes: the
// column is byte k % 4 of k-quad (k % 64) / 4, stored +128) into lane halves of the bf16 B tile
// dst: k-pair row j / 2, the low half for an even j, the high half for an odd one (the tile's
// other lanes untouched, zero where no column lands). Integers of 8 bits are exact in bf16; the
// weight's row scales come in at scale_tile.
static inline void gather_outlier(const uint8_t* step, int64_t k, int64_t j, bf16_t* dst) {
    const __m512i quad = _mm512_loadu_si512(step + k % W8A8_KSTEP / 4 * 64);
    const __m512i shift = _mm512_set1_epi32((int)(8 * (k % 4)));
    const __m512i q = _mm512_and_si512(_mm512_srlv_epi32(quad, shift), _mm512_set1_epi32(255));
    const __m512i exact = _mm512_castps_si512(
        _mm512_cvtepi32_ps(_mm512_sub_epi32(q, _mm512_set1_epi32(128))));
    bf16_t* pair = dst + j / 2 * 32;
    if (j % 2 == 0)
        _mm512_mask_storeu_epi16(pair, 0x55555555u, _mm512_srli_epi32(exact, 16));
    else
        _mm512_mask_storeu_epi16(pair, 0xAAAAAAAAu, exact);
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

// One 16 x 16 tile of y's sums: ((int8 sum - offset[m]) * xscale[m] + the outlier columns'
// float32 sum over the weight's integers) * wscale[n].
static inline void scale_tile(const int32_t (*sums)[16], const float (*outlier)[16],
                              const int8_rows* xs, int64_t m0, __m512 wscale, float (*out)[16]) {
    for (int r = 0; r < 16; r++) {
        const __m512i s = _mm512_sub_epi32(_mm512_load_si512(sums[r]),
                                           _mm512_set1_epi32(xs->offset[m0 + r]));
        const __m512 sum = _mm512_fmadd_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(xs->scale[m0 + r]),
                                           _mm512_load_ps(outlier[r]));
        _mm512_store_ps(out[r], _mm512_mul_ps(sum, wscale));
    }
}

// Rows [m0, m1) of xs (whole 32-row pairs but the last, which may be one 16-row tile) times
// block b (tiles left, right; right -1: none) through the epilogue. The first 32 rows' k-steps
// also gather the block's outlier columns into bf16 B tiles, from the steps as they stream by.
static void w8a8_task(const int8_rows* xs, const quantized_weight* w, const bf16_t* bias, void* y,
                      int64_t M, int64_t N, int64_t K, int64_t left, int64_t right, int64_t n0,
                      int64_t m0, int64_t m1, int epilogue) {
    int32_t sums[4][16][16] __attribute__((aligned(64)));
    float outlier[4][16][16] __attribute__((aligned(64)));
    float block[4][16][16] __attribute__((aligned(64)));
    uint8_t tails[2][16][64] __attribute__((aligned(64)));
    // k-pairs of 16 rows: W8A8_OUTLIERS / AMX_KSTEP B tiles a side
    bf16_t wout[2][16 * W8A8_OUTLIERS] __attribute__((aligned(64)));
    memset(wout, 0, sizeof wout);
    const int64_t ksteps = xs->ldx / W8A8_KSTEP;
    const __m512 wleft = tile_floats(w->scales, w->scales_f32, left);
    const __m512 wright = right >= 0 ? tile_floats(w->scales, w->scales_f32, right) : wleft;
    for (int64_t m = m0; m < m1; m += 32) {
        const int pair = m1 - m >= 32;
        const int8_t* a0 = xs->xq + m * xs->ldx;
        const int8_t* a1 = a0 + 16 * xs->ldx;
        int64_t next = m == m0 ? 0 : xs->count;  // the next outlier to gather
        // (the tile intrinsics take their registers as literals)
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t s = 0; s < ksteps; s++) {
            const uint8_t* step_left = weight_step(w, left, K, s, tails[0]);
            const uint8_t* step_right = right >= 0 ? weight_step(w, right, K, s, tails[1]) : NULL;
            for (; next < xs->count && xs->outliers[next] < (s + 1) * W8A8_KSTEP; next++) {
                gather_outlier(step_left, xs->outliers[next], next, wout[0]);
                if (step_right)
                    gather_outlier(step_right, xs->outliers[next], next, wout[1]);
            }
            _tile_loadd(4, a0 + s * W8A8_KSTEP, xs->ldx);
            _tile_loadd(6, step_left, 64);
            _tile_dpbsud(0, 4, 6);
            if (pair) {
                _tile_loadd(5, a1 + s * W8A8_KSTEP, xs->ldx);
                _tile_dpbsud(2, 5, 6);
            }
            if (step_right) {
                _tile_loadd(7, step_right, 64);
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
        // The outlier columns: bf16 k-steps of 32 into the same tiles, now float32.
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t q = 0; q < (xs->count + AMX_KSTEP - 1) / AMX_KSTEP; q++) {
            const bf16_t* xout = xs->xout + m * W8A8_OUTLIERS + q * AMX_KSTEP;
            _tile_loadd(4, xout, 2 * W8A8_OUTLIERS);
            _tile_loadd(6, wout[0] + q * 512, 64);
            _tile_loadd(7, wout[1] + q * 512, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            if (pair) {
                _tile_loadd(5, xout + 16 * W8A8_OUTLIERS, 2 * W8A8_OUTLIERS);
                _tile_dpbf16ps(2, 5, 6);
                _tile_dpbf16ps(3, 5, 7);
            }
        }
        _tile_stored(0, outlier[0], 64);
        _tile_stored(1, outlier[1], 64);
        if (pair) {
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

// Row m of xs: x's row quantized, or (a padding row past M) zeros.
static void int8_row(const bf16_t* x, int64_t M, int64_t K, int8_rows* xs, const int16_t* skip,
                     int64_t m) {
    if (m < M) {
        quantize_row(x + m * K, K, xs, skip, m);
        return;
    }
    memset(xs->xq + m * xs->ldx, 0, (size_t)xs->ldx);
    memset(xs->xout + m * W8A8_OUTLIERS, 0, W8A8_OUTLIERS * 2);
    xs->scale[m] = 0.0f;
    xs->offset[m] = 0;
}

int quantized_w8a8_linear(const bf16_t* x, const quantized_weight* w, const bf16_t* bias, void* y,
                          int64_t M, int64_t N, int64_t K, int epilogue, int nthreads) {
    const int gated = epilogue == EPILOGUE_GATED;
    const int64_t mpad = (M + 15) / 16 * 16, ldx = (K + W8A8_KSTEP - 1) / W8A8_KSTEP * W8A8_KSTEP;
    const int64_t blocks = (N + AMX_NBLOCK - 1) / AMX_NBLOCK;
    // As few panels as keep one in L2, of even size (whole 32 rows): each panel reads the whole
    // weight once more.
    int64_t panel_rows = W8A8_PANEL_BYTES / ldx / 32 * 32;
    panel_rows = panel_rows < 32 ? 32 : panel_rows;
    const int64_t panels = (mpad + panel_rows - 1) / panel_rows;
    panel_rows = ((mpad + panels - 1) / panels + 31) / 32 * 32;
    // xq, then (64-byte aligned pieces) xout, scales and offsets, the column maxima, their
    // chunks' maxima and the skip mask.
    const size_t xq_bytes = (size_t)(mpad * ldx), xout_bytes = (size_t)mpad * W8A8_OUTLIERS * 2;
    const size_t rows_bytes = (size_t)mpad * 8;
    const size_t col_bytes = (size_t)(K * (4 * nthreads + 2) + 4 * W8A8_CHUNKS(K) + 63) / 64 * 64;
    char* buffer = kernel_alloc(xq_bytes + xout_bytes + rows_bytes + col_bytes);
    if (!buffer) return MINISGL_ERR_NOMEM;
    int8_rows xs = {.xq = (int8_t*)buffer, .ldx = ldx};
    xs.xout = (bf16_t*)(buffer + xq_bytes);
    xs.scale = (float*)(buffer + xq_bytes + xout_bytes);
    xs.offset = (int32_t*)xs.scale + mpad;
    float* colmax = (float*)(buffer + xq_bytes + xout_bytes + rows_bytes);
    float* chunk_max = colmax + nthreads * K;
    int16_t* skip = (int16_t*)(chunk_max + W8A8_CHUNKS(K));
    // A decode batch's rows are quantized by one thread: two barriers fewer than sharing them.
    const int serial = M <= W8A8_SERIAL_ROWS;
#pragma omp parallel num_threads(nthreads)
    {
        if (serial) {
#pragma omp single
            {
                column_maxima(x, 0, M, K, colmax);
                pick_outliers(colmax, 1, K, M, skip, &xs, chunk_max);
                for (int64_t m = 0; m < mpad; m++) int8_row(x, M, K, &xs, skip, m);
            }
        } else {
            const int team = omp_get_num_threads(), tid = omp_get_thread_num();
            column_maxima(x, M * tid / team, M * (tid + 1) / team, K, colmax + tid * K);
#pragma omp barrier
#pragma omp single
            pick_outliers(colmax, team, K, M, skip, &xs, chunk_max);
#pragma omp for schedule(static)
            for (int64_t m = 0; m < mpad; m++) int8_row(x, M, K, &xs, skip, m);
        }
        amx_configure();
        // Panel-major: consecutive tasks of a thread share its x panel in L2.
#pragma omp for schedule(guided)
        for (int64_t task = 0; task < panels * blocks; task++) {
            const int64_t panel = task / blocks, b = task % blocks;
            int64_t left, right;
            block_tiles(b, N, gated, &left, &right);
            const int64_t m0 = panel * panel_rows;
            const int64_t m1 = m0 + panel_rows < mpad ? m0 + panel_rows : mpad;
            w8a8_task(&xs, w, bias, y, M, N, K, left, right, 32 * b, m0, m1, epilogue);
        }
        _tile_release();
    }
    free(buffer);
    return MINISGL_OK;
}
#endif
