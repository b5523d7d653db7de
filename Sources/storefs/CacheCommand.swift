import Foundation
import Glibc
import StorefsCore

/// `storefs cache status [CACHE_DIR]` and `storefs cache clear [--force] [CACHE_DIR]`
/// (docs/operations.md, "Cache tools"). Without CACHE_DIR: the default cache (one per user)
/// and the per-source caches older versions made under it. `status` only reads (it works
/// beside live mounts and lists them); `clear` empties a cache no mount uses, and refuses one
/// that mounts use, naming them, unless `--force`, which asks each of their daemons to empty
/// it (the daemons own a cache they use: nobody else deletes files under it).
enum CacheCommand {
    static let usage = "usage: storefs cache status [CACHE_DIR] | storefs cache clear [--force] [CACHE_DIR]"
    static let clearAttribute = "user.storefs.control.clear_cache"

    static func run(_ arguments: [String], environment: [String: String]) -> Int32 {
        guard let verb = arguments.first else { return StorefsMain.fail("no command: \(usage)", status: 2) }
        var force = false
        var dirs: [String] = []
        for a in arguments.dropFirst() {
            if a == "--force" && verb == "clear" {
                force = true
            } else if a.hasPrefix("-") {
                return StorefsMain.fail("unknown flag '\(a)': \(usage)", status: 2)
            } else {
                dirs.append(a)
            }
        }
        guard verb == "status" || verb == "clear" else {
            return StorefsMain.fail("unknown cache command '\(verb)': \(usage)", status: 2)
        }
        if dirs.isEmpty {
            guard let root = CacheLocation.defaultDirectory(environment: environment) else {
                return StorefsMain.fail("no home directory, so no default cache root: give CACHE_DIR", status: 2)
            }
            dirs = cachesUnder(root)
            if dirs.isEmpty {
                print("no storefs caches under \(Log.escaped(root))")
                return 0
            }
        }
        var status: Int32 = 0
        for dir in dirs {
            let rc = verb == "status" ? showStatus(dir) : clear(dir, force: force)
            if rc != 0 { status = rc }
        }
        return status
    }

    /// The caches (directories holding `v1/`) at the default root: the root itself, and the
    /// per-source subdirectories older versions made.
    static func cachesUnder(_ root: String) -> [String] {
        let names = (try? FileManager.default.contentsOfDirectory(atPath: root)) ?? []
        return ([root] + names.sorted().map { root + "/" + $0 }).filter { dir in
            var st = stat()
            return lstat(dir + "/v\(versionNumber)", &st) == 0 && st.st_mode & S_IFMT == S_IFDIR
        }
    }

    static var versionNumber: Int { BlockCache.formatVersion }

    /// Where mounts from a manifest keep its index (docs/manifest.md).
    static let manifestIndexes = "mf-v1"

    /// A mount using a cache: from its slot file (`mounts-v1/NNN`), or for an older storefs
    /// version, which holds the cache alone (`older`), from `v1/.lock`.
    struct Holder {
        var mount = CacheMount()
        var older = false

        var pid: Int? { mount.pid }
        var mountpoint: String? { mount.mountpoint }
        var capacity: Int64? { mount.capacity }
        var shown: String { "pid \(pid.map(String.init) ?? "?") mounted at \(mountpoint.map(Log.escaped) ?? "?")" }
    }

    /// Every mount using the cache at `dirFD` now: the live slots, or an older version.
    static func holders(_ dirFD: Int32) -> [Holder] {
        if let older = holder(dirFD) { return [older] }
        return BlockCache.liveMounts(cacheDirectoryFD: dirFD).map { Holder(mount: $0) }
    }

    /// Opens `dir` itself without following a link; nil and a reason otherwise.
    static func openCacheDirectory(_ dir: String) -> (fd: Int32, error: String?) {
        let fd = open(dir, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else {
            let err = errno
            if err == ELOOP || err == ENOTDIR { return (-1, "\(Log.escaped(dir)) is not a directory (a link or a file)") }
            return (-1, "\(Log.escaped(dir)): \(String(cString: strerror(err)))")
        }
        return (fd, nil)
    }

    /// An older storefs holding the cache (exclusively), and what its lock file says; nil when
    /// none does (mounts of this version hold shared locks, found by `holders`). Each lock is
    /// probed through a descriptor of its own (a new open file description, so a lock the
    /// caller holds on `dirFD` is neither converted nor released), then closed.
    static func holder(_ dirFD: Int32) -> Holder? {
        var held = false
        let probe = openat(dirFD, ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        if probe >= 0 {
            held = flock(probe, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK
            close(probe)
        }
        let lockFD = openat(dirFD, "v\(versionNumber)/.lock", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
        var info = Holder(older: true)
        if lockFD >= 0 {
            defer { close(lockFD) }
            // Older storefs versions lock only this file.
            if flock(lockFD, LOCK_SH | LOCK_NB) != 0 && errno == EWOULDBLOCK { held = true }
            info.mount = CacheMount.record(from: lockFD)
        }
        return held ? info : nil
    }

    /// Files and disk bytes under `dirFD/name` (one level of shard directories), without
    /// following links; with `remove`, each file is unlinked as it is counted.
    static func tally(_ dirFD: Int32, _ name: String, remove: Bool) -> (files: Int, bytes: Int64) {
        let fd = openat(dirFD, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC)
        guard fd >= 0 else { return (0, 0) }
        defer { close(fd) }
        var files = 0
        var bytes: Int64 = 0
        for (entry, isDirectory) in entries(fd) {
            if isDirectory {
                let sub = tally(fd, entry, remove: remove)
                files += sub.files
                bytes += sub.bytes
                continue
            }
            guard entry != ".lock" else { continue }
            var st = stat()
            guard fstatat(fd, entry, &st, AT_SYMLINK_NOFOLLOW) == 0, st.st_mode & S_IFMT == S_IFREG else { continue }
            files += 1
            bytes += Int64(st.st_blocks) * 512
            if remove { unlinkat(fd, entry, 0) }
        }
        return (files, bytes)
    }

    static func entries(_ fd: Int32) -> [(String, Bool)] {
        let copy = dup(fd)
        guard copy >= 0, let dir = fdopendir(copy) else { return [] }
        defer { closedir(dir) }
        var out: [(String, Bool)] = []
        while let e = readdir(dir) {
            let name = withUnsafeBytes(of: e.pointee.d_name) { String(decoding: $0.prefix(while: { $0 != 0 }), as: UTF8.self) }
            if name == "." || name == ".." { continue }
            var st = stat()
            guard fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 else { continue }
            out.append((name, st.st_mode & S_IFMT == S_IFDIR))
        }
        return out
    }

    static func showStatus(_ dir: String) -> Int32 {
        let (fd, error) = openCacheDirectory(dir)
        if let error { return StorefsMain.fail("cache status: \(error)") }
        defer { close(fd) }
        // What is printed comes from the file system and from v1/.lock, which whoever owns the
        // cache wrote: control characters are escaped (Log.escaped), so none drives the terminal.
        let shown = Log.escaped(dir)
        let blocks = tally(fd, "v\(versionNumber)", remove: false)
        let namespace = tally(fd, "ns-v1", remove: false)
        let manifests = tally(fd, manifestIndexes, remove: false)
        print("cache \(shown)")
        print("  format:    v\(versionNumber) block files, ns-v1 namespace, \(manifestIndexes) manifest indexes")
        print("  objects:   \(blocks.files) cached object generations, \(bytes(blocks.bytes)) on disk (\(blocks.bytes) bytes)")
        print("  namespace: \(namespace.files) stored source(s), \(bytes(namespace.bytes))")
        print("  manifests: \(manifests.files) index(es), \(bytes(manifests.bytes))")
        let using = holders(fd)
        if using.isEmpty {
            print("  cap:       set when mounted (cache_size=); the default here now is \(bytes(CacheLocation.defaultSize(directory: dir)))")
            print("  in use:    no (not mounted)")
        } else if using.count == 1, let h = using.first {
            let cap = h.capacity.map { "\(bytes($0)) (\($0) bytes)" } ?? "unknown"
            print("  cap:       \(cap), set by the mount using it")
            print("  in use:    by \(h.shown)")
        } else {
            let caps = using.compactMap { $0.capacity }
            let cap = caps.min().map { "\(bytes($0)) (\($0) bytes)" } ?? "unknown"
            print("  cap:       \(cap), the smallest cache_size of the \(using.count) mounts using it")
            print("  in use:    by \(using.count) mounts, sharing it:")
            for h in using { print("             \(h.shown)") }
        }
        if !using.isEmpty, !using[0].older, let counted = BlockCache.countedBytes(cacheDirectoryFD: fd) {
            print("  counted:   \(bytes(counted)) (\(counted) bytes) by the mounts against the cap")
        }
        return 0
    }

    static func clear(_ dir: String, force: Bool) -> Int32 {
        let (fd, error) = openCacheDirectory(dir)
        if let error { return StorefsMain.fail("cache clear: \(error)") }
        defer { close(fd) }
        let shown = Log.escaped(dir)
        var st = stat()
        guard fstat(fd, &st) == 0, st.st_uid == geteuid() else {
            return StorefsMain.fail("cache clear: \(shown) belongs to uid \(st.st_uid), not to you (uid \(geteuid())): only its owner clears it")
        }
        // The lock a mount takes, held until every deletion is done: a mount starting
        // meanwhile is refused ("in use") instead of losing the files it finds.
        if flock(fd, LOCK_EX | LOCK_NB) == 0 {
            defer { flock(fd, LOCK_UN) }
            // Older storefs versions lock only v1/.lock: that lock is held through the deletions too.
            let lockFile = openat(fd, "v\(versionNumber)/.lock", O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
            defer { if lockFile >= 0 { close(lockFile) } }
            if lockFile < 0 || flock(lockFile, LOCK_EX | LOCK_NB) == 0 {
                let blocks = tally(fd, "v\(versionNumber)", remove: true)
                let namespace = tally(fd, "ns-v1", remove: true)
                let manifests = tally(fd, manifestIndexes, remove: true)
                print("cleared \(shown): \(blocks.files) cached objects, \(namespace.files) stored namespace(s) and \(manifests.files) manifest index(es), \(bytes(blocks.bytes + namespace.bytes + manifests.bytes)) freed")
                return 0
            }
        }
        let using = holders(fd)
        let named = using.isEmpty ? "a storefs mount" : using.map(\.shown).joined(separator: ", ")
        guard force else {
            let who = using.count > 1 ? "\(using.count) storefs mounts (\(named))" : named
            return StorefsMain.fail("cache_dir \(shown) is in use by \(who): unmount first, or give --force to clear it through \(using.count > 1 ? "each of them" : "that mount")")
        }
        guard !using.isEmpty else {
            return StorefsMain.fail("cache_dir \(shown) is in use, but by no mount that says where it is: unmount it, then clear")
        }
        var status: Int32 = 0
        for h in using {
            let rc = clear(dir, through: h)
            if rc != 0 { status = rc }
        }
        return status
    }

    /// `clear --force`: asks the daemon of the mount `h` to empty the cache at `dir` (in a
    /// shared cache that empties it for every mount: each one's blocks go as it reads on).
    static func clear(_ dir: String, through h: Holder) -> Int32 {
        let shown = Log.escaped(dir)
        guard let mountpoint = h.mountpoint, mountedAt(mountpoint)?.hasPrefix("fuse.storefs") == true else {
            return StorefsMain.fail("cache_dir \(shown) is in use by \(h.shown), but that is not a storefs mount here: unmount it, then clear")
        }
        guard let answer = PathAttributes.get(mountpoint, clearAttribute),
              let obj = try? JSONSerialization.jsonObject(with: Data(answer)) as? [String: Any] else {
            return StorefsMain.fail("cache clear --force: the mount at \(Log.escaped(mountpoint)) refused (\(String(cString: strerror(errno)))): run it as the mounting user or root")
        }
        let before = (obj["before_bytes"] as? NSNumber)?.int64Value ?? 0
        let after = (obj["after_bytes"] as? NSNumber)?.int64Value ?? 0
        let served = obj["dir"] as? String ?? ""
        if served != dir, let a = realpath(served, nil), let b = realpath(dir, nil) {
            defer { free(a); free(b) }
            if strcmp(a, b) != 0 {
                return StorefsMain.fail("cache clear --force: the mount at \(Log.escaped(mountpoint)) uses \(Log.escaped(served)), not \(shown); it cleared its own cache")
            }
        }
        print("cleared \(shown) through the mount at \(Log.escaped(mountpoint)): \(bytes(before)) before, \(bytes(after)) after (blocks being read at that moment stay)")
        return 0
    }
}
