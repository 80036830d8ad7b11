#include "common.h"
#include "internal.h"
#include "simd.h"

// ------------------------------------------------ tiled quantized weight on the AMX tiles
// Where the CPU has AMX, bf16 activations of more than a few rows meet a tiled quantized weight
// (layers/quant_tiles.py's layout, quantized_tiled.c describes it) as they are: each block of
// 32 output columns is dequantized (q * scale + min in float32, rounded to bf16 once: the values
// a prefill's dequantized weight holds) into one block of the packed copy's layout (matmul.c:
// per k-step of 32, two tiles of 16 columns' k-pairs) in the thread's L2, and every x row meets
// it on the tiles. The weight streams from memory once at its quantized size, and the
// dequantization (about 0.2 cycles a weight) is shared by all the rows, where the int8 products
// of quantized_tiled.c cost a vector operation per 64 weights per row.
// A gate_up weight (gate rows, then up rows) can be paired gate tile with up tile, so that the
// block's epilogue writes silu(gate) * up.

#ifdef HAVE_QUANTIZED_AMX
#define TILE TILE_ROWS
#define FETCH_STEPS 8  // k-steps ahead a tile's values, scales and mins are fetched
#define TOP_BYTES 0x8888888888888888ull  // the top byte of every dword

// Bytes a k-step (32 columns) of one tile's values take.
static inline int64_t step_bytes(int64_t bits) { return 64 * bits; }

// A k-pair row of the packed tile is made from the weight's bytes in two halves: weight rows
// 8h..8h+7, two columns each, as 16 float32 lanes (lane 2j + c: row 8h + j, column 2p + c of
// its 4 in a lane). vpermb moves each byte to the top of its lane: the lane is then the
// integer times 2^24, which converts exactly and meets the scale times 2^-24 (the same product).
typedef struct {
    __m512i bytes[2][2];  // [h][p]: vpermb's indices
    __m512i spread[2];    // [h]: permps's indices, a row's scale into both of its lanes
} pair_moves;

static pair_moves make_moves(void) {
    pair_moves moves;
    for (int h = 0; h < 2; h++) {
        int32_t spread[16];
        for (int lane = 0; lane < 16; lane++) spread[lane] = 8 * h + lane / 2;
        moves.spread[h] = _mm512_loadu_si512(spread);
        for (int p = 0; p < 2; p++) {
            uint8_t index[64];
            for (int i = 0; i < 64; i++)  // byte i: lane i / 4, of which only the top is kept
                index[i] = (uint8_t)(4 * (8 * h + i / 8) + 2 * p + i / 4 % 2);
            moves.bytes[h][p] = _mm512_loadu_si512(index);
        }
    }
    return moves;
}

// A lane-quad vector (lane l: 4 columns of weight row l, signed or 0..15 bytes) dequantized
// into two k-pair rows: dst (its columns 0-1) and dst + 32 (2-3); scale/offset by half [h].
static inline void quad_rows(__m512i quad, const pair_moves* moves, const __m512* scale,
                             const __m512* offset, bf16_t* dst) {
    for (int p = 0; p < 2; p++) {
        __m512 half[2];
        for (int h = 0; h < 2; h++) {
            const __m512i top = _mm512_maskz_permutexvar_epi8(TOP_BYTES, moves->bytes[h][p], quad);
            half[h] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(top), scale[h], offset[h]);
        }
        _mm512_store_si512(dst + 32 * p, (__m512i)_mm512_cvtne2ps_pbh(half[1], half[0]));
    }
}

// Tile t's 16 weight rows over k-step kb (32 columns) dequantized into dst: a tile of 16 k-pair
// rows (64 bytes each) for the packed block. Its values, scales and mins are fetched
// FETCH_STEPS k-steps ahead: unfetched, the scales' misses took a fifth of the time.
static void dequant_step(const quantized_weight* w, int64_t t, int64_t K, int64_t kb,
                         const pair_moves* moves, bf16_t* dst) {
    const int64_t groups = K / w->group;
    const uint8_t* step = (const uint8_t*)w->values + t * tile_bytes(w->bits, K) +
                          kb * step_bytes(w->bits);
    if (kb + FETCH_STEPS < K / 32) {
        for (int line = 0; line < step_bytes(w->bits) / 64; line++)
            __builtin_prefetch(step + FETCH_STEPS * step_bytes(w->bits) + 64 * line, 0, 3);
        const int64_t ahead = t * groups + (kb + FETCH_STEPS) * 32 / w->group;
        __builtin_prefetch(tile_group_at(w->scales, w->scales_f32, ahead), 0, 3);
        if (w->mins) __builtin_prefetch(tile_group_at(w->mins, w->scales_f32, ahead), 0, 3);
    }
    __m512 scale[2][2], offset[2][2];  // [columns 0-15, 16-31 (groups are 16 or more)][h]
    for (int c = 0; c < 2; c++) {
        const int64_t index = t * groups + (kb * 32 + 16 * c) / w->group;
        const __m512 s = _mm512_mul_ps(tile_floats(w->scales, w->scales_f32, index),
                                       _mm512_set1_ps(0x1p-24f));
        const __m512 m = w->mins ? tile_floats(w->mins, w->scales_f32, index) : _mm512_setzero_ps();
        for (int h = 0; h < 2; h++) {
            scale[c][h] = _mm512_permutexvar_ps(moves->spread[h], s);
            offset[c][h] = _mm512_permutexvar_ps(moves->spread[h], m);
        }
    }
    if (w->bits == 8) {  // quads 0..7 of the step, stored +128: xor 0x80 gives the signed byte
        for (int q = 0; q < 8; q++) {
            const __m512i quad = _mm512_xor_si512(_mm512_loadu_si512(step + 64 * q),
                                                  _mm512_set1_epi8((char)0x80));
            quad_rows(quad, moves, scale[q / 4], offset[q / 4], dst + 64 * q);
        }
        return;
    }
    // 4 bits: vector j holds columns 4j..4j+3 in its low nibbles, 16 + 4j.. in its high ones;
    // 6 bits: their top 2 bits come from vectors 4 and 5 (+32).
    const __m512i nibble = _mm512_set1_epi8(15);
    // Loaded once: dst's stores could alias step for all the compiler knows.
    const __m512i tops_low = w->bits == 6 ? _mm512_loadu_si512(step + 256) : nibble;
    const __m512i tops_high = w->bits == 6 ? _mm512_loadu_si512(step + 320) : nibble;
    for (int j = 0; j < 4; j++) {
        const __m512i v = _mm512_loadu_si512(step + 64 * j);
        __m512i low = _mm512_and_si512(v, nibble);
        __m512i high = _mm512_and_si512(_mm512_srli_epi32(v, 4), nibble);
        if (w->bits == 6) {
            low = _mm512_sub_epi8(six_bits(low, tops_low, j), _mm512_set1_epi8(32));
            high = _mm512_sub_epi8(six_bits(high, tops_high, j), _mm512_set1_epi8(32));
        }
        quad_rows(low, moves, scale[0], offset[0], dst + 64 * j);
        quad_rows(high, moves, scale[1], offset[1], dst + 64 * (4 + j));
    }
}

// A block of the packed layout in the making: tiles `left` (columns 0-15) and `right` (16-31;
// -1: zeros) of w into wblock.
typedef struct {
    const quantized_weight* w;
    int64_t left, right, K;
    const pair_moves* moves;
    bf16_t* wblock;
} block_fill;

// K-step kb of the block (packed_block_tiles' fill).
static void fill_step(void* ctx, int64_t kb) {
    const block_fill* f = (const block_fill*)ctx;
    bf16_t* dst = f->wblock + kb * AMX_NBLOCK * AMX_KSTEP;
    dequant_step(f->w, f->left, f->K, kb, f->moves, dst);
    if (f->right >= 0)
        dequant_step(f->w, f->right, f->K, kb, f->moves, dst + 512);
    else
        memset(dst + 512, 0, 1024);
}

// bf16 x [M, K] times the tiled weight w [N, K] (K a multiple of 32): y [M, N] bf16 (float32 for
// EPILOGUE_F32), or with EPILOGUE_GATED y [M, N / 2] = silu(gate) * up, N / 2 a multiple of 16
// (and no bias). A task is one block (guided, as the packed matmul's); x is copied only to pad
// it to whole 16-row tiles. Returns MINISGL_OK or MINISGL_ERR_NOMEM (y not written).
int quantized_amx_linear(const bf16_t* x, const quantized_weight* w, const bf16_t* bias, void* y,
                         int64_t M, int64_t N, int64_t K, int epilogue, int nthreads) {
    const int gated = epilogue == EPILOGUE_GATED;
    const int64_t mpad = (M + 15) / 16 * 16, blocks = (N + AMX_NBLOCK - 1) / AMX_NBLOCK;
    const size_t block_bytes = (size_t)K * AMX_NBLOCK * 2, x_bytes = (size_t)(mpad * K) * 2;
    char* buffer = kernel_alloc((mpad != M ? x_bytes : 0) + (size_t)nthreads * block_bytes);
    if (!buffer) return MINISGL_ERR_NOMEM;
    const bf16_t* a = x;
    char* blocks_at = buffer;
    if (mpad != M) {
        memcpy(buffer, x, (size_t)(M * K) * 2);
        memset(buffer + (size_t)(M * K) * 2, 0, (size_t)((mpad - M) * K) * 2);
        a = (const bf16_t*)buffer;
        blocks_at = buffer + x_bytes;
    }
#pragma omp parallel num_threads(nthreads)
    {
        amx_configure();
        const pair_moves moves = make_moves();
        bf16_t* wblock = (bf16_t*)(blocks_at + (size_t)omp_get_thread_num() * block_bytes);
#pragma omp for schedule(guided)
        for (int64_t b = 0; b < blocks; b++) {
            block_fill fill = {.w = w, .K = K, .moves = &moves, .wblock = wblock};
            block_tiles(b, N, gated, &fill.left, &fill.right);
            packed_block_tiles(a, K, wblock, bias, y, M, N, K / 32, 32 * b, epilogue, fill_step,
                               &fill);
        }
        _tile_release();
    }
    free(buffer);
    return MINISGL_OK;
}
#endif

// The whole tiled weight w [N, K] dequantized into the packed copy's layout (the packed matmul's
// weight, for a prefill's rows); gated: gate and up rows paired as the gated epilogue reads them.
// Returns MINISGL_OK, or MINISGL_ERR_UNSUPPORTED built without AMX (and VBMI).
int quantized_tiled_packed(const quantized_weight* w, bf16_t* packed, int64_t N, int64_t K,
                           int gated, int nthreads) {
#ifdef HAVE_QUANTIZED_AMX
    const int64_t blocks = (N + AMX_NBLOCK - 1) / AMX_NBLOCK;
    const pair_moves moves = make_moves();
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        block_fill fill = {.w = w, .K = K, .moves = &moves, .wblock = packed + b * K * AMX_NBLOCK};
        block_tiles(b, N, gated, &fill.left, &fill.right);
        for (int64_t kb = 0; kb < K / 32; kb++) fill_step(&fill, kb);
    }
    return MINISGL_OK;
#else
    (void)w, (void)packed, (void)N, (void)K, (void)gated, (void)nthreads;
    return MINISGL_ERR_UNSUPPORTED;
#endif
}
