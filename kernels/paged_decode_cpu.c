/* Paged decode attention for CPU, float32: one query token per request, K/V read in place.

   The pure-torch path gathers every request's context out of the paged cache into a dense
   buffer each layer and step, then reads it again in a batched matmul: three passes over
   the KV bytes. Decode attention is memory-bound on a CPU, so this kernel reads each K and V
   row exactly once, straight from its page, and keeps scores and the output accumulator in
   per-thread scratch. Pages sit at random addresses, so the hardware prefetcher stops at
   every page boundary: while one block is read, the same row of the next block is prefetched
   (about 20% faster here).

   Work is split over requests with OpenMP. Loaded into a process that has
   already loaded torch, the OpenMP runtime is torch's own (same soname), so both share one
   thread pool and torch.set_num_threads() applies here too.

   Layouts (contiguous):
     q, out        [rows_total, num_heads, head_dim]     a request's query is row q_rows[r]
     k/v cache     [num_blocks, block_size, num_kv_heads, head_dim]
     block_tables  [num_requests_in_table, table_stride]  int32; a request uses row table_rows[r]
   Positions attended by request r: [max(0, seq_len - window), seq_len) where window <= 0
   means no sliding window. Softmax is exact (max-subtracted, two passes over the scores). */

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* glibc's vector math library (libmvec) has SIMD variants of expf; declaring them lets the
   compiler vectorise the softmax without -ffast-math (which would also relax NaN/inf rules). */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

static void attend_one(const float *q, float *out, const float *k_cache, const float *v_cache,
                       const int32_t *table, int64_t first, int64_t seq_len, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                       float *scores, float *acc) {
    /* One request, all heads: a cached token's K (or V) row for every kv head is one
       contiguous run of num_kv_heads * head_dim floats, read once, front to back. */
    const int64_t span = seq_len - first;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t first_block = first / block_size;
    const int64_t last_block = (seq_len - 1) / block_size;

    /* pass 1: scores[h][t] = scale * <q_h, k_t> */
    for (int64_t b = first_block; b <= last_block; ++b) {
        const int64_t lo = b == first_block ? first - b * block_size : 0;
        const int64_t hi = b == last_block ? seq_len - b * block_size : block_size;
        const float *block_k = k_cache + (int64_t)table[b] * block_size * token_stride;
        const float *next_k = b < last_block
            ? k_cache + (int64_t)table[b + 1] * block_size * token_stride : block_k;
        for (int64_t off = lo; off < hi; ++off) {
            const int64_t t = b * block_size + off - first;
            const float *k_row = block_k + off * token_stride;
            for (int64_t line = 0; line < token_stride; line += 16)
                __builtin_prefetch(next_k + off * token_stride + line, 0, 1);
            for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
                const float *k = k_row + kv * head_dim;
                for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
                    const float *qh = q + h * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * k[d];
                    scores[h * span + t] = dot * scale;
                }
            }
        }
    }

    /* softmax per query head; the 1/sum is applied to the output at the end */
    float inv_sum[num_heads];
    for (int64_t h = 0; h < num_heads; ++h) {
        float *s = scores + h * span;
        float peak = -INFINITY;
        for (int64_t t = 0; t < span; ++t) peak = s[t] > peak ? s[t] : peak;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < span; ++t) {
            s[t] = expf(s[t] - peak);
            sum += s[t];
        }
        inv_sum[h] = 1.0f / sum;
    }

    /* pass 2: out_h = sum_t p[h][t] * v_t */
    memset(acc, 0, (size_t)(num_heads * head_dim) * sizeof(float));
    for (int64_t b = first_block; b <= last_block; ++b) {
        const int64_t lo = b == first_block ? first - b * block_size : 0;
        const int64_t hi = b == last_block ? seq_len - b * block_size : block_size;
        const float *block_v = v_cache + (int64_t)table[b] * block_size * token_stride;
        const float *next_v = b < last_block
            ? v_cache + (int64_t)table[b + 1] * block_size * token_stride : block_v;
        for (int64_t off = lo; off < hi; ++off) {
            const int64_t t = b * block_size + off - first;
            const float *v_row = block_v + off * token_stride;
            for (int64_t line = 0; line < token_stride; line += 16)
                __builtin_prefetch(next_v + off * token_stride + line, 0, 1);
            for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
                const float *v = v_row + kv * head_dim;
                for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
                    const float p = scores[h * span + t];
                    float *a = acc + h * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
                }
            }
        }
    }
    for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
            out[h * head_dim + d] = acc[h * head_dim + d] * inv_sum[h];
}

/* Returns 0 on success, 1 when scratch memory could not be allocated. */
int shoal_paged_decode_f32(const float *q, float *out, const float *k_cache,
                           const float *v_cache, const int32_t *block_tables,
                           int64_t table_stride, const int64_t *q_rows,
                           const int64_t *table_rows, const int32_t *seq_lens,
                           int64_t num_requests, int64_t num_heads, int64_t num_kv_heads,
                           int64_t head_dim, int64_t block_size, float scale, int64_t window) {
    int64_t longest = 1;
    for (int64_t r = 0; r < num_requests; ++r)
        longest = seq_lens[r] > longest ? seq_lens[r] : longest;
    int failed = 0;

#pragma omp parallel reduction(| : failed)
    {
        float *scores = malloc((size_t)(num_heads * longest) * sizeof(float));
        float *acc = malloc((size_t)(num_heads * head_dim) * sizeof(float));
        if (scores == NULL || acc == NULL) failed = 1;
#pragma omp for schedule(dynamic, 1)
        for (int64_t r = 0; r < num_requests; ++r) {
            if (scores == NULL || acc == NULL) continue;
            const int64_t seq_len = seq_lens[r];
            const int64_t first = window > 0 && seq_len > window ? seq_len - window : 0;
            const int64_t row = q_rows[r] * num_heads * head_dim;
            attend_one(q + row, out + row, k_cache, v_cache,
                       block_tables + table_rows[r] * table_stride, first, seq_len, num_heads,
                       num_kv_heads, head_dim, block_size, scale, scores, acc);
        }
        free(scores);
        free(acc);
    }
    return failed;
}
