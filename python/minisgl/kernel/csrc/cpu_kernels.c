// CPU kernels for the hot paths PyTorch's eager ops do badly on small batches: a bf16 GEMV
// that streams weights at memory bandwidth, paged decode attention that reads the KV pool in
// place, and fused elementwise ops (residual + RMSNorm, SiLU-and-mul, rotary) that round to the
// storage dtype exactly where PyTorch's op-by-op version does, so results match bit for bit.
//
// Built once per machine by minisgl/kernel/cpu.py (gcc -O3 -march=native -fopenmp) and called
// through ctypes with raw pointers to contiguous tensors. It links the OpenMP runtime that
// torch already loaded, so both share one thread pool. dtype codes: 0 float32, 1 bfloat16.

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define HAVE_AVX512_BF16 1
#endif
#if defined(HAVE_AVX512_BF16) && defined(__AMX_TILE__) && defined(__AMX_BF16__) && \
    defined(__linux__)
#define HAVE_AMX 1
#include <sys/syscall.h>
#include <unistd.h>
#endif

typedef uint16_t bf16_t;

// What the kernels that can fail return; cpu.py turns every code but MINISGL_OK into an
// exception naming the kernel (nothing is written on an error, unless it says otherwise).
#define MINISGL_OK 0
#define MINISGL_ERR_NOMEM 1        // an allocation failed
#define MINISGL_ERR_SHAPE 2        // a shape this kernel cannot take (cpu.py checks them first)
#define MINISGL_ERR_UNSUPPORTED 3  // built without the instructions this kernel needs
#define MINISGL_ERR_POSITION 4     // a position outside the rotary tables

// Allocations made through kernel_alloc fail while this is positive (the tests' hook, each
// failure counting it down), so that every error path is exercised.
static int64_t failing_allocations = 0;

void minisgl_fail_allocations(int64_t count) {
    __atomic_store_n(&failing_allocations, count, __ATOMIC_SEQ_CST);
}

// Every allocation of the kernels: 64-byte aligned (whole lines, as the AVX-512 loads and tile
// rows want), rounded up to whole lines as aligned_alloc requires, never of 0 bytes. NULL on
// failure: the caller returns MINISGL_ERR_NOMEM (or takes a path that needs no memory).
static void* kernel_alloc(size_t bytes) {
    if (__atomic_load_n(&failing_allocations, __ATOMIC_RELAXED) > 0 &&
        __atomic_sub_fetch(&failing_allocations, 1, __ATOMIC_SEQ_CST) >= 0)
        return NULL;
    return aligned_alloc(64, bytes == 0 ? 64 : (bytes + 63) / 64 * 64);
}

// Whether minisgl_has_amx got this process the tile state: the tiles are used only then (a
// tile instruction without it kills the process), whatever a caller asks for.
static int amx_granted = 0;

static inline int tiles_usable(int use_tiles) { return use_tiles && amx_granted; }

#ifdef __AVX512F__
// 16 bf16 values as float32 (exact).
static inline __m512 bf16x16_to_f32(__m256i packed) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(packed), 16));
}
#endif

static inline float bf16_to_f32(bf16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

// Round to nearest even, as torch does when it stores a float32 result as bfloat16.
static inline bf16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return (bf16_t)(u >> 16);
}

// exp(x) in plain float arithmetic, exp512's steps lane by lane (2^n * poly(r), x = n ln2 + r,
// clamped to [-87, 88]): no libm call, so gcc vectorises the loops that use it on any target.
// The portable SiLU and attention softmax called expf per element: 10% and most of the 20% of
// an AVX2 build's W1 that they took.
static inline float exp_portable(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    const float n = __builtin_rintf(x * 1.44269504f);
    float r = x - n * 0.693145752f;
    r = r - n * 1.42860677e-6f;
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    const uint32_t bits = (uint32_t)((int32_t)n + 127) << 23;
    float scale;
    memcpy(&scale, &bits, sizeof scale);
    return p * scale;
}

static inline void load_row(const void* base, int64_t offset, int dtype, float* dst, int64_t n) {
    if (dtype == 0) {
        memcpy(dst, (const float*)base + offset, (size_t)n * sizeof(float));
    } else {
        const bf16_t* src = (const bf16_t*)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = bf16_to_f32(src[i]);
    }
}

static inline void store_row(void* base, int64_t offset, int dtype, const float* src, int64_t n) {
    if (dtype == 0) {
        memcpy((float*)base + offset, src, (size_t)n * sizeof(float));
    } else {
        bf16_t* dst = (bf16_t*)base + offset;
        for (int64_t i = 0; i < n; i++) dst[i] = f32_to_bf16(src[i]);
    }
}

// Rounds a float32 value to the storage dtype and back (identity for float32).
static inline float round_to(int dtype, float x) {
    return dtype == 0 ? x : bf16_to_f32(f32_to_bf16(x));
}

int minisgl_has_avx512_bf16(void) {
#ifdef HAVE_AVX512_BF16
    return 1;
#else
    return 0;
#endif
}

// ------------------------------------------------------------------------------------- GEMV
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for a few rows m: bf16 in, float32 accumulate,
// bf16 out. Every thread streams its own contiguous block of weight rows once.

#ifdef HAVE_AVX512_BF16
static inline __mmask32 tail_mask(int64_t K, int64_t k) {
    return K - k >= 32 ? (__mmask32)0xffffffffu : (__mmask32)((1u << (K - k)) - 1u);
}

// Two adjacent bf16 values as one 32-bit lane, broadcast to all 16.
static inline __m512bh broadcast_pair(const bf16_t* pair) {
    uint32_t bits;
    memcpy(&bits, pair, 4);
    return (__m512bh)_mm512_set1_epi32((int)bits);
}

// A block is 4 weight rows: four 64-byte lines of the block `ahead` per 32-element step.
static inline __attribute__((always_inline)) void prefetch_block(const bf16_t* ahead, int64_t k) {
    for (int line = 0; line < 4; line++)
        __builtin_prefetch(ahead + 4 * k + 32 * line, 0, 3);
}

static inline void store_sums(__m512 acc0, __m512 acc1, __m512 acc2, __m512 acc3,
                              const bf16_t* bias, bf16_t* y_row, int64_t n0) {
    float sums[4] = {_mm512_reduce_add_ps(acc0), _mm512_reduce_add_ps(acc1),
                     _mm512_reduce_add_ps(acc2), _mm512_reduce_add_ps(acc3)};
    for (int r = 0; r < 4; r++) {
        if (bias) sums[r] += bf16_to_f32(bias[n0 + r]);
        y_row[n0 + r] = f32_to_bf16(sums[r]);
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
static inline void gemv_4x4(const bf16_t* x, const bf16_t* w0, const bf16_t* bias, bf16_t* y,
                            int64_t N, int64_t K, int64_t n0, const bf16_t* ahead) {
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
    store_sums(a00, a01, a02, a03, bias, y, n0);
    store_sums(a10, a11, a12, a13, bias, y + N, n0);
    store_sums(a20, a21, a22, a23, bias, y + 2 * N, n0);
    store_sums(a30, a31, a32, a33, bias, y + 3 * N, n0);
}
#undef DP4

// Weight rows n0..n0+3 against every x row. The block (4 x K bf16) stays in L1 while the x
// rows pass over it, so memory sees each weight once; prefetch runs two blocks ahead.
static void gemv_block4(const bf16_t* x, const bf16_t* w, const bf16_t* bias, bf16_t* y,
                        int64_t M, int64_t N, int64_t K, int64_t n0, int64_t n_end) {
    const bf16_t* w0 = w + n0 * K;
    const bf16_t* ahead = n0 + 8 < n_end ? w0 + 8 * K : NULL;  // two blocks on
    int64_t m = 0;
    for (; m + 4 <= M; m += 4, ahead = NULL)
        gemv_4x4(x + m * K, w0, bias, y + m * N, N, K, n0, ahead);
    for (; m < M; m++, ahead = NULL) {
        __m512 acc[4];
        gemv_1x4(x + m * K, w0, K, ahead, acc);
        store_sums(acc[0], acc[1], acc[2], acc[3], bias, y + m * N, n0);
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
        gemv_block4(x, w, bias, y, M, N, K, n0, full_blocks * 4);
#else
        for (int64_t r = 0; r < 4; r++) gemv_row_generic(x, w, bias, y, M, N, K, n0 + r);
#endif
    }
    for (int64_t n = full_blocks * 4; n < N; n++) gemv_row_generic(x, w, bias, y, M, N, K, n);
}

// ------------------------------------------------------------------------ packed matmul
// y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for every row count above the GEMV's, with the
// AMX tile unit where the CPU has it (oneDNN's bf16 matmul does not overlap streaming the
// weights with the tile math), else with vdpbf16ps on the same layout (vec_rows). The weight
// is packed once into the tile layout
// (zero-padded to whole 32 x 32 blocks): for each block of 32 output columns, for each 32-wide
// step of k, two 16-column tiles of 16 k-pairs ("VNNI": w[n][k], w[n][k+1] adjacent), 2 KB
// read in order. Each 32 x 32 block of the result lives in four accumulator tiles
// (two 16-row tiles of x times two 16-column tiles of w) over the whole of k.

#define AMX_KSTEP 32
#define AMX_NBLOCK 32
#define AMX_MGROUP 64        // rows per task: a task's weight block is reused from cache
#define AMX_PREFETCH_STEPS 4  // k-steps ahead the weight tiles are prefetched
#define VEC_ROWS 6            // x rows per register block without tiles (vec_rows)
// What the packed matmul writes: bf16 rows of y, silu(gate) * up (bf16) from a gate_up weight
// packed with its gate and up rows interleaved in 16s, or float32 rows (logits, unrounded).
#define EPILOGUE_BF16 0
#define EPILOGUE_GATED 1
#define EPILOGUE_F32 2

int minisgl_has_amx(void) {
#ifdef HAVE_AMX
    // Linux hands out the tile state only to processes that ask (ARCH_REQ_XCOMP_PERM, 18 =
    // XFEATURE_XTILEDATA); asking again is harmless.
    amx_granted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
    return amx_granted;
#else
    return 0;
#endif
}

int64_t minisgl_packed_elems(int64_t N, int64_t K) {
    return (N + AMX_NBLOCK - 1) / AMX_NBLOCK * AMX_NBLOCK * ((K + AMX_KSTEP - 1) / AMX_KSTEP) *
           AMX_KSTEP;
}

void minisgl_pack_weight(const bf16_t* w, bf16_t* packed, int64_t N, int64_t K, int nthreads) {
    const int64_t nblocks = (N + AMX_NBLOCK - 1) / AMX_NBLOCK;
    const int64_t ksteps = (K + AMX_KSTEP - 1) / AMX_KSTEP;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        bf16_t* dst = packed + nb * ksteps * AMX_NBLOCK * AMX_KSTEP;
        for (int64_t kb = 0; kb < ksteps; kb++)
            for (int tile = 0; tile < 2; tile++)
                for (int pair = 0; pair < 16; pair++)
                    for (int col = 0; col < 16; col++)
                        for (int e = 0; e < 2; e++) {
                            int64_t n = nb * AMX_NBLOCK + tile * 16 + col;
                            int64_t k = kb * AMX_KSTEP + 2 * pair + e;
                            *dst++ = n < N && k < K ? w[n * K + k] : 0;
                        }
    }
}

#ifdef HAVE_AVX512_BF16
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
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_add_ps(_mm512_load_ps(right[r]), bias_right),
                                               _mm512_add_ps(_mm512_load_ps(left[r]), bias_left));
        _mm512_mask_storeu_epi16(y + (m0 + r) * N + n0, cols, (__m512i)v);
    }
}

static inline __m512 silu_times(__m512 gate, __m512 up, int dtype);
static inline __m512 round_bf16_512(__m512 x);

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
static inline void packed_store(const float (*left)[16], const float (*right)[16],
                                const bf16_t* bias, void* y, int64_t N, int64_t m0, int64_t rows,
                                int64_t n0, int epilogue) {
    if (epilogue == EPILOGUE_GATED)
        amx_store_gated(left, right, bias ? bias + n0 : NULL, (bf16_t*)y, N / 2, m0, rows,
                        n0 / 2);
    else if (epilogue == EPILOGUE_F32)
        store_f32(left, right, bias, (float*)y, N, m0, rows, n0);
    else
        amx_store(left, right, bias, (bf16_t*)y, N, m0, rows, n0);
}

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
static inline __attribute__((always_inline)) void vec_rows(
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

#endif

#ifdef HAVE_AMX
typedef struct {
    uint8_t palette_id, start_row;
    uint8_t reserved[14];
    uint16_t colsb[16];
    uint8_t rows[16];
} amx_tilecfg;

// This thread's eight tiles as 16 rows of 64 bytes (16 float32 or 32 bf16 a row).
static inline void amx_configure(void) {
    amx_tilecfg cfg;
    memset(&cfg, 0, sizeof cfg);
    cfg.palette_id = 1;
    for (int t = 0; t < 8; t++) {
        cfg.rows[t] = 16;
        cfg.colsb[t] = 64;
    }
    _tile_loadconfig(&cfg);
}

// k-step kb's two weight tiles into tmm6 and tmm7; the pass that streams the weights from
// memory also prefetches AMX_PREFETCH_STEPS steps ahead.
static inline __attribute__((always_inline)) void amx_load_weight_tiles(const bf16_t* wblock,
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
static inline __attribute__((always_inline)) void amx_ksteps(const bf16_t* a0, const bf16_t* a1,
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
// Returns MINISGL_OK, MINISGL_ERR_NOMEM (y not written) or, built without avx512_bf16,
// MINISGL_ERR_UNSUPPORTED.
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
#ifndef HAVE_AMX
    use_tiles = 0;
#endif
    return M <= PACKED_GEMV_ROWS && !tiles_usable(use_tiles);
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

// --------------------------------------------------------------------- paged decode attention
// One query token per request. Request b attends to the key positions
// [max(0, kv_len - window), kv_len) of page-table row rows[b]: position p lives in KV slot
// page_table[rows[b] * table_stride + p]. Caches are [slots, kv_heads, head_dim]; q and out are
// [B, heads, head_dim]. Online softmax in float32 over blocks of ATTN_BLOCK keys.
// Cascade: with kv_starts, request b only reads positions from kv_starts[b] on, and
// prefix_out [B, heads, head_dim] / prefix_lse [B, heads] (float32) hold the attention over the
// positions before it (output and log-sum-exp), computed elsewhere for the whole batch at once;
// they seed the online softmax (max = lse, sum = 1, acc = out), so the result covers both.

#define ATTN_BLOCK 64
#define ATTN_MAX_DIM 256
#define ATTN_MAX_GROUP 32
#define ATTN_MAX_HEADS 64  // query heads one task may hold

typedef struct {
    const void *q, *k_cache, *v_cache;
    void* out;
    const int32_t* page_table;
    int64_t table_stride;
    const int64_t *rows, *kv_lens, *kv_starts;
    const float *prefix_out, *prefix_lse;
    int64_t num_heads, num_kv_heads, head_dim, window;
    float scale;
    int dtype;
} attn_args;

// First position request b attends to: its window's start, or where the cascade prefix ends.
static inline int64_t attn_start(const attn_args* a, int64_t b) {
    int64_t kv_len = a->kv_lens[b];
    int64_t start = (a->window > 0 && kv_len > a->window) ? kv_len - a->window : 0;
    return a->kv_starts && a->kv_starts[b] > start ? a->kv_starts[b] : start;
}

// Bytes [first, first + bytes) of KV slot `slot` (rows of row_bytes), into L1.
static inline __attribute__((always_inline)) void prefetch_rows(const void* cache,
                                                               int64_t row_bytes, int64_t first,
                                                               int64_t bytes, int64_t slot) {
    const char* part = (const char*)cache + slot * row_bytes + first;
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(part + line, 0, 3);
}

#define GENERIC_PREFETCH 8  // positions ahead the portable attention asks for its rows

#ifdef __AVX512F__
static inline __m512 load16(const void* base, int64_t offset, int dtype) {
    if (dtype == 0) return _mm512_loadu_ps((const float*)base + offset);
    __m256i half = _mm256_loadu_si256((const __m256i*)((const bf16_t*)base + offset));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// exp(x) for x <= 88, ~1 ulp: 2^n * poly(r), x = n ln2 + r; below -87 it returns ~0.
static inline __m512 exp512(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 5040.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 720.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

// A task reads its rows position by position, every kv head of a position before the next
// one (scores: the keys; then P V: the values). A task holding every kv head sweeps whole rows
// in slot order, and a prompt's slots (and consecutive requests' prompts) are consecutive.
// Head by head instead (256 B of each 2 KB row per pass) a pure read loop streams ~25% slower.
// The L2 streamer does not run ahead of a loop that also computes (a read loop with FMAs took
// the sum of both times), so the rows ATTN_LOOKAHEAD positions ahead are asked for too (8 to
// 32 measured alike). Batch 64 x 160 positions x 28 layers (Qwen3-0.6B's decode attention):
// 34.1 -> 31.4 ms against head-by-head passes with the next block prefetched.
// A one-kv-head task reads a part of each row, which no prefetcher follows: it asks for its
// part ATTN_PREFETCH positions ahead. __builtin_prefetch, not _mm_prefetch, and always inlined:
// gcc 12 deems a helper that only prefetches side-effect free and deletes its calls.
#define ATTN_PREFETCH 4
#define ATTN_LOOKAHEAD 16
#define ATTN_RUNS_PER_THREAD 4

// The positions a thread reads after a range (the next request's), for the lookahead.
typedef struct {
    const int32_t* slots;
    int64_t count;
} attn_next;

// The slot of position i of a range ending at `end`, continuing into `next`; -1 past both.
static inline int64_t slot_ahead(const int32_t* slots, int64_t end, const attn_next* next,
                                 int64_t i) {
    if (i < end) return slots[i];
    return next && i - end < next->count ? next->slots[i - end] : -1;
}

// Lane t of the result is the sum of v[t]'s 16 lanes: a transpose-and-add tree, ~3 ops per
// vector instead of a full horizontal reduction each.
static inline __m512 sum_lanes16(const __m512 v[16]) {
    __m512 pairs[8], quads[4];
    for (int i = 0; i < 8; i++)  // 128-bit lane: [v2i 0+2, v2i+1 0+2, v2i 1+3, v2i+1 1+3]
        pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                                 _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
    for (int i = 0; i < 4; i++)  // 128-bit lane: the lane's sums of v4i .. v4i+3
        quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                                 _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
    __m512 lo = _mm512_add_ps(_mm512_shuffle_f32x4(quads[0], quads[1], 0x88),
                              _mm512_shuffle_f32x4(quads[0], quads[1], 0xDD));
    __m512 hi = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2], quads[3], 0x88),
                              _mm512_shuffle_f32x4(quads[2], quads[3], 0xDD));
    return _mm512_add_ps(_mm512_shuffle_f32x4(lo, hi, 0x88), _mm512_shuffle_f32x4(lo, hi, 0xDD));
}

static inline __mmask16 first_lanes(int64_t n) {
    return n >= 16 ? (__mmask16)0xffff : (__mmask16)((1u << n) - 1u);
}

// Value sums are kept per 32 dims as two float32 vectors, the even dims then the odd ones: a
// bf16 row widens that way in one op per 16 dims (shift, or mask the high halves), not two.
static const int32_t pair_even_odd[32] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20,
                                          22, 24, 26, 28, 30, 1,  3,  5,  7,  9,  11,
                                          13, 15, 17, 19, 21, 23, 25, 27, 29, 31};
static const int32_t pair_natural[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                         21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                         11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

// 32 dims of a value row as (even, odd) float32 vectors.
static inline __attribute__((always_inline)) void load_pair(const void* base, int64_t offset,
                                                            int dtype, __m512* even,
                                                            __m512* odd) {
    if (dtype == 1) {
        __m512i v = _mm512_loadu_si512((const bf16_t*)base + offset);
        *even = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
        *odd = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xffff0000)));
        return;
    }
    __m512 lo = _mm512_loadu_ps((const float*)base + offset);
    __m512 hi = _mm512_loadu_ps((const float*)base + offset + 16);
    *even = _mm512_permutex2var_ps(lo, _mm512_loadu_si512(pair_even_odd), hi);
    *odd = _mm512_permutex2var_ps(lo, _mm512_loadu_si512(pair_even_odd + 16), hi);
}

// float32 row <-> (even, odd) layout, 32 dims at a time; dim a multiple of 32.
static inline void row_to_pairs(const float* src, float* dst, int64_t dim) {
    for (int64_t d = 0; d < dim; d += 32) {
        __m512 even, odd;
        load_pair(src, d, 0, &even, &odd);
        _mm512_storeu_ps(dst + d, even);
        _mm512_storeu_ps(dst + d + 16, odd);
    }
}
static inline void pairs_to_row(const float* src, float* dst, int64_t dim) {
    for (int64_t d = 0; d < dim; d += 32) {
        __m512 even = _mm512_loadu_ps(src + d), odd = _mm512_loadu_ps(src + d + 16);
        const __m512i first = _mm512_loadu_si512(pair_natural);
        const __m512i second = _mm512_loadu_si512(pair_natural + 16);
        _mm512_storeu_ps(dst + d, _mm512_permutex2var_ps(even, first, odd));
        _mm512_storeu_ps(dst + d + 16, _mm512_permutex2var_ps(even, second, odd));
    }
}

// Scores of one position against the task's `heads` query heads, 16 at a time, into
// scores[0, heads): one partial dot product per head (its kv head's key at key + key_offset[h]),
// summed across lanes together. BF16_DOT: vdpbf16ps on the stored bf16 key against the bf16
// query (products of two bf16 values are exact in float32: the float32 path but for summation
// order), scaled after; otherwise float32 FMAs against the scaled float32 query `qf`.
static inline __attribute__((always_inline)) void attn_position_scores(
    const attn_args* a, int64_t key, const bf16_t* q, float (*qf)[ATTN_MAX_DIM],
    const int64_t* key_offset, int64_t heads, float* scores, const int CHUNKS,
    const int BF16_DOT) {
    for (int64_t h0 = 0; h0 < heads; h0 += 16) {
        __m512 partial[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            partial[i] = _mm512_setzero_ps();
            if (h0 + i >= heads) continue;
            const int64_t k = key + key_offset[h0 + i];
#ifdef HAVE_AVX512_BF16
            if (BF16_DOT)
                for (int c = 0; c < CHUNKS / 2; c++)
                    partial[i] = _mm512_dpbf16_ps(
                        partial[i],
                        (__m512bh)_mm512_loadu_si512(q + (h0 + i) * a->head_dim + 32 * c),
                        (__m512bh)_mm512_loadu_si512((const bf16_t*)a->k_cache + k + 32 * c));
#endif
            if (!BF16_DOT)
                for (int c = 0; c < CHUNKS; c++)
                    partial[i] = _mm512_fmadd_ps(_mm512_loadu_ps(qf[h0 + i] + 16 * c),
                                                 load16(a->k_cache, k + 16 * c, a->dtype),
                                                 partial[i]);
        }
        __m512 sums = sum_lanes16(partial);
        if (BF16_DOT) sums = _mm512_mul_ps(sums, _mm512_set1_ps(a->scale));
        _mm512_mask_storeu_ps(scores + h0, first_lanes(heads - h0), sums);
    }
}

// The online softmax of a task's heads over the positions seen so far: float32 value sums in
// the (even, odd) pair layout, running max and sum.
typedef struct {
    float acc[ATTN_MAX_HEADS][ATTN_MAX_DIM];
    float max[ATTN_MAX_HEADS], sum[ATTN_MAX_HEADS];
} attn_state;

// Empty, or (seeded) the cascade prefix's state for heads [head0, head0 + heads) of request b.
static void attn_state_begin(const attn_args* a, int64_t b, int64_t head0, int64_t heads,
                             int seeded, attn_state* st) {
    for (int64_t h = 0; h < heads; h++) {
        const int64_t offset = (b * a->num_heads + head0 + h) * a->head_dim;
        if (seeded && a->prefix_out)
            row_to_pairs(a->prefix_out + offset, st->acc[h], a->head_dim);
        else
            memset(st->acc[h], 0, a->head_dim * sizeof(float));
        const int prefix = seeded && a->prefix_lse;
        st->max[h] = prefix ? a->prefix_lse[b * a->num_heads + head0 + h] : -3.0e38f;
        st->sum[h] = prefix ? 1.0f : 0.0f;
    }
}

// `from` folded into `into` (the same heads over other positions).
static void attn_state_merge(attn_state* into, const attn_state* from, int64_t heads,
                             int64_t dim) {
    for (int64_t h = 0; h < heads; h++) {
        const float top = into->max[h] > from->max[h] ? into->max[h] : from->max[h];
        const float keep = expf(into->max[h] - top), add = expf(from->max[h] - top);
        for (int64_t d = 0; d < dim; d++)
            into->acc[h][d] = into->acc[h][d] * keep + from->acc[h][d] * add;
        into->sum[h] = into->sum[h] * keep + from->sum[h] * add;
        into->max[h] = top;
    }
}

static void attn_state_store(const attn_args* a, int64_t b, int64_t head0, int64_t heads,
                             const attn_state* st) {
    for (int64_t h = 0; h < heads; h++) {
        float row[ATTN_MAX_DIM];
        pairs_to_row(st->acc[h], row, a->head_dim);
        for (int64_t d = 0; d < a->head_dim; d++) row[d] /= st->sum[h];
        store_row(a->out, (b * a->num_heads + head0 + h) * a->head_dim, a->dtype, row,
                  a->head_dim);
    }
}

// Positions [begin, end) of request b for kv heads [kvh0, kvh0 + kv_count), into `st`: per
// block of ATTN_BLOCK positions the scores, the online softmax, then P V position by position
// into the sums (a position's value row is widened once for all its heads). CHUNKS = head_dim
// / 16, a constant in each instantiation so the row loops unroll.
static inline __attribute__((always_inline)) void attn_range_avx512(
    const attn_args* a, int64_t b, int64_t kvh0, int64_t kv_count, int64_t begin, int64_t end,
    const attn_next* next, attn_state* st, const int CHUNKS) {
    const int64_t group = a->num_heads / a->num_kv_heads, dim = a->head_dim;
    const int64_t heads = kv_count * group, head0 = kvh0 * group;
    float qf[ATTN_MAX_HEADS][ATTN_MAX_DIM], scores[ATTN_BLOCK][ATTN_MAX_HEADS];
    float correction[ATTN_MAX_HEADS];
    int64_t key_offset[ATTN_MAX_HEADS];
#ifdef HAVE_AVX512_BF16
    const int bf16_dot = a->dtype == 1;
#else
    const int bf16_dot = 0;
#endif
    const bf16_t* q = (const bf16_t*)a->q + (b * a->num_heads + head0) * dim;
    for (int64_t h = 0; h < heads; h++) {
        key_offset[h] = (h / group) * dim;
        if (bf16_dot) continue;
        load_row(a->q, (b * a->num_heads + head0 + h) * dim, a->dtype, qf[h], dim);
        for (int64_t d = 0; d < dim; d++) qf[h][d] *= a->scale;
    }
    const int64_t elem = a->dtype == 0 ? 4 : 2, row_elems = a->num_kv_heads * dim;
    const int64_t row_bytes = row_elems * elem, part_bytes = kv_count * dim * elem;
    const int whole_rows = kv_count == a->num_kv_heads;
    const int32_t* slots = a->page_table + a->rows[b] * a->table_stride;
    for (int64_t t0 = begin; t0 < end; t0 += ATTN_BLOCK) {
        const int64_t count = end - t0 < ATTN_BLOCK ? end - t0 : ATTN_BLOCK;
        for (int64_t t = 0; t < count; t++) {
            if (whole_rows) {
                const int64_t ahead = slot_ahead(slots, end, next, t0 + t + ATTN_LOOKAHEAD);
                if (ahead >= 0) prefetch_rows(a->k_cache, row_bytes, 0, row_bytes, ahead);
            } else if (t0 + t + ATTN_PREFETCH < end) {
                const int64_t ahead = slots[t0 + t + ATTN_PREFETCH], first = kvh0 * dim * elem;
                prefetch_rows(a->k_cache, row_bytes, first, part_bytes, ahead);
                prefetch_rows(a->v_cache, row_bytes, first, part_bytes, ahead);
            }
            const int64_t key = (int64_t)slots[t0 + t] * row_elems + kvh0 * dim;
            if (bf16_dot)
                attn_position_scores(a, key, q, qf, key_offset, heads, scores[t], CHUNKS, 1);
            else
                attn_position_scores(a, key, q, qf, key_offset, heads, scores[t], CHUNKS, 0);
        }
        // Softmax along the block, 16 heads at a time.
        for (int64_t h0 = 0; h0 < heads; h0 += 16) {
            const __mmask16 m = first_lanes(heads - h0);
            const __m512 old_max = _mm512_maskz_loadu_ps(m, st->max + h0);
            __m512 top = old_max, total = _mm512_setzero_ps();
            for (int64_t t = 0; t < count; t++)
                top = _mm512_max_ps(top, _mm512_maskz_loadu_ps(m, scores[t] + h0));
            for (int64_t t = 0; t < count; t++) {
                __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores[t] + h0), top));
                _mm512_mask_storeu_ps(scores[t] + h0, m, p);
                total = _mm512_add_ps(total, p);
            }
            const __m512 shrink = exp512(_mm512_sub_ps(old_max, top));
            _mm512_mask_storeu_ps(correction + h0, m, shrink);
            _mm512_mask_storeu_ps(
                st->sum + h0, m,
                _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, st->sum + h0), shrink, total));
            _mm512_mask_storeu_ps(st->max + h0, m, top);
        }
        for (int64_t h = 0; h < heads; h++) {
            const __m512 shrink = _mm512_set1_ps(correction[h]);
            for (int c = 0; c < CHUNKS; c++)
                _mm512_storeu_ps(st->acc[h] + 16 * c,
                                 _mm512_mul_ps(_mm512_loadu_ps(st->acc[h] + 16 * c), shrink));
        }
        for (int64_t t = 0; t < count; t++) {
            if (whole_rows) {
                const int64_t ahead = slot_ahead(slots, end, next, t0 + t + ATTN_LOOKAHEAD);
                if (ahead >= 0) prefetch_rows(a->v_cache, row_bytes, 0, row_bytes, ahead);
            }
            int64_t row = (int64_t)slots[t0 + t] * row_elems + kvh0 * dim;
            for (int64_t kv = 0; kv < kv_count; kv++, row += dim) {
                __m512 v[CHUNKS];
                for (int c = 0; c < CHUNKS; c += 2)
                    load_pair(a->v_cache, row + 16 * c, a->dtype, v + c, v + c + 1);
                for (int64_t g = 0; g < group; g++) {
                    float* sums = st->acc[kv * group + g];
                    const __m512 weight = _mm512_set1_ps(scores[t][kv * group + g]);
                    for (int c = 0; c < CHUNKS; c++)
                        _mm512_storeu_ps(
                            sums + 16 * c,
                            _mm512_fmadd_ps(weight, v[c], _mm512_loadu_ps(sums + 16 * c)));
                }
            }
        }
    }
}

// CHUNKS of the vector path for this head_dim (0: the portable path).
static inline int attn_chunks(int64_t head_dim) {
    return head_dim == 64 ? 4 : head_dim == 128 ? 8 : head_dim == 256 ? 16 : 0;
}

static void attn_range(const attn_args* a, int64_t b, int64_t kvh0, int64_t kv_count,
                       int64_t begin, int64_t end, const attn_next* next, attn_state* st) {
    switch (attn_chunks(a->head_dim)) {
        case 4: attn_range_avx512(a, b, kvh0, kv_count, begin, end, next, st, 4); return;
        case 8: attn_range_avx512(a, b, kvh0, kv_count, begin, end, next, st, 8); return;
        default: attn_range_avx512(a, b, kvh0, kv_count, begin, end, next, st, 16); return;
    }
}

// Kv heads [kvh0, kvh0 + kv_count) of request b over all its positions; `next`: the positions
// read after them, or NULL.
static void attn_task_avx512(const attn_args* a, int64_t b, int64_t kvh0, int64_t kv_count,
                             const attn_next* next) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    attn_state st;
    attn_state_begin(a, b, kvh0 * group, kv_count * group, 1, &st);
    attn_range(a, b, kvh0, kv_count, attn_start(a, b), a->kv_lens[b], next, &st);
    attn_state_store(a, b, kvh0 * group, kv_count * group, &st);
}
#else
static inline int attn_chunks(int64_t head_dim) { return 0; }
#endif

// Portable version of the same computation (any head_dim up to ATTN_MAX_DIM) for query heads
// [first, first + count) of kv head kvh's group (count at most ATTN_MAX_GROUP: a wider group is
// taken a slice per task, each reading the group's keys and values again).
// DIM: head_dim as a constant (0: read it from a), so that the row loops unroll.
static inline __attribute__((always_inline)) void attn_generic_body(const attn_args* a, int64_t b,
                                                                    int64_t kvh, int64_t first,
                                                                    int64_t count,
                                                                    const int64_t DIM) {
    const int64_t group = a->num_heads / a->num_kv_heads, dim = DIM ? DIM : a->head_dim;
    const int64_t head0 = kvh * group + first;  // the slice's first query head
    float qf[ATTN_MAX_GROUP][ATTN_MAX_DIM], acc[ATTN_MAX_GROUP][ATTN_MAX_DIM];
    float scores[ATTN_MAX_GROUP][ATTN_BLOCK], row[ATTN_MAX_DIM];
    float run_max[ATTN_MAX_GROUP], run_sum[ATTN_MAX_GROUP];
    for (int64_t g = 0; g < count; g++) {
        int64_t offset = (b * a->num_heads + head0 + g) * dim;
        load_row(a->q, offset, a->dtype, qf[g], dim);
        for (int64_t d = 0; d < dim; d++) {
            qf[g][d] *= a->scale;
            acc[g][d] = a->prefix_out ? a->prefix_out[offset + d] : 0.0f;
        }
        run_max[g] = a->prefix_lse ? a->prefix_lse[b * a->num_heads + head0 + g] : 0.0f;
        run_sum[g] = a->prefix_lse ? 1.0f : 0.0f;
    }
    int has_state = a->prefix_lse != NULL;
    const int32_t* slots = a->page_table + a->rows[b] * a->table_stride;
    const int64_t kv_len = a->kv_lens[b], start = attn_start(a, b);
    // This kv head's part of each row, asked for GENERIC_PREFETCH positions ahead: no
    // prefetcher follows the part, and waiting on each load took ~55% of this loop (AVX2 build).
    const int64_t elem = a->dtype == 0 ? 4 : 2, part_bytes = dim * elem;
    const int64_t part_offset = kvh * part_bytes, row_bytes = a->num_kv_heads * part_bytes;
    for (int64_t t0 = start; t0 < kv_len; t0 += ATTN_BLOCK) {
        int64_t block = kv_len - t0 < ATTN_BLOCK ? kv_len - t0 : ATTN_BLOCK;
        for (int64_t j = 0; j < block; j++) {
            if (t0 + j + GENERIC_PREFETCH < kv_len)
                prefetch_rows(a->k_cache, row_bytes, part_offset, part_bytes,
                              slots[t0 + j + GENERIC_PREFETCH]);
            int64_t offset = ((int64_t)slots[t0 + j] * a->num_kv_heads + kvh) * dim;
            load_row(a->k_cache, offset, a->dtype, row, dim);
            for (int64_t g = 0; g < count; g++) {
                float dot = 0.0f;
                for (int64_t d = 0; d < dim; d++) dot += qf[g][d] * row[d];
                scores[g][j] = dot;
            }
        }
        for (int64_t g = 0; g < count; g++) {
            float new_max = scores[g][0];
            for (int64_t j = 1; j < block; j++)
                new_max = scores[g][j] > new_max ? scores[g][j] : new_max;
            if (has_state && run_max[g] > new_max) new_max = run_max[g];
            float correction = has_state ? expf(run_max[g] - new_max) : 0.0f;
            float block_sum = 0.0f;
            for (int64_t j = 0; j < block; j++) {
                scores[g][j] = exp_portable(scores[g][j] - new_max);
                block_sum += scores[g][j];
            }
            run_sum[g] = run_sum[g] * correction + block_sum;
            run_max[g] = new_max;
            for (int64_t d = 0; d < dim; d++) acc[g][d] *= correction;
        }
        has_state = 1;
        for (int64_t j = 0; j < block; j++) {
            if (j + GENERIC_PREFETCH < block)
                prefetch_rows(a->v_cache, row_bytes, part_offset, part_bytes,
                              slots[t0 + j + GENERIC_PREFETCH]);
            int64_t offset = ((int64_t)slots[t0 + j] * a->num_kv_heads + kvh) * dim;
            load_row(a->v_cache, offset, a->dtype, row, dim);
            for (int64_t g = 0; g < count; g++)
                for (int64_t d = 0; d < dim; d++) acc[g][d] += scores[g][j] * row[d];
        }
    }
    for (int64_t g = 0; g < count; g++) {
        float inv = 1.0f / run_sum[g];
        for (int64_t d = 0; d < dim; d++) acc[g][d] *= inv;
        store_row(a->out, (b * a->num_heads + head0 + g) * dim, a->dtype, acc[g], dim);
    }
}

// head_dim 64 and 128 with constant loop bounds, so the score and value loops unroll: batch 64 x
// 160 positions x 30 layers (SmolLM2's W1 decode) 50 -> 36 ms in an AVX2 build, with the
// prefetch 68 ms before.
static void attn_task_generic(const attn_args* a, int64_t b, int64_t kvh, int64_t first,
                              int64_t count) {
    if (a->head_dim == 64) attn_generic_body(a, b, kvh, first, count, 64);
    else if (a->head_dim == 128) attn_generic_body(a, b, kvh, first, count, 128);
    else attn_generic_body(a, b, kvh, first, count, 0);
}

// Whether attention kernels can take these heads: a whole number of query heads per kv head.
static inline int heads_fit(int64_t num_heads, int64_t num_kv_heads) {
    return num_kv_heads > 0 && num_heads > 0 && num_heads % num_kv_heads == 0;
}

// Returns MINISGL_OK, MINISGL_ERR_SHAPE (heads not a whole group per kv head, head_dim above
// ATTN_MAX_DIM) or MINISGL_ERR_NOMEM; any group size, head_dim, page size and batch otherwise.
int minisgl_decode_attention(const void* q, const void* k_cache, const void* v_cache, void* out,
                             const int32_t* page_table, int64_t table_stride,
                             const int64_t* rows, const int64_t* kv_lens,
                             const int64_t* kv_starts, const float* prefix_out,
                             const float* prefix_lse, int64_t num_reqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window,
                             int dtype, int nthreads) {
    if (!heads_fit(num_heads, num_kv_heads) || head_dim <= 0 || head_dim > ATTN_MAX_DIM ||
        num_reqs < 0)
        return MINISGL_ERR_SHAPE;
    attn_args a = {q,          k_cache,    v_cache,   out,          page_table, table_stride,
                   rows,       kv_lens,    kv_starts, prefix_out,   prefix_lse, num_heads,
                   num_kv_heads, head_dim, window,    scale,        dtype};
    const int64_t group = num_heads / num_kv_heads;
    if (!attn_chunks(head_dim) || group > ATTN_MAX_HEADS) {  // the portable path
        const int64_t slices = (group + ATTN_MAX_GROUP - 1) / ATTN_MAX_GROUP;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (int64_t task = 0; task < num_reqs * num_kv_heads * slices; task++) {
            const int64_t head = task / slices, first = task % slices * ATTN_MAX_GROUP;
            attn_task_generic(&a, head / num_kv_heads, head % num_kv_heads, first,
                              group - first < ATTN_MAX_GROUP ? group - first : ATTN_MAX_GROUP);
        }
        return MINISGL_OK;
    }
#ifdef __AVX512F__
    if (num_heads > ATTN_MAX_HEADS) {  // more heads than a task holds: one kv head per task
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (int64_t task = 0; task < num_reqs * num_kv_heads; task++)
            attn_task_avx512(&a, task / num_kv_heads, task % num_kv_heads, 1, NULL);
        return MINISGL_OK;
    }
    if (num_reqs == 0) return MINISGL_OK;
    if (num_reqs < 2 * nthreads) {
        // Few requests: each split into one range of positions per thread (whole rows, read in
        // order), their states merged after.
        const int64_t parts = nthreads, tasks = num_reqs * parts;
        attn_state* states = (attn_state*)kernel_alloc((size_t)tasks * sizeof(attn_state));
        if (!states) return MINISGL_ERR_NOMEM;
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
        for (int64_t task = 0; task < tasks; task++) {
            const int64_t b = task / parts, part = task % parts;
            const int64_t first = attn_start(&a, b), len = kv_lens[b] - first;
            attn_state_begin(&a, b, 0, num_heads, part == 0, states + task);
            attn_range(&a, b, 0, num_kv_heads, first + len * part / parts,
                       first + len * (part + 1) / parts, NULL, states + task);
        }
        for (int64_t b = 0; b < num_reqs; b++) {
            for (int64_t part = 1; part < parts; part++)
                attn_state_merge(states + b * parts, states + b * parts + part, num_heads,
                                 head_dim);
            attn_state_store(&a, b, 0, num_heads, states + b * parts);
        }
        free(states);
        return MINISGL_OK;
    }
    // Otherwise a task is a whole request (each position's rows are read once for all its
    // heads), and a run of consecutive requests holding an equal share of the positions is read
    // as one sweep along the slots (consecutive when requests' slots follow each other). Runs
    // are claimed one at a time, ATTN_RUNS_PER_THREAD of them a thread: one per thread left the
    // other waiting whenever the OS or another process slowed one.
    int64_t runs = nthreads * ATTN_RUNS_PER_THREAD;
    runs = runs < num_reqs ? runs : num_reqs;
    int64_t* run_first = (int64_t*)kernel_alloc((size_t)(runs + 1) * sizeof(int64_t));
    if (!run_first) return MINISGL_ERR_NOMEM;
    int64_t total = 0, done = 0;
    for (int64_t b = 0; b < num_reqs; b++) total += kv_lens[b] - attn_start(&a, b);
    for (int64_t r = 0, b = 0; r < runs; r++) {  // run r: the requests whose work begins in it
        while (b < num_reqs && done * runs < r * total) done += kv_lens[b] - attn_start(&a, b++);
        run_first[r] = b;
    }
    run_first[runs] = num_reqs;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t r = 0; r < runs; r++) {
        const int64_t hi = run_first[r + 1];
        for (int64_t b = run_first[r]; b < hi; b++) {
            attn_next next = {NULL, 0};
            if (b + 1 < hi) {
                const int64_t next_start = attn_start(&a, b + 1);
                next.slots = page_table + rows[b + 1] * table_stride + next_start;
                next.count = kv_lens[b + 1] - next_start;
            }
            attn_task_avx512(&a, b, 0, num_kv_heads, &next);
        }
    }
    free(run_first);
#endif
    return MINISGL_OK;
}


// --------------------------------------------------------- blocked attention (prefill, cascade)
// Keys and values are first laid out as tile operands: keys [16-key block][32-dim chunk][dim
// pair 16][key 16] (the B operand of Q K^T) and values [32-position block][16-dim tile][position
// pair 16][dim 16] (the B operand of P V), as 32-bit bf16 pairs, zero past the last position.
// A task then takes 16 query rows of one kv head (its GQA group's heads of consecutive tokens):
// scores = Q K^T, a two-pass softmax along each row (every key is known up front: no
// rescaling), out = P V with float32 probabilities, as PyTorch's bf16 attention keeps them:
// each is split into a bf16 part and a bf16 remainder, two bf16 products (the value half of the
// work doubles; rounding P to bf16 alone costs ~10% more error than PyTorch's SDPA). The
// products run on the AMX tiles where the CPU has them (`tiles`), else with vdpbf16ps on the
// same layout: a 32-bit pair of the query (or of P) broadcast against 16 keys' (or 16 dims')
// pairs. head_dim: a multiple of 32 up to ATTN_MAX_DIM.
#ifdef HAVE_AVX512_BF16
// 16 keys (row pointers into the pool, NULL past the end) as one key block of `dim / 32` chunks.
static void tile_layout_keys(uint32_t* dst, const bf16_t* const* keys, int64_t dim) {
    uint32_t rows16[16][ATTN_MAX_DIM / 2] __attribute__((aligned(64)));
    for (int64_t n = 0; n < 16; n++) {
        if (keys[n])
            memcpy(rows16[n], keys[n], (size_t)dim * 2);
        else
            memset(rows16[n], 0, (size_t)dim * 2);
    }
    // Each pair of dims gathered across the 16 keys.
    const __m512i across =
        _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                           _mm512_set1_epi32(ATTN_MAX_DIM / 2));
    for (int64_t i = 0; i < dim / 2; i++)  // chunk i / 16, pair i % 16
        _mm512_store_si512(dst + (i / 16) * 256 + (i % 16) * 16,
                           _mm512_i32gather_epi32(across, rows16[0] + i, 4));
}

// 32 values (row pointers, NULL past the end) as one value block.
static void tile_layout_values(uint32_t* dst, const bf16_t* const* values, int64_t dim) {
    for (int64_t pair = 0; pair < 16; pair++) {
        const bf16_t* first = values[2 * pair];
        const bf16_t* second = values[2 * pair + 1];
        for (int64_t d = 0; d < dim; d += 16) {  // dim tile d / 16
            __m512i low =
                first ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(first + d)))
                      : _mm512_setzero_si512();
            __m512i high =
                second ? _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)(second + d)))
                       : _mm512_setzero_si512();
            _mm512_store_si512(dst + (d / 16) * 256 + pair * 16,
                               _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
        }
    }
}

// 32 positions' keys and values (element offsets of their rows' head in the pool, -1 past the
// end) as two key blocks and one value block at `base` words.
static void tile_layout_positions(uint32_t* keys_t, uint32_t* values_p, int64_t base,
                                  const bf16_t* k_cache, const bf16_t* v_cache,
                                  const int64_t* at, int64_t dim) {
    const bf16_t* keys[32];
    const bf16_t* values[32];
    for (int64_t n = 0; n < 32; n++) {
        keys[n] = at[n] < 0 ? NULL : k_cache + at[n];
        values[n] = at[n] < 0 ? NULL : v_cache + at[n];
    }
    tile_layout_keys(keys_t + base, keys, dim);
    tile_layout_keys(keys_t + base + 8 * dim, keys + 16, dim);
    tile_layout_values(values_p + base, values, dim);
}

// Bits i of a 16-lane block starting at position p with lo <= p + i < hi.
static inline __mmask16 lanes_between(int64_t p, int64_t lo, int64_t hi) {
    int64_t first = lo - p < 0 ? 0 : lo - p > 16 ? 16 : lo - p;
    int64_t end = hi - p < 0 ? 0 : hi - p > 16 ? 16 : hi - p;
    const uint32_t below_end = (uint32_t)((1ull << end) - 1);
    const uint32_t below_first = (uint32_t)((1ull << first) - 1);
    return (__mmask16)(below_end & ~below_first);
}

// The softmax of a task's 16 rows of scores [16][k1 - k0] (float32, unscaled; row n sees
// positions [lo[n], hi[n])): each row's largest scaled score into maxes, its exponentials'
// sum into sums, and the exponentials as probs [2][16][k1 - k0] bf16 (bf16 parts, then
// remainders).
static void attend_softmax(const float* scores, bf16_t* probs, int64_t k0, int64_t k1,
                           const int64_t* lo, const int64_t* hi, float scale, float* maxes,
                           float* sums) {
    const int64_t span = k1 - k0;
    const __m512 scale_v = _mm512_set1_ps(scale);
    for (int64_t n = 0; n < 16; n++) {
        const float* row = scores + n * span;
        bf16_t* prob = probs + n * span;
        bf16_t* remainder = probs + (16 + n) * span;
        __m512 row_max = _mm512_set1_ps(-3.0e38f);
        for (int64_t p = k0; p < k1; p += 16)
            row_max = _mm512_mask_max_ps(row_max, lanes_between(p, lo[n], hi[n]), row_max,
                                         _mm512_mul_ps(_mm512_loadu_ps(row + (p - k0)), scale_v));
        const __m512 max_v = _mm512_set1_ps(maxes[n] = _mm512_reduce_max_ps(row_max));
        __m512 row_sum = _mm512_setzero_ps();
        for (int64_t p = k0; p < k1; p += 32) {
            __m512 e[2];
            for (int half = 0; half < 2; half++) {
                const int64_t first = p + 16 * half;
                e[half] = _mm512_maskz_mov_ps(
                    lanes_between(first, lo[n], hi[n]),
                    exp512(_mm512_fmsub_ps(_mm512_loadu_ps(row + (first - k0)), scale_v, max_v)));
                row_sum = _mm512_add_ps(row_sum, e[half]);
            }
            const __m512bh rounded = _mm512_cvtne2ps_pbh(e[1], e[0]);
            const __m512i halves = (__m512i)rounded;  // e[0]'s 16 in the low half
            const __m512 rest0 =
                _mm512_sub_ps(e[0], bf16x16_to_f32(_mm512_castsi512_si256(halves)));
            const __m512 rest1 =
                _mm512_sub_ps(e[1], bf16x16_to_f32(_mm512_extracti64x4_epi64(halves, 1)));
            _mm512_storeu_si512(prob + (p - k0), (__m512i)rounded);
            _mm512_storeu_si512(remainder + (p - k0), (__m512i)_mm512_cvtne2ps_pbh(rest1, rest0));
        }
        sums[n] = _mm512_reduce_add_ps(row_sum);
    }
}

#ifdef HAVE_AMX
// One task on the tiles: 16 query rows (row stride ATTN_MAX_DIM) against the keys of positions
// [k0, k1) (multiples of 32) of one head's laid-out keys and values; row n sees positions
// [lo[n], hi[n]) (none for padding rows). Leaves each row's unnormalised P V in acc
// [dim / 16][16][16], its largest scaled score in maxes and its sum of exponentials in sums.
// scores [16][k1 - k0] float32 and probs [2][16][k1 - k0] bf16 are scratch.
static void tile_attend(const bf16_t (*queries)[ATTN_MAX_DIM], const uint32_t* head_keys,
                        const uint32_t* head_values, int64_t k0, int64_t k1, const int64_t* lo,
                        const int64_t* hi, int64_t dim, float scale, float* scores, bf16_t* probs,
                        float (*acc)[16][16], float* maxes, float* sums) {
    const int64_t chunks = dim / 32, span = k1 - k0;
    for (int64_t p0 = k0; p0 < k1; p0 += 32) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t c = 0; c < chunks; c++) {
            _tile_loadd(4, queries[0] + 32 * c, ATTN_MAX_DIM * 2);
            _tile_loadd(6, head_keys + (p0 / 16 * chunks + c) * 256, 64);
            _tile_loadd(7, head_keys + ((p0 / 16 + 1) * chunks + c) * 256, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
        }
        _tile_stored(0, scores + (p0 - k0), span * 4);
        _tile_stored(1, scores + (p0 - k0) + 16, span * 4);
    }
    attend_softmax(scores, probs, k0, k1, lo, hi, scale, maxes, sums);
    for (int64_t d0 = 0; d0 < dim; d0 += 64) {
        const int64_t dtiles = dim - d0 >= 64 ? 4 : (dim - d0) / 16;
        _tile_zero(0);
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        for (int64_t p0 = k0; p0 < k1; p0 += 32) {
            const uint32_t* block = head_values + p0 * dim / 2 + d0 / 16 * 256;
            _tile_loadd(4, probs + (p0 - k0), span * 2);  // bf16 parts
            _tile_loadd(5, probs + 16 * span + (p0 - k0), span * 2);  // remainders
            // Dim tile t's values (into tile 6 or 7) times both, into accumulator t.
#define PV_TILE(t, values_tile)                          \
    do {                                                 \
        _tile_loadd(values_tile, block + 256 * (t), 64); \
        _tile_dpbf16ps(t, 4, values_tile);               \
        _tile_dpbf16ps(t, 5, values_tile);               \
    } while (0)
            PV_TILE(0, 6);
            if (dtiles > 1) PV_TILE(1, 7);
            if (dtiles > 2) PV_TILE(2, 6);
            if (dtiles > 3) PV_TILE(3, 7);
#undef PV_TILE
        }
        _tile_stored(0, acc[d0 / 16], 64);
        if (dtiles > 1) _tile_stored(1, acc[d0 / 16 + 1], 64);
        if (dtiles > 2) _tile_stored(2, acc[d0 / 16 + 2], 64);
        if (dtiles > 3) _tile_stored(3, acc[d0 / 16 + 3], 64);
    }
}
#endif

// Scores of query rows [n0, n0 + 8) against the 32 keys of two laid-out key blocks: per dim
// pair, each row's pair broadcast against 16 keys' pairs (16 accumulators in registers).
static inline __attribute__((always_inline)) void vec_scores_8x32(
    const bf16_t (*queries)[ATTN_MAX_DIM], int64_t n0, const uint32_t* keys0,
    const uint32_t* keys1, int64_t pairs, float* dst, int64_t span) {
    __m512 acc[8][2];
    for (int r = 0; r < 8; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    for (int64_t i = 0; i < pairs; i++) {
        const __m512bh first = (__m512bh)_mm512_load_si512(keys0 + 16 * i);
        const __m512bh second = (__m512bh)_mm512_load_si512(keys1 + 16 * i);
        for (int r = 0; r < 8; r++) {
            const __m512bh query = broadcast_pair(queries[n0 + r] + 2 * i);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], query, first);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], query, second);
        }
    }
    for (int r = 0; r < 8; r++) {
        _mm512_storeu_ps(dst + (n0 + r) * span, acc[r][0]);
        _mm512_storeu_ps(dst + (n0 + r) * span + 16, acc[r][1]);
    }
}

// P V of rows [n0, n0 + 4) for DTILES 16-dim tiles from dim d0: per position pair, each row's
// bf16 part and remainder broadcast against the tiles' value pairs (16 accumulators).
static inline __attribute__((always_inline)) void vec_pv_4rows(
    const bf16_t* probs, int64_t span, int64_t n0, const uint32_t* head_values, int64_t k0,
    int64_t k1, int64_t d0, int64_t dim, const int dtiles, float (*acc)[16][16]) {
    __m512 sum[4][4];
    for (int r = 0; r < 4; r++)
        for (int t = 0; t < 4; t++) sum[r][t] = _mm512_setzero_ps();
    for (int64_t p = k0; p < k1; p += 2) {
        const uint32_t* pair = head_values + p / 32 * 16 * dim + d0 / 16 * 256 + p % 32 / 2 * 16;
        __m512bh values[4];
        for (int t = 0; t < dtiles; t++) values[t] = (__m512bh)_mm512_load_si512(pair + 256 * t);
        for (int r = 0; r < 4; r++) {
            const __m512bh part = broadcast_pair(probs + (n0 + r) * span + (p - k0));
            const __m512bh rest = broadcast_pair(probs + (16 + n0 + r) * span + (p - k0));
            for (int t = 0; t < dtiles; t++) {
                sum[r][t] = _mm512_dpbf16_ps(sum[r][t], part, values[t]);
                sum[r][t] = _mm512_dpbf16_ps(sum[r][t], rest, values[t]);
            }
        }
    }
    for (int r = 0; r < 4; r++)
        for (int t = 0; t < dtiles; t++) _mm512_store_ps(acc[d0 / 16 + t][n0 + r], sum[r][t]);
}

// tile_attend's computation with vdpbf16ps instead of the tiles (same arguments and results).
static void vec_attend(const bf16_t (*queries)[ATTN_MAX_DIM], const uint32_t* head_keys,
                       const uint32_t* head_values, int64_t k0, int64_t k1, const int64_t* lo,
                       const int64_t* hi, int64_t dim, float scale, float* scores, bf16_t* probs,
                       float (*acc)[16][16], float* maxes, float* sums) {
    const int64_t span = k1 - k0;
    for (int64_t p0 = k0; p0 < k1; p0 += 32) {
        const uint32_t* block = head_keys + p0 / 16 * 8 * dim;
        for (int64_t n0 = 0; n0 < 16; n0 += 8)
            vec_scores_8x32(queries, n0, block, block + 8 * dim, dim / 2, scores + (p0 - k0),
                            span);
    }
    attend_softmax(scores, probs, k0, k1, lo, hi, scale, maxes, sums);
    for (int64_t d0 = 0; d0 < dim; d0 += 64)
        for (int64_t n0 = 0; n0 < 16; n0 += 4) {
            if (dim - d0 >= 64)
                vec_pv_4rows(probs, span, n0, head_values, k0, k1, d0, dim, 4, acc);
            else
                vec_pv_4rows(probs, span, n0, head_values, k0, k1, d0, dim, 2, acc);
        }
}

// One task through the tiles or vdpbf16ps.
static inline void attend(int tiles, const bf16_t (*queries)[ATTN_MAX_DIM],
                          const uint32_t* head_keys, const uint32_t* head_values, int64_t k0,
                          int64_t k1, const int64_t* lo, const int64_t* hi, int64_t dim,
                          float scale, float* scores, bf16_t* probs, float (*acc)[16][16],
                          float* maxes, float* sums) {
#ifdef HAVE_AMX
    if (tiles) {
        tile_attend(queries, head_keys, head_values, k0, k1, lo, hi, dim, scale, scores, probs,
                    acc, maxes, sums);
        return;
    }
#endif
    (void)tiles;
    vec_attend(queries, head_keys, head_values, k0, k1, lo, hi, dim, scale, scores, probs, acc,
               maxes, sums);
}

// Tile configuration around a thread's tasks (nothing without tiles).
static inline void attend_begin(int tiles) {
#ifdef HAVE_AMX
    if (tiles) amx_configure();
#endif
    (void)tiles;
}

static inline void attend_end(int tiles) {
#ifdef HAVE_AMX
    if (tiles) _tile_release();
#endif
    (void)tiles;
}

// Query rows [row0, row0 + 16) of kv head h (row r: token r / group, head h * group + r % group)
// of q [tokens, heads, dim]; zero past `rows`.
static void tile_queries(bf16_t (*queries)[ATTN_MAX_DIM], const bf16_t* q, int64_t row0,
                         int64_t rows, int64_t h, int64_t group, int64_t num_heads, int64_t dim) {
    for (int64_t n = 0; n < 16; n++) {
        const int64_t r = row0 + n;
        if (r < rows)
            memcpy(queries[n], q + ((r / group) * num_heads + h * group + r % group) * dim,
                   (size_t)dim * 2);
        else
            memset(queries[n], 0, (size_t)dim * 2);
    }
}
#endif

// The cascade's first half: every query token of a batch (q [tokens, heads, dim] bf16) against
// the `prefix_len` positions all its requests share (KV at `slots`). Writes out [tokens, heads,
// dim] float32 (normalised) and lse [tokens, heads] (natural log-sum-exp of the scaled scores),
// the state minisgl_decode_attention continues from. use_tiles: on the AMX tiles (where compiled
// in), else with vdpbf16ps. Returns MINISGL_OK, MINISGL_ERR_SHAPE (head_dim not a multiple of 32
// up to ATTN_MAX_DIM, no prefix), MINISGL_ERR_NOMEM, or without avx512_bf16
// MINISGL_ERR_UNSUPPORTED; nothing written on an error.
int minisgl_shared_prefix_attention(const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache,
                                    const int64_t* slots, int64_t prefix_len, float* out,
                                    float* lse, int64_t tokens, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t dim, float scale, int use_tiles,
                                    int nthreads) {
#ifdef HAVE_AVX512_BF16
    if (dim % 32 != 0 || dim <= 0 || dim > ATTN_MAX_DIM || prefix_len <= 0 || tokens < 0 ||
        !heads_fit(num_heads, num_kv_heads))
        return MINISGL_ERR_SHAPE;
    use_tiles = tiles_usable(use_tiles);
    const int64_t group = num_heads / num_kv_heads, rows = tokens * group;
    const int64_t tiles = (rows + 15) / 16, padded = (prefix_len + 31) / 32 * 32;
    const int64_t row_elems = num_kv_heads * dim;
    // Laid-out keys and values [kv head][position], then per thread: scores [16, padded]
    // float32, probabilities [2, 16, padded] bf16.
    const size_t kv_words = (size_t)(num_kv_heads * padded * dim / 2);
    const size_t thread_bytes = (size_t)(16 * padded * 4 * 2);
    char* buffer = (char*)kernel_alloc(8 * kv_words + (size_t)nthreads * thread_bytes);
    if (!buffer) return MINISGL_ERR_NOMEM;
    uint32_t* keys_t = (uint32_t*)buffer;
    uint32_t* values_p = keys_t + kv_words;
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(static)
        for (int64_t block = 0; block < num_kv_heads * padded / 32; block++) {
            const int64_t h = block / (padded / 32), p0 = block % (padded / 32) * 32;
            int64_t at[32];
            for (int64_t n = 0; n < 32; n++)
                at[n] = p0 + n < prefix_len ? slots[p0 + n] * row_elems + h * dim : -1;
            tile_layout_positions(keys_t, values_p, (h * padded + p0) * dim / 2, k_cache, v_cache,
                                  at, dim);
        }
        attend_begin(use_tiles);
        char* mine = buffer + 8 * kv_words + (size_t)omp_get_thread_num() * thread_bytes;
        float* scores = (float*)mine;
        bf16_t* probs = (bf16_t*)(mine + 16 * padded * 4);
        bf16_t queries[16][ATTN_MAX_DIM] __attribute__((aligned(64)));
        float acc[ATTN_MAX_DIM / 16][16][16] __attribute__((aligned(64)));
        int64_t lo[16], hi[16];
        float maxes[16], sums[16];
        for (int64_t n = 0; n < 16; n++) lo[n] = 0, hi[n] = prefix_len;
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < num_kv_heads * tiles; task++) {
            const int64_t h = task / tiles, row0 = task % tiles * 16;
            const int64_t base = h * padded * dim / 2;
            tile_queries(queries, q, row0, rows, h, group, num_heads, dim);
            attend(use_tiles, queries, keys_t + base, values_p + base, 0, padded, lo, hi, dim,
                   scale, scores, probs, acc, maxes, sums);
            for (int64_t n = 0; n < 16 && row0 + n < rows; n++) {
                int64_t r = row0 + n, head = (r / group) * num_heads + h * group + r % group;
                __m512 inv = _mm512_set1_ps(1.0f / sums[n]);
                for (int64_t t = 0; t < dim / 16; t++)
                    _mm512_storeu_ps(out + head * dim + 16 * t,
                                     _mm512_mul_ps(_mm512_load_ps(acc[t][n]), inv));
                lse[head] = maxes[n] + logf(sums[n]);
            }
        }
        attend_end(use_tiles);
    }
    free(buffer);
    return MINISGL_OK;
#else
    (void)q, (void)k_cache, (void)v_cache, (void)slots, (void)prefix_len, (void)out, (void)lse;
    (void)tokens, (void)num_heads, (void)num_kv_heads, (void)dim, (void)scale, (void)use_tiles;
    (void)nthreads;
    return MINISGL_ERR_UNSUPPORTED;
#endif
}

#ifdef HAVE_AVX512_BF16
// Where a prefill attention task's 16 query rows (row0 on, `rows` in its request) sit: each
// row's visible positions [lo, hi) and the key blocks [k0, k1) they span, all for a request with
// `cached` positions before its new tokens.
typedef struct {
    int64_t lo[16], hi[16], k0, k1, last;
} prefill_tile;

static inline void prefill_tile_bounds(prefill_tile* t, int64_t row0, int64_t rows,
                                       int64_t group, int64_t cached, int64_t window) {
    for (int64_t n = 0; n < 16; n++) {
        const int64_t own = cached + (row0 + n) / group, valid = row0 + n < rows;
        t->hi[n] = valid ? own + 1 : 0;
        t->lo[n] = valid && window > 0 && own - window + 1 > 0 ? own - window + 1 : 0;
    }
    t->last = (rows - row0 < 16 ? rows - row0 : 16) - 1;
    t->k0 = t->lo[0] / 32 * 32;
    t->k1 = (t->hi[t->last] + 31) / 32 * 32;
}
#endif

// Causal prefill attention: request b's extend_lens[b] new tokens (consecutive rows of q
// [tokens, heads, dim] bf16, request after request) at positions cached_lens[b] + j attend to
// the positions [lo, own] of page-table row rows[b] (lo = own - window + 1 with a sliding
// window, else 0), read from the pool (their new K/V already stored). Writes out [tokens,
// heads, dim] bf16. Each request's keys and values are laid out once for all its query tiles, a
// tile computes only the key blocks its rows can see, and each thread takes a contiguous run of
// tiles (so a request's keys stay in its cache) holding an equal share of the key blocks.
// use_tiles: on the AMX tiles (where compiled in), else with vdpbf16ps. Returns MINISGL_OK,
// MINISGL_ERR_SHAPE (head_dim not a multiple of 32 up to ATTN_MAX_DIM), MINISGL_ERR_NOMEM, or
// without avx512_bf16 MINISGL_ERR_UNSUPPORTED; nothing written on an error.
// The first task i (of `tasks`, cumulative costs cost_first[0..tasks]) with
// cost_first[i] * runs >= target, or `tasks`: where a run of 1 / runs of the cost begins.
static int64_t first_task_from(const int64_t* cost_first, int64_t tasks, int64_t target,
                               int64_t runs) {
    int64_t lo = 0, hi = tasks;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (cost_first[mid] * runs >= target) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

#define PREFILL_RUNS_PER_THREAD 4
int minisgl_prefill_attention(const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache,
                              bf16_t* out, const int32_t* page_table, int64_t table_stride,
                              const int64_t* rows, const int64_t* cached_lens,
                              const int64_t* extend_lens, int64_t num_reqs, int64_t num_heads,
                              int64_t num_kv_heads, int64_t dim, float scale, int64_t window,
                              int use_tiles, int nthreads) {
#ifdef HAVE_AVX512_BF16
    if (dim % 32 != 0 || dim <= 0 || dim > ATTN_MAX_DIM || num_reqs < 0 ||
        !heads_fit(num_heads, num_kv_heads))
        return MINISGL_ERR_SHAPE;
    if (num_reqs == 0) return MINISGL_OK;
    use_tiles = tiles_usable(use_tiles);
    const int64_t group = num_heads / num_kv_heads, row_elems = num_kv_heads * dim;
    // Per request (prefix sums, one extra entry for the totals): first query token, first
    // laid-out position, first 32-position block (x kv heads), first task.
    int64_t* starts = (int64_t*)kernel_alloc((size_t)(4 * (num_reqs + 1)) * sizeof(int64_t));
    if (!starts) return MINISGL_ERR_NOMEM;
    int64_t *q_first = starts, *kv_first = starts + num_reqs + 1;
    int64_t *block_first = kv_first + num_reqs + 1, *task_first = block_first + num_reqs + 1;
    int64_t max_padded = 0;
    q_first[0] = kv_first[0] = block_first[0] = task_first[0] = 0;
    for (int64_t b = 0; b < num_reqs; b++) {
        const int64_t padded = (cached_lens[b] + extend_lens[b] + 31) / 32 * 32;
        max_padded = padded > max_padded ? padded : max_padded;
        q_first[b + 1] = q_first[b] + extend_lens[b];
        kv_first[b + 1] = kv_first[b] + padded;
        block_first[b + 1] = block_first[b] + padded / 32 * num_kv_heads;
        task_first[b + 1] = task_first[b] + (extend_lens[b] * group + 15) / 16 * num_kv_heads;
    }
    const int64_t tasks = task_first[num_reqs];
    // A task's cost: its key blocks plus a fixed share for loading queries and storing rows.
    int64_t* cost_first = (int64_t*)kernel_alloc((size_t)(tasks + 1) * sizeof(int64_t));
    const size_t kv_words = (size_t)(kv_first[num_reqs] * num_kv_heads * dim / 2);
    const size_t thread_bytes = (size_t)(16 * max_padded * 4 * 2);
    char* buffer = cost_first ? (char*)kernel_alloc(8 * kv_words + (size_t)nthreads * thread_bytes)
                              : NULL;
    if (!buffer || !cost_first) {
        free(buffer), free(cost_first), free(starts);
        return MINISGL_ERR_NOMEM;
    }
    cost_first[0] = 0;
    for (int64_t b = 0, i = 0; b < num_reqs; b++) {
        const int64_t tiles = (task_first[b + 1] - task_first[b]) / num_kv_heads;
        for (int64_t h = 0; h < num_kv_heads; h++)
            for (int64_t tile = 0; tile < tiles; tile++, i++) {
                prefill_tile t;
                prefill_tile_bounds(&t, tile * 16, extend_lens[b] * group, group, cached_lens[b],
                                    window);
                cost_first[i + 1] = cost_first[i] + (t.k1 - t.k0) / 32 + 2;
            }
    }
    uint32_t* keys_t = (uint32_t*)buffer;
    uint32_t* values_p = keys_t + kv_words;
#pragma omp parallel num_threads(nthreads)
    {
        int64_t b = 0;
#pragma omp for schedule(static)
        for (int64_t i = 0; i < block_first[num_reqs]; i++) {
            while (block_first[b + 1] <= i) b++;  // a thread's i only grows
            const int64_t local = i - block_first[b], h = local % num_kv_heads;
            const int64_t p0 = local / num_kv_heads * 32, kv_len = cached_lens[b] + extend_lens[b];
            const int64_t padded = kv_first[b + 1] - kv_first[b];
            // With a window, blocks before the first new token's window are never read.
            if (window > 0 && p0 + 32 <= cached_lens[b] - window + 1) continue;
            const int32_t* slots = page_table + rows[b] * table_stride;
            int64_t at[32];
            for (int64_t n = 0; n < 32; n++)
                at[n] = p0 + n < kv_len ? (int64_t)slots[p0 + n] * row_elems + h * dim : -1;
            tile_layout_positions(keys_t, values_p,
                                  (kv_first[b] * num_kv_heads + h * padded + p0) * dim / 2,
                                  k_cache, v_cache, at, dim);
        }  // the implicit barrier: every layout is done before any task reads it
        attend_begin(use_tiles);
        // Tasks go in PREFILL_RUNS_PER_THREAD runs a thread of equal cost, claimed one at a
        // time (a run per thread left the other waiting whenever one was slowed).
        const int64_t workers = omp_get_num_threads(), me = omp_get_thread_num();
        const int64_t total = cost_first[tasks], runs = workers * PREFILL_RUNS_PER_THREAD;
        char* mine = buffer + 8 * kv_words + (size_t)me * thread_bytes;
        float* scores = (float*)mine;
        bf16_t* probs = (bf16_t*)(mine + 16 * max_padded * 4);
        bf16_t queries[16][ATTN_MAX_DIM] __attribute__((aligned(64)));
        float acc[ATTN_MAX_DIM / 16][16][16] __attribute__((aligned(64)));
        float maxes[16], sums[16];
        b = 0;
#pragma omp for schedule(dynamic, 1)
        for (int64_t run = 0; run < runs; run++) {
          // the tasks whose cost starts in this run's share
          const int64_t first = first_task_from(cost_first, tasks, total * run, runs);
          const int64_t end = first_task_from(cost_first, tasks, total * (run + 1), runs);
          for (int64_t i = first; i < end; i++) {
            while (task_first[b + 1] <= i) b++;
            const int64_t tiles = (task_first[b + 1] - task_first[b]) / num_kv_heads;
            const int64_t h = (i - task_first[b]) / tiles, row0 = (i - task_first[b]) % tiles * 16;
            const int64_t rows_b = extend_lens[b] * group, padded = kv_first[b + 1] - kv_first[b];
            prefill_tile t;
            prefill_tile_bounds(&t, row0, rows_b, group, cached_lens[b], window);
            const int64_t base = (kv_first[b] * num_kv_heads + h * padded) * dim / 2;
            tile_queries(queries, q + q_first[b] * num_heads * dim, row0, rows_b, h, group,
                         num_heads, dim);
            attend(use_tiles, queries, keys_t + base, values_p + base, t.k0, t.k1, t.lo, t.hi, dim,
                   scale, scores, probs, acc, maxes, sums);
            for (int64_t n = 0; n <= t.last; n++) {
                const int64_t r = row0 + n, token = q_first[b] + r / group;
                bf16_t* dst = out + (token * num_heads + h * group + r % group) * dim;
                const __m512 inv = _mm512_set1_ps(1.0f / sums[n]);
                for (int64_t d = 0; d < dim / 16; d++)
                    _mm256_storeu_si256((__m256i*)(dst + 16 * d),
                                        (__m256i)_mm512_cvtneps_pbh(
                                            _mm512_mul_ps(_mm512_load_ps(acc[d][n]), inv)));
            }
          }
        }
        attend_end(use_tiles);
    }
    free(buffer);
    free(cost_first);
    free(starts);
    return MINISGL_OK;
#else
    (void)q, (void)k_cache, (void)v_cache, (void)out, (void)page_table, (void)table_stride;
    (void)rows, (void)cached_lens, (void)extend_lens, (void)num_reqs, (void)num_heads;
    (void)num_kv_heads, (void)dim, (void)scale, (void)window, (void)use_tiles, (void)nthreads;
    return MINISGL_ERR_UNSUPPORTED;
#endif
}

// ------------------------------------------------------------------------ fused elementwise
#ifdef __AVX512F__
// Round float32 lanes to bfloat16 precision (nearest even), kept as float32.
static inline __m512 round_bf16_512(__m512 x) {
    __m512i u = _mm512_castps_si512(x);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    u = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff)));
    return _mm512_castsi512_ps(_mm512_and_si512(u, _mm512_set1_epi32((int)0xffff0000u)));
}

static inline __m512 round_to_512(int dtype, __m512 x) {
    return dtype == 0 ? x : round_bf16_512(x);
}

// Stores 16 lanes already rounded to the dtype (bf16: their top halves).
static inline void store16(void* base, int64_t offset, int dtype, __m512 v) {
    if (dtype == 0) {
        _mm512_storeu_ps((float*)base + offset, v);
    } else {
        __m256i half = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(v), 16));
        _mm256_storeu_si256((__m256i*)((bf16_t*)base + offset), half);
    }
}
#endif

#ifdef __AVX512F__
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
static __attribute__((noinline)) void add_rms_norm_row(const void* x, const void* residual,
                                                       const void* weight, void* out,
                             void* residual_out, int64_t r, int64_t hidden, float eps,
                             int dtype) {
#ifdef __AVX512F__
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

void minisgl_add_rms_norm(const void* x, const void* residual, const void* weight, void* out,
                          void* residual_out, int64_t rows, int64_t hidden, float eps, int dtype,
                          int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++)
        add_rms_norm_row(x, residual, weight, out, residual_out, r, hidden, eps, dtype);
}

#ifdef __AVX512F__
// round(round(silu(gate)) * up) in the dtype, as PyTorch's op-by-op silu(gate) * up rounds.
// A correctly rounded division (the explicit-rounding form, which -ffast-math leaves alone), as
// PyTorch divides: the gated matmul's epilogue and minisgl_silu_and_mul agree bit for bit, and
// a reciprocal estimate's last-bit error would flip bf16 roundings PyTorch does not.
static inline __m512 silu_times(__m512 gate, __m512 up, int dtype) {
    const __m512 neg = _mm512_min_ps(_mm512_sub_ps(_mm512_setzero_ps(), gate),
                                     _mm512_set1_ps(88.0f));
    const __m512 denom = _mm512_add_ps(_mm512_set1_ps(1.0f), exp512(neg));
    const __m512 silu = _mm512_div_round_ps(gate, denom, _MM_FROUND_CUR_DIRECTION);
    return round_to_512(dtype, _mm512_mul_ps(round_to_512(dtype, silu), up));
}
#endif

// out[r, i] = round(silu(gate[r, i])) * up[r, i], gate_up = [gate | up] per row.
#define SILU_CHUNK 256
void minisgl_silu_and_mul(const void* gate_up, void* out, int64_t rows, int64_t inter,
                          int dtype, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        int64_t i = 0;
#ifdef __AVX512F__
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
                gate[j] = round_to(dtype, gate[j] / (1.0f + exp_portable(-gate[j]))) * up[j];
            store_row(out, r * inter + i, dtype, gate, n);
        }
    }
}

// indices[r] = the first column of row r of x [rows, cols] (dtype code: float32 or bf16)
// holding its largest value, or its first NaN (as torch.max(dim=-1) picks): greedy sampling
// straight from the logits, bf16 ones widened exactly to float32 as they are read.
void minisgl_argmax(const void* x, int64_t* indices, int64_t rows, int64_t cols, int dtype,
                    int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * cols;
        int64_t c = 0, best = 0;
        float best_value;
        load_row(x, base, dtype, &best_value, 1);
#ifdef __AVX512F__
        if (cols >= 16) {
            // Per lane: the largest value so far and its first column; a NaN stops the scan.
            __m512 lane_max = load16(x, base, dtype);
            __m512i lane_at =
                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
            __m512i at = lane_at;
            const __m512i step = _mm512_set1_epi32(16);
            int nan = _mm512_cmp_ps_mask(lane_max, lane_max, _CMP_UNORD_Q) != 0;
            for (c = 16; c + 16 <= cols && !nan; c += 16) {
                at = _mm512_add_epi32(at, step);
                const __m512 v = load16(x, base + c, dtype);
                const __mmask16 higher = _mm512_cmp_ps_mask(v, lane_max, _CMP_GT_OQ);
                lane_max = _mm512_mask_mov_ps(lane_max, higher, v);
                lane_at = _mm512_mask_mov_epi32(lane_at, higher, at);
                nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
            }
            if (nan) {  // the scalar scan below finds the first NaN
                c = 0;
            } else {
                float values[16];
                int32_t at_lane[16];
                _mm512_storeu_ps(values, lane_max);
                _mm512_storeu_si512(at_lane, lane_at);
                best_value = values[0], best = at_lane[0];
                for (int lane = 1; lane < 16; lane++)
                    if (values[lane] > best_value ||
                        (values[lane] == best_value && at_lane[lane] < best))
                        best_value = values[lane], best = at_lane[lane];
            }
        }
#endif
        for (; c < cols; c++) {
            float v;
            load_row(x, base + c, dtype, &v, 1);
            if (v != v) {
                best = c;
                break;
            }
            if (v > best_value) best_value = v, best = c;
        }
        indices[r] = best;
    }
}

// The weights of a row's columns [0, n) into w, and their float32 sum (minisgl_sample_rows adds
// these block sums in double): x itself, or for logits exp((x - top) * inv_temp), 0 below e^-87
// (where exp underflows, and for -inf).
#define SAMPLE_BLOCK 64
static inline float block_weights(const float* x, int64_t n, int logits, float top,
                                  float inv_temp, float* w) {
#ifdef __AVX512F__
    if (n == SAMPLE_BLOCK) {
        __m512 total = _mm512_setzero_ps();
        for (int i = 0; i < SAMPLE_BLOCK; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            if (logits) {
                const __m512 z =
                    _mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(top)), _mm512_set1_ps(inv_temp));
                const __mmask16 live = _mm512_cmp_ps_mask(z, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
                v = _mm512_maskz_mov_ps(live, exp512(z));
            }
            _mm512_storeu_ps(w + i, v);
            total = _mm512_add_ps(total, v);
        }
        return _mm512_reduce_add_ps(total);
    }
#endif
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float z = (x[i] - top) * inv_temp;
        w[i] = !logits ? x[i] : z >= -87.0f ? expf(z) : 0.0f;
        sum += w[i];
    }
    return sum;
}

// tokens[r]: a draw from row r of x [rows, cols], by the inverse of its distribution function:
// the first column whose running weight exceeds uniforms[r] (in [0, 1)) times the row's total.
// The weights are x itself (>= 0, not all zero) or, given temperatures, softmax(x / T) up to
// its normaliser, computed on the fly (no probability buffer). One uniform number per row, where
// drawing one per column (an exponential race) cost 34 ms at 64 x 151,936.
void minisgl_sample_rows(const float* x, const float* temperatures, const double* uniforms,
                         int64_t* tokens, int64_t rows, int64_t cols, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float* row = x + r * cols;
        const int logits = temperatures != NULL;
        float top = 0.0f, w[SAMPLE_BLOCK];
        if (logits) {
            int64_t c = 0;
            top = row[0];
#ifdef __AVX512F__
            __m512 tops = _mm512_set1_ps(row[0]);
            for (; c + 16 <= cols; c += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(row + c));
            top = _mm512_reduce_max_ps(tops);
#endif
            for (; c < cols; c++) top = row[c] > top ? row[c] : top;
        }
        const float inv_temp = logits ? 1.0f / temperatures[r] : 1.0f;
        double total = 0.0;
        for (int64_t c = 0; c < cols; c += SAMPLE_BLOCK)
            total += block_weights(row + c, cols - c < SAMPLE_BLOCK ? cols - c : SAMPLE_BLOCK,
                                   logits, top, inv_temp, w);
        const double target = uniforms[r] * total;
        double running = 0.0;
        int64_t token = -1, last = 0;  // last: the start of the last block with weight
        for (int64_t c = 0; c < cols && token < 0; c += SAMPLE_BLOCK) {
            const int64_t n = cols - c < SAMPLE_BLOCK ? cols - c : SAMPLE_BLOCK;
            const float sum = block_weights(row + c, n, logits, top, inv_temp, w);
            if (sum > 0.0f) last = c;
            if (running + sum <= target) {
                running += sum;
                continue;
            }
            // The crossing is in this block, up to rounding (the element sums in double may
            // fall short of the block's float sum): then the next column with weight after it.
            double inside = running;
            for (int64_t i = 0; i < n; i++) {
                inside += w[i];
                if (inside > target && w[i] > 0.0f) {
                    token = c + i;
                    break;
                }
            }
            running += sum;
        }
        if (token < 0) {  // target at the very top (rounding): the last column with weight
            const int64_t n = cols - last < SAMPLE_BLOCK ? cols - last : SAMPLE_BLOCK;
            block_weights(row + last, n, logits, top, inv_temp, w);
            for (token = n - 1; token > 0 && !(w[token] > 0.0f); token--) {
            }
            token += last;
        }
        tokens[r] = token;
    }
}

// A candidate of minisgl_top_candidates; `a` ranks before `b` when larger, or equal and
// further left (the first of equal values first, as a stable sort).
typedef struct {
    float value;
    int64_t index;
} candidate;

static inline int ranks_before(candidate a, candidate b) {
    return a.value > b.value || (a.value == b.value && a.index < b.index);
}

static int compare_candidates(const void* a, const void* b) {
    return ranks_before(*(const candidate*)a, *(const candidate*)b) ? -1 : 1;
}

// Reorder buf[0, n) so that its k first-ranked come first, in no order (quickselect).
static void select_first(candidate* buf, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const candidate pivot = buf[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (ranks_before(buf[i], pivot)) i++;
            while (ranks_before(pivot, buf[j])) j--;
            if (i <= j) {
                const candidate swap = buf[i];
                buf[i++] = buf[j], buf[j--] = swap;
            }
        }
        if (k - 1 <= j)
            hi = j;
        else if (k - 1 >= i)
            lo = i;
        else
            return;
    }
}

// The k largest values of each row of x [rows, cols] (float32, k <= cols), largest first (the
// first column first among equals), and their columns. One pass: a column is kept when it
// beats the weakest of the best k so far (16 compared at a time); when 2k are kept, the best k
// are selected and the bar rises. torch.topk took ~17 ms for 1,024 of 151,936 columns x 64
// rows here; a heap of the best k, ~15. Returns MINISGL_OK, MINISGL_ERR_SHAPE (k outside
// [1, cols]) or MINISGL_ERR_NOMEM.
int minisgl_top_candidates(const float* x, int64_t rows, int64_t cols, int64_t k, float* values,
                           int64_t* indices, int nthreads) {
    if (k <= 0 || k > cols || rows < 0) return MINISGL_ERR_SHAPE;
    int status = MINISGL_OK;
#pragma omp parallel num_threads(nthreads)
    {
        candidate* kept = (candidate*)kernel_alloc((size_t)(2 * k) * sizeof(candidate));
        if (!kept) {
#pragma omp atomic write
            status = MINISGL_ERR_NOMEM;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!kept) continue;  // this thread's rows are lost: the call reports the failure
            const float* row = x + r * cols;
            int64_t count = 0;
            float bar = -INFINITY;  // every kept value beats it; -inf: fewer than k kept so far
            for (int64_t c = 0; c < cols; c++) {
#ifdef __AVX512F__
                if (c % 16 == 0 && c + 16 <= cols &&
                    !_mm512_cmp_ps_mask(_mm512_loadu_ps(row + c), _mm512_set1_ps(bar),
                                        _CMP_GT_OQ)) {
                    c += 15;  // none of these 16 beats the bar
                    continue;
                }
#endif
                if (!(row[c] > bar) && !(count < k && row[c] == bar)) continue;
                kept[count++] = (candidate){row[c], c};
                if (count == 2 * k) {
                    select_first(kept, count, k);
                    count = k;
                    bar = kept[0].value;
                    for (int64_t i = 1; i < k; i++) bar = kept[i].value < bar ? kept[i].value : bar;
                }
            }
            if (count > k) select_first(kept, count, k);
            qsort(kept, (size_t)k, sizeof(candidate), compare_candidates);
            for (int64_t i = 0; i < k; i++)
                values[r * k + i] = kept[i].value, indices[r * k + i] = kept[i].index;
        }
        free(kept);
    }
    return status;
}

// Whether every position has its row in rotary tables of max_positions rows.
static int positions_fit(const int64_t* positions, int64_t tokens, int64_t max_positions) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_positions) return 0;
    return 1;
}

// One token's heads of minisgl_rotary: x + base holds them dim apart; cos/sin its rows. Never
// inlined, as add_rms_norm_row (one compiled form for minisgl_rotary and the attention blocks).
#define ROTARY_CHUNK 128
static __attribute__((noinline)) void rotary_token(void* x, int64_t base, int64_t heads, int64_t dim, const float* cos,
                         const float* sin, int dtype) {
    const int64_t half = dim / 2;
    for (int64_t h = 0; h < heads; h++, base += dim) {
        int64_t i = 0;
#ifdef __AVX512F__
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

// ------------------------------------------------------------------ decode attention block
// The attention half of a decode layer after the qkv projection, in one call: q/k RMSNorm (when
// q_norm is set), rotary, the new keys/values into the pool at out_loc, paged attention.
// qkv: [tokens, q | k | v] (read only); q_buf: [tokens, q_width] scratch; out: [tokens, q_width].
// Everything before the attention itself: q into q_buf and the new keys/values into the pool,
// then the norms and rotary in place there, a token at a time (its rows are in L1): the same
// per-row kernels as the module path's norm and rotary calls, so the same results bit for bit,
// without writing the projection back (that traffic was a third of these inputs' time).
// Returns MINISGL_OK or, before writing anything, MINISGL_ERR_POSITION (a position outside the
// rotary tables' max_positions rows; 0: the caller vouches for them).
static int attention_inputs(const void* qkv, void* q_buf, const void* q_norm, const void* k_norm,
                            float eps, void* k_cache, void* v_cache, const int64_t* out_loc,
                            const int64_t* positions, const float* cos, const float* sin,
                            int64_t max_positions, int64_t tokens, int64_t num_heads,
                            int64_t num_kv_heads, int64_t dim, int dtype, int nthreads) {
    if (max_positions > 0 && !positions_fit(positions, tokens, max_positions))
        return MINISGL_ERR_POSITION;
    const int64_t q_width = num_heads * dim, kv_width = num_kv_heads * dim;
    const int64_t qkv_width = q_width + 2 * kv_width;
    const size_t elem = dtype == 0 ? 4 : 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const char* row = (const char*)qkv + t * qkv_width * elem;
        char* q = (char*)q_buf + t * q_width * elem;
        char* k = (char*)k_cache + out_loc[t] * kv_width * elem;
        memcpy(q, row, (size_t)q_width * elem);
        memcpy(k, row + q_width * elem, (size_t)kv_width * elem);
        memcpy((char*)v_cache + out_loc[t] * kv_width * elem, row + (q_width + kv_width) * elem,
               (size_t)kv_width * elem);
        if (q_norm) {
            for (int64_t h = 0; h < num_heads; h++)
                add_rms_norm_row(q, NULL, q_norm, q, NULL, h, dim, eps, dtype);
            for (int64_t h = 0; h < num_kv_heads; h++)
                add_rms_norm_row(k, NULL, k_norm, k, NULL, h, dim, eps, dtype);
        }
        const float *cos_row = cos + positions[t] * dim, *sin_row = sin + positions[t] * dim;
        rotary_token(q, 0, num_heads, dim, cos_row, sin_row, dtype);
        rotary_token(k, 0, num_kv_heads, dim, cos_row, sin_row, dtype);
    }
    return MINISGL_OK;
}

// Returns attention_inputs' status, then minisgl_decode_attention's.
int minisgl_decode_attention_block(const void* qkv, void* q_buf, void* out, const void* q_norm,
                                   const void* k_norm, float eps, void* k_cache, void* v_cache,
                                   const int64_t* out_loc, const int64_t* positions,
                                   const float* cos, const float* sin, int64_t max_positions,
                                   const int32_t* page_table, int64_t table_stride,
                                   const int64_t* rows, const int64_t* kv_lens, int64_t tokens,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                                   float scale, int64_t window, int dtype, int nthreads) {
    if (!heads_fit(num_heads, num_kv_heads) || dim <= 0 || dim > ATTN_MAX_DIM)
        return MINISGL_ERR_SHAPE;
    const int status = attention_inputs(qkv, q_buf, q_norm, k_norm, eps, k_cache, v_cache,
                                        out_loc, positions, cos, sin, max_positions, tokens,
                                        num_heads, num_kv_heads, dim, dtype, nthreads);
    if (status != MINISGL_OK) return status;
    return minisgl_decode_attention(q_buf, k_cache, v_cache, out, page_table, table_stride, rows,
                                    kv_lens, NULL, NULL, NULL, tokens, num_heads, num_kv_heads,
                                    dim, scale, window, dtype, nthreads);
}

// The same for a prefill batch (bf16): inputs as above, then minisgl_prefill_attention over
// the new tokens of each request (rows/cached_lens/extend_lens as it takes them). Returns
// attention_inputs' status, then the attention's (on its error q_buf holds the queries, the pool
// the new keys and values, normed and rotated).
int minisgl_prefill_attention_block(const void* qkv, bf16_t* q_buf, bf16_t* out, const void* q_norm,
                                    const void* k_norm, float eps, bf16_t* k_cache,
                                    bf16_t* v_cache, const int64_t* out_loc,
                                    const int64_t* positions, const float* cos, const float* sin,
                                    int64_t max_positions, const int32_t* page_table,
                                    int64_t table_stride, const int64_t* rows,
                                    const int64_t* cached_lens, const int64_t* extend_lens,
                                    int64_t num_reqs, int64_t tokens, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t dim, float scale,
                                    int64_t window, int use_tiles, int nthreads) {
    if (!heads_fit(num_heads, num_kv_heads) || dim % 32 != 0 || dim <= 0 || dim > ATTN_MAX_DIM)
        return MINISGL_ERR_SHAPE;
#ifndef HAVE_AVX512_BF16
    return MINISGL_ERR_UNSUPPORTED;  // before the inputs: nothing written
#endif
    const int status = attention_inputs(qkv, q_buf, q_norm, k_norm, eps, k_cache, v_cache,
                                        out_loc, positions, cos, sin, max_positions, tokens,
                                        num_heads, num_kv_heads, dim, 1, nthreads);
    if (status != MINISGL_OK) return status;
    return minisgl_prefill_attention(q_buf, k_cache, v_cache, out, page_table, table_stride, rows,
                                     cached_lens, extend_lens, num_reqs, num_heads, num_kv_heads,
                                     dim, scale, window, use_tiles, nthreads);
}

// ------------------------------------------------------------------- fused decode layer (bf16)
// A whole decoder layer for a decode batch (one token per request) in one call, built from the
// kernels above in the order the PyTorch modules run them, so the result is the same bit for
// bit: at batch 1 the layer is ~10 short kernels, and Python's cost between them was as large
// as the weights' read time. Projections read their packed (tile-layout) copies, the only copy
// the model keeps: with vdpbf16ps up to gemv_max_rows tokens, above on the AMX tiles where
// use_tiles (as layers/linear.py's CpuProjection picks); the row-major weight through the GEMV
// only where a projection has no packed copy.

typedef struct {
    const bf16_t *input_norm, *post_norm, *q_norm, *k_norm;  // q/k norms may be NULL
    const bf16_t *qkv_w, *qkv_b, *o_w, *o_b, *gate_up_w, *gate_up_b, *down_w, *down_b;
    const bf16_t *qkv_t, *o_t, *gate_up_t, *down_t;  // packed (tile layout) copies, or NULL
    const bf16_t* gate_up_tb;  // gate_up's bias interleaved as gate_up_t is (gated), or NULL
    bf16_t *k_cache, *v_cache;  // this layer's pool: [slots, kv_heads, head_dim]
    int64_t window;             // 0: none
} decode_layer;

typedef struct {
    int64_t hidden, inter, num_heads, num_kv_heads, head_dim;
    float eps, scale;
    const float *cos, *sin;  // rotary tables [max_positions, head_dim]
    const int32_t* page_table;
    int64_t table_stride;
    int64_t gemv_max_rows;
    int64_t use_tiles;      // the packed matmuls on the AMX tiles, else vdpbf16ps
    int64_t max_positions;  // rows of cos/sin (0: unchecked)
} decode_model;

// Whether a projection of this many tokens runs on the AMX tiles (else vdpbf16ps, which at a
// few rows streams the packed weight once at memory speed, as the GEMV does).
static inline int layer_tiles(const decode_model* m, int64_t tokens) {
    return m->use_tiles && tokens > m->gemv_max_rows;
}

// Status: the packed matmul's (the GEMV cannot fail).
static int layer_matmul(const decode_model* m, const bf16_t* x, const bf16_t* w,
                        const bf16_t* tiles, const bf16_t* bias, bf16_t* y, int64_t tokens,
                        int64_t N, int64_t K, int nthreads) {
    if (tiles)
        return minisgl_packed_linear(x, tiles, bias, y, tokens, N, K, 0, layer_tiles(m, tokens),
                                     nthreads);
    minisgl_gemv_bf16(x, w, bias, y, tokens, N, K, nthreads);
    return MINISGL_OK;
}

// Scratch elements (bf16) minisgl_decode_layer needs for `tokens` tokens.
int64_t minisgl_decode_layer_scratch(const decode_model* m, int64_t tokens) {
    int64_t q_width = m->num_heads * m->head_dim, kv_width = m->num_kv_heads * m->head_dim;
    return tokens * (2 * m->hidden + q_width + 2 * kv_width + 2 * q_width + 3 * m->inter);
}

// Where the first half leaves the rotated queries [tokens, heads, head_dim] in the scratch.
int64_t minisgl_decode_layer_q_offset(const decode_model* m, int64_t tokens) {
    return tokens * (m->hidden + (m->num_heads + 2 * m->num_kv_heads) * m->head_dim);
}

// The layer's scratch, carved from one bf16 buffer of minisgl_decode_layer_scratch elements.
typedef struct {
    bf16_t *normed, *qkv, *q, *attn, *proj, *gate_up, *act;
} layer_scratch;

static layer_scratch carve_scratch(const decode_model* m, bf16_t* scratch, int64_t tokens) {
    const int64_t q_width = m->num_heads * m->head_dim;
    layer_scratch s;
    s.normed = scratch;                                        // [tokens, hidden]
    s.qkv = s.normed + tokens * m->hidden;                     // [tokens, q | k | v]
    s.q = scratch + minisgl_decode_layer_q_offset(m, tokens);  // [tokens, q_width]
    s.attn = s.q + tokens * q_width;                           // [tokens, q_width]
    s.proj = s.attn + tokens * q_width;                        // [tokens, hidden]
    s.gate_up = s.proj + tokens * m->hidden;                   // [tokens, 2 * inter]
    s.act = s.gate_up + tokens * 2 * m->inter;                 // [tokens, inter]
    return s;
}

// First half of a layer: the input norm (x + residual -> residual), the qkv projection, q/k
// norms and rotary, the new keys/values into the pool, the queries into the scratch. Returns
// MINISGL_OK or the first failing step's status.
int minisgl_decode_layer_begin(const decode_layer* L, const decode_model* m, const bf16_t* x,
                                bf16_t* residual, int has_residual, bf16_t* scratch,
                                int64_t tokens, const int64_t* positions, const int64_t* out_loc,
                                int nthreads) {
    const int64_t hidden = m->hidden, dim = m->head_dim;
    const int64_t qkv_width = (m->num_heads + 2 * m->num_kv_heads) * dim;
    layer_scratch s = carve_scratch(m, scratch, tokens);
    if (has_residual) {
        minisgl_add_rms_norm(x, residual, L->input_norm, s.normed, residual, tokens, hidden,
                             m->eps, 1, nthreads);
    } else {
        memcpy(residual, x, (size_t)(tokens * hidden) * sizeof(bf16_t));
        minisgl_add_rms_norm(x, NULL, L->input_norm, s.normed, NULL, tokens, hidden, m->eps, 1,
                             nthreads);
    }
    const int status = layer_matmul(m, s.normed, L->qkv_w, L->qkv_t, L->qkv_b, s.qkv, tokens,
                                    qkv_width, hidden, nthreads);
    if (status != MINISGL_OK) return status;
    return attention_inputs(s.qkv, s.q, L->q_norm, L->k_norm, m->eps, L->k_cache, L->v_cache,
                            out_loc, positions, m->cos, m->sin, m->max_positions, tokens,
                            m->num_heads, m->num_kv_heads, dim, 1, nthreads);
}

// Second half: paged attention over each request's positions (continuing from a prefix state
// when kv_starts is set, see minisgl_decode_attention), the o projection, the post-attention
// norm and the MLP into out. Returns MINISGL_OK or the first failing step's status.
int minisgl_decode_layer_end(const decode_layer* L, const decode_model* m, bf16_t* residual,
                              bf16_t* out, bf16_t* scratch, int64_t tokens, const int64_t* rows,
                              const int64_t* kv_lens, const int64_t* kv_starts,
                              const float* prefix_out, const float* prefix_lse, int nthreads) {
    const int64_t hidden = m->hidden, q_width = m->num_heads * m->head_dim;
    layer_scratch s = carve_scratch(m, scratch, tokens);
    int status = minisgl_decode_attention(s.q, L->k_cache, L->v_cache, s.attn, m->page_table,
                                          m->table_stride, rows, kv_lens, kv_starts, prefix_out,
                                          prefix_lse, tokens, m->num_heads, m->num_kv_heads,
                                          m->head_dim, m->scale, L->window, 1, nthreads);
    if (status != MINISGL_OK) return status;
    status = layer_matmul(m, s.attn, L->o_w, L->o_t, L->o_b, s.proj, tokens, hidden, q_width,
                          nthreads);
    if (status != MINISGL_OK) return status;
    minisgl_add_rms_norm(s.proj, residual, L->post_norm, s.normed, residual, tokens, hidden,
                         m->eps, 1, nthreads);
    if (L->gate_up_t) {
        status = minisgl_packed_gated_silu(s.normed, L->gate_up_t, L->gate_up_tb, s.act, tokens,
                                           m->inter, hidden, layer_tiles(m, tokens), nthreads);
    } else {
        status = layer_matmul(m, s.normed, L->gate_up_w, NULL, L->gate_up_b, s.gate_up, tokens,
                              2 * m->inter, hidden, nthreads);
        if (status == MINISGL_OK)
            minisgl_silu_and_mul(s.gate_up, s.act, tokens, m->inter, 1, nthreads);
    }
    if (status != MINISGL_OK) return status;
    return layer_matmul(m, s.act, L->down_w, L->down_t, L->down_b, out, tokens, hidden, m->inter,
                        nthreads);
}

// Every layer of a decode step with no shared prefix, in one call: at batch 1 the Python and
// ctypes around a call per layer cost ~4% of SmolLM2's step. x: [tokens, hidden] the first
// layer's input; residual: [tokens, hidden], written; out: [tokens, hidden] each layer's MLP
// output, the next layer's input (a layer has read all of its input, into the residual and the
// normed scratch, before its down projection writes out). rows/kv_lens: the requests'
// page-table rows and lengths (new token included); out_loc: the new tokens' KV slots.
// Returns MINISGL_OK or the first failing layer's status (the later layers not run).
int minisgl_decode_layers(const decode_layer* layers, int64_t num_layers, const decode_model* m,
                          const bf16_t* x, bf16_t* residual, bf16_t* out, bf16_t* scratch,
                          int64_t tokens, const int64_t* positions, const int64_t* rows,
                          const int64_t* kv_lens, const int64_t* out_loc, int nthreads) {
    for (int64_t i = 0; i < num_layers; i++) {
        int status = minisgl_decode_layer_begin(&layers[i], m, i == 0 ? x : out, residual, i > 0,
                                                scratch, tokens, positions, out_loc, nthreads);
        if (status == MINISGL_OK)
            status = minisgl_decode_layer_end(&layers[i], m, residual, out, scratch, tokens, rows,
                                              kv_lens, NULL, NULL, NULL, nthreads);
        if (status != MINISGL_OK) return status;
    }
    return MINISGL_OK;
}

// ------------------------------------------------------------------ rows of a packed weight
// out[i] = w[ids[i]] ([count, K] bf16) from the packed (tile-layout) copy of a weight w [N, K]:
// a tied embedding looked up in its output head's copy, which is then the only one. Row n is
// column n % 16 of tile (n % 32) / 16 of block n / 32: one 4-byte k-pair every 64 bytes. Returns
// MINISGL_ERR_SHAPE (nothing written) for an id outside [0, N).
int minisgl_packed_rows(const bf16_t* packed, const int64_t* ids, bf16_t* out, int64_t count,
                        int64_t N, int64_t K, int nthreads) {
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= N) return MINISGL_ERR_SHAPE;
    const int64_t ksteps = (K + AMX_KSTEP - 1) / AMX_KSTEP;
    const int64_t block_elems = ksteps * AMX_NBLOCK * AMX_KSTEP;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (count * K >= (1 << 16))
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = ids[i];
        const bf16_t* column = packed + n / 32 * block_elems + n % 32 / 16 * 512 + n % 16 * 2;
        bf16_t* row = out + i * K;
        for (int64_t k = 0; k + 1 < K; k += 2)
            memcpy(row + k, column + k / 32 * 1024 + k % 32 * 16, 2 * sizeof(bf16_t));
        if (K % 2) row[K - 1] = column[(K - 1) / 32 * 1024 + (K - 1) % 32 * 16];
    }
    return MINISGL_OK;
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
// (16-31): an accumulator per row and tile, and for one or two rows one per parity of the pair
// too (a longer dependency chain would bound them). The fetch ahead may pass the copy's end.
static inline __attribute__((always_inline)) void packed_gemv_block(
    const bf16_t* x, int64_t K, const bf16_t* block, int64_t ksteps, float (*left)[16],
    float (*right)[16], const int ROWS) {
    const int64_t step = AMX_NBLOCK * AMX_KSTEP, whole = K / AMX_KSTEP;
    const int split = ROWS <= 2 ? 2 : 1;
    __m512 acc[PACKED_GEMV_ROWS][4];
    for (int r = 0; r < ROWS; r++)
        for (int c = 0; c < 2 * split; c++) acc[r][c] = _mm512_setzero_ps();
    for (int64_t kb = 0; kb < ksteps; kb++) {
        const bf16_t* w = block + kb * step;
        const int64_t k0 = kb * AMX_KSTEP;
        for (int p = 0; p < 16; p++) {
            const char* ahead = (const char*)(w + 64 * p) + PACKED_GEMV_AHEAD;
            __builtin_prefetch(ahead, 0, 1);
            __builtin_prefetch(ahead + 64, 0, 1);
            const __m512bh w0 = (__m512bh)_mm512_load_si512(w + 32 * p);
            const __m512bh w1 = (__m512bh)_mm512_load_si512(w + 512 + 32 * p);
            const int c = 2 * (p % split);
            for (int r = 0; r < ROWS; r++) {
                const bf16_t* row = x + r * K;
                const int64_t k = k0 + 2 * p;
                const __m512bh xv = kb < whole ? broadcast_pair(row + k) : pair_within(row, k, K);
                acc[r][c] = _mm512_dpbf16_ps(acc[r][c], xv, w0);
                acc[r][c + 1] = _mm512_dpbf16_ps(acc[r][c + 1], xv, w1);
            }
        }
    }
    for (int r = 0; r < ROWS; r++) {
        __m512 sum_left = acc[r][0], sum_right = acc[r][1];
        if (split == 2) {
            sum_left = _mm512_add_ps(sum_left, acc[r][2]);
            sum_right = _mm512_add_ps(sum_right, acc[r][3]);
        }
        _mm512_store_ps(left[r], sum_left);
        _mm512_store_ps(right[r], sum_right);
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
