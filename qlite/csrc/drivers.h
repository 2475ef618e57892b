/* The bf16 and int8 matrix-vector products' loops over blocks of ROWS weight rows (split over OpenMP
 * threads), the same in both kernel files (kernels.c, kernels_avx2.c): each defines
 *   bf16_rows(x, w, K, nrows, out)              x bf16 [K], w bf16 [nrows, K]
 *   int8_rows(x, w, scales, K, G, nrows, out)   x fp32 [K], w int8 [nrows, K], scales fp16 [nrows, G]
 *   int4_rows(xe, xo, xsum, w, scales, zeros, K, G, nrows, out)   xe/xo: one row's even and odd activations
 *                                               as int4_act (to_int4_act of bf16), xsum: its groups' sums
 * (out[r] = the product with weight row r), then includes this. Also int4k's fp16 scales of a block
 * (block_fp16_scales), which the integer-activation products take too. */

void qlite_gemv_bf16(const uint16_t *x, long M, const uint16_t *w, long N, long K, const float *bias,
                     void *y, int out_bf16, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n += ROWS) {
        int nrows = N - n < ROWS ? (int)(N - n) : ROWS;
        for (long m = 0; m < M; m++) {
            float out[ROWS];
            if (nrows == ROWS) bf16_rows(x + m * K, w + n * K, K, ROWS, out); else bf16_rows(x + m * K, w + n * K, K, nrows, out);
            for (int r = 0; r < nrows; r++) store(y, out_bf16, m * N + n + r, out[r] + (bias ? bias[n + r] : 0.f));
        }
    }
}

void qlite_gemv_int8(const uint16_t *x, long M, const int8_t *w, const uint16_t *scales, long G, long N, long K,
                     const float *bias, void *y, int out_bf16, int threads) {
    float *xf = malloc(sizeof(float) * M * K);  /* activations in fp32, read by every row */
    for (long i = 0; i < M * K; i++) xf[i] = bf16_to_f32(x[i]);
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n += ROWS) {
        int nrows = N - n < ROWS ? (int)(N - n) : ROWS;
        for (long m = 0; m < M; m++) {
            float out[ROWS];
            if (nrows == ROWS) int8_rows(xf + m * K, w + n * K, scales + n * G, K, G, ROWS, out); else int8_rows(xf + m * K, w + n * K, scales + n * G, K, G, nrows, out);
            for (int r = 0; r < nrows; r++) store(y, out_bf16, m * N + n + r, out[r] + (bias ? bias[n + r] : 0.f));
        }
    }
    free(xf);
}

/* int4's group scales [nrows, G] of the rows n.. of a block: the fp16 scales [N, G] themselves, or, with
 * row_scales (int4k), scales' uint8 codes c [N, G] made into fp16(d * c), d the row's fp16 scale, in `room`
 * (formats.coded_scale: the same fp32 product, rounded to nearest even). */
static inline const uint16_t *block_fp16_scales(const void *scales, const uint16_t *row_scales, long n, long G,
                                                int nrows, uint16_t *room) {
    if (!row_scales) return (const uint16_t *)scales + n * G;
    const uint8_t *codes = (const uint8_t *)scales + n * G;
    for (int r = 0; r < nrows; r++) {
        float d = _cvtsh_ss(row_scales[n + r]);
        long g = 0;
        for (; g + 8 <= G; g += 8) {
            __m256 c = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(codes + r * G + g))));
            _mm_storeu_si128((__m128i *)(room + r * G + g), _mm256_cvtps_ph(_mm256_mul_ps(_mm256_set1_ps(d), c), _MM_FROUND_TO_NEAREST_INT));
        }
        for (; g < G; g++) room[r * G + g] = _cvtss_sh(d * (float)codes[r * G + g], _MM_FROUND_TO_NEAREST_INT);
    }
    return room;
}

/* xsum [G]: the sums of one activation row x bf16 [K] over each of its G groups (the zero points' term) */
static void group_sums(const uint16_t *x, long K, long G, float *xsum) {
    long gsize = K / G;
    for (long g = 0; g < G; g++) {
        float s = 0.f;
        for (long k = g * gsize; k < (g + 1) * gsize; k++) s += bf16_to_f32(x[k]);
        xsum[g] = s;
    }
}

/* int4 weights with bf16 activations: w uint8 [N, K/2], zeros uint8 [N, G], scales fp16 [N, G] (int4k: uint8
 * codes under row_scales, block_fp16_scales) */
void qlite_gemv_int4(const uint16_t *x, long M, const uint8_t *w, const void *scales, const uint16_t *row_scales,
                     const uint8_t *zeros, long G, long N, long K, const float *bias, void *y, int out_bf16, int threads) {
    long half = K / 2;
    int4_act *xe = malloc(sizeof(int4_act) * M * K);  /* (M, 2, K/2): even then odd activations */
    float *xsum = malloc(sizeof(float) * M * G);
    for (long m = 0; m < M; m++) {
        for (long i = 0; i < half; i++) {
            xe[m * K + i] = to_int4_act(x[m * K + 2 * i]);
            xe[m * K + half + i] = to_int4_act(x[m * K + 2 * i + 1]);
        }
        group_sums(x + m * K, K, G, xsum + m * G);
    }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n += ROWS) {
        int nrows = N - n < ROWS ? (int)(N - n) : ROWS;
        uint16_t room[ROWS * MAX_GROUPS];
        const uint16_t *sn = block_fp16_scales(scales, row_scales, n, G, nrows, room);
        for (long m = 0; m < M; m++) {
            float out[ROWS];
            const int4_act *xm = xe + m * K;
            const float *sm = xsum + m * G;
            if (nrows == ROWS) int4_rows(xm, xm + half, sm, w + n * half, sn, zeros + n * G, K, G, ROWS, out);
            else int4_rows(xm, xm + half, sm, w + n * half, sn, zeros + n * G, K, G, nrows, out);
            for (int r = 0; r < nrows; r++) store(y, out_bf16, m * N + n + r, out[r] + (bias ? bias[n + r] : 0.f));
        }
    }
    free(xe);
    free(xsum);
}
