internal import CFuse3
import Foundation
import Glibc
import StorefsCore

/// Mounts a `Filesystem`, runs the FUSE loop, and unmounts, the libfuse3 low-level way:
/// session → signal handlers → mount → (daemonize) → multi-threaded loop → drain → unmount.
public enum FuseSession {
    /// The kernel's largest request here (max_pages 256): also the read buffer size.
    public static let maxRequestSize = 1 << 20

    public struct Settings: Sendable {
        public var mountpoint: String
        public var fsname: String
        public var foreground: Bool
        public var debug: Bool
        /// Extra `-o` options for libfuse (allow_other, default_permissions, fsname=…).
        public var fuseOptions: [String]
        /// Kernel mount flags: `exec`/`noexec`, `suid`/`nosuid`, `dev`/`nodev`.
        public var mountFlags: [String]
        public var maxThreads: Int
        /// FUSE threads kept waiting for requests once a burst is over: past these, a thread
        /// that finishes a request while this many others wait ends. libfuse's default keeps
        /// every thread a burst made (issue 49, item 4; docs/architecture.md, "Threads").
        public var idleThreads: Int

        public init(mountpoint: String, fsname: String, foreground: Bool, debug: Bool, fuseOptions: [String],
                    mountFlags: [String] = ["exec", "nosuid", "nodev"], maxThreads: Int = 32, idleThreads: Int = 16) {
            self.idleThreads = idleThreads
            self.mountFlags = mountFlags
            self.mountpoint = mountpoint
            self.fsname = fsname
            self.foreground = foreground
            self.debug = debug
            self.fuseOptions = fuseOptions
            self.maxThreads = maxThreads
        }
    }

    public struct MountError: Error, CustomStringConvertible {
        public let message: String
        public var description: String { message }
    }

    /// Runs until unmounted or signalled (SIGTERM, SIGINT); returns the exit status.
    /// `ready` runs once the mount exists and this is the process that serves it (after fork).
    /// `pools`: the daemon's threads (the read and metadata workers, the kernel notifier's).
    public static func run(_ fs: Filesystem, _ settings: Settings, pools: WorkerPools,
                           ready: () -> Void) throws(MountError) -> Int32 {
        let ctx = FuseContext(fs: fs, pools: pools, fuseThreads: settings.maxThreads)
        FuseOp.nameForMetrics()
        var options = ["ro", "subtype=storefs", "default_permissions"]
        if !settings.fuseOptions.contains(where: { $0.hasPrefix("fsname=") }) {
            options.append("fsname=" + settings.fsname)
        }
        options += settings.fuseOptions.filter { $0 != "default_permissions" }
        // Values are escaped for libfuse's own splitting, so `fsname=x\,suid` stays one value
        // and cannot smuggle a mount flag in; the mount flags chosen come last, so nothing
        // before them can undo them.
        let flags = settings.mountFlags.filter { ["exec", "noexec", "suid", "nosuid", "dev", "nodev"].contains($0) }
        options = options.map(Self.escapeOption) + flags
        var argvStrings = ["storefs", "-o", options.joined(separator: ",")]
        if settings.debug { argvStrings.append("-d") }
        let argv = UnsafeMutablePointer<UnsafeMutablePointer<CChar>?>.allocate(capacity: argvStrings.count + 1)
        for (i, s) in argvStrings.enumerated() { argv[i] = strdup(s) }
        argv[argvStrings.count] = nil
        var args = fuse_args(argc: Int32(argvStrings.count), argv: argv, allocated: 0)
        defer {
            fuse_opt_free_args(&args)
            for i in 0..<argvStrings.count { free(argv[i]) }
            argv.deallocate()
        }

        var ops = makeOperations()
        let userdata = Unmanaged.passRetained(ctx).toOpaque()
        guard let se = fuse_session_new(&args, &ops, MemoryLayout<fuse_lowlevel_ops>.size, userdata) else {
            throw MountError(message: "libfuse rejected the options '\(options.joined(separator: ","))'")
        }
        ctx.attach(se)
        defer {
            ctx.attach(nil)
            fuse_session_destroy(se)
        }

        // Background jobs inherit SIGINT as ignored, and libfuse only installs its handlers
        // over SIG_DFL (docs/fuse-notes.md, item 4).
        signal(SIGINT, SIG_DFL)
        signal(SIGTERM, SIG_DFL)
        signal(SIGHUP, SIG_DFL)
        guard fuse_set_signal_handlers(se) == 0 else { throw MountError(message: "cannot install signal handlers") }
        defer { fuse_remove_signal_handlers(se) }

        guard fuse_session_mount(se, settings.mountpoint) == 0 else {
            throw MountError(message: "cannot mount on \(settings.mountpoint): is /dev/fuse available and are you allowed to mount there (root, or fusermount3 setuid)?")
        }
        var unmounted = false
        defer { if !unmounted { fuse_session_unmount(se) } }
        raiseReadahead(mountpoint: settings.mountpoint, connection: fuse_session_fd(se))

        if !settings.foreground {
            // mount(8) waits for us: the parent exits here once the mount exists.
            guard fuse_daemonize(0) == 0 else { throw MountError(message: "cannot daemonize") }
            Log.daemonized()
        }
        SignalThread.start(summary: { fs.summaryFields() })
        let notifier = KernelNotifier(se, queue: pools.notify)
        defer { notifier.stop() }
        fs.onNameChanged { parent, name in notifier.invalidateEntry(parent: parent, name: name) }
        ready()
        Log.info("mounted \(settings.fsname) on \(settings.mountpoint)")

        let config = fuse_loop_cfg_create()
        fuse_loop_cfg_set_max_threads(config, UInt32(settings.maxThreads))
        fuse_loop_cfg_set_idle_threads(config, UInt32(settings.idleThreads))
        fuse_loop_cfg_set_clone_fd(config, 0)
        let rc = fuse_session_loop_mt(se, config)
        fuse_loop_cfg_destroy(config)

        // Shutdown (docs/architecture.md, "Shutdown"): everything still running is cancelled
        // (as if interrupted) and its reply must land before the session goes away; then the
        // mount goes; only then are cache writes finished, off the user's path.
        ctx.stopping.store(true, ordering: .relaxed)
        let owed = ctx.inFlight.wait(timeout: Self.replyDrainSeconds) ? 0 : ctx.inFlight.current
        notifier.stop()
        fuse_session_unmount(se)
        unmounted = true
        Log.info("unmounted \(settings.mountpoint) (loop status \(rc))")
        if owed > 0 {
            // A worker could still reply: destroying the session under it would be a
            // use-after-free. The process ends here instead; the kernel aborts what is left.
            Log.error("shutdown: \(owed) replies still owed after \(Int(Self.replyDrainSeconds))s; exiting without waiting for them")
            _exit(rc < 0 ? 1 : 0)
        }
        ctx.stopWorkers()
        fs.finishPendingWork()
        // rc is 0 on unmount, or the number of the signal that ended the loop: both are clean.
        return rc < 0 ? 1 : 0
    }

    /// How long in-flight replies may take to land once cancelled (a transfer notices within
    /// about a second; retries and waits stop at once).
    static let replyDrainSeconds = 5.0

    /// One `-o` item as libfuse reads it: `\` and `,` inside it are escaped with `\`.
    static func escapeOption(_ item: String) -> String {
        var out = ""
        for c in item {
            if c == "\\" || c == "," { out.append("\\") }
            out.append(c)
        }
        return out
    }

    /// Writes `read_ahead_kb` of the mount's backing device so buffered sequential reads arrive
    /// as 1 MiB requests (docs/fuse-notes.md, item 3). Best effort: needs root.
    private static func raiseReadahead(mountpoint: String, connection: Int32) {
        if HandedInConnection.descriptor(in: mountpoint) != nil {
            // Handed in: the mount point may not exist in this mount namespace, and stat() of
            // the mount before the loop answers FUSE_INIT would deadlock; the connection's own
            // device names the bdi (docs/kubernetes.md, "Read-ahead").
            guard let device = HandedInConnection.device(of: connection) else {
                Log.debug("cannot raise readahead: the kernel does not name the connection's device", ["fd": String(connection)])
                return
            }
            writeReadahead(bdi: device)
            return
        }
        if let mount = MountTable.current()?.mount(at: mountpoint) { writeReadahead(bdi: mount.device) }
    }

    private static func writeReadahead(bdi: String) {
        let path = "/sys/class/bdi/\(bdi)/read_ahead_kb"
        let value = "\(maxRequestSize / 1024)\n"
        let fd = open(path, O_WRONLY)
        if fd >= 0 {
            _ = value.withCString { write(fd, $0, strlen($0)) }
            close(fd)
        } else {
            Log.debug("cannot raise readahead at \(path): \(String(cString: strerror(errno)))")
        }
    }
}
