/* Weight-only integer matmul for CPU: out[m, n] = sum_k x[m, k] * W[n, k], float32 sums,
   with W kept as 4-bit or 8-bit codes and dequantized tile by tile inside the loop.

   Layout (shoal/kernels/int_matmul_cpu.py packs it):
   - codes: row n of W is k codes in sub-blocks of 32 columns. 4-bit: 16 bytes per
     sub-block, byte i holding column i (low nibble) and column 16 + i (high nibble), which
     is GGUF's Q4_0/Q4_1 nibble order, so those blocks are copied in as they are; 8-bit: one
     unsigned byte per column.
   - scales, offsets: float32 [n, k / group], W[n, k] = code * scale + offset for the group
     of column k. group is a multiple of 32. Every integer format folds into this (a zero
     point z: offset = -z * scale; GGUF Q4_1's min is the offset itself).

   Why this shape: decode multiplies a few rows (1-64) by every weight, so the weights'
   bytes and their unpacking are the cost. A tile of NR weight rows x KC columns is unpacked
   once into float32 (it stays in L1) and then used by every activation row, MR rows at a
   time with MR x NR vector accumulators; at one row the unpacking is paid once per weight,
   at 64 rows it is nothing next to the multiply-adds. Output rows are split over OpenMP
   threads (torch's pool, see native_cpu.py).

   AVX2 + FMA (every x86 CPU of the pool: Zen 3/4/5, Intel with AMX) gets intrinsics;
   anything else the same loops in portable C. -march=native decides at build time, and
   the library is built per CPU (native_cpu.py keys it by the CPU's flags). */

#include <stdint.h>
#include <string.h>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SHOAL_AVX2 1
#endif

#define NR 4      /* weight rows per tile */
#define KC 512    /* columns per tile: NR * KC float32 = 8 KiB, in L1 */
#define SUB 32    /* columns per packed sub-block */
#define PARALLEL_MIN 65536  /* weights below which one thread does it all */

/* float32 [KC] <- weight row n's columns [k0, k0 + len) (len a multiple of SUB) */
static void dequant_row(const uint8_t *codes, const float *scales, const float *offsets,
                        int64_t n, int64_t k, int64_t group, int64_t bits, int64_t k0,
                        int64_t len, float *dst) {
    const int64_t groups = k / group;
    const int64_t row_bytes = bits == 4 ? k / 2 : k;
    for (int64_t j = 0; j < len; j += SUB) {
        const int64_t col = k0 + j;
        const float s = scales[n * groups + col / group];
        const float o = offsets[n * groups + col / group];
        const uint8_t *src = codes + n * row_bytes + (bits == 4 ? col / 2 : col);
        float *d = dst + j;
#ifdef SHOAL_AVX2
        const __m256 vs = _mm256_set1_ps(s), vo = _mm256_set1_ps(o);
        __m128i a, b, c, e;
        if (bits == 4) {
            const __m128i packed = _mm_loadu_si128((const __m128i *)src);
            const __m128i mask = _mm_set1_epi8(0x0f);
            const __m128i lo = _mm_and_si128(packed, mask);
            const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
            a = lo, b = _mm_srli_si128(lo, 8), c = hi, e = _mm_srli_si128(hi, 8);
        } else {
            a = _mm_loadl_epi64((const __m128i *)src);
            b = _mm_loadl_epi64((const __m128i *)(src + 8));
            c = _mm_loadl_epi64((const __m128i *)(src + 16));
            e = _mm_loadl_epi64((const __m128i *)(src + 24));
        }
        _mm256_storeu_ps(d, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(a)), vs, vo));
        _mm256_storeu_ps(d + 8, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(b)), vs, vo));
        _mm256_storeu_ps(d + 16, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(c)), vs, vo));
        _mm256_storeu_ps(d + 24, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(e)), vs, vo));
#else
        if (bits == 4) {
            for (int i = 0; i < 16; ++i) {
                d[i] = (float)(src[i] & 15) * s + o;
                d[16 + i] = (float)(src[i] >> 4) * s + o;
            }
        } else {
            for (int i = 0; i < SUB; ++i) d[i] = (float)src[i] * s + o;
        }
#endif
    }
}

/* out[m, n0 + j] (+)= x[m, :len] . w[j, :len] for MR rows and the NR tile rows; `first`:
   the tile's first column chunk (store, not add). Inlined with MR a constant, so the
   accumulators live in registers. */
static inline __attribute__((always_inline)) void tile(
        const float *x, int64_t x_stride, const float *w, int64_t len, float *out,
        int64_t out_stride, int64_t nr, int first, const int mr) {
#ifdef SHOAL_AVX2
    __m256 acc[3][NR];
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < NR; ++j) acc[i][j] = _mm256_setzero_ps();
    for (int64_t c = 0; c < len; c += 8) {
        __m256 xv[3];
        for (int i = 0; i < mr; ++i) xv[i] = _mm256_loadu_ps(x + i * x_stride + c);
        for (int j = 0; j < NR; ++j) {
            const __m256 wv = _mm256_loadu_ps(w + j * KC + c);
            for (int i = 0; i < mr; ++i) acc[i][j] = _mm256_fmadd_ps(xv[i], wv, acc[i][j]);
        }
    }
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j) {
            const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc[i][j]),
                                        _mm256_extractf128_ps(acc[i][j], 1));
            const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
            const float sum = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
            float *dst = out + i * out_stride + j;
            *dst = first ? sum : *dst + sum;
        }
#else
    for (int i = 0; i < mr; ++i)
        for (int j = 0; j < nr; ++j) {
            float sum = 0.0f;
            const float *xi = x + i * x_stride, *wj = w + j * KC;
#pragma omp simd reduction(+ : sum)
            for (int64_t c = 0; c < len; ++c) sum += xi[c] * wj[c];
            float *dst = out + i * out_stride + j;
            *dst = first ? sum : *dst + sum;
        }
#endif
}

#ifdef SHOAL_AVX2
/* One activation row (decode at batch 1): each sub-block's weights go from codes to FMAs in
   registers, never through the tile buffer, whose stores and reloads were a third of the
   instructions per weight when a single row uses them. The same weights (one FMA each from
   code, scale and offset), summed in another order. */
static void gemv_rows(const float *x, const uint8_t *codes, const float *scales,
                      const float *offsets, int64_t n0, int64_t n1, int64_t k, int64_t group,
                      int64_t bits, float *out) {
    const int64_t groups = k / group;
    const int64_t row_bytes = bits == 4 ? k / 2 : k;
    const __m128i mask = _mm_set1_epi8(0x0f);
    for (int64_t r = n0; r < n1; ++r) {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
        const uint8_t *row = codes + r * row_bytes;
        for (int64_t col = 0; col < k; col += SUB) {
            const __m256 vs = _mm256_set1_ps(scales[r * groups + col / group]);
            const __m256 vo = _mm256_set1_ps(offsets[r * groups + col / group]);
            __m128i a, b, c, e;
            if (bits == 4) {
                const __m128i packed = _mm_loadu_si128((const __m128i *)(row + col / 2));
                const __m128i lo = _mm_and_si128(packed, mask);
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
                a = lo, b = _mm_srli_si128(lo, 8), c = hi, e = _mm_srli_si128(hi, 8);
            } else {
                a = _mm_loadl_epi64((const __m128i *)(row + col));
                b = _mm_loadl_epi64((const __m128i *)(row + col + 8));
                c = _mm_loadl_epi64((const __m128i *)(row + col + 16));
                e = _mm_loadl_epi64((const __m128i *)(row + col + 24));
            }
#define SHOAL_W(v) _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), vs, vo)
            acc0 = _mm256_fmadd_ps(SHOAL_W(a), _mm256_loadu_ps(x + col), acc0);
            acc1 = _mm256_fmadd_ps(SHOAL_W(b), _mm256_loadu_ps(x + col + 8), acc1);
            acc2 = _mm256_fmadd_ps(SHOAL_W(c), _mm256_loadu_ps(x + col + 16), acc2);
            acc3 = _mm256_fmadd_ps(SHOAL_W(e), _mm256_loadu_ps(x + col + 24), acc3);
#undef SHOAL_W
        }
        const __m256 acc = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
        out[r] = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
    }
}
#endif

/* out [rows, n] (rows out_stride apart) = x [rows, k] (x_stride apart) @ W^T. k and group
   multiples of 32, group dividing k. */
void shoal_int_matmul_f32(const float *x, int64_t x_stride, int64_t rows, const uint8_t *codes,
                          const float *scales, const float *offsets, int64_t n, int64_t k,
                          int64_t group, int64_t bits, float *out, int64_t out_stride) {
    const int64_t tiles = (n + NR - 1) / NR;
#ifdef SHOAL_AVX2
    if (rows == 1) {
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN)
        for (int64_t t = 0; t < tiles; ++t)
            gemv_rows(x, codes, scales, offsets, t * NR, t * NR + NR < n ? t * NR + NR : n, k,
                      group, bits, out);
        return;
    }
#endif
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN)
    for (int64_t t = 0; t < tiles; ++t) {
        float w[NR * KC] __attribute__((aligned(32)));
        const int64_t n0 = t * NR;
        const int64_t nr = n - n0 < NR ? n - n0 : NR;
        for (int64_t k0 = 0; k0 < k; k0 += KC) {
            const int64_t len = k - k0 < KC ? k - k0 : KC;
            for (int64_t j = 0; j < NR; ++j) {
                if (j < nr)
                    dequant_row(codes, scales, offsets, n0 + j, k, group, bits, k0, len,
                                w + j * KC);
                else  /* the last tile's missing rows: zeros, their sums never stored */
                    memset(w + j * KC, 0, sizeof(float) * (size_t)len);
            }
            const float *xk = x + k0;
            float *o = out + n0;
            const int first = k0 == 0;
            int64_t m = 0;
            for (; m + 3 <= rows; m += 3)
                tile(xk + m * x_stride, x_stride, w, len, o + m * out_stride, out_stride, nr,
                     first, 3);
            if (rows - m == 2)
                tile(xk + m * x_stride, x_stride, w, len, o + m * out_stride, out_stride, nr,
                     first, 2);
            else if (rows - m == 1)
                tile(xk + m * x_stride, x_stride, w, len, o + m * out_stride, out_stride, nr,
                     first, 1);
        }
    }
}

/* float32 W[n0:n1, :] into out [n1 - n0, k]: the dequantized band a GEMM takes when there
   are many rows (prefill). */
void shoal_int_dequant_f32(const uint8_t *codes, const float *scales, const float *offsets,
                           int64_t n0, int64_t n1, int64_t k, int64_t group, int64_t bits,
                           float *out) {
#pragma omp parallel for schedule(static) if ((n1 - n0) * k >= PARALLEL_MIN)
    for (int64_t r = n0; r < n1; ++r)
        dequant_row(codes, scales, offsets, r, k, group, bits, 0, k, out + (r - n0) * k);
}
