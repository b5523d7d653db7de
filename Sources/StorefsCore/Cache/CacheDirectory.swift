import Glibc
internal import CBlockCache

/// Every file-system access of the block cache, made relative to directory descriptors that
/// were verified once: nothing under `cache_dir` is reached by a path another user could have
/// redirected. docs/security.md ("The cache directory") gives the rules; in short:
///
/// - `cache_dir` itself is opened with `O_NOFOLLOW`: it must be a real directory owned by the
///   mounting user and writable by nobody else. A missing one is created with mode 0700.
/// - Every existing ancestor must be owned by root or the mounting user and may be writable by
///   others only with the sticky bit (`/tmp`); a symbolic link on the way must be owned by
///   root or the mounting user (TrustedPath, which `log_file=` shares). Nothing that fails is
///   ever chmodded: it is refused, by name.
/// - Below it (`v1/`, shards, cache files, `.lock`) every open is an `openat` with
///   `O_NOFOLLOW | O_NONBLOCK` and an `fstat` check (a directory or a regular file of ours,
///   one link): a symlink, FIFO, device or foreign file found there is unlinked (the link
///   itself, never its target) and never opened for I/O.
final class CacheDirectory: Sendable {
    /// The directory as the user named it (for messages).
    let path: String
    /// `cache_dir/v<version>`: the only directory cache files live under.
    let versionPath: String
    private let versionFD: Int32
    /// `cache_dir` itself: the mount's lock is taken on it (`BlockCache`), so deleting
    /// `cache_dir/v1` under a live mount cannot free the cache for a second one.
    let topFD: Int32
    private let owner: uid_t

    struct Refused: Error {
        let message: String
    }

    /// Opens (creating where missing) `directory` and `directory/<versionName>`, checking both
    /// and every ancestor. Throws a one-line reason naming the offending path.
    init(directory: String, versionName: String) throws(Refused) {
        owner = geteuid()
        guard directory.hasPrefix("/") else {
            throw Refused(message: "cache_dir \(directory) is not an absolute path: give -o cache_dir=/absolute/path")
        }
        path = directory
        versionPath = directory + "/" + versionName
        let top = try Self.openVerifiedPath(directory, owner: owner)
        do throws(Refused) {
            versionFD = try Self.openOwnedSubdirectory(top, versionName, shown: versionPath, owner: owner, replaceLinks: true)
        } catch {
            close(top)
            throw error
        }
        topFD = top
    }

    deinit {
        close(versionFD)
        close(topFD)
    }

    /// Whether the version directory was deleted under us (`rm -rf cache_dir/v1`): nothing
    /// can be created in it any more.
    var isRemoved: Bool {
        var st = stat()
        return fstat(versionFD, &st) != 0 || st.st_nlink == 0
    }

    // MARK: Opening the top directory

    /// Walks `path` from `/` (TrustedPath: every ancestor checked, missing ones created 0700);
    /// returns a descriptor of the last one, which must be ours and private.
    private static func openVerifiedPath(_ path: String, owner: uid_t) throws(Refused) -> Int32 {
        do throws(TrustedPath.Refused) {
            return try TrustedPath.openDirectory(path, subject: "cache_dir \(path)", owner: owner, create: true, last: .own,
                                                 hint: " (choose another with -o cache_dir=DIR)")
        } catch {
            throw Refused(message: error.message)
        }
    }

    /// Opens directory `name` under `parent`, creating it (0700) if missing. It must be a
    /// directory of `owner` that nobody else may write. With `replaceLinks`, a symlink or
    /// non-directory in its place is unlinked and a fresh directory made.
    private static func openOwnedSubdirectory(_ parent: Int32, _ name: String, shown: String, owner: uid_t,
                                              replaceLinks: Bool) throws(Refused) -> Int32 {
        for _ in 0..<2 {
            if mkdirat(parent, name, 0o700) != 0 && errno != EEXIST {
                throw Refused(message: "cannot create \(shown): \(errnoText())")
            }
            let fd = openat(parent, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
            if fd < 0 {
                let e = errno
                guard replaceLinks, e == ELOOP || e == ENOTDIR else {
                    throw Refused(message: "cannot open \(shown): \(String(cString: strerror(e)))")
                }
                Log.warn("cache: \(shown) is not a directory (a link or a file): replacing it")
                unlinkat(parent, name, 0)
                continue
            }
            var st = stat()
            guard fstat(fd, &st) == 0 else {
                close(fd)
                throw Refused(message: "cannot examine \(shown): \(errnoText())")
            }
            guard st.st_uid == owner else {
                close(fd)
                throw Refused(message: "\(shown) is owned by uid \(st.st_uid), not by the mounting user (uid \(owner)): remove it or use another cache_dir")
            }
            guard st.st_mode & 0o022 == 0 else {
                close(fd)
                throw Refused(message: "\(shown) is writable by other users (mode \(octal(st.st_mode & 0o7777))): run chmod go-w \(shown)")
            }
            return fd
        }
        throw Refused(message: "cannot create \(shown): something keeps replacing it")
    }

    // MARK: Files under the version directory

    /// Opens (creating) the lock file; a link or non-regular file in its place is replaced.
    func openLockFile() throws(Refused) -> Int32 {
        for _ in 0..<2 {
            let fd = openat(versionFD, ".lock", O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0o600)
            if fd < 0 {
                guard errno == ELOOP else { throw Refused(message: "cannot open \(versionPath)/.lock: \(errnoText())") }
                unlinkat(versionFD, ".lock", 0)
                continue
            }
            if isOwnRegularFile(fd) { return fd }
            close(fd)
            unlinkat(versionFD, ".lock", 0)
        }
        throw Refused(message: "cannot create \(versionPath)/.lock: something keeps replacing it")
    }

    /// The shard directory of `hex` (created if asked): nil unless it is a private directory of
    /// ours. A link or file in its place is unlinked (and, when creating, replaced).
    private func shard(_ hex: String, create: Bool) -> Int32? {
        let name = String(hex.prefix(2))
        for _ in 0..<3 {
            // Opened first: a shard exists for all but a cache's first files, and a mkdirat
            // that finds it costs a path walk per file made.
            let fd = openat(versionFD, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
            guard fd >= 0 else {
                if errno == ENOENT, create {
                    if mkdirat(versionFD, name, 0o700) != 0, errno != EEXIST { return nil }
                    continue
                }
                guard errno == ELOOP || errno == ENOTDIR else { return nil }
                unlinkat(versionFD, name, 0)
                if create { continue }
                return nil
            }
            var st = stat()
            guard fstat(fd, &st) == 0, st.st_uid == owner, st.st_mode & 0o022 == 0 else {
                close(fd)
                return nil
            }
            return fd
        }
        return nil
    }

    static func fileName(_ hex: String) -> String { hex + ".blk" }

    /// Opens the cache file of `hex` for reading and writing, holding a shared `flock` on it for
    /// as long as the descriptor is open: other mounts of the cache remove or trim a file only
    /// while nobody has it open (`removeFileIfUnused`, `openFile(_:tryAlone:)`). nil unless it
    /// is a regular file of ours with one link (anything else in its place is removed), and
    /// when it was removed while its lock was awaited.
    func openFile(_ hex: String) -> Int32? { openFile(hex, tryAlone: false)?.fd }

    /// `openFile`, trying first for the file alone: `alone` true when no other descriptor had
    /// it open (nor has, until the caller calls `share`: it holds an exclusive lock meanwhile).
    func openFile(_ hex: String, tryAlone: Bool) -> (fd: Int32, alone: Bool)? {
        guard let dir = shard(hex, create: false) else { return nil }
        defer { close(dir) }
        let name = Self.fileName(hex)
        let fd = openat(dir, name, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
        guard fd >= 0 else {
            if errno == ELOOP { unlinkat(dir, name, 0) }
            return nil
        }
        guard isOwnRegularFile(fd) else {
            close(fd)
            unlinkat(dir, name, 0)
            return nil
        }
        let alone = tryAlone && flock(fd, LOCK_EX | LOCK_NB) == 0
        if !alone { Self.share(fd) }
        // A remover holds the exclusive lock while it unlinks: the name may be gone by now.
        guard isOwnRegularFile(fd) else {
            close(fd)
            return nil
        }
        return (fd, alone)
    }

    /// Holds a shared lock on an open cache file (after `openFile(_:tryAlone:)` found it alone,
    /// or after `tryAlone(_:)`). Waits for an exclusive holder (a remover or trimmer: brief).
    static func share(_ fd: Int32) {
        while flock(fd, LOCK_SH) != 0 && errno == EINTR {}
    }

    /// Tries to have an open cache file alone (converting its shared lock): true when no other
    /// descriptor has it open. A conversion that fails leaves no lock (flock(2)): the shared
    /// one is taken again before returning false.
    static func tryAlone(_ fd: Int32) -> Bool {
        if flock(fd, LOCK_EX | LOCK_NB) == 0 { return true }
        share(fd)
        return false
    }

    /// The inode number of the cache file of `hex` now, nil when there is none (a mount of a
    /// shared cache tells a file another mount removed, or replaced, from its own).
    func identity(_ hex: String) -> ino_t? {
        guard let dir = shard(hex, create: false) else { return nil }
        defer { close(dir) }
        var st = stat()
        guard fstatat(dir, Self.fileName(hex), &st, AT_SYMLINK_NOFOLLOW) == 0, st.st_mode & S_IFMT == S_IFREG else { return nil }
        return st.st_ino
    }

    enum Creation {
        /// The new file, open for reading and writing with a shared `flock` (held since before
        /// it had its name, as `openFile` holds one), and its inode number: its maker uses this
        /// descriptor instead of opening the file again (`CachedObject.adopt`).
        case created(fd: Int32, inode: ino_t)
        /// Another process made it first (shared caches): open that one.
        case exists
        /// `outOfDescriptors`: the process (EMFILE) or the system (ENFILE) had no descriptor to
        /// spare, which says nothing about the cache (BlockCache does not pause for it).
        case failed(String, outOfDescriptors: Bool)
    }

    /// Writes a new cache file (`header`, then sized to `size`) under a temporary name and
    /// renames it into place, never over a file another process made meanwhile (`.exists`)
    /// unless `replace` (a damaged one). `.created` hands over the open descriptor.
    func createFile(_ hex: String, header: [UInt8], size: Int64, replace: Bool = false) -> Creation {
        guard let dir = shard(hex, create: true) else {
            let full = errno == EMFILE || errno == ENFILE
            return .failed("cannot create the shard directory \(versionPath)/\(hex.prefix(2)): \(errnoText())", outOfDescriptors: full)
        }
        defer { close(dir) }
        let final = Self.fileName(hex)
        let temp = "\(final).tmp\(getpid())-\(UInt32.random(in: 0...UInt32.max))"
        let fd = openat(dir, temp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
        guard fd >= 0 else { return .failed("cannot create a cache file: \(errnoText())", outOfDescriptors: errno == EMFILE || errno == ENFILE) }
        var st = stat()
        // Shared before the name exists: from then on other mounts see the file in use.
        let ok = header.withUnsafeBytes { pwrite(fd, $0.baseAddress, $0.count, 0) } == header.count
            && ftruncate(fd, off_t(size)) == 0 && fstat(fd, &st) == 0 && flock(fd, LOCK_SH | LOCK_NB) == 0
        guard ok else {
            let why = errnoText()
            unlinkat(dir, temp, 0)
            close(fd)
            return .failed("cannot write a cache file: \(why)", outOfDescriptors: false)
        }
        let renamed = replace ? renameat(dir, temp, dir, final) : cblockcache_rename_noreplace(dir, temp, dir, final)
        guard renamed == 0 else {
            let exists = errno == EEXIST
            let why = errnoText()
            unlinkat(dir, temp, 0)
            close(fd)
            return exists ? .exists : .failed("cannot write a cache file: \(why)", outOfDescriptors: false)
        }
        return .created(fd: fd, inode: st.st_ino)
    }

    /// Removes the cache file of `hex` (the name only: a link is never followed).
    func removeFile(_ hex: String) {
        guard let dir = shard(hex, create: false) else { return }
        unlinkat(dir, Self.fileName(hex), 0)
        close(dir)
    }

    /// Removes the cache file of `hex` if no descriptor has it open (in any mount) and
    /// `isEmpty` says, with the file open and held exclusively, that it holds no block; true if
    /// it went. An opener waiting meanwhile sees it gone (`openFile`).
    func removeFileIfUnused(_ hex: String, isEmpty: (Int32) -> Bool) -> Bool {
        guard let dir = shard(hex, create: false) else { return false }
        defer { close(dir) }
        let name = Self.fileName(hex)
        let fd = openat(dir, name, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
        guard fd >= 0 else { return errno == ENOENT }
        defer { close(fd) }
        guard isOwnRegularFile(fd), flock(fd, LOCK_EX | LOCK_NB) == 0, isEmpty(fd) else { return false }
        return unlinkat(dir, name, 0) == 0
    }

    /// Every cache file now: `visit(hex, mtime in ns, inode)`. Nothing is removed or opened
    /// (the eviction of a shared cache looks for files other mounts made).
    func listFiles(_ visit: (String, Int64, ino_t) -> Void) {
        for (name, type) in entries(of: versionFD) where name.utf8.count == 2 && name.utf8.allSatisfy(Self.isHex) {
            guard type == DT_DIR || type == DT_UNKNOWN, let dir = shard(name + "00", create: false) else { continue }
            defer { close(dir) }
            for (file, _) in entries(of: dir) {
                let utf8 = Array(file.utf8)
                guard utf8.count == 68, file.hasSuffix(".blk"), utf8[0..<64].allSatisfy(Self.isHex), file.hasPrefix(name) else { continue }
                var st = stat()
                guard fstatat(dir, file, &st, AT_SYMLINK_NOFOLLOW) == 0, st.st_mode & S_IFMT == S_IFREG,
                      st.st_uid == owner, st.st_nlink == 1 else { continue }
                visit(String(file.prefix(64)), Int64(st.st_mtim.tv_sec) * 1_000_000_000 + Int64(st.st_mtim.tv_nsec), st.st_ino)
            }
        }
    }

    /// Start-up scan: calls `visit(hex, fd, mtime)` for every regular cache file of ours (the
    /// descriptor is closed after the call); `visit` returns false for a file to be deleted.
    /// Everything else under the version directory — temp files of a crashed write, other
    /// versions' names, links, FIFOs, foreign files — is unlinked, never followed or opened
    /// for I/O. Unknown sub-directories are left alone (and logged). With
    /// `keepRecentTemporaries` (other mounts share the cache), a temporary file younger than
    /// `temporaryAge` is left: another mount may be about to rename it into place.
    func scan(keepRecentTemporaries: Bool = false, _ visit: (String, Int32, Int64) -> Bool) {
        for (name, type) in entries(of: versionFD) where name != ".lock" {
            guard name.utf8.count == 2, name.utf8.allSatisfy(Self.isHex) else {
                if type == DT_DIR {
                    Log.warn("cache: leaving unknown directory \(versionPath)/\(name) alone")
                } else {
                    unlinkat(versionFD, name, 0)
                }
                continue
            }
            guard type == DT_DIR || type == DT_UNKNOWN, let dir = shard(name + "00", create: false) else {
                unlinkat(versionFD, name, 0)  // a link or a file where a shard should be
                continue
            }
            defer { close(dir) }
            for (file, _) in entries(of: dir) {
                let utf8 = Array(file.utf8)
                let hex = String(file.prefix(64))
                guard utf8.count == 68, file.hasSuffix(".blk"), utf8[0..<64].allSatisfy(Self.isHex),
                      hex.hasPrefix(name) else {
                    if keepRecentTemporaries, file.contains(".blk.tmp"), isRecent(dir, file) { continue }
                    unlinkat(dir, file, 0)
                    continue
                }
                let fd = openat(dir, file, O_RDWR | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
                guard fd >= 0 else {
                    unlinkat(dir, file, 0)
                    continue
                }
                var st = stat()
                let keep = isOwnRegularFile(fd) && fstat(fd, &st) == 0
                    && visit(hex, fd, Int64(st.st_mtim.tv_sec) * 1_000_000_000 + Int64(st.st_mtim.tv_nsec))
                close(fd)
                if !keep { unlinkat(dir, file, 0) }
            }
        }
    }

    /// How long a temporary file of a creation under way may live (a creation takes
    /// milliseconds; one older is a killed process's).
    static let temporaryAge: Int = 600

    private func isRecent(_ dir: Int32, _ name: String) -> Bool {
        var st = stat()
        guard fstatat(dir, name, &st, AT_SYMLINK_NOFOLLOW) == 0 else { return false }
        return Int(time(nil)) - Int(st.st_mtim.tv_sec) < Self.temporaryAge
    }

    private static func isHex(_ b: UInt8) -> Bool {
        (b >= UInt8(ascii: "0") && b <= UInt8(ascii: "9")) || (b >= UInt8(ascii: "a") && b <= UInt8(ascii: "f"))
    }

    /// Names and types of a directory's entries (without `.` and `..`).
    private func entries(of dirFD: Int32) -> [(String, Int32)] {
        let copy = dup(dirFD)
        guard copy >= 0, let dir = fdopendir(copy) else {
            if copy >= 0 { close(copy) }
            return []
        }
        defer { closedir(dir) }
        rewinddir(dir)
        var out: [(String, Int32)] = []
        while let e = readdir(dir) {
            let name = withUnsafeBytes(of: e.pointee.d_name) { raw in
                String(decoding: raw.prefix(while: { $0 != 0 }), as: UTF8.self)
            }
            if name == "." || name == ".." { continue }
            out.append((name, Int32(e.pointee.d_type)))
        }
        return out
    }

    // MARK: Plain files directly under the version directory (the namespace store)

    /// Opens `name` (a plain file directly under the version directory) with `flags`, with
    /// the same checks as cache files: anything but a regular file of ours with one link in
    /// its place is unlinked, never followed.
    func openPlainFile(_ name: String, flags: Int32) -> Int32? {
        for _ in 0..<2 {
            let fd = openat(versionFD, name, flags | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC, 0o600)
            if fd < 0 {
                guard errno == ELOOP else { return nil }
                unlinkat(versionFD, name, 0)
                continue
            }
            if isOwnRegularFile(fd) { return fd }
            close(fd)
            unlinkat(versionFD, name, 0)
        }
        return nil
    }

    /// Replaces `name` with `bytes`, crash-safely: a temporary file, fsync, rename.
    func replacePlainFile(_ name: String, with bytes: [UInt8]) -> Bool {
        let temp = "\(name).tmp\(getpid())-\(UInt32.random(in: 0...UInt32.max))"
        let fd = openat(versionFD, temp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
        guard fd >= 0 else { return false }
        var done = 0
        while done < bytes.count {
            let n = bytes.withUnsafeBytes { write(fd, $0.baseAddress! + done, $0.count - done) }
            if n <= 0 { break }
            done += n
        }
        let ok = done == bytes.count && fsync(fd) == 0
        close(fd)
        guard ok, renameat(versionFD, temp, versionFD, name) == 0 else {
            unlinkat(versionFD, temp, 0)
            return false
        }
        return true
    }

    /// A new file under the version directory, opened read-write, with a temporary name of
    /// its own (`name.tmpPID-RANDOM`, which `removeTemporaryPlainFiles` clears after a crash).
    /// `commitTemporary` renames it into place; `unlinked` removes the name at once (a scratch
    /// file nobody else can open, gone when closed). nil and errno on failure.
    func createTemporary(for name: String, unlinked: Bool = false) -> (fd: Int32, name: String)? {
        let temp = "\(name).tmp\(getpid())-\(UInt32.random(in: 0...UInt32.max))"
        let fd = openat(versionFD, temp, O_RDWR | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0o600)
        guard fd >= 0 else { return nil }
        if unlinked { unlinkat(versionFD, temp, 0) }
        return (fd, temp)
    }

    /// Renames a file made by `createTemporary` to `name` (replacing what was there).
    func commitTemporary(_ temp: String, as name: String) -> Bool {
        renameat(versionFD, temp, versionFD, name) == 0
    }

    /// Removes `name` directly under the version directory (the name only).
    func removePlainFile(_ name: String) {
        unlinkat(versionFD, name, 0)
    }

    /// Regular files directly under the version directory whose names end in `suffix`, with
    /// their modification times (seconds).
    func plainFiles(endingWith suffix: String) -> [(name: String, mtime: Int)] {
        entries(of: versionFD).compactMap { name, _ in
            guard name.hasSuffix(suffix) else { return nil }
            var st = stat()
            guard fstatat(versionFD, name, &st, AT_SYMLINK_NOFOLLOW) == 0, st.st_mode & S_IFMT == S_IFREG else { return nil }
            return (name, st.st_mtim.tv_sec)
        }
    }

    /// Removes temporary files a crashed `replacePlainFile` left: all of them (`all`, nobody
    /// else uses the directory), else those older than `temporaryAge` (another mount may be
    /// writing one now).
    func removeTemporaryPlainFiles(all: Bool = true) {
        for (name, _) in entries(of: versionFD) where name.contains(".tmp") && (all || !isRecent(versionFD, name)) {
            unlinkat(versionFD, name, 0)
        }
    }

    private func isOwnRegularFile(_ fd: Int32) -> Bool {
        var st = stat()
        return fstat(fd, &st) == 0 && st.st_mode & S_IFMT == S_IFREG && st.st_uid == owner && st.st_nlink == 1
    }
}

private func errnoText() -> String { String(cString: strerror(errno)) }
