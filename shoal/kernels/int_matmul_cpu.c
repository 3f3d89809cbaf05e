/* Weight-only integer matmul for CPU: out[m, n] = sum_k x[m, k] * W[n, k], float32 sums,
   with W kept as 4-bit or 8-bit codes and dequantized tile by tile inside the loop.

   Layout (shoal/kernels/int_matmul_cpu.py packs it):
   - codes: row n of W is k codes in sub-blocks of 32 columns. 4-bit: 16 bytes per
     sub-block, byte i holding column i (low nibble) and column 16 + i (high nibble), which
     is GGUF's Q4_0/Q4_1 nibble order, so those blocks are copied in as they are; 8-bit: one
     unsigned byte per column.
   - scales, offsets: [n, k / group], W[n, k] = code * scale + offset for the group of
     column k. group is a multiple of 32. Every integer format folds into this (a zero
     point z: offset = -z * scale; GGUF Q4_1's min is the offset itself). float32, or
     float16 / bfloat16 (scale_fmt 1 / 2) where the loader found both exact in it: at group
     32 that is 1 bit a weight instead of 2.
   - fmt (the Python side's IntPacked.fmt): the scales' type in its low 4 bits, and in bits
     4-7 what `offsets` holds: 0 offsets in the scales' type; 1 one unsigned zero point z a
     group, uint8, offset = -z * scale (rounded once in float32, as an offset computed at load
     would be); 2 the same zero points two a byte (group i: byte i / 2, low nibble when i is
     even); 3 one zero point for the whole tensor (offsets[0]); 4 none (offset 0). A 4-bit
     zero point costs 1/8 bit a weight at group 32, a float32 offset 1 bit.
   - bits == 0: float8_e4m3fn codes (one byte a column), W = fp8 * scale, scale per group
     (FP8 block-scaled or per-channel weights; the offsets mode is 4).
   - bits == 6: GGUF Q6_K super-blocks as the file stores them (row n: k / 256 blocks of 210
     bytes: ql[128] low nibbles, qh[64] high 2-bit pairs, int8 scales[16] per 16 columns, fp16
     d), scales and offsets unused. Its scales come per 16 columns, and folding them into
     float32 groups would double its 6.56 bits a weight, so the blocks are decoded in
     dequant_row instead: W = (d * scale) * (q - 32), one rounding as the gguf package's
     dequantization.

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
#define QK 256    /* Q6_K: columns per super-block */
#define Q6K_BYTES 210

static int64_t row_bytes_of(int64_t bits, int64_t k) {
    return bits == 4 ? k / 2 : bits == 6 ? k / QK * Q6K_BYTES : k;
}

#define FP8 0  /* bits: float8_e4m3fn codes */

/* IEEE binary16 -> float32 (exact) */
static inline float half_to_float(const uint8_t *p) {
    const uint32_t h = (uint32_t)p[0] | (uint32_t)p[1] << 8;
#if defined(SHOAL_AVX2) && defined(__F16C__)
    return _cvtsh_ss((unsigned short)h);
#endif
    const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;
    uint32_t bits;
    float f;
    if (exp == 0) {  /* zero or subnormal: man * 2^-24, exact */
        f = (float)man * 5.9604644775390625e-08f;
        memcpy(&bits, &f, 4);
        bits |= sign;
    } else if (exp == 31) {
        bits = sign | 0x7f800000u | man << 13;
    } else {
        bits = sign | (exp + 112) << 23 | man << 13;
    }
    memcpy(&f, &bits, 4);
    return f;
}

/* scale or offset i of a float32 (0), float16 (1) or bfloat16 (2) array */
static inline float scale_at(const void *p, int64_t i, int64_t fmt) {
    if (fmt == 0) return ((const float *)p)[i];
    if (fmt == 2) {
        const uint32_t bits = (uint32_t)((const uint16_t *)p)[i] << 16;
        float f;
        memcpy(&f, &bits, 4);
        return f;
    }
    return half_to_float((const uint8_t *)p + 2 * i);
}

/* group i's scale and offset, fmt as in the header */
static inline void group_so(const void *scales, const void *offsets, int64_t i, int64_t fmt,
                            float *s, float *o) {
    const int64_t sfmt = fmt & 15;
    *s = scale_at(scales, i, sfmt);
    const uint8_t *z = (const uint8_t *)offsets;
    switch (fmt >> 4) {
    case 0: *o = scale_at(offsets, i, sfmt); break;
    case 1: *o = -(float)z[i] * *s; break;
    case 2: *o = -(float)((z[i >> 1] >> ((i & 1) * 4)) & 15) * *s; break;
    case 3: *o = -(float)z[0] * *s; break;
    default: *o = 0.0f; break;
    }
}

/* float8_e4m3fn -> float32, exact: the sign moved to bit 31, exponent and mantissa placed
   under float32's (e4m3's bias 7, float32's 127: times 2^120; an e4m3 subnormal lands on a
   float32 subnormal, scaled exactly the same) */
static inline float fp8_to_float(uint8_t b) {
    const uint32_t bits = (uint32_t)(b & 0x7f) << 20;
    float f;
    memcpy(&f, &bits, 4);
    f *= 0x1p120f;
    return (b & 0x80) ? -f : f;
}

#ifdef SHOAL_AVX2
static inline __m256 fp8x8_to_ps(__m128i v) {
    const __m256i w = _mm256_cvtepu8_epi32(v);
    const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x7f)), 20);
    const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(w, _mm256_set1_epi32(0x80)), 24);
    const __m256 f = _mm256_mul_ps(_mm256_castsi256_ps(mag), _mm256_set1_ps(0x1p120f));
    return _mm256_or_ps(f, _mm256_castsi256_ps(sign));
}
#endif

/* A Q6_K row's columns [col, col + 32) (col a multiple of 32) as unsigned codes with a
   scale and offset per half of 16 columns: within a half of 128 columns, the quarter qd
   takes ql's low (qd < 2) or high nibbles of bytes (qd & 1) * 32 + l and bits 2 qd of qh[l]
   (llama.cpp's dequantize_row_q6_K); scale d * sc[16 columns], offset -32 * scale, so
   code * scale + offset (one FMA) rounds once to (d * sc) * (q - 32), as the gguf package's
   dequantization. */
typedef struct { float s[2], o[2]; int shift, hshift; const uint8_t *lo, *hi; } kchunk;

static inline kchunk kquant_chunk(const uint8_t *row, int64_t col) {
    kchunk c;
    const uint8_t *blk = row + col / QK * Q6K_BYTES;
    const int64_t p = col % QK, half = p / 128, qd = (p % 128) / 32;
    const int8_t *sc = (const int8_t *)(blk + 192) + 8 * half + 2 * qd;
    const float d = half_to_float(blk + 208);
    for (int i = 0; i < 2; ++i) c.s[i] = d * (float)sc[i], c.o[i] = -32.0f * c.s[i];
    c.lo = blk + 64 * half + (qd & 1) * 32, c.hi = blk + 128 + 32 * half;
    c.shift = qd >= 2 ? 4 : 0, c.hshift = 2 * (int)qd;
    return c;
}

static inline int kquant_code(const kchunk *c, int l) {
    return ((c->lo[l] >> c->shift) & 15) | ((c->hi[l] >> c->hshift) & 3) << 4;
}

#ifdef SHOAL_AVX2
/* the chunk's 32 codes, 8 in the low bytes of each of v[0..3] */
static inline void kquant_codes(const kchunk *c, __m128i v[4]) {
    const __m256i low = _mm256_and_si256(
        _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)c->lo), _mm_cvtsi32_si128(c->shift)),
        _mm256_set1_epi8(0x0f));
    const __m256i two = _mm256_and_si256(
        _mm256_srl_epi16(_mm256_loadu_si256((const __m256i *)c->hi),
                         _mm_cvtsi32_si128(c->hshift)), _mm256_set1_epi8(0x03));
    const __m256i codes = _mm256_or_si256(low, _mm256_slli_epi16(two, 4));
    const __m128i lo = _mm256_castsi256_si128(codes), hi = _mm256_extracti128_si256(codes, 1);
    v[0] = lo, v[1] = _mm_srli_si128(lo, 8), v[2] = hi, v[3] = _mm_srli_si128(hi, 8);
}
#endif

/* float32 [32] <- a Q6_K row's columns [col, col + 32) */
static void dequant_q6k(const uint8_t *row, int64_t col, float *d) {
    const kchunk c = kquant_chunk(row, col);
#ifdef SHOAL_AVX2
    __m128i v[4];
    kquant_codes(&c, v);
    for (int i = 0; i < 4; ++i)
        _mm256_storeu_ps(d + 8 * i, _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v[i])), _mm256_set1_ps(c.s[i / 2]),
            _mm256_set1_ps(c.o[i / 2])));
#else
    for (int l = 0; l < 32; ++l)
        d[l] = __builtin_fmaf((float)kquant_code(&c, l), c.s[l / 16], c.o[l / 16]);
#endif
}

/* float32 [KC] <- weight row n's columns [k0, k0 + len) (len a multiple of SUB) */
static void dequant_row(const uint8_t *codes, const void *scales, const void *offsets,
                        int64_t n, int64_t k, int64_t group, int64_t bits, int64_t sfmt,
                        int64_t k0, int64_t len, float *dst) {
    const int64_t groups = k / group;
    const int64_t row_bytes = row_bytes_of(bits, k);
    for (int64_t j = 0; j < len; j += SUB) {
        const int64_t col = k0 + j;
        if (bits == 6) {
            dequant_q6k(codes + n * row_bytes, col, dst + j);
            continue;
        }
        float s, o;
        group_so(scales, offsets, n * groups + col / group, sfmt, &s, &o);
        const uint8_t *src = codes + n * row_bytes + (bits == 4 ? col / 2 : col);
        float *d = dst + j;
        if (bits == FP8) {
#ifdef SHOAL_AVX2
            const __m256 v8 = _mm256_set1_ps(s);
            for (int q = 0; q < 4; ++q)
                _mm256_storeu_ps(d + 8 * q, _mm256_mul_ps(
                    fp8x8_to_ps(_mm_loadl_epi64((const __m128i *)(src + 8 * q))), v8));
#else
            for (int i = 0; i < SUB; ++i) d[i] = fp8_to_float(src[i]) * s;
#endif
            continue;
        }
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
   code, scale and offset), summed in another order. out[r - n0] for rows [n0, n1). */
static void gemv_rows(const float *x, const uint8_t *codes, const void *scales,
                      const void *offsets, int64_t n0, int64_t n1, int64_t k, int64_t group,
                      int64_t bits, int64_t sfmt, float *out) {
    const int64_t groups = k / group;
    const int64_t row_bytes = row_bytes_of(bits, k);
    const __m128i mask = _mm_set1_epi8(0x0f);
    for (int64_t r = n0; r < n1; ++r) {
        __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
        __m256 acc2 = _mm256_setzero_ps(), acc3 = _mm256_setzero_ps();
        const uint8_t *row = codes + r * row_bytes;
        for (int64_t col = 0; col < k; col += SUB) {
            __m128i a, b, c, e;
            __m256 vs, vo, vs2, vo2;  /* columns 0-15, 16-31 */
            if (bits == 6) {
                const kchunk kc = kquant_chunk(row, col);
                __m128i v[4];
                kquant_codes(&kc, v);
                a = v[0], b = v[1], c = v[2], e = v[3];
                vs = _mm256_set1_ps(kc.s[0]), vo = _mm256_set1_ps(kc.o[0]);
                vs2 = _mm256_set1_ps(kc.s[1]), vo2 = _mm256_set1_ps(kc.o[1]);
            } else if (bits == FP8) {
                float s, o;
                group_so(scales, offsets, r * groups + col / group, sfmt, &s, &o);
                const __m256 v8 = _mm256_set1_ps(s);
                for (int q = 0; q < 4; ++q) {
                    const __m256 w8 = _mm256_mul_ps(
                        fp8x8_to_ps(_mm_loadl_epi64((const __m128i *)(row + col + 8 * q))), v8);
                    const __m256 xv = _mm256_loadu_ps(x + col + 8 * q);
                    if (q == 0) acc0 = _mm256_fmadd_ps(w8, xv, acc0);
                    else if (q == 1) acc1 = _mm256_fmadd_ps(w8, xv, acc1);
                    else if (q == 2) acc2 = _mm256_fmadd_ps(w8, xv, acc2);
                    else acc3 = _mm256_fmadd_ps(w8, xv, acc3);
                }
                continue;
            } else if (bits == 4) {
                float s, o;
                group_so(scales, offsets, r * groups + col / group, sfmt, &s, &o);
                vs = vs2 = _mm256_set1_ps(s);
                vo = vo2 = _mm256_set1_ps(o);
                const __m128i packed = _mm_loadu_si128((const __m128i *)(row + col / 2));
                const __m128i lo = _mm_and_si128(packed, mask);
                const __m128i hi = _mm_and_si128(_mm_srli_epi16(packed, 4), mask);
                a = lo, b = _mm_srli_si128(lo, 8), c = hi, e = _mm_srli_si128(hi, 8);
            } else {
                float s, o;
                group_so(scales, offsets, r * groups + col / group, sfmt, &s, &o);
                vs = vs2 = _mm256_set1_ps(s);
                vo = vo2 = _mm256_set1_ps(o);
                a = _mm_loadl_epi64((const __m128i *)(row + col));
                b = _mm_loadl_epi64((const __m128i *)(row + col + 8));
                c = _mm_loadl_epi64((const __m128i *)(row + col + 16));
                e = _mm_loadl_epi64((const __m128i *)(row + col + 24));
            }
#define SHOAL_W(v, s, o) _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), s, o)
            acc0 = _mm256_fmadd_ps(SHOAL_W(a, vs, vo), _mm256_loadu_ps(x + col), acc0);
            acc1 = _mm256_fmadd_ps(SHOAL_W(b, vs, vo), _mm256_loadu_ps(x + col + 8), acc1);
            acc2 = _mm256_fmadd_ps(SHOAL_W(c, vs2, vo2), _mm256_loadu_ps(x + col + 16), acc2);
            acc3 = _mm256_fmadd_ps(SHOAL_W(e, vs2, vo2), _mm256_loadu_ps(x + col + 24), acc3);
#undef SHOAL_W
        }
        const __m256 acc = _mm256_add_ps(_mm256_add_ps(acc0, acc1), _mm256_add_ps(acc2, acc3));
        const __m128 h = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        const __m128 q = _mm_add_ps(h, _mm_movehl_ps(h, h));
        out[r - n0] = _mm_cvtss_f32(_mm_add_ss(q, _mm_shuffle_ps(q, q, 1)));
    }
}
#endif

/* out [rows, n] (rows out_stride apart) = x [rows, k] (x_stride apart) @ W^T. k and group
   multiples of 32, group dividing k. */
void shoal_int_matmul_f32(const float *x, int64_t x_stride, int64_t rows, const uint8_t *codes,
                          const void *scales, const void *offsets, int64_t n, int64_t k,
                          int64_t group, int64_t bits, int64_t sfmt, float *out,
                          int64_t out_stride) {
    const int64_t tiles = (n + NR - 1) / NR;
#ifdef SHOAL_AVX2
    if (rows == 1) {
#pragma omp parallel for schedule(static) if (n * k >= PARALLEL_MIN)
        for (int64_t t = 0; t < tiles; ++t)
            gemv_rows(x, codes, scales, offsets, t * NR, t * NR + NR < n ? t * NR + NR : n, k,
                      group, bits, sfmt, out + t * NR);
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
                    dequant_row(codes, scales, offsets, n0 + j, k, group, bits, sfmt, k0, len,
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
void shoal_int_dequant_f32(const uint8_t *codes, const void *scales, const void *offsets,
                           int64_t n0, int64_t n1, int64_t k, int64_t group, int64_t bits,
                           int64_t sfmt, float *out) {
#pragma omp parallel for schedule(static) if ((n1 - n0) * k >= PARALLEL_MIN)
    for (int64_t r = n0; r < n1; ++r)
        dequant_row(codes, scales, offsets, r, k, group, bits, sfmt, 0, k, out + (r - n0) * k);
}

/* float32 W[n, :] into dst [k]: one row for a caller that multiplies it itself (the
   quantized experts of moe_experts_cpu.c). */
void shoal_int_dequant_row(const uint8_t *codes, const void *scales, const void *offsets,
                           int64_t n, int64_t k, int64_t group, int64_t bits, int64_t fmt,
                           float *dst) {
    dequant_row(codes, scales, offsets, n, k, group, bits, fmt, 0, k, dst);
}

/* out[r - n0] = x . W[r, :] for rows [n0, n1), one activation row, straight from the codes
   (the quantized experts' one-token items); returns 0 where there is no such path (no AVX2:
   the caller dequantizes the rows and multiplies them itself). */
int shoal_int_gemv_rows(const float *x, const uint8_t *codes, const void *scales,
                        const void *offsets, int64_t n0, int64_t n1, int64_t k, int64_t group,
                        int64_t bits, int64_t fmt, float *out) {
#ifdef SHOAL_AVX2
    gemv_rows(x, codes, scales, offsets, n0, n1, k, group, bits, fmt, out);
    return 1;
#else
    (void)x, (void)codes, (void)scales, (void)offsets, (void)n0, (void)n1, (void)k;
    (void)group, (void)bits, (void)fmt, (void)out;
    return 0;
#endif
}
