/* Tiles of paged_prefill.c: a chunk of up to CH keys read from the paged cache and repacked
 * once, and the inner products of 4 query rows against KT of its keys at a time.
 *
 * float32 tiles: multiply-adds on 16 lanes (fma16). bfloat16 pairs (when the CPU has
 * AVX512_BF16): vdpbf16ps adds two exact bfloat16 products per float32 lane, half the
 * instructions; its operands hold consecutive elements in pairs (32-bit words).
 */
#ifndef EPD_PREFILL_TILES_H
#define EPD_PREFILL_TILES_H

#include "cpu_simd.h"

#define KT 64  /* keys per product: four vectors of logits per query row */
#define CH 512 /* keys per softmax chunk: torch's flash kernel's kv split */

typedef struct {
    const char *kbase, *vbase;
    int64_t s_n, s_b, s_h, bs, d, heads, group, window, elt;
    int bf16, dp, lanes; /* dp: bfloat16 read as pairs for vdpbf16ps; lanes: exp_chunk's */
    float scale, soft_cap;
} layout_t;

/* the cache row of kv head h at position pos */
static inline const char *row_at(const layout_t *L, const char *base, const int32_t *blocks,
                                 int64_t h, int64_t pos) {
    return base + (blocks[pos / L->bs] * L->s_n + pos % L->bs * L->s_b + h * L->s_h) * L->elt;
}

/* keys k0..k0+n-1 (n <= CH) of kv head h as float32: kt[d][CH] (K transposed; zeros from n
 * to the next multiple of KT), vt[n][d] */
static void load_tile(const layout_t *L, const int32_t *blocks, int64_t h, int64_t k0,
                      int64_t n, float *restrict kt, float *restrict vt) {
    const int64_t d = L->d;
    for (int64_t j = 0; j < n; j++) {
        const char *kr = row_at(L, L->kbase, blocks, h, k0 + j);
        const char *vr = row_at(L, L->vbase, blocks, h, k0 + j);
        if (L->bf16) { /* bfloat16 is the top half of a float32 */
            const uint16_t *k16 = (const uint16_t *)kr, *v16 = (const uint16_t *)vr;
            uint32_t *vbits = (uint32_t *)(vt + j * d); /* built with -fno-strict-aliasing */
            for (int64_t i = 0; i < d; i++) kt[i * CH + j] = bits_to_f32((uint32_t)k16[i] << 16);
#pragma omp simd
            for (int64_t i = 0; i < d; i++) vbits[i] = (uint32_t)v16[i] << 16;
        } else {
            const float *k32 = (const float *)kr;
            for (int64_t i = 0; i < d; i++) kt[i * CH + j] = k32[i];
            memcpy(vt + j * d, vr, (size_t)d * sizeof(float));
        }
    }
    for (int64_t i = 0; i < d; i++)
        for (int64_t j = n; j % KT; j++) kt[i * CH + j] = 0.0f;
}

/* the same keys as bfloat16 pairs: kt[d / 2][CH] (K's pairs transposed, zeros as above) and
 * vp[(n + 1) / 2][d] (V rows 2k, 2k + 1 interleaved per column; a missing odd row is 0) */
static void load_pairs(const layout_t *L, const int32_t *blocks, int64_t h, int64_t k0,
                       int64_t n, uint32_t *restrict kt, uint32_t *restrict vp) {
    const int64_t d = L->d;
    for (int64_t j = 0; j < n; j++) {
        const char *kr = row_at(L, L->kbase, blocks, h, k0 + j);
        const uint16_t *v16 = (const uint16_t *)row_at(L, L->vbase, blocks, h, k0 + j);
        for (int64_t i = 0; i < d / 2; i++) memcpy(kt + i * CH + j, kr + 4 * i, 4);
        uint32_t *dst = vp + j / 2 * d;
        if (j % 2 == 0)
#pragma omp simd
            for (int64_t i = 0; i < d; i++) dst[i] = v16[i];
        else
#pragma omp simd
            for (int64_t i = 0; i < d; i++) dst[i] |= (uint32_t)v16[i] << 16;
    }
    for (int64_t i = 0; i < d / 2; i++)
        for (int64_t j = n; j % KT; j++) kt[i * CH + j] = 0;
}

/* s[r][k] = q[r] . key k for 4 rows and the KT keys from kt on (kt[d][CH]: K transposed);
 * s rows CH apart */
static inline void qk_4xKT(const float *const q[4], const float *restrict kt, int64_t d,
                           float *restrict s) {
    v16f acc[16] = {0};
    for (int64_t i = 0; i < d; i++) {
        v16f k[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) memcpy(&k[j], kt + i * CH + 16 * j, 64);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            v16f b = splat16(q[r][i]);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[4 * r + j] = fma16(b, k[j], acc[4 * r + j]);
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) memcpy(s + (t / 4) * CH + 16 * (t % 4), &acc[t], 64);
}

/* pv_4xNV: o[r][c .. c + 16 NV) += sum over keys k < n of p[r][k] vt[k][c ..], 4 rows
 * (p rows CH apart), keys added in order */
#define PV_4(NV)                                                                         \
    static inline void pv_4x##NV(const float *restrict p, const float *restrict vt,      \
                                 int64_t n, int64_t d, int64_t c, float *restrict o) {   \
        v16f a[4 * NV];                                                                  \
        _Pragma("GCC unroll 16") for (int t = 0; t < 4 * NV; t++)                        \
            memcpy(&a[t], o + (t / NV) * d + c + 16 * (t % NV), 64);                     \
        for (int64_t k = 0; k < n; k++) {                                                \
            v16f v[NV];                                                                  \
            _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++)                         \
                memcpy(&v[j], vt + k * d + c + 16 * j, 64);                              \
            _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {                        \
                v16f b = splat16(p[r * CH + k]);                                         \
                _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++)                     \
                    a[NV * r + j] = fma16(b, v[j], a[NV * r + j]);                       \
            }                                                                            \
        }                                                                                \
        _Pragma("GCC unroll 16") for (int t = 0; t < 4 * NV; t++)                        \
            memcpy(o + (t / NV) * d + c + 16 * (t % NV), &a[t], 64);                     \
    }
PV_4(1)
PV_4(2)
PV_4(4)

#ifdef __AVX512BF16__
#include <immintrin.h>
#define HAVE_DP 1

static inline v16u splat16u(uint32_t x) {
    return (v16u){x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x};
}

/* acc + a.even * b.even + a.odd * b.odd per lane (bfloat16 pairs; denormals read as 0) */
static inline v16f dp16(v16f acc, v16u a, v16u b) {
    return (v16f)_mm512_dpbf16_ps((__m512)acc, (__m512bh)(__m512i)a, (__m512bh)(__m512i)b);
}

/* qk_4xKT on pairs: q[r][d / 2] and kt[d / 2][CH] (K's pairs transposed) */
static inline void qk_dp_4xKT(const uint32_t *const q[4], const uint32_t *restrict kt,
                              int64_t d, float *restrict s) {
    v16f acc[16] = {0};
    for (int64_t i = 0; i < d / 2; i++) {
        v16u k[4];
#pragma GCC unroll 4
        for (int j = 0; j < 4; j++) memcpy(&k[j], kt + i * CH + 16 * j, 64);
#pragma GCC unroll 4
        for (int r = 0; r < 4; r++) {
            v16u b = splat16u(q[r][i]);
#pragma GCC unroll 4
            for (int j = 0; j < 4; j++) acc[4 * r + j] = dp16(acc[4 * r + j], b, k[j]);
        }
    }
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) memcpy(s + (t / 4) * CH + 16 * (t % 4), &acc[t], 64);
}

/* pv_4xNV on pairs of keys: p[r][CH / 2] (probabilities of keys 2k, 2k + 1) and
 * vp[pairs][d] (V rows 2k and 2k + 1 interleaved per column) */
#define PV_DP_4(NV)                                                                      \
    static inline void pv_dp_4x##NV(const uint32_t *restrict p,                          \
                                    const uint32_t *restrict vp, int64_t pairs,          \
                                    int64_t d, int64_t c, float *restrict o) {           \
        v16f a[4 * NV];                                                                  \
        _Pragma("GCC unroll 16") for (int t = 0; t < 4 * NV; t++)                        \
            memcpy(&a[t], o + (t / NV) * d + c + 16 * (t % NV), 64);                     \
        for (int64_t k = 0; k < pairs; k++) {                                            \
            v16u v[NV];                                                                  \
            _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++)                         \
                memcpy(&v[j], vp + k * d + c + 16 * j, 64);                              \
            _Pragma("GCC unroll 4") for (int r = 0; r < 4; r++) {                        \
                v16u b = splat16u(p[r * (CH / 2) + k]);                                  \
                _Pragma("GCC unroll 4") for (int j = 0; j < NV; j++)                     \
                    a[NV * r + j] = dp16(a[NV * r + j], b, v[j]);                        \
            }                                                                            \
        }                                                                                \
        _Pragma("GCC unroll 16") for (int t = 0; t < 4 * NV; t++)                        \
            memcpy(o + (t / NV) * d + c + 16 * (t % NV), &a[t], 64);                     \
    }
PV_DP_4(1)
PV_DP_4(2)
PV_DP_4(4)
#else
#define HAVE_DP 0
#endif

#endif
