#include "common.h"
#include "internal.h"

// ---------------------------------------------------------------- packed matmul, AVX2 and FMA
// The packed (tile-layout) copy of a bf16 weight (matmul.c describes it) read where there are
// no bf16 dot products: the copy a bf16 model keeps on an AVX2 CPU instead of oneDNN's float32
// one (twice the bytes, streamed every decode step). Row p of a k-step's tile holds 16
// columns' k-pairs (2p, 2p + 1) as 32-bit lanes, so 8 columns' pairs widen to float32 in two
// operations and no shuffle: k's weights shifted up 16 bits, k + 1's with the low half masked.
// x is widened once per call (float32 rows, zero past K). Every (row, 8 columns) sum is one chain
// of FMAs over k in order, whatever the row count and however rows are grouped, so a row's
// output does not depend on its batch (a speculative verify step's rows are what decoding them
// one by one gives).

#if defined(HAVE_AVX2_FMA) && !defined(HAVE_AVX512_BF16)
#define AVX2_PACKED_MR 4  // x rows a register block takes: 8 sums, 4 weight vectors, an x
#define AVX2_PACKED_MGROUP 64   // rows a task takes: its block stays in L2 while they pass
// Bytes ahead a streaming task fetches the copy into L2: without it SmolLM2's 1-row projections
// and head took 1.4x longer (Zen 3); 16-64 KB ahead were within 5% of each other.
#define AVX2_PACKED_AHEAD (32 << 10)

// R rows of x (float32, stride ldx) times TILES of a block's two 16-column tiles from tile0,
// summed over ksteps k-steps into sums[r][16 * tile + c]. ahead: memory to fetch into L2 as
// the pass goes (the next blocks), or NULL.
static inline FORM_INLINE void block_sums(const float* x, int64_t ldx, const bf16_t* block,
                                          int64_t ksteps, int tile0, float (*sums)[AMX_NBLOCK],
                                          const char* ahead, const int R, const int TILES) {
    __m256 acc[AVX2_PACKED_MR][4];
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 2 * TILES; c++) acc[r][c] = _mm256_setzero_ps();
    const __m256i high = _mm256_set1_epi32((int)0xFFFF0000u);
    for (int64_t kb = 0; kb < ksteps; kb++) {
        const bf16_t* w = block + kb * AMX_NBLOCK * AMX_KSTEP + tile0 * 512;
        const float* xk = x + kb * AMX_KSTEP;
        if (ahead) {
            const char* fetch = ahead + kb * AMX_NBLOCK * AMX_KSTEP * 2;
            for (int line = 0; line < 32; line++) __builtin_prefetch(fetch + 64 * line, 0, 1);
        }
        for (int p = 0; p < 16; p++) {
            __m256 even[4], odd[4];  // each 8 columns' k and k + 1 weights
            for (int c = 0; c < 2 * TILES; c++) {  // 8 columns c: tile c / 2, half c % 2
                const bf16_t* lanes = w + 512 * (c / 2) + 32 * p + 16 * (c % 2);
                const __m256i v = _mm256_loadu_si256((const __m256i*)lanes);
                even[c] = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
                odd[c] = _mm256_castsi256_ps(_mm256_and_si256(v, high));
            }
            for (int r = 0; r < R; r++) {
                const float* xr = xk + r * ldx + 2 * p;
                const __m256 x_even = _mm256_broadcast_ss(xr);
                for (int c = 0; c < 2 * TILES; c++)
                    acc[r][c] = _mm256_fmadd_ps(even[c], x_even, acc[r][c]);
                const __m256 x_odd = _mm256_broadcast_ss(xr + 1);
                for (int c = 0; c < 2 * TILES; c++)
                    acc[r][c] = _mm256_fmadd_ps(odd[c], x_odd, acc[r][c]);
            }
        }
    }
    for (int r = 0; r < R; r++)
        for (int c = 0; c < 2 * TILES; c++)
            _mm256_storeu_ps(sums[r] + 16 * tile0 + 8 * c, acc[r][c]);
}

// Rows [m0, m0 + rows) of a block's sums (columns n0..n0 + 31) + bias into y through the
// epilogue, as matmul.c's packed_store rounds them.
static void store_sums(const float (*sums)[AMX_NBLOCK], const bf16_t* bias, void* y, int64_t N,
                       int64_t m0, int64_t rows, int64_t n0, int epilogue) {
    float bias_f[AMX_NBLOCK] = {0};  // (a gated copy's bias: its gate and up columns, paired)
    for (int64_t c = 0; bias && c < AMX_NBLOCK && n0 + c < N; c++)
        bias_f[c] = bf16_to_f32(bias[n0 + c]);
    if (epilogue == EPILOGUE_GATED) {  // 16 gate columns, then their 16 up columns
        const int64_t width = N / 2, col0 = n0 / 2;
        const int64_t valid = width - col0 < 16 ? width - col0 : 16;
        for (int64_t r = 0; r < rows; r++) {
            // Whole rows of 16 in constant-length loops, so that gcc vectorises them (element
            // by element: 1.4x the gated matmul's time at 2,048 rows).
            float gate[16], up[16];
            for (int c = 0; c < 16; c++) {
                gate[c] = round_to(1, sums[r][c] + bias_f[c]);
                up[c] = round_to(1, sums[r][16 + c] + bias_f[16 + c]);
            }
            for (int c = 0; c < 16; c++) gate[c] = silu_times_portable(1, gate[c], up[c]);
            store_row(y, (m0 + r) * width + col0, 1, gate, valid);
        }
        return;
    }
    const int64_t valid = N - n0 < AMX_NBLOCK ? N - n0 : AMX_NBLOCK;
    for (int64_t r = 0; r < rows; r++) {
        float row[AMX_NBLOCK];
        for (int c = 0; c < AMX_NBLOCK; c++) row[c] = sums[r][c] + bias_f[c];
        store_row(y, (m0 + r) * N + n0, epilogue == EPILOGUE_F32 ? 0 : 1, row, valid);
    }
}

// Rows [m0, m1) of x times the block at n0, AVX2_PACKED_MR rows a pass: up to 2 rows both
// tiles at once (4 sums a row: enough chains to stream the copy at memory speed), more a tile
// at a time (2 a row; with 6 rows a pass, which spilled, SmolLM2's layers at 256 rows took
// 1.2x longer). ahead: what the first pass fetches, or NULL.
static void block_task(const float* x, int64_t ldx, const bf16_t* block, int64_t ksteps,
                       const bf16_t* bias, void* y, int64_t N, int64_t m0, int64_t m1, int64_t n0,
                       int epilogue, const char* ahead) {
    float sums[AVX2_PACKED_MR][AMX_NBLOCK];
    for (int64_t m = m0; m < m1; m += AVX2_PACKED_MR) {
        const int64_t rows = m1 - m < AVX2_PACKED_MR ? m1 - m : AVX2_PACKED_MR;
        const float* xm = x + m * ldx;
        switch (rows) {
            case 1: block_sums(xm, ldx, block, ksteps, 0, sums, ahead, 1, 2); break;
            case 2: block_sums(xm, ldx, block, ksteps, 0, sums, ahead, 2, 2); break;
#define TILE_BY_TILE(n)                                                   \
    case n:                                                               \
        block_sums(xm, ldx, block, ksteps, 0, sums, ahead, n, 1);         \
        block_sums(xm, ldx, block, ksteps, 1, sums, NULL, n, 1);          \
        break;
            TILE_BY_TILE(3)
            default:
            TILE_BY_TILE(4)
#undef TILE_BY_TILE
        }
        store_sums((const float(*)[AMX_NBLOCK])sums, bias, y, N, m, rows, n0, epilogue);
        ahead = NULL;
    }
}

// x [M, K] bf16 times the packed weight into y [M, N] (gated: [M, N / 2]) through the epilogue.
// A task is a column block and up to AVX2_PACKED_MGROUP rows, claimed guided (as matmul.c's
// tasks): at a few rows each thread streams its run of blocks once, fetching the next ones.
MINISGL_INTERNAL int packed_matmul_avx2(const bf16_t* x, const bf16_t* packed, const bf16_t* bias,
                                        void* y, int64_t M, int64_t N, int64_t K, int epilogue,
                                        int nthreads) {
    if (M == 0 || N == 0) return MINISGL_OK;
    const int64_t ksteps = (K + AMX_KSTEP - 1) / AMX_KSTEP, kpad = ksteps * AMX_KSTEP;
    const int64_t nblocks = (N + AMX_NBLOCK - 1) / AMX_NBLOCK;
    const int64_t block_elems = ksteps * AMX_NBLOCK * AMX_KSTEP;
    const int64_t mgroups = (M + AVX2_PACKED_MGROUP - 1) / AVX2_PACKED_MGROUP;
    float* xf = (float*)kernel_alloc((size_t)(M * kpad) * sizeof(float));
    if (!xf) return MINISGL_ERR_NOMEM;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t m = 0; m < M; m++) {
            load_row(x, m * K, 1, xf + m * kpad, K);
            memset(xf + m * kpad + K, 0, (size_t)(kpad - K) * sizeof(float));
        }
#pragma omp for schedule(guided)
        for (int64_t task = 0; task < nblocks * mgroups; task++) {
            const int64_t nb = task / mgroups, g = task % mgroups;
            const int64_t m0 = g * AVX2_PACKED_MGROUP;
            const int64_t m1 = m0 + AVX2_PACKED_MGROUP < M ? m0 + AVX2_PACKED_MGROUP : M;
            const bf16_t* block = packed + nb * block_elems;
            // The copy is one stream: fetch what comes AVX2_PACKED_AHEAD bytes on (it may
            // pass the copy's end: prefetches do not fault).
            const char* ahead = g == 0 && M <= AVX2_PACKED_MGROUP
                                    ? (const char*)block + AVX2_PACKED_AHEAD
                                    : NULL;
            block_task(xf, kpad, block, ksteps, bias, y, N, m0, m1, nb * AMX_NBLOCK, epilogue,
                       ahead);
        }
    }
    free(xf);
    return MINISGL_OK;
}
#endif
