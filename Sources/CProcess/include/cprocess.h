#ifndef STOREFS_CPROCESS_H
#define STOREFS_CPROCESS_H
/* Process-wide settings Swift cannot reach: prctl is variadic, and malloc.h (malloc_trim)
 * and sys/xattr.h are not part of Glibc's Swift module. */

/* No core dumps, no ptrace or /proc/PID/mem by other processes of the same user: the
 * process holds tokens and keys. 0 or -1/errno. */
int cprocess_make_undumpable(void);
/* Returns free malloc pages to the system (malloc_trim). */
int cprocess_malloc_trim(void);
/* Caps glibc's malloc arenas (mallopt M_ARENA_MAX); 1 on success. */
int cprocess_limit_arenas(int arenas);
/* getxattr(2) (sys/xattr.h is not part of Glibc's Swift module): the value's length, or -1/errno. */
long cprocess_getxattr(const char *path, const char *name, void *value, unsigned long size);
/* fgetxattr(2), for the same reason: the value's length, or -1/errno. */
long cprocess_fgetxattr(int fd, const char *name, void *value, unsigned long size);
/* lgetxattr(2), for the same reason (does not follow a link in the last component). */
long cprocess_lgetxattr(const char *path, const char *name, void *value, unsigned long size);
/* O_DIRECT (a _GNU_SOURCE name Glibc's Swift module leaves out). */
int cprocess_o_direct(void);
/* O_PATH (the same): a descriptor that names a directory without opening it for reading. */
int cprocess_o_path(void);
#endif
