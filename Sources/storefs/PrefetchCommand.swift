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

    struct Item {
        let path: String
        let size: Int64
    }

    /// Shared by the workers and the progress line.
    final class Progress: Sendable {
        let bytesDone = Atomic<Int64>(0)
        let filesDone = Atomic<Int>(0)
        let next = Atomic<Int>(0)
        let workersDone = Atomic<Int>(0)
        let failures = Mutex<[(String, String)]>([])
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

        var items: [Item] = []
        var failures: [(String, String)] = []
        var skipped = 0
        var skippedBytes: Int64 = 0
        for p in paths {
            guard isInsideStorefs(p) else {
                failures.append((p, "not a file or directory inside a storefs mount"))
                continue
            }
            collect(p, into: &items, failures: &failures)
        }
        // What the cache holds already is not read again.
        items = items.filter { item in
            if let cached = cachedBytes(item.path), cached >= item.size {
                skipped += 1
                skippedBytes += item.size
                return false
            }
            return true
        }
        let total = items.reduce(Int64(0)) { $0 + $1.size }
        let work = items
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
                worker(work, progress)
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
        failures += progress.failures.withLock { $0 }
        let line = "storefs prefetch: \(progress.filesDone.load(ordering: .relaxed)) of \(items.count) files fetched "
            + "(\(bytes(progress.bytesDone.load(ordering: .relaxed)))), \(skipped) already cached (\(bytes(skippedBytes)))"
        FileHandle.standardError.write(Data((line + "\n").utf8))
        for (path, why) in failures {
            FileHandle.standardError.write(Data("storefs prefetch: could not fetch \(path): \(why)\n".utf8))
        }
        if interrupted.load(ordering: .relaxed) {
            FileHandle.standardError.write(Data("storefs prefetch: interrupted; what was fetched stays in the cache\n".utf8))
            return 130
        }
        return failures.isEmpty ? 0 : 1
    }

    /// Files (not following links) under `path`, or `path` itself.
    static func collect(_ path: String, into items: inout [Item], failures: inout [(String, String)]) {
        if interrupted.load(ordering: .relaxed) { return }
        var st = stat()
        guard lstat(path, &st) == 0 else {
            failures.append((path, String(cString: strerror(errno))))
            return
        }
        switch st.st_mode & S_IFMT {
        case S_IFREG:
            items.append(Item(path: path, size: Int64(st.st_size)))
        case S_IFDIR:
            guard let dir = opendir(path) else {
                failures.append((path, String(cString: strerror(errno))))
                return
            }
            var names: [String] = []
            while let e = readdir(dir) {
                let name = withUnsafeBytes(of: e.pointee.d_name) { String(decoding: $0.prefix(while: { $0 != 0 }), as: UTF8.self) }
                if name != "." && name != ".." { names.append(name) }
            }
            closedir(dir)
            for name in names.sorted() {
                collect(path.hasSuffix("/") ? path + name : path + "/" + name, into: &items, failures: &failures)
            }
        default:
            break  // symbolic links: their targets are objects of their own
        }
    }

    static func worker(_ items: [Item], _ progress: Progress) {
        let buffer = UnsafeMutableRawPointer.allocate(byteCount: 1 << 20, alignment: 4096)
        defer { buffer.deallocate() }
        while !interrupted.load(ordering: .relaxed) {
            let k = progress.next.add(1, ordering: .relaxed).oldValue
            guard k < items.count else { return }
            let item = items[k]
            // O_DIRECT: each read is one request of this thread, which Ctrl-C interrupts (a
            // read waiting on the kernel's own read-ahead only ends for SIGKILL), and the
            // bytes do not take the page cache: they are in the block cache.
            var fd = open(item.path, O_RDONLY | O_CLOEXEC | OpenFlags.direct)
            if fd < 0 && errno == EINVAL { fd = open(item.path, O_RDONLY | O_CLOEXEC) }
            guard fd >= 0 else {
                let why = String(cString: strerror(errno))
                progress.failures.withLock { $0.append((item.path, why)) }
                continue
            }
            var failed: String? = nil
            while !interrupted.load(ordering: .relaxed) {
                let n = read(fd, buffer, 1 << 20)
                if n == 0 { break }
                if n < 0 {
                    if errno == EINTR { continue }
                    failed = String(cString: strerror(errno))
                    break
                }
                progress.bytesDone.add(Int64(n), ordering: .relaxed)
            }
            // The bytes live in the block cache now: the page cache need not keep a copy.
            _ = posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)
            close(fd)
            if let failed {
                progress.failures.withLock { $0.append((item.path, failed)) }
            } else if !interrupted.load(ordering: .relaxed) {
                progress.filesDone.add(1, ordering: .relaxed)
            }
        }
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

    /// Whether `path` lies in a storefs mount: every file and directory there answers
    /// `user.storefs.gs_uri`.
    static func isInsideStorefs(_ path: String) -> Bool {
        PathAttributes.get(path, "user.storefs.gs_uri")?.isEmpty == false
    }

    static func cachedBytes(_ path: String) -> Int64? {
        PathAttributes.get(path, "user.storefs.cached", limit: 32).flatMap { Int64(String(decoding: $0, as: UTF8.self)) }
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
