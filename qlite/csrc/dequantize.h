/* Dequantization to bf16 (rounded to nearest even from the fp32 value) for prefill's bf16 matmul, the
 * same loops in both kernel files; each defines dequantize_16_int8(w, scale, out) and
 * dequantize_32_int4(w, scale, zero, out) (16 bytes: 32 weights of one group) before including this. */

/* w row-major, as stored (the integer-activation products' tiled codes are never dequantized) */
void qlite_dequantize_int8(const int8_t *w, const uint16_t *scales, long G, long N, long K, uint16_t *out, int threads) {
    long gsize = K / G;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n++)
        for (long k = 0; k < K; k += 16)  /* 16 weights, inside one group */
            dequantize_16_int8(w + n * K + k, _cvtsh_ss(scales[n * G + k / gsize]), out + n * K + k);
}

void qlite_dequantize_int4(const uint8_t *w, const void *scales, const uint16_t *row_scales, const uint8_t *zeros,
                           long G, long N, long K, uint16_t *out, int threads) {
    long gsize = K / G;
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (long n = 0; n < N; n++) {
        uint16_t room[MAX_GROUPS];
        const uint16_t *sn = block_fp16_scales(scales, row_scales, n, G, 1, room);  /* int4k: coded scales made fp16 */
        for (long k = 0; k < K; k += 32)  /* 16 bytes = 32 weights, always inside one group */
            dequantize_32_int4(w + (n * K + k) / 2, _cvtsh_ss(sn[k / gsize]), (float)zeros[n * G + k / gsize], out + n * K + k);
    }
}
