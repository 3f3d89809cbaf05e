/* Reading a float8 KV cache (--kv-cache-dtype fp8 / fp8_e5m2) on CPU: a 256-entry table
   from each byte to its float32 value times the layer's scale, built once per kernel call
   (1 KB for K, 1 KB for V) and used by the decode and prefill kernels as they load a row.

   A table is exact for all 256 bytes, subnormals included: a bit trick (the byte's bits
   placed in a float32's exponent and mantissa, then rescaled) would turn float8 subnormals
   into float32 denormals, which a flush-to-zero / denormals-are-zero mode zeroes. Each value
   is built from its fields with ldexpf, so nothing here depends on such modes either:
     e4m3fn: bias 7, no infinities, S.1111.111 is NaN (448 is the largest finite)
     e5m2:   bias 15, IEEE-like (exponent 31: infinity, or NaN with a mantissa)
   "value * scale" is one float32 multiply, as torch's dequantize computes it. */

#include <math.h>
#include <stdint.h>

/* kv_kind of the kernels' entry points; values 2 and 3 are the two float8 formats */
enum { KV_FP8_E4M3 = 2, KV_FP8_E5M2 = 3 };

static float fp8_e4m3_value(unsigned byte) {
    const unsigned exponent = (byte >> 3) & 0xf, mantissa = byte & 0x7;
    float magnitude;
    if (exponent == 0xf && mantissa == 0x7) magnitude = NAN;
    else if (exponent == 0) magnitude = ldexpf((float)mantissa, -9);
    else magnitude = ldexpf((float)(8 + mantissa), (int)exponent - 10);
    return byte & 0x80 ? -magnitude : magnitude;
}

static float fp8_e5m2_value(unsigned byte) {
    const unsigned exponent = (byte >> 2) & 0x1f, mantissa = byte & 0x3;
    float magnitude;
    if (exponent == 0x1f) magnitude = mantissa ? NAN : INFINITY;
    else if (exponent == 0) magnitude = ldexpf((float)mantissa, -16);
    else magnitude = ldexpf((float)(4 + mantissa), (int)exponent - 17);
    return byte & 0x80 ? -magnitude : magnitude;
}

/* table[b] = the float8 byte b of format kv_kind, widened, times scale */
void shoal_fp8_table(int64_t kv_kind, float scale, float *table) {
    for (unsigned b = 0; b < 256; ++b)
        table[b] = (kv_kind == KV_FP8_E5M2 ? fp8_e5m2_value(b) : fp8_e4m3_value(b)) * scale;
}
