/* What qlite's kernels for each instruction set share (kernels.c: AVX-512, kernels_avx2.c: AVX2):
 * block sizes and the scalar bf16 conversions. */
#include <stdint.h>
#include <stdlib.h>
#include <math.h>
#include <string.h>

#define ROWS 4  /* weight rows per block: independent accumulator chains, activations loaded once */
#define AHEAD 8  /* prefetch the weights this many rows ahead */
#define TILE_AHEAD 8192  /* tiled codes (below): prefetch this many bytes ahead into L2; the hardware prefetchers
                          * alone streamed 7B's int4 down 0.63x and gate_up 0.92x as fast on Zen 4 */
#define MAX_GROUPS 1024  /* K / group_size; native.py checks it */
#define LOWBIT_MAX_GROUPS 2048  /* int3k / int2k (lowbit.h): K up to 32768 at groups of 16; native.py checks it */
#define CHUNK 128  /* the integer-activation kernels take x and the groups in whole chunks of this many inputs */

static inline float bf16_to_f32(uint16_t h) { uint32_t u = (uint32_t)h << 16; float f; memcpy(&f, &u, 4); return f; }

static inline uint16_t f32_to_bf16(float f) {  /* round to nearest even; NaN stays NaN */
    uint32_t u; memcpy(&u, &f, 4);
    if ((u & 0x7fffffff) > 0x7f800000) return (uint16_t)((u >> 16) | 0x40);
    return (uint16_t)((u + 0x7fff + ((u >> 16) & 1)) >> 16);
}

static inline void store(void *y, int out_bf16, long i, float v) {
    if (out_bf16) ((uint16_t *)y)[i] = f32_to_bf16(v); else ((float *)y)[i] = v;
}
