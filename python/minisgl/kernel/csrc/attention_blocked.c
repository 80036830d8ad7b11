#include "common.h"
#include "internal.h"
#include "simd.h"

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
static inline FORM_INLINE void vec_scores_8x32(
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
static inline FORM_INLINE void vec_pv_4rows(
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
#endif

#define PREFILL_RUNS_PER_THREAD 4

// Causal prefill attention: request b's extend_lens[b] new tokens (consecutive rows of q
// [tokens, heads, dim] bf16, request after request) at positions cached_lens[b] + j attend to
// the positions [lo, own] of page-table row rows[b] (lo = own - window + 1 with a sliding
// window, else 0), read from the pool (their new K/V already stored). Writes out [tokens,
// heads, dim] bf16. Each request's keys and values are laid out once for all its query tiles, a
// tile computes only the key blocks its rows can see, and tiles go in contiguous runs (so a
// request's keys stay in a thread's cache) of equal cost, PREFILL_RUNS_PER_THREAD a thread,
// claimed one at a time.
// use_tiles: on the AMX tiles (where compiled in), else with vdpbf16ps. Returns MINISGL_OK,
// MINISGL_ERR_SHAPE (head_dim not a multiple of 32 up to ATTN_MAX_DIM), MINISGL_ERR_NOMEM, or
// without avx512_bf16 MINISGL_ERR_UNSUPPORTED; nothing written on an error.
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
