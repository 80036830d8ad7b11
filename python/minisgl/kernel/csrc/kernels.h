// CPU kernels for the hot paths PyTorch's eager ops do badly on small batches: a bf16 GEMV
// that streams weights at memory bandwidth, paged decode attention that reads the KV pool in
// place, and fused elementwise ops (residual + RMSNorm, SiLU-and-mul, rotary) that round to the
// storage dtype exactly where PyTorch's op-by-op version does, so results match bit for bit.
//
// Built once per machine by minisgl/kernel/build.py (gcc -O3 -march=native -fopenmp), every
// .c file of this folder into one shared library, and called through ctypes with raw pointers
// to contiguous tensors. It links the OpenMP runtime that torch already loaded, so both share
// one thread pool. dtype codes: 0 float32, 1 bfloat16.
//
// This header is the library's interface: its status codes, the fused decode layer's
// parameter structs and one prototype per exported function, by the file that defines it.
// kernel/abi.py mirrors it for ctypes (tests/test_kernel_abi.py checks the two against each
// other); every .c file includes it, so a definition that differs from its prototype does
// not compile.
#pragma once

#include <stdint.h>

typedef uint16_t bf16_t;

// What the kernels that can fail return; the wrappers (kernel/abi.py's check_status) turn
// every code but MINISGL_OK into an exception naming the kernel (nothing is written on an
// error, unless it says otherwise).
#define MINISGL_OK 0
#define MINISGL_ERR_NOMEM 1        // an allocation failed
#define MINISGL_ERR_SHAPE 2        // a shape this kernel cannot take (the wrappers check first)
#define MINISGL_ERR_UNSUPPORTED 3  // built without the instructions this kernel needs
#define MINISGL_ERR_POSITION 4     // a position outside the rotary tables

// The fused decode layer's parameters (fused_layer.c; abi.ProjectionParams,
// abi.DecodeLayerParams and abi.DecodeModelParams): one projection as the module path holds it
// (layers/linear.py's CpuProjection.fused_params), one layer's norms, projections and KV pool,
// the model's shapes and tables.
// A weight as small integers and per-group float scales and offsets (quantized.c;
// layers/quant_weight.py's QuantizedWeight, abi.QuantizedWeightParams): w[n, k] =
// values[n, k] * scales[n, k / group] + mins[n, k / group].
typedef struct {
    const void* values;  // bits 8: int8 [N, K]; bits 4: nibbles, 64-column blocks of 32 bytes
    const void* scales;  // [N, K / group] float16, or float32 where scales_f32
    const void* mins;    // the same, or NULL (+ 0)
    int64_t bits, group, scales_f32;  // bits 8 or 4; tiled also 6 (quantized_tiled.c)
    int64_t tiled;  // values, scales and mins in the tile layout instead (quantized_tiled.c)
    int64_t amx;    // tiled: bf16 x of QUANTIZED_AMX_MIN_ROWS rows on the tiles (quantized_amx.c)
    int64_t int8_x;  // tiled, one scale a row: 6+ bf16 rows of x as int8 (quantized_w8a8.c)
    int64_t precise;  // tiled: bf16 x to 16 bits (VNNI: two int8 passes), else int8 per 32 columns
} quantized_weight;

typedef struct {
    const bf16_t* weight;  // row-major [N, K], read only where there is no packed copy
    const bf16_t* tiles;   // the packed (tile layout) copy, or NULL
    const bf16_t* bias;    // [N] in the packed copy's column order, or NULL
    int64_t gated;         // a gate_up whose copy (and bias) interleave gate and up: SiLU fused
    quantized_weight quantized;  // read where its values are set (weight and tiles NULL)
    // LoRA adapters (layers/lora.py's LoraSlots, float32), or lora_a NULL: A [parts * slots *
    // rank, K], each part's slots side by side; B transposed [parts * slots * rank, N], its
    // scaling in it; part p covers lora_part_rows[p] of the N outputs, in order.
    const float* lora_a;
    const float* lora_bt;
    int64_t lora_parts, lora_slots, lora_rank;
    const int64_t* lora_part_rows;  // [lora_parts]
} projection;

typedef struct {
    const bf16_t *input_norm, *post_norm, *q_norm, *k_norm;  // q/k norms may be NULL
    projection qkv, o, gate_up, down;
    bf16_t *k_cache, *v_cache;  // this layer's pool: [slots, kv_heads, head_dim]
    int64_t window;             // 0: none
} decode_layer;

typedef struct {
    int64_t hidden, inter, num_heads, num_kv_heads, head_dim;
    float eps, scale;
    const float *cos, *sin;  // rotary tables [max_positions, head_dim]
    const int32_t* page_table;
    int64_t table_stride;
    int64_t gemv_max_rows;
    int64_t use_tiles;      // the packed matmuls on the AMX tiles, else vdpbf16ps
    int64_t max_positions;  // rows of cos/sin (0: unchecked)
    const int64_t* lora_slots;  // per token its adapter's slot (-1: none), or NULL: no adapter
} decode_model;

// common.c
void minisgl_fail_allocations(int64_t count);
int minisgl_has_avx512_bf16(void);
int minisgl_has_avx512(void);
int minisgl_has_avx2(void);
int minisgl_has_amx(void);
int minisgl_has_amx_int8(void);  // after minisgl_has_amx: the int8 tiles too
int minisgl_has_vnni(void);

// gemv.c
void minisgl_gemv_bf16(const bf16_t* x, const bf16_t* w, const bf16_t* bias, bf16_t* y,
                       int64_t M, int64_t N, int64_t K, int nthreads);

// packing.c
int64_t minisgl_packed_elems(int64_t N, int64_t K);
void minisgl_pack_weight(const bf16_t* w, bf16_t* packed, int64_t N, int64_t K, int nthreads);
int minisgl_packed_rows(const bf16_t* packed, const int64_t* ids, bf16_t* out, int64_t count,
                        int64_t N, int64_t K, int nthreads);

// matmul.c
int minisgl_packed_linear(const bf16_t* x, const bf16_t* packed, const bf16_t* bias, void* y,
                          int64_t M, int64_t N, int64_t K, int out_f32, int use_tiles,
                          int nthreads);
int minisgl_packed_gated_silu(const bf16_t* x, const bf16_t* packed, const bf16_t* bias,
                              bf16_t* y, int64_t M, int64_t inter, int64_t K, int use_tiles,
                              int nthreads);

// quantized.c: the quantized matmul's paths (minisgl_quantized_path: which one a call takes;
// kernel/abi.py's QUANTIZED_PATHS names them in this order).
enum {
    QPATH_GENERIC,        // any build: row by row, each weight row dequantized once
    QPATH_F32,            // AVX-512: up to 4 rows of float32 x
    QPATH_NIBBLES,        // avx512_bf16: 4 bits, up to 4 bf16 rows, nibbles as bf16 integers
    QPATH_WIDE,           // avx512_bf16: 5-16 bf16 rows, weights to bf16 in registers
    QPATH_BF16_BLOCK,     // avx512_bf16: more bf16 rows, K not whole 32s: GEMV blocks
    QPATH_PACKED,         // avx512_bf16: more bf16 rows: 32-row packed blocks
    QPATH_AVX2_ROWS,      // AVX2: up to 8 rows in float32
    QPATH_AVX2_INT16,     // AVX2: up to 8 bf16 rows as int16 per 32 columns (vpmaddwd)
    QPATH_AVX2_TILE,      // AVX2: more rows, 16-row blocks under a 6 x 16 FMA tile
    QPATH_TILED_F32,      // VNNI tile layout: float32 x against the tiles dequantized
    QPATH_TILED_PRECISE,  // VNNI tile layout, precise: bf16 rows in two int8 passes
    QPATH_TILED_INT8,     // VNNI tile layout: bf16 rows in one int8 pass (Q8_0's x)
    QPATH_TILED_AMX,      // AMX: a tiled weight from 10 bf16 rows, dequantized onto the tiles
    QPATH_TILED_W8A8,     // AMX-INT8: int8_x, 6+ bf16 rows as int8 per row on the int8 tiles
    QPATH_TILED_W8A8_VNNI,  // VNNI, no int8 tiles: int8_x, 6+ bf16 rows as int8 per row
    QPATH_AVX2_TILED_INT16,  // AVX2, tile layout: bf16 rows as int16 (vpmaddwd): 8 bits, any
                             // count; 4/6 bits precise, up to 64
    QPATH_AVX2_TILED_F32,    // AVX2, tile layout: float32 x, more 4/6-bit rows: tiles to float32
    QPATH_AVX2_TILED_INT8,   // AVX2, tile layout, 4/6 bits, not precise: up to 64 bf16 rows int8
    QPATH_COUNT
};
// Whether a weight of this layout (bits, group, tiled) and K columns is one the kernels take:
// the one rule every quantized entry point checks (kernel/quantized.py's quantized_fits).
int minisgl_quantized_fits(int64_t bits, int64_t group, int64_t K, int64_t tiled);
// The path of minisgl_quantized_linear for M rows of x (dtype code) against w; -1: none (the
// call would return MINISGL_ERR_SHAPE).
int minisgl_quantized_path(const quantized_weight* w, int64_t M, int64_t K, int x_dtype);
// How many calls took each path since the library loaded: out [QPATH_COUNT].
void minisgl_quantized_path_runs(int64_t* out);
int minisgl_quantized_linear(const void* x, const quantized_weight* w, const void* bias, void* y,
                             int64_t M, int64_t N, int64_t K, int x_dtype, int out_f32,
                             int nthreads);
int minisgl_quantized_rows(const quantized_weight* w, const int64_t* ids, void* out,
                           int64_t count, int64_t N, int64_t K, int dtype, int nthreads);
int minisgl_quantized_gated_silu(const bf16_t* x, const quantized_weight* w, bf16_t* y, int64_t M,
                                 int64_t inter, int64_t K, int nthreads);
int minisgl_quantized_packed(const quantized_weight* w, bf16_t* packed, int64_t N, int64_t K,
                             int gated, int nthreads);

// attention_decode.c
int minisgl_decode_attention(const void* q, const void* k_cache, const void* v_cache, void* out,
                             const int32_t* page_table, int64_t table_stride,
                             const int64_t* rows, const int64_t* kv_lens,
                             const int64_t* kv_starts, const float* prefix_out,
                             const float* prefix_lse, int64_t num_reqs, int64_t num_heads,
                             int64_t num_kv_heads, int64_t head_dim, float scale, int64_t window,
                             int dtype, int nthreads);

// attention_blocked.c
int minisgl_shared_prefix_attention(const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache,
                                    const int64_t* slots, int64_t prefix_len, float* out,
                                    float* lse, int64_t tokens, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t dim, float scale, int use_tiles,
                                    int nthreads);
int minisgl_prefill_attention(const bf16_t* q, const bf16_t* k_cache, const bf16_t* v_cache,
                              bf16_t* out, const int32_t* page_table, int64_t table_stride,
                              const int64_t* rows, const int64_t* cached_lens,
                              const int64_t* extend_lens, int64_t num_reqs, int64_t num_heads,
                              int64_t num_kv_heads, int64_t dim, float scale, int64_t window,
                              int use_tiles, int nthreads);

// elementwise.c
void minisgl_add_rms_norm(const void* x, const void* residual, const void* weight, void* out,
                          void* residual_out, int64_t rows, int64_t hidden, float eps, int dtype,
                          int nthreads);
void minisgl_silu_and_mul(const void* gate_up, void* out, int64_t rows, int64_t inter,
                          int dtype, int nthreads);
int minisgl_rotary(void* x, int64_t tokens, int64_t token_stride, int64_t heads, int64_t dim,
                   const int64_t* positions, const float* cos_table, const float* sin_table,
                   int64_t max_positions, int dtype, int nthreads);

// sampling.c
void minisgl_argmax(const void* x, int64_t* indices, int64_t rows, int64_t cols, int dtype,
                    int nthreads);
void minisgl_sample_rows(const float* x, const float* temperatures, const double* uniforms,
                         int64_t* tokens, int64_t rows, int64_t cols, int nthreads);
int minisgl_top_candidates(const float* x, int64_t rows, int64_t cols, int64_t k, float* values,
                           int64_t* indices, int nthreads);
void minisgl_tempered_softmax(const float* x, const float* temperatures, float* out,
                              int64_t rows, int64_t cols, int normalize, int nthreads);
int minisgl_mask_disallowed(void* logits, int64_t logits_rows, const int64_t* rows,
                            const int32_t* bitmask, int64_t n, int64_t cols, int64_t words,
                            int dtype, int nthreads);
void minisgl_flag_non_finite(const void* logits, const int32_t* sampled, int32_t* next,
                             int32_t* pool, int64_t rows, int64_t cols, int dtype);

// fused_layer.c
int minisgl_decode_attention_block(const void* qkv, void* q_buf, void* out, const void* q_norm,
                                   const void* k_norm, float eps, void* k_cache, void* v_cache,
                                   const int64_t* out_loc, const int64_t* positions,
                                   const float* cos, const float* sin, int64_t max_positions,
                                   const int32_t* page_table, int64_t table_stride,
                                   const int64_t* rows, const int64_t* kv_lens, int64_t tokens,
                                   int64_t num_heads, int64_t num_kv_heads, int64_t dim,
                                   float scale, int64_t window, int dtype, int nthreads);
int minisgl_prefill_attention_block(const void* qkv, bf16_t* q_buf, bf16_t* out, const void* q_norm,
                                    const void* k_norm, float eps, bf16_t* k_cache,
                                    bf16_t* v_cache, const int64_t* out_loc,
                                    const int64_t* positions, const float* cos, const float* sin,
                                    int64_t max_positions, const int32_t* page_table,
                                    int64_t table_stride, const int64_t* rows,
                                    const int64_t* cached_lens, const int64_t* extend_lens,
                                    int64_t num_reqs, int64_t tokens, int64_t num_heads,
                                    int64_t num_kv_heads, int64_t dim, float scale,
                                    int64_t window, int use_tiles, int nthreads);
int64_t minisgl_decode_layer_scratch(const decode_model* m, int64_t tokens);
int64_t minisgl_decode_layer_q_offset(const decode_model* m, int64_t tokens);
int minisgl_decode_layer_begin(const decode_layer* L, const decode_model* m, const bf16_t* x,
                                bf16_t* residual, int has_residual, bf16_t* scratch,
                                int64_t tokens, const int64_t* positions, const int64_t* out_loc,
                                int nthreads);
int minisgl_decode_layer_end(const decode_layer* L, const decode_model* m, bf16_t* residual,
                              bf16_t* out, bf16_t* scratch, int64_t tokens, const int64_t* rows,
                              const int64_t* kv_lens, const int64_t* kv_starts,
                              const float* prefix_out, const float* prefix_lse, int nthreads);
int minisgl_lora_add(const bf16_t* x, bf16_t* y, int64_t tokens, int64_t N, int64_t K,
                     const projection* p, const int64_t* slots, int nthreads);
int minisgl_decode_layers(const decode_layer* layers, int64_t num_layers, const decode_model* m,
                          const bf16_t* x, bf16_t* residual, bf16_t* out, bf16_t* scratch,
                          int64_t tokens, const int64_t* positions, const int64_t* rows,
                          const int64_t* kv_lens, const int64_t* out_loc, int nthreads);
