/* The integer-activation matrix-matrix product for prefill (many rows) of the AVX2 kernels (kernels_avx2.c;
 * kernels.c's int4 product in lanes computes the same numbers at every row count); int4 weights. The matrix-vector kernel (int_driver.h) keeps each dot product
 * in the lanes of one vector and reduces them at the end, which costs float work per 8 inputs; here a
 * vector's lanes are LANES activation rows, so an integer multiply-add vector advances LANES dot products
 * by 4 inputs, and a SPAN of inputs (the weight group, at most CHUNK) is summed in integers first:
 *   activations x bf16 [M, K] -> xq uint8 [Mp/LANES, K/4, LANES, 4] = 128 + round(x / xs) (absmax / 127 per
 *     row and span, like the matrix-vector kernel's int8 but per SPAN inputs), xs fp32 [Mp/LANES, K/SPAN, LANES];
 *   a tile of ROWS weight rows, KC inputs at a time, unpacked to int8 (q - z) in k order (wq [ROWS, KC]), with
 *     wcorr = -128 sum (q - z) per span (the +128 of xq taken back) and the weight scale per span (wsc);
 *   y[m, n] = sum_span xs[m, span] wsc[n, span] (wcorr[n, span] + sum_k xq[m, k] wq[n, k])   (exact integers
 *     inside a span; the stored weights (q - z) s exactly, times x's integer image).
 * Blocking: threads take NB weight rows at a time; inputs go in blocks of KC (the activations' block,
 * MB x KC bytes, stays in L2 across the NB rows); activation rows in blocks of MB. Each file defines,
 * before including this: LANES, MV (activation vectors per tile), absmax_bf16(p, n), quantize_u8(p, inv, out)
 * (QUANTIZE_STEP inputs to 128 + round(x inv)), unpack_64_int4 and
 *   gemm_tile(xq, xs, K, span, k0, kc, wq, wcorr, wsc, mv, acc, Mp)   acc fp32 [ROWS, Mp] += the tile */
#define NB 64  /* weight rows a thread takes at a time */
#define KC 512  /* inputs per block */
#define MB 512  /* activation rows per block */

/* int8 (q - z) of nrows rows from input k0, kc inputs (multiples of 64), in k order, with wcorr per span
 * (unpack_64_int4: the ISA's 64 inputs of one row); rows nrows..ROWS - 1 zero */
static inline void unpack_int4_tile(const uint8_t *w, const uint8_t *zeros, long K, long G, long span, long k0, long kc,
                                    int nrows, int8_t *wq, int32_t *wcorr) {
    long gsize = K / G, spans = kc / span;
    for (int r = 0; r < ROWS; r++) {
        for (long s = 0; s < spans; s++) wcorr[r * spans + s] = 0;
        if (r >= nrows) memset(wq + r * kc, 0, kc);
        for (long k = 0; r < nrows && k < kc; k += 64) {
            long g = (k0 + k) / gsize;  /* groups of 32: this one and the next */
            int32_t sums[2];
            _mm_prefetch((const char *)int4_tiled(w + ROWS * (K / 2), ROWS, r, k0 + k), _MM_HINT_T0);  /* the next tile's */
            unpack_64_int4(int4_tiled(w, nrows, r, k0 + k), zeros[r * G + g], zeros[r * G + (gsize == 32 ? g + 1 : g)],
                           wq + r * kc + k, sums);
            wcorr[r * spans + k / span] -= 128 * sums[0];
            wcorr[r * spans + (k + 32) / span] -= 128 * sums[1];
        }
    }
}

/* x bf16 [rows, K] -> xq, xs as laid out above; rows rows..Mp - 1 zero (xq 128, xs 0) */
static void quantize_gemm_activations(const uint16_t *x, long rows, long Mp, long K, long span, uint8_t *xq, float *xs,
                                      int threads) {
    long S = K / span;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long m = 0; m < Mp; m++) {
        uint8_t *dst = xq + (m / LANES) * K * LANES + (m % LANES) * 4;  /* input k at dst[(k / 4) LANES 4 + k % 4] */
        float *scale = xs + (m / LANES) * S * LANES + m % LANES;
        for (long s = 0; s < S; s++) {
            const uint16_t *src = x + m * K + s * span;
            float amax = m < rows ? absmax_bf16(src, span) : 0.f, inv = amax > 0.f ? 127.f / amax : 0.f;
            scale[s * LANES] = amax / 127.f;
            for (long k = 0; k < span; k += QUANTIZE_STEP) {
                uint8_t q[QUANTIZE_STEP];
                if (m < rows) quantize_u8(src + k, inv, q); else memset(q, 128, QUANTIZE_STEP);
                for (int i = 0; i < QUANTIZE_STEP / 4; i++) memcpy(dst + ((s * span + k) / 4 + i) * LANES * 4, q + 4 * i, 4);
            }
        }
    }
}

/* w: int4 codes [N, K/2] tiled (common.h's int4_tiled), zeros uint8 [N, G], scales fp16 [N, G] (int4k: uint8 codes under row_scales) */
void qlite_gemm_int4(const uint16_t *x, long M, const uint8_t *w, const void *scales, const uint16_t *row_scales,
                     const uint8_t *zeros, long G, long N, long K, const float *bias, void *y, int out_bf16, int threads) {
    long gsize = K / G, span = gsize < CHUNK ? gsize : CHUNK;
    for (long mb = 0; mb < M; mb += MB) {
        long rows = M - mb < MB ? M - mb : MB, Mp = (rows + LANES - 1) / LANES * LANES;
        uint8_t *xq = aligned_alloc(64, Mp * K);
        float *xs = aligned_alloc(64, sizeof(float) * Mp * (K / span));
        quantize_gemm_activations(x + mb * K, rows, Mp, K, span, xq, xs, threads);
        #pragma omp parallel num_threads(threads)
        {
            float *acc = aligned_alloc(64, sizeof(float) * NB * Mp);
            int8_t *wq = aligned_alloc(64, ROWS * KC);
            int32_t wcorr[ROWS * KC / 32];
            float wsc[ROWS * KC / 32];
            uint16_t room[ROWS * MAX_GROUPS];
            float sw[ROWS][MAX_GROUPS], sz[ROWS][MAX_GROUPS];
            #pragma omp for schedule(static)
            for (long nb = 0; nb < N; nb += NB) {
                int nbrows = N - nb < NB ? (int)(N - nb) : NB;
                memset(acc, 0, sizeof(float) * NB * Mp);
                for (long k0 = 0; k0 < K; k0 += KC) {
                    long kc = K - k0 < KC ? K - k0 : KC;
                    for (int t = 0; t < nbrows; t += ROWS) {
                        long n = nb + t;
                        int nrows = nbrows - t < ROWS ? nbrows - t : ROWS;
                        const uint16_t *sn = block_fp16_scales(scales, row_scales, n, G, nrows, room);
                        block_scales(sn, NULL, G, nrows, sw, sz);
                        unpack_int4_tile(w + n * (K / 2), zeros + n * G, K, G, span, k0, kc, nrows, wq, wcorr);
                        for (int r = 0; r < ROWS; r++)
                            for (long s = 0; s < kc / span; s++) wsc[r * (kc / span) + s] = r < nrows ? sw[r][(k0 + s * span) / gsize] : 0.f;
                        float *tile = acc + t * Mp;
                        for (long m0 = 0; m0 < Mp; ) {
                            int mv = (Mp - m0) / LANES < MV ? (int)((Mp - m0) / LANES) : MV;
                            gemm_tile(xq + m0 * K, xs + m0 * (K / span), K, span, k0, kc, wq, wcorr, wsc, mv, tile + m0, Mp);
                            m0 += mv * LANES;
                        }
                    }
                }
                for (long m = 0; m < rows; m++)
                    for (int t = 0; t < nbrows; t++)
                        store(y, out_bf16, (mb + m) * N + nb + t, acc[t * Mp + m] + (bias ? bias[nb + t] : 0.f));
            }
            free(acc);
            free(wq);
        }
        free(xq);
        free(xs);
    }
}
