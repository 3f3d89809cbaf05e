/* bfloat16 <-> float32 for the native CPU kernels: a bfloat16 is the top half of a float32,
   so widening is a shift, and narrowing rounds to nearest even as torch's .to(bfloat16)
   does (NaN stays NaN). */

#ifndef SHOAL_BF16_CPU_H
#define SHOAL_BF16_CPU_H

#include <stdint.h>
#include <string.h>

typedef uint16_t bf16;

static inline float widen(bf16 h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    memcpy(&f, &bits, sizeof f);
    return f;
}

static inline bf16 narrow(float f) {
    uint32_t bits;
    memcpy(&bits, &f, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (bf16)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (bf16)(bits >> 16);
}

#endif /* SHOAL_BF16_CPU_H */
