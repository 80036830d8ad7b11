#include "common.h"
#include "simd.h"

// ---------------------------------------------------------------------------------- sampling
// indices[r] = the first column of row r of x [rows, cols] (dtype code: float32 or bf16)
// holding its largest value, or its first NaN (as torch.max(dim=-1) picks): greedy sampling
// straight from the logits, bf16 ones widened exactly to float32 as they are read.
// One row runs on the calling thread: a parallel region's start and join cost more than it.
void minisgl_argmax(const void* x, int64_t* indices, int64_t rows, int64_t cols, int dtype,
                    int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const int64_t base = r * cols;
        int64_t c = 0, best = 0;
        float best_value;
        load_row(x, base, dtype, &best_value, 1);
#ifdef HAVE_AVX512
        if (cols >= 16) {
            // Per lane: the largest value so far and its first column; a NaN stops the scan.
            __m512 lane_max = load16(x, base, dtype);
            __m512i lane_at =
                _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
            __m512i at = lane_at;
            const __m512i step = _mm512_set1_epi32(16);
            int nan = _mm512_cmp_ps_mask(lane_max, lane_max, _CMP_UNORD_Q) != 0;
            for (c = 16; c + 16 <= cols && !nan; c += 16) {
                at = _mm512_add_epi32(at, step);
                const __m512 v = load16(x, base + c, dtype);
                const __mmask16 higher = _mm512_cmp_ps_mask(v, lane_max, _CMP_GT_OQ);
                lane_max = _mm512_mask_mov_ps(lane_max, higher, v);
                lane_at = _mm512_mask_mov_epi32(lane_at, higher, at);
                nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q) != 0;
            }
            if (nan) {  // the scalar scan below finds the first NaN
                c = 0;
            } else {
                float values[16];
                int32_t at_lane[16];
                _mm512_storeu_ps(values, lane_max);
                _mm512_storeu_si512(at_lane, lane_at);
                best_value = values[0], best = at_lane[0];
                for (int lane = 1; lane < 16; lane++)
                    if (values[lane] > best_value ||
                        (values[lane] == best_value && at_lane[lane] < best))
                        best_value = values[lane], best = at_lane[lane];
            }
        }
#elif defined(HAVE_AVX2_FMA)
        // The same scan 8 lanes at a time: one scalar row of SmolLM2's 49,152 logits took 56 µs
        // (Zen 3), 1.6% of a batch-16 step.
        if (cols >= 8) {
            __m256 lane_max = load8(x, base, dtype);
            __m256i lane_at = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), at = lane_at;
            const __m256i step = _mm256_set1_epi32(8);
            int nan = _mm256_movemask_ps(_mm256_cmp_ps(lane_max, lane_max, _CMP_UNORD_Q)) != 0;
            for (c = 8; c + 8 <= cols && !nan; c += 8) {
                at = _mm256_add_epi32(at, step);
                const __m256 v = load8(x, base + c, dtype);
                const __m256 higher = _mm256_cmp_ps(v, lane_max, _CMP_GT_OQ);
                lane_max = _mm256_blendv_ps(lane_max, v, higher);
                lane_at = _mm256_castps_si256(_mm256_blendv_ps(
                    _mm256_castsi256_ps(lane_at), _mm256_castsi256_ps(at), higher));
                nan = _mm256_movemask_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q)) != 0;
            }
            if (nan) {  // the scalar scan below finds the first NaN
                c = 0;
            } else {
                float values[8];
                int32_t at_lane[8];
                _mm256_storeu_ps(values, lane_max);
                _mm256_storeu_si256((__m256i*)at_lane, lane_at);
                best_value = values[0], best = at_lane[0];
                for (int lane = 1; lane < 8; lane++)
                    if (values[lane] > best_value ||
                        (values[lane] == best_value && at_lane[lane] < best))
                        best_value = values[lane], best = at_lane[lane];
            }
        }
#endif
        for (; c < cols; c++) {
            float v;
            load_row(x, base + c, dtype, &v, 1);
            if (v != v) {
                best = c;
                break;
            }
            if (v > best_value) best_value = v, best = c;
        }
        indices[r] = best;
    }
}

// Row rows[i] of logits [*, cols] (dtype code) keeps the columns whose bit in bitmask[i] (int32
// [n, words], bit j of word w: column 32 w + j, words * 32 >= cols) is set, the others -inf: a
// constrained request's grammar mask (MINISGL_ERR_SHAPE: a row outside logits_rows, too few
// words). Whole words of clear bits (most of a JSON constraint's
// vocabulary) are filled at once; the PyTorch ops expanded the mask to a tensor of the
// vocabulary (0.77 ms a row of 49,152 on Zen 3, 24 ms at batch 16).
int minisgl_mask_disallowed(void* logits, int64_t logits_rows, const int64_t* rows,
                            const int32_t* bitmask, int64_t n, int64_t cols, int64_t words,
                            int dtype, int nthreads) {
    if (32 * words < cols) return MINISGL_ERR_SHAPE;
    for (int64_t i = 0; i < n; i++)
        if (rows[i] < 0 || rows[i] >= logits_rows) return MINISGL_ERR_SHAPE;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (n > 1)
    for (int64_t i = 0; i < n; i++) {
        const uint32_t* bits = (const uint32_t*)bitmask + i * words;
        float* row32 = (float*)logits + rows[i] * cols;
        bf16_t* row16 = (bf16_t*)logits + rows[i] * cols;
        for (int64_t w = 0; w < words && 32 * w < cols; w++) {
            const uint32_t word = bits[w];
            if (word == 0xffffffffu) continue;
            const int64_t first = 32 * w, last = first + 32 < cols ? first + 32 : cols;
            if (word == 0 && dtype == 0) {
                for (int64_t c = first; c < last; c++) row32[c] = -INFINITY;
            } else if (word == 0) {
                for (int64_t c = first; c < last; c++) row16[c] = (bf16_t)0xff80u;  // -inf
            } else if (dtype == 0) {  // (branchless: mixed words' bits are unpredictable)
                for (int64_t c = first; c < last; c++)
                    row32[c] = (word >> (c - first)) & 1u ? row32[c] : -INFINITY;
            } else {
                for (int64_t c = first; c < last; c++)
                    row16[c] = (word >> (c - first)) & 1u ? row16[c] : (bf16_t)0xff80u;
            }
        }
    }
    return MINISGL_OK;
}

// For each row r of logits [rows, cols] (dtype code), next[r] = sampled[r] where it is a column
// whose logit is finite, else -1 (its request fails alone), and pool[r] = that token, else 0 (a
// token safe to feed back as input): reading only the chosen logit of each row, in one call
// where the PyTorch ops took nine (~0.12 ms of a 6 ms batch-1 step on Zen 3).
void minisgl_flag_non_finite(const void* logits, const int32_t* sampled, int32_t* next,
                             int32_t* pool, int64_t rows, int64_t cols, int dtype) {
    for (int64_t r = 0; r < rows; r++) {
        const int32_t token = sampled[r];
        int ok = token >= 0 && token < cols;
        if (ok) {
            float value;
            load_row(logits, r * cols + token, dtype, &value, 1);
            uint32_t bits;
            memcpy(&bits, &value, sizeof bits);
            ok = (bits & 0x7f800000u) != 0x7f800000u;  // neither inf nor NaN
        }
        next[r] = ok ? token : -1;
        pool[r] = ok ? token : 0;
    }
}

// The weights of a row's columns [0, n) into w, and their float32 sum (minisgl_sample_rows adds
// these block sums in double): x itself, or for logits exp((x - top) * inv_temp), 0 below e^-87
// (where exp underflows, and for -inf).
#define SAMPLE_BLOCK 64
static inline float block_weights(const float* x, int64_t n, int logits, float top,
                                  float inv_temp, float* w) {
#ifdef HAVE_AVX512
    if (n == SAMPLE_BLOCK) {
        __m512 total = _mm512_setzero_ps();
        for (int i = 0; i < SAMPLE_BLOCK; i += 16) {
            __m512 v = _mm512_loadu_ps(x + i);
            if (logits) {
                const __m512 z =
                    _mm512_mul_ps(_mm512_sub_ps(v, _mm512_set1_ps(top)), _mm512_set1_ps(inv_temp));
                const __mmask16 live = _mm512_cmp_ps_mask(z, _mm512_set1_ps(-87.0f), _CMP_GE_OQ);
                v = _mm512_maskz_mov_ps(live, exp512(z));
            }
            _mm512_storeu_ps(w + i, v);
            total = _mm512_add_ps(total, v);
        }
        return _mm512_reduce_add_ps(total);
    }
#elif defined(HAVE_AVX2_FMA)
    // (scalar, a row of SmolLM2's 49,152 logits took 320 µs on Zen 3: 18% of a batch-16 step)
    if (n == SAMPLE_BLOCK) {
        __m256 total = _mm256_setzero_ps();
        for (int i = 0; i < SAMPLE_BLOCK; i += 8) {
            __m256 v = _mm256_loadu_ps(x + i);
            if (logits) {
                const __m256 z =
                    _mm256_mul_ps(_mm256_sub_ps(v, _mm256_set1_ps(top)), _mm256_set1_ps(inv_temp));
                const __m256 live = _mm256_cmp_ps(z, _mm256_set1_ps(-87.0f), _CMP_GE_OQ);
                v = _mm256_and_ps(live, exp256_nonpositive(z));
            }
            _mm256_storeu_ps(w + i, v);
            total = _mm256_add_ps(total, v);
        }
        const __m128 quad = _mm_add_ps(_mm256_castps256_ps128(total),
                                       _mm256_extractf128_ps(total, 1));
        const __m128 pair = _mm_add_ps(quad, _mm_movehl_ps(quad, quad));
        return _mm_cvtss_f32(_mm_add_ss(pair, _mm_movehdup_ps(pair)));
    }
#endif
    float sum = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        const float z = (x[i] - top) * inv_temp;
        w[i] = !logits ? x[i] : z >= -87.0f ? expf(z) : 0.0f;
        sum += w[i];
    }
    return sum;
}

// The largest of row[0, cols) (cols >= 1).
static inline float row_max(const float* row, int64_t cols) {
    int64_t c = 0;
    float top = row[0];
#ifdef HAVE_AVX512
    __m512 tops = _mm512_set1_ps(row[0]);
    for (; c + 16 <= cols; c += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(row + c));
    top = _mm512_reduce_max_ps(tops);
#elif defined(HAVE_AVX2_FMA)
    // Four chains of maxima: one waited on each maximum's latency (Zen 3: ~4 cycles a vector).
    __m256 tops[4];
    for (int i = 0; i < 4; i++) tops[i] = _mm256_set1_ps(row[0]);
    for (; c + 32 <= cols; c += 32)
        for (int i = 0; i < 4; i++)
            tops[i] = _mm256_max_ps(tops[i], _mm256_loadu_ps(row + c + 8 * i));
    for (; c + 8 <= cols; c += 8) tops[0] = _mm256_max_ps(tops[0], _mm256_loadu_ps(row + c));
    float lanes[32];
    for (int i = 0; i < 4; i++) _mm256_storeu_ps(lanes + 8 * i, tops[i]);
    for (int lane = 0; lane < 32; lane++) top = lanes[lane] > top ? lanes[lane] : top;
#endif
    for (; c < cols; c++) top = row[c] > top ? row[c] : top;
    return top;
}

// out[r] = softmax(x[r] / temperatures[r]) over its columns, unnormalised (the largest column
// 1) unless `normalize`: the weights of minisgl_sample_rows's draw (0 below e^-87), for the
// sampler's top-k / top-p / min-p filters. One pass for the maximum, one for the weights, one
// to normalise, where the PyTorch ops took six over the row (~0.2 ms of SmolLM2's 49,152 logits
// at batch 1 on Zen 3).
void minisgl_tempered_softmax(const float* x, const float* temperatures, float* out,
                              int64_t rows, int64_t cols, int normalize, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static) if (rows > 1)
    for (int64_t r = 0; r < rows; r++) {
        const float* row = x + r * cols;
        float* probs = out + r * cols;
        const float top = row_max(row, cols), inv_temp = 1.0f / temperatures[r];
        double total = 0.0;
        for (int64_t c = 0; c < cols; c += SAMPLE_BLOCK)
            total += block_weights(row + c, cols - c < SAMPLE_BLOCK ? cols - c : SAMPLE_BLOCK, 1,
                                   top, inv_temp, probs + c);
        if (!normalize) continue;
        const float scale = (float)(1.0 / total);
        for (int64_t c = 0; c < cols; c++) probs[c] *= scale;
    }
}

// tokens[r]: a draw from row r of x [rows, cols], by the inverse of its distribution function:
// the first column whose running weight exceeds uniforms[r] (in [0, 1)) times the row's total.
// The weights are x itself (>= 0, not all zero) or, given temperatures, softmax(x / T) up to
// its normaliser, computed on the fly (no probability buffer). One uniform number per row, where
// drawing one per column (an exponential race) cost 34 ms at 64 x 151,936.
void minisgl_sample_rows(const float* x, const float* temperatures, const double* uniforms,
                         int64_t* tokens, int64_t rows, int64_t cols, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = 0; r < rows; r++) {
        const float* row = x + r * cols;
        const int logits = temperatures != NULL;
        float w[SAMPLE_BLOCK];
        const float top = logits ? row_max(row, cols) : 0.0f;
        const float inv_temp = logits ? 1.0f / temperatures[r] : 1.0f;
        double total = 0.0;
        for (int64_t c = 0; c < cols; c += SAMPLE_BLOCK)
            total += block_weights(row + c, cols - c < SAMPLE_BLOCK ? cols - c : SAMPLE_BLOCK,
                                   logits, top, inv_temp, w);
        const double target = uniforms[r] * total;
        double running = 0.0;
        int64_t token = -1, last = 0;  // last: the start of the last block with weight
        for (int64_t c = 0; c < cols && token < 0; c += SAMPLE_BLOCK) {
            const int64_t n = cols - c < SAMPLE_BLOCK ? cols - c : SAMPLE_BLOCK;
            const float sum = block_weights(row + c, n, logits, top, inv_temp, w);
            if (sum > 0.0f) last = c;
            if (running + sum <= target) {
                running += sum;
                continue;
            }
            // The crossing is in this block, up to rounding (the element sums in double may
            // fall short of the block's float sum): then the next column with weight after it.
            double inside = running;
            for (int64_t i = 0; i < n; i++) {
                inside += w[i];
                if (inside > target && w[i] > 0.0f) {
                    token = c + i;
                    break;
                }
            }
            running += sum;
        }
        if (token < 0) {  // target at the very top (rounding): the last column with weight
            const int64_t n = cols - last < SAMPLE_BLOCK ? cols - last : SAMPLE_BLOCK;
            block_weights(row + last, n, logits, top, inv_temp, w);
            for (token = n - 1; token > 0 && !(w[token] > 0.0f); token--) {
            }
            token += last;
        }
        tokens[r] = token;
    }
}

// A candidate of minisgl_top_candidates; `a` ranks before `b` when larger, or equal and
// further left (the first of equal values first, as a stable sort).
typedef struct {
    float value;
    int64_t index;
} candidate;

static inline int ranks_before(candidate a, candidate b) {
    return a.value > b.value || (a.value == b.value && a.index < b.index);
}

// Reorder buf[0, n) so that its k first-ranked come first, in no order (quickselect).
static void select_first(candidate* buf, int64_t n, int64_t k) {
    int64_t lo = 0, hi = n - 1;
    while (lo < hi) {
        const candidate pivot = buf[lo + (hi - lo) / 2];
        int64_t i = lo, j = hi;
        while (i <= j) {
            while (ranks_before(buf[i], pivot)) i++;
            while (ranks_before(pivot, buf[j])) j--;
            if (i <= j) {
                const candidate swap = buf[i];
                buf[i++] = buf[j], buf[j--] = swap;
            }
        }
        if (k - 1 <= j)
            hi = j;
        else if (k - 1 >= i)
            lo = i;
        else
            return;
    }
}

// A float's order as an unsigned integer (the larger float, the larger key; -0.0 as +0.0), and
// the float of a key.
static inline uint32_t order_key(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    bits = bits == 0x80000000u ? 0u : bits;
    return bits & 0x80000000u ? ~bits : bits | 0x80000000u;
}

static inline float key_value(uint32_t key) {
    const uint32_t bits = key & 0x80000000u ? key & 0x7fffffffu : ~key;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

// A bar below which no value of the row is among its k largest: just under the lowest value of
// the histogram bucket (a key's top BAR_BITS bits) that holds the k-th largest; -inf where that
// bucket reaches -inf. NaNs are not counted (they are never kept).
#define BAR_BITS 12
// The k from which the histogram pays: its pass cost ~40 µs of 49,152 columns (Zen 3), which
// for the 64 largest was half the call, for the 1,024 largest (Sampler's candidates) a fifth.
#define BAR_MIN_K 256
static float initial_bar(const float* row, int64_t cols, int64_t k) {
    uint32_t counts[1 << BAR_BITS] = {0};
    for (int64_t c = 0; c < cols; c++)
        if (row[c] == row[c]) counts[order_key(row[c]) >> (32 - BAR_BITS)]++;
    int64_t above = 0;
    for (int64_t bucket = (1 << BAR_BITS) - 1; bucket >= 0; bucket--) {
        above += counts[bucket];
        if (above < k) continue;
        const float low = key_value((uint32_t)bucket << (32 - BAR_BITS));
        return low > -INFINITY ? nextafterf(low, -INFINITY) : -INFINITY;  // (NaN: -inf's)
    }
    return -INFINITY;
}

// keys[0, n) ascending (distinct): quicksort, the smaller side first, then insertion sort.
static void sort_keys(uint64_t* keys, int64_t n) {
    while (n > 16) {
        const uint64_t a = keys[0], b = keys[n / 2], c = keys[n - 1];
        const uint64_t pivot = a < b ? (b < c ? b : a < c ? c : a) : (a < c ? a : b < c ? c : b);
        int64_t i = 0, j = n - 1;
        while (i <= j) {
            while (keys[i] < pivot) i++;
            while (keys[j] > pivot) j--;
            if (i <= j) {
                const uint64_t swap = keys[i];
                keys[i++] = keys[j], keys[j--] = swap;
            }
        }
        if (j + 1 < n - i) {
            sort_keys(keys, j + 1);
            keys += i, n -= i;
        } else {
            sort_keys(keys + i, n - i);
            n = j + 1;
        }
    }
    for (int64_t i = 1; i < n; i++) {
        const uint64_t key = keys[i];
        int64_t j = i - 1;
        for (; j >= 0 && keys[j] > key; j--) keys[j + 1] = keys[j];
        keys[j + 1] = key;
    }
}

// The k largest values of each row of x [rows, cols] (float32, k <= cols), largest first (the
// first column first among equals), and their columns. For a large k a histogram of the values'
// top bits sets a bar that only the few around the k-th largest pass (a bar from -inf up kept
// thousands of 49,152 probabilities before it rose: ~300 µs a row for the 1,024 largest against
// ~100, Zen 3); one pass then keeps a column when it beats the bar (8 or 16 compared at a time),
// and when 2k are kept, the best k are selected and the bar rises. The k are ordered as 64-bit
// keys (the value's order, then the column), not by qsort's comparator calls. Returns
// MINISGL_OK, MINISGL_ERR_SHAPE (k outside [1, cols], cols past 2^32) or MINISGL_ERR_NOMEM.
int minisgl_top_candidates(const float* x, int64_t rows, int64_t cols, int64_t k, float* values,
                           int64_t* indices, int nthreads) {
    if (k <= 0 || k > cols || rows < 0 || cols > (int64_t)UINT32_MAX) return MINISGL_ERR_SHAPE;
    int status = MINISGL_OK;
#pragma omp parallel num_threads(nthreads)
    {
        candidate* kept = (candidate*)kernel_alloc((size_t)(2 * k) * sizeof(candidate));
        uint64_t* keys = kept ? (uint64_t*)kernel_alloc((size_t)k * sizeof(uint64_t)) : NULL;
        if (!keys) {
#pragma omp atomic write
            status = MINISGL_ERR_NOMEM;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!keys) continue;  // this thread's rows are lost: the call reports the failure
            const float* row = x + r * cols;
            int64_t count = 0;
            // every kept value beats the bar; -inf: fewer than k kept so far may equal it
            float bar = k >= BAR_MIN_K ? initial_bar(row, cols, k) : -INFINITY;
            for (int64_t c = 0; c < cols; c++) {
#ifdef HAVE_AVX512
                if (c % 16 == 0 && c + 16 <= cols) {
                    const __m512 v = _mm512_loadu_ps(row + c), at_bar = _mm512_set1_ps(bar);
                    if (!_mm512_cmp_ps_mask(v, at_bar, _CMP_GT_OQ) &&
                        (count >= k || !_mm512_cmp_ps_mask(v, at_bar, _CMP_EQ_OQ))) {
                        c += 15;  // none of these 16 is kept (below)
                        continue;
                    }
                }
#elif defined(HAVE_AVX2_FMA)
                if (c % 8 == 0 && c + 8 <= cols) {
                    const __m256 v = _mm256_loadu_ps(row + c), at_bar = _mm256_set1_ps(bar);
                    if (!_mm256_movemask_ps(_mm256_cmp_ps(v, at_bar, _CMP_GT_OQ)) &&
                        (count >= k || !_mm256_movemask_ps(_mm256_cmp_ps(v, at_bar, _CMP_EQ_OQ)))) {
                        c += 7;  // none of these 8 is kept (below)
                        continue;
                    }
                }
#endif
                if (!(row[c] > bar) && !(count < k && row[c] == bar)) continue;
                kept[count++] = (candidate){row[c], c};
                if (count == 2 * k) {
                    select_first(kept, count, k);
                    count = k;
                    bar = kept[0].value;
                    for (int64_t i = 1; i < k; i++) bar = kept[i].value < bar ? kept[i].value : bar;
                }
            }
            // Fewer than k values that are not NaN (a row gone non-finite): its NaNs, in
            // column order, fill the k (ordered by their bits, as the rest).
            for (int64_t c = 0; c < cols && count < k; c++)
                if (row[c] != row[c]) kept[count++] = (candidate){row[c], c};
            if (count > k) select_first(kept, count, k);
            for (int64_t i = 0; i < k; i++)
                keys[i] = (uint64_t)(~order_key(kept[i].value)) << 32 | (uint64_t)kept[i].index;
            sort_keys(keys, k);
            for (int64_t i = 0; i < k; i++) {
                const int64_t column = (int64_t)(keys[i] & 0xffffffffu);
                values[r * k + i] = row[column], indices[r * k + i] = column;
            }
        }
        free(keys);
        free(kept);
    }
    return status;
}
