#define _GNU_SOURCE
#include "cblockcache.h"
#include <stdatomic.h>
#include <fcntl.h>
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

int cblockcache_punch_hole(int fd, off_t offset, off_t len) {
    return fallocate(fd, FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE, offset, len);
}


int cblockcache_allocate(int fd, off_t offset, off_t len) {
    return fallocate(fd, FALLOC_FL_KEEP_SIZE, offset, len);
}

int cblockcache_reopen_direct(int fd) {
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    int d = open(path, O_RDWR | O_DIRECT | O_CLOEXEC);
    if (d < 0) return -1;
    struct stat a, b;
    if (fstat(fd, &a) != 0 || fstat(d, &b) != 0 || a.st_dev != b.st_dev || a.st_ino != b.st_ino) {
        close(d);
        errno = ESTALE;
        return -1;
    }
    return d;
}

#ifndef __NR_cachestat
#define __NR_cachestat 451  /* Linux 6.5; Debian 12's headers predate it */
#endif

/* Set once cachestat is found missing (before Linux 6.5) or refused (a seccomp filter): the
 * calls that follow fail at once instead of asking the kernel again on every read. */
static atomic_int cachestat_unavailable;

int cblockcache_all_cached(int fd, off_t offset, size_t len) {
    if (atomic_load_explicit(&cachestat_unavailable, memory_order_relaxed)) {
        errno = ENOSYS;
        return -1;
    }
    struct { uint64_t off, len; } range = { (uint64_t)offset, len };
    struct { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; } stat;
    if (syscall(__NR_cachestat, fd, &range, &stat, 0) != 0) {
        if (errno == ENOSYS || errno == EPERM)
            atomic_store_explicit(&cachestat_unavailable, 1, memory_order_relaxed);
        return -1;
    }
    /* nr_cache counts pages of the machine's size (4 KiB on x86-64, up to 64 KiB on arm64). */
    uint64_t page = (uint64_t)sysconf(_SC_PAGESIZE);
    uint64_t first = (uint64_t)offset / page, last = ((uint64_t)offset + len - 1) / page;
    return stat.nr_cache >= last - first + 1;
}

int cblockcache_lock_range(int fd, off_t start, off_t len, int exclusive, int wait) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = exclusive ? F_WRLCK : F_RDLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = start;
    fl.l_len = len;
    int r;
    do {
        r = fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl);
    } while (r != 0 && errno == EINTR);
    return r;
}

int cblockcache_unlock_range(int fd, off_t start, off_t len) {
    struct flock fl;
    memset(&fl, 0, sizeof fl);
    fl.l_type = F_UNLCK;
    fl.l_whence = SEEK_SET;
    fl.l_start = start;
    fl.l_len = len;
    return fcntl(fd, F_OFD_SETLK, &fl);
}

int cblockcache_rename_noreplace(int olddirfd, const char *oldpath, int newdirfd, const char *newpath) {
    return renameat2(olddirfd, oldpath, newdirfd, newpath, RENAME_NOREPLACE);
}

int64_t cblockcache_atomic_load(const int64_t *p) {
    return __atomic_load_n(p, __ATOMIC_SEQ_CST);
}

void cblockcache_atomic_store(int64_t *p, int64_t v) {
    __atomic_store_n(p, v, __ATOMIC_SEQ_CST);
}

int64_t cblockcache_atomic_add(int64_t *p, int64_t v) {
    return __atomic_add_fetch(p, v, __ATOMIC_SEQ_CST);
}

int64_t cblockcache_atomic_exchange(int64_t *p, int64_t v) {
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}

int cblockcache_atomic_cas(int64_t *p, int64_t expected, int64_t desired) {
    return __atomic_compare_exchange_n(p, &expected, desired, 0, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
}
