#ifndef STOREFS_CBLOCKCACHE_H
#define STOREFS_CBLOCKCACHE_H
/* The block cache's C needs, each something Swift cannot reach directly: fallocate, O_DIRECT,
 * cachestat, open file description locks and renameat2 (_GNU_SOURCE names Glibc's
 * Swift module does not export, or variadic fcntl), and atomics on memory that other
 * processes map too (the shared cache state: Swift's Atomic lives only in its own storage). Its checksums are CChecksum's. */
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Frees the disk space of [offset, offset+len) keeping the file size (FALLOC_FL_PUNCH_HOLE). 0 or -1/errno. */
int cblockcache_punch_hole(int fd, off_t offset, off_t len);
/* Allocates the disk space of [offset, offset+len) (unwritten extents, size kept). 0 or -1/errno. */
int cblockcache_allocate(int fd, off_t offset, off_t len);
/* A second descriptor, O_DIRECT (read and write), of the very file `fd` is open on: opened
 * through /proc/self/fd (never a name another process could have swapped) and checked to be
 * the same inode. -1/errno where the filesystem, or /proc, does not allow it. */
int cblockcache_reopen_direct(int fd);
/* Whether the page cache holds every page of [offset, offset+len) of fd (cachestat(2), which
 * reads nothing and starts no read-ahead): 1 or 0, -1/errno (ENOSYS before Linux 6.5 or where
 * a seccomp filter refuses it; asked once, then answered without a system call). */
int cblockcache_all_cached(int fd, off_t offset, size_t len);
/* An open file description lock (F_OFD_SETLK[W]) on [start, start+len) of fd: shared or
 * exclusive, waiting for it or not. Released by cblockcache_unlock_range, or when the last
 * descriptor of that open file description closes (a killed process's go with it). 0 or
 * -1/errno (EAGAIN: held by another, without waiting). */
int cblockcache_lock_range(int fd, off_t start, off_t len, int exclusive, int wait);
int cblockcache_unlock_range(int fd, off_t start, off_t len);
/* renameat2(..., RENAME_NOREPLACE): 0, or -1/errno (EEXIST: the new name is taken). */
int cblockcache_rename_noreplace(int olddirfd, const char *oldpath, int newdirfd, const char *newpath);
/* Sequentially consistent atomics on an aligned 8-byte word of shared memory. */
int64_t cblockcache_atomic_load(const int64_t *p);
void cblockcache_atomic_store(int64_t *p, int64_t v);
/* Adds v; returns the new value. */
int64_t cblockcache_atomic_add(int64_t *p, int64_t v);
/* Stores v; returns the value before. */
int64_t cblockcache_atomic_exchange(int64_t *p, int64_t v);
/* Stores desired if *p is expected: 1, else 0 (and *p unchanged). */
int cblockcache_atomic_cas(int64_t *p, int64_t expected, int64_t desired);
#endif
