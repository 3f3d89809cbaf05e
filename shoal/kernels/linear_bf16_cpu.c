/* Linear layers over bfloat16 weights on CPUs without bfloat16 matmul instructions.

   oneDNN packs bfloat16 weights only where the CPU converts or multiplies bfloat16 in
   hardware (AVX512-BF16, AMX, AVX-NE-CONVERT); on others (Zen 3 and most AVX2 parts) torch's
   bfloat16 F.linear ran 1.5-3x slower than float32 here. A decode step reads every weight
   once and does little else with it, so it is bound by the weight bytes: this kernel keeps
   the weight in bfloat16 (half float32's bytes) and widens each row to float32 in registers
   as it streams past (a bfloat16 is a float32's top 16 bits). Sums are float32 and rounded
   to bfloat16 once, at the end, as torch's bfloat16 matmul does.

   Work: output features split over OpenMP threads (torch's pool: see paged_decode_cpu.c);
   each weight row is multiplied with two activation rows at a time (two accumulator chains
   per row, four in flight), the activations widened to float32 once up front. Activation
   rows are re-read for every weight row, so this is for a few rows (decode); the Python side
   sends many-row calls (prefill) to float32 GEMM on widened weight chunks instead.

   Layouts: x [rows, k] bfloat16, rows x_stride elements apart; w [n, k] bfloat16,
   contiguous; bias [n] bfloat16 or NULL; out [rows, n] bfloat16, contiguous. */

#pragma GCC optimize("fp-contract=fast")

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16_u __attribute__((vector_size(64), aligned(4)));
typedef uint16_t u16x16_u __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
#define LOAD16(p) (*(const f32x16_u *)(p))

static inline __attribute__((always_inline)) f32x16 widen16(const uint16_t *p) {
    return (f32x16)(__builtin_convertvector(*(const u16x16_u *)p, u32x16) << 16);
}

static inline float widen(uint16_t half) {
    const uint32_t bits = (uint32_t)half << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

/* round to nearest even, as torch's float -> bfloat16 conversion; NaN stays a (quiet) NaN */
static inline uint16_t narrow(float value) {
    uint32_t bits;
    memcpy(&bits, &value, sizeof bits);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40u);
    bits += 0x7fffu + ((bits >> 16) & 1u);
    return (uint16_t)(bits >> 16);
}

static inline __attribute__((always_inline)) float sum16(f32x16 v) {
    float lanes[16];
    memcpy(lanes, &v, sizeof lanes);
    for (int width = 8; width > 0; width /= 2)
        for (int i = 0; i < width; ++i) lanes[i] += lanes[i + width];
    return lanes[0];
}

/* Returns 0 on success, 1 when the widened activations could not be allocated. */
int shoal_linear_bf16(const uint16_t *x, int64_t x_stride, const uint16_t *w,
                      const uint16_t *bias, uint16_t *out, int64_t rows, int64_t n, int64_t k) {
    float *xf = malloc((size_t)(rows * k > 0 ? rows * k : 1) * sizeof(float));
    if (xf == NULL) return 1;
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t i = 0; i < k; ++i) xf[r * k + i] = widen(x[r * x_stride + i]);

#pragma omp parallel for schedule(static)
    for (int64_t j = 0; j < n; ++j) {
        const uint16_t *wj = w + j * k;
        const float b = bias != NULL ? widen(bias[j]) : 0.0f;
        for (int64_t r = 0; r < rows; r += 2) {
            const int two = r + 1 < rows;
            const float *x0 = xf + r * k, *x1 = two ? x0 + k : x0;
            f32x16 a0 = {0}, a1 = {0}, c0 = {0}, c1 = {0};
            int64_t i = 0;
            for (; i + 32 <= k; i += 32) {
                const f32x16 w0 = widen16(wj + i), w1 = widen16(wj + i + 16);
                a0 += LOAD16(x0 + i) * w0;
                a1 += LOAD16(x0 + i + 16) * w1;
                c0 += LOAD16(x1 + i) * w0;
                c1 += LOAD16(x1 + i + 16) * w1;
            }
            for (; i + 16 <= k; i += 16) {
                const f32x16 w0 = widen16(wj + i);
                a0 += LOAD16(x0 + i) * w0;
                c0 += LOAD16(x1 + i) * w0;
            }
            float s0 = sum16(a0 + a1), s1 = sum16(c0 + c1);
            for (; i < k; ++i) {
                const float wi = widen(wj[i]);
                s0 += x0[i] * wi;
                s1 += x1[i] * wi;
            }
            out[r * n + j] = narrow(s0 + b);
            if (two) out[(r + 1) * n + j] = narrow(s1 + b);
        }
    }
    free(xf);
    return 0;
}
