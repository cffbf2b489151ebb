/* Vector helpers of the LoRA kernel (lora.c): loads that widen bfloat16, adds in y's
 * dtype, and a 16x16 reduction. Needs cpu_simd.h first.
 */
#ifndef EPD_LORA_SIMD_H
#define EPD_LORA_SIMD_H

typedef uint16_t v16h __attribute__((vector_size(32)));

static inline v16f load16(const void *p, int64_t i, int bf16) {
    v16f v;
    if (bf16) {
        v16h h;
        memcpy(&h, (const uint16_t *)p + i, 32);
        v16u u = __builtin_convertvector(h, v16u) << 16;
        memcpy(&v, &u, 64);
    } else {
        memcpy(&v, (const float *)p + i, 64);
    }
    return v;
}

static inline float load1(const void *p, int64_t i, int bf16) {
    return bf16 ? bits_to_f32((uint32_t)((const uint16_t *)p)[i] << 16) : ((const float *)p)[i];
}

/* y[i] = y[i] + round(d[i]) in y's dtype (one rounding of the sum for bfloat16) */
static inline void add16(void *y, int64_t i, v16f d, int bf16) {
    if (bf16) {
        v16f sum = load16(y, i, 1) + round_bf16_16(d);
        v16h out = __builtin_convertvector(((v16u)round_bf16_16(sum)) >> 16, v16h);
        memcpy((uint16_t *)y + i, &out, 32);
    } else {
        v16f sum = load16(y, i, 0) + d;
        memcpy((float *)y + i, &sum, 64);
    }
}

static inline void add1(void *y, int64_t i, float d, int bf16) {
    if (bf16) {
        v16f v = round_bf16_16(splat16(load1(y, i, 1)) + round_bf16_16(splat16(d)));
        ((uint16_t *)y)[i] = (uint16_t)(((v16u)v)[0] >> 16);
    } else {
        ((float *)y)[i] += d;
    }
}

/* lane i of the result = the sum of the 16 lanes of v[i]: halves of pairs added, then
 * quarters, eighths and pairs of lanes, which leaves the sums in bit-reversed order */
static inline v16f reduce16x16(const v16f *v) {
    v16f u[8], w[4], z[2];
    for (int i = 0; i < 8; i++)
        u[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18,
                                       19, 20, 21, 22, 23) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24,
                                       25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; i++)
        w[i] = __builtin_shufflevector(u[2 * i], u[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9,
                                       10, 11, 24, 25, 26, 27) +
               __builtin_shufflevector(u[2 * i], u[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13,
                                       14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; i++)
        z[i] = __builtin_shufflevector(w[2 * i], w[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9,
                                       24, 25, 12, 13, 28, 29) +
               __builtin_shufflevector(w[2 * i], w[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11,
                                       26, 27, 14, 15, 30, 31);
    v16f f = __builtin_shufflevector(z[0], z[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12,
                                     28, 14, 30) +
             __builtin_shufflevector(z[0], z[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13,
                                     29, 15, 31);
    return __builtin_shufflevector(f, f, 0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15);
}

#ifdef __AVX512BF16__
#include <immintrin.h>

/* h[j * r + k] = sc * (x_j . a_k) for `rows` bfloat16 rows x_j (pointers may repeat) and the
 * r bfloat16 rows of a [r, in], with the CPU's bfloat16 dot product: each float32 lane adds
 * two exact products per step, rounded once each (denormals flushed), 32 values a step */
static inline __attribute__((always_inline)) void shrink_dpbf16(const uint16_t *const *xs,
                                                                int rows, const uint16_t *a,
                                                                int64_t r, int64_t in, float sc,
                                                                float *h) {
    int64_t vec = in & ~(int64_t)31;
    for (int64_t k0 = 0; k0 < r; k0 += 2) {
        int64_t ks[2] = {k0, k0 + 1 < r ? k0 + 1 : k0};
        __m512 acc[2][8];
        for (int j = 0; j < rows; j++) acc[0][j] = acc[1][j] = _mm512_setzero_ps();
        for (int64_t i = 0; i < vec; i += 32) {
            __m512bh w0 = (__m512bh)_mm512_loadu_si512(a + ks[0] * in + i);
            __m512bh w1 = (__m512bh)_mm512_loadu_si512(a + ks[1] * in + i);
            for (int j = 0; j < rows; j++) {
                __m512bh xv = (__m512bh)_mm512_loadu_si512(xs[j] + i);
                acc[0][j] = _mm512_dpbf16_ps(acc[0][j], xv, w0);
                acc[1][j] = _mm512_dpbf16_ps(acc[1][j], xv, w1);
            }
        }
        for (int c = 0; c < 2; c++)
            for (int j = 0; j < rows; j++) {
                float tail = 0.0f;
                for (int64_t i = vec; i < in; i++)
                    tail = __builtin_fmaf(bits_to_f32((uint32_t)xs[j][i] << 16),
                                          bits_to_f32((uint32_t)a[ks[c] * in + i] << 16), tail);
                v16f v;
                memcpy(&v, &acc[c][j], 64);
                h[j * r + ks[c]] = (hsum16(v) + tail) * sc;
            }
    }
}
#endif

#endif
