/* RMSNorm and SiLU * up of a decode step, the same in both kernel files over rows.h's vector vocabulary
 * and, defined before including this, load_bf16 / round_bf16 (VW bf16 -> fp32, fp32 rounded to bf16),
 * vmul, vdiv, vsub, vexp and vstore_bf16 (VW fp32 -> bf16, nearest even). */

/* rows of x (bf16, n wide, n % 16 == 0) -> bf16(bf16(x * rsqrt(mean(x^2) + eps)) * w), as torch computes it */
void qlite_rmsnorm(const uint16_t *x, long rows, long n, const uint16_t *w, float eps, uint16_t *out) {
    for (long r = 0; r < rows; r++) {
        const uint16_t *xr = x + r * n;
        vec ss = vzero();
        for (long i = 0; i < n; i += VW) { vec v = load_bf16(xr + i); ss = vfma(v, v, ss); }
        vec inv = vset1(1.f / __builtin_sqrtf(vsum(ss) / n + eps));
        for (long i = 0; i < n; i += VW)
            vstore_bf16(out + r * n + i, vmul(round_bf16(vmul(load_bf16(xr + i), inv)), load_bf16(w + i)));
    }
}

/* rows of [gate | up] (bf16, 2n wide) -> bf16(bf16(silu(gate)) * up), n % 16 == 0 */
void qlite_silu_mul(const uint16_t *gate_up, long rows, long n, uint16_t *out) {
    for (long r = 0; r < rows; r++)
        for (long i = 0; i < n; i += VW) {
            vec g = load_bf16(gate_up + r * 2 * n + i), u = load_bf16(gate_up + r * 2 * n + n + i);
            vec silu = vdiv(g, vadd(vset1(1.f), vexp(vsub(vzero(), g))));
            vstore_bf16(out + r * n + i, vmul(round_bf16(silu), u));
        }
}
