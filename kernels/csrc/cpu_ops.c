/* Small per-token ops for CPUs, with the numerics of their torch twins (the *_ref.py
 * modules of epdserve.kernels).
 *
 * Built together with paged_decode.c by epdserve/kernels/native.py, called via ctypes. At
 * decode batch sizes a torch op on a [64, 4, 32] tensor costs more in dispatch and strided
 * loops than in arithmetic (rotary: eight such ops per call); here each is one pass.
 *
 * bfloat16 arithmetic is done as torch does it on CPUs: operands widened to float32 (exact),
 * one float32 operation, the result rounded to bfloat16 (nearest even); so every product
 * and sum below is rounded where the torch twin's tensor op rounds it.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    uint16_t r = (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return f != f ? 0x7FC0 : r; /* NaN stays NaN (rounding could carry it into infinity) */
}

/* round a float32 to the nearest bfloat16, kept as float32 */
static inline float round_bf16(float f) { return bf16_to_f32(f32_to_bf16(f)); }

/* r1 = x1*cos - x2*sin, r2 = x2*cos + x1*sin over n pairs, each product and the sum
 * rounded (bf16) as the twin's `x1 * cos - x2 * sin` on bfloat16 tensors; x1/x2 `step`
 * apart from pair to pair (1: neox halves, 2: interleaved pairs) */
static inline void rotate_pairs_bf16(uint16_t *restrict x1, uint16_t *restrict x2,
                                     const uint16_t *restrict cos, const uint16_t *restrict sin,
                                     int64_t n, int64_t step) {
    for (int64_t i = 0; i < n; i++) {
        float a = bf16_to_f32(x1[i * step]), b = bf16_to_f32(x2[i * step]);
        float c = bf16_to_f32(cos[i]), s = bf16_to_f32(sin[i]);
        float r1 = round_bf16(a * c) - round_bf16(b * s);
        float r2 = round_bf16(b * c) + round_bf16(a * s);
        x1[i * step] = f32_to_bf16(r1);
        x2[i * step] = f32_to_bf16(r2);
    }
}

/* One head of `rot` rotated dims: neox pairs i with i + rot/2, else 2i with 2i+1. */
static inline void rotate_bf16(uint16_t *x, const uint16_t *cs, int64_t rot, int neox) {
    int64_t half = rot / 2;
    if (neox)
        rotate_pairs_bf16(x, x + half, cs, cs + half, half, 1);
    else
        rotate_pairs_bf16(x, x + 1, cs, cs + half, half, 2);
}

static inline void rotate_f32(float *x, const float *cs, int64_t rot, int neox) {
    int64_t half = rot / 2, step = neox ? 1 : 2, off = neox ? half : 1;
    for (int64_t i = 0; i < half; i++) {
        float *p1 = x + i * step, *p2 = p1 + off;
        float x1 = *p1, x2 = *p2, c = cs[i], s = cs[half + i];
        float a = x1 * c, b = x2 * s, e = x2 * c, f = x1 * s; /* rounded one by one */
        *p1 = a - b;
        *p2 = e + f;
    }
}

/* Rotary embedding in place on q [T, H, D] and k [T, KVH, D] (contiguous), the first `rot`
 * dims of every head, with row positions[t] of cos_sin [max_pos, rot] (cos | sin), all of
 * one dtype: bfloat16 (bf16 != 0) or float32. Returns 0, or -1 (nothing written) when a
 * position is outside 0..max_pos-1. */
int epd_rotary(const int64_t *positions, void *q, void *k, int64_t tokens, int64_t heads,
               int64_t kv_heads, int64_t head_dim, const void *cos_sin, int64_t max_pos,
               int64_t rot, int neox, int bf16) {
    for (int64_t t = 0; t < tokens; t++)
        if (positions[t] < 0 || positions[t] >= max_pos) return -1;
    for (int64_t t = 0; t < tokens; t++) {
        int64_t p = positions[t];
        if (bf16) {
            const uint16_t *cs = (const uint16_t *)cos_sin + p * rot;
            uint16_t *qt = (uint16_t *)q + t * heads * head_dim;
            uint16_t *kt = (uint16_t *)k + t * kv_heads * head_dim;
            for (int64_t h = 0; h < heads; h++) rotate_bf16(qt + h * head_dim, cs, rot, neox);
            for (int64_t h = 0; h < kv_heads; h++) rotate_bf16(kt + h * head_dim, cs, rot, neox);
        } else {
            const float *cs = (const float *)cos_sin + p * rot;
            float *qt = (float *)q + t * heads * head_dim;
            float *kt = (float *)k + t * kv_heads * head_dim;
            for (int64_t h = 0; h < heads; h++) rotate_f32(qt + h * head_dim, cs, rot, neox);
            for (int64_t h = 0; h < kv_heads; h++) rotate_f32(kt + h * head_dim, cs, rot, neox);
        }
    }
    return 0;
}

/* ---- RMSNorm ------------------------------------------------------------------------ */

#define SUM_LANES 8 /* float32 lanes of torch's x86 sum kernel (AVX2; no AVX-512 build of it) */
#define SUM_ILP 4
#define SUM_LEVELS 4

typedef struct {
    float v[SUM_LANES];
} lanes_t;

static inline void lanes_add(lanes_t *a, const lanes_t *b) {
    for (int l = 0; l < SUM_LANES; l++) a->v[l] += b->v[l];
}

static inline int64_t ceil_log2(int64_t x) {
    int64_t r = 0;
    while (((int64_t)1 << r) < x) r++;
    return r;
}

/* sum of sq[0..n) in the order of torch's CPU sum over a contiguous float32 row: vectors of
 * SUM_LANES, SUM_ILP interleaved partial sums kept in a cascade of SUM_LEVELS levels
 * (every 2^level_power vectors move up a level), the partials added in order, the scalar
 * tail, then the lanes one by one */
static float torch_row_sum(const float *sq, int64_t n) {
    int64_t nvec = n / SUM_LANES, size = nvec / SUM_ILP;
    int64_t power = ceil_log2(size) / SUM_LEVELS;
    power = power > 4 ? power : 4;
    int64_t step = (int64_t)1 << power, mask = step - 1;
    lanes_t acc[SUM_LEVELS][SUM_ILP];
    memset(acc, 0, sizeof acc);
    int64_t i = 0;
    for (; i + step <= size;) {
        for (int64_t j = 0; j < step; j++, i++)
            for (int k = 0; k < SUM_ILP; k++)
                lanes_add(&acc[0][k], (const lanes_t *)(sq + (i * SUM_ILP + k) * SUM_LANES));
        for (int j = 1; j < SUM_LEVELS; j++) {
            for (int k = 0; k < SUM_ILP; k++) {
                lanes_add(&acc[j][k], &acc[j - 1][k]);
                memset(&acc[j - 1][k], 0, sizeof(lanes_t));
            }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < size; i++)
        for (int k = 0; k < SUM_ILP; k++)
            lanes_add(&acc[0][k], (const lanes_t *)(sq + (i * SUM_ILP + k) * SUM_LANES));
    for (int j = 1; j < SUM_LEVELS; j++)
        for (int k = 0; k < SUM_ILP; k++) lanes_add(&acc[0][k], &acc[j][k]);
    lanes_t part = acc[0][0];
    for (int64_t v = size * SUM_ILP; v < nvec; v++)
        lanes_add(&part, (const lanes_t *)(sq + v * SUM_LANES));
    for (int k = 1; k < SUM_ILP; k++) lanes_add(&part, &acc[0][k]);
    float total = 0.0f;
    for (int64_t t = nvec * SUM_LANES; t < n; t++) total += sq[t];
    for (int l = 0; l < SUM_LANES; l++) total += part.v[l];
    return total;
}

static inline float load_x(const void *p, int64_t i, int bf16) {
    return bf16 ? bf16_to_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

static inline void store_x(void *p, int64_t i, float v, int bf16) {
    if (bf16)
        ((uint16_t *)p)[i] = f32_to_bf16(v);
    else
        ((float *)p)[i] = v;
}

/* RMSNorm of rows x [T, n] (contiguous), as kernels/norm_ref.py: with residual, x + residual
 * is rounded to x's dtype and written to res_out first; then x / sqrt(mean(x^2) + eps),
 * the mean in float32 summed in torch's order, the rsqrt as 1 / sqrt; weight in x's dtype
 * (both bfloat16): the normalized row rounded to bfloat16, times the weight, rounded; any
 * other weight: x * inv * w in float32, rounded once. x, residual,
 * out and res_out are bfloat16 (x_bf16) or float32; the weight bfloat16 (w_bf16) or
 * float32. Returns 0, or -2 when scratch memory ran out. */
int epd_rms_norm(const void *x, const void *residual, const void *weight, void *out,
                 void *res_out, int64_t tokens, int64_t n, float eps, int x_bf16, int w_bf16) {
    float *scratch = malloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    if (!scratch) return -2;
    for (int64_t t = 0; t < tokens; t++) {
        const void *xr = x_bf16 ? (const void *)((const uint16_t *)x + t * n)
                                : (const void *)((const float *)x + t * n);
        void *orow = x_bf16 ? (void *)((uint16_t *)out + t * n) : (void *)((float *)out + t * n);
        if (residual) {
            const void *rr = x_bf16 ? (const void *)((const uint16_t *)residual + t * n)
                                    : (const void *)((const float *)residual + t * n);
            void *nr = x_bf16 ? (void *)((uint16_t *)res_out + t * n)
                              : (void *)((float *)res_out + t * n);
            if (x_bf16) {
                const uint16_t *a = xr, *b = rr;
                uint16_t *c = nr;
                for (int64_t i = 0; i < n; i++) c[i] = f32_to_bf16(bf16_to_f32(a[i]) + bf16_to_f32(b[i]));
            } else {
                const float *a = xr, *b = rr;
                float *c = nr;
                for (int64_t i = 0; i < n; i++) c[i] = a[i] + b[i];
            }
            xr = nr;
        }
        if (x_bf16) { /* one pass per dtype, so the loops vectorize */
            const uint16_t *xb = xr;
            for (int64_t i = 0; i < n; i++) {
                float v = bf16_to_f32(xb[i]);
                scratch[i] = v * v;
            }
        } else {
            const float *xf = xr;
            for (int64_t i = 0; i < n; i++) scratch[i] = xf[i] * xf[i];
        }
        float mean = torch_row_sum(scratch, n) / (float)n;
        float inv = 1.0f / sqrtf(mean + eps);
        if (x_bf16 && w_bf16) {
            const uint16_t *w = weight, *xb = xr;
            uint16_t *ob = orow;
            for (int64_t i = 0; i < n; i++)
                ob[i] = f32_to_bf16(round_bf16(bf16_to_f32(xb[i]) * inv) * bf16_to_f32(w[i]));
        } else { /* any other weight: in float32, the product rounded once */
            for (int64_t i = 0; i < n; i++) {
                float y = load_x(xr, i, x_bf16) * inv;
                store_x(orow, i, y * load_x(weight, i, w_bf16), x_bf16);
            }
        }
    }
    free(scratch);
    return 0;
}

/* reshape_and_cache: token t's key and value rows (kv_heads * head_dim elements, contiguous;
 * rows key_stride / value_stride elements apart) go to slot slots[t] of the paged caches:
 * block slot / block_size (blocks k_blk / v_blk elements apart), offset slot % block_size
 * (rows `row` elements apart inside a block). Negative slots (padding) are skipped. Every slot is
 * checked before anything is written: returns 1, writing nothing, if one is out of range.
 * One thread: a memcpy per row, far below what a parallel region costs to start. */
int epd_cache_write(const void *key, const void *value, int64_t key_stride,
                    int64_t value_stride, void *key_cache, void *value_cache, int64_t k_blk,
                    int64_t v_blk, const int64_t *slots, int64_t tokens, int64_t row,
                    int64_t block_size, int64_t num_blocks, int64_t elsize) {
    const int64_t capacity = num_blocks * block_size;
    for (int64_t t = 0; t < tokens; t++)
        if (slots[t] >= capacity) return 1;
    const char *k = key, *v = value;
    char *kc = key_cache, *vc = value_cache;
    const size_t bytes = (size_t)(row * elsize);
    for (int64_t t = 0; t < tokens; t++) {
        const int64_t s = slots[t];
        if (s < 0) continue;
        const int64_t blk = s / block_size, off = s % block_size;
        memcpy(kc + (blk * k_blk + off * row) * elsize, k + t * key_stride * elsize, bytes);
        memcpy(vc + (blk * v_blk + off * row) * elsize, v + t * value_stride * elsize, bytes);
    }
    return 0;
}
