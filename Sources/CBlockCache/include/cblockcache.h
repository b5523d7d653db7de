#ifndef STOREFS_CBLOCKCACHE_H
#define STOREFS_CBLOCKCACHE_H
/* The block cache's file operations Swift cannot reach directly: fallocate and O_DIRECT
 * (_GNU_SOURCE names Glibc's Swift module does not export). Its checksums are CChecksum's. */
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

/* Frees the disk space of [offset, offset+len) keeping the file size (FALLOC_FL_PUNCH_HOLE). 0 or -1/errno. */
int cblockcache_punch_hole(int fd, off_t offset, off_t len);
/* Allocates the disk space of [offset, offset+len) (unwritten extents, size kept). 0 or -1/errno. */
int cblockcache_allocate(int fd, off_t offset, off_t len);
/* A second descriptor, write-only and O_DIRECT, of the very file `fd` is open on: opened through
 * /proc/self/fd (never a name another process could have swapped) and checked to be the same
 * inode. -1/errno where the filesystem, or /proc, does not allow it. */
int cblockcache_reopen_direct(int fd);
#endif
