#include "common.h"
#include "internal.h"
#include "simd.h"

// ------------------------------------------------------------------------ packed matmul
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for every row count above the GEMV's, with the
// AMX tile unit where the CPU has it (oneDNN's bf16 matmul does not overlap streaming the
// weights with the tile math), else with vdpbf16ps on the same layout (vec_rows). The weight
// is packed once into the tile layout
// (zero-padded to whole 32 x 32 blocks): for each block of 32 output columns, for each 32-wide
// step of k, two 16-column tiles of 16 k-pairs ("VNNI": w[n][k], w[n][k+1] adjacent), 2 KB
// read in order. Each 32 x 32 block of the result lives in four accumulator tiles
// (two 16-row tiles of x times two 16-column tiles of w) over the whole of k.

#define AMX_MGROUP 64        // rows per task: a task's weight block is reused from cache
#define AMX_PREFETCH_STEPS 4  // k-steps ahead the weight tiles are prefetched
#define VEC_ROWS 6            // x rows per register block without tiles (vec_rows)

#ifdef HAVE_AVX512
// Two accumulator tiles side by side (float32 rows of 16 columns: columns n0.. and n0 + 16..)
// + bias -> bf16 rows of y, a 64-byte line per row, for valid rows and columns only.
static inline void amx_store(const float (*left)[16], const float (*right)[16],
                             const bf16_t* bias, bf16_t* y, int64_t N, int64_t m0, int64_t rows,
                             int64_t n0) {
    const __mmask32 cols = N - n0 >= 32 ? 0xffffffffu : (__mmask32)((1ull << (N - n0)) - 1u);
    __m512 bias_left = _mm512_setzero_ps(), bias_right = _mm512_setzero_ps();
    if (bias) {
        const __m512i b = _mm512_maskz_loadu_epi16(cols, bias + n0);
        bias_left = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(b)), 16));
        bias_right = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(b, 1)), 16));
    }
    for (int64_t r = 0; r < rows; r++) {
        const __m512 l = _mm512_add_ps(_mm512_load_ps(left[r]), bias_left);
        const __m512 h = _mm512_add_ps(_mm512_load_ps(right[r]), bias_right);
#ifdef HAVE_AVX512_BF16
        const __m512i v = (__m512i)_mm512_cvtne2ps_pbh(h, l);
#else  // (W8A8 in vpdpbusd on a CPU without bf16: the same rounding, finite lanes)
        const __m512i v = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm512_cvtepi32_epi16(
                _mm512_srli_epi32(_mm512_castps_si512(round_bf16_512(l)), 16))),
            _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16_512(h)), 16)),
            1);
#endif
        _mm512_mask_storeu_epi16(y + (m0 + r) * N + n0, cols, v);
    }
}

// The gated form: the left tile holds 16 gate columns, the right one the matching 16 up
// columns (the weight packed with its gate and up rows interleaved in 16s, bias likewise);
// writes round(silu(gate)) * up, rounded as minisgl_silu_and_mul rounds, to 16 columns of y
// [M, width] from col0.
static inline void amx_store_gated(const float (*gate)[16], const float (*up)[16],
                                   const bf16_t* bias, bf16_t* y, int64_t width, int64_t m0,
                                   int64_t rows, int64_t col0) {
    const __mmask16 cols = width - col0 >= 16 ? 0xffff : (__mmask16)((1u << (width - col0)) - 1u);
    __m512 bias_gate = _mm512_setzero_ps(), bias_up = _mm512_setzero_ps();
    if (bias) {
        bias_gate = _mm512_castsi512_ps(
            _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)bias)), 16));
        bias_up = _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(bias + 16))), 16));
    }
    for (int64_t r = 0; r < rows; r++) {
        const __m512 g = round_bf16_512(_mm512_add_ps(_mm512_load_ps(gate[r]), bias_gate));
        const __m512 u = round_bf16_512(_mm512_add_ps(_mm512_load_ps(up[r]), bias_up));
        const __m512i v = _mm512_castps_si512(silu_times(g, u, 1));  // already bf16-rounded
        _mm256_mask_storeu_epi16(y + (m0 + r) * width + col0, cols,
                                 _mm512_cvtepi32_epi16(_mm512_srli_epi32(v, 16)));
    }
}

// Float32 rows: left/right tiles + bias straight to 32 columns of y [M, N] from n0.
static inline void store_f32(const float (*left)[16], const float (*right)[16],
                             const bf16_t* bias, float* y, int64_t N, int64_t m0, int64_t rows,
                             int64_t n0) {
    const int64_t valid = N - n0 >= 32 ? 32 : N - n0;
    const __mmask16 cols_left = valid >= 16 ? 0xffff : (__mmask16)((1u << valid) - 1u);
    const __mmask16 cols_right = valid <= 16 ? 0 : (__mmask16)((1u << (valid - 16)) - 1u);
    __m512 bias_left = _mm512_setzero_ps(), bias_right = _mm512_setzero_ps();
    if (bias) {
        bias_left = bf16x16_to_f32(_mm256_maskz_loadu_epi16(cols_left, bias + n0));
        bias_right = bf16x16_to_f32(_mm256_maskz_loadu_epi16(cols_right, bias + n0 + 16));
    }
    for (int64_t r = 0; r < rows; r++) {
        float* row = y + (m0 + r) * N + n0;
        _mm512_mask_storeu_ps(row, cols_left, _mm512_add_ps(_mm512_load_ps(left[r]), bias_left));
        _mm512_mask_storeu_ps(row + 16, cols_right,
                              _mm512_add_ps(_mm512_load_ps(right[r]), bias_right));
    }
}

// Rows [m0, m0 + rows) of a 32-column block at n0 (left: columns 0-15, right: 16-31) into y
// through the epilogue.
void packed_store(const float (*left)[16], const float (*right)[16], const bf16_t* bias, void* y,
                  int64_t N, int64_t m0, int64_t rows, int64_t n0, int epilogue) {
    if (epilogue == EPILOGUE_GATED)
        amx_store_gated(left, right, bias ? bias + n0 : NULL, (bf16_t*)y, N / 2, m0, rows,
                        n0 / 2);
    else if (epilogue == EPILOGUE_F32)
        store_f32(left, right, bias, (float*)y, N, m0, rows, n0);
    else
        amx_store(left, right, bias, (bf16_t*)y, N, m0, rows, n0);
}
#endif

#ifdef HAVE_AVX512_BF16
// A 32 x 32 block's four accumulator tiles (rows m.. of y, up to m1) through the epilogue.
static inline void amx_store_block(const float (*acc)[16][16], const bf16_t* bias, void* y,
                                   int64_t M, int64_t N, int64_t m, int64_t m1, int64_t n0,
                                   int epilogue) {
    for (int mt = 0; mt < 2 && m + 16 * mt < m1; mt++) {
        const int64_t first_row = m + 16 * mt;
        const int64_t rows = M - first_row < 16 ? M - first_row : 16;
        if (rows <= 0) break;
        packed_store(acc[2 * mt], acc[2 * mt + 1], bias, y, N, first_row, rows, n0, epilogue);
    }
}

// The tile layout read with vdpbf16ps, where there are no tiles: row p of a k-step's tile (16
// columns' k-pairs 2p, 2p + 1) is one vector, each x row's pair broadcast against it. ROWS rows
// of x (from a, stride ldx) times BLOCKS adjacent 32-column blocks, summed over every k-step
// in registers (6 x 4 vectors: 4 weight loads and 6 broadcasts feed 24 dot products); block
// j's sums go to part[j][0] (columns 0-15) and part[j][1] (16-31) at row r0. ahead: the next
// two blocks (4 lines a step over the pass), of which this pass fetches every spread-th line
// from line `pass`; or NULL.
static inline FORM_INLINE void vec_rows(
    const bf16_t* a, int64_t ldx, const bf16_t* wblock, int64_t ksteps,
    float (*part)[2][AMX_MGROUP][16], int64_t r0, const char* ahead, int pass, int spread,
    const int ROWS, const int BLOCKS) {
    const int64_t block_elems = ksteps * AMX_NBLOCK * AMX_KSTEP;
    __m512 acc[VEC_ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < 2 * BLOCKS; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < ksteps; kb++) {
        const bf16_t* b = wblock + kb * AMX_NBLOCK * AMX_KSTEP;
        const bf16_t* xk = a + kb * AMX_KSTEP;
        for (int p = 0; p < 16; p++) {
            if (ahead) {
                const int64_t step = kb * 16 + p;
                for (int line = (int)((pass - 4 * step) & (spread - 1)); line < 4; line += spread)
                    __builtin_prefetch(ahead + (step * 4 + line) * 64, 0, 3);
            }
            __m512bh w[4];
            for (int j = 0; j < BLOCKS; j++) {
                w[2 * j] = (__m512bh)_mm512_load_si512(b + j * block_elems + 32 * p);
                w[2 * j + 1] = (__m512bh)_mm512_load_si512(b + j * block_elems + 512 + 32 * p);
            }
            for (int r = 0; r < ROWS; r++) {
                const __m512bh xv = broadcast_pair(xk + r * ldx + 2 * p);
                for (int c = 0; c < 2 * BLOCKS; c++)
                    acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, w[c]);
            }
        }
    }
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < 2 * BLOCKS; c++) _mm512_store_ps(part[c / 2][c % 2][r0 + r], acc[r][c]);
}

// amx_task without tiles: rows [m0, m1) (at most AMX_MGROUP) of x times `blocks` (1 or 2)
// adjacent column blocks from n0, VEC_ROWS rows at a time, fetching `ahead` meanwhile.
static void vec_task(const bf16_t* x, int64_t ldx, const bf16_t* wblock, const bf16_t* bias,
                     void* y, int64_t M, int64_t N, int64_t ksteps, int64_t m0, int64_t m1,
                     int64_t n0, int epilogue, int blocks, const char* ahead) {
    float part[2][2][AMX_MGROUP][16] __attribute__((aligned(64)));
    if (m1 > M) m1 = M;
    // The next pair's lines are spread over up to 8 passes (a power of two): fetched all in the
    // first, they were demanded at several times the memory's rate and stalled it; spread,
    // the 64-row matmuls of a Qwen3-0.6B decode step ran 66 -> 55 ms.
    const int64_t passes = (m1 - m0 + VEC_ROWS - 1) / VEC_ROWS;
    int spread = 1;
    while (spread < 8 && 2 * spread <= passes) spread *= 2;
    for (int64_t m = m0; m < m1; m += VEC_ROWS) {
        const int64_t rows = m1 - m < VEC_ROWS ? m1 - m : VEC_ROWS;
        const bf16_t* a = x + m * ldx;
        const int pass = (int)((m - m0) / VEC_ROWS);
        const char* fetch = pass < spread ? ahead : NULL;
#define VEC_CASE(n)                                                                    \
    case n:                                                                            \
        if (blocks == 2)                                                               \
            vec_rows(a, ldx, wblock, ksteps, part, m - m0, fetch, pass, spread, n, 2); \
        else                                                                           \
            vec_rows(a, ldx, wblock, ksteps, part, m - m0, fetch, pass, spread, n, 1); \
        break;
        switch (rows) {
            VEC_CASE(6)
            VEC_CASE(5)
            VEC_CASE(4)
            VEC_CASE(3)
            VEC_CASE(2)
            default:
            VEC_CASE(1)
        }
#undef VEC_CASE
    }
    for (int j = 0; j < blocks; j++) {
        const int64_t col = n0 + 32 * j;
        if (col >= N) break;
        packed_store(part[j][0], part[j][1], bias, y, N, m0, m1 - m0, col, epilogue);
    }
}

// Every row of x (contiguous, K = ksteps * AMX_KSTEP) times one packed column block at n0
// (wblock, 64-byte aligned) with vdpbf16ps, bf16 or float32 out: the quantized matmul's, on a
// block it dequantized into the tile layout.
void packed_block_rows(const bf16_t* x, const bf16_t* wblock, const bf16_t* bias, void* y,
                       int64_t M, int64_t N, int64_t ksteps, int64_t n0, int out_f32) {
    for (int64_t m0 = 0; m0 < M; m0 += AMX_MGROUP)
        vec_task(x, ksteps * AMX_KSTEP, wblock, bias, y, M, N, ksteps, m0, m0 + AMX_MGROUP, n0,
                 out_f32 ? EPILOGUE_F32 : EPILOGUE_BF16, 1, NULL);
}

#endif

#ifdef HAVE_AMX
// k-step kb's two weight tiles into tmm6 and tmm7; the pass that streams the weights from
// memory also prefetches AMX_PREFETCH_STEPS steps ahead.
static inline FORM_INLINE void amx_load_weight_tiles(const bf16_t* wblock,
                                                                        int64_t kb,
                                                                        int64_t ksteps,
                                                                        int prefetch) {
    const bf16_t* b = wblock + kb * AMX_NBLOCK * AMX_KSTEP;
    if (prefetch && kb + AMX_PREFETCH_STEPS < ksteps)
        for (int line = 0; line < 32; line++)
            __builtin_prefetch(
                (const char*)(b + AMX_PREFETCH_STEPS * AMX_NBLOCK * AMX_KSTEP) + 64 * line, 0, 3);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + 512, 64);
}

// k-steps [kb0, kb1) of a block into accumulator tiles 0-1 (x rows from a0) and, with pair,
// 2-3 (rows from a1); the weight tiles from wblock.
static inline FORM_INLINE void amx_ksteps(const bf16_t* a0, const bf16_t* a1,
                                                             int pair, int64_t ldx,
                                                             const bf16_t* wblock, int64_t kb0,
                                                             int64_t kb1, int64_t ksteps,
                                                             int fetch) {
    for (int64_t kb = kb0; kb < kb1; kb++) {
        _tile_loadd(4, a0 + kb * AMX_KSTEP, ldx * 2);
        amx_load_weight_tiles(wblock, kb, ksteps, fetch);
        if (pair) _tile_loadd(5, a1 + kb * AMX_KSTEP, ldx * 2);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        if (pair) {
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
        }
    }
}

// Rows [m0, m1) of x (whole 16-row tiles, row stride ldx elements) times the column block at
// n0, through the epilogue (gated: the block is 16 gate and 16 up columns, and y holds N / 2
// activations a row).
static void amx_task(const bf16_t* x, int64_t ldx, const bf16_t* wblock, const bf16_t* bias,
                     void* y, int64_t M, int64_t N, int64_t ksteps, int64_t m0, int64_t m1,
                     int64_t n0, int epilogue) {
    float acc[4][16][16] __attribute__((aligned(64)));
    for (int64_t m = m0; m < m1; m += 32) {
        const bf16_t* a0 = x + m * ldx;
        const int first = m == m0;  // only the first pass reads the weights from memory
        if (m1 - m >= 32) {
            const bf16_t* a1 = a0 + 16 * ldx;
            _tile_zero(0);
            _tile_zero(1);
            _tile_zero(2);
            _tile_zero(3);
            amx_ksteps(a0, a1, 1, ldx, wblock, 0, ksteps, ksteps, first);
            _tile_stored(0, acc[0], 64);
            _tile_stored(1, acc[1], 64);
            _tile_stored(2, acc[2], 64);
            _tile_stored(3, acc[3], 64);
        } else {
            _tile_zero(0);
            _tile_zero(1);
            amx_ksteps(a0, NULL, 0, ldx, wblock, 0, ksteps, ksteps, first);
            _tile_stored(0, acc[0], 64);
            _tile_stored(1, acc[1], 64);
        }
        amx_store_block((const float(*)[16][16])acc, bias, y, M, N, m, m1, n0, epilogue);
    }
}

// Every row of x (M rows, padded with rows of zeros to whole 16-row tiles; row stride ldx) times
// one packed column block at n0 (wblock) on the tiles, through the epilogue: the quantized
// matmul's, on a block it makes. fill(ctx, kb) writes k-step kb of wblock just before the
// first 32 rows' tiles take it, so that making the block (a dequantization, on the vector
// units) overlaps their tile products; the other rows find it whole. The caller has
// configured the tiles.
void packed_block_tiles(const bf16_t* x, int64_t ldx, const bf16_t* wblock, const bf16_t* bias,
                        void* y, int64_t M, int64_t N, int64_t ksteps, int64_t n0, int epilogue,
                        void (*fill)(void* ctx, int64_t kb), void* ctx) {
    float acc[4][16][16] __attribute__((aligned(64)));
    const int64_t mpad = (M + 15) / 16 * 16;
    const int pair = mpad >= 32;
    const bf16_t* a1 = x + 16 * ldx;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t kb = 0; kb < ksteps; kb++) {
        fill(ctx, kb);
        amx_ksteps(x, a1, pair, ldx, wblock, kb, kb + 1, ksteps, 0);
    }
    _tile_stored(0, acc[0], 64);
    _tile_stored(1, acc[1], 64);
    _tile_stored(2, acc[2], 64);
    _tile_stored(3, acc[3], 64);
    const int64_t first = pair ? 32 : 16;
    amx_store_block((const float(*)[16][16])acc, bias, y, M, N, 0, first, n0, epilogue);
    for (int64_t m0 = first; m0 < mpad; m0 += AMX_MGROUP)
        amx_task(x, ldx, wblock, bias, y, M, N, ksteps, m0,
                 m0 + AMX_MGROUP < mpad ? m0 + AMX_MGROUP : mpad, n0, epilogue);
}

// Rows [m0, m1) (at most 32) against the column blocks [nb0, nb1) of a panel, k in chunks of
// AMX_KCHUNK steps: a chunk's 32 rows of x (16 KB) stay in L1 while every block of the panel
// passes, each block's partial sums waiting in acc [blocks][4][16][16] float32 between chunks.
#define AMX_KCHUNK 8
static void amx_panel_slice(const bf16_t* x, int64_t ldx, const bf16_t* packed,
                            int64_t block_elems, const bf16_t* bias, void* y, int64_t M,
                            int64_t N, int64_t ksteps, int64_t m0, int64_t m1, int64_t nb0,
                            int64_t nb1, int epilogue, int fetch, float (*acc)[4][16][16]) {
    const bf16_t *a0 = x + m0 * ldx, *a1 = a0 + 16 * ldx;
    const int pair = m1 - m0 >= 32;
    for (int64_t kc = 0; kc < ksteps; kc += AMX_KCHUNK) {
        const int64_t kend = kc + AMX_KCHUNK < ksteps ? kc + AMX_KCHUNK : ksteps;
        for (int64_t nb = nb0; nb < nb1; nb++) {
            float(*sums)[16][16] = acc[nb - nb0];
            const bf16_t* wblock = packed + nb * block_elems;
            if (kc == 0) {
                _tile_zero(0);
                _tile_zero(1);
                _tile_zero(2);
                _tile_zero(3);
            } else {
                _tile_loadd(0, sums[0], 64);
                _tile_loadd(1, sums[1], 64);
                _tile_loadd(2, sums[2], 64);
                _tile_loadd(3, sums[3], 64);
            }
            amx_ksteps(a0, a1, pair, ldx, wblock, kc, kend, ksteps, fetch);
            _tile_stored(0, sums[0], 64);
            _tile_stored(1, sums[1], 64);
            _tile_stored(2, sums[2], 64);
            _tile_stored(3, sums[3], 64);
        }
    }
    for (int64_t nb = nb0; nb < nb1; nb++)
        amx_store_block((const float(*)[16][16])acc[nb - nb0], bias, y, M, N, m0, m1,
                        nb * AMX_NBLOCK, epilogue);
}
#endif

// x [M, K] (contiguous) times the packed weight; M rows of y [M, N] (gated: [M, N / 2]; float32
// with EPILOGUE_F32). Rows
// and k are padded to whole tiles in a copy of x only when they are not already.
//
// Up to AMX_PANEL_MIN_ROWS rows the weights stream from memory once: a task is a column block
// and a group of rows, consecutive tasks share a block. With more rows (prefill) each thread
// takes its own rows, and the columns go by panels of AMX_PANEL_BYTES of weights (kept in L2):
// per panel, each 64-row slice of x (in L1) meets every block of the panel, so the result is
// written a row segment at a time, not a 32-column strip down the whole matrix.
#define AMX_PANEL_MIN_ROWS 256
#define AMX_PANEL_BYTES (1 << 20)
#define AMX_PANEL_ROWS 64
// Without avx512_bf16, FMA on the same layout (matmul_avx2.c). Returns MINISGL_OK,
// MINISGL_ERR_NOMEM (y not written) or, built with neither, MINISGL_ERR_UNSUPPORTED.
static int packed_matmul(const bf16_t* x, const bf16_t* packed, const bf16_t* bias, void* y,
                         int64_t M, int64_t N, int64_t K, int epilogue, int use_tiles,
                         int nthreads) {
#ifdef HAVE_AVX512_BF16
#ifndef HAVE_AMX
    use_tiles = 0;
#endif
    use_tiles = tiles_usable(use_tiles);
    const int64_t ksteps = (K + AMX_KSTEP - 1) / AMX_KSTEP, kpad = ksteps * AMX_KSTEP;
    // Tiles take whole 16-row tiles of x; vdpbf16ps any number of rows.
    const int64_t mpad = use_tiles ? (M + 15) / 16 * 16 : M;
    const int64_t nblocks = (N + AMX_NBLOCK - 1) / AMX_NBLOCK;
    const int64_t mgroups = (mpad + AMX_MGROUP - 1) / AMX_MGROUP;
    const int64_t block_elems = ksteps * AMX_NBLOCK * AMX_KSTEP;
    bf16_t* xpad = NULL;
    const bf16_t* a = x;
    int64_t ldx = K;
    if (mpad != M || kpad != K) {
        xpad = (bf16_t*)kernel_alloc((size_t)(mpad * kpad * 2));
        if (!xpad) return MINISGL_ERR_NOMEM;
        for (int64_t m = 0; m < mpad; m++) {
            bf16_t* row = xpad + m * kpad;
            if (m < M) memcpy(row, x + m * K, (size_t)K * 2);
            memset(row + (m < M ? K : 0), 0, (size_t)(m < M ? kpad - K : kpad) * 2);
        }
        a = xpad;
        ldx = kpad;
    }
#ifdef HAVE_AMX
    if (use_tiles && mpad >= AMX_PANEL_MIN_ROWS) {
        int64_t panel = AMX_PANEL_BYTES / (block_elems * 2);
        panel = panel > 0 ? panel : 1;
#pragma omp parallel num_threads(nthreads)
        {
            amx_configure();
            // Long k (1,024 and up) in chunks that keep x's rows in L1; short k whole, block
            // by block (chunking it measured 2% slower there, 7% faster on Qwen3's shapes).
            const int k_chunked = ksteps >= 4 * AMX_KCHUNK;
            float(*acc)[4][16][16] = NULL;
            if (k_chunked) acc = (float(*)[4][16][16])kernel_alloc((size_t)panel * sizeof(*acc));
            // A task is a slice of rows against one panel, panel by panel, claimed one at a
            // time: a thread slowed by another process takes fewer slices instead of keeping
            // the other waiting at the end (each thread's own half of the rows, before). The
            // first slices of a panel stream its weights from memory.
            const int64_t slice_rows = k_chunked ? 32 : AMX_PANEL_ROWS;
            const int64_t slices = (mpad + slice_rows - 1) / slice_rows;
            const int64_t panels = (nblocks + panel - 1) / panel;
            const int64_t workers = omp_get_num_threads();
#pragma omp for schedule(dynamic, 1)
            for (int64_t task = 0; task < panels * slices; task++) {
                const int64_t p0 = task / slices * panel, slice = task % slices;
                const int64_t p1 = p0 + panel < nblocks ? p0 + panel : nblocks;
                const int64_t m = slice * slice_rows;
                const int64_t m_end = m + slice_rows < mpad ? m + slice_rows : mpad;
                if (acc)
                    amx_panel_slice(a, ldx, packed, block_elems, bias, y, M, N, ksteps, m, m_end,
                                    p0, p1, epilogue, slice < workers, acc);
                else  // short k, or no memory for the sums: block by block
                    for (int64_t nb = p0; nb < p1; nb++)
                        amx_task(a, ldx, packed + nb * block_elems, bias, y, M, N, ksteps, m,
                                 m_end, nb * AMX_NBLOCK, epilogue);
            }
            free(acc);
            _tile_release();
        }
        free(xpad);
        return MINISGL_OK;
    }
#endif
    if (!use_tiles) {
        // A task is a pair of column blocks (and up to AMX_MGROUP rows); a thread's tasks come
        // in runs of consecutive ones (guided, as in minisgl_gemv_bf16), so each fetches the
        // next pair's weights while it computes.
        const int64_t pairs = (nblocks + 1) / 2;
#pragma omp parallel for num_threads(nthreads) schedule(guided)
        for (int64_t task = 0; task < pairs * mgroups; task++) {
            int64_t nb = task / mgroups * 2, g = task % mgroups;
            int64_t m0 = g * AMX_MGROUP, m1 = m0 + AMX_MGROUP < mpad ? m0 + AMX_MGROUP : mpad;
            const char* ahead = nb + 2 < nblocks && g == mgroups - 1
                                    ? (const char*)(packed + (nb + 2) * block_elems)
                                    : NULL;
            vec_task(a, ldx, packed + nb * block_elems, bias, y, M, N, ksteps, m0, m1,
                     nb * AMX_NBLOCK, epilogue, nb + 1 < nblocks ? 2 : 1, ahead);
        }
    }
#ifdef HAVE_AMX
    else {
#pragma omp parallel num_threads(nthreads)
        {
            amx_configure();
            // A task is a column block and all its row groups (so its weights are read once,
            // then found in cache), claimed guided: a thread that the OS or another process
            // slows takes fewer blocks. Static halves measured 10-15% slower at 32-64 rows on
            // a 2-core VM (the other thread waited at the barrier), level at 128.
#pragma omp for schedule(guided)
            for (int64_t nb = 0; nb < nblocks; nb++)
                for (int64_t g = 0; g < mgroups; g++) {
                    int64_t m0 = g * AMX_MGROUP;
                    int64_t m1 = m0 + AMX_MGROUP < mpad ? m0 + AMX_MGROUP : mpad;
                    amx_task(a, ldx, packed + nb * block_elems, bias, y, M, N, ksteps, m0, m1,
                             nb * AMX_NBLOCK, epilogue);
                }
            _tile_release();
        }
    }
#endif
    free(xpad);
    return MINISGL_OK;
#elif defined(HAVE_AVX2_FMA)
    (void)use_tiles;
    return packed_matmul_avx2(x, packed, bias, y, M, N, K, epilogue, nthreads);
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)epilogue;
    (void)use_tiles, (void)nthreads;
    return MINISGL_ERR_UNSUPPORTED;
#endif
}

// Up to PACKED_GEMV_ROWS rows without the tiles: packed_gemv (at the end of this file), which
// streams the packed copy as minisgl_gemv_bf16 streams a row-major weight.
#define PACKED_GEMV_ROWS 8
static int packed_gemv(const bf16_t* x, const bf16_t* packed, const bf16_t* bias, void* y,
                       int64_t M, int64_t N, int64_t K, int epilogue, int nthreads);

static inline int packed_gemv_takes(int64_t M, int use_tiles) {
#ifndef HAVE_AVX512_BF16
    (void)M, (void)use_tiles;
    return 0;  // (without bf16 dots the matmul takes every row count)
#else
#ifndef HAVE_AMX
    use_tiles = 0;
#endif
    return M <= PACKED_GEMV_ROWS && !tiles_usable(use_tiles);
#endif
}

// use_tiles: the AMX tiles (where compiled in), else vdpbf16ps on the same packed layout.
// out_f32: y is float32 (the sums unrounded, e.g. logits), else bf16. Status: packed_matmul's.
int minisgl_packed_linear(const bf16_t* x, const bf16_t* packed, const bf16_t* bias, void* y,
                          int64_t M, int64_t N, int64_t K, int out_f32, int use_tiles,
                          int nthreads) {
    const int epilogue = out_f32 ? EPILOGUE_F32 : EPILOGUE_BF16;
    if (packed_gemv_takes(M, use_tiles))
        return packed_gemv(x, packed, bias, y, M, N, K, epilogue, nthreads);
    return packed_matmul(x, packed, bias, y, M, N, K, epilogue, use_tiles, nthreads);
}

// silu(gate) * up straight from a gate_up weight packed with its gate and up rows interleaved
// in 16s (and its bias likewise): y [M, inter]; inter a multiple of 16. Status: packed_matmul's.
int minisgl_packed_gated_silu(const bf16_t* x, const bf16_t* packed, const bf16_t* bias,
                              bf16_t* y, int64_t M, int64_t inter, int64_t K, int use_tiles,
                              int nthreads) {
    if (packed_gemv_takes(M, use_tiles))
        return packed_gemv(x, packed, bias, y, M, 2 * inter, K, EPILOGUE_GATED, nthreads);
    return packed_matmul(x, packed, bias, y, M, 2 * inter, K, EPILOGUE_GATED, use_tiles,
                         nthreads);
}

// ------------------------------------------------------------------ GEMV on the packed copy
// y = x w^T (+ bias) for M <= PACKED_GEMV_ROWS rows of x from the packed (tile-layout) copy of
// w, which the model keeps instead of the row-major weight: a task is one 32-column block (its
// 2 KB k-steps read in order), tasks in guided runs as in minisgl_gemv_bf16. Blocks, not the
// vdpbf16ps matmul's pairs of them: SmolLM2's 576-row projections make 18 tasks, which two
// threads share evenly (9 pairs left one idle a ninth of the time). Each thread's run of blocks
// is one stream, fetched into L2 PACKED_GEMV_AHEAD bytes ahead: fetched into L1 (prefetcht0),
// which holds a few lines in flight, the 1-row GEMV ran ~5% behind the row-major one; into L2,
// level with it at 1 row and 1.1-1.4x ahead at 2-8 (benchmark/kernels.py).
#define PACKED_GEMV_AHEAD (64 << 10)

#ifdef HAVE_AVX512_BF16
// The k-pair (k, k + 1) of a row of x broadcast, zero past its K elements.
static inline __m512bh pair_within(const bf16_t* row, int64_t k, int64_t K) {
    if (k + 1 < K) return broadcast_pair(row + k);
    const bf16_t pair[2] = {k < K ? row[k] : (bf16_t)0, 0};
    return broadcast_pair(pair);
}

// ROWS rows of x (stride K) times one block, summed over k into left (columns 0-15) and right
// (16-31): one accumulator per row and tile, k in order, as the packed matmul sums them, so a
// row's sums are the same bits at every row count (a speculative verify step's rows are what
// decoding one by one gives). Two more per row at one or two rows, splitting the chain by the
// pair's parity, changed those rows' bits and no speed (weights from memory). The fetch ahead
// may pass the copy's end.
static inline FORM_INLINE void packed_gemv_block(
    const bf16_t* x, int64_t K, const bf16_t* block, int64_t ksteps, float (*left)[16],
    float (*right)[16], const int ROWS) {
    const int64_t step = AMX_NBLOCK * AMX_KSTEP, whole = K / AMX_KSTEP;
    __m512 acc[PACKED_GEMV_ROWS][2];
    for (int r = 0; r < ROWS; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < ksteps; kb++) {
        const bf16_t* w = block + kb * step;
        const int64_t k0 = kb * AMX_KSTEP;
        for (int p = 0; p < 16; p++) {
            const char* ahead = (const char*)(w + 64 * p) + PACKED_GEMV_AHEAD;
            __builtin_prefetch(ahead, 0, 1);
            __builtin_prefetch(ahead + 64, 0, 1);
            const __m512bh w0 = (__m512bh)_mm512_load_si512(w + 32 * p);
            const __m512bh w1 = (__m512bh)_mm512_load_si512(w + 512 + 32 * p);
            for (int r = 0; r < ROWS; r++) {
                const bf16_t* row = x + r * K;
                const int64_t k = k0 + 2 * p;
                const __m512bh xv = kb < whole ? broadcast_pair(row + k) : pair_within(row, k, K);
                acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
                acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        _mm512_store_ps(left[r], acc[r][0]);
        _mm512_store_ps(right[r], acc[r][1]);
    }
}
#endif

// Returns MINISGL_OK, MINISGL_ERR_SHAPE (M outside 0..PACKED_GEMV_ROWS) or, built without
// avx512_bf16, MINISGL_ERR_UNSUPPORTED.
static int packed_gemv(const bf16_t* x, const bf16_t* packed, const bf16_t* bias, void* y,
                       int64_t M, int64_t N, int64_t K, int epilogue, int nthreads) {
#ifdef HAVE_AVX512_BF16
    if (M < 0 || M > PACKED_GEMV_ROWS) return MINISGL_ERR_SHAPE;
    if (M == 0 || N == 0) return MINISGL_OK;
    const int64_t ksteps = (K + AMX_KSTEP - 1) / AMX_KSTEP;
    const int64_t block_elems = ksteps * AMX_NBLOCK * AMX_KSTEP;
    const int64_t nblocks = (N + AMX_NBLOCK - 1) / AMX_NBLOCK;
#pragma omp parallel for num_threads(nthreads) schedule(guided)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        float left[PACKED_GEMV_ROWS][16] __attribute__((aligned(64)));
        float right[PACKED_GEMV_ROWS][16] __attribute__((aligned(64)));
        const bf16_t* block = packed + nb * block_elems;
#define PACKED_GEMV_CASE(n)                                           \
    case n:                                                           \
        packed_gemv_block(x, K, block, ksteps, left, right, n); \
        break;
        switch (M) {
            PACKED_GEMV_CASE(8)
            PACKED_GEMV_CASE(7)
            PACKED_GEMV_CASE(6)
            PACKED_GEMV_CASE(5)
            PACKED_GEMV_CASE(4)
            PACKED_GEMV_CASE(3)
            PACKED_GEMV_CASE(2)
            default:
            PACKED_GEMV_CASE(1)
        }
#undef PACKED_GEMV_CASE
        packed_store((const float(*)[16])left, (const float(*)[16])right, bias, y, N, 0, M,
                     nb * AMX_NBLOCK, epilogue);
    }
    return MINISGL_OK;
#else
    (void)x, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K, (void)epilogue;
    (void)nthreads;
    return MINISGL_ERR_UNSUPPORTED;
#endif
}
