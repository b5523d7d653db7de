import Foundation
import Glibc

/// A FUSE connection another process opened and mounted, handed to storefs as the mount point
/// `/dev/fd/N` (libfuse's `fuse_session_mount` form "to allow FUSE daemons to run without
/// privileges"; docs/kubernetes.md, "The sidecar pattern"). A privileged mounter opens
/// `/dev/fuse`, mounts it with `mount -o fd=N,...` and passes the descriptor on (inherited, or
/// over a Unix socket with SCM_RIGHTS); storefs serves it without mounting, unmounting or
/// touching the mount point, which may not even exist in its mount namespace. The mounter
/// chooses the mount options (`ro`, `nosuid`, `nodev`, `default_permissions`, `allow_other`);
/// the connection ends when the mounter unmounts, and storefs then exits 0.
public enum HandedInConnection {
    /// `/dev/fuse` is the misc device 10:229 (Linux `include/linux/miscdevice.h`, FUSE_MINOR):
    /// compared by number, since an unprivileged container has no `/dev/fuse` node to stat.
    static let fuseDevice = (major: UInt32(10), minor: UInt32(229))

    /// N when `mountpoint` is `/dev/fd/N` (N decimal digits, as libfuse reads it), else nil.
    public static func descriptor(in mountpoint: String) -> Int32? {
        let prefix = "/dev/fd/"
        guard mountpoint.hasPrefix(prefix) else { return nil }
        let digits = mountpoint.utf8.dropFirst(prefix.utf8.count)
        guard !digits.isEmpty, digits.count <= 9, digits.allSatisfy({ $0 >= 0x30 && $0 <= 0x39 }) else { return nil }
        return Int32(String(decoding: digits, as: UTF8.self))
    }

    /// Nil when descriptor `fd` is a mounted FUSE connection open for reading and writing;
    /// otherwise what is wrong with it and how to fix it, as one line.
    public static func problem(with fd: Int32) -> String? {
        let path = "/dev/fd/\(fd)"
        let mountHint = "open /dev/fuse read-write, mount it (mount -t fuse.storefs -o fd=\(fd),rootmode=40000,user_id=UID,group_id=GID storefs DIR), and start storefs with that descriptor open as \(fd)"
        guard fd > 2 else {
            return "\(path): descriptors 0-2 are standard input, output and error, not a FUSE connection: \(mountHint)"
        }
        let flags = fcntl(fd, F_GETFL)
        guard flags >= 0 else {
            return "\(path) is not an open descriptor of this process: \(mountHint)"
        }
        var st = stat()
        guard fstat(fd, &st) == 0 else {
            return "\(path): \(String(cString: strerror(errno))): \(mountHint)"
        }
        let isFuse = st.st_mode & S_IFMT == S_IFCHR && deviceNumbers(st.st_rdev) == fuseDevice
        guard isFuse else {
            return "\(path) is not /dev/fuse (it is \(describe(fd: fd, st))): \(mountHint)"
        }
        guard flags & O_ACCMODE == O_RDWR else {
            return "\(path) is /dev/fuse opened read-only or write-only; a FUSE connection needs both: \(mountHint)"
        }
        // The kernel answers POLLERR on a /dev/fuse descriptor that no mount uses yet, or
        // whose mount is gone (fs/fuse/dev.c, fuse_dev_poll); a mounted one is readable or idle.
        var pfd = pollfd(fd: fd, events: Int16(POLLIN), revents: 0)
        if poll(&pfd, 1, 0) >= 0, pfd.revents & Int16(POLLERR) != 0 {
            return "\(path) is /dev/fuse but no mount uses it (not mounted yet, or already unmounted): \(mountHint)"
        }
        return nil
    }

    /// The connection's device ("0:41"), the name of its bdi under /sys/class/bdi, from the
    /// `fuse_connection:` line the kernel (6.18 here) puts in /proc/self/fdinfo/N of a mounted
    /// /dev/fuse descriptor. Nil where the kernel does not say (older kernels): then only the
    /// mounter, which knows the mount point, can raise the read-ahead.
    static func device(of fd: Int32) -> String? {
        guard let info = try? String(contentsOfFile: "/proc/self/fdinfo/\(fd)", encoding: .utf8) else { return nil }
        for line in info.split(separator: "\n") where line.hasPrefix("fuse_connection:") {
            // The kernel's own dev_t: major above the low 20 bits (MINORBITS).
            guard let dev = UInt32(line.dropFirst("fuse_connection:".count).trimmingCharacters(in: .whitespaces)) else { return nil }
            return "\(dev >> 20):\(dev & 0xFFFFF)"
        }
        return nil
    }

    /// glibc's dev_t encoding (<sys/sysmacros.h> `major`/`minor`, macros Swift cannot call).
    static func deviceNumbers(_ dev: dev_t) -> (major: UInt32, minor: UInt32) {
        let d = UInt64(dev)
        return (UInt32(truncatingIfNeeded: ((d >> 8) & 0xFFF) | ((d >> 32) & ~0xFFF)),
                UInt32(truncatingIfNeeded: (d & 0xFF) | ((d >> 12) & ~0xFF)))
    }

    private static func describe(fd: Int32, _ st: stat) -> String {
        var buffer = [CChar](repeating: 0, count: 4096)
        let n = readlink("/proc/self/fd/\(fd)", &buffer, buffer.count - 1)
        if n > 0 { return String(decoding: buffer[..<n].map { UInt8(bitPattern: $0) }, as: UTF8.self) }
        switch st.st_mode & S_IFMT {
        case S_IFREG: return "a regular file"
        case S_IFDIR: return "a directory"
        case S_IFSOCK: return "a socket"
        case S_IFIFO: return "a pipe"
        default: return "another kind of file"
        }
    }
}
