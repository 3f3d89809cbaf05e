/* The panel multiply shared by the native CPU matmuls (moe_experts_cpu.c's experts,
   linear_panels_cpu.c's dense layers): PW weight rows stored column by column, a "panel"
   (panel[c * PW + j] = w[j][c]), times PM activation rows at a time as an outer product,
   each row's element broadcast against the panel's two vectors: no horizontal sums, every
   panel load used by up to PM rows, and one row reads the panel once at memory speed.

   The panel is float32, or bfloat16 widened in registers (a bfloat16 is the top half of a
   float32), so bfloat16 weights are read from memory at half the bytes; the activations and
   the sums are float32. AVX2 + FMA intrinsics where -march=native has them, the same loops
   in portable C elsewhere. */

#ifndef SHOAL_PANEL_CPU_H
#define SHOAL_PANEL_CPU_H

#include <stdint.h>

#include "bf16_cpu.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHOAL_AVX2 1
#endif

#define LANES 8 /* float32 per vector */
#define PW 16   /* weight rows a panel: two vectors */
#define PM 6    /* rows per register block: 6 x 2 accumulators + 2 panel + 1 broadcast */

#ifdef SHOAL_AVX2
static inline __attribute__((always_inline)) __m256 load_w(const void *w, int64_t c,
                                                           const int is_bf16) {
    if (is_bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const bf16 *)w + c))),
            16));
    return _mm256_loadu_ps((const float *)w + c);
}
#else
static inline float load_w1(const void *w, int64_t c, const int is_bf16) {
    return is_bf16 ? widen(((const bf16 *)w)[c]) : ((const float *)w)[c];
}
#endif

/* outr[i][0:PW] = xr[i][0:len] . panel, for i < mr; the panel in float32, or bfloat16 when
   pbf16 (a prepacked one, widened in registers) */
static inline __attribute__((always_inline)) void panel_block(
        const float *const *xr, const void *panel, int64_t len, float *const *outr,
        const int mr, const int pbf16) {
#ifdef SHOAL_AVX2
    /* named accumulators, not an array: gcc keeps an array's copy in memory every step */
    const __m256 z = _mm256_setzero_ps();
    __m256 l0 = z, h0 = z, l1 = z, h1 = z, l2 = z, h2 = z, l3 = z, h3 = z, l4 = z, h4 = z,
           l5 = z, h5 = z;
    if (mr <= 2) {
        /* one or two rows are 2 or 4 FMA chains, each waiting out the FMA's latency every
           column: odd columns sum apart (l2.. for row 0, l3.. for row 1), twice the chains */
        const float *q0 = xr[0], *q1 = xr[mr > 1 ? 1 : 0];
        int64_t c = 0;
        for (; c + 2 <= len; c += 2) {
            const __m256 b0 = load_w(panel, c * PW, pbf16),
                         b1 = load_w(panel, c * PW + 8, pbf16),
                         b2 = load_w(panel, c * PW + PW, pbf16),
                         b3 = load_w(panel, c * PW + PW + 8, pbf16);
            const __m256 x0 = _mm256_broadcast_ss(q0 + c), y0 = _mm256_broadcast_ss(q0 + c + 1);
            l0 = _mm256_fmadd_ps(x0, b0, l0);
            h0 = _mm256_fmadd_ps(x0, b1, h0);
            l2 = _mm256_fmadd_ps(y0, b2, l2);
            h2 = _mm256_fmadd_ps(y0, b3, h2);
            if (mr > 1) {
                const __m256 x1 = _mm256_broadcast_ss(q1 + c),
                             y1 = _mm256_broadcast_ss(q1 + c + 1);
                l1 = _mm256_fmadd_ps(x1, b0, l1);
                h1 = _mm256_fmadd_ps(x1, b1, h1);
                l3 = _mm256_fmadd_ps(y1, b2, l3);
                h3 = _mm256_fmadd_ps(y1, b3, h3);
            }
        }
        if (c < len) {
            const __m256 b0 = load_w(panel, c * PW, pbf16), b1 = load_w(panel, c * PW + 8, pbf16);
            const __m256 x0 = _mm256_broadcast_ss(q0 + c), x1 = _mm256_broadcast_ss(q1 + c);
            l0 = _mm256_fmadd_ps(x0, b0, l0);
            h0 = _mm256_fmadd_ps(x0, b1, h0);
            l1 = _mm256_fmadd_ps(x1, b0, l1);
            h1 = _mm256_fmadd_ps(x1, b1, h1);
        }
        _mm256_storeu_ps(outr[0], _mm256_add_ps(l0, l2));
        _mm256_storeu_ps(outr[0] + 8, _mm256_add_ps(h0, h2));
        if (mr > 1) {
            _mm256_storeu_ps(outr[1], _mm256_add_ps(l1, l3));
            _mm256_storeu_ps(outr[1] + 8, _mm256_add_ps(h1, h3));
        }
        return;
    }
    const float *p0 = xr[0], *p1 = xr[mr > 1 ? 1 : 0], *p2 = xr[mr > 2 ? 2 : 0],
                *p3 = xr[mr > 3 ? 3 : 0], *p4 = xr[mr > 4 ? 4 : 0], *p5 = xr[mr > 5 ? 5 : 0];
    for (int64_t c = 0; c < len; ++c) {
        const __m256 b0 = load_w(panel, c * PW, pbf16), b1 = load_w(panel, c * PW + 8, pbf16);
#define STEP(i)                                                                             \
        if (mr > i) {                                                                       \
            const __m256 xi = _mm256_broadcast_ss(p##i + c);                                \
            l##i = _mm256_fmadd_ps(xi, b0, l##i);                                           \
            h##i = _mm256_fmadd_ps(xi, b1, h##i);                                           \
        }
        STEP(0) STEP(1) STEP(2) STEP(3) STEP(4) STEP(5)
#undef STEP
    }
#define OUT(i)                                                                              \
    if (mr > i) {                                                                           \
        _mm256_storeu_ps(outr[i], l##i);                                                    \
        _mm256_storeu_ps(outr[i] + 8, h##i);                                                \
    }
    OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5)
#undef OUT
#else
    for (int i = 0; i < mr; ++i) {
        float sum[PW] = {0};
        for (int64_t c = 0; c < len; ++c)
            for (int j = 0; j < PW; ++j) sum[j] += xr[i][c] * load_w1(panel, c * PW + j, pbf16);
        for (int j = 0; j < PW; ++j) outr[i][j] = sum[j];
    }
#endif
}

static inline void panel_rows_as(const float *const *xr, const void *panel, int64_t len,
                          float *const *outr, int mr, const int pbf16) {
    switch (mr) {
    case 6: panel_block(xr, panel, len, outr, 6, pbf16); break;
    case 5: panel_block(xr, panel, len, outr, 5, pbf16); break;
    case 4: panel_block(xr, panel, len, outr, 4, pbf16); break;
    case 3: panel_block(xr, panel, len, outr, 3, pbf16); break;
    case 2: panel_block(xr, panel, len, outr, 2, pbf16); break;
    default: panel_block(xr, panel, len, outr, 1, pbf16); break;
    }
}

static inline void panel_rows(const float *const *xr, const void *panel, int64_t len,
                       float *const *outr, int mr, int pbf16) {
    if (pbf16) panel_rows_as(xr, panel, len, outr, mr, 1);
    else panel_rows_as(xr, panel, len, outr, mr, 0);
}

#endif /* SHOAL_PANEL_CPU_H */
