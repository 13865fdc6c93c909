/* Paged decode attention for the CPU, float32.
 *
 * One work item is (sequence, kv head): it reads that head's K/V once, block by block
 * through the block table, for all G = Hq / Hkv query heads of its group, with an online
 * softmax (running max m, running sum l, rescaled accumulator). This reads the KV pool
 * once per step, where a gather-then-SDPA path copies it first and reads it twice.
 *
 *   q      [nd, q_stride]        query head i of sequence s at q + s*q_stride + i*D
 *   cache  [num_blocks, BS, Hkv, D]   (k and v alike)
 *   tables [nd, table_stride]    int32 block ids
 *   lens   [nd]                  int32 context lengths (>= 1)
 *   out    [nd, Hq, D]           contiguous
 *
 * Threads are plain pthreads, not OpenMP: a second OpenMP runtime beside PyTorch's leaves
 * its idle threads spinning against PyTorch's and slows every later matmul several-fold.
 */
#include <math.h>
#include <pthread.h>
#include <stdint.h>

#define MAX_GROUP 32
#define MAX_DIM 256

static inline float dot(const float *restrict a, const float *restrict b, int64_t d) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int64_t i = 0; i < d; ++i) s += a[i] * b[i];
    return s;
}

typedef struct {
    const float *q, *k_cache, *v_cache;
    const int32_t *tables, *lens;
    float *out;
    int64_t q_stride, table_stride, nd, hq, hkv, d, bs;
    float scale;
    int64_t first, step; /* this thread's work items: first, first + step, ... */
} Job;

static void run_items(const Job *j) {
    const int64_t g = j->hq / j->hkv, d = j->d, bs = j->bs, hkv = j->hkv;
    const int64_t pos_stride = hkv * d; /* between two positions of one block */
    float m[MAX_GROUP], l[MAX_GROUP], acc[MAX_GROUP * MAX_DIM], sc[1024];
    for (int64_t w = j->first; w < j->nd * hkv; w += j->step) {
        const int64_t s = w / hkv, h = w % hkv;
        const int64_t len = j->lens[s];
        const int32_t *table = j->tables + s * j->table_stride;
        const float *qh = j->q + s * j->q_stride + h * g * d;
        for (int64_t gi = 0; gi < g; ++gi) {
            m[gi] = -INFINITY;
            l[gi] = 0.0f;
            for (int64_t i = 0; i < d; ++i) acc[gi * d + i] = 0.0f;
        }
        for (int64_t start = 0; start < len; start += bs) {
            const int64_t blk = table[start / bs];
            const int64_t n = len - start < bs ? len - start : bs;
            const float *kb = j->k_cache + (blk * bs * hkv + h) * d;
            const float *vb = j->v_cache + (blk * bs * hkv + h) * d;
            for (int64_t gi = 0; gi < g; ++gi) {
                const float *qg = qh + gi * d;
                float bmax = -INFINITY;
                for (int64_t t = 0; t < n; ++t) {
                    sc[t] = dot(qg, kb + t * pos_stride, d) * j->scale;
                    if (sc[t] > bmax) bmax = sc[t];
                }
                const float mnew = bmax > m[gi] ? bmax : m[gi];
                const float corr = expf(m[gi] - mnew); /* 0 on the first block */
                float *a = acc + gi * d;
                float lsum = l[gi] * corr;
#pragma omp simd
                for (int64_t i = 0; i < d; ++i) a[i] *= corr;
                for (int64_t t = 0; t < n; ++t) {
                    const float p = expf(sc[t] - mnew);
                    const float *vt = vb + t * pos_stride;
                    lsum += p;
#pragma omp simd
                    for (int64_t i = 0; i < d; ++i) a[i] += p * vt[i];
                }
                l[gi] = lsum;
                m[gi] = mnew;
            }
        }
        for (int64_t gi = 0; gi < g; ++gi) {
            float *o = j->out + (s * j->hq + h * g + gi) * d;
            const float inv = 1.0f / l[gi];
            for (int64_t i = 0; i < d; ++i) o[i] = acc[gi * d + i] * inv;
        }
    }
}

static void *thread_main(void *arg) {
    run_items((const Job *)arg);
    return NULL;
}

#define MAX_THREADS 64

int paged_decode_f32(const float *q, int64_t q_stride, const float *k_cache, const float *v_cache,
                     const int32_t *tables, int64_t table_stride, const int32_t *lens, float *out,
                     int64_t nd, int64_t hq, int64_t hkv, int64_t d, int64_t bs, float scale,
                     int nthreads) {
    if (hq / hkv > MAX_GROUP || d > MAX_DIM || bs > 1024) return -1;
    int64_t items = nd * hkv;
    int64_t nt = nthreads < 1 ? 1 : (nthreads > MAX_THREADS ? MAX_THREADS : nthreads);
    if (nt > items) nt = items;
    Job jobs[MAX_THREADS];
    pthread_t threads[MAX_THREADS];
    for (int64_t t = 0; t < nt; ++t) {
        Job j = {q, k_cache, v_cache, tables, lens, out, q_stride, table_stride,
                 nd, hq, hkv, d, bs, scale, t, nt};
        jobs[t] = j;
    }
    int64_t started = 1;
    for (int64_t t = 1; t < nt; ++t, ++started)
        if (pthread_create(&threads[t], NULL, thread_main, &jobs[t]) != 0) break;
    /* items of threads that could not start run here, after the caller's own share */
    run_items(&jobs[0]);
    for (int64_t t = started; t < nt; ++t) run_items(&jobs[t]);
    for (int64_t t = 1; t < started; ++t) pthread_join(threads[t], NULL);
    return 0;
}
