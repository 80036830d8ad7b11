#include "common.h"
#include "internal.h"
#include "simd.h"

// ------------------------------------------------------------------------ fused elementwise
#ifdef HAVE_AVX512
// Lanes [i, i + 16) of a bf16 row of n, as float32 (zero past the end).
static inline __m512 load_bf16x16(const bf16_t* row, int64_t i, int64_t n) {
    const __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1u);
    return bf16x16_to_f32(_mm256_maskz_loadu_epi16(m, row + i));
}

// Float32 lanes already rounded to bf16 precision, stored as bf16 (their top halves).
static inline void store_bf16x16(bf16_t* row, int64_t i, int64_t n, __m512 v) {
    const __mmask16 m = n - i >= 16 ? 0xffff : (__mmask16)((1u << (n - i)) - 1u);
    _mm256_mask_storeu_epi16(row + i, m,
                             _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16)));
}

// One bf16 row of minisgl_add_rms_norm, 16 lanes at a time; h goes to residual_out (or, with
// none, to out, which the second pass then overwrites) and is read back from there exactly.
static void add_rms_norm_bf16_row(const bf16_t* x, const bf16_t* residual, const bf16_t* weight,
                                  bf16_t* out, bf16_t* residual_out, int64_t hidden, float eps) {
    const bf16_t* h_row = x;
    __m512 sum_sq = _mm512_setzero_ps();
    if (residual) {
        bf16_t* h_out = residual_out ? residual_out : out;
        for (int64_t i = 0; i < hidden; i += 16) {
            const __m512 h = round_bf16_512(
                _mm512_add_ps(load_bf16x16(x, i, hidden), load_bf16x16(residual, i, hidden)));
            store_bf16x16(h_out, i, hidden, h);
            sum_sq = _mm512_fmadd_ps(h, h, sum_sq);
        }
        h_row = h_out;
    } else {
        for (int64_t i = 0; i < hidden; i += 16) {
            const __m512 h = load_bf16x16(x, i, hidden);
            sum_sq = _mm512_fmadd_ps(h, h, sum_sq);
        }
    }
    const float inv_rms = 1.0f / sqrtf(_mm512_reduce_add_ps(sum_sq) / (float)hidden + eps);
    const __m512 scale = _mm512_set1_ps(inv_rms);
    for (int64_t i = 0; i < hidden; i += 16) {
        const __m512 normed = round_bf16_512(_mm512_mul_ps(load_bf16x16(h_row, i, hidden), scale));
        store_bf16x16(out, i, hidden,
                      round_bf16_512(_mm512_mul_ps(load_bf16x16(weight, i, hidden), normed)));
    }
}
#endif

// Residual add + RMSNorm, as transformers computes it: h = x + residual (rounded to the dtype),
// then weight * round(h * rsqrt(mean(h^2) + eps)) with the statistics in float32. Writes the
// normalised rows to `out` and h to `residual_out` (either may alias its input).

// Row r of minisgl_add_rms_norm. Never inlined: under -ffast-math gcc would vectorise its sums
// differently in each caller, and the attention blocks' q/k norms must equal the module path's
// bit for bit.
#define NORM_CHUNK 8192
__attribute__((noinline)) void add_rms_norm_row(const void* x, const void* residual,
                                                       const void* weight, void* out,
                             void* residual_out, int64_t r, int64_t hidden, float eps,
                             int dtype) {
#ifdef HAVE_AVX512
    if (dtype == 1) {
        add_rms_norm_bf16_row((const bf16_t*)x + r * hidden,
                              residual ? (const bf16_t*)residual + r * hidden : NULL,
                              (const bf16_t*)weight, (bf16_t*)out + r * hidden,
                              residual_out ? (bf16_t*)residual_out + r * hidden : NULL, hidden,
                              eps);
        return;
    }
#endif
    // Any hidden size, NORM_CHUNK elements at a time through local buffers, the old whole-row
    // loops per chunk: the sum of squares is one vectorised loop of known alignment (the same
    // order wherever the row lives; for rows up to NORM_CHUNK, a whole-row buffer's), and the
    // products are formed in the buffer, then stored (the same loop whether or not out aliases
    // x). Without residual_out, h is recomputed from x and residual for the second pass.
    const int64_t base = r * hidden;
    float h[NORM_CHUNK] __attribute__((aligned(64)));
    float other[NORM_CHUNK] __attribute__((aligned(64)));  // residual, then weight
    float sum_sq = 0.0f;
    for (int64_t c0 = 0; c0 < hidden; c0 += NORM_CHUNK) {
        const int64_t n = hidden - c0 < NORM_CHUNK ? hidden - c0 : NORM_CHUNK;
        load_row(x, base + c0, dtype, h, n);
        if (residual) {
            load_row(residual, base + c0, dtype, other, n);
            for (int64_t i = 0; i < n; i++) h[i] = round_to(dtype, h[i] + other[i]);
            if (residual_out) store_row(residual_out, base + c0, dtype, h, n);
        }
        float chunk_sum = 0.0f;
        for (int64_t i = 0; i < n; i++) chunk_sum += h[i] * h[i];
        sum_sq += chunk_sum;
    }
    const float inv_rms = 1.0f / sqrtf(sum_sq / (float)hidden + eps);
    for (int64_t c0 = 0; c0 < hidden; c0 += NORM_CHUNK) {
        const int64_t n = hidden - c0 < NORM_CHUNK ? hidden - c0 : NORM_CHUNK;
        if (residual && residual_out) {
            load_row(residual_out, base + c0, dtype, h, n);
        } else {
            load_row(x, base + c0, dtype, h, n);
            if (residual) {
                load_row(residual, base + c0, dtype, other, n);
                for (int64_t i = 0; i < n; i++) h[i] = round_to(dtype, h[i] + other[i]);
            }
        }
        load_row(weight, c0, dtype, other, n);
        for (int64_t i = 0; i < n; i++) h[i] = other[i] * round_to(dtype, h[i] * inv_rms);
        store_row(out, base + c0, dtype, h, n);
    }
}

// One row runs on the calling thread: a parallel region's start and join cost more than it.
void minisgl_add_rms_norm(const void* x, const void* residual, const void* weight, void* out,
                          void* residual_out, int64_t rows, int64_t hidden, float eps, int dtype,
                          int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(x, residual, weight, out, residual_out, r, hidden, eps, dtype);
}

// out[r, i] = round(silu(gate[r, i])) * up[r, i], gate_up = [gate | up] per row (one row on the
// calling thread, as add_rms_norm).
#define SILU_CHUNK 256
void minisgl_silu_and_mul(const void* gate_up, void* out, int64_t rows, int64_t inter,
                          int dtype, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = 0;
#ifdef HAVE_AVX512
        for (; i + 16 <= inter; i += 16) {
            __m512 gate = load16(gate_up, r * 2 * inter + i, dtype);
            __m512 up = load16(gate_up, r * 2 * inter + inter + i, dtype);
            store16(out, r * inter + i, dtype, silu_times(gate, up, dtype));
        }
#endif
        // The rest (the whole row without AVX-512) in vectorisable chunks.
        for (; i < inter; i += SILU_CHUNK) {
            const int64_t n = inter - i < SILU_CHUNK ? inter - i : SILU_CHUNK;
            float gate[SILU_CHUNK], up[SILU_CHUNK];
            load_row(gate_up, r * 2 * inter + i, dtype, gate, n);
            load_row(gate_up, r * 2 * inter + inter + i, dtype, up, n);
            for (int64_t j = 0; j < n; j++)
                gate[j] = silu_times_portable(dtype, gate[j], up[j]);
            store_row(out, r * inter + i, dtype, gate, n);
        }
    }
}

// ------------------------------------------------------------------------------------ rotary
// Whether every position has its row in rotary tables of max_positions rows.
int positions_fit(const int64_t* positions, int64_t tokens, int64_t max_positions) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_positions) return 0;
    return 1;
}

// One token's heads of minisgl_rotary: x + base holds them dim apart; cos/sin its rows. Never
// inlined, as add_rms_norm_row (one compiled form for minisgl_rotary and the attention blocks).
#define ROTARY_CHUNK 128
__attribute__((noinline)) void rotary_token(void* x, int64_t base, int64_t heads, int64_t dim,
                                            const float* cos, const float* sin, int dtype) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++, base += dim) {
        int64_t i = 0;
#ifdef HAVE_AVX512
        for (; i + 16 <= half; i += 16) {
            __m512 x1 = load16(x, base + i, dtype), x2 = load16(x, base + half + i, dtype);
            __m512 c1 = round_to_512(dtype, _mm512_loadu_ps(cos + i));
            __m512 c2 = round_to_512(dtype, _mm512_loadu_ps(cos + half + i));
            __m512 s1 = round_to_512(dtype, _mm512_loadu_ps(sin + i));
            __m512 s2 = round_to_512(dtype, _mm512_loadu_ps(sin + half + i));
            __m512 neg_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
            __m512 o1 = _mm512_add_ps(round_to_512(dtype, _mm512_mul_ps(x1, c1)),
                                      round_to_512(dtype, _mm512_mul_ps(neg_x2, s1)));
            __m512 o2 = _mm512_add_ps(round_to_512(dtype, _mm512_mul_ps(x2, c2)),
                                      round_to_512(dtype, _mm512_mul_ps(x1, s2)));
            store16(x, base + i, dtype, round_to_512(dtype, o1));
            store16(x, base + half + i, dtype, round_to_512(dtype, o2));
        }
#endif
        // The rest (the whole head without AVX-512) through float copies, in loops gcc
        // vectorises (element by element it took 6.8% of an AVX2 build's W1).
        for (; i < half; i += ROTARY_CHUNK) {
            const int64_t n = half - i < ROTARY_CHUNK ? half - i : ROTARY_CHUNK;
            float x1[ROTARY_CHUNK], x2[ROTARY_CHUNK];
            load_row(x, base + i, dtype, x1, n);
            load_row(x, base + half + i, dtype, x2, n);
            for (int64_t j = 0; j < n; j++) {
                const float first = x1[j], second = x2[j];
                x1[j] = round_to(dtype, round_to(dtype, first * round_to(dtype, cos[i + j])) +
                                            round_to(dtype, -second * round_to(dtype, sin[i + j])));
                x2[j] = round_to(
                    dtype, round_to(dtype, second * round_to(dtype, cos[half + i + j])) +
                               round_to(dtype, first * round_to(dtype, sin[half + i + j])));
            }
            store_row(x, base + i, dtype, x1, n);
            store_row(x, base + half + i, dtype, x2, n);
        }
    }
}

// Rotary embedding (neox layout: rotate halves), in place on x viewed as [tokens, heads, dim]
// with `token_stride` elements between tokens (q or k inside the fused qkv rows). cos/sin are
// float32 [max_positions, dim] tables; as transformers does, they are rounded to the dtype and
// every product and the sum are rounded too. Returns MINISGL_OK or, x untouched, with a position
// outside [0, max_positions), MINISGL_ERR_POSITION.
int minisgl_rotary(void* x, int64_t tokens, int64_t token_stride, int64_t heads, int64_t dim,
                   const int64_t* positions, const float* cos_table, const float* sin_table,
                   int64_t max_positions, int dtype, int nthreads) {
    if (!positions_fit(positions, tokens, max_positions)) return MINISGL_ERR_POSITION;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (tokens * heads > 64)
    for (int64_t t = 0; t < tokens; t++)
        rotary_token(x, t * token_stride, heads, dim, cos_table + positions[t] * dim,
                     sin_table + positions[t] * dim, dtype);
    return MINISGL_OK;
}
