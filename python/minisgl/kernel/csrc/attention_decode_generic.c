#include "attention_decode.h"

// ---------------------------------------------------------------- decode attention, portable
#define GENERIC_PREFETCH 8  // positions ahead the portable attention asks for its rows

// A head's value sums over their softmax sum, stored at `offset` of the output.
static inline void store_normalized(const attn_args* a, int64_t offset, float* acc, float sum,
                                    int64_t dim) {
    const float inv = 1.0f / sum;
    for (int64_t d = 0; d < dim; d++) acc[d] *= inv;
    store_row(a->out, offset, a->dtype, acc, dim);
}

#ifdef HAVE_AVX2_FMA
// Lane t of the result is the sum of v[t]'s 8 lanes: a transpose-and-add tree (~3 ops a vector).
static inline __m256 sum_lanes8(const __m256 v[8]) {
    __m256 pairs[4], quads[2];
    for (int i = 0; i < 4; i++)  // per 128-bit lane: [v2i 0+1, v2i 2+3, v2i+1 0+1, v2i+1 2+3]
        pairs[i] = _mm256_hadd_ps(v[2 * i], v[2 * i + 1]);
    for (int i = 0; i < 2; i++)  // per 128-bit lane: the lane's sums of v4i .. v4i+3
        quads[i] = _mm256_hadd_ps(pairs[2 * i], pairs[2 * i + 1]);
    return _mm256_add_ps(_mm256_permute2f128_ps(quads[0], quads[1], 0x20),
                         _mm256_permute2f128_ps(quads[0], quads[1], 0x31));
}

// Rows [0, count) of one kv head's keys or values for a block of positions, as float32 rows of
// DIM, one after another (rows past count zeroed, so that 8 positions are always summed at once).
// ahead: positions of `slots` that may be asked for GENERIC_PREFETCH on (each one's part of the
// task's kv heads: the first kv head's pass brings the others'), 0 for none.
static inline FORM_INLINE void block_rows_f32(const attn_args* a, const void* cache,
                                              const int32_t* slots, int64_t kv, int64_t count,
                                              int64_t ahead, int64_t row_bytes,
                                              int64_t part_offset, int64_t part_bytes,
                                              float* rows, const int64_t DIM) {
    for (int64_t j = 0; j < count; j++) {
        if (j + GENERIC_PREFETCH < ahead)
            prefetch_rows(cache, row_bytes, part_offset, part_bytes, slots[j + GENERIC_PREFETCH]);
        load_row(cache, ((int64_t)slots[j] * a->num_kv_heads + kv) * DIM, a->dtype,
                 rows + j * DIM, DIM);
    }
    const int64_t padded_count = (count + 7) & ~(int64_t)7;
    memset(rows + count * DIM, 0, (size_t)((padded_count - count) * DIM) * sizeof(float));
}

// A head's scores of positions [0, valid) from its (scaled) query and the block's keys: 8
// positions at a time, each a partial dot product per 8 dims, summed across lanes together.
static inline FORM_INLINE void block_scores_avx2(const float* qh, const float* keys,
                                                 int64_t valid, float* scores, const int64_t DIM) {
    for (int64_t j = 0; j < valid; j += 8) {
        __m256 partial[8];
        for (int t = 0; t < 8; t++) partial[t] = _mm256_setzero_ps();
        for (int64_t d = 0; d < DIM; d += 8) {
            const __m256 q8 = _mm256_loadu_ps(qh + d);
            for (int t = 0; t < 8; t++) {
                const __m256 key = _mm256_loadu_ps(keys + (j + t) * DIM + d);
                partial[t] = _mm256_fmadd_ps(q8, key, partial[t]);
            }
        }
        _mm256_storeu_ps(scores + j, sum_lanes8(partial));
    }
}

// A head's value sums (acc, already scaled by the softmax's correction) plus positions [0,
// valid) of the block's values times their weights, 64 dims at a time in registers.
static inline FORM_INLINE void block_values_avx2(float* acc, const float* values,
                                                 const float* weights, int64_t valid,
                                                 const int64_t DIM) {
    for (int64_t d0 = 0; d0 < DIM; d0 += 64) {
        const int chunks = DIM - d0 < 64 ? (int)(DIM - d0) / 8 : 8;
        __m256 sums[8];
        for (int c = 0; c < chunks; c++) sums[c] = _mm256_loadu_ps(acc + d0 + 8 * c);
        for (int64_t j = 0; j < valid; j++) {
            const __m256 p = _mm256_broadcast_ss(weights + j);
            for (int c = 0; c < chunks; c++) {
                const __m256 value = _mm256_loadu_ps(values + j * DIM + d0 + 8 * c);
                sums[c] = _mm256_fmadd_ps(p, value, sums[c]);
            }
        }
        for (int c = 0; c < chunks; c++) _mm256_storeu_ps(acc + d0 + 8 * c, sums[c]);
    }
}
#endif

// Portable version of the same computation (any head_dim up to ATTN_MAX_DIM) for a run of
// rows [b0, b0 + nrows) of one request (attn_run: a verify step's positions, kv_lens one apart;
// one row elsewhere), kv heads [kvh0, kvh0 + kv_count), and of each one's group the query heads
// [first, first + count) (count at most ATTN_MAX_GROUP, nrows * kv_count * count at most
// ATTN_MAX_HEADS: a wider group is taken a slice per task, each reading the group's keys and
// values again). Row r reads positions [begin, ends[r]): each position's keys and values are
// read once for every row of the run (a verify step's rows re-read them, a row alone, at about
// a sixth of a batch-1 step on AVX2), and each row's arithmetic is what it is alone. Every kv
// head of a position before the next, so a task holding them all reads whole rows in slot order.
// With AVX2 and DIM a multiple of 8, a block's keys (then values) are widened to float32 kv head
// by kv head, once for all the task's rows and heads, and each head's scores are taken 8
// positions at a time (block_scores_avx2): a verify step's 4-8 rows over 700-2,000 positions
// 1.3-1.5x faster than the loops below (SmolLM2's heads, Zen 3), one row as fast.
// DIM: head_dim as a constant (0: read it from a), so that the row loops unroll.
static inline FORM_INLINE void attn_generic_body(const attn_args* a, int64_t b0, int64_t nrows,
                                                 int64_t kvh0, int64_t kv_count, int64_t first,
                                                 int64_t count, int64_t begin,
                                                 const int64_t* ends, int seeded, attn_state* st,
                                                 const int64_t DIM) {
    const int64_t group = a->num_heads / a->num_kv_heads, dim = DIM ? DIM : a->head_dim;
    const int64_t row_heads = kv_count * count;  // a row's task head h: kv head kvh0 + h / count
    const int64_t heads = nrows * row_heads;     // task head r * row_heads + h: row b0 + r's
    float qf[ATTN_MAX_HEADS][ATTN_MAX_DIM], acc[ATTN_MAX_HEADS][ATTN_MAX_DIM];
    float scores[ATTN_MAX_HEADS][ATTN_BLOCK], row[ATTN_MAX_DIM];
#ifdef HAVE_AVX2_FMA
    // A block's keys, then its values, of one kv head as float32 rows (AVX2's loops; DIM 0,
    // any head_dim, takes the loops below).
    float block_f32[ATTN_BLOCK * ATTN_MAX_DIM] __attribute__((aligned(32)));
    const int avx2_blocks = DIM > 0 && DIM % 8 == 0;
#endif
    float run_max[ATTN_MAX_HEADS], run_sum[ATTN_MAX_HEADS];
    int64_t out_offset[ATTN_MAX_HEADS];
    int64_t end = begin;
    for (int64_t r = 0; r < nrows; r++) end = ends[r] > end ? ends[r] : end;
    for (int64_t hh = 0; hh < heads; hh++) {
        const int64_t b = b0 + hh / row_heads, h = hh % row_heads;
        const int64_t head = (kvh0 + h / count) * group + first + h % count;
        const int64_t offset = (b * a->num_heads + head) * dim;
        out_offset[hh] = offset;
        load_row(a->q, offset, a->dtype, qf[hh], dim);
        for (int64_t d = 0; d < dim; d++) {
            qf[hh][d] *= a->scale;
            acc[hh][d] = seeded && a->prefix_out ? a->prefix_out[offset + d] : 0.0f;
        }
        run_max[hh] = seeded && a->prefix_lse ? a->prefix_lse[b * a->num_heads + head] : 0.0f;
        run_sum[hh] = seeded && a->prefix_lse ? 1.0f : 0.0f;
    }
    int has_state = seeded && a->prefix_lse != NULL;
    const int32_t* slots = a->page_table + a->rows[b0] * a->table_stride;
    // The task's part of each row, asked for GENERIC_PREFETCH positions ahead: no prefetcher
    // follows a part, and waiting on each load took ~55% of this loop (AVX2 build).
    const int64_t elem = a->dtype == 0 ? 4 : 2, part_bytes = kv_count * dim * elem;
    const int64_t part_offset = kvh0 * dim * elem, row_bytes = a->num_kv_heads * dim * elem;
    for (int64_t t0 = begin; t0 < end; t0 += ATTN_BLOCK) {
        const int64_t block = end - t0 < ATTN_BLOCK ? end - t0 : ATTN_BLOCK;
        int64_t blocks[ATTN_MAX_HEADS];  // each run row's positions in this block (0: none)
        for (int64_t r = 0; r < nrows; r++) {
            const int64_t left = ends[r] - t0;
            blocks[r] = left <= 0 ? 0 : left < ATTN_BLOCK ? left : ATTN_BLOCK;
        }
#ifdef HAVE_AVX2_FMA
        if (avx2_blocks) {
            for (int64_t kv = 0; kv < kv_count; kv++) {
                block_rows_f32(a, a->k_cache, slots + t0, kvh0 + kv, block,
                               kv == 0 ? end - t0 : 0, row_bytes, part_offset, part_bytes,
                               block_f32, DIM);
                for (int64_t r = 0; r < nrows; r++)
                    for (int64_t g = 0; g < count; g++) {
                        const int64_t hh = r * row_heads + kv * count + g;
                        block_scores_avx2(qf[hh], block_f32, blocks[r], scores[hh], DIM);
                    }
            }
        } else
#endif
        for (int64_t j = 0; j < block; j++) {
            if (t0 + j + GENERIC_PREFETCH < end)
                prefetch_rows(a->k_cache, row_bytes, part_offset, part_bytes,
                              slots[t0 + j + GENERIC_PREFETCH]);
            for (int64_t kv = 0; kv < kv_count; kv++) {
                const int64_t offset = ((int64_t)slots[t0 + j] * a->num_kv_heads + kvh0 + kv) * dim;
                load_row(a->k_cache, offset, a->dtype, row, dim);
                for (int64_t r = 0; r < nrows; r++) {
                    if (j >= blocks[r]) continue;
                    for (int64_t g = 0; g < count; g++) {
                        const int64_t hh = r * row_heads + kv * count + g;
                        const float* qh = qf[hh];
                        float dot = 0.0f;
                        for (int64_t d = 0; d < dim; d++) dot += qh[d] * row[d];
                        scores[hh][j] = dot;
                    }
                }
            }
        }
        for (int64_t hh = 0; hh < heads; hh++) {
            const int64_t valid = blocks[hh / row_heads];
            if (valid == 0) continue;  // the row ended before this block
            float new_max = scores[hh][0];
            for (int64_t j = 1; j < valid; j++)
                new_max = scores[hh][j] > new_max ? scores[hh][j] : new_max;
            if (has_state && run_max[hh] > new_max) new_max = run_max[hh];
            float correction = has_state ? expf(run_max[hh] - new_max) : 0.0f;
            float block_sum = 0.0f;
            for (int64_t j = 0; j < valid; j++) {
                scores[hh][j] = exp_portable(scores[hh][j] - new_max);
                block_sum += scores[hh][j];
            }
            run_sum[hh] = run_sum[hh] * correction + block_sum;
            run_max[hh] = new_max;
            for (int64_t d = 0; d < dim; d++) acc[hh][d] *= correction;
        }
        has_state = 1;
#ifdef HAVE_AVX2_FMA
        if (avx2_blocks) {
            for (int64_t kv = 0; kv < kv_count; kv++) {
                block_rows_f32(a, a->v_cache, slots + t0, kvh0 + kv, block,
                               kv == 0 ? block : 0, row_bytes, part_offset, part_bytes,
                               block_f32, DIM);
                for (int64_t r = 0; r < nrows; r++)
                    for (int64_t g = 0; g < count; g++) {
                        const int64_t hh = r * row_heads + kv * count + g;
                        block_values_avx2(acc[hh], block_f32, scores[hh], blocks[r], DIM);
                    }
            }
            continue;
        }
#endif
        for (int64_t j = 0; j < block; j++) {
            if (j + GENERIC_PREFETCH < block)
                prefetch_rows(a->v_cache, row_bytes, part_offset, part_bytes,
                              slots[t0 + j + GENERIC_PREFETCH]);
            for (int64_t kv = 0; kv < kv_count; kv++) {
                const int64_t offset = ((int64_t)slots[t0 + j] * a->num_kv_heads + kvh0 + kv) * dim;
                load_row(a->v_cache, offset, a->dtype, row, dim);
                for (int64_t r = 0; r < nrows; r++) {
                    if (j >= blocks[r]) continue;
                    for (int64_t g = 0; g < count; g++) {
                        float* sums = acc[r * row_heads + kv * count + g];
                        const float p = scores[r * row_heads + kv * count + g][j];
                        for (int64_t d = 0; d < dim; d++) sums[d] += p * row[d];
                    }
                }
            }
        }
    }
    for (int64_t hh = 0; hh < heads; hh++) {
        if (st) {  // a part of the positions: its state, merged by the caller
            memcpy(st->acc[hh], acc[hh], (size_t)dim * sizeof(float));
            st->max[hh] = has_state ? run_max[hh] : -3.0e38f;
            st->sum[hh] = has_state ? run_sum[hh] : 0.0f;
            continue;
        }
        store_normalized(a, out_offset[hh], acc[hh], run_sum[hh], dim);
    }
}

// Positions [begin, ends[r]) of run rows b0 + r (seeded: the first part, which starts from the
// cascade prefix); st: where the part's state goes, row r's heads from r * kv_count * count
// (NULL: the whole range, its outputs stored). head_dim 64 and 128 with constant loop bounds, so
// the score and value loops unroll: batch 64 x 160 positions x 30 layers (SmolLM2's W1 decode)
// 50 -> 36 ms in an AVX2 build, with the prefetch 68 ms before.
MINISGL_INTERNAL void attn_part_generic(const attn_args* a, int64_t b0, int64_t nrows,
                                        int64_t kvh0, int64_t kv_count, int64_t first,
                                        int64_t count, int64_t begin, const int64_t* ends,
                                        int seeded, attn_state* st) {
    if (a->head_dim == 64)
        attn_generic_body(a, b0, nrows, kvh0, kv_count, first, count, begin, ends, seeded, st,
                          64);
    else if (a->head_dim == 128)
        attn_generic_body(a, b0, nrows, kvh0, kv_count, first, count, begin, ends, seeded, st,
                          128);
    else
        attn_generic_body(a, b0, nrows, kvh0, kv_count, first, count, begin, ends, seeded, st,
                          0);
}

MINISGL_INTERNAL void attn_store_generic(const attn_args* a, int64_t b, int64_t kvh0,
                                         int64_t kv_count, int64_t first, int64_t count,
                                         const attn_state* st, int64_t st_head) {
    const int64_t group = a->num_heads / a->num_kv_heads, dim = a->head_dim;
    for (int64_t h = 0; h < kv_count * count; h++) {
        const int64_t head = (kvh0 + h / count) * group + first + h % count;
        float acc[ATTN_MAX_DIM];
        memcpy(acc, st->acc[st_head + h], (size_t)dim * sizeof(float));
        store_normalized(a, (b * a->num_heads + head) * dim, acc, st->sum[st_head + h], dim);
    }
}
