/* int3k and int2k weights (formats.py), the same in both kernel files: codes 128 inputs a block, in 16 * bits
 * bytes: 32 bytes of their low two bits (byte i: inputs i + 32 t in bits 2 t, 2 t + 1, so one shift and mask
 * give 32 consecutive inputs), then int3's 16 bytes of high bits (byte i: input i + 16 j in bit j); scales
 * uint8 [N, G] each c << bits | z, row_scales fp16 [N]: w = (q - z) * fp16(d * c).
 * Each file defines, before including this:
 *   lowbit_act, to_lowbit_act(bf16)   the activations as its rows function takes them
 *   lowbit_rows(x, s32, w, row_bytes, bits, K, G, nrows, out)   out[r] = sum_k q s x over
 *     the rows' codes w (row_bytes apart) against one activation row x, s32 [ROWS][LOWBIT_MAX_GROUPS] the rows'
 *     group scales in fp32 (LOWBIT_MAX_GROUPS: common.h) */
static inline float lowbit_scale(uint16_t d, uint8_t byte, int bits) {  /* formats.coded_scale: fp16(d * c) */
    return _cvtsh_ss(_cvtss_sh(_cvtsh_ss(d) * (float)(byte >> bits), _MM_FROUND_TO_NEAREST_INT));
}

/* the code of input i (0..127) of a block */
static inline int lowbit_code(const uint8_t *block, int bits, int i) {
    int q = (block[i % 32] >> (2 * (i / 32))) & 3;
    return bits == 3 ? q | ((block[32 + i % 16] >> (i / 16)) & 1) << 2 : q;
}

static inline __attribute__((always_inline)) void lowbit_block(
        const lowbit_act *xa, const float *xsum, const uint8_t *w, const uint8_t *scales, const uint16_t *row_scales,
        const int bits, long K, long G, const int nrows, float *out) {
    float s32[ROWS][LOWBIT_MAX_GROUPS], corr[ROWS];
    long row_bytes = K / 8 * bits;
    for (int r = 0; r < nrows; r++) {  /* corr = sum_g s z xsum */
        corr[r] = 0.f;
        for (long g = 0; g < G; g++) {
            uint8_t byte = scales[r * G + g];
            s32[r][g] = lowbit_scale(row_scales[r], byte, bits);
            corr[r] += s32[r][g] * (float)(byte & ((1 << bits) - 1)) * xsum[g];
        }
    }
    lowbit_rows(xa, s32, w, row_bytes, bits, K, G, nrows, out);
    for (int r = 0; r < nrows; r++) out[r] -= corr[r];
}

/* x bf16 [M, K] -> y [M, N] (+ bias) */
void qlite_gemv_lowbit(const uint16_t *x, long M, const uint8_t *w, const uint8_t *scales, const uint16_t *row_scales,
                       int bits, long G, long N, long K, const float *bias, void *y, int out_bf16, int threads) {
    long row_bytes = K / 8 * bits;
    lowbit_act *xa = malloc(sizeof(lowbit_act) * M * K);
    float *xsum = malloc(sizeof(float) * M * G);
    for (long m = 0; m < M; m++) {
        for (long k = 0; k < K; k++) xa[m * K + k] = to_lowbit_act(x[m * K + k]);
        group_sums(x + m * K, K, G, xsum + m * G);  /* drivers.h */
    }
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n += ROWS) {
        int nrows = N - n < ROWS ? (int)(N - n) : ROWS;
        const uint8_t *wn = w + n * row_bytes, *sn = scales + n * G;
        for (long m = 0; m < M; m++) {
            float out[ROWS];
            const lowbit_act *xm = xa + m * K;
            const float *sm = xsum + m * G;
            if (bits == 3 && nrows == ROWS) lowbit_block(xm, sm, wn, sn, row_scales + n, 3, K, G, ROWS, out);
            else if (bits == 3) lowbit_block(xm, sm, wn, sn, row_scales + n, 3, K, G, nrows, out);
            else if (nrows == ROWS) lowbit_block(xm, sm, wn, sn, row_scales + n, 2, K, G, ROWS, out);
            else lowbit_block(xm, sm, wn, sn, row_scales + n, 2, K, G, nrows, out);
            for (int r = 0; r < nrows; r++) store(y, out_bf16, m * N + n + r, out[r] + (bias ? bias[n + r] : 0.f));
        }
    }
    free(xa);
    free(xsum);
}

/* bf16 [N, K] (rounded to nearest even from the fp32 (q - z) * s) for prefill's matmul */
void qlite_dequantize_lowbit(const uint8_t *w, const uint8_t *scales, const uint16_t *row_scales, int bits, long G,
                             long N, long K, uint16_t *out, int threads) {
    long gsize = K / G, row_bytes = K / 8 * bits;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n++)
        for (long g = 0; g < G; g++) {
            uint8_t byte = scales[n * G + g];
            float s = lowbit_scale(row_scales[n], byte, bits), z = (float)(byte & ((1 << bits) - 1));
            for (long k = g * gsize; k < (g + 1) * gsize; k++) {
                const uint8_t *block = w + n * row_bytes + k / 128 * 16 * bits;
                out[n * K + k] = f32_to_bf16(((float)lowbit_code(block, bits, (int)(k % 128)) - z) * s);
            }
        }
}
