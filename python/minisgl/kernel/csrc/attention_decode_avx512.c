#include "attention_decode.h"

// ----------------------------------------------------------------- decode attention, AVX-512
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
MINISGL_INTERNAL void attn_state_begin(const attn_args* a, int64_t b, int64_t head0, int64_t heads,
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

MINISGL_INTERNAL void attn_state_store(const attn_args* a, int64_t b, int64_t head0, int64_t heads,
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
    float qf[ATTN_VECTOR_HEADS][ATTN_MAX_DIM], scores[ATTN_BLOCK][ATTN_VECTOR_HEADS];
    float correction[ATTN_VECTOR_HEADS];
    int64_t key_offset[ATTN_VECTOR_HEADS];
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

MINISGL_INTERNAL void attn_range(const attn_args* a, int64_t b, int64_t kvh0, int64_t kv_count,
                       int64_t begin, int64_t end, const attn_next* next, attn_state* st) {
    switch (attn_chunks(a->head_dim)) {
        case 4: attn_range_avx512(a, b, kvh0, kv_count, begin, end, next, st, 4); return;
        case 8: attn_range_avx512(a, b, kvh0, kv_count, begin, end, next, st, 8); return;
        default: attn_range_avx512(a, b, kvh0, kv_count, begin, end, next, st, 16); return;
    }
}
#endif
