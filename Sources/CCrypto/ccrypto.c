#include "ccrypto.h"
#include <openssl/bio.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/sha.h>

int ccrypto_rs256_sign(const char *pem, size_t pem_len, const void *data, size_t data_len,
                       uint8_t *sig, size_t *sig_len) {
    BIO *bio = BIO_new_mem_buf(pem, (int)pem_len);
    if (!bio) return -1;
    EVP_PKEY *key = PEM_read_bio_PrivateKey(bio, NULL, NULL, NULL);
    BIO_free(bio);
    if (!key) return -1;
    int rc = -2;
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    size_t needed = 0;
    if (ctx && EVP_DigestSignInit(ctx, NULL, EVP_sha256(), NULL, key) == 1 &&
        EVP_DigestSignUpdate(ctx, data, data_len) == 1 && EVP_DigestSignFinal(ctx, NULL, &needed) == 1) {
        if (needed > *sig_len) {
            rc = -3;
        } else if (EVP_DigestSignFinal(ctx, sig, sig_len) == 1) {
            rc = 0;
        }
    }
    EVP_MD_CTX_free(ctx);
    EVP_PKEY_free(key);
    return rc;
}

void ccrypto_sha256(const void *data, size_t len, uint8_t out[32]) {
    SHA256((const unsigned char *)data, len, out);
}
