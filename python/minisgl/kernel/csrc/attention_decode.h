#ifndef MINISGL_ATTENTION_DECODE_H
#define MINISGL_ATTENTION_DECODE_H

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
#define ATTN_MAX_HEADS 128    // query heads a task (a run of rows) and a state hold
#define ATTN_VECTOR_HEADS 64  // a request's query heads an AVX-512 task takes whole

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

// The online softmax of a task's heads over the positions seen so far: float32 value sums (the
// AVX-512 kernels': in the (even, odd) pair layout; the portable ones': in order), running max
// and sum. A request's positions split over threads each give one; merged, they are the whole.
typedef struct {
    float acc[ATTN_MAX_HEADS][ATTN_MAX_DIM];
    float max[ATTN_MAX_HEADS], sum[ATTN_MAX_HEADS];
} attn_state;

// The positions a thread reads after a range (the next request's), for the lookahead.
typedef struct {
    const int32_t* slots;
    int64_t count;
} attn_next;

// CHUNKS of the vector path for this head_dim (0: the portable path).
static inline int attn_chunks(int64_t head_dim) {
#ifdef HAVE_AVX512
    return head_dim == 64 ? 4 : head_dim == 128 ? 8 : head_dim == 256 ? 16 : 0;
#else
    (void)head_dim;
    return 0;
#endif
}

// One part of the positions of a run of rows [b0, b0 + nrows) of one request (attn_run), for
// some of their heads (attention_decode_generic.c): kv heads [kvh0, kvh0 + kv_count), each one's
// query heads [first, first + count); row r's positions [begin, ends[r]) from an empty state
// (seeded: the cascade prefix's) into st, row r's heads from r * kv_count * count (NULL: the
// heads' outputs stored).
MINISGL_INTERNAL void attn_part_generic(const attn_args* a, int64_t b0, int64_t nrows,
                                        int64_t kvh0, int64_t kv_count, int64_t first,
                                        int64_t count, int64_t begin, const int64_t* ends,
                                        int seeded, attn_state* st);
// Row b's outputs for those heads from a state whose heads for it start at st_head.
MINISGL_INTERNAL void attn_store_generic(const attn_args* a, int64_t b, int64_t kvh0,
                                         int64_t kv_count, int64_t first, int64_t count,
                                         const attn_state* st, int64_t st_head);

#ifdef HAVE_AVX512
// The vector kernels (attention_decode_avx512.c), as attn_part_generic (every query head of the
// kv heads; a run of several rows holds every kv head), in their (even, odd) layout; `next`:
// what the task reads after the part, or NULL. The store: row b's outputs for those heads.
MINISGL_INTERNAL void attn_part_avx512(const attn_args* a, int64_t b0, int64_t nrows,
                                       int64_t kvh0, int64_t kv_count, int64_t begin,
                                       const int64_t* ends, int seeded, const attn_next* next,
                                       attn_state* st);
MINISGL_INTERNAL void attn_store_avx512(const attn_args* a, int64_t b, int64_t kvh0,
                                        int64_t kv_count, const attn_state* st, int64_t st_head);
#endif

#endif
