/* The routed experts of a mixture-of-experts block on CPU, float32:
   out[t] = sum_j w[t, j] * down_e(silu(gate_e x[t]) * up_e x[t]), e = ids[t, j].

   Layout (runtime/model/moe.py stores it): w13 [E, 2I, H], each expert's I gate rows then
   its I up rows; w2 [E, H, I]; both in [out, in] orientation, contiguous.

   Why this shape: at decode each chosen expert sees a handful of tokens, so the cost is
   streaming that expert's weights once. torch._grouped_mm calls the BLAS once per expert
   on a few rows (5-22% of the dense GEMM rate, bench/moe_experts.py). Here the (token,
   expert) pairs are counting-sorted by expert, then every tile of NR weight rows of an
   expert is read once and multiplied into all of that expert's rows, MR rows at a time with
   MR x NR vector accumulators (the int_matmul_cpu.c scheme, the weights already float32).
   Work is split over (expert, output tile) pairs, not experts, so both cores stay busy with
   one token and eight experts, and an expert with many tokens does not serialise.

   Three passes, each an OpenMP loop over torch's pool (see native_cpu.py):
   1. gate and up tiles of each expert's rows, then silu(gate) * up * routing weight (the
      down projection is linear, so the weight scales the I-wide activations, as
      moe_grouped.py does);
   2. the down projection of those activations, one H-wide row per pair;
   3. each token's k rows summed in its own routing order.

   AVX2 + FMA intrinsics where -march=native has them, the same loops in portable C
   elsewhere; H and I must be multiples of 8 (moe_experts_cpu.py checks, and keeps other
   shapes on the torch path). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHOAL_AVX2 1
#endif

#define NR 4   /* weight rows per tile (H and I are multiples of 8, so tiles are whole) */
#define MR 3   /* activation rows per register block: 3 x 4 accumulators + 3 x + 1 w */

/* outr[i][j] = xr[i][:len] . w[j * w_stride :][:len] for i < mr, j < NR. Inlined with mr
   a constant, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(
        const float *const *xr, const float *w, int64_t w_stride, int64_t len,
        float *const *outr, const int mr) {
#ifdef SHOAL_AVX2
    __m256 acc[MR][NR];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < len; c += 8) {
        __m256 xv[MR];
        for (int i = 0; i < mr; ++i) xv[i] = _mm256_loadu_ps(xr[i] + c);
        for (int j = 0; j < NR; ++j) {
            const __m256 wv = _mm256_loadu_ps(w + j * w_stride + c);
            for (int i = 0; i < mr; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NR; ++j) {
            const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[i][j]),
                                        _mm256_extractf128_ps(acc[i][j], 1));
            const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
            outr[i][j] = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
        }
#else
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NR; ++j) {
            float sum = 0.0f;
            const float *xi = xr[i], *wj = w + j * w_stride;
#pragma omp simd reduction(+ : sum)
            for (int64_t c = 0; c < len; ++c) sum += xi[c] * wj[c];
            outr[i][j] = sum;
        }
#endif
}

/* For rows [0, rows): out_row(r)[0:NR] = in_row(r) . w[0:NR rows]. Rows are given as
   pointer tables (pass 1 reads x's rows by token, in the expert's order). */
static void rows_by_tile(const float *const *in, int64_t rows, const float *w, int64_t len,
                         float *const *out) {
    int64_t m = 0;
    for (; m + MR <= rows; m += MR) tile(in + m, w, len, len, out + m, MR);
    if (rows - m == 2) tile(in + m, w, len, len, out + m, 2);
    else if (rows - m == 1) tile(in + m, w, len, len, out + m, 1);
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* x [T, H], ids [T, k] (int64), weights [T, k] float32, w13 [E, 2I, H], w2 [E, H, I],
   out [T, H]. Ids outside [0, E) contribute nothing. Returns 0, or -1 when scratch memory
   could not be allocated (the caller falls back). */
int shoal_moe_experts_f32(const float *x, int64_t tokens, int64_t hidden, int64_t inter,
                          int64_t experts, int64_t top_k, const int64_t *ids,
                          const float *weights, const float *w13, const float *w2,
                          float *out) {
    const int64_t pairs = tokens * top_k;
    int64_t *start = calloc((size_t)experts + 1, sizeof(int64_t));
    int64_t *pos = malloc(sizeof(int64_t) * (size_t)(pairs ? pairs : 1));  /* pair -> row */
    int64_t *src = malloc(sizeof(int64_t) * (size_t)(pairs ? pairs : 1));  /* row -> pair */
    int64_t *active = malloc(sizeof(int64_t) * (size_t)experts);
    /* the activations [rows, I] and the down projection's outputs [rows, H] */
    float *act = malloc(sizeof(float) * (size_t)(pairs ? pairs : 1) * (size_t)inter);
    float *y = malloc(sizeof(float) * (size_t)(pairs ? pairs : 1) * (size_t)hidden);
    int rc = -1;
    if (!start || !pos || !src || !active || !act || !y) goto done;

    /* counting sort of the pairs by expert, in token order within an expert (stable) */
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t e = ids[p];
        if (e >= 0 && e < experts) ++start[e + 1];
    }
    for (int64_t e = 0; e < experts; ++e) start[e + 1] += start[e];
    {
        int64_t *fill = malloc(sizeof(int64_t) * (size_t)experts);
        if (!fill) goto done;
        for (int64_t e = 0; e < experts; ++e) fill[e] = start[e];
        for (int64_t p = 0; p < pairs; ++p) {
            const int64_t e = ids[p];
            if (e >= 0 && e < experts) {
                pos[p] = fill[e]++;
                src[pos[p]] = p;
            } else {
                pos[p] = -1;
            }
        }
        free(fill);
    }
    int64_t n_active = 0;
    for (int64_t e = 0; e < experts; ++e)
        if (start[e + 1] > start[e]) active[n_active++] = e;

    /* pass 1: work items (active expert, tile of NR intermediate columns) */
    const int64_t i_tiles = inter / NR;
#pragma omp parallel for schedule(dynamic, 4)
    for (int64_t item = 0; item < n_active * i_tiles; ++item) {
        const int64_t e = active[item / i_tiles], j0 = (item % i_tiles) * NR;
        const int64_t r0 = start[e], r1 = start[e + 1];
        const float *wg = w13 + (e * 2 * inter + j0) * hidden;
        const float *wu = wg + inter * hidden;
        const float *xin[MR];
        float g[MR][NR], u[MR][NR];
        float *go[MR] = {g[0], g[1], g[2]}, *uo[MR] = {u[0], u[1], u[2]};
        for (int64_t r = r0; r < r1; r += MR) {
            const int mr = r1 - r < MR ? (int)(r1 - r) : MR;
            for (int i = 0; i < mr; ++i) {
                xin[i] = x + (src[r + i] / top_k) * hidden;
            }
            rows_by_tile(xin, mr, wg, hidden, go);
            rows_by_tile(xin, mr, wu, hidden, uo);
            for (int i = 0; i < mr; ++i) {
                const float wt = weights[src[r + i]];
                float *a = act + (r + i) * inter + j0;
                for (int j = 0; j < NR; ++j) a[j] = silu(g[i][j]) * u[i][j] * wt;
            }
        }
    }

    /* pass 2: work items (active expert, tile of NR output features) */
    const int64_t h_tiles = hidden / NR;
#pragma omp parallel for schedule(dynamic, 8)
    for (int64_t item = 0; item < n_active * h_tiles; ++item) {
        const int64_t e = active[item / h_tiles], n0 = (item % h_tiles) * NR;
        const int64_t r0 = start[e], r1 = start[e + 1];
        const float *wd = w2 + (e * hidden + n0) * inter;
        const float *ain[MR];
        float *yo[MR];
        for (int64_t r = r0; r < r1; r += MR) {
            const int mr = r1 - r < MR ? (int)(r1 - r) : MR;
            for (int i = 0; i < mr; ++i) {
                ain[i] = act + (r + i) * inter;
                yo[i] = y + (r + i) * hidden + n0;
            }
            rows_by_tile(ain, mr, wd, inter, yo);
        }
    }

    /* pass 3: each token's rows summed in its routing order */
#pragma omp parallel for schedule(static) if (tokens * hidden >= 65536)
    for (int64_t t = 0; t < tokens; ++t) {
        float *o = out + t * hidden;
        for (int64_t c = 0; c < hidden; ++c) o[c] = 0.0f;
        for (int64_t j = 0; j < top_k; ++j) {
            const int64_t r = pos[t * top_k + j];
            if (r < 0) continue;
            const float *yr = y + r * hidden;
#pragma omp simd
            for (int64_t c = 0; c < hidden; ++c) o[c] += yr[c];
        }
    }
    rc = 0;
done:
    free(start), free(pos), free(src), free(active), free(act), free(y);
    return rc;
}
