// The packed (tile-layout) copy of a bf16 weight [N, K] that the matmuls read (matmul.c
// describes the layout): its size, the packing, and rows read back from it.
#include "common.h"
#include "internal.h"

int64_t minisgl_packed_elems(int64_t N, int64_t K) {
    return (N + AMX_NBLOCK - 1) / AMX_NBLOCK * AMX_NBLOCK * ((K + AMX_KSTEP - 1) / AMX_KSTEP) *
           AMX_KSTEP;
}

void minisgl_pack_weight(const bf16_t* w, bf16_t* packed, int64_t N, int64_t K, int nthreads) {
    const int64_t nblocks = (N + AMX_NBLOCK - 1) / AMX_NBLOCK;
    const int64_t ksteps = (K + AMX_KSTEP - 1) / AMX_KSTEP;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t nb = 0; nb < nblocks; nb++) {
        bf16_t* dst = packed + nb * ksteps * AMX_NBLOCK * AMX_KSTEP;
        for (int64_t kb = 0; kb < ksteps; kb++)
            for (int tile = 0; tile < 2; tile++)
                for (int pair = 0; pair < 16; pair++)
                    for (int col = 0; col < 16; col++)
                        for (int e = 0; e < 2; e++) {
                            int64_t n = nb * AMX_NBLOCK + tile * 16 + col;
                            int64_t k = kb * AMX_KSTEP + 2 * pair + e;
                            *dst++ = n < N && k < K ? w[n * K + k] : 0;
                        }
    }
}

// ------------------------------------------------------------------ rows of a packed weight
// out[i] = w[ids[i]] ([count, K] bf16) from the packed (tile-layout) copy of a weight w [N, K]:
// a tied embedding looked up in its output head's copy, which is then the only one. Row n is
// column n % 16 of tile (n % 32) / 16 of block n / 32: one 4-byte k-pair every 64 bytes. Returns
// MINISGL_ERR_SHAPE (nothing written) for an id outside [0, N).
int minisgl_packed_rows(const bf16_t* packed, const int64_t* ids, bf16_t* out, int64_t count,
                        int64_t N, int64_t K, int nthreads) {
    for (int64_t i = 0; i < count; i++)
        if (ids[i] < 0 || ids[i] >= N) return MINISGL_ERR_SHAPE;
    const int64_t ksteps = (K + AMX_KSTEP - 1) / AMX_KSTEP;
    const int64_t block_elems = ksteps * AMX_NBLOCK * AMX_KSTEP;
#pragma omp parallel for num_threads(nthreads) schedule(static) if (count * K >= (1 << 16))
    for (int64_t i = 0; i < count; i++) {
        const int64_t n = ids[i];
        const bf16_t* column = packed + n / 32 * block_elems + n % 32 / 16 * 512 + n % 16 * 2;
        bf16_t* row = out + i * K;
        for (int64_t k = 0; k + 1 < K; k += 2)
            memcpy(row + k, column + k / 32 * 1024 + k % 32 * 16, 2 * sizeof(bf16_t));
        if (K % 2) row[K - 1] = column[(K - 1) / 32 * 1024 + (K - 1) % 32 * 16];
    }
    return MINISGL_OK;
}
