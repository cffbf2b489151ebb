/* Vector helpers shared by the CPU attention kernels (paged_decode.c, paged_prefill.c).
 *
 * GCC/Clang vector extensions: 16 float32 lanes, one AVX-512 register (two AVX2 ones).
 * Built with -ffp-contract=off, so `a * b + c` is two roundings; fma16 is one.
 */
#ifndef EPD_CPU_SIMD_H
#define EPD_CPU_SIMD_H

#include <stdint.h>
#include <string.h>

typedef float v16f __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));

static inline float bits_to_f32(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* the sum of v's 16 lanes, folded in halves */
static inline float hsum16(v16f v) {
    v16f t = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v += t;
    t = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v += t;
    t = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v += t;
    return v[0] + v[1];
}

/* a * b + c with one rounding where the CPU has it (AVX-512), else two */
static inline v16f fma16(v16f a, v16f b, v16f c) {
#ifdef __AVX512F__
    return __builtin_ia32_vfmaddps512_mask(a, b, c, -1, 4);
#else
    return a * b + c;
#endif
}

/* lanes where mask is all ones take a, the others b */
static inline v16f select16(v16i mask, v16f a, v16f b) {
    return (v16f)(((v16i)a & mask) | ((v16i)b & ~mask));
}

static inline v16f splat16(float x) {
    return (v16f){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

/* the largest of v's 16 lanes, folded in halves */
static inline float hmax16(v16f v) {
    v16f t = __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
    v = select16(t > v, t, v);
    t = __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
    v = select16(t > v, t, v);
    t = __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
    v = select16(t > v, t, v);
    return v[0] > v[1] ? v[0] : v[1];
}

/* exp(x) for x <= 0, -inf included (1-2 ulp): 2^n * p(r), n = round(x / ln 2),
 * r = x - n ln 2 (ln 2 in two parts), p the degree-7 Cephes expf polynomial; 0 below
 * ln(FLT_MIN) */
static inline v16f vexp16(v16f x) {
    const v16f zero = {0};
    v16i dead = x < -87.33654f;
    v16f xc = select16(dead, zero - 87.0f, x);
    v16f n = fma16(xc, zero + 1.44269504f, zero + 12582912.0f) - 12582912.0f; /* rint */
    v16f r = fma16(n, zero - 0.693359375f, xc);
    r = fma16(n, zero + 2.12194440e-4f, r);
    v16f p = fma16(zero + 1.9875691500e-4f, r, zero + 1.3981999507e-3f);
    p = fma16(p, r, zero + 8.3334519073e-3f);
    p = fma16(p, r, zero + 4.1665795894e-2f);
    p = fma16(p, r, zero + 1.6666665459e-1f);
    p = fma16(p, r, zero + 5.0000001201e-1f);
    p = fma16(p, r * r, r) + 1.0f;
    v16i e = (__builtin_convertvector(n, v16i) + 127) << 23;
    return select16(dead, zero, p * (v16f)e);
}

/* round to nearest even bfloat16, kept as float32 (finite inputs) */
static inline v16f round_bf16_16(v16f x) {
    v16u b = (v16u)x;
    return (v16f)((b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u);
}

#endif
