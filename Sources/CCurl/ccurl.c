/* The parts of the curl shim that need OpenSSL or pthread types (see ccurl.h). */
#include "ccurl.h"

#include <openssl/err.h>
#include <openssl/ssl.h>
#include <openssl/x509.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

static void openssl_reason(char *err, size_t errlen, const char *what) {
    unsigned long e = ERR_peek_last_error();
    char detail[256] = "no detail";
    if (e != 0) ERR_error_string_n(e, detail, sizeof detail);
    ERR_clear_error();
    snprintf(err, errlen, "%s (%s)", what, detail);
}

void *ccurl_trust_load_file(const char *path, int *count, char *err, size_t errlen) {
    X509_STORE *store = X509_STORE_new();
    if (store == NULL) { snprintf(err, errlen, "out of memory"); return NULL; }
    BIO *bio = BIO_new_file(path, "r");
    if (bio == NULL) {
        openssl_reason(err, errlen, "cannot open it");
        X509_STORE_free(store);
        return NULL;
    }
    int n = 0;
    X509 *cert;
    while ((cert = PEM_read_bio_X509(bio, NULL, NULL, NULL)) != NULL) {
        if (X509_STORE_add_cert(store, cert) == 1) n++;
        X509_free(cert);
    }
    /* The loop ends at the end of the file (PEM_R_NO_START_LINE) or at a block it cannot
     * parse; the second is a broken bundle, said as such rather than half-loaded. */
    unsigned long e = ERR_peek_last_error();
    int clean_end = e == 0 || (ERR_GET_LIB(e) == ERR_LIB_PEM && ERR_GET_REASON(e) == PEM_R_NO_START_LINE);
    BIO_free(bio);
    if (!clean_end) {
        openssl_reason(err, errlen, "a certificate in it cannot be parsed");
        X509_STORE_free(store);
        return NULL;
    }
    ERR_clear_error();
    if (n == 0) {
        snprintf(err, errlen, "it holds no PEM certificate (-----BEGIN CERTIFICATE-----)");
        X509_STORE_free(store);
        return NULL;
    }
    *count = n;
    return store;
}

void *ccurl_trust_load_directory(const char *path, char *err, size_t errlen) {
    X509_STORE *store = X509_STORE_new();
    if (store == NULL) { snprintf(err, errlen, "out of memory"); return NULL; }
    if (X509_STORE_load_path(store, path) != 1) {
        openssl_reason(err, errlen, "cannot use it as a certificate directory");
        X509_STORE_free(store);
        return NULL;
    }
    return store;
}

void ccurl_trust_free(void *store) { X509_STORE_free((X509_STORE *)store); }

static CURLcode use_store(CURL *curl, void *ssl_ctx, void *store) {
    (void)curl;
    /* set1: the context takes its own reference; the store outlives every connection. */
    SSL_CTX_set1_cert_store((SSL_CTX *)ssl_ctx, (X509_STORE *)store);
    return CURLE_OK;
}

CURLcode ccurl_setopt_trust(CURL *h, void *store) {
    CURLcode rc;
    if ((rc = curl_easy_setopt(h, CURLOPT_CAINFO, (char *)NULL)) != CURLE_OK) return rc;
    if ((rc = curl_easy_setopt(h, CURLOPT_CAPATH, (char *)NULL)) != CURLE_OK) return rc;
    if ((rc = curl_easy_setopt(h, CURLOPT_SSL_VERIFYPEER, 1L)) != CURLE_OK) return rc;
    if ((rc = curl_easy_setopt(h, CURLOPT_SSL_VERIFYHOST, 2L)) != CURLE_OK) return rc;
    if ((rc = curl_easy_setopt(h, CURLOPT_SSL_CTX_FUNCTION, use_store)) != CURLE_OK) return rc;
    return curl_easy_setopt(h, CURLOPT_SSL_CTX_DATA, store);
}

/* One mutex per kind of shared data, as libcurl asks (CURLSHOPT_LOCKFUNC). */
static pthread_mutex_t share_locks[CURL_LOCK_DATA_LAST];

static void share_lock(CURL *h, curl_lock_data data, curl_lock_access access, void *user) {
    (void)h; (void)access; (void)user;
    pthread_mutex_lock(&share_locks[data]);
}

static void share_unlock(CURL *h, curl_lock_data data, void *user) {
    (void)h; (void)user;
    pthread_mutex_unlock(&share_locks[data]);
}

static pthread_once_t share_once = PTHREAD_ONCE_INIT;
static void share_init(void) {
    for (int i = 0; i < CURL_LOCK_DATA_LAST; i++) pthread_mutex_init(&share_locks[i], NULL);
}

CURLSH *ccurl_share_new(void) {
    pthread_once(&share_once, share_init);
    CURLSH *s = curl_share_init();
    if (s == NULL) return NULL;
    curl_share_setopt(s, CURLSHOPT_LOCKFUNC, share_lock);
    curl_share_setopt(s, CURLSHOPT_UNLOCKFUNC, share_unlock);
    curl_share_setopt(s, CURLSHOPT_SHARE, CURL_LOCK_DATA_SSL_SESSION);
    curl_share_setopt(s, CURLSHOPT_SHARE, CURL_LOCK_DATA_DNS);
    return s;
}
