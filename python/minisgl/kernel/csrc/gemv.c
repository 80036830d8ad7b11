#include "common.h"
#include "internal.h"
#include "simd.h"

// ------------------------------------------------------------------------------------- GEMV
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows m: bf16 in, float32 accumulate,
// bf16 out. Every thread streams its own contiguous block of weight rows once.

#ifdef HAVE_AVX512_BF16
static inline __mmask32 tail_mask(int64_t K, int64_t k) {
    return K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
}

// A block is 4 weight rows: four 64-byte lines of the block `ahead` per 32-element step.
static inline FORM_INLINE void prefetch_block(const bf16_t* ahead, int64_t k) {
    for (int line = 0; line < 4; line++)
        __builtin_prefetch(ahead + 4 * k + 32 * line, 0, 3);
}

// Row m's sums for columns n0..n0+3 (+ bias) into y [M, N] at m * N + n0: bf16, or float32
// (unrounded) where out_f32.
static inline void store_sums(__m512 acc0, __m512 acc1, __m512 acc2, __m512 acc3,
                              const bf16_t* bias, void* y, int64_t row, int64_t n0, int out_f32) {
    float sums[4] = {_mm512_reduce_add_ps(acc0), _mm512_reduce_add_ps(acc1),
                     _mm512_reduce_add_ps(acc2), _mm512_reduce_add_ps(acc3)};
    for (int r = 0; r < 4; r++) {
        if (bias) sums[r] += bf16_to_f32(bias[n0 + r]);
        if (out_f32)
            ((float*)y)[row + n0 + r] = sums[r];
        else
            ((bf16_t*)y)[row + n0 + r] = f32_to_bf16(sums[r]);
    }
}

// One x row against weight rows n0..n0+3 (each output's own accumulator over k, in order).
static inline void gemv_1x4(const bf16_t* xm, const bf16_t* w0, int64_t K,
                            const bf16_t* ahead, __m512 out[4]) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    __m512 acc2 = _mm512_setzero_ps(), acc3 = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 32) {
        __mmask32 mask = tail_mask(K, k);
        if (ahead) prefetch_block(ahead, k);
        __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, xm + k);
        acc0 = _mm512_dpbf16_ps(acc0, xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, w0 + k));
        acc1 = _mm512_dpbf16_ps(acc1, xv, (__m512bh)_mm512_maskz_loadu_epi16(mask, w0 + K + k));
        acc2 = _mm512_dpbf16_ps(acc2, xv,
                                (__m512bh)_mm512_maskz_loadu_epi16(mask, w0 + 2 * K + k));
        acc3 = _mm512_dpbf16_ps(acc3, xv,
                                (__m512bh)_mm512_maskz_loadu_epi16(mask, w0 + 3 * K + k));
    }
    out[0] = acc0, out[1] = acc1, out[2] = acc2, out[3] = acc3;
}

// Four x rows against weight rows n0..n0+3: each weight vector loaded once feeds four dot
// products (16 accumulators in registers), so the kernel stays load-light up to ~16 rows.
#define DP4(i, xv)                                                   \
    a##i##0 = _mm512_dpbf16_ps(a##i##0, xv, w0v);                    \
    a##i##1 = _mm512_dpbf16_ps(a##i##1, xv, w1v);                    \
    a##i##2 = _mm512_dpbf16_ps(a##i##2, xv, w2v);                    \
    a##i##3 = _mm512_dpbf16_ps(a##i##3, xv, w3v);
static inline void gemv_4x4(const bf16_t* x, const bf16_t* w0, const bf16_t* bias, void* y,
                            int64_t m, int64_t N, int64_t K, int64_t n0, const bf16_t* ahead,
                            int out_f32) {
    __m512 a00 = _mm512_setzero_ps(), a01 = a00, a02 = a00, a03 = a00;
    __m512 a10 = a00, a11 = a00, a12 = a00, a13 = a00;
    __m512 a20 = a00, a21 = a00, a22 = a00, a23 = a00;
    __m512 a30 = a00, a31 = a00, a32 = a00, a33 = a00;
    for (int64_t k = 0; k < K; k += 32) {
        __mmask32 mask = tail_mask(K, k);
        if (ahead) prefetch_block(ahead, k);
        __m512bh w0v = (__m512bh)_mm512_maskz_loadu_epi16(mask, w0 + k);
        __m512bh w1v = (__m512bh)_mm512_maskz_loadu_epi16(mask, w0 + K + k);
        __m512bh w2v = (__m512bh)_mm512_maskz_loadu_epi16(mask, w0 + 2 * K + k);
        __m512bh w3v = (__m512bh)_mm512_maskz_loadu_epi16(mask, w0 + 3 * K + k);
        __m512bh x0 = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + k);
        DP4(0, x0)
        __m512bh x1 = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + K + k);
        DP4(1, x1)
        __m512bh x2 = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + 2 * K + k);
        DP4(2, x2)
        __m512bh x3 = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + 3 * K + k);
        DP4(3, x3)
    }
    store_sums(a00, a01, a02, a03, bias, y, m * N, n0, out_f32);
    store_sums(a10, a11, a12, a13, bias, y, (m + 1) * N, n0, out_f32);
    store_sums(a20, a21, a22, a23, bias, y, (m + 2) * N, n0, out_f32);
    store_sums(a30, a31, a32, a33, bias, y, (m + 3) * N, n0, out_f32);
}
#undef DP4

// Weight rows n0..n0+3 (w0: the first, rows K apart) against every x row. The block (4 x K
// bf16) stays in L1 while the x rows pass over it, so memory sees each weight once; `ahead`
// (or NULL) is fetched meanwhile. Also the quantized matmul's, on a block it dequantized.
void gemv_block4(const bf16_t* x, const bf16_t* w0, const bf16_t* bias, void* y, int64_t M,
                 int64_t N, int64_t K, int64_t n0, const bf16_t* ahead, int out_f32) {
    int64_t m = 0;
    for (; m + 4 <= M; m += 4, ahead = NULL)
        gemv_4x4(x + m * K, w0, bias, y, m, N, K, n0, ahead, out_f32);
    for (; m < M; m++, ahead = NULL) {
        __m512 acc[4];
        gemv_1x4(x + m * K, w0, K, ahead, acc);
        store_sums(acc[0], acc[1], acc[2], acc[3], bias, y, m * N, n0, out_f32);
    }
}
#endif

static void gemv_row_generic(const bf16_t* x, const bf16_t* w, const bf16_t* bias, bf16_t* y,
                             int64_t M, int64_t N, int64_t K, int64_t n) {
    for (int64_t m = 0; m < M; m++) {
        float sum = 0.0f;
        for (int64_t k = 0; k < K; k++)
            sum += bf16_to_f32(x[m * K + k]) * bf16_to_f32(w[n * K + k]);
        if (bias) sum += bf16_to_f32(bias[n]);
        y[m * N + n] = f32_to_bf16(sum);
    }
}

void minisgl_gemv_bf16(const bf16_t* x, const bf16_t* w, const bf16_t* bias, bf16_t* y,
                       int64_t M, int64_t N, int64_t K, int nthreads) {
    int64_t full_blocks = N / 4;
    // Guided: long runs of consecutive blocks (the prefetch two blocks on stays useful), then
    // shorter ones, so a thread that fell behind (preempted, slower memory) is helped out at
    // the end instead of waited for: batch 8 decode 4-5% faster than static halves.
#pragma omp parallel for num_threads(nthreads) schedule(guided)
    for (int64_t blk = 0; blk < full_blocks; blk++) {
        int64_t n0 = blk * 4;
#ifdef HAVE_AVX512_BF16
        // Prefetch runs two blocks ahead.
        const bf16_t* ahead = n0 + 8 < full_blocks * 4 ? w + (n0 + 8) * K : NULL;
        gemv_block4(x, w + n0 * K, bias, y, M, N, K, n0, ahead, 0);
#else
        for (int64_t r = 0; r < 4; r++) gemv_row_generic(x, w, bias, y, M, N, K, n0 + r);
#endif
    }
    for (int64_t n = full_blocks * 4; n < N; n++) gemv_row_generic(x, w, bias, y, M, N, K, n);
}
