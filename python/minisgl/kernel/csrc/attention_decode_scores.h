#ifndef MINISGL_ATTENTION_DECODE_SCORES_H
#define MINISGL_ATTENTION_DECODE_SCORES_H

#include "attention_decode.h"

// ------------------------------------------------------- decode attention's scores, AVX-512
// The scores of a block's positions against a task's queries (attention_decode_avx512.c): a
// position at a time, or for a run of rows 16 positions at a time, the same bits either way.
#ifdef HAVE_AVX512
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

// Scores of one position against queries [j0, j1) of a run (query j: q + j * head_dim, its kv
// head's key at key + key_offset[j]), 16 at a time, into scores[j0, j1): one partial dot
// product per query, summed across lanes together (sum_lanes16 adds each lane's values by the
// same tree wherever it sits: a query's score is the same bits in any run). BF16_DOT:
// vdpbf16ps on the stored bf16 key against the bf16 query (products of two bf16 values are
// exact in float32: the float32 path but for summation order), scaled after; otherwise float32
// FMAs against the scaled float32 query `qf`.
static inline FORM_INLINE void attn_position_scores(
    const attn_args* a, int64_t key, const bf16_t* q, float (*qf)[ATTN_MAX_DIM],
    const int64_t* key_offset, int64_t j0, int64_t j1, float* scores, const int CHUNKS,
    const int BF16_DOT) {
    for (int64_t h0 = j0; h0 < j1; h0 += 16) {
        __m512 partial[16];
#pragma GCC unroll 16
        for (int i = 0; i < 16; i++) {
            partial[i] = _mm512_setzero_ps();
            if (h0 + i >= j1) continue;
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
        _mm512_mask_storeu_ps(scores + h0, first_lanes(j1 - h0), sums);
    }
}

#ifdef HAVE_AVX512_BF16
// a + b, kept as written: -ffast-math lets gcc regroup a tree of plain vector adds, and a run's
// scores must add as sum_lanes16 does.
static inline __m512 add_kept(__m512 a, __m512 b) {
    __m512 sum = _mm512_add_ps(a, b);
#ifdef MINISGL_EMULATED_AVX512
    __asm__("" : "+m"(sum));
#else
    __asm__("" : "+v"(sum));
#endif
    return sum;
}

// The keys of a run's sub-block (up to 16 positions) as 32-bit dim pairs across the positions
// in kt [kv head][pair][16] words at most; a run's dim pairs per kv head and kv heads fit.
#define ATTN_KT_WORDS 16384

// A run's scores of `count` positions (slots: theirs, up to 16) against queries [j0, j1), into
// scores[0, count) (BF16_DOT only). Each query's dot products with 16 positions at once: lane
// l's partial sums (dim pairs l, l + 16, ...) as a vector over the positions, from its pairs
// broadcast against the keys laid out across the positions, added by sum_lanes16's tree: a
// score is the same bits as attn_position_scores gives, without its lane transposes per score.
static inline FORM_INLINE void attn_run_scores(const attn_args* a, const int32_t* slots,
                                               int64_t count, int64_t key0, int64_t row_elems,
                                               int64_t kv_count, const bf16_t* q, int64_t j0,
                                               int64_t j1, int64_t heads, uint32_t* kt,
                                               float (*scores)[ATTN_MAX_HEADS],
                                               const int CHUNKS) {
    const int64_t group = a->num_heads / a->num_kv_heads, dim = a->head_dim, pairs = dim / 2;
    for (int64_t kv = 0; kv < kv_count; kv++)
        for (int c = 0; c < CHUNKS / 2; c++) {
            __m512i rows[16];
            for (int p = 0; p < 16; p++)
                rows[p] = p < count ? _mm512_loadu_si512((const bf16_t*)a->k_cache +
                                                         slots[p] * row_elems + key0 +
                                                         kv * dim + 32 * c)
                                    : _mm512_setzero_si512();
            transpose16(rows);
            for (int i = 0; i < 16; i++)
                _mm512_storeu_si512(kt + ((kv * pairs) + 16 * c + i) * 16, rows[i]);
        }
    const __m512 scale = _mm512_set1_ps(a->scale);
    for (int64_t h0 = j0; h0 < j1; h0 += 16) {
        __m512i out[16];
        for (int i = 0; i < 16; i++) {
            const int64_t j = h0 + i;
            if (j >= j1) {
                out[i] = _mm512_setzero_si512();
                continue;
            }
            const bf16_t* query = q + j * dim;
            const uint32_t* keys = kt + (j % heads / group) * pairs * 16;
            __m512 lane[16];
            for (int l = 0; l < 16; l++) lane[l] = _mm512_setzero_ps();
            for (int c = 0; c < CHUNKS / 2; c++)
#pragma GCC unroll 16
                for (int l = 0; l < 16; l++)
                    lane[l] = _mm512_dpbf16_ps(
                        lane[l], broadcast_pair(query + 2 * (16 * c + l)),
                        (__m512bh)_mm512_loadu_si512(keys + (16 * c + l) * 16));
            __m512 quarter[4];
            for (int L = 0; L < 4; L++)
                quarter[L] = add_kept(add_kept(lane[4 * L], lane[4 * L + 2]),
                                      add_kept(lane[4 * L + 1], lane[4 * L + 3]));
            const __m512 sum = add_kept(add_kept(quarter[0], quarter[1]),
                                        add_kept(quarter[2], quarter[3]));
            out[i] = _mm512_castps_si512(_mm512_mul_ps(sum, scale));
        }
        transpose16(out);
        for (int p = 0; p < count; p++)
            _mm512_mask_storeu_ps(scores[p] + h0, first_lanes(j1 - h0),
                                  _mm512_castsi512_ps(out[p]));
    }
}
#endif

#endif

#endif
