#include "common.h"
#include "internal.h"
#include "simd.h"

// ------------------------------------------------------------ W8A8: int8 activations, per row
// A call's bf16 rows (a decode batch's or a prefill's) against an 8-bit tiled weight with one scale
// per output row (`--quantization int8`): each x row is rounded to int8 with one scale (max|x| /
// 127, dynamic and symmetric: SmoothQuant's per-token activations) and meets the weight in int8
// products, summed in int32 over the whole of k and scaled once by the two rows' scales: on the
// AMX int8 tiles (here), or in vpdpbusd (quantized_w8a8_vnni.c). The call's W8A8_OUTLIERS
// columns of largest magnitude (over all its rows) are left out of the rounding and meet the
// weight's integers at those columns apart (on the tiles in bf16, exact; in vpdpwssd as int16),
// the row scale after the sum, LLM.int8()'s decomposition: on the default model per-row rounding
// alone cost 3.6% of perplexity, with the columns apart 0.4% over bf16
// (benchmark/quantized_quality.py). The tile layout's 8-bit values are the int8 products' weight
// operand as they lie (a 64-column step of a 16-row tile is 16 k-quads of 16 rows: 1 KB, stride
// 64), stored +128: tdpbsud and vpdpbusd take x signed and the weight unsigned, and 128 * sum(xq)
// comes off each row's sums. The int8 products run at twice the bf16 ones' rate, and nothing
// else of the weight is dequantized.

#ifdef HAVE_AVX512_VNNI
#define W8A8_PANEL_BYTES (512 << 10)  // int8 x rows a task takes against a block (L2-resident)
// Columns kept apart: up to W8A8_SERIAL_ROWS rows the smaller count (its cost is the call's, a
// decode batch shares it among few rows), above it the larger (the default model's whole-text
// perplexity over bf16: +0.4% with 64).
#define W8A8_FEW_OUTLIERS 32
#define W8A8_SERIAL_ROWS 32  // rows up to which one thread quantizes them
#define W8A8_CHUNKS(K) (((K) / 16 + 15) / 16 * 16)  // pick_outliers' 16-column maxima

// Row m's outlier values (xout) to int16 with one scale, its largest magnitude / 32767 (NaN
// where a value is not finite: the row's outputs are then NaN, as a product with it is).
static void outliers_int16(const int8_rows* xs, int64_t m) {
    const bf16_t* out = xs->xout + m * W8A8_OUTLIERS;
    float largest = 0.0f;
    int finite = 1;
    for (int64_t j = 0; j < W8A8_OUTLIERS; j++) {
        const float magnitude = fabsf(bf16_to_f32(out[j]));
        finite &= isfinite(magnitude) != 0;
        largest = magnitude > largest ? magnitude : largest;
    }
    const float inverse = finite && largest > 0.0f ? 32767.0f / largest : 0.0f;
    for (int64_t j = 0; j < W8A8_OUTLIERS; j++)
        xs->xout16[m * W8A8_OUTLIERS + j] = (int16_t)lrintf(bf16_to_f32(out[j]) * inverse);
    xs->oscale[m] = !finite ? __builtin_nanf("") : largest / 32767.0f;
}

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
    outliers_int16(xs, m);
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

// Row m of xs: x's row quantized, or (a padding row past M) zeros.
static void int8_row(const bf16_t* x, int64_t M, int64_t K, int8_rows* xs, const int16_t* skip,
                     int64_t m) {
    if (m < M) {
        quantize_row(x + m * K, K, xs, skip, m);
        return;
    }
    memset(xs->xq + m * xs->ldx, 0, (size_t)xs->ldx);
    memset(xs->xout + m * W8A8_OUTLIERS, 0, W8A8_OUTLIERS * 2);
    memset(xs->xout16 + m * W8A8_OUTLIERS, 0, W8A8_OUTLIERS * 2);
    xs->scale[m] = xs->oscale[m] = 0.0f;
    xs->offset[m] = 0;
}

int quantized_w8a8_linear(const bf16_t* x, const quantized_weight* w, const bf16_t* bias, void* y,
                          int64_t M, int64_t N, int64_t K, int epilogue, int on_tiles,
                          int nthreads) {
    const int64_t mpad = (M + 15) / 16 * 16, ldx = (K + W8A8_KSTEP - 1) / W8A8_KSTEP * W8A8_KSTEP;
    const int64_t blocks = (N + AMX_NBLOCK - 1) / AMX_NBLOCK;
    // A task's blocks: a pair of tiles on the int8 tiles, up to W8A8_VNNI_BLOCKS pairs in vpdpbusd.
    const int64_t task_blocks = on_tiles ? 1 : W8A8_VNNI_BLOCKS;
    const int64_t block_groups = (blocks + task_blocks - 1) / task_blocks;
    // As few panels as keep one in L2, of even size (whole 32 rows): each panel reads the whole
    // weight once more.
    int64_t panel_rows = W8A8_PANEL_BYTES / ldx / 32 * 32;
    panel_rows = panel_rows < 32 ? 32 : panel_rows;
    const int64_t panels = (mpad + panel_rows - 1) / panel_rows;
    panel_rows = ((mpad + panels - 1) / panels + 31) / 32 * 32;
    // xq, then (64-byte aligned pieces) xout and xout16, scales, offsets and outlier scales, the
    // column maxima, their chunks' maxima and the skip mask.
    const size_t xq_bytes = (size_t)(mpad * ldx), xout_bytes = (size_t)mpad * W8A8_OUTLIERS * 2;
    const size_t rows_bytes = (size_t)mpad * 12;
    const size_t col_bytes = (size_t)(K * (4 * nthreads + 2) + 4 * W8A8_CHUNKS(K) + 63) / 64 * 64;
    char* buffer = kernel_alloc(xq_bytes + 2 * xout_bytes + rows_bytes + col_bytes);
    if (!buffer) return MINISGL_ERR_NOMEM;
    int8_rows xs = {.xq = (int8_t*)buffer, .ldx = ldx};
    xs.xout = (bf16_t*)(buffer + xq_bytes);
    xs.xout16 = (int16_t*)(buffer + xq_bytes + xout_bytes);
    xs.scale = (float*)(buffer + xq_bytes + 2 * xout_bytes);
    xs.offset = (int32_t*)xs.scale + mpad;
    xs.oscale = xs.scale + 2 * mpad;
    float* colmax = (float*)(buffer + xq_bytes + 2 * xout_bytes + rows_bytes);
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
#ifdef HAVE_AMX_INT8
        if (on_tiles) amx_configure();
#endif
        // Panel-major: consecutive tasks of a thread share its x panel in L2.
#pragma omp for schedule(guided)
        for (int64_t task = 0; task < panels * block_groups; task++) {
            const int64_t panel = task / block_groups, b = task % block_groups * task_blocks;
            const int64_t m0 = panel * panel_rows;
            const int64_t m1 = m0 + panel_rows < mpad ? m0 + panel_rows : mpad;
#ifdef HAVE_AMX_INT8
            if (on_tiles) {
                int64_t left, right;
                block_tiles(b, N, epilogue == EPILOGUE_GATED, &left, &right);
                w8a8_amx_task(&xs, w, bias, y, M, N, K, left, right, 32 * b, m0, m1, epilogue);
                continue;
            }
#endif
            const int64_t count = blocks - b < task_blocks ? blocks - b : task_blocks;
            w8a8_vnni_task(&xs, w, bias, y, M, N, K, b, count, m0, m1, epilogue);
        }
#ifdef HAVE_AMX_INT8
        if (on_tiles) _tile_release();
#endif
    }
    free(buffer);
    return MINISGL_OK;
}
#endif
