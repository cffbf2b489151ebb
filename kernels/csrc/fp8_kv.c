/* Reading a paged KV cache stored in fp8 (e4m3) back to the model's dtype, for CPUs.
 *
 * Built with the other kernels by epdserve/kernels/native_build.py, called via ctypes from
 * kernels/native.py (fp8_blocks). One pass: each named block's bytes are looked up in a
 * 256-entry table of their values in the output dtype (bfloat16 or float32 bits, made by
 * torch from every fp8 byte, so the result is torch's cast bit for bit; every e4m3 value is
 * exact in both). torch's own fp8 cast on CPUs runs about ten times slower than this.
 */
#include <stdint.h>

/* dst[i] (block_elems values of out_bytes each) = table[src block ids[i]'s bytes]; a block
 * is block_elems contiguous bytes, block_stride bytes after the one before it */
int epd_fp8_blocks(const uint8_t *src, int64_t block_stride, const int64_t *ids, int64_t n,
                   int64_t block_elems, int64_t num_blocks, const void *table, void *dst,
                   int out_bytes) {
    for (int64_t i = 0; i < n; i++) {
        if (ids[i] < 0 || ids[i] >= num_blocks) return 1;
    }
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        const uint8_t *s = src + ids[i] * block_stride;
        if (out_bytes == 2) {
            const uint16_t *t = (const uint16_t *)table;
            uint16_t *d = (uint16_t *)dst + i * block_elems;
            for (int64_t j = 0; j < block_elems; j++) d[j] = t[s[j]];
        } else {
            const uint32_t *t = (const uint32_t *)table;
            uint32_t *d = (uint32_t *)dst + i * block_elems;
            for (int64_t j = 0; j < block_elems; j++) d[j] = t[s[j]];
        }
    }
    return 0;
}
