#ifndef STOREFS_CCRYPTO_H
#define STOREFS_CCRYPTO_H
/* RSA-SHA256 (PKCS#1 v1.5) signing with a PEM private key, and SHA-256, from OpenSSL's
 * libcrypto: the JWT grant (RS256) and V4 signed URLs need them. OpenSSL's EVP API takes
 * opaque handles and some of it is macros, so Swift sees only these two calls. */
#include <stddef.h>
#include <stdint.h>

/* Signs data with the PEM key. Writes at most *sig_len bytes to sig and sets *sig_len.
 * Returns 0 on success, -1 if the key cannot be parsed, -2 if signing fails, -3 if sig is too small. */
int ccrypto_rs256_sign(const char *pem, size_t pem_len, const void *data, size_t data_len,
                       uint8_t *sig, size_t *sig_len);
void ccrypto_sha256(const void *data, size_t len, uint8_t out[32]);
#endif
