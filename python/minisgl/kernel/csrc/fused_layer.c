#include "common.h"
#include "internal.h"

// ------------------------------------------------------------------ decode attention block
// The attention half of a decode layer after the qkv projection, in one call: q/k RMSNorm (when
// q_norm is set), rotary, the new keys/values into the pool at out_loc, paged attention.
// qkv: [tokens, q | k | v] (read only); q_buf: [tokens, q_width] scratch; out: [tokens, q_width].
// Everything before the attention itself: q into q_buf and the new keys/values into the pool,
// then the norms and rotary in place there, a token at a time (its rows are in L1): the same
// per-row kernels as the module path's norm and rotary calls, so the same results bit for bit,
// without writing the projection back (that traffic was a third of these inputs' time).
// Returns MINISGL_OK or, before writing anything, MINISGL_ERR_POSITION (a position outside the
// rotary tables' max_positions rows; 0: the caller vouches for them).
static int attention_inputs(const void* qkv, void* q_buf, const void* q_norm, const void* k_norm,
                            float eps, void* k_cache, void* v_cache, const int64_t* out_loc,
                            const int64_t* positions, const float* cos, const float* sin,
                            int64_t max_positions, int64_t tokens, int64_t num_heads,
                            int64_t num_kv_heads, int64_t dim, int dtype, int nthreads) {
    if (max_positions > 0 && !positions_fit(positions, tokens, max_positions))
        return MINISGL_ERR_POSITION;
    const int64_t q_width = num_heads * dim, kv_width = num_kv_heads * dim;
    const int64_t qkv_width = q_width + 2 * kv_width;
    const size_t elem = dtype == 0 ? 4 : 2;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const char* row = (const char*)qkv + t * qkv_width * elem;
        char* q = (char*)q_buf + t * q_width * elem;
        char* k = (char*)k_cache + out_loc[t] * kv_width * elem;
        memcpy(q, row, (size_t)q_width * elem);
        memcpy(k, row + q_width * elem, (size_t)kv_width * elem);
        memcpy((char*)v_cache + out_loc[t] * kv_width * elem, row + (q_width + kv_width) * elem,
               (size_t)kv_width * elem);
        if (q_norm) {
            for (int64_t h = 0; h < num_heads; h++)
                add_rms_norm_row(q, NULL, q_norm, q, NULL, h, dim, eps, dtype);
            for (int64_t h = 0; h < num_kv_heads; h++)
                add_rms_norm_row(k, NULL, k_norm, k, NULL, h, dim, eps, dtype);
        }
        const float *cos_row = cos + positions[t] * dim, *sin_row = sin + positions[t] * dim;
        rotary_token(q, 0, num_heads, dim, cos_row, sin_row, dtype);
        rotary_token(k, 0, num_kv_heads, dim, cos_row, sin_row, dtype);
    }
    return MINISGL_OK;
}

// Returns attention_inputs' status, then minisgl_decode_attention's.
int minisgl_decode_attention_block(const void* qkv, void* q_buf, void* out, const void* q_norm,
                                   const void* k_norm, float eps, void* k_cache, void* v_cache,
                                   const int64_t* out_loc, const int64_t* positions,
                                   const float* cos, const float* sin, int64_t max_positions,
                                   const int32_t* page_table, int64_t table_stride,
                                   const int64_t* rows, const int64_t* kv_lens, int64_t tokens,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                                   float scale, int64_t window, int dtype, int nthreads) {
    if (!heads_fit(num_heads, num_kv_heads) || dim <= 0 || dim > ATTN_MAX_DIM)
        return MINISGL_ERR_SHAPE;
    const int status = attention_inputs(qkv, q_buf, q_norm, k_norm, eps, k_cache, v_cache,
                                        out_loc, positions, cos, sin, max_positions, tokens,
                                        num_heads, num_kv_heads, dim, dtype, nthreads);
    if (status != MINISGL_OK) return status;
    return minisgl_decode_attention(q_buf, k_cache, v_cache, out, page_table, table_stride, rows,
                                    kv_lens, NULL, NULL, NULL, tokens, num_heads, num_kv_heads,
                                    dim, scale, window, dtype, nthreads);
}

// The same for a prefill batch (bf16): inputs as above, then minisgl_prefill_attention over
// the new tokens of each request (rows/cached_lens/extend_lens as it takes them). Returns
// attention_inputs' status, then the attention's (on its error q_buf holds the queries, the pool
// the new keys and values, normed and rotated).
int minisgl_prefill_attention_block(const void* qkv, bf16_t* q_buf, bf16_t* out, const void* q_norm,
                                    const void* k_norm, float eps, bf16_t* k_cache,
                                    bf16_t* v_cache, const int64_t* out_loc,
                                    const int64_t* positions, const float* cos, const float* sin,
                                    int64_t max_positions, const int32_t* page_table,
                                    int64_t table_stride, const int64_t* rows,
                                    const int64_t* cached_lens, const int64_t* extend_lens,
                                    int64_t num_reqs, int64_t tokens, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t dim, float scale,
                                    int64_t window, int use_tiles, int nthreads) {
    if (!heads_fit(num_heads, num_kv_heads) || dim % 32 != 0 || dim <= 0 || dim > ATTN_MAX_DIM)
        return MINISGL_ERR_SHAPE;
#ifndef HAVE_AVX512_BF16
    return MINISGL_ERR_UNSUPPORTED;  // before the inputs: nothing written
#endif
    const int status = attention_inputs(qkv, q_buf, q_norm, k_norm, eps, k_cache, v_cache,
                                        out_loc, positions, cos, sin, max_positions, tokens,
                                        num_heads, num_kv_heads, dim, 1, nthreads);
    if (status != MINISGL_OK) return status;
    return minisgl_prefill_attention(q_buf, k_cache, v_cache, out, page_table, table_stride, rows,
                                     cached_lens, extend_lens, num_reqs, num_heads, num_kv_heads,
                                     dim, scale, window, use_tiles, nthreads);
}

// ------------------------------------------------------------------- fused decode layer (bf16)
// A whole decoder layer for a decode batch (one token per request) in one call, built from the
// library's kernels in the order the PyTorch modules run them, so the result is the same bit for
// bit: at batch 1 the layer is ~10 short kernels, and Python's cost between them was as large
// as the weights' read time. Projections read their packed (tile-layout) copies, the only copy
// the model keeps: with vdpbf16ps up to gemv_max_rows tokens, above on the AMX tiles where
// use_tiles (as layers/linear.py's CpuProjection picks); the row-major weight through the GEMV
// only where a projection has no packed copy.

// Whether a projection of this many tokens runs on the AMX tiles (else vdpbf16ps, which at a
// few rows streams the packed weight once at memory speed, as the GEMV does).
static inline int layer_tiles(const decode_model* m, int64_t tokens) {
    return m->use_tiles && tokens > m->gemv_max_rows;
}

// Status: the packed or quantized matmul's (the GEMV cannot fail).
static int layer_matmul(const decode_model* m, const bf16_t* x, const projection* p, bf16_t* y,
                        int64_t tokens, int64_t N, int64_t K, int nthreads) {
    if (p->quantized.values)
        return minisgl_quantized_linear(x, &p->quantized, p->bias, y, tokens, N, K, 1, 0,
                                        nthreads);
    if (p->tiles)
        return minisgl_packed_linear(x, p->tiles, p->bias, y, tokens, N, K, 0,
                                     layer_tiles(m, tokens), nthreads);
    minisgl_gemv_bf16(x, p->weight, p->bias, y, tokens, N, K, nthreads);
    return MINISGL_OK;
}

// y [tokens, N] (the projection of x [tokens, K]) plus each token's adapter delta (B (A x)
// of its slot's columns, rounded to bf16 and added as layers/lora.py's module path adds it);
// tokens without an adapter (slot -1) are left as they are. B is read transposed (lora_bt
// [width, N]): the delta is `rank` row-vector updates, not a dot product per output.
static int lora_add(const projection* p, const bf16_t* x, bf16_t* y, int64_t tokens, int64_t N,
                    int64_t K, const int64_t* slots, int nthreads) {
    if (!p->lora_a || !slots) return MINISGL_OK;
    const int64_t rank = p->lora_rank, per_token = K + rank + N;
    float* scratch = (float*)kernel_alloc((size_t)(tokens * per_token) * sizeof(float));
    if (!scratch) return MINISGL_ERR_NOMEM;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (tokens > 1)
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t slot = slots[t];
        if (slot < 0) continue;
        float *xf = scratch + t * per_token, *h = xf + K, *delta = h + rank;
        for (int64_t k = 0; k < K; k++) xf[k] = bf16_to_f32(x[t * K + k]);
        int64_t row0 = 0;
        for (int64_t part = 0; part < p->lora_parts; part++) {
            const int64_t col0 = (part * p->lora_slots + slot) * rank;
            const int64_t rows = p->lora_part_rows[part];
            for (int64_t r = 0; r < rank; r++) {
                const float* a = p->lora_a + (col0 + r) * K;
                float sum = 0.0f;
                for (int64_t k = 0; k < K; k++) sum += a[k] * xf[k];
                h[r] = sum;
            }
            float* d = delta + row0;
            for (int64_t o = 0; o < rows; o++) d[o] = 0.0f;
            for (int64_t r = 0; r < rank; r++) {
                const float* bt = p->lora_bt + (col0 + r) * N + row0;
                const float hr = h[r];
                for (int64_t o = 0; o < rows; o++) d[o] += hr * bt[o];
            }
            row0 += rows;
        }
        bf16_t* out = y + t * N;
        for (int64_t o = 0; o < row0 && o < N; o++)
            out[o] = f32_to_bf16(bf16_to_f32(out[o]) + bf16_to_f32(f32_to_bf16(delta[o])));
    }
    free(scratch);
    return MINISGL_OK;
}

// lora_add on its own: the module path's deltas (layers/lora.py), the same sums as the C
// layer's, so a row's output is the same bits on either path.
int minisgl_lora_add(const bf16_t* x, bf16_t* y, int64_t tokens, int64_t N, int64_t K,
                     const projection* p, const int64_t* slots, int nthreads) {
    return lora_add(p, x, y, tokens, N, K, slots, nthreads);
}

// The projection and its adapters' deltas (lora_add).
static int layer_project(const decode_model* m, const bf16_t* x, const projection* p, bf16_t* y,
                         int64_t tokens, int64_t N, int64_t K, int nthreads) {
    const int status = layer_matmul(m, x, p, y, tokens, N, K, nthreads);
    if (status != MINISGL_OK) return status;
    return lora_add(p, x, y, tokens, N, K, m->lora_slots, nthreads);
}

// Scratch elements (bf16) minisgl_decode_layer needs for `tokens` tokens.
int64_t minisgl_decode_layer_scratch(const decode_model* m, int64_t tokens) {
    int64_t q_width = m->num_heads * m->head_dim, kv_width = m->num_kv_heads * m->head_dim;
    return tokens * (2 * m->hidden + q_width + 2 * kv_width + 2 * q_width + 3 * m->inter);
}

// Where the first half leaves the rotated queries [tokens, heads, head_dim] in the scratch.
int64_t minisgl_decode_layer_q_offset(const decode_model* m, int64_t tokens) {
    return tokens * (m->hidden + (m->num_heads + 2 * m->num_kv_heads) * m->head_dim);
}

// The layer's scratch, carved from one bf16 buffer of minisgl_decode_layer_scratch elements.
typedef struct {
    bf16_t *normed, *qkv, *q, *attn, *proj, *gate_up, *act;
} layer_scratch;

static layer_scratch carve_scratch(const decode_model* m, bf16_t* scratch, int64_t tokens) {
    const int64_t q_width = m->num_heads * m->head_dim;
    layer_scratch s;
    s.normed = scratch;                                        // [tokens, hidden]
    s.qkv = s.normed + tokens * m->hidden;                     // [tokens, q | k | v]
    s.q = scratch + minisgl_decode_layer_q_offset(m, tokens);  // [tokens, q_width]
    s.attn = s.q + tokens * q_width;                           // [tokens, q_width]
    s.proj = s.attn + tokens * q_width;                        // [tokens, hidden]
    s.gate_up = s.proj + tokens * m->hidden;                   // [tokens, 2 * inter]
    s.act = s.gate_up + tokens * 2 * m->inter;                 // [tokens, inter]
    return s;
}

// First half of a layer: the input norm (x + residual -> residual), the qkv projection, q/k
// norms and rotary, the new keys/values into the pool, the queries into the scratch. Returns
// MINISGL_OK or the first failing step's status.
int minisgl_decode_layer_begin(const decode_layer* L, const decode_model* m, const bf16_t* x,
                                bf16_t* residual, int has_residual, bf16_t* scratch,
                                int64_t tokens, const int64_t* positions, const int64_t* out_loc,
                                int nthreads) {
    const int64_t hidden = m->hidden, dim = m->head_dim;
    const int64_t qkv_width = (m->num_heads + 2 * m->num_kv_heads) * dim;
    layer_scratch s = carve_scratch(m, scratch, tokens);
    if (has_residual) {
        minisgl_add_rms_norm(x, residual, L->input_norm, s.normed, residual, tokens, hidden,
                             m->eps, 1, nthreads);
    } else {
        memcpy(residual, x, (size_t)(tokens * hidden) * sizeof(bf16_t));
        minisgl_add_rms_norm(x, NULL, L->input_norm, s.normed, NULL, tokens, hidden, m->eps, 1,
                             nthreads);
    }
    const int status = layer_project(m, s.normed, &L->qkv, s.qkv, tokens, qkv_width, hidden,
                                     nthreads);
    if (status != MINISGL_OK) return status;
    return attention_inputs(s.qkv, s.q, L->q_norm, L->k_norm, m->eps, L->k_cache, L->v_cache,
                            out_loc, positions, m->cos, m->sin, m->max_positions, tokens,
                            m->num_heads, m->num_kv_heads, dim, 1, nthreads);
}

// Second half: paged attention over each request's positions (continuing from a prefix state
// when kv_starts is set, see minisgl_decode_attention), the o projection, the post-attention
// norm and the MLP into out. Returns MINISGL_OK or the first failing step's status.
int minisgl_decode_layer_end(const decode_layer* L, const decode_model* m, bf16_t* residual,
                              bf16_t* out, bf16_t* scratch, int64_t tokens, const int64_t* rows,
                              const int64_t* kv_lens, const int64_t* kv_starts,
                              const float* prefix_out, const float* prefix_lse, int nthreads) {
    const int64_t hidden = m->hidden, q_width = m->num_heads * m->head_dim;
    layer_scratch s = carve_scratch(m, scratch, tokens);
    int status = minisgl_decode_attention(s.q, L->k_cache, L->v_cache, s.attn, m->page_table,
                                          m->table_stride, rows, kv_lens, kv_starts, prefix_out,
                                          prefix_lse, tokens, m->num_heads, m->num_kv_heads,
                                          m->head_dim, m->scale, L->window, 1, nthreads);
    if (status != MINISGL_OK) return status;
    status = layer_project(m, s.attn, &L->o, s.proj, tokens, hidden, q_width, nthreads);
    if (status != MINISGL_OK) return status;
    minisgl_add_rms_norm(s.proj, residual, L->post_norm, s.normed, residual, tokens, hidden,
                         m->eps, 1, nthreads);
    // A gated quantized gate_up runs SiLU in its matmul where it can (AMX), else as below
    // (always with adapters: their deltas go in before SiLU).
    status = MINISGL_ERR_UNSUPPORTED;
    const int adapted = L->gate_up.lora_a && m->lora_slots;
    if (!adapted && L->gate_up.gated && L->gate_up.tiles) {
        status = minisgl_packed_gated_silu(s.normed, L->gate_up.tiles, L->gate_up.bias, s.act,
                                           tokens, m->inter, hidden, layer_tiles(m, tokens),
                                           nthreads);
    } else if (!adapted && L->gate_up.gated && L->gate_up.quantized.values) {
        status = minisgl_quantized_gated_silu(s.normed, &L->gate_up.quantized, s.act, tokens,
                                              m->inter, hidden, nthreads);
    }
    if (status == MINISGL_ERR_UNSUPPORTED) {
        status = layer_project(m, s.normed, &L->gate_up, s.gate_up, tokens, 2 * m->inter, hidden,
                               nthreads);
        if (status == MINISGL_OK)
            minisgl_silu_and_mul(s.gate_up, s.act, tokens, m->inter, 1, nthreads);
    }
    if (status != MINISGL_OK) return status;
    return layer_project(m, s.act, &L->down, out, tokens, hidden, m->inter, nthreads);
}

// Every layer of a decode step with no shared prefix, in one call: at batch 1 the Python and
// ctypes around a call per layer cost ~4% of SmolLM2's step. x: [tokens, hidden] the first
// layer's input; residual: [tokens, hidden], written; out: [tokens, hidden] each layer's MLP
// output, the next layer's input (a layer has read all of its input, into the residual and the
// normed scratch, before its down projection writes out). rows/kv_lens: the requests'
// page-table rows and lengths (new token included); out_loc: the new tokens' KV slots.
// Returns MINISGL_OK or the first failing layer's status (the later layers not run).
int minisgl_decode_layers(const decode_layer* layers, int64_t num_layers, const decode_model* m,
                          const bf16_t* x, bf16_t* residual, bf16_t* out, bf16_t* scratch,
                          int64_t tokens, const int64_t* positions, const int64_t* rows,
                          const int64_t* kv_lens, const int64_t* out_loc, int nthreads) {
    for (int64_t i = 0; i < num_layers; i++) {
        int status = minisgl_decode_layer_begin(&layers[i], m, i == 0 ? x : out, residual, i > 0,
                                                scratch, tokens, positions, out_loc, nthreads);
        if (status == MINISGL_OK)
            status = minisgl_decode_layer_end(&layers[i], m, residual, out, scratch, tokens, rows,
                                              kv_lens, NULL, NULL, NULL, nthreads);
        if (status != MINISGL_OK) return status;
    }
    return MINISGL_OK;
}
