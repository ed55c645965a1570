/* Checks one build of the fused AdamW kernel bit for bit against the scalar build (test_optim_neon.py runs it
 * under qemu-aarch64 with the NEON build): usage  optim_kernel_paths SCALAR.so OTHER.so INPUTS.bin
 * INPUTS.bin: the code books and thresholds (signed code, signed thr, unsigned code, unsigned thr; 256 fp32 each),
 * an int64 count and that many fp32 values to encode. Both builds encode the values, then run 4 steps of every
 * configuration (fp32/bf16 master, fp32/bf16 gradient, with and without the stream copy, fp32 and 8-bit states)
 * from the same inputs; every output must be equal. Prints the mismatches; exit status 1 if any. */
#include <dlfcn.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct { /* = lt_args of _adamw_kernel.c */
    float *p32;
    uint16_t *p16;
    const void *grad;
    int32_t grad_bf16, nthreads;
    float *m, *v;
    uint8_t *mq, *vq;
    float *mabs, *vabs;
    uint16_t *copy;
    int64_t n, block;
    float decay, w1, beta2, w2, neg_step, bc2_sqrt, eps, grad_scale;
    uint32_t sr_key;
    float v_floor;
} lt_args;

typedef struct {
    int (*step)(const lt_args *);
    void (*encode)(int, const float *, uint8_t *, int64_t);
    void (*tables)(const float *, const float *, const float *, const float *);
    int (*fast)(void);
} kernel;

enum { N = 3 * 4096 + 123, BLOCK = 4096, NBLK = (N + BLOCK - 1) / BLOCK };

typedef struct { /* everything a run writes */
    float p32[N], m[N], v[N], mabs[NBLK], vabs[NBLK];
    uint16_t p16[N], copy[N];
    uint8_t mq[N], vq[N];
} run_state;

static int load(const char *so, float tab[4][256], kernel *k) {
    void *h = dlopen(so, RTLD_NOW | RTLD_LOCAL);
    if (!h) return fprintf(stderr, "%s\n", dlerror()), 1;
    k->step = (int (*)(const lt_args *))dlsym(h, "lt_adamw_step");
    k->encode = (void (*)(int, const float *, uint8_t *, int64_t))dlsym(h, "lt_encode");
    k->tables = (void (*)(const float *, const float *, const float *, const float *))dlsym(h, "lt_set_tables");
    k->fast = (int (*)(void))dlsym(h, "lt_fast_encoder");
    if (!k->step || !k->encode || !k->tables || !k->fast) return fprintf(stderr, "%s: missing symbols\n", so), 1;
    k->tables(tab[0], tab[1], tab[2], tab[3]);
    return 0;
}

static uint32_t rng(uint32_t *s) {
    *s ^= *s << 13;
    *s ^= *s >> 17;
    *s ^= *s << 5;
    return *s;
}

/* Gradient-like values: random sign, magnitudes over 6 decades. */
static float sample(uint32_t *s) {
    const float u = (float)(rng(s) >> 8) / 16777216.0f, e = (float)(rng(s) >> 8) / 16777216.0f;
    return (u - 0.5f) * powf(10.0f, -6.0f * e);
}

static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return (uint16_t)(u >> 16);
}

static void run(const kernel *k, int cfg, run_state *r) {
    const int p16 = cfg & 1, g16 = cfg & 2, cp = cfg & 4, q8 = cfg & 8;
    uint32_t seed = 12345;
    memset(r, 0, sizeof(*r));
    for (int i = 0; i < N; i++) {
        r->p32[i] = sample(&seed) * 100.0f;
        r->p16[i] = to_bf16(r->p32[i]);
    }
    static float g32[N];
    static uint16_t g16v[N];
    for (int t = 1; t <= 4; t++) {
        for (int i = 0; i < N; i++) {
            g32[i] = sample(&seed);
            g16v[i] = to_bf16(g32[i]);
        }
        const double b1 = 0.9, b2 = 0.999, lr = 1e-2;
        lt_args a = {p16 ? NULL : r->p32, p16 ? r->p16 : NULL, g16 ? (const void *)g16v : (const void *)g32,
                     g16 != 0, 2, q8 ? NULL : r->m, q8 ? NULL : r->v, q8 ? r->mq : NULL, q8 ? r->vq : NULL,
                     r->mabs, r->vabs, cp ? r->copy : NULL, N, BLOCK, (float)(1 - lr * 1e-2), (float)(1 - b1),
                     (float)b2, (float)(1 - b2), (float)(-lr / (1 - pow(b1, t))), (float)sqrt(1 - pow(b2, t)),
                     1e-8f, 0.37f, 1000u + (uint32_t)t, q8 ? 0.05f : 0.0f};
        if (k->step(&a)) exit(2);
    }
}

static int diff(const char *what, int cfg, const void *x, const void *y, size_t bytes) {
    size_t bad = 0;
    for (size_t i = 0; i < bytes; i++) bad += ((const uint8_t *)x)[i] != ((const uint8_t *)y)[i];
    if (bad) printf("config %d: %s differs in %zu bytes\n", cfg, what, bad);
    return bad != 0;
}

int main(int argc, char **argv) {
    if (argc != 4) return fprintf(stderr, "usage: %s SCALAR.so OTHER.so INPUTS.bin\n", argv[0]), 2;
    FILE *f = fopen(argv[3], "rb");
    static float tab[4][256];
    int64_t n = 0;
    if (!f || fread(tab, sizeof(tab), 1, f) != 1 || fread(&n, 8, 1, f) != 1 || n <= 0) return 2;
    float *x = malloc((size_t)n * 4);
    uint8_t *c0 = malloc((size_t)n), *c1 = malloc((size_t)n);
    if (fread(x, 4, (size_t)n, f) != (size_t)n) return 2;
    kernel ref, other;
    if (load(argv[1], tab, &ref) || load(argv[2], tab, &other)) return 2;
    int bad = !other.fast();
    if (bad) printf("the second build's fast encoder refused the maps\n");
    for (int w = 0; w < 2; w++) {
        ref.encode(w, x, c0, n);
        other.encode(w, x, c1, n);
        bad |= diff(w ? "unsigned codes" : "signed codes", -1, c0, c1, (size_t)n);
    }
    static run_state r0, r1;
    for (int cfg = 0; cfg < 16; cfg++) {
        run(&ref, cfg, &r0);
        run(&other, cfg, &r1);
        bad |= diff("state", cfg, &r0, &r1, sizeof(r0));
    }
    printf(bad ? "MISMATCH\n" : "bitwise equal: %lld codes of each map, 16 configurations\n", (long long)n);
    return bad;
}
