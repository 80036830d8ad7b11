#include "common.h"
#include "internal.h"
#include "simd.h"

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
static inline FORM_INLINE void prefetch_rows(const void* cache,
                                                               int64_t row_bytes, int64_t first,
                                                               int64_t bytes, int64_t slot) {
    const char* part = (const char*)cache + slot * row_bytes + first;
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(part + line, 0, 3);
}

#define GENERIC_PREFETCH 8  // positions ahead the portable attention asks for its rows

// The online softmax of a task's heads over the positions seen so far: float32 value sums (the
// AVX-512 kernels': in the (even, odd) pair layout; the portable ones': in order), running max
// and sum. A request's positions split over threads each give one; merged, they are the whole.
typedef struct {
    float acc[ATTN_MAX_HEADS][ATTN_MAX_DIM];
    float max[ATTN_MAX_HEADS], sum[ATTN_MAX_HEADS];
} attn_state;

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

#ifdef HAVE_AVX512
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
static inline FORM_INLINE void load_pair(const void* base, int64_t offset,
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
static inline FORM_INLINE void attn_position_scores(
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
static inline FORM_INLINE void attn_range_avx512(
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

// A head's value sums over their softmax sum, stored at `offset` of the output.
static inline void store_normalized(const attn_args* a, int64_t offset, float* acc, float sum,
                                    int64_t dim) {
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < dim; d++) acc[d] *= inv;
    store_row(a->out, offset, a->dtype, acc, dim);
}

// Portable version of the same computation (any head_dim up to ATTN_MAX_DIM) for kv heads
// [kvh0, kvh0 + kv_count) of request b, and of each one's group the query heads [first, first +
// count) (count at most ATTN_MAX_GROUP, kv_count * count at most ATTN_MAX_HEADS: a wider group is
// taken a slice per task, each reading the group's keys and values again). Every kv head of a
// position before the next, so a task holding them all reads whole rows in slot order.
// DIM: head_dim as a constant (0: read it from a), so that the row loops unroll.
static inline FORM_INLINE void attn_generic_body(
    const attn_args* a, int64_t b, int64_t kvh0, int64_t kv_count, int64_t first, int64_t count,
    int64_t begin, int64_t end, int seeded, attn_state* st, const int64_t DIM) {
    const int64_t group = a->num_heads / a->num_kv_heads, dim = DIM ? DIM : a->head_dim;
    const int64_t heads = kv_count * count;  // task head h: kv head kvh0 + h / count
    float qf[ATTN_MAX_HEADS][ATTN_MAX_DIM], acc[ATTN_MAX_HEADS][ATTN_MAX_DIM];
    float scores[ATTN_MAX_HEADS][ATTN_BLOCK], row[ATTN_MAX_DIM];
    float run_max[ATTN_MAX_HEADS], run_sum[ATTN_MAX_HEADS];
    int64_t out_offset[ATTN_MAX_HEADS];
    for (int64_t h = 0; h < heads; h++) {
        const int64_t head = (kvh0 + h / count) * group + first + h % count;
        const int64_t offset = (b * a->num_heads + head) * dim;
        out_offset[h] = offset;
        load_row(a->q, offset, a->dtype, qf[h], dim);
        for (int64_t d = 0; d < dim; d++) {
            qf[h][d] *= a->scale;
            acc[h][d] = seeded && a->prefix_out ? a->prefix_out[offset + d] : 0.0f;
        }
        run_max[h] = seeded && a->prefix_lse ? a->prefix_lse[b * a->num_heads + head] : 0.0f;
        run_sum[h] = seeded && a->prefix_lse ? 1.0f : 0.0f;
    }
    int has_state = seeded && a->prefix_lse != NULL;
    const int32_t* slots = a->page_table + a->rows[b] * a->table_stride;
    // The task's part of each row, asked for GENERIC_PREFETCH positions ahead: no prefetcher
    // follows a part, and waiting on each load took ~55% of this loop (AVX2 build).
    const int64_t elem = a->dtype == 0 ? 4 : 2, part_bytes = kv_count * dim * elem;
    const int64_t part_offset = kvh0 * dim * elem, row_bytes = a->num_kv_heads * dim * elem;
    for (int64_t t0 = begin; t0 < end; t0 += ATTN_BLOCK) {
        int64_t block = end - t0 < ATTN_BLOCK ? end - t0 : ATTN_BLOCK;
        for (int64_t j = 0; j < block; j++) {
            if (t0 + j + GENERIC_PREFETCH < end)
                prefetch_rows(a->k_cache, row_bytes, part_offset, part_bytes,
                              slots[t0 + j + GENERIC_PREFETCH]);
            for (int64_t kv = 0; kv < kv_count; kv++) {
                const int64_t offset = ((int64_t)slots[t0 + j] * a->num_kv_heads + kvh0 + kv) * dim;
                load_row(a->k_cache, offset, a->dtype, row, dim);
                for (int64_t g = 0; g < count; g++) {
                    const float* qh = qf[kv * count + g];
                    float dot = 0.0f;
                    for (int64_t d = 0; d < dim; d++) dot += qh[d] * row[d];
                    scores[kv * count + g][j] = dot;
                }
            }
        }
        for (int64_t h = 0; h < heads; h++) {
            float new_max = scores[h][0];
            for (int64_t j = 1; j < block; j++)
                new_max = scores[h][j] > new_max ? scores[h][j] : new_max;
            if (has_state && run_max[h] > new_max) new_max = run_max[h];
            float correction = has_state ? expf(run_max[h] - new_max) : 0.0f;
            float block_sum = 0.0f;
            for (int64_t j = 0; j < block; j++) {
                scores[h][j] = exp_portable(scores[h][j] - new_max);
                block_sum += scores[h][j];
            }
            run_sum[h] = run_sum[h] * correction + block_sum;
            run_max[h] = new_max;
            for (int64_t d = 0; d < dim; d++) acc[h][d] *= correction;
        }
        has_state = 1;
        for (int64_t j = 0; j < block; j++) {
            if (j + GENERIC_PREFETCH < block)
                prefetch_rows(a->v_cache, row_bytes, part_offset, part_bytes,
                              slots[t0 + j + GENERIC_PREFETCH]);
            for (int64_t kv = 0; kv < kv_count; kv++) {
                const int64_t offset = ((int64_t)slots[t0 + j] * a->num_kv_heads + kvh0 + kv) * dim;
                load_row(a->v_cache, offset, a->dtype, row, dim);
                for (int64_t g = 0; g < count; g++) {
                    float* sums = acc[kv * count + g];
                    const float p = scores[kv * count + g][j];
                    for (int64_t d = 0; d < dim; d++) sums[d] += p * row[d];
                }
            }
        }
    }
    for (int64_t h = 0; h < heads; h++) {
        if (st) {  // a part of the positions: its state, merged by the caller
            memcpy(st->acc[h], acc[h], (size_t)dim * sizeof(float));
            st->max[h] = has_state ? run_max[h] : -3.0e38f;
            st->sum[h] = has_state ? run_sum[h] : 0.0f;
            continue;
        }
        store_normalized(a, out_offset[h], acc[h], run_sum[h], dim);
    }
}

// Positions [begin, end) (seeded: the first part, which starts from the cascade prefix); st:
// where the part's state goes (NULL: the whole range, its output stored). head_dim 64 and 128
// with constant loop bounds, so the score and value loops unroll: batch 64 x 160 positions x 30
// layers (SmolLM2's W1 decode) 50 -> 36 ms in an AVX2 build, with the prefetch 68 ms before.
static void attn_part_generic(const attn_args* a, int64_t b, int64_t kvh0, int64_t kv_count,
                              int64_t first, int64_t count, int64_t begin, int64_t end,
                              int seeded, attn_state* st) {
    if (a->head_dim == 64)
        attn_generic_body(a, b, kvh0, kv_count, first, count, begin, end, seeded, st, 64);
    else if (a->head_dim == 128)
        attn_generic_body(a, b, kvh0, kv_count, first, count, begin, end, seeded, st, 128);
    else
        attn_generic_body(a, b, kvh0, kv_count, first, count, begin, end, seeded, st, 0);
}

static void attn_task_generic(const attn_args* a, int64_t b, int64_t kvh0, int64_t kv_count,
                              int64_t first, int64_t count) {
    attn_part_generic(a, b, kvh0, kv_count, first, count, attn_start(a, b), a->kv_lens[b], 1,
                      NULL);
}

// Few requests on several threads: each request's positions split into one range per thread
// (every head of a position read at once), the parts' states merged after, as the AVX-512
// path does: a task per kv head left a thread idle where the heads do not split evenly
// (SmolLM2's 3 on 2 threads: batch 1 over 2,000 positions 161 -> 136 µs a layer).
static int attn_split_generic(const attn_args* a, int64_t num_reqs, int nthreads) {
    const int64_t parts = nthreads, tasks = num_reqs * parts, heads = a->num_heads;
    const int64_t group = heads / a->num_kv_heads;
    attn_state* states = (attn_state*)kernel_alloc((size_t)tasks * sizeof(attn_state));
    if (!states) return MINISGL_ERR_NOMEM;
#pragma omp parallel for num_threads(nthreads) schedule(static, 1)
    for (int64_t task = 0; task < tasks; task++) {
        const int64_t b = task / parts, part = task % parts;
        const int64_t first = attn_start(a, b), len = a->kv_lens[b] - first;
        attn_part_generic(a, b, 0, a->num_kv_heads, 0, group, first + len * part / parts,
                          first + len * (part + 1) / parts, part == 0, states + task);
    }
    for (int64_t b = 0; b < num_reqs; b++) {
        attn_state* whole = states + b * parts;
        for (int64_t part = 1; part < parts; part++)
            attn_state_merge(whole, whole + part, heads, a->head_dim);
        for (int64_t h = 0; h < heads; h++)
            store_normalized(a, (b * heads + h) * a->head_dim, whole->acc[h], whole->sum[h],
                             a->head_dim);
    }
    free(states);
    return MINISGL_OK;
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
        // Few requests whose kv heads do not split evenly over the threads: by positions.
        const int64_t head_tasks = num_reqs * num_kv_heads;
        if (nthreads > 1 && num_reqs < 2 * nthreads && head_tasks % nthreads != 0 &&
            group <= ATTN_MAX_GROUP && num_heads <= ATTN_MAX_HEADS)
            return attn_split_generic(&a, num_reqs, nthreads);
        // With two requests per thread or more, a task is a whole request (whole rows read once,
        // in slot order): batch 64 x 160 x 30 layers 38 -> 31 ms, x 192 38 -> 28 ms (AVX2 build,
        // alternated in one process) against a task per kv head, which fewer requests and
        // heads past a task's arrays keep (a slice of a wide group per task).
        if (num_reqs >= 2 * nthreads && group <= ATTN_MAX_GROUP && num_heads <= ATTN_MAX_HEADS) {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
            for (int64_t b = 0; b < num_reqs; b++)
                attn_task_generic(&a, b, 0, num_kv_heads, 0, group);
            return MINISGL_OK;
        }
        const int64_t slices = (group + ATTN_MAX_GROUP - 1) / ATTN_MAX_GROUP;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (int64_t task = 0; task < num_reqs * num_kv_heads * slices; task++) {
            const int64_t head = task / slices, first = task % slices * ATTN_MAX_GROUP;
            attn_task_generic(&a, head / num_kv_heads, head % num_kv_heads, 1, first,
                              group - first < ATTN_MAX_GROUP ? group - first : ATTN_MAX_GROUP);
        }
        return MINISGL_OK;
    }
#ifdef HAVE_AVX512
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
        for (; b < num_reqs && done * runs < r * total; b++)
            done += kv_lens[b] - attn_start(&a, b);
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
