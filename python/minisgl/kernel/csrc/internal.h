// What one kernel file defines and others use: the packed weight's block shape, the
// attention kernels' head limits, and the elementwise rows the fused attention inputs reuse.
#pragma once

#include "common.h"

// The packed (tile-layout) weight's blocks: AMX_NBLOCK output columns by AMX_KSTEP-wide
// k-steps (matmul.c describes the layout, packing.c writes it and reads rows back).
#define AMX_KSTEP 32
#define AMX_NBLOCK 32

// What the packed matmul writes: bf16 rows of y, silu(gate) * up (bf16) from a gate_up weight
// packed with its gate and up rows interleaved in 16s, or float32 rows (logits, unrounded).
#define EPILOGUE_BF16 0
#define EPILOGUE_GATED 1
#define EPILOGUE_F32 2

// The largest head_dim the attention kernels take (their per-head buffers; abi.MAX_HEAD_DIM).
#define ATTN_MAX_DIM 256

// Whether attention kernels can take these heads: a whole number of query heads per kv head.
static inline int heads_fit(int64_t num_heads, int64_t num_kv_heads) {
    return num_kv_heads > 0 && num_heads > 0 && num_heads % num_kv_heads == 0;
}

// elementwise.c: a row of minisgl_add_rms_norm and a token's heads of minisgl_rotary (each
// one compiled form, which the attention blocks share), and the rotary tables' bounds check.
MINISGL_INTERNAL void add_rms_norm_row(const void* x, const void* residual, const void* weight,
                                       void* out, void* residual_out, int64_t r, int64_t hidden,
                                       float eps, int dtype);
MINISGL_INTERNAL void rotary_token(void* x, int64_t base, int64_t heads, int64_t dim,
                                   const float* cos, const float* sin, int dtype);
MINISGL_INTERNAL int positions_fit(const int64_t* positions, int64_t tokens,
                                   int64_t max_positions);

// The row layout of a quantized weight (quantized.c describes it): what its kernels share.
#define QBLOCK 4  // weight rows a work item takes
#define QROWS 4   // x rows one pass over a weight row multiplies

// Floats a row's scales (or mins) take in scratch: whole vectors of 16.
static inline int64_t padded(int64_t groups) { return (groups + 15) / 16 * 16; }

// A weight row's scales (or mins) as float32 into dst (padded(groups) floats).
static inline void group_floats(const quantized_weight* w, const void* src, int64_t n,
                                int64_t groups, float* dst) {
    if (w->scales_f32) {
        memcpy(dst, (const float*)src + n * groups, (size_t)groups * sizeof(float));
        return;
    }
    const uint16_t* half = (const uint16_t*)src + n * groups;
    int64_t g = 0;
#ifdef HAVE_AVX512
    // Whole-vector stores: the kernels read the values back at once, and a masked store would
    // not forward to those loads (a stall per weight row that cost as much as the row).
    for (; g < groups; g += 16) {
        const __mmask16 mask =
            groups - g >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << (groups - g)) - 1u);
        _mm512_storeu_ps(dst + g, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, half + g)));
    }
#elif defined(HAVE_AVX2_FMA)
    for (; g + 8 <= groups; g += 8)
        _mm256_storeu_ps(dst + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(half + g))));
    for (; g < groups; g++) dst[g] = _cvtsh_ss(half[g]);  // F16C too (half_to_f32 branches)
#endif
    for (; g < groups; g++) dst[g] = half_to_f32(half[g]);
}

// Each group's sum of x [M, K] (float32 where x_dtype is 0, else bf16) into sums [M, K /
// group], in column order: the offsets' term, x times each group's min.
static inline void x_group_sums(const void* x, int x_dtype, int64_t M, int64_t K, int64_t group,
                                float* sums) {
    for (int64_t m = 0; m < M; m++)
        for (int64_t g = 0; g < K / group; g++) {
            float sum = 0.0f;
            for (int64_t k = m * K + g * group; k < m * K + (g + 1) * group; k++)
                sum += x_dtype == 0 ? ((const float*)x)[k] : bf16_to_f32(((const bf16_t*)x)[k]);
            sums[m * (K / group) + g] = sum;
        }
}

// Stores row m's sum for output n in y's dtype (bias added in float32).
static inline void store_out(void* y, int64_t index, float sum, const void* bias, int64_t n,
                             int x_dtype, int out_f32) {
    if (bias) sum += x_dtype == 0 ? ((const float*)bias)[n] : bf16_to_f32(((const bf16_t*)bias)[n]);
    if (out_f32 || x_dtype == 0)
        ((float*)y)[index] = sum;
    else
        ((bf16_t*)y)[index] = f32_to_bf16(sum);
}

#ifdef HAVE_AVX2_FMA
#define AVX2_ROWS_MAX 8  // x rows up to which quantized_avx2.c streams each weight row once
#define AVX2_BLOCK 16    // weight rows a work item of its kernels takes
// quantized_avx2.c: weight row n dequantized to float32 (as dequant_row) into out [K]; rows
// n0..n1 (one work item) against M float32 x rows (xsums: their group sums where w has mins).
MINISGL_INTERNAL void dequant_row_avx2(const quantized_weight* w, int64_t n, int64_t K,
                                       const float* scales, const float* mins, float* out);
// xscale: x given as int16 (xf holds avx2_x_int16's x16, xscale its scales), else NULL.
MINISGL_INTERNAL void quantized_rows_avx2(const float* xf, const float* xscale,
                                          const float* xsums, const quantized_weight* w,
                                          const void* bias, void* y, int64_t M, int64_t N,
                                          int64_t K, int64_t n0, int64_t n1, int x_dtype,
                                          int out_f32, float* scratch);
// 8 x 8 floats transposed in registers: row i of the result is column i of rows.
static inline void transpose8(__m256 rows[8]) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(rows[i], rows[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(rows[i], rows[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int i = 0; i < 4; i++) {
        rows[i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x20);
        rows[4 + i] = _mm256_permute2f128_ps(u[i], u[4 + i], 0x31);
    }
}

// The x rows quantized_avx2.c's FMA tile multiplies: every row of xf [M, K] float32 against wt
// [K, AVX2_BLOCK] (weight rows n0..n1-1 dequantized, side by side per column) into y.
MINISGL_INTERNAL void avx2_block_rows(const float* xf, const float* wt, const void* bias, void* y,
                                      int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n1,
                                      int x_dtype, int out_f32);
// quantized_tiled_avx2.c: a tiled weight's matmul and rows where there is no vpdpbusd, their
// arguments checked; bf16 x as int16 (path QPATH_AVX2_TILED_INT16), else float32 products
// (QPATH_AVX2_TILED_F32). An 8-bit weight's bf16 rows take int16 at every row count (prefills
// of 65-2,048 rows 1.11-1.21x the float32 tiles, SmolLM2's layer on Zen 3); a 4- or 6-bit
// weight's up to AVX2_TILED_MAX_ROWS (past it int16 was level with float32, and int8 x would
// round a weight-only prefill's activations). layers/quantized.py's AVX2_TILED_MAX_ROWS is
// this number.
#define AVX2_TILED_MAX_ROWS 64
MINISGL_INTERNAL int quantized_tiled_avx2_linear(const void* x, const quantized_weight* w,
                                                 const void* bias, void* y, int64_t M, int64_t N,
                                                 int64_t K, int x_dtype, int path, int out_f32,
                                                 int nthreads);
MINISGL_INTERNAL int quantized_tiled_avx2_rows(const quantized_weight* w, const int64_t* ids,
                                               void* out, int64_t count, int64_t K, int dtype,
                                               int nthreads);
// Whether M rows of x take the int16 form against w: bf16, up to AVX2_ROWS_MAX rows, K a
// multiple of 32, each 32 columns within one group (or two groups of 16).
MINISGL_INTERNAL int avx2_int16_rows(const quantized_weight* w, int64_t M, int64_t K,
                                     int x_dtype);
// bf16 x rows as int16 per 32 columns (scale max|x| / 32767, nearest) into x16 [M, K], the
// scales into xscale [M, K / 32].
MINISGL_INTERNAL void avx2_x_int16(const bf16_t* x, int64_t M, int64_t K, int16_t* x16,
                                   float* xscale);
#endif

#ifdef HAVE_AVX512_BF16
// gemv.c: rows n0..n0+3 of a row-major bf16 weight (w0: the first) against every row of x
// (M rows), into y [M, N] as bf16, or float32 where out_f32; `ahead`: memory to prefetch.
MINISGL_INTERNAL void gemv_block4(const bf16_t* x, const bf16_t* w0, const bf16_t* bias, void* y,
                                  int64_t M, int64_t N, int64_t K, int64_t n0,
                                  const bf16_t* ahead, int out_f32);
// matmul.c: every row of x (K = ksteps * AMX_KSTEP) times one block of a packed copy (wblock,
// 64-byte aligned; columns n0..n0+31 of y, those below N), bf16 or float32 out.
MINISGL_INTERNAL void packed_block_rows(const bf16_t* x, const bf16_t* wblock, const bf16_t* bias,
                                        void* y, int64_t M, int64_t N, int64_t ksteps, int64_t n0,
                                        int out_f32);
#endif

#if defined(HAVE_AVX2_FMA) && !defined(HAVE_AVX512_BF16)
// matmul_avx2.c: x [M, K] times a packed copy with FMA (no bf16 dot products), any M, into y
// [M, N] through the epilogue (EPILOGUE_GATED: y [M, N / 2]). MINISGL_OK or MINISGL_ERR_NOMEM.
MINISGL_INTERNAL int packed_matmul_avx2(const bf16_t* x, const bf16_t* packed, const bf16_t* bias,
                                        void* y, int64_t M, int64_t N, int64_t K, int epilogue,
                                        int nthreads);
#endif

#ifdef HAVE_AVX512
// matmul.c: rows [m0, m0 + rows) of a 32-column block at n0 (float32 sums, left: columns 0-15,
// right: 16-31) + bias into y through the epilogue (EPILOGUE_GATED: y [M, N / 2]).
MINISGL_INTERNAL void packed_store(const float (*left)[16], const float (*right)[16],
                                   const bf16_t* bias, void* y, int64_t N, int64_t m0,
                                   int64_t rows, int64_t n0, int epilogue);
#endif

#ifdef HAVE_AMX
// matmul.c: every row of x (zero rows up to whole 16-row tiles, row stride ldx) times one packed
// block on the AMX tiles (configured by the caller), through the epilogue; fill(ctx, kb) writes
// the block's k-step kb just before the tiles first take it.
MINISGL_INTERNAL void packed_block_tiles(const bf16_t* x, int64_t ldx, const bf16_t* wblock,
                                         const bf16_t* bias, void* y, int64_t M, int64_t N,
                                         int64_t ksteps, int64_t n0, int epilogue,
                                         void (*fill)(void* ctx, int64_t kb), void* ctx);
#endif

#ifdef HAVE_QUANTIZED_AMX
// Rows from which a tiled quantized weight meets bf16 x on the AMX tiles (quantized_amx.c)
// instead of in int8 products (quantized_tiled.c); layers/quantized.py's
// QUANTIZED_AMX_MIN_ROWS is this number.
#define QUANTIZED_AMX_MIN_ROWS 10
// quantized_amx.c: a tiled quantized weight (w->tiled) against bf16 x, dequantized block by
// block onto the tiles; epilogue EPILOGUE_GATED: N = 2 * inter gate and up rows, y [M, inter].
MINISGL_INTERNAL int quantized_amx_linear(const bf16_t* x, const quantized_weight* w,
                                          const bf16_t* bias, void* y, int64_t M, int64_t N,
                                          int64_t K, int epilogue, int nthreads);
#endif

// quantized_amx.c: tiled weight w [N, K] in the packed copy's layout (gated: gate and up paired).
MINISGL_INTERNAL int quantized_tiled_packed(const quantized_weight* w, bf16_t* packed, int64_t N,
                                            int64_t K, int gated, int nthreads);

// The tile layout of a quantized weight (layers/quant_tiles.py; quantized_tiled.c describes
// it), which quantized_tiled.c, quantized_amx.c and quantized_tiled_avx2.c read: TILE_ROWS
// weight rows a tile.
#define TILE_ROWS 16

// Bytes one tile's values take (bits 8, 6 or 4).
static inline int64_t tile_bytes(int64_t bits, int64_t K) { return 2 * bits * K; }

// Where the 16 rows' scales (or mins) of tile t, group g (index t * groups + g) start.
static inline const void* tile_group_at(const void* src, int64_t scales_f32, int64_t index) {
    return (const char*)src + index * TILE_ROWS * (scales_f32 ? 4 : 2);
}

// Columns a unit of the tiled kernels holds: within one x scale (32 columns) and one weight group.
static inline int64_t unit_cols(int64_t group) { return group % 32 == 0 ? 32 : 16; }

// Rows of the pass over a tile that starts at x row m0 of M, in passes of up to `most` rows as
// even in size as they can be (5 rows, 4 at most: 3 + 2, not 4 + 1, whose one-row pass would
// unpack the whole tile again for a single row).
static inline int64_t even_pass_rows(int64_t M, int64_t m0, int64_t most) {
    const int64_t left = M - m0, passes = (left + most - 1) / most;
    return (left + passes - 1) / passes;
}

#ifdef HAVE_AVX2_FMA
// The 8 rows' (half h of the tile) scales or mins of tile t, group g (index t * groups + g).
static inline __m256 half_floats(const void* src, int64_t scales_f32, int64_t index, int64_t h) {
    const char* at = (const char*)tile_group_at(src, scales_f32, index);
    if (scales_f32) return _mm256_loadu_ps((const float*)at + 8 * h);
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)((const uint16_t*)at + 8 * h)));
}

// x rows one pass of AVX2's tiled kernels multiplies against a tile (quantized_tiled_avx2*.c):
// its two halves' float sums of 4 rows fill half the registers; more spilled and ran slower.
#define AVX2_TILE_MR 4

// The offsets' term of x rows m0..m0+R-1 of a pass (acc: each half's 8 weight rows per x row):
// the tile's mins times x's own group sums (xsum [M, groups]), summed apart in registers after
// the products and added once (added group by group, acc went through memory between the
// products' units each time: 15% of a 4-row pass).
static inline __attribute__((always_inline)) void add_offsets(__m256 acc[2][AVX2_TILE_MR],
                                                              const quantized_weight* w,
                                                              const float* xsum, int64_t t,
                                                              int64_t groups, int64_t m0,
                                                              const int R) {
    __m256 offsets[2][AVX2_TILE_MR];
    for (int p = 0; p < 2; p++)
        for (int r = 0; r < R; r++) offsets[p][r] = _mm256_setzero_ps();
    for (int64_t g = 0; g < groups; g++)
        for (int p = 0; p < 2; p++) {
            const __m256 mins = half_floats(w->mins, w->scales_f32, t * groups + g, p);
            for (int r = 0; r < R; r++)
                offsets[p][r] = _mm256_fmadd_ps(
                    mins, _mm256_set1_ps(xsum[(m0 + r) * groups + g]), offsets[p][r]);
        }
    for (int p = 0; p < 2; p++)
        for (int r = 0; r < R; r++) acc[p][r] = _mm256_add_ps(acc[p][r], offsets[p][r]);
}

// 8 float32 lanes as bf16 (f32_to_bf16's nearest even and quiet NaNs, lane by lane).
static inline __m128i f32x8_to_bf16(__m256 v) {
    const __m256i u = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    const __m256i rounded = _mm256_srli_epi32(
        _mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    const __m256i quiet = _mm256_or_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(0x40));
    const __m256i words = _mm256_blendv_epi8(rounded, quiet, nan);
    const __m256i packed = _mm256_packus_epi32(words, words);  // per 128-bit lane: 4 words twice
    return _mm_unpacklo_epi64(_mm256_castsi256_si128(packed), _mm256_extracti128_si256(packed, 1));
}

// A pass's sums (acc) into rows m0..m0+R-1 of y [M, N], tile t's outputs below N: 8 at a time
// (with a bf16 bias; each output as store_out gives it), a half past N one by one. One by one
// (Zen 3) they cost a 4-row pass over a 576-column weight in L2 8%, and the default model's
// 49,152-row head at batch 1 17%.
static inline __attribute__((always_inline)) void store_tile_rows(
    __m256 acc[2][AVX2_TILE_MR], const void* bias, void* y, int64_t N, int64_t t, int64_t m0,
    int out_f32, const int R) {
    for (int p = 0; p < 2; p++)
        for (int r = 0; r < R; r++) {
            const int64_t n0 = t * TILE_ROWS + 8 * p, at = (m0 + r) * N + n0;
            if (n0 + 8 <= N) {
                __m256 sums = acc[p][r];
                if (bias) {
                    const __m128i raw = _mm_loadu_si128((const __m128i*)((const bf16_t*)bias + n0));
                    const __m256i widened = _mm256_slli_epi32(_mm256_cvtepu16_epi32(raw), 16);
                    sums = _mm256_add_ps(sums, _mm256_castsi256_ps(widened));
                }
                if (out_f32)
                    _mm256_storeu_ps((float*)y + at, sums);
                else
                    _mm_storeu_si128((__m128i*)((bf16_t*)y + at), f32x8_to_bf16(sums));
                continue;
            }
            float sums[8];
            _mm256_storeu_ps(sums, acc[p][r]);
            for (int64_t l = 0; l < 8 && n0 + l < N; l++)
                store_out(y, at + l, sums[l], bias, n0 + l, 1, out_f32);
        }
}

// 32 bf16 columns at src rounded to integers of at most `limit` in magnitude (nearest even):
// into ints (4 vectors of 8, in column order); returns their scale, max|x| / limit (0: all 0).
static inline float bf16_block_round(const bf16_t* src, float limit, __m256i ints[4]) {
    const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
    __m256 v[4], top = _mm256_setzero_ps();
    for (int i = 0; i < 4; i++) {
        const __m128i half = _mm_loadu_si128((const __m128i*)(src + 8 * i));
        v[i] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(half), 16));
        top = _mm256_max_ps(top, _mm256_and_ps(v[i], abs_mask));
    }
    __m128 t = _mm_max_ps(_mm256_castps256_ps128(top), _mm256_extractf128_ps(top, 1));
    t = _mm_max_ps(t, _mm_movehl_ps(t, t));
    t = _mm_max_ss(t, _mm_movehdup_ps(t));
    const float scale = _mm_cvtss_f32(t) / limit;
    const __m256 inverse = _mm256_set1_ps(scale > 0.0f ? 1.0f / scale : 0.0f);
    for (int i = 0; i < 4; i++) ints[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inverse));
    return scale;
}

// A pass's start on group g of tile t: the two halves' scales; the first pass (m0 0) also
// fetches the scales and mins `ahead` groups on (unfetched, their misses cost the VNNI kernel a
// tenth of a batch of 1's time).
static inline __attribute__((always_inline)) void group_scales(
    __m256 scale[2], const quantized_weight* w, int64_t t, int64_t g, int64_t groups,
    int64_t ahead, int64_t m0) {
    const int64_t index = t * groups + g;
    for (int p = 0; p < 2; p++) scale[p] = half_floats(w->scales, w->scales_f32, index, p);
    if (m0 == 0) {
        __builtin_prefetch(tile_group_at(w->scales, w->scales_f32, index + ahead));
        if (w->mins) __builtin_prefetch(tile_group_at(w->mins, w->scales_f32, index + ahead));
    }
}

// The first pass (m0 0) over a tile fetches its values `ahead` units of `bytes` on (past the
// tile's end: the next tile, the same thread's).
static inline void prefetch_unit(const uint8_t* tile, int64_t u, int64_t ahead, int64_t bytes,
                                 int64_t m0) {
    if (m0 != 0) return;
    const uint8_t* next = tile + (u + ahead) * bytes;
    for (int64_t line = 0; line < bytes; line += 64)
        _mm_prefetch((const char*)(next + line), _MM_HINT_T0);
}

// quantized_tiled_avx2_int8.c: bf16 x of up to AVX2_TILED_MAX_ROWS rows against a 4- or 6-bit
// tiled weight in one int8 pass (path QPATH_AVX2_TILED_INT8), its arguments checked.
MINISGL_INTERNAL int quantized_tiled_avx2_int8_linear(const bf16_t* x, const quantized_weight* w,
                                                      const void* bias, void* y, int64_t M,
                                                      int64_t N, int64_t K, int out_f32,
                                                      int nthreads);
#endif

#ifdef HAVE_AVX512
// The 6-bit values (0..63 a byte) of a 6-bit tile's quad vector: its 4 low bits (nibbles, one a
// byte) and, from the chunk's top-bits vector for its half, crumb j (bits 2j..2j+1) of each byte.
static inline __m512i six_bits(__m512i nibbles, __m512i tops, int j) {
    const __m512i top = j == 0   ? _mm512_slli_epi32(tops, 4)
                        : j == 1 ? _mm512_slli_epi32(tops, 2)
                        : j == 2 ? tops
                                 : _mm512_srli_epi32(tops, 2);
    return _mm512_ternarylogic_epi32(nibbles, top, _mm512_set1_epi8(0x30), 0xF8);  // a | (b & c)
}

// The 16 rows' scales (or mins) of tile t, group g, as float32 lanes.
static inline __m512 tile_floats(const void* src, int64_t scales_f32, int64_t index) {
    const void* at = tile_group_at(src, scales_f32, index);
    if (scales_f32) return _mm512_loadu_ps(at);
    return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)at));
}
#endif

#ifdef HAVE_AVX512
// The 16-row tiles block b (32 output columns) of an N-row tiled weight pairs, as the packed
// copy's blocks and the AMX kernels take them (right -1: none, zeros); gated: N = 2 * inter
// rows of gate, then up, paired in 16s (the gated epilogue's order).
static inline void block_tiles(int64_t b, int64_t N, int gated, int64_t* left, int64_t* right) {
    const int64_t tiles = (N + TILE_ROWS - 1) / TILE_ROWS;
    *left = gated ? b : 2 * b;
    *right = gated ? N / 32 + b : (2 * b + 1 < tiles ? 2 * b + 1 : -1);
}
#endif

// W8A8 (quantized_w8a8.c): an 8-bit tiled weight with one scale per row (group K, no mins)
// against bf16 x of more than W8A8_MIN_ROWS rows rounded to int8 per row, on the AMX int8
// tiles, or in vpdpbusd where there are none (quantized_w8a8_vnni.c); below that many rows the
// call's fixed costs, the column maxima and the outlier columns, outweigh the 16-bit products.
// K up to W8A8_MAX_K keeps every int32 sum exact (127 * 255 * K < 2^31).
// kernel/quantized.py's W8A8_MIN_ROWS is this number.
#define W8A8_MIN_ROWS 5
#define W8A8_MAX_K 65536
static inline int w8a8_fits(const quantized_weight* w, int64_t K) {
    return w->tiled && w->bits == 8 && w->group == K && !w->mins && K <= W8A8_MAX_K;
}
#ifdef HAVE_AVX512_VNNI
// The 16 rows' integers (-128..127) at column k of 8-bit tile quads from `quads` (quad k / 4,
// byte k % 4 of each lane, stored +128): the W8A8 tasks' outlier columns.
static inline __m512i tile_column_integers(const uint8_t* quads, int64_t k) {
    const __m512i quad = _mm512_loadu_si512(quads + k / 4 * 64);
    const __m512i shifted = _mm512_srlv_epi32(quad, _mm512_set1_epi32((int)(8 * (k % 4))));
    return _mm512_sub_epi32(_mm512_and_si512(shifted, _mm512_set1_epi32(255)),
                            _mm512_set1_epi32(128));
}
// The most columns of largest magnitude a call keeps out of the int8 rounding.
#define W8A8_OUTLIERS 64
#define W8A8_KSTEP 64  // columns an int8 tile product takes (x rows padded to whole ones)
// x rounded to int8 per row: xq [mpad, ldx] (columns past K, outlier columns and rows past M
// zero), each row's scale and 128 times its integers' sum (the weight's +128 meets it); the
// outlier columns' indices (ascending) and x's values there, xout [mpad, W8A8_OUTLIERS] bf16
// (zeros past the count and M), and the same values to int16 per row, xout16 with oscale (15
// bits of the row's largest: as fine as bf16; NaN where one is not finite).
typedef struct {
    int8_t* xq;
    float* scale;
    int32_t* offset;
    int64_t ldx;
    int64_t outliers[W8A8_OUTLIERS];
    int64_t count;  // outlier columns (pick_outliers' count, K when K is fewer)
    bf16_t* xout;
    int16_t* xout16;
    float* oscale;
} int8_rows;
// on_tiles: the AMX int8 tiles (HAVE_AMX_INT8 and granted), else vpdpbusd.
MINISGL_INTERNAL int quantized_w8a8_linear(const bf16_t* x, const quantized_weight* w,
                                           const bf16_t* bias, void* y, int64_t M, int64_t N,
                                           int64_t K, int epilogue, int on_tiles, int nthreads);
// quantized_w8a8_vnni.c: rows [m0, m1) of xs (whole 16s) times `blocks` (up to
// W8A8_VNNI_BLOCKS) 32-column blocks from block b, through the epilogue.
#define W8A8_VNNI_BLOCKS 2
MINISGL_INTERNAL void w8a8_vnni_task(const int8_rows* xs, const quantized_weight* w,
                                     const bf16_t* bias, void* y, int64_t M, int64_t N,
                                     int64_t K, int64_t b, int64_t blocks, int64_t m0,
                                     int64_t m1, int epilogue);
#endif
#ifdef HAVE_AMX_INT8
// Whether the CPU has AMX-INT8 (common.c; set by minisgl_has_amx): its tiles are usable too.
MINISGL_INTERNAL extern int amx_int8_granted;
// quantized_w8a8_amx.c: rows [m0, m1) of xs (whole 32-row pairs but the last, which may be one
// 16-row tile) times tiles left and right (-1: none), y's columns n0.., through the epilogue.
MINISGL_INTERNAL void w8a8_amx_task(const int8_rows* xs, const quantized_weight* w,
                                    const bf16_t* bias, void* y, int64_t M, int64_t N, int64_t K,
                                    int64_t left, int64_t right, int64_t n0, int64_t m0,
                                    int64_t m1, int epilogue);
#endif

#ifdef HAVE_AVX512_VNNI
// quantized_tiled.c: minisgl_quantized_linear and minisgl_quantized_rows for a weight in the
// tile layout (w->tiled), their arguments checked.
// path: minisgl_quantized_path's choice, one of the QPATH_TILED_* (float32 x for TILED_F32).
MINISGL_INTERNAL int quantized_tiled_linear(const void* x, const quantized_weight* w,
                                            const void* bias, void* y, int64_t M, int64_t N,
                                            int64_t K, int path, int out_f32, int nthreads);
MINISGL_INTERNAL int quantized_tiled_rows(const quantized_weight* w, const int64_t* ids,
                                          void* out, int64_t count, int64_t K, int dtype,
                                          int nthreads);
#endif
