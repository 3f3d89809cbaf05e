/* The decoder's position-wise ops for CPU in bfloat16: RMSNorm (with the residual add),
   SiLU-and-mul, the neox rotary embedding in place, and the per-head q/k RMSNorm followed by
   the rotary embedding in place (Qwen 3's attention).

   torch runs each of these as several bfloat16 ops (a widening copy, the op, a narrowing
   copy, a multiply by the weight...), each too small at decode sizes for torch to split over
   threads: with the linear layers on both cores, the second core sat idle through them. Here
   each is one pass over its rows, rows split over OpenMP threads (torch's pool: see
   paged_decode_cpu.c).

   Rounding follows torch's bfloat16 ops one by one: the arithmetic of each op in float32,
   its result rounded to bfloat16 (nearest even) where torch's op would write a bfloat16
   tensor, so the outputs equal the torch path's but for the order of a sum or the last bit
   of an exp. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "bf16_cpu.h" /* bf16, widen, narrow */

#if defined(__x86_64__) && defined(__GNUC__)
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

/* below this many elements a parallel region costs more than it saves */
#define PARALLEL_MIN 8192

/* One row: dst = narrow(narrow(src * inv_rms) * weight), as torch's
   F.rms_norm(x.float()).to(bfloat16) * weight. */
static inline void norm_row(const bf16 *src, const bf16 *weight, bf16 *dst, int64_t size,
                            float eps) {
    float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
    for (int64_t i = 0; i < size; ++i) squares += widen(src[i]) * widen(src[i]);
    const float inv_rms = 1.0f / sqrtf(squares / (float)size + eps);
#pragma omp simd
    for (int64_t i = 0; i < size; ++i)
        dst[i] = narrow(widen(narrow(widen(src[i]) * inv_rms)) * widen(weight[i]));
}

/* One head in place: x1' = x1 cos - x2 sin, x2' = x2 cos + x1 sin, each product and the sum
   rounded as torch's bfloat16 ops round them. */
static inline void rotate_head(bf16 *x, const bf16 *c, const bf16 *s, int64_t half) {
    bf16 *x2 = x + half;
#pragma omp simd
    for (int64_t i = 0; i < half; ++i) {
        const float a = widen(x[i]), b = widen(x2[i]), ci = widen(c[i]), si = widen(s[i]);
        x[i] = narrow(widen(narrow(a * ci)) - widen(narrow(b * si)));
        x2[i] = narrow(widen(narrow(b * ci)) + widen(narrow(a * si)));
    }
}

/* out[r] = norm(x[r]) * weight; with a residual: residual[r] = x[r] + residual[r] (rounded)
   first, and the updated residual is what is normalised. */
void shoal_rms_norm_bf16(const bf16 *x, int64_t x_stride, bf16 *residual, int64_t res_stride,
                         const bf16 *weight, bf16 *out, int64_t out_stride, int64_t rows,
                         int64_t size, float eps) {
#pragma omp parallel for schedule(static) if (rows * size >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const bf16 *src = x + r * x_stride;
        if (residual != 0) {
            bf16 *res = residual + r * res_stride;
#pragma omp simd
            for (int64_t i = 0; i < size; ++i) res[i] = narrow(widen(src[i]) + widen(res[i]));
            src = res;
        }
        norm_row(src, weight, out + r * out_stride, size, eps);
    }
}

/* out[r] = narrow(narrow(silu(gate)) * up) where gate_up[r] = [gate | up]. Columns are split
   too, so a few decode rows still use every thread. */
void shoal_silu_and_mul_bf16(const bf16 *gate_up, int64_t in_stride, bf16 *out,
                             int64_t out_stride, int64_t rows, int64_t size) {
    const int64_t chunk = 512;
    const int64_t chunks = (size + chunk - 1) / chunk;
#pragma omp parallel for collapse(2) schedule(static) if (rows * size >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < chunks; ++c) {
            const bf16 *gate = gate_up + r * in_stride;
            const bf16 *up = gate + size;
            bf16 *dst = out + r * out_stride;
            const int64_t start = c * chunk;
            const int64_t len = ((c + 1) * chunk < size ? (c + 1) * chunk : size) - start;
            float silu[512];  /* two loops: the vector expf loop vectorises only alone */
#pragma omp simd
            for (int64_t i = 0; i < len; ++i) {
                const float g = widen(gate[start + i]);
                silu[i] = g / (1.0f + expf(-g));
            }
#pragma omp simd
            for (int64_t i = 0; i < len; ++i)
                dst[start + i] = narrow(widen(narrow(silu[i])) * widen(up[start + i]));
        }
}

/* Neox rotary in place over `heads` heads of each token (layout as shoal_rotary_neox_f32). */
void shoal_rotary_neox_bf16(bf16 *x, int64_t token_stride, int64_t heads, int64_t head_dim,
                            const bf16 *cos, const bf16 *sin, int64_t table_stride,
                            int64_t tokens) {
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < heads; ++h)
            rotate_head(x + t * token_stride + h * head_dim, cos + t * table_stride,
                        sin + t * table_stride, head_dim / 2);
}

/* Per-head RMSNorm then neox rotary, in place: each token's first q_heads heads with
   q_weight, the next k_heads with k_weight (q and k side by side in the fused qkv rows). */
void shoal_qk_norm_rotary_bf16(bf16 *x, int64_t token_stride, int64_t q_heads,
                               int64_t k_heads, int64_t head_dim, const bf16 *q_weight,
                               const bf16 *k_weight, float eps, const bf16 *cos,
                               const bf16 *sin, int64_t table_stride, int64_t tokens) {
    const int64_t heads = q_heads + k_heads;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; ++t)
        for (int64_t h = 0; h < heads; ++h) {
            bf16 *head = x + t * token_stride + h * head_dim;
            norm_row(head, h < q_heads ? q_weight : k_weight, head, head_dim, eps);
            rotate_head(head, cos + t * table_stride, sin + t * table_stride, head_dim / 2);
        }
}
