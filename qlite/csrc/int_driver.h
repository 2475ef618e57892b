/* The integer-activation product's driver, the same in both kernel files (kernels.c, kernels_avx2.c; int4
 * weights in a file that defines INT4_LANES go to its int4_lanes_product instead):
 * activations quantized once (int8 for int4 weights, int16 for int8 ones), then blocks of ROWS weight rows
 * (split over OpenMP threads) against XTILE activation rows at a time. Each file defines, before including
 * this, quantize_activations_int16 (and _int8 unless INT4_LANES), XTILE and
 *   int_block(xq, xs, xsum, K, G, w, scales, sw, sz, int4, small, nrows, mrows, out)   out [ROWS * XTILE]
 * (always inline: the constant arguments below specialise it). */

/* codes [N, K] (int8) or [N, K/2] (int4) row-major, as stored -> dst laid out as int8_tiled / int4_tiled
 * (common.h) read them, or int4 codes as the file's INT4_LANES layout has them; native.tile_codes */
void qlite_tile_codes(const uint8_t *src, uint8_t *dst, long N, long K, int int4, int threads) {
#ifdef INT4_LANES
    if (int4) { tile_int4_lanes(src, dst, N, K, threads); return; }  /* the file's own int4 layout */
#endif
    long C = K / CHUNK, step = int4 ? CHUNK / 2 : CHUNK, row_bytes = C * step;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n += ROWS) {
        int nrows = N - n < ROWS ? (int)(N - n) : ROWS;
        for (long c = 0; c < C; c++)
            for (int r = 0; r < nrows; r++)
                memcpy(dst + n * row_bytes + (c * nrows + r) * step, src + (n + r) * row_bytes + c * step, step);
    }
}

/* int4: w uint8 [N, K/2] tiled (common.h's int4_tiled), zeros uint8 [N, G]; int8: w int8 [N, K] tiled, zeros NULL; scales fp16 [N, G] (int4k: uint8
 * codes under row_scales fp16 [N], block_fp16_scales; else row_scales NULL) */
void qlite_gemv_vnni(const uint16_t *x, long M, const void *w, const void *scales, const uint16_t *row_scales,
                     const uint8_t *zeros, int int4, long G, long N, long K, const float *bias, void *y, int out_bf16,
                     int threads) {
#ifdef INT4_LANES
    if (int4) { int4_lanes_product(x, M, w, scales, row_scales, zeros, G, N, K, bias, y, out_bf16, threads); return; }
#endif
    long C = K / CHUNK, wbytes = int4 ? K / 2 : K, xbytes = int4 ? 1 : 2;
    int small = G > C;  /* groups of 32 or 64 (native.py checks) */
    void *xq = malloc(xbytes * M * K);
    float *xs = malloc(sizeof(float) * M * C * 16), *xsum = malloc(sizeof(float) * M * G);
#ifndef INT4_LANES
    if (int4) quantize_activations_int8(x, M, K, G, xq, xs, xsum); else
#endif
    quantize_activations_int16(x, M, K, xq, xs);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n += ROWS) {
        int nrows = N - n < ROWS ? (int)(N - n) : ROWS;
        uint16_t room[ROWS * MAX_GROUPS];
        const uint16_t *sn = block_fp16_scales(scales, row_scales, n, G, nrows, room);
        const void *wn = (const uint8_t *)w + n * wbytes;
        float sw[ROWS][MAX_GROUPS], sz[ROWS][MAX_GROUPS];
        block_scales(sn, int4 ? zeros + n * G : NULL, G, nrows, sw, sz);
        for (long m0 = 0; m0 < M; m0 += XTILE) {
            int mrows = M - m0 < XTILE ? (int)(M - m0) : XTILE;
            float out[ROWS * XTILE];
            const void *xm = (const uint8_t *)xq + m0 * K * xbytes;
            const float *xsm = xs + m0 * C * 16, *xsumm = xsum + m0 * G;
            /* constant arguments for the common shapes: the compiler specialises each */
            #define INT_BLOCK(NR, MR) do { \
                if (int4 && small) int_block(xm, xsm, xsumm, K, G, wn, sn, sw, sz, 1, 1, NR, MR, out); \
                else if (int4) int_block(xm, xsm, xsumm, K, G, wn, sn, sw, sz, 1, 0, NR, MR, out); \
                else if (small) int_block(xm, xsm, xsumm, K, G, wn, sn, sw, sz, 0, 1, NR, MR, out); \
                else int_block(xm, xsm, xsumm, K, G, wn, sn, sw, sz, 0, 0, NR, MR, out); } while (0)
            /* every row count below XTILE too: speculative decoding verifies 2-8 tokens a pass (speculate.py) */
            if (nrows == ROWS && mrows == XTILE) INT_BLOCK(ROWS, XTILE);
            else if (nrows == ROWS && mrows == 1) INT_BLOCK(ROWS, 1);
#if XTILE > 3
            else if (nrows == ROWS && mrows == 2) INT_BLOCK(ROWS, 2);
            else if (nrows == ROWS && mrows == 3) INT_BLOCK(ROWS, 3);
#endif
            else int_block(xm, xsm, xsumm, K, G, wn, sn, sw, sz, int4, small, nrows, mrows, out);
            #undef INT_BLOCK
            for (int r = 0; r < nrows; r++)
                for (int m = 0; m < mrows; m++)
                    store(y, out_bf16, (m0 + m) * N + n + r, out[r * XTILE + m] + (bias ? bias[n + r] : 0.f));
        }
    }
    free(xq);
    free(xs);
    free(xsum);
}
