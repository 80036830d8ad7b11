#include "attention_decode_scores.h"

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

// What a task reads ahead of position i of a range ending at `end`: its whole rows (keys and
// values) ATTN_LOOKAHEAD positions on, into `next`; or its kv heads' part of them (bytes
// [first, first + part_bytes) of each row) ATTN_PREFETCH positions on.
static inline FORM_INLINE void prefetch_ahead(const attn_args* a, const int32_t* slots,
                                              int64_t end, const attn_next* next, int64_t i,
                                              int whole_rows, int64_t first, int64_t part_bytes,
                                              int64_t row_bytes) {
    int64_t ahead = -1;
    if (whole_rows)
        ahead = slot_ahead(slots, end, next, i + ATTN_LOOKAHEAD);
    else if (i + ATTN_PREFETCH < end)
        ahead = slots[i + ATTN_PREFETCH];
    if (ahead < 0) return;
    prefetch_rows(a->k_cache, row_bytes, first, part_bytes, ahead);
    prefetch_rows(a->v_cache, row_bytes, first, part_bytes, ahead);
}

// Row b's heads [head0, head0 + heads), empty or (seeded) the cascade prefix's, into st from
// st_head on.
static void attn_state_begin(const attn_args* a, int64_t b, int64_t head0, int64_t heads,
                             int seeded, attn_state* st, int64_t st_head) {
    for (int64_t h = 0; h < heads; h++) {
        const int64_t offset = (b * a->num_heads + head0 + h) * a->head_dim;
        float* acc = st->acc[st_head + h];
        if (seeded && a->prefix_out)
            row_to_pairs(a->prefix_out + offset, acc, a->head_dim);
        else
            memset(acc, 0, a->head_dim * sizeof(float));
        const int prefix = seeded && a->prefix_lse;
        st->max[st_head + h] = prefix ? a->prefix_lse[b * a->num_heads + head0 + h] : -3.0e38f;
        st->sum[st_head + h] = prefix ? 1.0f : 0.0f;
    }
}

MINISGL_INTERNAL void attn_store_avx512(const attn_args* a, int64_t b, int64_t kvh0,
                                        int64_t kv_count, const attn_state* st, int64_t st_head) {
    const int64_t group = a->num_heads / a->num_kv_heads;
    for (int64_t h = 0; h < kv_count * group; h++) {
        float row[ATTN_MAX_DIM];
        pairs_to_row(st->acc[st_head + h], row, a->head_dim);
        for (int64_t d = 0; d < a->head_dim; d++) row[d] /= st->sum[st_head + h];
        store_row(a->out, (b * a->num_heads + kvh0 * group + h) * a->head_dim, a->dtype, row,
                  a->head_dim);
    }
}

// P V of a block for up to PV_QUERIES queries of one kv head (js: their heads in the state,
// counts: how many of the block's positions each takes), 64 dims at a time: the sums stay in
// registers over the block (scaled first by the softmax's correction), each position's value
// rows widened once for all the queries. A sum's operations are those of one query alone, in
// the same order: the same bits in any run.
#define PV_QUERIES 6
static inline FORM_INLINE void attn_pv_tile(const attn_args* a, const int32_t* slots,
                                            int64_t value0, int64_t row_elems, const int64_t* js,
                                            const int32_t* counts, int nq,
                                            float (*scores)[ATTN_MAX_HEADS],
                                            const float* correction, attn_state* st,
                                            const int CHUNKS) {
    int64_t shortest = ATTN_BLOCK, longest = 0;
    for (int q = 0; q < nq; q++) {
        shortest = counts[js[q]] < shortest ? counts[js[q]] : shortest;
        longest = counts[js[q]] > longest ? counts[js[q]] : longest;
    }
    for (int c0 = 0; c0 < CHUNKS; c0 += 4) {
        __m512 acc[PV_QUERIES][4];
#pragma GCC unroll 6
        for (int q = 0; q < PV_QUERIES; q++) {
            if (q >= nq) break;
            const __m512 shrink = _mm512_set1_ps(correction[js[q]]);
            for (int c = 0; c < 4; c++)
                acc[q][c] = _mm512_mul_ps(_mm512_loadu_ps(st->acc[js[q]] + 16 * (c0 + c)), shrink);
        }
        for (int64_t t = 0; t < longest; t++) {
            const int64_t row = (int64_t)slots[t] * row_elems + value0 + 16 * c0;
            __m512 v[4];
            load_pair(a->v_cache, row, a->dtype, v, v + 1);
            load_pair(a->v_cache, row + 32, a->dtype, v + 2, v + 3);
#pragma GCC unroll 6
            for (int q = 0; q < PV_QUERIES; q++) {
                if (q >= nq) break;
                if (t >= shortest && t >= counts[js[q]]) continue;
                const __m512 weight = _mm512_set1_ps(scores[t][js[q]]);
                for (int c = 0; c < 4; c++) acc[q][c] = _mm512_fmadd_ps(weight, v[c], acc[q][c]);
            }
        }
#pragma GCC unroll 6
        for (int q = 0; q < PV_QUERIES; q++) {
            if (q >= nq) break;
            for (int c = 0; c < 4; c++) _mm512_storeu_ps(st->acc[js[q]] + 16 * (c0 + c), acc[q][c]);
        }
    }
}

// A run's rows b0 + r (r < nrows: one request's consecutive positions, as a verify step's) over
// positions [begin, ends[r]), ends growing, kv heads [kvh0, kvh0 + kv_count) (all of them when
// nrows > 1), continued into st (row r's heads from r * kv_count * group). Per block of
// ATTN_BLOCK positions: each position's key rows read once for every row's scores, the online
// softmax of each row over its own positions, then P V by tiles of queries. Every row's
// operations are those it takes alone: the same bits. CHUNKS = head_dim / 16, a constant in
// each instantiation so the row loops unroll.
static inline FORM_INLINE void attn_range_avx512(const attn_args* a, int64_t b0, int64_t nrows,
                                                 int64_t kvh0, int64_t kv_count, int64_t begin,
                                                 const int64_t* ends, const attn_next* next,
                                                 attn_state* st, const int CHUNKS) {
    const int64_t group = a->num_heads / a->num_kv_heads, dim = a->head_dim;
    const int64_t heads = kv_count * group, queries = nrows * heads, end = ends[nrows - 1];
    float qf[ATTN_MAX_HEADS][ATTN_MAX_DIM], scores[ATTN_BLOCK][ATTN_MAX_HEADS];
    float correction[ATTN_MAX_HEADS];
    int64_t key_offset[ATTN_MAX_HEADS], js[ATTN_MAX_HEADS];
    int32_t counts[ATTN_MAX_HEADS + 16] = {0};  // (read 16 at a time)
#ifdef HAVE_AVX512_BF16
    const int bf16_dot = a->dtype == 1;
#else
    const int bf16_dot = 0;
#endif
    // A run's rows hold every head, so its queries are consecutive in q.
    const bf16_t* q = (const bf16_t*)a->q + (b0 * a->num_heads + kvh0 * group) * dim;
    for (int64_t j = 0; j < queries; j++) {
        key_offset[j] = (j % heads / group) * dim;
        if (bf16_dot) continue;
        load_row(a->q, (b0 * a->num_heads + kvh0 * group + j) * dim, a->dtype, qf[j], dim);
        for (int64_t d = 0; d < dim; d++) qf[j][d] *= a->scale;
    }
    const int64_t elem = a->dtype == 0 ? 4 : 2, row_elems = a->num_kv_heads * dim;
    const int64_t row_bytes = row_elems * elem, part_bytes = kv_count * dim * elem;
    const int whole_rows = kv_count == a->num_kv_heads;
#ifdef HAVE_AVX512_BF16
    // A run of rows takes its scores 16 positions at a time (one row: position by position,
    // where laying the keys out would cost more than the lane transposes it saves).
    uint32_t kt[ATTN_KT_WORDS];
    const int by_run = bf16_dot && nrows > 1 && whole_rows &&
                       kv_count * (dim / 2) * 16 <= ATTN_KT_WORDS;
#endif
    const int32_t* slots = a->page_table + a->rows[b0] * a->table_stride;
    for (int64_t t0 = begin; t0 < end; t0 += ATTN_BLOCK) {
        const int64_t count = end - t0 < ATTN_BLOCK ? end - t0 : ATTN_BLOCK;
        int64_t live = 0;  // the rows with positions in this block are the last ones
        while (ends[live] <= t0) live++;
        const int64_t j0 = live * heads;
        for (int64_t j = j0; j < queries; j++) {
            const int64_t row_count = ends[j / heads] - t0;
            counts[j] = row_count < count ? row_count : count;
        }
#ifdef HAVE_AVX512_BF16
        if (by_run) {  // (the prefetches of attn_position_scores' loop, 16 positions at a time)
            for (int64_t t = 0; t < count; t += 16) {
                for (int64_t i = t; i < t + 16 && i < count; i++)
                    prefetch_ahead(a, slots, end, next, t0 + i, 1, 0, row_bytes, row_bytes);
                const int64_t n = count - t < 16 ? count - t : 16;
                attn_run_scores(a, slots + t0 + t, n, kvh0 * dim, row_elems, kv_count, q, j0,
                                queries, heads, kt, scores + t, CHUNKS);
            }
        } else
#endif
        for (int64_t t = 0; t < count; t++) {
            prefetch_ahead(a, slots, end, next, t0 + t, whole_rows, kvh0 * dim * elem, part_bytes,
                           row_bytes);
            const int64_t key = (int64_t)slots[t0 + t] * row_elems + kvh0 * dim;
            if (bf16_dot)
                attn_position_scores(a, key, q, qf, key_offset, j0, queries, scores[t], CHUNKS,
                                     1);
            else
                attn_position_scores(a, key, q, qf, key_offset, j0, queries, scores[t], CHUNKS,
                                     0);
        }
        // Softmax along the block, 16 queries at a time, each over its own row's positions.
        for (int64_t h0 = j0; h0 < queries; h0 += 16) {
            const __mmask16 m = first_lanes(queries - h0);
            __mmask16 taking[ATTN_BLOCK];  // lanes whose row has position t
            const __m512i lane_counts = _mm512_loadu_si512(counts + h0);
            for (int64_t t = 0; t < count; t++)
                taking[t] = _mm512_mask_cmpgt_epi32_mask(m, lane_counts, _mm512_set1_epi32((int)t));
            const __m512 old_max = _mm512_maskz_loadu_ps(m, st->max + h0);
            __m512 top = old_max, total = _mm512_setzero_ps();
            for (int64_t t = 0; t < count; t++)
                top = _mm512_mask_max_ps(top, taking[t], top,
                                         _mm512_maskz_loadu_ps(m, scores[t] + h0));
            for (int64_t t = 0; t < count; t++) {
                __m512 p = exp512(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, scores[t] + h0), top));
                _mm512_mask_storeu_ps(scores[t] + h0, taking[t], p);
                total = _mm512_mask_add_ps(total, taking[t], total, p);
            }
            const __m512 shrink = exp512(_mm512_sub_ps(old_max, top));
            _mm512_mask_storeu_ps(correction + h0, m, shrink);
            _mm512_mask_storeu_ps(
                st->sum + h0, m,
                _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, st->sum + h0), shrink, total));
            _mm512_mask_storeu_ps(st->max + h0, m, top);
        }
        // P V, kv head by kv head, the live rows' queries of each in tiles.
        for (int64_t kv = 0; kv < kv_count; kv++) {
            int64_t listed = 0;
            for (int64_t r = live; r < nrows; r++)
                for (int64_t g = 0; g < group; g++) js[listed++] = r * heads + kv * group + g;
            for (int64_t i = 0; i < listed; i += PV_QUERIES) {
                const int nq = listed - i < PV_QUERIES ? (int)(listed - i) : PV_QUERIES;
                attn_pv_tile(a, slots + t0, (kvh0 + kv) * dim, row_elems, js + i, counts, nq,
                             scores, correction, st, CHUNKS);
            }
        }
    }
}

MINISGL_INTERNAL void attn_part_avx512(const attn_args* a, int64_t b0, int64_t nrows,
                                       int64_t kvh0, int64_t kv_count, int64_t begin,
                                       const int64_t* ends, int seeded, const attn_next* next,
                                       attn_state* st) {
    const int64_t group = a->num_heads / a->num_kv_heads, heads = kv_count * group;
    for (int64_t r = 0; r < nrows; r++)
        attn_state_begin(a, b0 + r, kvh0 * group, heads, seeded, st, r * heads);
    switch (attn_chunks(a->head_dim)) {
        case 4: attn_range_avx512(a, b0, nrows, kvh0, kv_count, begin, ends, next, st, 4); return;
        case 8: attn_range_avx512(a, b0, nrows, kvh0, kv_count, begin, ends, next, st, 8); return;
        default:
            attn_range_avx512(a, b0, nrows, kvh0, kv_count, begin, ends, next, st, 16);
            return;
    }
}
#endif
