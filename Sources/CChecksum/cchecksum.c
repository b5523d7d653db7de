#include "cchecksum.h"
#include <openssl/sha.h>
#include <pthread.h>
#include <string.h>

static uint32_t table[8][256];
static int have_sse42 = 0;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init_table(void);

static void init_table(void) {
    for (uint32_t i = 0; i < 256; i++) {
        uint32_t c = i;
        for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
        table[0][i] = c;
    }
    for (int t = 1; t < 8; t++)
        for (uint32_t i = 0; i < 256; i++)
            table[t][i] = (table[t - 1][i] >> 8) ^ table[0][table[t - 1][i] & 0xFF];
}

/* Slicing-by-8 fallback for CPUs without SSE4.2. */
static uint32_t crc32c_soft(uint32_t crc, const uint8_t *p, size_t len) {
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        v ^= crc;
        crc = table[7][v & 0xFF] ^ table[6][(v >> 8) & 0xFF] ^ table[5][(v >> 16) & 0xFF] ^
              table[4][(v >> 24) & 0xFF] ^ table[3][(v >> 32) & 0xFF] ^ table[2][(v >> 40) & 0xFF] ^
              table[1][(v >> 48) & 0xFF] ^ table[0][v >> 56];
        p += 8;
        len -= 8;
    }
    while (len--) crc = (crc >> 8) ^ table[0][(crc ^ *p++) & 0xFF];
    return crc;
}

/* The crc32 instruction has a latency of 3 cycles but a throughput of 1: three independent
 * streams keep it busy, and their CRCs are combined by "shifting" the earlier ones over the
 * bytes that follow, with tables of the GF(2) operator that appends N zero bytes (the zlib
 * crc32_combine idea, as in Mark Adler's crc32c). */
#define LONG_RUN 8192
#define SHORT_RUN 256
static uint32_t zeros_long[4][256];
static uint32_t zeros_short[4][256];

static uint32_t gf2_times(const uint32_t *mat, uint32_t vec) {
    uint32_t sum = 0;
    while (vec) {
        if (vec & 1) sum ^= *mat;
        vec >>= 1;
        mat++;
    }
    return sum;
}

static void gf2_square(uint32_t *square, const uint32_t *mat) {
    for (int n = 0; n < 32; n++) square[n] = gf2_times(mat, mat[n]);
}

/* Builds in `even` the GF(2) matrix that appends `len` zero bytes to a (pre-inverted) CRC:
 * start from the one-zero-bit operator and square it up through the bits of len. */
static void zeros_operator(uint32_t *even, size_t len) {
    uint32_t odd[32];
    odd[0] = 0x82F63B78u; /* one zero bit */
    uint32_t row = 1;
    for (int n = 1; n < 32; n++) {
        odd[n] = row;
        row <<= 1;
    }
    gf2_square(even, odd); /* two zero bits */
    gf2_square(odd, even); /* four zero bits */
    do {
        gf2_square(even, odd);
        len >>= 1;
        if (len == 0) return;
        gf2_square(odd, even);
        len >>= 1;
    } while (len);
    for (int n = 0; n < 32; n++) even[n] = odd[n];
}

static void zeros_table(uint32_t zeros[][256], size_t len) {
    uint32_t op[32];
    zeros_operator(op, len);
    for (uint32_t n = 0; n < 256; n++) {
        zeros[0][n] = gf2_times(op, n);
        zeros[1][n] = gf2_times(op, n << 8);
        zeros[2][n] = gf2_times(op, n << 16);
        zeros[3][n] = gf2_times(op, n << 24);
    }
}

static uint32_t shift(uint32_t zeros[][256], uint32_t crc) {
    return zeros[0][crc & 0xff] ^ zeros[1][(crc >> 8) & 0xff] ^ zeros[2][(crc >> 16) & 0xff] ^ zeros[3][crc >> 24];
}

#if defined(__x86_64__)
/* CRCs three consecutive runs of `run` bytes at once and folds them into c0. */
__attribute__((target("sse4.2"), always_inline))
static inline uint64_t crc32c_three(uint64_t c0, const uint8_t *p, size_t run, uint32_t zeros[][256]) {
    uint64_t c1 = 0, c2 = 0;
    const uint8_t *end = p + run;
    do {
        uint64_t a, b, d;
        memcpy(&a, p, 8);
        memcpy(&b, p + run, 8);
        memcpy(&d, p + 2 * run, 8);
        c0 = __builtin_ia32_crc32di(c0, a);
        c1 = __builtin_ia32_crc32di(c1, b);
        c2 = __builtin_ia32_crc32di(c2, d);
        p += 8;
    } while (p < end);
    c0 = shift(zeros, (uint32_t)c0) ^ (uint32_t)c1;
    return shift(zeros, (uint32_t)c0) ^ (uint32_t)c2;
}

__attribute__((target("sse4.2")))
static uint32_t crc32c_hw(uint32_t crc, const uint8_t *p, size_t len) {
    uint64_t c0 = crc;
    for (; len >= 3 * LONG_RUN; p += 3 * LONG_RUN, len -= 3 * LONG_RUN) c0 = crc32c_three(c0, p, LONG_RUN, zeros_long);
    for (; len >= 3 * SHORT_RUN; p += 3 * SHORT_RUN, len -= 3 * SHORT_RUN) c0 = crc32c_three(c0, p, SHORT_RUN, zeros_short);
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c0 = __builtin_ia32_crc32di(c0, v);
        p += 8;
        len -= 8;
    }
    uint32_t c32 = (uint32_t)c0;
    while (len--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
#endif

static void detect(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
    if (!have_sse42) init_table();
    zeros_table(zeros_long, LONG_RUN);
    zeros_table(zeros_short, SHORT_RUN);
}

uint32_t cchecksum_crc32c(uint32_t crc, const void *buf, size_t len) {
    pthread_once(&once, detect);
    crc = ~crc;
#if defined(__x86_64__)
    if (have_sse42) return ~crc32c_hw(crc, (const uint8_t *)buf, len);
#endif
    return ~crc32c_soft(crc, (const uint8_t *)buf, len);
}

uint32_t cchecksum_crc32c_portable(uint32_t crc, const void *buf, size_t len) {
    pthread_once(&once, detect);
    static pthread_once_t table_once = PTHREAD_ONCE_INIT;
    pthread_once(&table_once, init_table);
    return ~crc32c_soft(~crc, (const uint8_t *)buf, len);
}

/* Combining CRCs without the bytes: appending n zero bytes to a CRC multiplies it by
 * x^(8n) modulo the polynomial, in the bit-reflected representation the CRC lives in (bit 31
 * is x^0). So the operator of a length is one 32-bit value, built from the table of
 * x^(2^k) by the bits of 8n, and applying it is one multiplication: about 32 steps each.
 * (The operator built as a 32x32 matrix, as zlib's crc32_combine once did, cost ~1 ms a call:
 * most of the daemon's CPU with 16 readers of small files.) */
static uint32_t x2k[64]; /* x^(2^k) mod P */
static pthread_once_t x2k_once = PTHREAD_ONCE_INIT;

/* a * b modulo P, both reflected. */
static uint32_t mul_mod_p(uint32_t a, uint32_t b) {
    uint32_t product = 0;
    for (uint32_t m = 1u << 31; m != 0 && a != 0; m >>= 1) {
        if (a & m) {
            product ^= b;
            a ^= m;
        }
        b = (b & 1) ? (b >> 1) ^ 0x82F63B78u : b >> 1; /* b * x */
    }
    return product;
}

static void init_x2k(void) {
    x2k[0] = 1u << 30; /* x^1 */
    for (int k = 1; k < 64; k++) x2k[k] = mul_mod_p(x2k[k - 1], x2k[k - 1]);
}

/* x^(8 * len) mod P: the operator that appends len zero bytes. */
static uint32_t zeros_op(size_t len) {
    pthread_once(&x2k_once, init_x2k);
    uint32_t op = 1u << 31; /* x^0 */
    for (int k = 3; len != 0; len >>= 1, k++)
        if (len & 1) op = mul_mod_p(x2k[k & 63], op);
    return op;
}

uint32_t cchecksum_crc32c_combine(const uint32_t *crcs, size_t count, size_t block_len, size_t last_len) {
    if (count == 0) return 0;
    uint32_t op = zeros_op(block_len), last_op = zeros_op(last_len);
    uint32_t crc = crcs[0];
    for (size_t i = 1; i < count; i++) crc = mul_mod_p(i == count - 1 ? last_op : op, crc) ^ crcs[i];
    return crc;
}

void cchecksum_sha256(const void *buf, size_t len, uint8_t out[32]) {
    SHA256((const unsigned char *)buf, len, out);
}
