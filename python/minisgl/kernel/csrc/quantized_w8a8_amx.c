#include "common.h"
#include "internal.h"
#include "simd.h"

// ---------------------------------------------------------- W8A8 on the AMX int8 tiles
// quantized_w8a8.c's W8A8 where the CPU has AMX-INT8: a 16-row tile of x's int8 rows meets a
// k-step of the weight's tile (its bytes the B operand as they lie) in tdpbsud, 1,024
// multiply-adds an instruction; the outlier columns in one bf16 tile product, exact.

#ifdef HAVE_AMX_INT8
// One tile's integers at outlier column k (in its k-step `step`, 16 k-quads of 16 lanes: the
// column is byte k % 4 of k-quad (k % 64) / 4, stored +128) into lane halves of the bf16 B tile
// dst: k-pair row j / 2, the low half for an even j, the high half for an odd one (the tile's
// other lanes untouched, zero where no column lands). Integers of 8 bits are exact in bf16; the
// weight's row scales come in at scale_tile.
static inline void gather_outlier(const uint8_t* step, int64_t k, int64_t j, bf16_t* dst) {
    const __m512i exact =
        _mm512_castps_si512(_mm512_cvtepi32_ps(tile_column_integers(step, k % W8A8_KSTEP)));
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
void w8a8_amx_task(const int8_rows* xs, const quantized_weight* w, const bf16_t* bias, void* y,
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

#endif
