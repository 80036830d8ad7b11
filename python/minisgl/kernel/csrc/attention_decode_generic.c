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

// The largest of s[0..valid) as the loop `m = s[0]; m = s[j] > m ? s[j] : m` finds it, 8 lanes
// at a time (every lane starts from s[0], so a NaN is kept exactly where the loop keeps it):
// the loop's chain of dependent maxima made SmolLM2's attention 3-5% slower at 1-16 rows (Zen 3).
static inline float block_max(const float* s, int64_t valid) {
    __m256 lanes = _mm256_set1_ps(s[0]);
    int64_t j = 0;
    for (; j + 8 <= valid; j += 8) lanes = _mm256_max_ps(_mm256_loadu_ps(s + j), lanes);
    float top[8];
    _mm256_storeu_ps(top, lanes);
    float m = top[0];
    for (int l = 1; l < 8; l++) m = top[l] > m ? top[l] : m;
    for (; j < valid; j++) m = s[j] > m ? s[j] : m;
    return m;
}

// sum_lanes8's sums of 4 vectors (each vector's lanes added in the same order).
static inline __m128 sum_lanes4(const __m256 v[4]) {
    const __m256 quad = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    return _mm_add_ps(_mm256_castps256_ps128(quad), _mm256_extractf128_ps(quad, 1));
}

// The scores of `heads` query heads of one kv head (their scaled queries qh) over a block's
// positions [0, valid): `at[j]` is position j's row in the cache (element offset), rows past
// `count` read as row count - 1 (their scores unused). Keys are read once for all the heads and
// widened in registers; each head's score is a dot product of 8-lane partial sums over DIM,
// summed across lanes in one order, so it is the same bits in any group. POS positions at a time
// (4 with several heads, 8 with one).
static inline FORM_INLINE void group_scores(const void* k_cache, const int64_t* at,
                                            int64_t offset, int64_t count, int64_t valid,
                                            float* const* qh, float* const* out, const int heads,
                                            const int bf16, const int64_t DIM) {
    enum { MAX_HEADS = 3, MAX_POS = 8 };
    const int POS = heads > 1 ? 4 : 8;
    for (int64_t j = 0; j < valid; j += POS) {
        int64_t row[MAX_POS];
        for (int t = 0; t < POS; t++) row[t] = at[j + t < count ? j + t : count - 1] + offset;
        __m256 partial[MAX_HEADS][MAX_POS];
        for (int h = 0; h < heads; h++)
            for (int t = 0; t < POS; t++) partial[h][t] = _mm256_setzero_ps();
        for (int64_t d = 0; d < DIM; d += 8) {
            __m256 q8[MAX_HEADS];
            for (int h = 0; h < heads; h++) q8[h] = _mm256_loadu_ps(qh[h] + d);
            for (int t = 0; t < POS; t++) {
                const __m256 key = load8(k_cache, row[t] + d, bf16);
                for (int h = 0; h < heads; h++)
                    partial[h][t] = _mm256_fmadd_ps(q8[h], key, partial[h][t]);
            }
        }
        for (int h = 0; h < heads; h++) {
            if (POS == 8)
                _mm256_storeu_ps(out[h] + j, sum_lanes8(partial[h]));
            else
                _mm_storeu_ps(out[h] + j, sum_lanes4(partial[h]));
        }
    }
}

// The value sums acc[h] (already scaled by the softmax's correction) of `heads` query heads of
// one kv head plus a block's positions [0, valid) of values times each head's weights[h]; values
// read once for all the heads, widened in registers, in passes of 64 dims (32 with several heads)
// held in registers. Each head's sums are added in position order, as alone.
static inline FORM_INLINE void group_values(const void* v_cache, const int64_t* at,
                                            int64_t offset, int64_t valid, float* const* acc,
                                            float* const* weights, const int heads,
                                            const int bf16, const int64_t DIM) {
    enum { MAX_HEADS = 3, MAX_CHUNKS = 8 };
    const int chunks_max = heads > 1 ? 4 : 8;
    for (int64_t d0 = 0; d0 < DIM; d0 += 8 * chunks_max) {
        // A constant bound where the passes divide DIM (64 and 128): with one that varied by
        // pass gcc kept the sums in memory, a store per FMA (head_dim 128, 2 heads a group:
        // 1.15-1.2x slower at 4-8 rows on Zen 3).
        const int chunks = DIM % (8 * chunks_max) == 0 ? chunks_max
                           : DIM - d0 < 8 * chunks_max ? (int)(DIM - d0) / 8
                                                       : chunks_max;
        __m256 sums[MAX_HEADS][MAX_CHUNKS];
        for (int h = 0; h < heads; h++)
            for (int c = 0; c < chunks; c++) sums[h][c] = _mm256_loadu_ps(acc[h] + d0 + 8 * c);
        for (int64_t j = 0; j < valid; j++) {
            __m256 p[MAX_HEADS];
            for (int h = 0; h < heads; h++) p[h] = _mm256_broadcast_ss(weights[h] + j);
            for (int c = 0; c < chunks; c++) {
                const __m256 value = load8(v_cache, at[j] + offset + d0 + 8 * c, bf16);
                for (int h = 0; h < heads; h++)
                    sums[h][c] = _mm256_fmadd_ps(p[h], value, sums[h][c]);
            }
        }
        for (int h = 0; h < heads; h++)
            for (int c = 0; c < chunks; c++) _mm256_storeu_ps(acc[h] + d0 + 8 * c, sums[h][c]);
    }
}

// How many of `left` heads the next group takes: 3 at most, never leaving one alone after 3
// (4 as 2 + 2).
static inline int group_size(int64_t left) {
    return left >= 5 || left == 3 ? 3 : left >= 2 ? 2 : 1;
}

// Calls fn(..., heads, bf16, DIM) with heads and bf16 as constants (one compiled form each).
#define GROUP_FORMS(fn, heads, bf16, DIM, ...)                                             \
    do {                                                                                   \
        if (heads == 3)                                                                    \
            bf16 ? fn(__VA_ARGS__, 3, 1, DIM) : fn(__VA_ARGS__, 3, 0, DIM);                \
        else if (heads == 2)                                                               \
            bf16 ? fn(__VA_ARGS__, 2, 1, DIM) : fn(__VA_ARGS__, 2, 0, DIM);                \
        else                                                                               \
            bf16 ? fn(__VA_ARGS__, 1, 1, DIM) : fn(__VA_ARGS__, 1, 0, DIM);                \
    } while (0)

// One kv head's pass over a block for every row of the run: its heads' scores from the keys
// (values == 0), or their value sums from the values, a row's heads of the kv head in groups
// that share each load. at[j]: position j's slot times the kv heads and DIM.
static inline FORM_INLINE void kv_head_pass(const attn_args* a, int values, const int64_t* at,
                                            int64_t kv_head, int64_t block, int64_t nrows,
                                            const int64_t* blocks, int64_t first_head,
                                            int64_t row_heads, int64_t count,
                                            float (*qf)[ATTN_MAX_DIM],
                                            float (*acc)[ATTN_MAX_DIM],
                                            float (*scores)[ATTN_BLOCK], const int64_t DIM) {
    const int bf16 = a->dtype != 0;
    const int64_t offset = kv_head * DIM;
    for (int64_t r = 0; r < nrows; r++) {
        if (blocks[r] == 0) continue;  // the row ended before this block
        for (int64_t g = 0; g < count;) {
            const int size = group_size(count - g);
            float *q[3], *out[3], *sums[3];
            for (int h = 0; h < size; h++) {
                const int64_t hh = r * row_heads + first_head + g + h;
                q[h] = qf[hh], out[h] = scores[hh], sums[h] = acc[hh];
            }
            if (values)
                GROUP_FORMS(group_values, size, bf16, DIM, a->v_cache, at, offset, blocks[r],
                            sums, out);
            else
                GROUP_FORMS(group_scores, size, bf16, DIM, a->k_cache, at, offset, block,
                            blocks[r], q, out);
            g += size;
        }
    }
}

// Every line of a block's task part of the keys and values (its kv heads' share of each
// position's row), loaded once up front: independent loads, many misses in flight, so that the
// passes after it read L1 and L2. Without it each pass waited on its own loads: one row over
// 700-4,000 positions took 10-15% longer (Zen 3), prefetches 8-32 positions ahead or the values
// asked for during the key pass changing nothing.
static inline void load_block_lines(const attn_args* a, const int32_t* slots, int64_t block,
                                    int64_t row_bytes, int64_t part_offset, int64_t part_bytes) {
    __m256i sink = _mm256_setzero_si256();
    for (int64_t j = 0; j < block; j++) {
        const int64_t at = (int64_t)slots[j] * row_bytes + part_offset;
        const char *keys = (const char*)a->k_cache + at, *values = (const char*)a->v_cache + at;
        for (int64_t line = 0; line < part_bytes; line += 64) {
            sink = _mm256_or_si256(sink, _mm256_loadu_si256((const __m256i*)(keys + line)));
            sink = _mm256_or_si256(sink, _mm256_loadu_si256((const __m256i*)(values + line)));
        }
    }
    __asm__ volatile("" : : "x"(sink));  // the loads are kept
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
// With AVX2 and DIM 64 or 128, a block's lines are loaded first (load_block_lines), then each kv
// head's keys (then values) are read for a row's heads of it in groups of up to 3, widened in
// registers (kv_head_pass): a verify step's 4-8 rows over 700-2,000 positions 1.3-1.5x faster
// than the loops below (SmolLM2's heads, Zen 3), one row 1.1-1.15x faster than through a float32
// copy of the block, and every score and sum the same bits as those.
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
    const int avx2_blocks = DIM > 0 && DIM % 8 == 0;  // DIM 0, any head_dim: the loops below
    int64_t at[ATTN_BLOCK];  // a block's positions' slots times the kv heads and DIM
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
            load_block_lines(a, slots + t0, block, row_bytes, part_offset, part_bytes);
            for (int64_t j = 0; j < block; j++)
                at[j] = (int64_t)slots[t0 + j] * a->num_kv_heads * DIM;
            for (int64_t kv = 0; kv < kv_count; kv++)
                kv_head_pass(a, 0, at, kvh0 + kv, block, nrows, blocks, kv * count, row_heads,
                             count, qf, acc, scores, DIM);
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
#ifdef HAVE_AVX2_FMA
            float new_max = block_max(scores[hh], valid);
#else
            float new_max = scores[hh][0];
            for (int64_t j = 1; j < valid; j++)
                new_max = scores[hh][j] > new_max ? scores[hh][j] : new_max;
#endif
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
            for (int64_t kv = 0; kv < kv_count; kv++)
                kv_head_pass(a, 1, at, kvh0 + kv, block, nrows, blocks, kv * count, row_heads,
                             count, qf, acc, scores, DIM);
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
