#include "attention_decode.h"

// ------------------------------------------------- decode attention: parts, tasks and threads
#define ATTN_RUNS_PER_THREAD 4  // runs of whole requests a thread claims (the vector path)

// One head's state (acc, *max, *sum) with another part's folded in. Not inlined: every merge,
// of a task's own parts or of parts other threads packed, is the same instructions.
static __attribute__((noinline)) void merge_head(float* acc, float* max, float* sum,
                                                 const float* from_acc, float from_max,
                                                 float from_sum, int64_t dim) {
    const float top = *max > from_max ? *max : from_max;
    const float keep = expf(*max - top), add = expf(from_max - top);
    for (int64_t d = 0; d < dim; d++) acc[d] = acc[d] * keep + from_acc[d] * add;
    *sum = *sum * keep + from_sum * add;
    *max = top;
}

// A state's heads [from, from + heads) packed into heads * (dim + 2) floats (sums, maxima, sums
// of weights), and a packed state folded into a state, head by head as merge_head folds one.
static void attn_state_pack(const attn_state* st, int64_t from, int64_t heads, int64_t dim,
                            float* out) {
    for (int64_t h = 0; h < heads; h++)
        memcpy(out + h * dim, st->acc[from + h], dim * sizeof(float));
    memcpy(out + heads * dim, st->max + from, heads * sizeof(float));
    memcpy(out + heads * (dim + 1), st->sum + from, heads * sizeof(float));
}

static void attn_state_unpack(const float* in, int64_t heads, int64_t dim, attn_state* st) {
    for (int64_t h = 0; h < heads; h++) memcpy(st->acc[h], in + h * dim, dim * sizeof(float));
    memcpy(st->max, in + heads * dim, heads * sizeof(float));
    memcpy(st->sum, in + heads * (dim + 1), heads * sizeof(float));
}

static void attn_state_merge_packed(attn_state* into, const float* from, int64_t heads,
                                    int64_t dim) {
    for (int64_t h = 0; h < heads; h++)
        merge_head(into->acc[h], &into->max[h], &into->sum[h], from + h * dim,
                   from[heads * dim + h], from[heads * (dim + 1) + h], dim);
}

// A row's positions are attended in parts, each from an empty state (the first: the cascade
// prefix's), merged in order: a row's output is the same bits whichever task, thread count or
// batch computes it (a verify step's rows give what decoding them one by one gives, and a
// thread count that follows the machine's load changes nothing). Parts are ATTN_PART
// positions, longer (whole blocks) where a row would have more than ATTN_MAX_PARTS: a function
// of the row's own length only.
#define ATTN_PART 64
#define ATTN_MAX_PARTS 16

static inline int64_t attn_part_len(int64_t len) {
    if (len <= ATTN_PART * ATTN_MAX_PARTS) return ATTN_PART;
    const int64_t per = (len + ATTN_MAX_PARTS - 1) / ATTN_MAX_PARTS;
    return (per + ATTN_BLOCK - 1) / ATTN_BLOCK * ATTN_BLOCK;
}

// How many parts request b's positions take.
static inline int64_t attn_parts(const attn_args* a, int64_t b) {
    const int64_t len = a->kv_lens[b] - attn_start(a, b), step = attn_part_len(len);
    return len <= step ? 1 : (len + step - 1) / step;
}

// Part p of request b's positions: [*begin, *end).
static inline void attn_part_range(const attn_args* a, int64_t b, int64_t part, int64_t* begin,
                                   int64_t* end) {
    const int64_t start = attn_start(a, b), stop = a->kv_lens[b];
    const int64_t step = attn_part_len(stop - start);
    *begin = start + part * step;
    *end = *begin + step < stop ? *begin + step : stop;
}

// The parts of requests [0, num_reqs) as tasks: request b's are [first[b], first[b + 1]).
// NULL when out of memory.
static int64_t* attn_part_tasks(const attn_args* a, int64_t num_reqs) {
    int64_t* first = (int64_t*)kernel_alloc((size_t)(num_reqs + 1) * sizeof(int64_t));
    if (!first) return NULL;
    first[0] = 0;
    for (int64_t b = 0; b < num_reqs; b++) first[b + 1] = first[b] + attn_parts(a, b);
    return first;
}

static inline int64_t attn_task_request(const int64_t* first, int64_t num_reqs, int64_t task) {
    int64_t b = 0;
    while (b + 1 < num_reqs && first[b + 1] <= task) b++;
    return b;
}

// Whether row b + 1 continues row b's run: the same request's next position (a verify step's
// rows), whose positions start where b's do and split into parts at the same places.
static int attn_run_joins(const attn_args* a, int64_t b) {
    const int64_t start = attn_start(a, b);
    return a->rows[b + 1] == a->rows[b] && a->kv_lens[b + 1] == a->kv_lens[b] + 1 &&
           attn_start(a, b + 1) == start &&
           attn_part_len(a->kv_lens[b + 1] - start) == attn_part_len(a->kv_lens[b] - start);
}

// The rows as runs of at most max_rows (the portable kernels read a run's positions once for
// all its rows): run i is rows [runs[i], runs[i + 1]), *num_runs of them. NULL when out of memory.
static int64_t* attn_runs(const attn_args* a, int64_t num_reqs, int64_t max_rows,
                          int64_t* num_runs) {
    int64_t* runs = (int64_t*)kernel_alloc((size_t)(num_reqs + 1) * sizeof(int64_t));
    if (!runs) return NULL;
    int64_t count = 0;
    for (int64_t b = 0; b < num_reqs; b++)
        if (b == 0 || b - runs[count - 1] >= max_rows || !attn_run_joins(a, b - 1))
            runs[count++] = b;
    runs[count] = num_reqs;
    *num_runs = count;
    return runs;
}

// Part p of a run's rows [b0, b0 + nrows), for kv heads [kvh0, kvh0 + kv_count), each one's
// query heads [first, first + count) (vector: the AVX-512 kernels, every query head), into st:
// the rows that have a part p are the run's last ones (lengths grow along it), from *active on;
// row b0 + r's heads from (r - *active) * kv_count * count. next: what the task reads after the
// part (the vector kernels prefetch it), or NULL.
static void attn_run_part(const attn_args* a, int64_t b0, int64_t nrows, int64_t kvh0,
                          int64_t kv_count, int64_t first, int64_t count, int64_t p,
                          const attn_next* next, int vector, attn_state* st, int64_t* active) {
    int64_t r0 = 0, begin = 0, ends[ATTN_MAX_HEADS];
    while (attn_parts(a, b0 + r0) <= p) r0++;
    for (int64_t r = r0; r < nrows; r++) attn_part_range(a, b0 + r, p, &begin, &ends[r - r0]);
    *active = r0;
#ifdef HAVE_AVX512
    if (vector) {
        attn_part_avx512(a, b0 + r0, nrows - r0, kvh0, kv_count, begin, ends, p == 0, next, st);
        return;
    }
#endif
    (void)next, (void)vector;
    attn_part_generic(a, b0 + r0, nrows - r0, kvh0, kv_count, first, count, begin, ends, p == 0,
                      st);
}

// Row b's outputs for the heads of attn_run_part from a state whose heads for it start at
// st_head.
static void attn_run_store(const attn_args* a, int64_t b, int64_t kvh0, int64_t kv_count,
                           int64_t first, int64_t count, const attn_state* st, int64_t st_head,
                           int vector) {
#ifdef HAVE_AVX512
    if (vector) {
        attn_store_avx512(a, b, kvh0, kv_count, st, st_head);
        return;
    }
#endif
    (void)vector;
    attn_store_generic(a, b, kvh0, kv_count, first, count, st, st_head);
}

// The heads (as attn_run_part's) of a run's rows over all their positions, part by part, each
// row's parts merged in order; next: the positions the task reads after the run, or NULL.
static void attn_task(const attn_args* a, int64_t b0, int64_t nrows, int64_t kvh0,
                      int64_t kv_count, int64_t first, int64_t count, const attn_next* next,
                      int vector) {
    const int64_t last = b0 + nrows - 1, parts = attn_parts(a, last), dim = a->head_dim;
    const int64_t row_heads = kv_count * count, stop = a->kv_lens[last];
    const int32_t* slots = a->page_table + a->rows[last] * a->table_stride;
    attn_state whole, part;
    for (int64_t p = 0; p < parts; p++) {
        int64_t begin, end, r0;
        attn_part_range(a, last, p, &begin, &end);
        const attn_next rest = {slots + end, stop - end};  // the run's later parts
        const attn_next* after = p + 1 < parts ? &rest : next;
        attn_run_part(a, b0, nrows, kvh0, kv_count, first, count, p, after, vector,
                      p == 0 ? &whole : &part, &r0);
        if (p == 0) continue;
        for (int64_t h = 0; h < (nrows - r0) * row_heads; h++) {
            const int64_t into = r0 * row_heads + h;
            merge_head(whole.acc[into], &whole.max[into], &whole.sum[into], part.acc[h],
                       part.max[h], part.sum[h], dim);
        }
    }
    for (int64_t r = 0; r < nrows; r++)
        attn_run_store(a, b0 + r, kvh0, kv_count, first, count, &whole, r * row_heads, vector);
}

// Few or uneven runs on several threads: every part of every run a task (every head of a
// position read at once), each row's part packed, then each row's parts merged in order. By a
// task per kv head instead, a thread sat idle where the heads or runs did not split evenly
// (SmolLM2's 3 kv heads on 2 threads, batch 1 over 2,000 positions: 161 -> 136 µs a layer; a
// verify step's 8 rows over 700, 1.15x), and each task read a narrow slice of every position's
// row (the Qwen3 shape's 8 kv heads, batch 1 over 700 positions: 1.15-1.3x; Zen 3). vector: the
// AVX-512 kernels.
static int attn_split(const attn_args* a, int64_t num_reqs, const int64_t* runs,
                      int64_t num_runs, int nthreads, int vector) {
    const int64_t heads = a->num_heads, dim = a->head_dim, packed = heads * (dim + 2);
    const int64_t group = heads / a->num_kv_heads;
    int64_t* first = attn_part_tasks(a, num_reqs);
    // run i's tasks: the parts of its last row, [run_tasks[i], run_tasks[i + 1])
    int64_t* run_tasks = (int64_t*)kernel_alloc((size_t)(num_runs + 1) * sizeof(int64_t));
    float* packs = first && run_tasks
                       ? (float*)kernel_alloc((size_t)(first[num_reqs] * packed) * 4)
                       : NULL;
    if (!packs) {
        free(run_tasks);
        free(first);
        return MINISGL_ERR_NOMEM;
    }
    run_tasks[0] = 0;
    for (int64_t i = 0; i < num_runs; i++)
        run_tasks[i + 1] = run_tasks[i] + attn_parts(a, runs[i + 1] - 1);
#pragma omp parallel num_threads(nthreads)
    {
#pragma omp for schedule(dynamic, 1)
        for (int64_t task = 0; task < run_tasks[num_runs]; task++) {
            const int64_t i = attn_task_request(run_tasks, num_runs, task);
            const int64_t p = task - run_tasks[i], b0 = runs[i], nrows = runs[i + 1] - b0;
            attn_state st;
            int64_t r0;
            attn_run_part(a, b0, nrows, 0, a->num_kv_heads, 0, group, p, NULL, vector, &st, &r0);
            for (int64_t r = r0; r < nrows; r++)
                attn_state_pack(&st, (r - r0) * heads, heads, dim,
                                packs + (first[b0 + r] + p) * packed);
        }
        // Each row's parts merged in the same region (a barrier, not a second fork): serial
        // merges grew with the rows times the parts, past the tasks' own time on many threads.
#pragma omp for schedule(static)
        for (int64_t b = 0; b < num_reqs; b++) {
            attn_state whole;
            attn_state_unpack(packs + first[b] * packed, heads, dim, &whole);
            for (int64_t task = first[b] + 1; task < first[b + 1]; task++)
                attn_state_merge_packed(&whole, packs + task * packed, heads, dim);
            attn_run_store(a, b, 0, a->num_kv_heads, 0, group, &whole, 0, vector);
        }
    }
    free(packs);
    free(run_tasks);
    free(first);
    return MINISGL_OK;
}

// Whether a run's positions (times its rows) exceed a thread's share of all runs' by a quarter:
// whole runs as tasks would leave the other threads waiting on it (a verify step's 8 rows beside
// 3 single rows: 1.13x by parts, the Qwen3 shape 1.26x; Zen 3).
static int attn_runs_uneven(const attn_args* a, const int64_t* runs, int64_t num_runs,
                            int nthreads) {
    int64_t total = 0, largest = 0;
    for (int64_t i = 0; i < num_runs; i++) {
        int64_t work = 0;
        for (int64_t b = runs[i]; b < runs[i + 1]; b++) work += a->kv_lens[b] - attn_start(a, b);
        total += work;
        largest = work > largest ? work : largest;
    }
    return 4 * largest * nthreads > 5 * total;
}

// The portable path: rows in runs (attn_runs), tasks of runs' parts (attn_split), whole runs or
// a run's kv heads (a slice of a wide group).
static int attn_portable(const attn_args* a, int64_t num_reqs, int nthreads) {
    const int64_t num_heads = a->num_heads, num_kv_heads = a->num_kv_heads;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t max_rows = num_heads <= ATTN_MAX_HEADS ? ATTN_MAX_HEADS / num_heads : 1;
    int64_t num_runs;
    int64_t* runs = attn_runs(a, num_reqs, max_rows, &num_runs);
    if (!runs) return MINISGL_ERR_NOMEM;
    int status = MINISGL_OK;
    const int fits = group <= ATTN_MAX_GROUP && num_heads <= ATTN_MAX_HEADS;
    if (fits && nthreads > 1 &&
        (num_runs < 2 * nthreads || attn_runs_uneven(a, runs, num_runs, nthreads))) {
        status = attn_split(a, num_reqs, runs, num_runs, nthreads, 0);  // by parts
    } else if (fits) {
        // Otherwise a task is a whole run (whole rows read once, in slot order): batch 64 x 160
        // x 30 layers 38 -> 31 ms, x 192 38 -> 28 ms (AVX2 build, alternated in one process);
        // on one thread, SmolLM2 at batch 1 over 700 positions 1.45x and the Qwen3 shape 1.2x
        // (Zen 3), against a task per kv head, which only heads past a task's arrays keep (a
        // slice of a wide group per task).
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (int64_t i = 0; i < num_runs; i++)
            attn_task(a, runs[i], runs[i + 1] - runs[i], 0, num_kv_heads, 0, group, NULL, 0);
    } else {
        const int64_t slices = (group + ATTN_MAX_GROUP - 1) / ATTN_MAX_GROUP;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (int64_t task = 0; task < num_runs * num_kv_heads * slices; task++) {
            const int64_t head = task / slices, first = task % slices * ATTN_MAX_GROUP;
            const int64_t i = head / num_kv_heads;
            attn_task(a, runs[i], runs[i + 1] - runs[i], head % num_kv_heads, 1, first,
                      group - first < ATTN_MAX_GROUP ? group - first : ATTN_MAX_GROUP, NULL, 0);
        }
    }
    free(runs);
    return status;
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
    if (!attn_chunks(head_dim) || group > ATTN_VECTOR_HEADS)  // the portable path
        return attn_portable(&a, num_reqs, nthreads);
#ifdef HAVE_AVX512
    if (num_heads > ATTN_VECTOR_HEADS) {  // more heads than a task holds: one kv head per task
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (int64_t task = 0; task < num_reqs * num_kv_heads; task++)
            attn_task(&a, task / num_kv_heads, 1, task % num_kv_heads, 1, 0, group, NULL, 1);
        return MINISGL_OK;
    }
    if (num_reqs == 0) return MINISGL_OK;
    // A verify step's rows are a run: each position's rows read once for all of them.
    int64_t num_runs;
    int64_t* runs = attn_runs(&a, num_reqs, ATTN_MAX_HEADS / num_heads, &num_runs);
    if (!runs) return MINISGL_ERR_NOMEM;
    if (num_runs < 2 * nthreads ||
        (nthreads > 1 && attn_runs_uneven(&a, runs, num_runs, nthreads))) {
        const int status = attn_split(&a, num_reqs, runs, num_runs, nthreads, 1);
        free(runs);
        return status;
    }
    // Otherwise a task is a whole run (each position's rows are read once for all its heads),
    // and consecutive runs holding an equal share of the work are read as one sweep along the
    // slots (consecutive when requests' slots follow each other). Sweeps are claimed one at a
    // time, ATTN_RUNS_PER_THREAD of them a thread: one per thread left the other waiting
    // whenever the OS or another process slowed one.
    int64_t sweeps = nthreads * ATTN_RUNS_PER_THREAD;
    sweeps = sweeps < num_runs ? sweeps : num_runs;
    int64_t* sweep_first = (int64_t*)kernel_alloc((size_t)(sweeps + 1) * sizeof(int64_t));
    if (!sweep_first) {
        free(runs);
        return MINISGL_ERR_NOMEM;
    }
    int64_t total = 0, done = 0;
    for (int64_t b = 0; b < num_reqs; b++) total += kv_lens[b] - attn_start(&a, b);
    for (int64_t w = 0, i = 0; w < sweeps; w++) {  // sweep w: the runs whose work begins in it
        for (; i < num_runs && done * sweeps < w * total; i++)
            for (int64_t b = runs[i]; b < runs[i + 1]; b++) done += kv_lens[b] - attn_start(&a, b);
        sweep_first[w] = i;
    }
    sweep_first[sweeps] = num_runs;
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
    for (int64_t w = 0; w < sweeps; w++) {
        const int64_t hi = sweep_first[w + 1];
        for (int64_t i = sweep_first[w]; i < hi; i++) {
            attn_next next = {NULL, 0};
            if (i + 1 < hi) {  // the next run's positions (its last row's)
                const int64_t last = runs[i + 2] - 1, next_start = attn_start(&a, last);
                next.slots = page_table + rows[last] * table_stride + next_start;
                next.count = kv_lens[last] - next_start;
            }
            attn_task(&a, runs[i], runs[i + 1] - runs[i], 0, num_kv_heads, 0, group, &next, 1);
        }
    }
    free(sweep_first);
    free(runs);
#endif
    return MINISGL_OK;
}
