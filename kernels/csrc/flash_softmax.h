/* The softmax of one row of logits over a chunk of keys as torch's CPU flash-attention
 * kernel computes it (shared by paged_decode.c and paged_prefill.c): its fast exponential,
 * the split of a chunk between that and libm's expf, the order of the sum, and the rounding
 * of the probabilities to bfloat16.
 */
#ifndef EPD_FLASH_SOFTMAX_H
#define EPD_FLASH_SOFTMAX_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_simd.h"

/* 2^(x*log2 e) with a cubic for the fraction, assembled in the exponent bits: the fast
 * exponential (relative error ~1e-5) of torch's flash kernel. x <= 0 here. */
static inline float fexp(float x) {
    const float log2e = bits_to_f32(0x3fb8aa3bu);
    const float ln_min = bits_to_f32(0xc2aeac50u);
    const float c0 = 0.00010703434948458272f, c1 = 0.30354260500649682f;
    const float c2 = -0.22433836478672356f, c3 = -0.079204240219773236f;
    const float a = 8388608.0f, b = 8388608.0f * 127.0f;
    float xc = x < ln_min ? ln_min : x;
    float src = xc * log2e;
    float fr = src - floorf(src);
    float r = fmaf(fr, c3, c2);
    r = fmaf(fr, r, c1);
    r = fmaf(fr, r, c0);
    src = src - r;
    int32_t i = (int32_t)fmaf(a, src, b);
    return x < ln_min ? 0.0f : bits_to_f32((uint32_t)i);
}

/* torch's fast exponential (exp_u20: relative error ~1e-5) on 16 lanes, the same operations
 * lane by lane as paged_decode.c's scalar fexp (floor by truncation, exact for the
 * |x| < 2^31 met here: x*log2e >= ln_min*log2e > -127); 0 below ln_min, -inf included.
 * Fused multiply-adds as torch's kernel where the CPU has them (AVX-512). */
static inline v16f fexp16(v16f x) {
    const float log2e = bits_to_f32(0x3fb8aa3bu);
    const float ln_min = bits_to_f32(0xc2aeac50u);
    const float c0 = 0.00010703434948458272f, c1 = 0.30354260500649682f;
    const float c2 = -0.22433836478672356f, c3 = -0.079204240219773236f;
    const float a = 8388608.0f, b = 8388608.0f * 127.0f;
    v16i under = x < ln_min;
    const v16f zero = {0}, lnv = zero + ln_min;
    v16f xc = (v16f)(((v16i)lnv & under) | ((v16i)x & ~under));
    v16f src = xc * log2e;
    v16f t = __builtin_convertvector(__builtin_convertvector(src, v16i), v16f);
    v16i below = src < t; /* truncation rounded up: floor is one less */
    v16f fl = (v16f)(((v16i)(t - 1.0f) & below) | ((v16i)t & ~below));
    v16f fr = src - fl;
    v16f r = fma16(fr, zero + c3, zero + c2);
    r = fma16(fr, r, zero + c1);
    r = fma16(fr, r, zero + c0);
    src = src - r;
    v16f ai = fma16(zero + a, src, zero + b);
    v16i i = __builtin_convertvector(ai, v16i);
    return (v16f)(i & ~under);
}

/* exp(row - mx) in place over n keys; returns their sum. lanes > 0: the flash kernel's way
 * (fexp on the first lanes*floor(n/lanes) keys summed in `lanes` partial sums folded in
 * halves, libm expf on the rest); lanes == 0: libm expf, summed in order. Keys from `live`
 * on count as -inf: their exp is 0, not computed (a vector starting there is skipped, so
 * one reaching past it must hold -inf there); their row entries are left as they were. */
static inline float exp_chunk(float *restrict row, int64_t n, int64_t live, float mx,
                               int lanes) {
    float part[16] = {0};
    int64_t nvec = lanes > 0 ? lanes * (n / lanes) : 0;
#ifdef __AVX512F__
    if (lanes == 16) {
        v16f acc = {0};
        for (int64_t b = 0; b < nvec && b < live; b += 16) {
            v16f x;
            memcpy(&x, row + b, 64);
            v16f e = fexp16(x - mx);
            acc += e;
            memcpy(row + b, &e, 64);
        }
        memcpy(part, &acc, 64);
    } else
#endif
        for (int64_t b = 0; b < nvec && b < live; b += lanes) {
#pragma omp simd
            for (int l = 0; l < lanes; l++) {
                float e = fexp(row[b + l] - mx);
                part[l] += e;
                row[b + l] = e;
            }
        }
    for (int step = lanes / 2; step >= 1; step /= 2)
        for (int l = 0; l < step; l++) part[l] += part[l + step];
    float sum = part[0];
    for (int64_t j = nvec; j < n && j < live; j++) {
        float e = expf(row[j] - mx);
        sum += e;
        row[j] = e;
    }
    return sum;
}

/* round to nearest even bfloat16, kept as float32 */
static inline void round_bf16(float *restrict x, int64_t n) {
    uint32_t *bits = (uint32_t *)x; /* built with -fno-strict-aliasing */
#pragma omp simd
    for (int64_t j = 0; j < n; j++) bits[j] = (bits[j] + 0x7FFFu + ((bits[j] >> 16) & 1u)) & 0xFFFF0000u;
}

#endif
