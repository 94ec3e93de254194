// Fused attention for decoder steps on the CPU (runtime/fused_attention.py builds and loads it).
// For each (row, head) b: a few queries over L cached keys and values of head dim 64, scores,
// float32 softmax and weighted sum in one pass, without materialising the product's operands:
// batched products of these sizes run far below a core's peak (docs/benchmarks.md).
#include <math.h>
#include <stdint.h>
#include <string.h>

typedef float v8 __attribute__((vector_size(32)));
typedef int32_t i8 __attribute__((vector_size(32)));

static inline v8 ld(const float *p) { v8 x; memcpy(&x, p, sizeof x); return x; }
static inline void st(float *p, v8 x) { memcpy(p, &x, sizeof x); }
static inline float hsum(v8 a) { return ((a[0] + a[4]) + (a[1] + a[5])) + ((a[2] + a[6]) + (a[3] + a[7])); }
static inline float hmax(v8 a) {
    float m = a[0];
    for (int j = 1; j < 8; j++) m = a[j] > m ? a[j] : m;
    return m;
}

// exp(x) for x <= 0 (shifted scores): Cephes' expf polynomial after reduction by ln 2; 0 below -87
// (and at -inf), NaN stays NaN.
static inline v8 vexp(v8 x) {
    const v8 zero = {};
    i8 low = x < -87.0f;
    x = low ? zero - 87.0f : x;
    i8 ni = __builtin_convertvector(x * 1.44269504088896341f - 0.5f, i8);  // nearest, as x <= 0
    v8 n = __builtin_convertvector(ni, v8);
    v8 r = x - n * 0.693359375f + n * 2.12194440e-4f;
    v8 p = 1.9875691500E-4f * r + 1.3981999507E-3f;
    p = p * r + 8.3334519073E-3f;
    p = p * r + 4.1665795894E-2f;
    p = p * r + 1.6666665459E-1f;
    p = p * r + 5.0000001201E-1f;
    p = p * (r * r) + r + 1.0f;
    i8 e = (ni + 127) << 23;
    v8 scale;
    memcpy(&scale, &e, sizeof scale);
    return low ? zero : p * scale;
}

// softmax of s[0..L) in place
static inline void softmax(float *s, int64_t L) {
    v8 m8 = (v8){} + s[0];
    int64_t l = 0;
    for (; l + 8 <= L; l += 8) { v8 x = ld(s + l); m8 = x > m8 ? x : m8; }
    float mx = hmax(m8);
    for (; l < L; l++) mx = s[l] > mx ? s[l] : mx;
    v8 sum8 = {};
    for (l = 0; l + 8 <= L; l += 8) { v8 e = vexp(ld(s + l) - mx); st(s + l, e); sum8 += e; }
    float sum = hsum(sum8);
    if (l < L) {
        float t[8];
        for (int j = 0; j < 8; j++) t[j] = l + j < L ? s[l + j] - mx : -INFINITY;
        v8 e = vexp(ld(t));
        for (int j = 0; l + j < L; j++) { s[l + j] = e[j]; sum += e[j]; }
    }
    float inv = 1.0f / sum;
    for (l = 0; l < L; l++) s[l] *= inv;
}

// For each b < B: M queries q[b, i] over L keys k[b, l] and values v[b, l], rows of 64 contiguous
// floats: out[b, i] = softmax_l(q[b, i] . k[b, l] + add[b * asb + i * asm + l]) v[b]. `add` may be
// NULL; `scores` holds B * M * L floats.
extern "C" void attend64_f32(const float *q, const float *k, const float *v, const float *add, int64_t asb,
                             int64_t asm_, float *out, int64_t B, int64_t M, int64_t L, float *scores, int threads) {
    enum { D = 64 };
    #pragma omp parallel for schedule(static) num_threads(threads) if (threads > 1)
    for (int64_t b = 0; b < B; b++) {
        const float *kb = k + b * L * D, *vb = v + b * L * D, *qb = q + b * M * D;
        float *s = scores + b * M * L;
        for (int64_t l = 0; l < L; l++) {
            const float *kl = kb + l * D;
            v8 k0 = ld(kl), k1 = ld(kl + 8), k2 = ld(kl + 16), k3 = ld(kl + 24);
            v8 k4 = ld(kl + 32), k5 = ld(kl + 40), k6 = ld(kl + 48), k7 = ld(kl + 56);
            for (int64_t i = 0; i < M; i++) {
                const float *qi = qb + i * D;
                v8 a0 = ld(qi) * k0 + ld(qi + 16) * k2 + ld(qi + 32) * k4 + ld(qi + 48) * k6;
                v8 a1 = ld(qi + 8) * k1 + ld(qi + 24) * k3 + ld(qi + 40) * k5 + ld(qi + 56) * k7;
                s[i * L + l] = hsum(a0 + a1);
            }
        }
        for (int64_t i = 0; i < M; i++) {
            float *si = s + i * L;
            if (add) {
                const float *ai = add + b * asb + i * asm_;
                for (int64_t l = 0; l < L; l++) si[l] += ai[l];
            }
            softmax(si, L);
            v8 o0 = {}, o1 = {}, o2 = {}, o3 = {}, o4 = {}, o5 = {}, o6 = {}, o7 = {};
            for (int64_t l = 0; l < L; l++) {
                float p = si[l];
                const float *vl = vb + l * D;
                o0 += p * ld(vl); o1 += p * ld(vl + 8); o2 += p * ld(vl + 16); o3 += p * ld(vl + 24);
                o4 += p * ld(vl + 32); o5 += p * ld(vl + 40); o6 += p * ld(vl + 48); o7 += p * ld(vl + 56);
            }
            float *o = out + (b * M + i) * D;
            st(o, o0); st(o + 8, o1); st(o + 16, o2); st(o + 24, o3);
            st(o + 32, o4); st(o + 40, o5); st(o + 48, o6); st(o + 56, o7);
        }
    }
}
