/* The routed experts of a mixture-of-experts block on CPU, weights in float32 or bfloat16
   (arithmetic in float32): out[t] = sum_j w[t, j] * down_e(silu(gate_e x[t]) * up_e x[t]),
   e = ids[t, j].

   Layout (runtime/model/moe.py stores it): w13 [E, 2I, H], each expert's I gate rows then
   its I up rows; w2 [E, H, I]; both in [out, in] orientation, contiguous. x, the routing
   weights and out are float32 (moe_experts_cpu.py widens and narrows bfloat16 activations).

   Why this shape: at decode each chosen expert sees a handful of tokens, so the cost is
   streaming that expert's weights once; at prefill it sees dozens, so the cost is the
   multiply. The (token, expert) pairs are counting-sorted by expert, then work is split over
   (expert, PW weight rows) items, not experts, so both cores stay busy with one token and
   eight experts, and an expert with many tokens does not serialise. An item takes one of two
   paths by its expert's row count:
   - few rows (under PACK_MIN): dot products along the weights' contiguous columns, NR weight
     rows at a time against MR rows, MR x NR vector accumulators; KC-column blocks, so the
     tile stays in L1 across the rows, the accumulators waiting in a per-thread buffer
     between blocks. The weights are read once, at memory speed.
   - many rows: the PW rows are first packed column by column into a per-thread float32
     panel (one pass over them, transposed in registers), then multiplied as an outer
     product, PM rows at a time, each row's element broadcast against the panel's two
     vectors: no horizontal sums, every panel load used PM times. At 256 tokens of the bench
     shape this runs 1.2x the dot path, at 1024 1.4x (72-77 GFLOP/s on one Zen 3 core).
   bfloat16 weights are widened to float32 in registers (a bfloat16 is the top half of a
   float32), so they are read from memory at half the bytes.
   - prepacked (shoal_moe_experts_packed: the loader packs every expert's panels once, in
     the weights' own dtype, in place of the plain layout): every item multiplies its panel
     in place, whatever its row count; measured 1.1-1.3x (float32) and 1.3-1.7x (bfloat16)
     the paths above from 1 to 256 tokens of the bench shape, one thread.

   Three passes, each an OpenMP loop over torch's pool (see native_cpu.py):
   1. an item's rows are PW / 2 gate rows and the same up rows, so silu(gate) * up * routing
      weight is formed from the sums (the down projection is linear, so the weight scales
      the I-wide activations, as moe_grouped.py does);
   2. the down projection of those activations, PW output features an item;
   3. each token's k rows summed in its own routing order.

   Scratch (the sort, the activations, the down outputs, accumulators and panels) is the
   caller's, reused across calls: shoal_moe_experts_scratch_bytes says how much.

   Quantized experts (shoal_moe_experts_q): the weights are int_matmul_cpu.c's packed layout
   (int4 / int8 codes with a scale and offset or zero point per group, or FP8 with a scale
   per block), the E experts' rows stacked into one [E * rows, cols] matrix. An item of an
   expert with one token (decode) goes from codes to sums in registers (int_matmul_cpu.c's
   one-row loop, AVX2); otherwise it first dequantizes its PW weight rows into a per-thread
   float32 stage (each weight once per step, read at its packed size), then runs the float32
   paths above on the stage.

   AVX2 + FMA intrinsics where -march=native has them, the same loops in portable C
   elsewhere; H must be a multiple of 16 and I of 8 (moe_experts_cpu.py checks, and keeps
   other shapes on the torch path). */

#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#include "panel_cpu.h" /* load_w, the panel multiply (panel_rows), PW, PM, LANES */

#define NR 4    /* weight rows per tile */
#define MR 3    /* activation rows per register block: 3 x 4 accumulators + 3 x + 1 w */
#define KC 512  /* columns per block: NR x KC float32 weights is 8 KB, L1-resident */
#define ALIGN 64

/* the experts' weights of one projection: float32 / bfloat16 [E * rows, cols], or packed
   (quant) codes with their group scales and offsets (int_matmul_cpu.c's layout) */
typedef struct {
    const void *data, *scales, *offsets;
    int64_t group, bits, fmt, quant, is_bf16;
    int64_t panels;  /* float32 / bfloat16 prepacked into items' panels (see below) */
} wsrc_t;

void shoal_int_dequant_row(const uint8_t *codes, const void *scales, const void *offsets,
                           int64_t n, int64_t k, int64_t group, int64_t bits, int64_t fmt,
                           float *dst);

int shoal_int_gemv_rows(const float *x, const uint8_t *codes, const void *scales,
                        const void *offsets, int64_t n0, int64_t n1, int64_t k, int64_t group,
                        int64_t bits, int64_t fmt, float *out);

/* out[j] = x . W[row0 + j, :] for j < count, one activation row, straight from packed
   codes: 1, or 0 where that path does not exist here (then the rows are staged) */
static inline int gemv_of(const wsrc_t *w, const float *x, int64_t row0, int64_t count,
                          int64_t cols, float *out) {
    return shoal_int_gemv_rows(x, (const uint8_t *)w->data, w->scales, w->offsets, row0,
                               row0 + count, cols, w->group, w->bits, w->fmt, out);
}

/* weight row `row` ([cols] wide): in place, or dequantized into `stage` */
static inline const void *row_of(const wsrc_t *w, int64_t row, int64_t cols, float *stage) {
    if (!w->quant)
        return (const char *)w->data + (size_t)(row * cols) * (w->is_bf16 ? sizeof(bf16)
                                                                          : sizeof(float));
    shoal_int_dequant_row((const uint8_t *)w->data, w->scales, w->offsets, row, cols,
                          w->group, w->bits, w->fmt, stage);
    return stage;
}

/* Columns [c0, c1) of the dot products xr[i] . wr[j] for i < mr, j < NR, added to the
   partial sums in acc (zero when first); when last, the sums go to outr[i][j], else back to
   acc. Inlined with mr and is_bf16 constants, so the accumulators stay in registers. */
static inline __attribute__((always_inline)) void tile(
        const float *const *xr, const void *const *wr, int64_t c0, int64_t c1, float *acc,
        int first, int last, float *const *outr, const int mr, const int is_bf16) {
#ifdef SHOAL_AVX2
    __m256 a[MR][NR];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NR; ++j)
            a[i][j] = first ? _mm256_setzero_ps() : _mm256_load_ps(acc + (i * NR + j) * LANES);
    for (int64_t c = c0; c < c1; c += LANES) {
        __m256 xv[MR];
        for (int i = 0; i < mr; ++i) xv[i] = _mm256_loadu_ps(xr[i] + c);
        for (int j = 0; j < NR; ++j) {
            const __m256 wv = load_w(wr[j], c, is_bf16);
            for (int i = 0; i < mr; ++i) a[i][j] = _mm256_fmadd_ps(xv[i], wv, a[i][j]);
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NR; ++j) {
            if (!last) {
                _mm256_store_ps(acc + (i * NR + j) * LANES, a[i][j]);
                continue;
            }
            const __m128 h = _mm_add_ps(_mm256_castps256_ps128(a[i][j]),
                                        _mm256_extractf128_ps(a[i][j], 1));
            const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
            outr[i][j] = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
        }
#else
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NR; ++j) {
            float sum = first ? 0.0f : acc[i * NR + j];
            const float *xi = xr[i];
            for (int64_t c = c0; c < c1; ++c) sum += xi[c] * load_w1(wr[j], c, is_bf16);
            if (last) outr[i][j] = sum;
            else acc[i * NR + j] = sum;
        }
#endif
}

static inline __attribute__((always_inline)) void tile_mr(
        const float *const *xr, const void *const *wr, int64_t c0, int64_t c1, float *acc,
        int first, int last, float *const *outr, int mr, const int is_bf16) {
    if (mr == MR) tile(xr, wr, c0, c1, acc, first, last, outr, MR, is_bf16);
    else if (mr == 2) tile(xr, wr, c0, c1, acc, first, last, outr, 2, is_bf16);
    else tile(xr, wr, c0, c1, acc, first, last, outr, 1, is_bf16);
}

/* The packed path: panel[c * PW + j] = w_rows[j][c] in float32, multiplied by panel_rows
   (panel_cpu.h). Packing is one more pass over the weights, paid back from PACK_MIN rows
   (measured: 4, 8 and 16 alike at 64 tokens of the bench shape). */
#define PACK_MIN 8

#ifdef SHOAL_AVX2
static inline void transpose8(__m256 r[8]) {
    const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
    const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
    const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
    const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
    const __m256 s0 = _mm256_shuffle_ps(t0, t2, 0x44), s1 = _mm256_shuffle_ps(t0, t2, 0xEE);
    const __m256 s2 = _mm256_shuffle_ps(t1, t3, 0x44), s3 = _mm256_shuffle_ps(t1, t3, 0xEE);
    const __m256 s4 = _mm256_shuffle_ps(t4, t6, 0x44), s5 = _mm256_shuffle_ps(t4, t6, 0xEE);
    const __m256 s6 = _mm256_shuffle_ps(t5, t7, 0x44), s7 = _mm256_shuffle_ps(t5, t7, 0xEE);
    r[0] = _mm256_permute2f128_ps(s0, s4, 0x20);
    r[1] = _mm256_permute2f128_ps(s1, s5, 0x20);
    r[2] = _mm256_permute2f128_ps(s2, s6, 0x20);
    r[3] = _mm256_permute2f128_ps(s3, s7, 0x20);
    r[4] = _mm256_permute2f128_ps(s0, s4, 0x31);
    r[5] = _mm256_permute2f128_ps(s1, s5, 0x31);
    r[6] = _mm256_permute2f128_ps(s2, s6, 0x31);
    r[7] = _mm256_permute2f128_ps(s3, s7, 0x31);
}
#endif

static inline __attribute__((always_inline)) void pack_rows(
        const void *const *wr, int64_t len, float *panel, const int is_bf16) {
#ifdef SHOAL_AVX2
    for (int64_t c = 0; c < len; c += LANES)
        for (int half = 0; half < PW / LANES; ++half) {
            __m256 r[LANES];
            for (int j = 0; j < LANES; ++j) r[j] = load_w(wr[half * LANES + j], c, is_bf16);
            transpose8(r);
            for (int q = 0; q < LANES; ++q)
                _mm256_store_ps(panel + (c + q) * PW + half * LANES, r[q]);
        }
#else
    for (int64_t c = 0; c < len; ++c)
        for (int j = 0; j < PW; ++j) panel[c * PW + j] = load_w1(wr[j], c, is_bf16);
#endif
}

static void pack(const void *const *wr, int64_t len, float *panel, int is_bf16) {
    if (is_bf16) pack_rows(wr, len, panel, 1);
    else pack_rows(wr, len, panel, 0);
}

static inline float silu(float g) { return g / (1.0f + expf(-g)); }

/* The scratch the kernel's layout needs, 64-byte aligned pieces. */
typedef struct {
    int64_t *start, *pos, *src, *active, *fill;
    float *act, *y, *acc, *panel, *stage;
    int64_t acc_per_thread, panel_per_thread, bytes;
} scratch_t;

static int64_t up(int64_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

static scratch_t carve(char *base, int64_t tokens, int64_t hidden, int64_t inter,
                       int64_t experts, int64_t top_k, int threads) {
    const int64_t pairs = tokens * top_k;
    scratch_t s;
    int64_t at = 0;
#define TAKE(field, type, count)                                                            \
    s.field = (type *)(base ? base + at : NULL);                                            \
    at += up((int64_t)sizeof(type) * (count));
    TAKE(start, int64_t, experts + 1)
    TAKE(pos, int64_t, pairs)
    TAKE(src, int64_t, pairs)
    TAKE(active, int64_t, experts)
    TAKE(fill, int64_t, experts)
    TAKE(act, float, pairs * inter)
    TAKE(y, float, pairs * hidden)
    /* an expert holds at most every pair: one accumulator block per MR of them */
    s.acc_per_thread = up((int64_t)sizeof(float) * ((pairs + MR - 1) / MR) * MR * NR * LANES)
                       / (int64_t)sizeof(float);
    TAKE(acc, float, s.acc_per_thread * threads)
    s.panel_per_thread = up((int64_t)sizeof(float) * PW * (hidden > inter ? hidden : inter))
                         / (int64_t)sizeof(float);
    TAKE(panel, float, s.panel_per_thread * threads)
    TAKE(stage, float, s.panel_per_thread * threads)  /* PW dequantized rows a thread */
#undef TAKE
    s.bytes = at + ALIGN;  /* room to align the base */
    return s;
}

/* Bytes of scratch a call with these sizes needs on the calling thread's OpenMP pool. */
int64_t shoal_moe_experts_scratch_bytes(int64_t tokens, int64_t hidden, int64_t inter,
                                        int64_t experts, int64_t top_k) {
    return carve(NULL, tokens, hidden, inter, experts, top_k, omp_get_max_threads()).bytes;
}

/* the routed experts, dense or quantized weights (the two exported entries below) */
static int experts_impl(const float *x, int64_t tokens, int64_t hidden, int64_t inter,
                        int64_t experts, int64_t top_k, const int64_t *ids,
                        const float *weights, const wsrc_t *w13s, const wsrc_t *w2s,
                        void *scratch, int64_t scratch_bytes, float *out) {
    const int threads = omp_get_max_threads();
    if (carve(NULL, tokens, hidden, inter, experts, top_k, threads).bytes > scratch_bytes)
        return -1;
    char *base = (char *)scratch + ((ALIGN - (uintptr_t)scratch % ALIGN) % ALIGN);
    const scratch_t s = carve(base, tokens, hidden, inter, experts, top_k, threads);
    const int64_t pairs = tokens * top_k;
    /* the tiles read float32 from a stage when the weights are quantized */
    const int is_bf16 = !w13s->quant && w13s->is_bf16;
    const size_t wsize13 = w13s->is_bf16 ? sizeof(bf16) : sizeof(float);
    const size_t wsize2 = w2s->is_bf16 ? sizeof(bf16) : sizeof(float);

    /* counting sort of the pairs by expert, in token order within an expert (stable) */
    memset(s.start, 0, sizeof(int64_t) * (size_t)(experts + 1));
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t e = ids[p];
        if (e >= 0 && e < experts) ++s.start[e + 1];
    }
    for (int64_t e = 0; e < experts; ++e) s.start[e + 1] += s.start[e];
    for (int64_t e = 0; e < experts; ++e) s.fill[e] = s.start[e];
    for (int64_t p = 0; p < pairs; ++p) {
        const int64_t e = ids[p];
        if (e >= 0 && e < experts) {
            s.pos[p] = s.fill[e]++;
            s.src[s.pos[p]] = p;
        } else {
            s.pos[p] = -1;
        }
    }
    int64_t n_active = 0;
    for (int64_t e = 0; e < experts; ++e)
        if (s.start[e + 1] > s.start[e]) s.active[n_active++] = e;

    /* pass 1: work items (active expert, PW / 2 intermediate columns: their gate and up
       rows), each a whole cache line of activations per row */
    const int64_t i_items = inter / (PW / 2);
#pragma omp parallel
    {
        float *acc = s.acc + s.acc_per_thread * omp_get_thread_num();
        float *panel = s.panel + s.panel_per_thread * omp_get_thread_num();
        float *stage = s.stage + s.panel_per_thread * omp_get_thread_num();
#pragma omp for schedule(dynamic, 2)
        for (int64_t item = 0; item < n_active * i_items; ++item) {
            const int64_t e = s.active[item / i_items], j0 = (item % i_items) * (PW / 2);
            const int64_t r0 = s.start[e], r1 = s.start[e + 1];
            if (w13s->quant && r1 - r0 == 1) {  /* one token (decode): codes to sums */
                const float *xr = x + (s.src[r0] / top_k) * hidden;
                const int64_t g = e * 2 * inter + j0;
                float gu[PW];
                if (gemv_of(w13s, xr, g, PW / 2, hidden, gu) &&
                    gemv_of(w13s, xr, g + inter, PW / 2, hidden, gu + PW / 2)) {
                    const float wt = weights[s.src[r0]];
                    float *a = s.act + r0 * inter + j0;
                    for (int j = 0; j < PW / 2; ++j) a[j] = silu(gu[j]) * gu[PW / 2 + j] * wt;
                    continue;
                }
            }
            const void *all[PW];  /* the item's gate rows, then its up rows */
            const void *pan = panel;  /* its panel: prepacked at load, or packed here */
            int pan_bf16 = 0;
            if (w13s->panels) {
                pan = (const char *)w13s->data
                      + (size_t)((e * i_items + item % i_items) * hidden * PW) * wsize13;
                pan_bf16 = (int)w13s->is_bf16;
            } else {
                for (int j = 0; j < PW / 2; ++j) {
                    const int64_t g = e * 2 * inter + j0 + j;
                    all[j] = row_of(w13s, g, hidden, stage + j * hidden);
                    all[PW / 2 + j] = row_of(w13s, g + inter, hidden,
                                             stage + (PW / 2 + j) * hidden);
                }
                if (r1 - r0 >= PACK_MIN) pack(all, hidden, panel, is_bf16);
            }
            if (w13s->panels || r1 - r0 >= PACK_MIN) {
                float gu[PM][PW];  /* each row's PW / 2 gate sums, then its up sums */
                for (int64_t r = r0; r < r1; r += PM) {
                    const int mr = r1 - r < PM ? (int)(r1 - r) : PM;
                    const float *xr[PM];
                    float *outr[PM];
                    for (int i = 0; i < mr; ++i) {
                        xr[i] = x + (s.src[r + i] / top_k) * hidden;
                        outr[i] = gu[i];
                    }
                    panel_rows(xr, pan, hidden, outr, mr, pan_bf16);
                    for (int i = 0; i < mr; ++i) {
                        const float wt = weights[s.src[r + i]];
                        float *a = s.act + (r + i) * inter + j0;
                        for (int j = 0; j < PW / 2; ++j)
                            a[j] = silu(gu[i][j]) * gu[i][PW / 2 + j] * wt;
                    }
                }
                continue;
            }
            /* few rows: dot products, NR rows (two gate, the same two up) at a time */
            for (int64_t jj = 0; jj < PW / 2; jj += 2) {
                const void *wr[NR] = {all[jj], all[jj + 1], all[PW / 2 + jj],
                                      all[PW / 2 + jj + 1]};
                float gu[MR][NR];  /* gate jj, gate jj + 1, up jj, up jj + 1 */
                for (int64_t c0 = 0; c0 < hidden; c0 += KC) {
                    const int64_t c1 = c0 + KC < hidden ? c0 + KC : hidden;
                    const int last = c1 == hidden;
                    float *blk = acc;
                    for (int64_t r = r0; r < r1; r += MR, blk += MR * NR * LANES) {
                        const int mr = r1 - r < MR ? (int)(r1 - r) : MR;
                        const float *xr[MR];
                        float *outr[MR];
                        for (int i = 0; i < mr; ++i) {
                            xr[i] = x + (s.src[r + i] / top_k) * hidden;
                            outr[i] = gu[i];
                        }
                        if (is_bf16) tile_mr(xr, wr, c0, c1, blk, c0 == 0, last, outr, mr, 1);
                        else tile_mr(xr, wr, c0, c1, blk, c0 == 0, last, outr, mr, 0);
                        if (!last) continue;
                        for (int i = 0; i < mr; ++i) {
                            const float wt = weights[s.src[r + i]];
                            float *a = s.act + (r + i) * inter + j0 + jj;
                            a[0] = silu(gu[i][0]) * gu[i][2] * wt;
                            a[1] = silu(gu[i][1]) * gu[i][3] * wt;
                        }
                    }
                }
            }
        }

        /* pass 2: work items (active expert, PW output features) */
        const int64_t h_items = hidden / PW;
#pragma omp for schedule(dynamic, 4)
        for (int64_t item = 0; item < n_active * h_items; ++item) {
            const int64_t e = s.active[item / h_items], n0 = (item % h_items) * PW;
            const int64_t r0 = s.start[e], r1 = s.start[e + 1];
            if (w2s->quant && r1 - r0 == 1 &&
                gemv_of(w2s, s.act + r0 * inter, e * hidden + n0, PW, inter,
                        s.y + r0 * hidden + n0))
                continue;
            const void *all[PW];
            const void *pan = panel;
            int pan_bf16 = 0;
            if (w2s->panels) {
                pan = (const char *)w2s->data
                      + (size_t)((e * h_items + item % h_items) * inter * PW) * wsize2;
                pan_bf16 = (int)w2s->is_bf16;
            } else {
                for (int j = 0; j < PW; ++j)
                    all[j] = row_of(w2s, e * hidden + n0 + j, inter, stage + j * inter);
                if (r1 - r0 >= PACK_MIN) pack(all, inter, panel, is_bf16);
            }
            if (w2s->panels || r1 - r0 >= PACK_MIN) {
                for (int64_t r = r0; r < r1; r += PM) {
                    const int mr = r1 - r < PM ? (int)(r1 - r) : PM;
                    const float *ar[PM];
                    float *yo[PM];
                    for (int i = 0; i < mr; ++i) {
                        ar[i] = s.act + (r + i) * inter;
                        yo[i] = s.y + (r + i) * hidden + n0;
                    }
                    panel_rows(ar, pan, inter, yo, mr, pan_bf16);
                }
                continue;
            }
            for (int64_t nn = 0; nn < PW; nn += NR) {
                const void *wr[NR];
                for (int j = 0; j < NR; ++j) wr[j] = all[nn + j];
                for (int64_t c0 = 0; c0 < inter; c0 += KC) {
                    const int64_t c1 = c0 + KC < inter ? c0 + KC : inter;
                    float *blk = acc;
                    for (int64_t r = r0; r < r1; r += MR, blk += MR * NR * LANES) {
                        const int mr = r1 - r < MR ? (int)(r1 - r) : MR;
                        const float *ar[MR];
                        float *yo[MR];
                        for (int i = 0; i < mr; ++i) {
                            ar[i] = s.act + (r + i) * inter;
                            yo[i] = s.y + (r + i) * hidden + n0 + nn;
                        }
                        if (is_bf16)
                            tile_mr(ar, wr, c0, c1, blk, c0 == 0, c1 == inter, yo, mr, 1);
                        else
                            tile_mr(ar, wr, c0, c1, blk, c0 == 0, c1 == inter, yo, mr, 0);
                    }
                }
            }
        }

        /* pass 3: each token's rows summed in its routing order */
#pragma omp for schedule(static)
        for (int64_t t = 0; t < tokens; ++t) {
            float *o = out + t * hidden;
            for (int64_t c = 0; c < hidden; ++c) o[c] = 0.0f;
            for (int64_t j = 0; j < top_k; ++j) {
                const int64_t r = s.pos[t * top_k + j];
                if (r < 0) continue;
                const float *yr = s.y + r * hidden;
#pragma omp simd
                for (int64_t c = 0; c < hidden; ++c) o[c] += yr[c];
            }
        }
    }
    return 0;
}

/* x [T, H] float32, ids [T, k] (int64), weights [T, k] float32, w13 [E, 2I, H], w2 [E, H, I]
   (float32, or bfloat16 when is_bf16), out [T, H] float32. Ids outside [0, E) contribute
   nothing. Returns 0, or -1 when scratch_bytes is short of what the call needs. */
int shoal_moe_experts(const float *x, int64_t tokens, int64_t hidden, int64_t inter,
                      int64_t experts, int64_t top_k, const int64_t *ids, const float *weights,
                      const void *w13, const void *w2, int64_t is_bf16, void *scratch,
                      int64_t scratch_bytes, float *out) {
    const wsrc_t a = {w13, NULL, NULL, 0, 0, 0, 0, is_bf16};
    const wsrc_t b = {w2, NULL, NULL, 0, 0, 0, 0, is_bf16};
    return experts_impl(x, tokens, hidden, inter, experts, top_k, ids, weights, &a, &b,
                        scratch, scratch_bytes, out);
}

/* The same with the weights prepacked (moe_experts_cpu.pack_experts, once at load), in each
   work item's panel order: w13 [E, I / (PW/2), H, PW], item g's column c holding gate rows
   g*PW/2 .. +PW/2 then the same up rows; w2 [E, H / PW, I, PW], item n's column c holding
   down rows n*PW .. +PW. Every expert, whatever its row count, multiplies its panels in
   place: no packing pass per step, and decode rows read the weights once as the dot
   products did, without their horizontal sums. */
int shoal_moe_experts_packed(const float *x, int64_t tokens, int64_t hidden, int64_t inter,
                             int64_t experts, int64_t top_k, const int64_t *ids,
                             const float *weights, const void *w13, const void *w2,
                             int64_t is_bf16, void *scratch, int64_t scratch_bytes,
                             float *out) {
    const wsrc_t a = {w13, NULL, NULL, 0, 0, 0, 0, is_bf16, 1};
    const wsrc_t b = {w2, NULL, NULL, 0, 0, 0, 0, is_bf16, 1};
    return experts_impl(x, tokens, hidden, inter, experts, top_k, ids, weights, &a, &b,
                        scratch, scratch_bytes, out);
}

/* The same with packed weights: codes13 [E * 2I, row bytes of H] with scales13 / offsets13
   [E * 2I, H / group13], codes2 [E * H, row bytes of I] with theirs; bits and each fmt as in
   int_matmul_cpu.c. */
int shoal_moe_experts_q(const float *x, int64_t tokens, int64_t hidden, int64_t inter,
                        int64_t experts, int64_t top_k, const int64_t *ids,
                        const float *weights, const void *codes13, const void *scales13,
                        const void *offsets13, int64_t group13, int64_t fmt13,
                        const void *codes2, const void *scales2, const void *offsets2,
                        int64_t group2, int64_t fmt2, int64_t bits, void *scratch,
                        int64_t scratch_bytes, float *out) {
    const wsrc_t a = {codes13, scales13, offsets13, group13, bits, fmt13, 1, 0};
    const wsrc_t b = {codes2, scales2, offsets2, group2, bits, fmt2, 1, 0};
    return experts_impl(x, tokens, hidden, inter, experts, top_k, ids, weights, &a, &b,
                        scratch, scratch_bytes, out);
}
