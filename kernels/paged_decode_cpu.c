/* Paged decode attention for CPU, float32: one query token per request, K/V read in place.

   The pure-torch path gathers every request's context out of the paged cache into a dense
   buffer each layer and step, then reads it again in a batched matmul: three passes over
   the KV bytes. Decode attention is memory-bound on a CPU, so this kernel reads each K and V
   row exactly once, straight from its page, and keeps scores and the output accumulator in
   per-thread scratch. The scalar path prefetches the same row of the next block while it
   reads one (pages sit at random addresses; about 20% faster there); the vector path
   prefetches where KV rows are short (below).

   Two paths compute the same thing. The vector path (head_dim a multiple of 16, up to 256)
   scores 16 tokens at once and reduces their dot products together; the scalar path covers
   any other head size. Where the KV bytes sit in cache (small batches, short contexts) the
   vector path was 1.1-1.6x faster in runs here; from DRAM, ~19.5 GB/s against 17.6.

   Work is split over requests with OpenMP. Loaded into a process that has
   already loaded torch, the OpenMP runtime is torch's own (same soname), so both share one
   thread pool and torch.set_num_threads() applies here too.

   Layouts (contiguous):
     q, out        [rows_total, num_heads, head_dim]     a request's query is row q_rows[r];
                   q's rows may be q_token_stride floats apart (a view into the qkv rows)
     k/v cache     [num_blocks, block_size, num_kv_heads, head_dim]
     block_tables  [num_requests_in_table, table_stride]  int32; a request uses row table_rows[r]
   Positions attended by request r: [max(0, seq_len - window), seq_len) where window <= 0
   means no sliding window. Softmax is exact (max-subtracted, two passes over the scores). */

/* a*b+c as one FMA in this file (cpu_ops.c keeps torch's separate roundings) */
#pragma GCC optimize("fp-contract=fast")

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

/* s[t] = exp(s[t] - peak) in place; returns their sum (the caller applies 1/sum to the
   output at the end) */
static float exp_shifted(float *s, int64_t span, float peak) {
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < span; ++t) {
        s[t] = expf(s[t] - peak);
        sum += s[t];
    }
    return sum;
}

/* unnormalised softmax of each query head's scores, for the scalar path */
static void softmax_rows(float *scores, int64_t num_heads, int64_t span, float *inv_sum) {
    for (int64_t h = 0; h < num_heads; ++h) {
        float *s = scores + h * span;
        float peak = -INFINITY;
        for (int64_t t = 0; t < span; ++t) peak = s[t] > peak ? s[t] : peak;
        inv_sum[h] = 1.0f / exp_shifted(s, span, peak);
    }
}

/* The vector path: head_dim a multiple of 16, 16-float vectors (one AVX-512 register; two
   AVX2 registers elsewhere). The scalar path's dot products end in a sequential 16-lane
   horizontal sum per score, which cost more than the memory traffic; here 16 tokens' partial
   sums are reduced together by a shuffle tree, and the output accumulators stay in
   registers across a block's tokens. Where a token's K/V row (all kv heads) is at most
   PREFETCH_MAX_ROW floats, pass 1 also asks for the V rows pass 2 will read and for the
   next block's K rows, each kv head's once, while it computes: the hardware prefetchers
   alone left the loads waiting (about 13% faster at 4 kv heads x 64, 6% at 8 x 64, in runs
   here). The prefetches go to L2 (locality 2, prefetcht1), not L1: more of them can be in
   flight at once, and pass 2 finds the V rows in L2 anyway (128 requests x 400 tokens of
   4 x 64 from DRAM: 11 GB/s one thread, 19-20 GB/s two, against 7.5 and 15 into L1).
   With longer rows each of a chunk's rows sits on its own 4 KB page, and the same
   prefetches made 8 kv heads x 128 25% slower, so they are off there. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16_u __attribute__((vector_size(64), aligned(4)));  /* any address */
typedef int32_t i32x16 __attribute__((vector_size(64)));
#define LOAD16(p) (*(const f32x16_u *)(p))
#define STORE16(p, x) (*(f32x16_u *)(p) = (x))
#define MAX_VECS 16 /* head_dim up to 256 */
#define PREFETCH_MAX_ROW 512

static inline f32x16 max16(f32x16 a, f32x16 b) {
    const i32x16 a_wins = a > b;
    return (f32x16)((a_wins & (i32x16)a) | (~a_wins & (i32x16)b));
}

/* The tree below leaves token i in lane bit_reverse(i): partial sums are stored at the
   bit-reversed slot so that lane i of the result is token i. */
static const int bit_reverse16[16] = {0, 8, 4, 12, 2, 10, 6, 14, 1, 9, 5, 13, 3, 11, 7, 15};

/* lane i of the result = the sum of x[i]'s 16 lanes (with x in bit-reversed order) */
static inline f32x16 sum_lanes16(const f32x16 *x) {
    f32x16 y[8], z[4], w[2];
    for (int i = 0; i < 8; ++i)
        y[i] = __builtin_shufflevector(x[2 * i], x[2 * i + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16,
                                       17, 18, 19, 20, 21, 22, 23)
             + __builtin_shufflevector(x[2 * i], x[2 * i + 1], 8, 9, 10, 11, 12, 13, 14, 15,
                                       24, 25, 26, 27, 28, 29, 30, 31);
    for (int i = 0; i < 4; ++i)
        z[i] = __builtin_shufflevector(y[2 * i], y[2 * i + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8,
                                       9, 10, 11, 24, 25, 26, 27)
             + __builtin_shufflevector(y[2 * i], y[2 * i + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12,
                                       13, 14, 15, 28, 29, 30, 31);
    for (int i = 0; i < 2; ++i)
        w[i] = __builtin_shufflevector(z[2 * i], z[2 * i + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8,
                                       9, 24, 25, 12, 13, 28, 29)
             + __builtin_shufflevector(z[2 * i], z[2 * i + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10,
                                       11, 26, 27, 14, 15, 30, 31);
    return __builtin_shufflevector(w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12,
                                   28, 14, 30)
         + __builtin_shufflevector(w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13,
                                   29, 15, 31);
}

/* The vector path for one request. Inlined with head_dim a constant where it is common, so
   the loops over a row's vectors unroll and the accumulators live in registers. */
static inline __attribute__((always_inline)) void attend_one_vec(
        const float *q, float *out, const float *k_cache, const float *v_cache,
        const int32_t *table, int64_t first, int64_t seq_len, int64_t num_heads,
        int64_t num_kv_heads, const int64_t head_dim, int64_t block_size, float scale,
        float *scores) {
    const int64_t vecs = head_dim / 16;
    const int prefetch = num_kv_heads * head_dim <= PREFETCH_MAX_ROW;
    const int64_t span = seq_len - first;
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t first_block = first / block_size;
    const int64_t last_block = (seq_len - 1) / block_size;

    /* pass 1: scores[h][t] = scale * <q_h, k_t>, 16 tokens at a time; each head's running
       maximum kept lane-wise */
    f32x16 peaks[num_heads];
    for (int64_t h = 0; h < num_heads; ++h) peaks[h] = (f32x16){0} - INFINITY;
    for (int64_t b = first_block; b <= last_block; ++b) {
        const int64_t lo = b == first_block ? first - b * block_size : 0;
        const int64_t hi = b == last_block ? seq_len - b * block_size : block_size;
        const float *block_k = k_cache + (int64_t)table[b] * block_size * token_stride;
        const float *block_v = v_cache + (int64_t)table[b] * block_size * token_stride;
        const float *next_k = b < last_block
            ? k_cache + (int64_t)table[b + 1] * block_size * token_stride : NULL;
        for (int64_t c = lo; c < hi; c += 16) {
            const int64_t n = hi - c < 16 ? hi - c : 16;
            const int64_t t0 = b * block_size + c - first;
            for (int64_t h = 0; h < num_heads; ++h) {
                const int64_t head_at = c * token_stride + (h / group) * head_dim;
                const float *k_head = block_k + head_at;
                if (prefetch && h % group == 0)
                    for (int64_t i = 0; i < n; ++i)
                        for (int64_t v = 0; v < vecs; ++v) {
                            const int64_t at = head_at + i * token_stride + 16 * v;
                            __builtin_prefetch(block_v + at, 0, 2);
                            if (next_k != NULL) __builtin_prefetch(next_k + at, 0, 2);
                        }
                f32x16 qv[MAX_VECS];
                for (int64_t v = 0; v < vecs; ++v) qv[v] = LOAD16(q + h * head_dim + 16 * v);
                f32x16 partial[16];
                for (int64_t i = n; i < 16; ++i) partial[bit_reverse16[i]] = (f32x16){0};
                for (int64_t i = 0; i < n; ++i) {
                    const float *k = k_head + i * token_stride;
                    f32x16 dot = qv[0] * LOAD16(k);
                    for (int64_t v = 1; v < vecs; ++v) dot += qv[v] * LOAD16(k + 16 * v);
                    partial[bit_reverse16[i]] = dot;
                }
                f32x16 sums = sum_lanes16(partial) * scale;
                if (n == 16) {
                    STORE16(scores + h * span + t0, sums);
                } else {  /* the lanes past the block's end hold no token */
                    float lanes[16];
                    memcpy(lanes, &sums, sizeof lanes);
                    memcpy(scores + h * span + t0, lanes, (size_t)n * sizeof(float));
                    for (int64_t i = n; i < 16; ++i) lanes[i] = -INFINITY;
                    memcpy(&sums, lanes, sizeof lanes);
                }
                peaks[h] = max16(peaks[h], sums);
            }
        }
    }

    float inv_sum[num_heads];
    for (int64_t h = 0; h < num_heads; ++h) {
        float lanes[16], peak = -INFINITY;
        memcpy(lanes, &peaks[h], sizeof lanes);
        for (int i = 0; i < 16; ++i) peak = lanes[i] > peak ? lanes[i] : peak;
        inv_sum[h] = 1.0f / exp_shifted(scores + h * span, span, peak);
    }

    /* pass 2: out_h = sum_t p[h][t] * v_t, the accumulator in registers over each block */
    for (int64_t h = 0; h < num_heads; ++h)
        memset(out + h * head_dim, 0, (size_t)head_dim * sizeof(float));
    for (int64_t b = first_block; b <= last_block; ++b) {
        const int64_t lo = b == first_block ? first - b * block_size : 0;
        const int64_t hi = b == last_block ? seq_len - b * block_size : block_size;
        const float *block_v = v_cache + (int64_t)table[b] * block_size * token_stride;
        const int64_t t0 = b * block_size - first;
        for (int64_t h = 0; h < num_heads; ++h) {
            const float *v_head = block_v + (h / group) * head_dim;
            const float *p = scores + h * span + t0;
            f32x16 acc[MAX_VECS];
            for (int64_t v = 0; v < vecs; ++v) acc[v] = LOAD16(out + h * head_dim + 16 * v);
            for (int64_t off = lo; off < hi; ++off) {
                const float *row = v_head + off * token_stride;
                for (int64_t v = 0; v < vecs; ++v) acc[v] += p[off] * LOAD16(row + 16 * v);
            }
            for (int64_t v = 0; v < vecs; ++v) STORE16(out + h * head_dim + 16 * v, acc[v]);
        }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
        const f32x16 norm = (f32x16){0} + inv_sum[h];
        for (int64_t v = 0; v < vecs; ++v)
            STORE16(out + h * head_dim + 16 * v, LOAD16(out + h * head_dim + 16 * v) * norm);
    }
}

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

    float inv_sum[num_heads];
    softmax_rows(scores, num_heads, span, inv_sum);

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
int shoal_paged_decode_f32(const float *q, int64_t q_token_stride, float *out,
                           const float *k_cache,
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
            const float *q_row = q + q_rows[r] * q_token_stride;
            const int64_t row = q_rows[r] * num_heads * head_dim;
            const int32_t *table = block_tables + table_rows[r] * table_stride;
            if (head_dim == 64)
                attend_one_vec(q_row, out + row, k_cache, v_cache, table, first, seq_len,
                               num_heads, num_kv_heads, 64, block_size, scale, scores);
            else if (head_dim == 128)
                attend_one_vec(q_row, out + row, k_cache, v_cache, table, first, seq_len,
                               num_heads, num_kv_heads, 128, block_size, scale, scores);
            else if (head_dim % 16 == 0 && head_dim <= 16 * MAX_VECS)
                attend_one_vec(q_row, out + row, k_cache, v_cache, table, first, seq_len,
                               num_heads, num_kv_heads, head_dim, block_size, scale, scores);
            else
                attend_one(q_row, out + row, k_cache, v_cache, table, first, seq_len,
                           num_heads, num_kv_heads, head_dim, block_size, scale, scores, acc);
        }
        free(scores);
        free(acc);
    }
    return failed;
}
