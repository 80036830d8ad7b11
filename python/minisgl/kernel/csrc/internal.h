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

#ifdef __AVX512F__
// The tile layout of a quantized weight (layers/quant_tiles.py; quantized_tiled.c describes
// it), which quantized_tiled.c and quantized_amx.c read: TILE_ROWS weight rows a tile.
#define TILE_ROWS 16

// Bytes one tile's values take (bits 8, 6 or 4).
static inline int64_t tile_bytes(int64_t bits, int64_t K) { return 2 * bits * K; }

// Where the 16 rows' scales (or mins) of tile t, group g (index t * groups + g) start.
static inline const void* tile_group_at(const void* src, int64_t scales_f32, int64_t index) {
    return (const char*)src + index * TILE_ROWS * (scales_f32 ? 4 : 2);
}

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

#ifdef HAVE_AVX512_VNNI
// quantized_tiled.c: minisgl_quantized_linear and minisgl_quantized_rows for a weight in the
// tile layout (w->tiled), their arguments checked.
MINISGL_INTERNAL int quantized_tiled_linear(const void* x, const quantized_weight* w,
                                            const void* bias, void* y, int64_t M, int64_t N,
                                            int64_t K, int x_dtype, int out_f32, int nthreads);
MINISGL_INTERNAL int quantized_tiled_rows(const quantized_weight* w, const int64_t* ids,
                                          void* out, int64_t count, int64_t K, int dtype,
                                          int nthreads);
#endif
