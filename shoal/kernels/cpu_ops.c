/* Position-wise ops of the decoder for CPU, float32, each one pass over its rows.

   torch runs RMSNorm, the residual add, SiLU-and-mul and the rotary embedding as several
   ops, each reading its input from memory and allocating an output; at prefill sizes the
   rows do not stay in cache between them. Here each is one loop over a row, rows split over
   OpenMP threads (torch's pool: see paged_decode_cpu.c).

   The arithmetic follows the reference formulas operation by operation (no contraction into
   FMAs: -std=c11 turns it off), so the rotary embedding equals torch's bit for bit and the
   others differ only by the order of a sum or the last bit of an exp. */

#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

/* below this many elements a parallel region costs more than it saves */
#define PARALLEL_MIN 32768

/* out[r] = x[r] * rsqrt(mean(x[r]^2) + eps) * weight. With a residual: residual[r] += x[r]
   first, and the updated residual is what is normalised (the pre-norm residual stream). */
void shoal_rms_norm_f32(const float *x, int64_t x_stride, float *residual, int64_t res_stride,
                        const float *weight, float *out, int64_t out_stride, int64_t rows,
                        int64_t size, float eps) {
#pragma omp parallel for schedule(static) if (rows * size >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r) {
        const float *src = x + r * x_stride;
        if (residual != 0) {
            float *res = residual + r * res_stride;
#pragma omp simd
            for (int64_t i = 0; i < size; ++i) res[i] += src[i];
            src = res;
        }
        float squares = 0.0f;
#pragma omp simd reduction(+ : squares)
        for (int64_t i = 0; i < size; ++i) squares += src[i] * src[i];
        const float inv_rms = 1.0f / sqrtf(squares / (float)size + eps);
        float *dst = out + r * out_stride;
#pragma omp simd
        for (int64_t i = 0; i < size; ++i) dst[i] = src[i] * inv_rms * weight[i];
    }
}

/* out[r] = silu(gate) * up where gate_up[r] = [gate | up], each `size` wide. Columns are
   split too, so a few decode rows still use every thread. */
void shoal_silu_and_mul_f32(const float *gate_up, int64_t in_stride, float *out,
                            int64_t out_stride, int64_t rows, int64_t size) {
    const int64_t chunk = 512;
    const int64_t chunks = (size + chunk - 1) / chunk;
#pragma omp parallel for collapse(2) schedule(static) if (rows * size >= PARALLEL_MIN)
    for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < chunks; ++c) {
            const float *gate = gate_up + r * in_stride;
            const float *up = gate + size;
            float *dst = out + r * out_stride;
            const int64_t end = (c + 1) * chunk < size ? (c + 1) * chunk : size;
#pragma omp simd
            for (int64_t i = c * chunk; i < end; ++i)
                dst[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
        }
}

/* Neox-style rotary embedding in place: for each token t and head h, with halves x1, x2 of
   x[t][h], x1' = x1 cos - x2 sin and x2' = x2 cos + x1 sin. cos/sin rows are the tokens'
   positions' [head_dim / 2] tables. Heads are head_dim apart within a token, tokens
   token_stride apart (q and k side by side in the fused qkv rows are one call). */
void shoal_rotary_neox_f32(float *x, int64_t token_stride, int64_t heads, int64_t head_dim,
                           const float *cos, const float *sin, int64_t table_stride,
                           int64_t tokens) {
    const int64_t half = head_dim / 2;
#pragma omp parallel for schedule(static) if (tokens * heads * head_dim >= PARALLEL_MIN)
    for (int64_t t = 0; t < tokens; ++t) {
        const float *c = cos + t * table_stride;
        const float *s = sin + t * table_stride;
        for (int64_t h = 0; h < heads; ++h) {
            float *x1 = x + t * token_stride + h * head_dim;
            float *x2 = x1 + half;
#pragma omp simd
            for (int64_t i = 0; i < half; ++i) {
                const float a = x1[i], b = x2[i];
                x1[i] = a * c[i] - b * s[i];
                x2[i] = b * c[i] + a * s[i];
            }
        }
    }
}

/* This step's new K and V rows into their cache slots: row t of k and v (row_bytes wide,
   rows k_stride / v_stride bytes apart: views into the fused qkv rows) goes to slot
   slots[t] of the [slots, row_bytes] caches; a negative slot (a padding row) is skipped.
   Bytes, so one function serves every element type (float32, bfloat16). One memcpy per
   row: torch's index_copy_ over the strided views cost more in dispatch than the copy
   itself at decode sizes. */
void shoal_write_kv(const char *k, int64_t k_stride, const char *v, int64_t v_stride,
                    char *k_cache, char *v_cache, const int64_t *slots, int64_t rows,
                    int64_t row_bytes) {
#pragma omp parallel for schedule(static) if (rows * row_bytes >= PARALLEL_MIN * 16)
    for (int64_t t = 0; t < rows; ++t) {
        if (slots[t] < 0) continue;
        memcpy(k_cache + slots[t] * row_bytes, k + t * k_stride, (size_t)row_bytes);
        memcpy(v_cache + slots[t] * row_bytes, v + t * v_stride, (size_t)row_bytes);
    }
}
