#define _GNU_SOURCE
#include "cblockcache.h"
#include <fcntl.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <string.h>

static uint32_t table[8][256];
static int have_sse42 = 0;
static pthread_once_t once = PTHREAD_ONCE_INIT;

static void init_table(void);
static void detect(void) {
#if defined(__x86_64__)
    __builtin_cpu_init();
    have_sse42 = __builtin_cpu_supports("sse4.2") ? 1 : 0;
#endif
    if (!have_sse42) init_table();
}

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

#if defined(__x86_64__)
__attribute__((target("sse4.2")))
static uint32_t crc32c_hw(uint32_t crc, const uint8_t *p, size_t len) {
    uint64_t c = crc;
    while (len >= 8) {
        uint64_t v;
        memcpy(&v, p, 8);
        c = __builtin_ia32_crc32di(c, v);
        p += 8;
        len -= 8;
    }
    uint32_t c32 = (uint32_t)c;
    while (len--) c32 = __builtin_ia32_crc32qi(c32, *p++);
    return c32;
}
#endif

uint32_t cchecksum_crc32c(uint32_t crc, const void *buf, size_t len) {
    pthread_once(&once, detect);
    crc = ~crc;
#if defined(__x86_64__)
    if (have_sse42) return ~crc32c_hw(crc, (const uint8_t *)buf, len);
#endif
    return ~crc32c_soft(crc, (const uint8_t *)buf, len);
}

void cchecksum_sha256(const void *buf, size_t len, uint8_t out[32]) {
    SHA256((const unsigned char *)buf, len, out);
}

int cblockcache_punch_hole(int fd, off_t offset, off_t len) {
    return fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, len);
}
