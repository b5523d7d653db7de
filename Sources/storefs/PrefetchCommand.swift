import Foundation
import Glibc
import StorefsCore
import Synchronization

/// `storefs prefetch [-j N] PATH...` (docs/operations.md, "Warm-up"): reads files through
/// the mount so their blocks land in the block cache, skipping what the cache already holds
/// (`user.storefs.cached`). Progress on stderr: a redrawn line on a terminal, a plain line
/// every few seconds otherwise. Ctrl-C stops it; what was fetched stays cached.
enum PrefetchCommand {
    static let usage = "usage: storefs prefetch [-j N] PATH...   (files or directories inside a storefs mount)"

    /// A mount's root as the walk holds it: every directory and file is reached from `fd`
    /// with `openat` and must be on `device`.
    struct Root {
        let fd: Int32
        let device: dev_t
    }

    /// A directory of the walk: `components` below its root, each opened `O_NOFOLLOW`.
    struct Directory {
        let root: Int
        let components: [String]
        /// The path as the user would type it (argument + names), for messages.
        let shown: String
    }

    /// A regular file to read: `name` in `directories[directory]`.
    struct Item {
        let directory: Int
        let name: String
        let shown: String
        let size: Int64
    }

    /// What the walk found, and what it refused.
    struct Tree {
        var roots: [Root] = []
        var directories: [Directory] = []
        var items: [Item] = []
        var failures: [(String, String)] = []
        /// Entries not read on purpose (a FIFO, a device, another file system, a link where
        /// a directory was): one line each, not an error.
        var skipped: [(String, String)] = []
        var cachedFiles = 0
        var cachedBytes: Int64 = 0
    }

    /// Shared by the workers and the progress line.
    final class Progress: Sendable {
        let bytesDone = Atomic<Int64>(0)
        let filesDone = Atomic<Int>(0)
        let next = Atomic<Int>(0)
        let workersDone = Atomic<Int>(0)
        let failures = Mutex<[(String, String)]>([])
        let skipped = Mutex<[(String, String)]>([])
        /// The workers' threads: a read waiting on the mount ends (EINTR) only when its own
        /// thread gets the signal, so Ctrl-C is passed on to each.
        let threads = Mutex<[pthread_t]>([])
    }

    static let interrupted = Atomic<Bool>(false)

    static func run(_ arguments: [String]) -> Int32 {
        var jobs = 4
        var paths: [String] = []
        var i = 0
        while i < arguments.count {
            let a = arguments[i]
            if a == "-h" || a == "--help" {
                print(usage)
                return 0
            } else if a == "-j" || a.hasPrefix("-j") {
                let value: String
                if a == "-j" {
                    i += 1
                    guard i < arguments.count else { return StorefsMain.fail("-j needs a number: \(usage)", status: 2) }
                    value = arguments[i]
                } else {
                    value = String(a.dropFirst(2))
                }
                guard let n = Int(value), (1...64).contains(n) else {
                    return StorefsMain.fail("-j \(value): give a number of parallel reads from 1 to 64", status: 2)
                }
                jobs = n
            } else if a == "--" {
                paths += arguments[(i + 1)...]
                break
            } else if a.hasPrefix("-") {
                return StorefsMain.fail("unknown flag '\(a)': \(usage)", status: 2)
            } else {
                paths.append(a)
            }
            i += 1
        }
        guard !paths.isEmpty else { return StorefsMain.fail("no PATH given: \(usage)", status: 2) }

        var tree = Tree()
        for p in paths {
            if interrupted.load(ordering: .relaxed) { break }
            switch locate(p) {
            case .failure(let problem):
                tree.failures.append((p, problem.message))
            case .success(let (root, components)):
                tree.roots.append(root)
                walk(shown: p, root: tree.roots.count - 1, components: components, into: &tree)
            }
        }
        defer { for root in tree.roots { close(root.fd) } }
        let items = tree.items
        let total = items.reduce(Int64(0)) { $0 + $1.size }
        let work = (items: items, directories: tree.directories, roots: tree.roots)
        installInterruptHandler()
        let progress = Progress()
        let started = Date()
        var running: [Thread] = []
        for _ in 0..<min(jobs, max(1, items.count)) {
            let t = Thread {
                var set = sigset_t()
                sigemptyset(&set)
                sigaddset(&set, SIGINT)
                pthread_sigmask(SIG_UNBLOCK, &set, nil)
                progress.threads.withLock { $0.append(pthread_self()) }
                worker(work.items, work.directories, work.roots, progress)
                progress.workersDone.add(1, ordering: .releasing)
            }
            t.start()
            running.append(t)
        }
        let terminal = isatty(2) != 0
        var lastLine = Date.distantPast
        var lastKick = Date.distantPast
        while progress.workersDone.load(ordering: .acquiring) < running.count {
            usleep(100_000)
            let now = Date()
            if interrupted.load(ordering: .relaxed), now.timeIntervalSince(lastKick) >= 1 {
                lastKick = now
                for t in progress.threads.withLock({ $0 }) { pthread_kill(t, SIGINT) }
            }
            if now.timeIntervalSince(lastLine) >= (terminal ? 0.25 : 5) {
                lastLine = now
                report(progress, total: total, files: items.count, started: started, terminal: terminal, final: false)
            }
        }
        report(progress, total: total, files: items.count, started: started, terminal: terminal, final: true)
        let failures = tree.failures + progress.failures.withLock { $0 }
        let skipped = tree.skipped + progress.skipped.withLock { $0 }
        let line = "storefs prefetch: \(progress.filesDone.load(ordering: .relaxed)) of \(items.count) files fetched "
            + "(\(bytes(progress.bytesDone.load(ordering: .relaxed)))), \(tree.cachedFiles) already cached (\(bytes(tree.cachedBytes)))"
        FileHandle.standardError.write(Data((line + "\n").utf8))
        // Names come from the bucket: escaped, so none can drive the terminal (Log.escaped).
        for (path, why) in skipped {
            FileHandle.standardError.write(Data("storefs prefetch: skipped \(Log.escaped(path)): \(Log.escaped(why))\n".utf8))
        }
        for (path, why) in failures {
            FileHandle.standardError.write(Data("storefs prefetch: could not fetch \(Log.escaped(path)): \(Log.escaped(why))\n".utf8))
        }
        if interrupted.load(ordering: .relaxed) {
            FileHandle.standardError.write(Data("storefs prefetch: interrupted; what was fetched stays in the cache\n".utf8))
            return 130
        }
        return failures.isEmpty ? 0 : 1
    }

    // MARK: Finding the mount's root

    /// The storefs mount `path` lies in, as a descriptor of its root, and the names leading
    /// from there to `path`. `realpath` resolves the argument once (links the user typed, or a
    /// link of the bucket that leads into a mount, are fine: what it names must be inside a
    /// storefs mount); from then on nothing is looked up by path. The components are walked
    /// from `/` with `O_PATH | O_NOFOLLOW` (no directory is opened for reading on the way),
    /// and the root is where the device of the final entry begins.
    static func locate(_ path: String) -> Result<(Root, [String]), Problem> {
        let outside = "not a file or directory inside a storefs mount"
        guard let resolved = realpath(path, nil) else { return .failure(Problem(errnoText())) }
        let real = String(cString: resolved)
        free(resolved)
        let names = real.split(separator: "/").map(String.init)
        let pathFlags = OpenFlags.path | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC
        var fds: [Int32] = []
        defer { for fd in fds { close(fd) } }
        var devices: [dev_t] = []
        func push(_ fd: Int32) -> Problem? {
            guard fd >= 0 else { return Problem(errno == ELOOP ? "\(real) changed while being resolved (a link appeared)" : errnoText()) }
            fds.append(fd)
            var st = stat()
            guard fstat(fd, &st) == 0 else { return Problem(errnoText()) }
            devices.append(st.st_dev)
            return nil
        }
        if let why = push(open("/", pathFlags)) { return .failure(why) }
        for name in names.dropLast() {
            if let why = push(openat(fds[fds.count - 1], name, pathFlags)) { return .failure(why) }
        }
        var target = stat()
        if let last = names.last {
            guard fstatat(fds[fds.count - 1], last, &target, AT_SYMLINK_NOFOLLOW) == 0 else { return .failure(Problem(errnoText())) }
            if target.st_mode & S_IFMT == S_IFDIR, let why = push(openat(fds[fds.count - 1], last, pathFlags)) {
                return .failure(why)
            }
        } else {
            target.st_dev = devices[0]
        }
        // The root: the first directory of the chain from which on every one is on the
        // device of the target.
        var first = devices.count
        while first > 0 && devices[first - 1] == target.st_dev { first -= 1 }
        guard first < devices.count else { return .failure(Problem(outside)) }
        let rootFD = openat(fds[first], ".", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard rootFD >= 0 else { return .failure(Problem(errnoText())) }
        var st = stat()
        guard fstat(rootFD, &st) == 0, st.st_dev == target.st_dev,
              PathAttributes.get(descriptor: rootFD, "user.storefs.gs_uri")?.isEmpty == false else {
            close(rootFD)
            return .failure(Problem(outside))
        }
        // fds[k] is the directory after k names: the root is after `first` of them.
        return .success((Root(fd: rootFD, device: st.st_dev), Array(names[first...])))
    }

    // MARK: The walk

    /// Opens `components` below `root` one at a time, each `O_NOFOLLOW`, and checks each is a
    /// directory on the root's device. Returns a descriptor, or why not (naming the entry).
    static func openDirectory(_ root: Root, _ components: [String]) -> Result<Int32, Problem> {
        var fd = root.fd
        var walked = ""
        for name in components {
            walked += walked.isEmpty ? name : "/" + name
            let next = openat(fd, name, O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC)
            let err = errno
            // O_DIRECTORY | O_NOFOLLOW on a link fails with ENOTDIR: say which it was.
            var st = stat()
            let isLink = next < 0 && fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 && st.st_mode & S_IFMT == S_IFLNK
            if fd != root.fd { close(fd) }
            guard next >= 0 else {
                if err == ELOOP || isLink { return .failure(Problem("\(walked) is a symbolic link now (not followed)")) }
                if err == ENOTDIR { return .failure(Problem("\(walked) is not a directory now")) }
                return .failure(Problem("\(walked): \(String(cString: strerror(err)))"))
            }
            guard fstat(next, &st) == 0, st.st_mode & S_IFMT == S_IFDIR, st.st_dev == root.device else {
                close(next)
                return .failure(Problem("\(walked) is on another file system (something is mounted there)"))
            }
            fd = next
        }
        return .success(fd == root.fd ? dup(root.fd) : fd)
    }

    /// Adds the regular files at `components` below root `rootIndex` (the entry itself, or
    /// everything under it) to `tree`: symbolic links are not followed (their targets are
    /// objects of their own), FIFOs, devices and entries of other file systems are skipped.
    static func walk(shown: String, root rootIndex: Int, components: [String], into tree: inout Tree) {
        let root = tree.roots[rootIndex]
        guard let last = components.last else {
            descend(Directory(root: rootIndex, components: [], shown: shown), root, into: &tree)
            return
        }
        let parentShown = shown.utf8.contains(UInt8(ascii: "/")) ? String(shown[..<shown.lastIndex(of: "/")!]) : "."
        switch openDirectory(root, Array(components.dropLast())) {
        case .failure(let problem):
            tree.failures.append((shown, problem.message))
        case .success(let parentFD):
            defer { close(parentFD) }
            tree.directories.append(Directory(root: rootIndex, components: Array(components.dropLast()), shown: parentShown))
            consider(last, shown: shown, in: parentFD, directory: tree.directories.count - 1, into: &tree)
        }
    }

    /// One entry of directory `directory` (open as `dirFD`).
    static func consider(_ name: String, shown: String, in dirFD: Int32, directory: Int, into tree: inout Tree) {
        if interrupted.load(ordering: .relaxed) { return }
        let parent = tree.directories[directory]
        let root = tree.roots[parent.root]
        var st = stat()
        guard fstatat(dirFD, name, &st, AT_SYMLINK_NOFOLLOW) == 0 else {
            tree.failures.append((shown, errnoText()))
            return
        }
        let type = st.st_mode & S_IFMT
        if type == S_IFLNK { return }
        guard st.st_dev == root.device else {
            tree.skipped.append((shown, "on another file system (something is mounted there), not read"))
            return
        }
        switch type {
        case S_IFREG:
            let size = Int64(st.st_size)
            if let cached = cachedBytes(dirFD, name), cached >= size {
                tree.cachedFiles += 1
                tree.cachedBytes += size
            } else {
                tree.items.append(Item(directory: directory, name: name, shown: shown, size: size))
            }
        case S_IFDIR:
            descend(Directory(root: parent.root, components: parent.components + [name], shown: shown), root, into: &tree)
        default:
            tree.skipped.append((shown, "\(fileType(type)), not a regular file: not opened"))
        }
    }

    /// Every entry of `directory`, in byte order.
    static func descend(_ directory: Directory, _ root: Root, into tree: inout Tree) {
        switch openDirectory(root, directory.components) {
        case .failure(let problem):
            tree.failures.append((directory.shown, problem.message))
        case .success(let fd):
            defer { close(fd) }
            tree.directories.append(directory)
            let index = tree.directories.count - 1
            let base = directory.shown.hasSuffix("/") ? directory.shown : directory.shown + "/"
            for name in entries(fd).sorted(by: { $0.utf8.lexicographicallyPrecedes($1.utf8) }) {
                consider(name, shown: base + name, in: fd, directory: index, into: &tree)
            }
        }
    }

    /// The names in the directory `fd` is open on (without `.` and `..`).
    static func entries(_ fd: Int32) -> [String] {
        let copy = dup(fd)
        guard copy >= 0 else { return [] }
        guard let dir = fdopendir(copy) else {
            close(copy)
            return []
        }
        defer { closedir(dir) }
        var names: [String] = []
        while let e = readdir(dir) {
            let name = withUnsafeBytes(of: e.pointee.d_name) { String(decoding: $0.prefix(while: { $0 != 0 }), as: UTF8.self) }
            if name != "." && name != ".." { names.append(name) }
        }
        return names
    }

    static func fileType(_ type: mode_t) -> String {
        switch type {
        case S_IFIFO: return "a FIFO"
        case S_IFCHR: return "a character device"
        case S_IFBLK: return "a block device"
        case S_IFSOCK: return "a socket"
        default: return "not a file or directory"
        }
    }

    // MARK: Reading

    static func worker(_ items: [Item], _ directories: [Directory], _ roots: [Root], _ progress: Progress) {
        let buffer = UnsafeMutableRawPointer.allocate(byteCount: 1 << 20, alignment: 4096)
        defer { buffer.deallocate() }
        // The directory of the last item (consecutive items mostly share one).
        var open: (index: Int, fd: Int32)? = nil
        defer { if let open { close(open.fd) } }
        while !interrupted.load(ordering: .relaxed) {
            let k = progress.next.add(1, ordering: .relaxed).oldValue
            guard k < items.count else { return }
            let item = items[k]
            let directory = directories[item.directory]
            let root = roots[directory.root]
            if open?.index != item.directory {
                if let old = open { close(old.fd) }
                open = nil
                switch openDirectory(root, directory.components) {
                case .failure(let problem):
                    progress.skipped.withLock { $0.append((item.shown, problem.message)) }
                    continue
                case .success(let fd):
                    open = (item.directory, fd)
                }
            }
            guard let dirFD = open?.fd else { continue }
            let fd: Int32
            switch openFile(dirFD, item.name, device: root.device) {
            case .skipped(let why):
                progress.skipped.withLock { $0.append((item.shown, why)) }
                continue
            case .failed(let why):
                progress.failures.withLock { $0.append((item.shown, why)) }
                continue
            case .opened(let opened):
                fd = opened
            }
            var failed: String? = nil
            while !interrupted.load(ordering: .relaxed) {
                let n = read(fd, buffer, 1 << 20)
                if n == 0 { break }
                if n < 0 {
                    if errno == EINTR { continue }
                    failed = errnoText()
                    break
                }
                progress.bytesDone.add(Int64(n), ordering: .relaxed)
            }
            // The bytes live in the block cache now: the page cache need not keep a copy.
            _ = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)
            close(fd)
            if let failed {
                progress.failures.withLock { $0.append((item.shown, failed)) }
            } else if !interrupted.load(ordering: .relaxed) {
                progress.filesDone.add(1, ordering: .relaxed)
            }
        }
    }

    /// Why a path was not walked or a directory not opened (one line, naming the entry).
    struct Problem: Error {
        let message: String
        init(_ message: String) { self.message = message }
    }

    enum Opened {
        case opened(Int32)
        case skipped(String)
        case failed(String)
    }

    /// Opens `name` in `dirFD` for reading: only a regular file of the mount (`device`), never
    /// through a link, never blocking in `open` (a FIFO put in its place would).
    static func openFile(_ dirFD: Int32, _ name: String, device: dev_t) -> Opened {
        var before = stat()
        guard fstatat(dirFD, name, &before, AT_SYMLINK_NOFOLLOW) == 0 else { return .failed(errnoText()) }
        if before.st_mode & S_IFMT == S_IFLNK { return .skipped("a symbolic link now (not followed)") }
        guard before.st_mode & S_IFMT == S_IFREG, before.st_dev == device else {
            return .skipped(before.st_dev == device ? "\(fileType(before.st_mode & S_IFMT)) now, not a regular file: not opened"
                                                    : "on another file system now (something is mounted there), not read")
        }
        // O_DIRECT: each read is one request of this thread, which Ctrl-C interrupts (a read
        // waiting on the kernel's own read-ahead only ends for SIGKILL), and the bytes do not
        // take the page cache: they are in the block cache.
        let flags = O_RDONLY | O_NOFOLLOW | O_NONBLOCK | O_NOCTTY | O_CLOEXEC
        var fd = openat(dirFD, name, flags | OpenFlags.direct)
        if fd < 0 && errno == EINVAL { fd = openat(dirFD, name, flags) }
        guard fd >= 0 else {
            return errno == ELOOP ? .skipped("a symbolic link now (not followed)") : .failed(errnoText())
        }
        var st = stat()
        guard fstat(fd, &st) == 0, st.st_mode & S_IFMT == S_IFREG, st.st_dev == device else {
            close(fd)
            return .skipped("not a regular file of the mount now: not read")
        }
        // O_NONBLOCK only mattered for opening.
        _ = fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK)
        return .opened(fd)
    }

    static func report(_ p: Progress, total: Int64, files: Int, started: Date, terminal: Bool, final: Bool) {
        let done = p.bytesDone.load(ordering: .relaxed)
        let elapsed = max(0.001, Date().timeIntervalSince(started))
        let rate = Double(done) / elapsed
        let percent = total > 0 ? Int(Double(done) * 100 / Double(total)) : 100
        var line = "prefetch: \(bytes(done)) of \(bytes(total)) (\(percent)%), \(p.filesDone.load(ordering: .relaxed))/\(files) files, "
            + "\(bytes(Int64(rate)))/s"
        if !final, rate > 0, total > done {
            let eta = Int(Double(total - done) / rate)
            line += ", ETA \(eta / 60):\(String(format: "%02d", eta % 60))"
        }
        if terminal {
            FileHandle.standardError.write(Data(("\r\u{1b}[K" + line + (final ? "\n" : "")).utf8))
        } else {
            FileHandle.standardError.write(Data((line + "\n").utf8))
        }
    }

    /// How much of `name` in `dirFD` the block cache holds (`user.storefs.cached`).
    static func cachedBytes(_ dirFD: Int32, _ name: String) -> Int64? {
        PathAttributes.get(directory: dirFD, entry: name, "user.storefs.cached", limit: 32)
            .flatMap { Int64(String(decoding: $0, as: UTF8.self)) }
    }

    /// SIGINT and SIGTERM stop the workers between reads (and interrupt a read under way:
    /// no SA_RESTART), so Ctrl-C ends it promptly with a summary.
    static func installInterruptHandler() {
        var action = sigaction()
        action.__sigaction_handler.sa_handler = { _ in PrefetchCommand.interrupted.store(true, ordering: .relaxed) }
        sigemptyset(&action.sa_mask)
        action.sa_flags = 0
        sigaction(SIGINT, &action, nil)
        sigaction(SIGTERM, &action, nil)
    }
}

/// `n` bytes for people: 1.5 GiB, 320.0 MiB, 12 B.
func bytes(_ n: Int64) -> String {
    let units = ["B", "KiB", "MiB", "GiB", "TiB"]
    var v = Double(n)
    var u = 0
    while v >= 1024 && u < units.count - 1 {
        v /= 1024
        u += 1
    }
    return u == 0 ? "\(n) B" : String(format: "%.1f %@", v, units[u])
}

private func errnoText() -> String { String(cString: strerror(errno)) }
