/* The int8 integer-activation product of a kernel file without int8 in lanes (kernels.c; lanes.h, included
 * after this, calls it): int8 weights tiled by chunks (common.h's int8_tiled) meet int16 activations quantized
 * once (a scale per 8 inputs), then blocks of ROWS weight rows (split over OpenMP threads) against XTILE
 * activation rows at a time. The file defines, before including this, quantize_activations_int16, XTILE and
 *   int_block(xq, xs, K, G, w, sw, small, nrows, mrows, out)   out [ROWS * XTILE]
 * (always inline: the constant arguments below specialise it). */

/* int8 codes [N, K] row-major, as stored -> common.h's int8_tiled (qlite_tile_codes) */
static void tile_int8_chunks(const uint8_t *src, uint8_t *dst, long N, long K, int threads) {
    long C = K / CHUNK;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n += ROWS) {
        int nrows = N - n < ROWS ? (int)(N - n) : ROWS;
        for (long c = 0; c < C; c++)
            for (int r = 0; r < nrows; r++)
                memcpy(dst + n * K + (c * nrows + r) * CHUNK, src + (n + r) * K + c * CHUNK, CHUNK);
    }
}

/* the fp32 weight scales of the nrows rows of a block */
static inline void block_scales(const uint16_t *scales, long G, int nrows, float (*sw)[MAX_GROUPS]) {
    for (int r = 0; r < nrows; r++) {
        long g = 0;
        for (; g + 8 <= G; g += 8)  /* 8 at a time (F16C) */
            _mm256_storeu_ps(sw[r] + g, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(scales + r * G + g))));
        for (; g < G; g++) sw[r][g] = _cvtsh_ss(scales[r * G + g]);
    }
}

/* w int8 [N, K] tiled (common.h's int8_tiled), scales fp16 [N, G]; y [M, N] */
static void int8_chunks_product(const uint16_t *x, long M, const void *w, const void *scales, long G, long N, long K,
                                const float *bias, void *y, int out_bf16, int threads) {
    long C = K / CHUNK;
    int small = G > C;  /* groups of 32 or 64 (native.py checks) */
    int16_t *xq = malloc(sizeof(int16_t) * M * K);
    float *xs = malloc(sizeof(float) * M * C * 16);
    quantize_activations_int16(x, M, K, xq, xs);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n += ROWS) {
        int nrows = N - n < ROWS ? (int)(N - n) : ROWS;
        const int8_t *wn = (const int8_t *)w + n * K;
        float sw[ROWS][MAX_GROUPS];
        block_scales((const uint16_t *)scales + n * G, G, nrows, sw);
        for (long m0 = 0; m0 < M; m0 += XTILE) {
            int mrows = M - m0 < XTILE ? (int)(M - m0) : XTILE;
            float out[ROWS * XTILE];
            const int16_t *xm = xq + m0 * K;
            const float *xsm = xs + m0 * C * 16;
            /* constant arguments for the common shapes: the compiler specialises each */
            #define INT_BLOCK(NR, MR) do { \
                if (small) int_block(xm, xsm, K, G, wn, sw, 1, NR, MR, out); \
                else int_block(xm, xsm, K, G, wn, sw, 0, NR, MR, out); } while (0)
            /* every row count below XTILE too: speculative decoding verifies 2-8 tokens a pass (speculate.py) */
            if (nrows == ROWS && mrows == XTILE) INT_BLOCK(ROWS, XTILE);
            else if (nrows == ROWS && mrows == 1) INT_BLOCK(ROWS, 1);
#if XTILE > 3
            else if (nrows == ROWS && mrows == 2) INT_BLOCK(ROWS, 2);
            else if (nrows == ROWS && mrows == 3) INT_BLOCK(ROWS, 3);
#endif
            else int_block(xm, xsm, K, G, wn, sw, small, nrows, mrows, out);
            #undef INT_BLOCK
            for (int r = 0; r < nrows; r++)
                for (int m = 0; m < mrows; m++)
                    store(y, out_bf16, (m0 + m) * N + n + r, out[r * XTILE + m] + (bias ? bias[n + r] : 0.f));
        }
    }
    free(xq);
    free(xs);
}
