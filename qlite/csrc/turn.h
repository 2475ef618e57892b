/* qlite_turn_inputs: a rotated format's activations (formats.py Rotated): each block of 128 inputs of the bf16 rows
 * x [M, K] turned to R^T x = H (D x), signs D [128] (+-1), H the orthonormal Hadamard transform (butterflies in
 * float32, then times 1/sqrt(128)), rounded to bf16 in out [M, K]. The module path (native.Product) and the fused
 * step (decode_step.h product) both call it, so they agree bit for bit; a row's result is its own. */
#define TURN_BLOCK 128

void qlite_turn_inputs(const uint16_t *x, long M, long K, const float *signs, uint16_t *out, int threads) {
    long blocks = M * K / TURN_BLOCK;
    #pragma omp parallel for num_threads(threads) if (blocks >= 512)
    for (long b = 0; b < blocks; b++) {
        float v[TURN_BLOCK];
        const uint16_t *in = x + b * TURN_BLOCK;
        for (int i = 0; i < TURN_BLOCK; i++) v[i] = bf16_to_f32(in[i]) * signs[i];
        for (int h = 1; h < TURN_BLOCK; h <<= 1)
            for (int i = 0; i < TURN_BLOCK; i += 2 * h)
                for (int j = i; j < i + h; j++) { float a = v[j], c = v[j + h]; v[j] = a + c; v[j + h] = a - c; }
        for (int i = 0; i < TURN_BLOCK; i++) out[b * TURN_BLOCK + i] = f32_to_bf16(v[i] * 0.08838834764831845f);
    }
}
