/* Paged prefill attention for CPU: chunks of query tokens attending causally over their
   request's cached prefix and themselves, K/V read in place from the pages of a float32,
   bfloat16 or float8 cache (each 16-key chunk is copied out anyway, widened to float32 on
   the way, a float8 element through its layer's table: see kv_fp8_cpu.c; q, out and the
   arithmetic are float32).

   torch's CPU flash SDPA works on whole 512-key blocks, so a causal prompt costs as much as
   a full one, and a chunk with a cached prefix first has its pages gathered into a dense
   copy and a boolean mask built. Here the work is tiles of 16 query rows x 16 keys, and
   only tiles with a key at or before some row's position are computed.

   A tile's 16 rows are (query token, query head) pairs of one kv head's group, in flat
   order, so one K/V read serves the whole group. The rows sit in vector lanes: the queries
   are transposed once per tile of rows (qt[d] = the 16 rows' d-th component), and then
     scores[j] = sum_d k_j[d] * qt[d]                (a broadcast K scalar times a vector)
     ot[d]     = ot[d] * alpha + sum_j v_j[d] * p[j]  (a broadcast V scalar times a vector)
   need no horizontal sums, and the online softmax (running max m, running sum l, rescale
   alpha = exp(m_old - m_new)) is lane-wise as well. Keys are addressed one by one through
   the block table, so any block size works.

   Tiles are handed out to OpenMP threads (torch's pool: see paged_decode_cpu.c) one at a
   time, each span's last rows (the most keys) first.

   Layouts (contiguous unless said):
     q             [rows_total, num_heads, head_dim]; tokens q_token_stride floats apart
     out           [rows_total, num_heads, head_dim]
     k/v cache     [num_blocks, block_size, num_kv_heads, head_dim]
     block_tables  [num_requests_in_table, table_stride] int32
     spans         [count, 4] int64: first flat row, query tokens, block-table row, seq_len
   Query token i of a span sits at position seq_len - query_tokens + i and attends keys
   (position - window, position], or [0, position] when window <= 0. head_dim is a
   multiple of 16 up to 256 (the caller checks). */

#pragma GCC optimize("fp-contract=fast")

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__x86_64__) && defined(__GNUC__)
#pragma omp declare simd notinbranch
extern float expf(float);
#endif

#define LANES 16
#define MAX_HEAD_DIM 256

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x16_u __attribute__((vector_size(64), aligned(4)));  /* any address */
typedef int32_t i32x16 __attribute__((vector_size(64)));
#define LOAD16(p) (*(const f32x16_u *)(p))
#define STORE16(p, x) (*(f32x16_u *)(p) = (x))

/* the cache's element type (kv_kind below; both float8 formats read through a table) */
enum { KV_F32 = 0, KV_BF16 = 1, KV_FP8 = 2 };
void shoal_fp8_table(int64_t kv_kind, float scale, float *table);

typedef struct {
    int64_t span, kv_head, first_row; /* first_row: index into the span's (token, head) rows */
} Tile;

static inline f32x16 select16(i32x16 take_a, f32x16 a, f32x16 b) {
    return (f32x16)((take_a & (i32x16)a) | (~take_a & (i32x16)b));
}

/* x[16] rows -> their transpose, in place: four butterfly stages, each pairing rows i and
   i + b and exchanging b-lane blocks (the stages for b = 8, 4, 2, 1) */
#define BUTTERFLY(b, ...) do {                                                              \
        for (int i = 0; i < 16; ++i) {                                                      \
            if (i & (b)) continue;                                                          \
            const f32x16 lo = x[i], hi = x[i + (b)];                                       \
            x[i] = __builtin_shufflevector(lo, hi, __VA_ARGS__);                            \
            x[i + (b)] = __builtin_shufflevector(lo, hi, SHIFTED_##b);                      \
        }                                                                                   \
    } while (0)
#define SHIFTED_8 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31
#define SHIFTED_4 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31
#define SHIFTED_2 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31
#define SHIFTED_1 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31
static inline void transpose16(f32x16 *x) {
    BUTTERFLY(8, 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
    BUTTERFLY(4, 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27);
    BUTTERFLY(2, 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29);
    BUTTERFLY(1, 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30);
}

#if defined(__AVX512F__)
#include <immintrin.h>
/* expf of 16 lanes inline (a libmvec call here is two 8-lane calls through memory, and the
   softmax makes 17 of them per 16 x 16 tile): e^x = 2^n e^r with n = round(x log2 e) and
   r = x - n ln 2 (ln 2 in two parts, so r is exact enough), e^r by a degree-7 polynomial
   (Cephes' expf coefficients: relative error under 2e-8 on |r| <= ln2/2), times 2^n by
   scalef, which also flushes results below the float range to 0. x is clamped first:
   -inf (a masked score) gives exactly 0 and 0 gives exactly 1, as expf does. */
static inline f32x16 exp16(f32x16 x) {
    __m512 v = _mm512_min_ps(_mm512_max_ps((__m512)x, _mm512_set1_ps(-110.0f)),
                             _mm512_set1_ps(88.7228f));
    const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(1.44269504f)),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), v);
    v = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), v);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, v, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, v, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, v, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, v, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, v, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(v, v), _mm512_add_ps(v, _mm512_set1_ps(1.0f)));
    return (f32x16)_mm512_scalef_ps(p, n);
}
#else
static inline f32x16 exp16(f32x16 x) {
    float lanes[LANES];
    memcpy(lanes, &x, sizeof lanes);
#pragma omp simd
    for (int i = 0; i < LANES; ++i) lanes[i] = expf(lanes[i]);
    memcpy(&x, lanes, sizeof lanes);
    return x;
}
#endif

static inline __attribute__((always_inline)) void attend_tile(
        const float *q, int64_t q_token_stride, float *out, const void *k_cache,
        const void *v_cache, const float *k_lut, const float *v_lut, const int32_t *table, int64_t q_start, int64_t q_len,
        int64_t seq_len, int64_t kv_head, int64_t first_row, int64_t num_heads,
        int64_t num_kv_heads, const int64_t head_dim, int64_t block_size, float scale,
        int64_t window, float softcap, const float *sinks, const int kind) {
    const int64_t group = num_heads / num_kv_heads;
    const int64_t token_stride = num_kv_heads * head_dim;
    const int64_t prefix = seq_len - q_len;
    const int64_t rows = q_len * group - first_row < LANES ? q_len * group - first_row : LANES;

    /* lane -> (token, head); lanes past the last row repeat it and are not written back */
    int64_t token[LANES], head[LANES];
    int32_t pos_lanes[LANES];
    for (int64_t r = 0; r < LANES; ++r) {
        const int64_t row = first_row + (r < rows ? r : rows - 1);
        token[r] = row / group;
        head[r] = kv_head * group + row % group;
        pos_lanes[r] = (int32_t)(prefix + token[r]);
    }
    i32x16 pos;
    memcpy(&pos, pos_lanes, sizeof pos);
    const int64_t pos_min = pos_lanes[0], pos_max = pos_lanes[LANES - 1];
    const int64_t key_end = pos_max + 1;
    const int64_t key_begin = window > 0 && pos_min - window + 1 > 0 ? pos_min - window + 1 : 0;

    /* qt: the rows' queries, scaled, transposed 16 components at a time */
    f32x16 qt[MAX_HEAD_DIM], ot[MAX_HEAD_DIM];
    const float *q_row[LANES];
    for (int64_t r = 0; r < LANES; ++r)
        q_row[r] = q + (q_start + token[r]) * q_token_stride + head[r] * head_dim;
    for (int64_t d0 = 0; d0 < head_dim; d0 += LANES) {
        for (int64_t r = 0; r < LANES; ++r) qt[d0 + r] = LOAD16(q_row[r] + d0);
        transpose16(qt + d0);
        for (int64_t i = 0; i < LANES; ++i) {
            qt[d0 + i] *= scale;
            ot[d0 + i] = (f32x16){0};
        }
    }
    f32x16 m = (f32x16){0} - INFINITY, l = (f32x16){0};
    if (sinks != NULL) {  /* gpt-oss: each row's sink is the first logit it has seen */
        float first[LANES];
        for (int64_t r = 0; r < LANES; ++r) first[r] = sinks[head[r]];
        memcpy(&m, first, sizeof m);
        l = (f32x16){0} + 1.0f;
    }

    /* the chunk's K and V rows copied side by side: fixed offsets in the loops below */
    float k_rows[LANES * MAX_HEAD_DIM], v_rows[LANES * MAX_HEAD_DIM];
    for (int64_t kc = key_begin; kc < key_end; kc += LANES) {
        const int64_t keys = key_end - kc < LANES ? key_end - kc : LANES;
        for (int64_t j = 0; j < LANES; ++j) {
            const int64_t t = kc + (j < keys ? j : 0);  /* past the end: any valid row */
            const int64_t slot = (int64_t)table[t / block_size] * block_size + t % block_size;
            const int64_t at = slot * token_stride + kv_head * head_dim;
            if (kind == KV_FP8) {
                const uint8_t *k_byte = (const uint8_t *)k_cache + at;
                const uint8_t *v_byte = (const uint8_t *)v_cache + at;
                for (int64_t d = 0; d < head_dim; ++d) {
                    k_rows[j * head_dim + d] = k_lut[k_byte[d]];
                    v_rows[j * head_dim + d] = v_lut[v_byte[d]];
                }
            } else if (kind == KV_BF16) {  /* a bfloat16 is a float32's top 16 bits */
                const uint16_t *k_half = (const uint16_t *)k_cache + at;
                const uint16_t *v_half = (const uint16_t *)v_cache + at;
                uint32_t *k_bits = (uint32_t *)(k_rows + j * head_dim);
                uint32_t *v_bits = (uint32_t *)(v_rows + j * head_dim);
#pragma omp simd
                for (int64_t d = 0; d < head_dim; ++d) {
                    k_bits[d] = (uint32_t)k_half[d] << 16;
                    v_bits[d] = (uint32_t)v_half[d] << 16;
                }
            } else {
                memcpy(k_rows + j * head_dim, (const float *)k_cache + at,
                       (size_t)head_dim * sizeof(float));
                memcpy(v_rows + j * head_dim, (const float *)v_cache + at,
                       (size_t)head_dim * sizeof(float));
            }
        }
        f32x16 s[LANES];
        for (int64_t j = 0; j < LANES; ++j) s[j] = (f32x16){0};
        for (int64_t d = 0; d < head_dim; ++d) {
            const f32x16 qd = qt[d];
            for (int64_t j = 0; j < LANES; ++j) s[j] += k_rows[j * head_dim + d] * qd;
        }
        if (softcap > 0.0f)  /* Gemma 2: cap * tanh(s / cap), before the mask */
            for (int64_t j = 0; j < LANES; ++j) {
                float lanes[LANES];
                memcpy(lanes, &s[j], sizeof lanes);
                for (int64_t i = 0; i < LANES; ++i) lanes[i] = softcap * tanhf(lanes[i] / softcap);
                memcpy(&s[j], lanes, sizeof lanes);
            }
        /* the mask: a key after a row's position, before its window, or past the end */
        const int needs_mask = kc + LANES - 1 > pos_min || keys < LANES
                               || (window > 0 && kc <= pos_max - window);
        if (needs_mask)
            for (int64_t j = 0; j < LANES; ++j) {
                const int32_t key = (int32_t)(kc + j);
                i32x16 valid = (i32x16){0} + key <= pos;
                if (window > 0) valid &= (i32x16){0} + key > pos - (int32_t)window;
                if (j >= keys) valid = (i32x16){0};
                s[j] = select16(valid, s[j], (f32x16){0} - INFINITY);
            }
        f32x16 peak = m;
        for (int64_t j = 0; j < LANES; ++j) {
            const i32x16 bigger = s[j] > peak;
            peak = select16(bigger, s[j], peak);
        }
        /* a row with no key yet keeps -inf as its maximum: shift by 0 so exp gives 0 */
        const f32x16 shift = select16(peak == (f32x16){0} - INFINITY, (f32x16){0}, peak);
        const f32x16 alpha = exp16(m - shift);
        m = peak;
        f32x16 p[LANES], sum = (f32x16){0};
        for (int64_t j = 0; j < LANES; ++j) {
            p[j] = exp16(s[j] - shift);
            sum += p[j];
        }
        l = l * alpha + sum;
        /* eight components at a time: independent FMA chains keep both units busy */
        for (int64_t d = 0; d < head_dim; d += 8) {
            f32x16 acc[8];
            for (int64_t i = 0; i < 8; ++i) acc[i] = ot[d + i] * alpha;
            for (int64_t j = 0; j < LANES; ++j)
                for (int64_t i = 0; i < 8; ++i) acc[i] += v_rows[j * head_dim + d + i] * p[j];
            for (int64_t i = 0; i < 8; ++i) ot[d + i] = acc[i];
        }
    }

    /* back to rows, 16 components at a time, each row divided by its softmax sum */
    const f32x16 inv_l = 1.0f / l;
    for (int64_t d0 = 0; d0 < head_dim; d0 += LANES) {
        f32x16 x[LANES];
        for (int64_t i = 0; i < LANES; ++i) x[i] = ot[d0 + i] * inv_l;
        transpose16(x);
        for (int64_t r = 0; r < rows; ++r)
            STORE16(out + ((q_start + token[r]) * num_heads + head[r]) * head_dim + d0, x[r]);
    }
}

/* Returns 0 on success, 1 when the tile list could not be allocated. kv_kind: the caches
   hold float32 (0), bfloat16 (1), float8 e4m3 (2) or float8 e5m2 (3); with float8,
   kv_scales is the layer's (k_scale, v_scale) (NULL: both 1). */
int shoal_paged_prefill(const float *q, int64_t q_token_stride, float *out,
                        const void *k_cache, const void *v_cache,
                        const int32_t *block_tables, int64_t table_stride,
                        const int64_t *spans, int64_t count, int64_t num_heads,
                        int64_t num_kv_heads, int64_t head_dim, int64_t block_size,
                        float scale, int64_t window, float softcap, int64_t kv_kind,
                        const float *sinks, const float *kv_scales) {
    const int64_t group = num_heads / num_kv_heads;
    int64_t total = 0;
    for (int64_t s = 0; s < count; ++s)
        total += num_kv_heads * ((spans[4 * s + 1] * group + LANES - 1) / LANES);
    float k_lut[256], v_lut[256];
    if (kv_kind >= KV_FP8) {
        shoal_fp8_table(kv_kind, kv_scales ? kv_scales[0] : 1.0f, k_lut);
        shoal_fp8_table(kv_kind, kv_scales ? kv_scales[1] : 1.0f, v_lut);
    }
    Tile *tiles = malloc((size_t)(total > 0 ? total : 1) * sizeof(Tile));
    if (tiles == NULL) return 1;
    int64_t n = 0;
    for (int64_t s = 0; s < count; ++s) {
        const int64_t row_tiles = (spans[4 * s + 1] * group + LANES - 1) / LANES;
        for (int64_t t = row_tiles - 1; t >= 0; --t)  /* the rows with the most keys first */
            for (int64_t h = 0; h < num_kv_heads; ++h)
                tiles[n++] = (Tile){s, h, t * LANES};
    }

/* one call per (head size, cache type) pair, so each gets its own unrolled loops */
#define ATTEND(dim, cache_kind)                                                             \
    attend_tile(q, q_token_stride, out, k_cache, v_cache, k_lut, v_lut, table, span[0],     \
                span[1], span[3], tiles[i].kv_head, tiles[i].first_row, num_heads,          \
                num_kv_heads, dim, block_size, scale, window, softcap, sinks, cache_kind)
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < total; ++i) {
        const int64_t *span = spans + 4 * tiles[i].span;
        const int32_t *table = block_tables + span[2] * table_stride;
        if (kv_kind == KV_BF16) {  /* one copy: see paged_decode_cpu.c on compile time */
            ATTEND(head_dim, KV_BF16);
        } else if (kv_kind >= KV_FP8) {
            ATTEND(head_dim, KV_FP8);
        } else {
            if (head_dim == 64) ATTEND(64, KV_F32);
            else if (head_dim == 128) ATTEND(128, KV_F32);
            else ATTEND(head_dim, KV_F32);
        }
    }
#undef ATTEND
    free(tiles);
    return 0;
}
