/* Paged decode attention for CPU: one query token per request, K/V read in place from a
   float32, bfloat16 or float8 cache (widened to float32 as each row is loaded, a float8
   element through its layer's table, times the K or V scale; q, out and all arithmetic are
   float32 either way, so a narrower cache only cuts the bytes read).

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
   means no sliding window. Softmax is exact (max-subtracted, two passes over the scores).
   sinks (gpt-oss; NULL: none): one logit per query head that joins its softmax's
   denominator (and the maximum subtracted) but attends to nothing. */

/* a*b+c as one FMA in this file (cpu_ops.c keeps torch's separate roundings) */
#pragma GCC optimize("fp-contract=fast")

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

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

/* 1 / the softmax denominator of a head whose scores' maximum is `peak`, the scores
   exponentiated in place; with a sink, it counts in both */
static float inv_denominator(float *s, int64_t span, float peak, const float *sink) {
    if (sink == NULL) return 1.0f / exp_shifted(s, span, peak);
    peak = *sink > peak ? *sink : peak;
    return 1.0f / (exp_shifted(s, span, peak) + expf(*sink - peak));
}

/* unnormalised softmax of each query head's scores, for the scalar path */
static void softmax_rows(float *scores, int64_t num_heads, int64_t span, float *inv_sum,
                         const float *sinks) {
    for (int64_t h = 0; h < num_heads; ++h) {
        float *s = scores + h * span;
        float peak = -INFINITY;
        for (int64_t t = 0; t < span; ++t) peak = s[t] > peak ? s[t] : peak;
        inv_sum[h] = inv_denominator(s, span, peak, sinks ? sinks + h : NULL);
    }
}

/* The vector path: head_dim a multiple of 16, 16-float vectors (one AVX-512 register; two
   AVX2 registers elsewhere). The scalar path's dot products end in a sequential 16-lane
   horizontal sum per score, which cost more than the memory traffic; here 16 tokens' partial
   sums are reduced together by a shuffle tree, and the output accumulators stay in
   registers across a block's tokens. Query heads go in pairs: a GQA group's two heads share
   each K and V row load, and two heads' trees run side by side.

   Where a token's K/V row (all kv heads) is at most PREFETCH_MAX_ROW floats, pass 1 also
   asks for the V rows pass 2 will read and for the next block's K rows, each kv head's
   once, a row at a time next to the K row it is loading: the hardware prefetchers alone
   left the loads waiting. Issued a chunk's worth at a time, the same prefetches stalled
   the loads behind them; spread over the rows, compute and DRAM traffic overlap (128
   requests x 200-400 tokens of 4 x 64 from DRAM, two threads: 15-17 GB/s against 13.5-14.6
   chunk-wise; one thread 11.4-12.5 against 8.9-10.4; a plain read of the same pages with
   the same prefetches reached 30 and 13.7). The prefetches go to L2 (locality 2,
   prefetcht1), not L1: more of them can be in flight at once, and pass 2 finds the V rows
   in L2 anyway. With longer rows each of a chunk's rows sits on its own 4 KB page, and the
   prefetches made 8 kv heads x 128 25% slower, so they are off there. */
typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16_u __attribute__((vector_size(64), aligned(4)));  /* any address */
typedef int32_t i32x16 __attribute__((vector_size(64)));
#define LOAD16(p) (*(const f32x16_u *)(p))
#define STORE16(p, x) (*(f32x16_u *)(p) = (x))
#define MAX_VECS 16 /* head_dim up to 256 */

/* K/V rows are addressed by element index from the cache's base; kind says what the cache
   holds. A bfloat16's bits are a float32's top half (widening is a 16-bit shift); a float8
   byte indexes its layer's table (kv_fp8_cpu.c: the byte's value times the K or V scale,
   exact for all 256 bytes). Every caller passes kind as a constant into always-inline code:
   each type gets its own loops. */
enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2 };
void shoal_fp8_table(int64_t kv_kind, float scale, float *table);
typedef uint16_t u16x16_u __attribute__((vector_size(32), aligned(2)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));

static inline __attribute__((always_inline)) int64_t kv_bytes(int kind) {
    return kind == KV_F32 ? 4 : kind == KV_BF16 ? 2 : 1;
}

static inline __attribute__((always_inline)) f32x16 kv_load16(const void *base, int64_t at,
                                                              int kind, const float *lut) {
    if (kind == KV_BF16) {
        const u16x16_u half = *(const u16x16_u *)((const uint16_t *)base + at);
        return (f32x16)(__builtin_convertvector(half, u32x16) << 16);
    }
    if (kind == KV_FP8) {
        const uint8_t *bytes = (const uint8_t *)base + at;
#if defined(__AVX512F__)
        const __m512i index = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)bytes));
        return (f32x16)_mm512_i32gather_ps(index, lut, 4);
#else
        float lanes[16];
        for (int i = 0; i < 16; ++i) lanes[i] = lut[bytes[i]];
        f32x16 x;
        memcpy(&x, lanes, sizeof x);
        return x;
#endif
    }
    return LOAD16((const float *)base + at);
}

static inline __attribute__((always_inline)) float kv_at(const void *base, int64_t at,
                                                         int kind, const float *lut) {
    if (kind == KV_F32) return ((const float *)base)[at];
    if (kind == KV_FP8) return lut[((const uint8_t *)base)[at]];
    const uint32_t bits = (uint32_t)((const uint16_t *)base)[at] << 16;
    float value;
    memcpy(&value, &bits, sizeof value);
    return value;
}

static inline __attribute__((always_inline)) const char *kv_addr(const void *base, int64_t at,
                                                                 int kind) {
    return (const char *)base + at * kv_bytes(kind);
}
#define PREFETCH_MAX_ROW 512

/* Gemma 2's attention softcap on 16 scores: cap * tanh(s / cap) (cap <= 0: unchanged) */
static inline f32x16 softcap16(f32x16 s, float cap) {
    if (cap <= 0.0f) return s;
    float lanes[16];
    memcpy(lanes, &s, sizeof lanes);
    for (int i = 0; i < 16; ++i) lanes[i] = cap * tanhf(lanes[i] / cap);
    memcpy(&s, lanes, sizeof lanes);
    return s;
}

static inline f32x16 max16(f32x16 a, f32x16 b) {
    const i32x16 a_wins = a > b;
    return (f32x16)((a_wins & (i32x16)a) | (~a_wins & (i32x16)b));
}

/* One level of the tree: two vectors of partial sums -> one, each lane the sum of a lane
   taken by the first shuffle and one taken by the second (level k adds lane groups of
   16 >> k; four levels leave token i's whole sum in lane i). */
#define TREE(a, b, first, second) \
    (__builtin_shufflevector(a, b, first) + __builtin_shufflevector(a, b, second))
#define TREE1_FIRST 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23
#define TREE1_SECOND 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define TREE2_FIRST 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27
#define TREE2_SECOND 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define TREE3_FIRST 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29
#define TREE3_SECOND 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define TREE4_FIRST 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30
#define TREE4_SECOND 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
#define TREE1(a, b) TREE(a, b, TREE1_FIRST, TREE1_SECOND)
#define TREE2(a, b) TREE(a, b, TREE2_FIRST, TREE2_SECOND)
#define TREE3(a, b) TREE(a, b, TREE3_FIRST, TREE3_SECOND)
#define TREE4(a, b) TREE(a, b, TREE4_FIRST, TREE4_SECOND)

/* Two query heads' dot products with one token's K rows (ka for head a, kb for head b).
   With same_kv (both heads in one GQA group) the row is loaded once for both. */
typedef struct { f32x16 a, b; } f32x16_pair;

/* one head's row of `bytes` bytes, a 64-byte line at a time */
static inline __attribute__((always_inline)) void prefetch_row(const char *p, int64_t bytes) {
    if (p != NULL)
        for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at, 0, 2);
}

static inline __attribute__((always_inline)) f32x16_pair dot_pair(
        const f32x16 *qa, const f32x16 *qb, const void *cache, const float *lut, int64_t ka,
        int64_t kb, int64_t vecs, int same_kv, int kind) {
    f32x16 ka0 = kv_load16(cache, ka, kind, lut);
    f32x16 kb0 = same_kv ? ka0 : kv_load16(cache, kb, kind, lut);
    f32x16_pair d = {qa[0] * ka0, qb[0] * kb0};
    for (int64_t v = 1; v < vecs; ++v) {
        const f32x16 kav = kv_load16(cache, ka + 16 * v, kind, lut);
        const f32x16 kbv = same_kv ? kav : kv_load16(cache, kb + 16 * v, kind, lut);
        d.a += qa[v] * kav;
        d.b += qb[v] * kbv;
    }
    return d;
}

/* Scores of 16 tokens (rows ka/kb + i * token_stride, i < n) for two heads: lane i of .a / .b is
   token i's dot product with head a / b. The partial-sum vectors are made in the order the
   tree consumes them, so each level's inputs die as soon as they are added and only a few
   vectors per head are live at once. */
static inline __attribute__((always_inline)) f32x16_pair scores16_pair(
        const f32x16 *qa, const f32x16 *qb, const void *cache, const float *lut, int64_t ka,
        int64_t kb, int64_t token_stride, int64_t n, int64_t vecs, int same_kv,
        const char *const pf[4], int kind) {
    const int64_t stride_bytes = token_stride * kv_bytes(kind);
    const int64_t head_bytes = 16 * vecs * kv_bytes(kind);
#define DOT(t) ((t) < n ? (prefetch_row(pf[0] ? pf[0] + (t) * stride_bytes : NULL, head_bytes), \
                           prefetch_row(pf[1] ? pf[1] + (t) * stride_bytes : NULL, head_bytes), \
                           prefetch_row(pf[2] ? pf[2] + (t) * stride_bytes : NULL, head_bytes), \
                           prefetch_row(pf[3] ? pf[3] + (t) * stride_bytes : NULL, head_bytes), \
                           dot_pair(qa, qb, cache, lut, ka + (t) * token_stride, \
                                    kb + (t) * token_stride, vecs, same_kv, kind)) \
                        : (f32x16_pair){{0}, {0}})
#define L1(t0, t1) ({ f32x16_pair x0 = DOT(t0), x1 = DOT(t1); \
                      (f32x16_pair){TREE1(x0.a, x1.a), TREE1(x0.b, x1.b)}; })
#define L2(t0, t1, t2, t3) ({ f32x16_pair y0 = L1(t0, t1), y1 = L1(t2, t3); \
                              (f32x16_pair){TREE2(y0.a, y1.a), TREE2(y0.b, y1.b)}; })
#define L3(t) ({ f32x16_pair z0 = L2(t, t + 8, t + 4, t + 12), \
                             z1 = L2(t + 2, t + 10, t + 6, t + 14); \
                 (f32x16_pair){TREE3(z0.a, z1.a), TREE3(z0.b, z1.b)}; })
    const f32x16_pair w0 = L3(0), w1 = L3(1);
#undef L3
#undef L2
#undef L1
#undef DOT
    return (f32x16_pair){TREE4(w0.a, w1.a), TREE4(w0.b, w1.b)};
}

/* The vector path for one request. Query heads go in pairs (a GQA group's two heads load
   each K and V row once: 8 requests x 400 tokens in cache, 57-60 GB/s against 50-54 one
   head at a time). Inlined with head_dim a constant where it is common, so the loops over
   a row's vectors unroll and the accumulators live in registers. */
static inline __attribute__((always_inline)) void attend_one_vec(
        const float *q, float *out, const void *k_cache, const void *v_cache,
        const float *k_lut, const float *v_lut, const int32_t *table, int64_t first, int64_t seq_len, int64_t num_heads,
        int64_t num_kv_heads, const int64_t head_dim, int64_t block_size, float scale,
        float softcap, const float *sinks, float *scores, const int kind) {
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
        const int64_t block_kv = (int64_t)table[b] * block_size * token_stride;
        const int64_t next_k = b < last_block
            ? (int64_t)table[b + 1] * block_size * token_stride : -1;
        for (int64_t c = lo; c < hi; c += 16) {
            const int64_t n = hi - c < 16 ? hi - c : 16;
            const int64_t t0 = b * block_size + c - first;
            for (int64_t ha = 0; ha < num_heads; ha += 2) {
                const int64_t hb = ha + 1 < num_heads ? ha + 1 : ha;
                /* once per kv head, spread over its rows' loads: the V rows pass 2 will
                   read and the next block's K rows */
                const int64_t row_a = c * token_stride + (ha / group) * head_dim;
                const int64_t row_b = c * token_stride + (hb / group) * head_dim;
                const char *pf[4] = {NULL, NULL, NULL, NULL};
                if (prefetch && ha % group == 0) {
                    pf[0] = kv_addr(v_cache, block_kv + row_a, kind);
                    pf[1] = next_k >= 0 ? kv_addr(k_cache, next_k + row_a, kind) : NULL;
                }
                if (prefetch && hb != ha && hb % group == 0 && hb / group != ha / group) {
                    pf[2] = kv_addr(v_cache, block_kv + row_b, kind);
                    pf[3] = next_k >= 0 ? kv_addr(k_cache, next_k + row_b, kind) : NULL;
                }
                const int64_t ka = block_kv + row_a, kb = block_kv + row_b;
                f32x16 qa[MAX_VECS], qb[MAX_VECS];
                for (int64_t v = 0; v < vecs; ++v) {
                    qa[v] = LOAD16(q + ha * head_dim + 16 * v);
                    qb[v] = LOAD16(q + hb * head_dim + 16 * v);
                }
                const f32x16_pair s = ka == kb
                    ? scores16_pair(qa, qb, k_cache, k_lut, ka, ka, token_stride, n, vecs, 1, pf,
                                    kind)
                    : scores16_pair(qa, qb, k_cache, k_lut, ka, kb, token_stride, n, vecs, 0, pf,
                                    kind);
                f32x16 sa = softcap16(s.a * scale, softcap), sb = softcap16(s.b * scale, softcap);
                if (n == 16) {
                    STORE16(scores + ha * span + t0, sa);
                    STORE16(scores + hb * span + t0, sb);
                } else {  /* the lanes past the block's end hold no token */
                    float la[16], lb[16];
                    memcpy(la, &sa, sizeof la);
                    memcpy(lb, &sb, sizeof lb);
                    memcpy(scores + ha * span + t0, la, (size_t)n * sizeof(float));
                    memcpy(scores + hb * span + t0, lb, (size_t)n * sizeof(float));
                    for (int64_t i = n; i < 16; ++i) la[i] = lb[i] = -INFINITY;
                    memcpy(&sa, la, sizeof la);
                    memcpy(&sb, lb, sizeof lb);
                }
                peaks[ha] = max16(peaks[ha], sa);
                peaks[hb] = max16(peaks[hb], sb);
            }
        }
    }

    float inv_sum[num_heads];
    for (int64_t h = 0; h < num_heads; ++h) {
        float lanes[16], peak = -INFINITY;
        memcpy(lanes, &peaks[h], sizeof lanes);
        for (int i = 0; i < 16; ++i) peak = lanes[i] > peak ? lanes[i] : peak;
        inv_sum[h] = inv_denominator(scores + h * span, span, peak, sinks ? sinks + h : NULL);
    }

    /* pass 2: out_h = sum_t p[h][t] * v_t, two heads' accumulators in registers over each
       block, each V row loaded once for both where they share it */
    for (int64_t h = 0; h < num_heads; ++h)
        memset(out + h * head_dim, 0, (size_t)head_dim * sizeof(float));
    for (int64_t b = first_block; b <= last_block; ++b) {
        const int64_t lo = b == first_block ? first - b * block_size : 0;
        const int64_t hi = b == last_block ? seq_len - b * block_size : block_size;
        const int64_t block_v = (int64_t)table[b] * block_size * token_stride;
        const int64_t t0 = b * block_size - first;
        for (int64_t ha = 0; ha < num_heads; ha += 2) {
            const int64_t hb = ha + 1 < num_heads ? ha + 1 : ha;
            const int64_t va = block_v + (ha / group) * head_dim;
            const int64_t vb = block_v + (hb / group) * head_dim;
            const float *pa = scores + ha * span + t0, *pb = scores + hb * span + t0;
            f32x16 acc_a[MAX_VECS], acc_b[MAX_VECS];
            for (int64_t v = 0; v < vecs; ++v) {
                acc_a[v] = LOAD16(out + ha * head_dim + 16 * v);
                acc_b[v] = LOAD16(out + hb * head_dim + 16 * v);
            }
            if (va == vb)
                for (int64_t off = lo; off < hi; ++off)
                    for (int64_t v = 0; v < vecs; ++v) {
                        const f32x16 row = kv_load16(v_cache, va + off * token_stride + 16 * v,
                                                     kind, v_lut);
                        acc_a[v] += pa[off] * row;
                        acc_b[v] += pb[off] * row;
                    }
            else
                for (int64_t off = lo; off < hi; ++off)
                    for (int64_t v = 0; v < vecs; ++v) {
                        acc_a[v] += pa[off] * kv_load16(v_cache, va + off * token_stride + 16 * v,
                                                        kind, v_lut);
                        acc_b[v] += pb[off] * kv_load16(v_cache, vb + off * token_stride + 16 * v,
                                                        kind, v_lut);
                    }
            /* hb == ha (an odd last head): both accumulators hold the same sums */
            for (int64_t v = 0; v < vecs; ++v) {
                STORE16(out + ha * head_dim + 16 * v, acc_a[v]);
                STORE16(out + hb * head_dim + 16 * v, acc_b[v]);
            }
        }
    }
    for (int64_t h = 0; h < num_heads; ++h) {
        const f32x16 norm = (f32x16){0} + inv_sum[h];
        for (int64_t v = 0; v < vecs; ++v)
            STORE16(out + h * head_dim + 16 * v, LOAD16(out + h * head_dim + 16 * v) * norm);
    }
}

static inline __attribute__((always_inline)) void attend_one(
        const float *q, float *out, const void *k_cache, const void *v_cache,
        const float *k_lut, const float *v_lut, const int32_t *table, int64_t first, int64_t seq_len, int64_t num_heads,
        int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
        float softcap, const float *sinks, float *scores, float *acc,
        const int kind) {
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
        const int64_t block_k = (int64_t)table[b] * block_size * token_stride;
        const int64_t next_k = b < last_block
            ? (int64_t)table[b + 1] * block_size * token_stride : block_k;
        for (int64_t off = lo; off < hi; ++off) {
            const int64_t t = b * block_size + off - first;
            const int64_t k_row = block_k + off * token_stride;
            prefetch_row(kv_addr(k_cache, next_k + off * token_stride, kind),
                         token_stride * kv_bytes(kind));
            for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
                const int64_t k = k_row + kv * head_dim;
                for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
                    const float *qh = q + h * head_dim;
                    float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
                    for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * kv_at(k_cache, k + d, kind, k_lut);
                    dot *= scale;
                    scores[h * span + t] = softcap > 0.0f ? softcap * tanhf(dot / softcap) : dot;
                }
            }
        }
    }

    float inv_sum[num_heads];
    softmax_rows(scores, num_heads, span, inv_sum, sinks);

    /* pass 2: out_h = sum_t p[h][t] * v_t */
    memset(acc, 0, (size_t)(num_heads * head_dim) * sizeof(float));
    for (int64_t b = first_block; b <= last_block; ++b) {
        const int64_t lo = b == first_block ? first - b * block_size : 0;
        const int64_t hi = b == last_block ? seq_len - b * block_size : block_size;
        const int64_t block_v = (int64_t)table[b] * block_size * token_stride;
        const int64_t next_v = b < last_block
            ? (int64_t)table[b + 1] * block_size * token_stride : block_v;
        for (int64_t off = lo; off < hi; ++off) {
            const int64_t t = b * block_size + off - first;
            const int64_t v_row = block_v + off * token_stride;
            prefetch_row(kv_addr(v_cache, next_v + off * token_stride, kind),
                         token_stride * kv_bytes(kind));
            for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
                const int64_t v = v_row + kv * head_dim;
                for (int64_t h = kv * group; h < (kv + 1) * group; ++h) {
                    const float p = scores[h * span + t];
                    float *a = acc + h * head_dim;
#pragma omp simd
                    for (int64_t d = 0; d < head_dim; ++d) a[d] += p * kv_at(v_cache, v + d, kind, v_lut);
                }
            }
        }
    }
    for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t d = 0; d < head_dim; ++d)
            out[h * head_dim + d] = acc[h * head_dim + d] * inv_sum[h];
}

/* Returns 0 on success, 1 when scratch memory could not be allocated. */
static inline __attribute__((always_inline)) int paged_decode(
        const float *q, int64_t q_token_stride, float *out, const void *k_cache,
        const void *v_cache, const float *k_lut, const float *v_lut,
        const int32_t *block_tables, int64_t table_stride,
        const int64_t *q_rows, const int64_t *table_rows, const int32_t *seq_lens,
        int64_t num_requests, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
        int64_t block_size, float scale, int64_t window, float softcap, const float *sinks,
        const int kind) {
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
            /* head sizes as constants (unrolled loops) for float32 only: each such copy
               costs ~30 s of compile time on a loaded machine, and a bfloat16 or float8
               cache is bound by its reads more than by the loop overhead */
#define ATTEND_VEC(dim, cache_kind)                                                         \
            attend_one_vec(q_row, out + row, k_cache, v_cache, k_lut, v_lut, table, first,  \
                           seq_len, num_heads, num_kv_heads, dim, block_size, scale, softcap, \
                           sinks, scores, cache_kind)
            if (head_dim == 64 && kind == KV_F32)
                ATTEND_VEC(64, KV_F32);
            else if (head_dim == 128 && kind == KV_F32)
                ATTEND_VEC(128, KV_F32);
            else if (head_dim % 16 == 0 && head_dim <= 16 * MAX_VECS)
                ATTEND_VEC(head_dim, kind);
            else
                attend_one(q_row, out + row, k_cache, v_cache, k_lut, v_lut, table, first,
                           seq_len, num_heads, num_kv_heads, head_dim, block_size, scale,
                           softcap, sinks, scores, acc, kind);
#undef ATTEND_VEC
        }
        free(scores);
        free(acc);
    }
    return failed;
}

/* The exported entry point. kv_kind: the caches hold float32 (0), bfloat16 (1), float8 e4m3
   (2) or float8 e5m2 (3); with float8, kv_scales is the layer's (k_scale, v_scale), read
   here on each call (NULL: both 1). */
int shoal_paged_decode(const float *q, int64_t q_token_stride, float *out, const void *k_cache,
                       const void *v_cache, const int32_t *block_tables, int64_t table_stride,
                       const int64_t *q_rows, const int64_t *table_rows,
                       const int32_t *seq_lens, int64_t num_requests, int64_t num_heads,
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, float scale,
                       int64_t window, float softcap, int64_t kv_kind,
                       const float *sinks, const float *kv_scales) {
#define DECODE(cache_kind, k_lut, v_lut)                                                    \
    paged_decode(q, q_token_stride, out, k_cache, v_cache, k_lut, v_lut, block_tables,      \
                 table_stride, q_rows, table_rows, seq_lens, num_requests, num_heads,        \
                 num_kv_heads, head_dim, block_size, scale, window, softcap, sinks, cache_kind)
    if (kv_kind == KV_F32) return DECODE(KV_F32, NULL, NULL);
    if (kv_kind == KV_BF16) return DECODE(KV_BF16, NULL, NULL);
    float k_lut[256], v_lut[256];
    shoal_fp8_table(kv_kind, kv_scales ? kv_scales[0] : 1.0f, k_lut);
    shoal_fp8_table(kv_kind, kv_scales ? kv_scales[1] : 1.0f, v_lut);
    return DECODE(KV_FP8, k_lut, v_lut);
#undef DECODE
}
