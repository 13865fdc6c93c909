/* Products of float32 activations with GGUF block-quantized weights, read in their GGUF
 * blocks (no float32 copy of the weight is kept). Built by bucketserve/kernels/cpu_quant.py
 * for the host (-march=native, the same cache and OpenMP team as csrc/paged_decode.c).
 *
 * Blocks of 32 weights along a row of the [N, K] weight (llama.cpp's layout):
 *   Q4_1: 20 bytes: d (fp16), m (fp16), 16 bytes of nibbles; byte i holds weight i in its
 *         low nibble and weight i + 16 in its high one; w = d * q + m.
 *   Q8_0: 34 bytes: d (fp16), 32 int8; w = d * q.
 *
 * Each weight is computed as the fused multiply-add fma(q, d, m) (Q8_0: q * d): the product
 * d * q of an fp16 scale and a small integer is exact in float32, so this is bit for bit the
 * float32 value that gguf's dequantize ((d * q) + m) gives. The products then run in float32
 * with float32 accumulation: the result equals the float32 GEMM of the dequantized weight up
 * to the order of the additions.
 *
 *   out[M, N] = x[M, K] @ W^T        x, out row-major (row strides x_stride, out_stride)
 *
 * q_gemm: per strip of NR output channels, the strip is dequantized once into a float32
 * buffer on the stack (NR x K, at most 4 x 8192 floats = 128 KiB: L1/L2) and every row tile
 * of MR rows runs a register-blocked dot-product kernel over it (MR x NR accumulators, one
 * vector load of x and of each weight row per step of VLEN columns). Strips are divided over
 * the OpenMP team. Used for the small row counts of decode steps; larger ones
 * (cpu_quant.py) dequantize whole weights into a scratch buffer with q_dequant and use the
 * float32 GEMM of PyTorch.
 */
#include <stdint.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <immintrin.h>

#define QK 32
#define NR 4
#define MAX_K 8192

enum { Q4_1 = 3, Q8_0 = 8 }; /* gguf.GGMLQuantizationType values */

int bq_isa(void) {
#if defined(__AVX512F__)
    return 3;
#elif defined(__AVX2__) && defined(__FMA__)
    return 2;
#else
    return 1;
#endif
}

static inline float fp16_to_f32(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* One row of blocks (K / 32 of them) -> K floats. */
static void dequant_row(int type, const uint8_t *src, int64_t k, float *dst) {
    const int64_t nb = k / QK;
    if (type == Q4_1) {
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + b * 20;
            const float d = fp16_to_f32(blk), m = fp16_to_f32(blk + 2);
            const uint8_t *qs = blk + 4;
            float *o = dst + b * QK;
#if defined(__AVX512F__)
            const __m512i bytes = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)qs));
            const __m512i mask = _mm512_set1_epi32(0xF);
            const __m512 vd = _mm512_set1_ps(d), vm = _mm512_set1_ps(m);
            _mm512_storeu_ps(o, _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_and_si512(bytes, mask)), vd, vm));
            _mm512_storeu_ps(o + 16, _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_srli_epi32(bytes, 4)), vd, vm));
#elif defined(__AVX2__) && defined(__FMA__)
            const __m256i mask = _mm256_set1_epi32(0xF);
            const __m256 vd = _mm256_set1_ps(d), vm = _mm256_set1_ps(m);
            for (int h = 0; h < 2; h++) {
                const __m256i bytes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * h)));
                _mm256_storeu_ps(o + 8 * h, _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_and_si256(bytes, mask)), vd, vm));
                _mm256_storeu_ps(o + 16 + 8 * h, _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_srli_epi32(bytes, 4)), vd, vm));
            }
#else
            for (int i = 0; i < 16; i++) {
                o[i] = __builtin_fmaf((float)(qs[i] & 0xF), d, m);
                o[i + 16] = __builtin_fmaf((float)(qs[i] >> 4), d, m);
            }
#endif
        }
    } else { /* Q8_0 */
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t *blk = src + b * 34;
            const float d = fp16_to_f32(blk);
            const int8_t *qs = (const int8_t *)(blk + 2);
            float *o = dst + b * QK;
#if defined(__AVX512F__)
            const __m512 vd = _mm512_set1_ps(d);
            for (int h = 0; h < 2; h++)
                _mm512_storeu_ps(o + 16 * h, _mm512_mul_ps(_mm512_cvtepi32_ps(
                    _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(qs + 16 * h)))), vd));
#elif defined(__AVX2__) && defined(__FMA__)
            const __m256 vd = _mm256_set1_ps(d);
            for (int h = 0; h < 4; h++)
                _mm256_storeu_ps(o + 8 * h, _mm256_mul_ps(_mm256_cvtepi32_ps(
                    _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(qs + 8 * h)))), vd));
#else
            for (int i = 0; i < QK; i++) o[i] = (float)qs[i] * d;
#endif
        }
    }
}

static inline int64_t row_bytes(int type, int64_t k) {
    return k / QK * (type == Q4_1 ? 20 : 34);
}

/* ---- the register-blocked kernel over a dequantized strip ------------------------------ */

#if defined(__AVX512F__)
#define VLEN 16
#define MR 4
typedef __m512 vec;
#define vzero() _mm512_setzero_ps()
#define vload(p) _mm512_loadu_ps(p)
#define vfma(a, b, c) _mm512_fmadd_ps(a, b, c)
#define vsum(a) _mm512_reduce_add_ps(a)
#elif defined(__AVX2__) && defined(__FMA__)
#define VLEN 8
#define MR 2
typedef __m256 vec;
#define vzero() _mm256_setzero_ps()
#define vload(p) _mm256_loadu_ps(p)
#define vfma(a, b, c) _mm256_fmadd_ps(a, b, c)
static inline float vsum(__m256 a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}
#endif

/* rows [m0, m0 + mr) x the strip's nr channels; w: [nr][k] floats. */
static inline void strip_tile(const float *x, int64_t x_stride, const float *w, int64_t k,
                              int64_t mr, int64_t nr, float *out, int64_t out_stride) {
#ifdef VLEN
    if (mr == MR && nr == NR) {
        vec acc[MR][NR];
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) acc[i][j] = vzero();
        for (int64_t c = 0; c < k; c += VLEN) {
            vec wv[NR];
            for (int j = 0; j < NR; j++) wv[j] = vload(w + j * k + c);
            for (int i = 0; i < MR; i++) {
                const vec xv = vload(x + i * x_stride + c);
                for (int j = 0; j < NR; j++) acc[i][j] = vfma(xv, wv[j], acc[i][j]);
            }
        }
        for (int i = 0; i < MR; i++)
            for (int j = 0; j < NR; j++) out[i * out_stride + j] = vsum(acc[i][j]);
        return;
    }
    for (int64_t i = 0; i < mr; i++)
        for (int64_t j = 0; j < nr; j++) {
            vec a = vzero();
            for (int64_t c = 0; c < k; c += VLEN)
                a = vfma(vload(x + i * x_stride + c), vload(w + j * k + c), a);
            out[i * out_stride + j] = vsum(a);
        }
#else
    for (int64_t i = 0; i < mr; i++)
        for (int64_t j = 0; j < nr; j++) {
            float a = 0.0f;
            for (int64_t c = 0; c < k; c++) a += x[i * x_stride + c] * w[j * k + c];
            out[i * out_stride + j] = a;
        }
#endif
}

#ifndef MR
#define MR 4
#endif

/* out[M, N] = x[M, K] @ dequant(W)^T (+ bias[N] if given). Returns 0, or -1 for a shape it
 * does not take (K not a multiple of 32 or above MAX_K, an unknown type). */
int q_gemm(int type, const uint8_t *wq, const float *x, int64_t x_stride, const float *bias,
           float *out, int64_t out_stride, int64_t m, int64_t n, int64_t k, int nt) {
    if (k % QK != 0 || k > MAX_K || (type != Q4_1 && type != Q8_0)) return -1;
    const int64_t rb = row_bytes(type, k);
    const int64_t strips = (n + NR - 1) / NR;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t s = 0; s < strips; s++) {
        float w[NR * MAX_K] __attribute__((aligned(64)));
        const int64_t n0 = s * NR, nr = n - n0 < NR ? n - n0 : NR;
        for (int64_t j = 0; j < nr; j++) dequant_row(type, wq + (n0 + j) * rb, k, w + j * k);
        for (int64_t m0 = 0; m0 < m; m0 += MR) {
            const int64_t mr = m - m0 < MR ? m - m0 : MR;
            strip_tile(x + m0 * x_stride, x_stride, w, k, mr, nr, out + m0 * out_stride + n0,
                       out_stride);
        }
        if (bias)
            for (int64_t i = 0; i < m; i++)
                for (int64_t j = 0; j < nr; j++) out[i * out_stride + n0 + j] += bias[n0 + j];
    }
    return 0;
}

/* The whole weight [N, K] as float32 (out contiguous). Returns 0, or -1 as q_gemm does. */
int q_dequant(int type, const uint8_t *wq, float *out, int64_t n, int64_t k, int nt) {
    if (k % QK != 0 || (type != Q4_1 && type != Q8_0)) return -1;
    const int64_t rb = row_bytes(type, k);
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t r = 0; r < n; r++) dequant_row(type, wq + r * rb, k, out + r * k);
    return 0;
}

/* ---- int8 weights (one scale per output channel) x int8 activations (one per row) -------
 *
 *   sx[i] = max_k |x[i, k]| / 127 (1 for a zero row), xq[i, k] = round_even(x[i, k] / sx[i])
 *   out[i, n] = (float)(sum_k xq[i, k] * wq[n, k]) * sx[i] * sw[n] (+ bias[n])
 *
 * The integer sums are exact, so the result is bit for bit that formula's (the tests'
 * reference computes it in torch). AVX-512 VNNI: vpdpbusd multiplies unsigned by signed
 * bytes, so the rows are stored as xq + 128 and 128 * sum_k wq[n, k] (wsum, precomputed)
 * is taken off. AVX2: vpmaddubsw on |xq| and wq with xq's sign, then vpmaddwd into int32
 * (|xq|, |wq| <= 127: the pair sums fit int16). K must be a multiple of 64. */

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define I8_VNNI 1
#define I8_OFFSET 128
#else
#define I8_OFFSET 0
#endif

int i8_isa(void) {
#if defined(I8_VNNI)
    return 4; /* AVX-512 VNNI */
#elif defined(__AVX2__)
    return 2;
#else
    return 1;
#endif
}

static void quantize_rows(const float *x, int64_t x_stride, int64_t m, int64_t k, uint8_t *xq,
                          float *sx) {
    for (int64_t i = 0; i < m; i++) {
        const float *r = x + i * x_stride;
        float amax = 0.0f;
#pragma omp simd reduction(max : amax)
        for (int64_t c = 0; c < k; c++) {
            const float a = r[c] < 0 ? -r[c] : r[c];
            amax = a > amax ? a : amax;
        }
        const float s = amax > 0.0f ? amax / 127.0f : 1.0f;
        sx[i] = s;
        uint8_t *o = xq + i * k;
#pragma omp simd
        for (int64_t c = 0; c < k; c++)
            o[c] = (uint8_t)((int32_t)__builtin_nearbyintf(r[c] / s) + I8_OFFSET);
    }
}

#define I8_NR 4
#if defined(I8_VNNI)
#define I8_MR 4
#else
#define I8_MR 2
#endif

/* sum_k xq[i, k] * wq[j, k] for a tile of rows x channels (offset removed). */
static inline void i8_tile(const uint8_t *xq, int64_t k, const int8_t *w, const int32_t *wsum,
                           int64_t mr, int64_t nr, int32_t *acc_out /* [mr][I8_NR] */) {
#if defined(I8_VNNI)
    if (mr == I8_MR && nr == I8_NR) {
        __m512i acc[I8_MR][I8_NR];
        for (int i = 0; i < I8_MR; i++)
            for (int j = 0; j < I8_NR; j++) acc[i][j] = _mm512_setzero_si512();
        for (int64_t c = 0; c < k; c += 64) {
            __m512i wv[I8_NR];
            for (int j = 0; j < I8_NR; j++) wv[j] = _mm512_loadu_si512(w + j * k + c);
            for (int i = 0; i < I8_MR; i++) {
                const __m512i xv = _mm512_loadu_si512(xq + i * k + c);
                for (int j = 0; j < I8_NR; j++) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, wv[j]);
            }
        }
        for (int i = 0; i < I8_MR; i++)
            for (int j = 0; j < I8_NR; j++)
                acc_out[i * I8_NR + j] = _mm512_reduce_add_epi32(acc[i][j]) - 128 * wsum[j];
        return;
    }
    for (int64_t i = 0; i < mr; i++)
        for (int64_t j = 0; j < nr; j++) {
            __m512i a = _mm512_setzero_si512();
            for (int64_t c = 0; c < k; c += 64)
                a = _mm512_dpbusd_epi32(a, _mm512_loadu_si512(xq + i * k + c),
                                        _mm512_loadu_si512(w + j * k + c));
            acc_out[i * I8_NR + j] = _mm512_reduce_add_epi32(a) - 128 * wsum[j];
        }
#elif defined(__AVX2__)
    (void)wsum;
    const __m256i ones = _mm256_set1_epi16(1);
    for (int64_t i0 = 0; i0 < mr; i0 += 1) {
        __m256i acc[I8_NR];
        for (int j = 0; j < I8_NR; j++) acc[j] = _mm256_setzero_si256();
        for (int64_t c = 0; c < k; c += 32) {
            const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + i0 * k + c));
            const __m256i ax = _mm256_sign_epi8(xv, xv);
            for (int64_t j = 0; j < nr; j++) {
                const __m256i wv = _mm256_loadu_si256((const __m256i *)(w + j * k + c));
                const __m256i p = _mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv));
                acc[j] = _mm256_add_epi32(acc[j], _mm256_madd_epi16(p, ones));
            }
        }
        for (int64_t j = 0; j < nr; j++) {
            __m128i s = _mm_add_epi32(_mm256_castsi256_si128(acc[j]),
                                      _mm256_extracti128_si256(acc[j], 1));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
            s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
            acc_out[i0 * I8_NR + j] = _mm_cvtsi128_si32(s);
        }
    }
#else
    (void)wsum;
    for (int64_t i = 0; i < mr; i++)
        for (int64_t j = 0; j < nr; j++) {
            int32_t a = 0;
            for (int64_t c = 0; c < k; c++) a += (int32_t)(int8_t)xq[i * k + c] * w[j * k + c];
            acc_out[i * I8_NR + j] = a;
        }
#endif
}

/* out[M, N] as above. xq: [M, K] bytes and sx: [M] floats of scratch (the caller's).
 * Returns 0, or -1 when K is not a multiple of 64. */
int i8_gemm(const float *x, int64_t x_stride, const int8_t *wq, const int32_t *wsum,
            const float *sw, const float *bias, float *out, int64_t out_stride, int64_t m,
            int64_t n, int64_t k, uint8_t *xq, float *sx, int nt) {
    if (k % 64 != 0) return -1;
    quantize_rows(x, x_stride, m, k, xq, sx);
    const int64_t strips = (n + I8_NR - 1) / I8_NR;
#pragma omp parallel for schedule(static) num_threads(nt) if (nt > 1)
    for (int64_t s = 0; s < strips; s++) {
        const int64_t n0 = s * I8_NR, nr = n - n0 < I8_NR ? n - n0 : I8_NR;
        int32_t acc[I8_MR * I8_NR];
        for (int64_t m0 = 0; m0 < m; m0 += I8_MR) {
            const int64_t mr = m - m0 < I8_MR ? m - m0 : I8_MR;
            i8_tile(xq + m0 * k, k, wq + n0 * k, wsum + n0, mr, nr, acc);
            for (int64_t i = 0; i < mr; i++)
                for (int64_t j = 0; j < nr; j++) {
                    float v = (float)acc[i * I8_NR + j] * sx[m0 + i] * sw[n0 + j];
                    if (bias) v += bias[n0 + j];
                    out[(m0 + i) * out_stride + n0 + j] = v;
                }
        }
    }
    return 0;
}
