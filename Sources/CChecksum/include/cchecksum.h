#ifndef STOREFS_CCHECKSUM_H
#define STOREFS_CCHECKSUM_H
/* Checksums Swift cannot compute fast by itself: CRC32C with the SSE4.2 crc32 instruction (the
 * block cache's blocks, a download's whole-body check) and SHA-256 from OpenSSL's libcrypto
 * (cache keys). */
#include <stddef.h>
#include <stdint.h>

/* CRC32C (Castagnoli) of buf, continuing from crc (pass 0 to start). */
uint32_t cchecksum_crc32c(uint32_t crc, const void *buf, size_t len);
/* The same CRC without the SSE4.2 instruction (tests compare the two). */
uint32_t cchecksum_crc32c_portable(uint32_t crc, const void *buf, size_t len);
/* CRC32C of the concatenation of `count` pieces from their own CRC32Cs (no re-read): every
 * piece `block_len` bytes long but the last, `last_len` (both > 0). */
uint32_t cchecksum_crc32c_combine(const uint32_t *crcs, size_t count, size_t block_len, size_t last_len);
/* SHA-256 of buf into out[32]. */
void cchecksum_sha256(const void *buf, size_t len, uint8_t out[32]);
#endif
