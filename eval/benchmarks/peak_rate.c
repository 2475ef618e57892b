/* Instruction rates of one core, for eval.benchmarks.kernel_bench --peak: how many AVX-512 VNNI multiply-adds
 * (vpdpbusd zmm, 64 int8 products each) and float FMAs (vfmadd231ps zmm) it retires per nanosecond, alone and
 * interleaved 1:1 (whether they share execution units); on AVX2, vpmaddubsw ymm (32 products) alone and in
 * the int4 lanes product's mix, and vpmaddwd ymm (16 products) in the int8 one's (csrc/kernels_avx2.c: two
 * blocks of weight rows a pass, so a vpbroadcastd from memory feeds two multiplies, each added by a vpaddw or
 * vpaddd); on AVX-512 also vpdpwssd zmm (32 int16 products) with its inputs an embedded broadcast from memory,
 * as csrc/kernels.c's int8 product issues it. 12 (6 in the mixes) independent accumulators hide the latencies.
 * Built with -mavx512f -mavx512vnni; the caller runs only the kinds the CPU has. */
#include <immintrin.h>
#include <time.h>

static double seconds(void) { struct timespec t; clock_gettime(CLOCK_MONOTONIC, &t); return t.tv_sec + 1e-9 * t.tv_nsec; }

#define TWELVE(op) op(0) op(1) op(2) op(3) op(4) op(5) op(6) op(7) op(8) op(9) op(10) op(11)
#define DP(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n"
#define FMA(i) "vfmadd231ps %%zmm30, %%zmm31, %%zmm" #i "\n"
#define WSSD(i) "vpdpwssd %0%{1to16%}, %%zmm31, %%zmm" #i "\n"
#define MIX(i) "vpdpbusd %%zmm30, %%zmm31, %%zmm" #i "\n vfmadd231ps %%zmm30, %%zmm31, %%zmm1" #i "\n"
#define CLOBBER "zmm0", "zmm1", "zmm2", "zmm3", "zmm4", "zmm5", "zmm6", "zmm7", "zmm8", "zmm9", "zmm10", "zmm11", \
                "zmm12", "zmm13", "zmm14", "zmm15", "zmm16", "zmm17", "zmm18", "zmm19"

#define UBS(i) "vpmaddubsw %%ymm14, %%ymm15, %%ymm" #i "\n"
/* a broadcast (into a) for two blocks' multiplies (into b and a), each added into its sum (c, d) */
#define PAIR(op, add, a, b, c, d) "vpbroadcastd %0, %%ymm" #a "\n " op " %%ymm" #a ", %%ymm15, %%ymm" #b "\n " op \
    " %%ymm" #a ", %%ymm14, %%ymm" #a "\n " add " %%ymm" #b ", %%ymm" #c ", %%ymm" #c "\n " add " %%ymm" #a ", %%ymm" \
    #d ", %%ymm" #d "\n"
#define LANES(a, b, c, d) PAIR("vpmaddubsw", "vpaddw", a, b, c, d)
#define WORDS(a, b, c, d) PAIR("vpmaddwd", "vpaddd", a, b, c, d)
#define YCLOBBER "ymm0", "ymm1", "ymm2", "ymm3", "ymm4", "ymm5", "ymm6", "ymm7", "ymm8", "ymm9", "ymm10", "ymm11", \
                 "ymm12", "ymm13"

/* instructions per ns: kind 0 vpdpbusd, 1 vfmadd231ps, 2 both in turn (8 + 8 per round), 6 vpdpwssd with a
 * broadcast memory operand; AVX2: 3 vpmaddubsw, 4 vpmaddubsw in the int4 lanes mix, 5 vpmaddwd in the int8 lanes
 * mix (the multiplies counted) */
double qlite_peak_rate(int kind, long rounds) {
    static int word = 0x01010101;
    double t = seconds();
    if (kind >= 3 && kind <= 5) {
        __asm__ volatile("vpxor %%ymm14, %%ymm14, %%ymm14\n vpxor %%ymm15, %%ymm15, %%ymm15" ::: "ymm14", "ymm15");
        for (long n = 0; n < rounds; n++) {
            if (kind == 3) __asm__ volatile(TWELVE(UBS) ::: YCLOBBER);
            else if (kind == 4) __asm__ volatile(LANES(0, 1, 10, 11) LANES(2, 3, 12, 13) LANES(4, 5, 8, 9) :: "m"(word) : YCLOBBER);
            else __asm__ volatile(WORDS(0, 1, 10, 11) WORDS(2, 3, 12, 13) WORDS(4, 5, 8, 9) :: "m"(word) : YCLOBBER);
        }
        return (kind == 3 ? 12.0 : 6.0) * rounds / (seconds() - t) / 1e9;
    }
    __asm__ volatile("vpxord %%zmm30, %%zmm30, %%zmm30\n vpxord %%zmm31, %%zmm31, %%zmm31" ::: "zmm30", "zmm31");
    for (long n = 0; n < rounds; n++) {
        if (kind == 0) __asm__ volatile(TWELVE(DP) ::: CLOBBER);
        else if (kind == 1) __asm__ volatile(TWELVE(FMA) ::: CLOBBER);
        else if (kind == 6) __asm__ volatile(TWELVE(WSSD) :: "m"(word) : CLOBBER);
        else __asm__ volatile(MIX(0) MIX(1) MIX(2) MIX(3) MIX(4) MIX(5) MIX(6) MIX(7) ::: CLOBBER);
    }
    return (kind == 2 ? 16.0 : 12.0) * rounds / (seconds() - t) / 1e9;
}
