import FuseAdapter
import Glibc
import StorageClient
import StorefsCore

/// The `storefs` command: parse, check the bucket, then mount. Every failure before the mount
/// exists is one line on stderr (`storefs: …`) and a non-zero exit.
enum StorefsMain {
    static let version = "0.1.0"

    static func run(_ argv: [String]) -> Int32 {
        CurlGlobal.ensureInitialised()  // OpenSSL without its exit-time clean-up, before any use
        let env = ProcessInfoEnvironment.current()
        let command: MountOptions.Command
        do {
            command = try MountOptions.parse(arguments: Array(argv.dropFirst()), environment: env)
        } catch {
            return fail(error.message, status: 2)
        }
        switch command {
        case .help:
            print(MountOptions.usage)
            return 0
        case .version:
            print("storefs \(version)")
            return 0
        case .mount(let options):
            return mount(options)
        case .prefetch(let arguments):
            return PrefetchCommand.run(arguments)
        case .cache(let arguments):
            return CacheCommand.run(arguments, environment: env)
        case .manifest(let arguments):
            return ManifestCommand.run(arguments, environment: env)
        }
    }

    /// Options whose values other users should not read in /proc/PID/cmdline.
    static let secretOptions = ["api_key=", "email="]

    /// Overwrites the values of `secretOptions` in this process's own argv memory (what
    /// /proc/PID/cmdline shows) with `*`: they were parsed already. The caller's own command
    /// line (a shell, mount(8)) is out of reach; files are the safer way to pass secrets.
    static func scrubSecretsFromCommandLine() {
        let argv = CommandLine.unsafeArgv
        for i in 1..<Int(CommandLine.argc) {
            guard let arg = argv[i] else { continue }
            let length = strlen(arg)
            var at = 0
            while at < length {
                var matched: Int? = nil
                for key in secretOptions {
                    let k = Array(key.utf8)
                    if at + k.count <= length, (0..<k.count).allSatisfy({ UInt8(bitPattern: arg[at + $0]) == k[$0] }),
                       at == 0 || arg[at - 1] == 0x2C || (at == 2 && arg[0] == 0x2D && arg[1] == 0x6F) {  // an item's start ("-oKEY=" too)
                        matched = k.count
                        break
                    }
                }
                if let m = matched {
                    var v = at + m
                    while v < length, arg[v] != 0x2C { arg[v] = 0x2A; v += 1 }
                    at = v
                } else {
                    at += 1
                }
            }
        }
    }

    static func fail(_ message: String, status: Int32 = 1) -> Int32 {
        let line = "storefs: \(message)\n"
        _ = line.withCString { write(2, $0, strlen($0)) }
        return status
    }

    static func mount(_ o: MountOptions) -> Int32 {
        Log.configure(level: o.logLevel, format: o.logFormat)
        if let path = o.logFile {
            do throws(LogFile.Refused) {
                Log.use(file: try LogFile(path: absolute(path)))
            } catch {
                return fail(error.message)
            }
        }
        Metrics.shared.observeStorage()
        raiseDescriptorLimit()
        MemoryReturn.limitArenas()
        // It holds tokens and keys: no core dumps, no same-user ptrace or /proc/PID/mem.
        if !MemoryReturn.makeUndumpable() { Log.debug("prctl(PR_SET_DUMPABLE, 0) failed") }
        scrubSecretsFromCommandLine()
        let mountpoint: String
        if let fd = HandedInConnection.descriptor(in: o.mountpoint) {
            // A connection another process mounted (docs/kubernetes.md): no path to check.
            if let problem = HandedInConnection.problem(with: fd) { return fail(problem) }
            let ignored = o.fuseOptions + (o.nonempty ? ["nonempty"] : [])
            if !ignored.isEmpty {
                Log.warn("mount options are the mounter's with /dev/fd/N: these are ignored (give them to the mount that made the connection)",
                         ["ignored": ignored.joined(separator: ",")])
            }
            mountpoint = o.mountpoint
        } else {
            switch checkedMountpoint(o.mountpoint, nonempty: o.nonempty) {
            case .success(let path): mountpoint = path
            case .failure(let refusal): return fail(refusal.message)
            }
        }

        let env = ProcessInfoEnvironment.current()
        let store: ObjectStore
        let choice: CredentialChoice
        switch connect(o, environment: env) {
        case .success(let c): (store, choice) = (c.store, c.choice)
        case .failure(let problem): return fail(problem.message)
        }

        // Download URLs point where the mount reads (README, "Download URLs").
        let urls = DownloadURL.forMount(protocol: o.storageProtocol, endpoint: o.resolvedEndpoint,
                                        signer: choice.signer, access: o.urlAccess, ownerUID: getuid())
        Log.debug(urls.summary)
        var config = Filesystem.Config(statTTL: o.statTTL, listTTL: o.listTTL, negativeTTL: o.negativeTTL,
                                       uid: o.uid ?? getuid(), gid: o.gid ?? getgid(),
                                       fileMode: o.fileMode, dirMode: o.dirMode, downloadURL: urls,
                                       listingPrefetch: o.listAhead, metadataCacheSize: o.metadataCacheSize)
        config.posixMetadata = o.posixMetadata
        config.fileModeGiven = o.fileModeGiven
        config.ownerGiven = o.uid != nil || o.gid != nil
        config.symlinks = o.symlinks
        // One cache per user by default, shared by all its mounts (docs/cache.md).
        guard let cacheDir = o.cacheDir.map(absolute) ?? CacheLocation.defaultDirectory(environment: env) else {
            return fail("no home directory to keep the block cache in: give one with -o cache_dir=DIR")
        }
        // The namespace stored beside the cache is this source's own (docs/architecture.md,
        // "Offline namespace").
        let namespaceKey = "\(o.storageProtocol.rawValue)\u{0}\(o.resolvedEndpoint)\u{0}\(o.source.bucket)\u{0}\(o.source.prefix)"
        // Before any thread exists and before the mount: a wrong endpoint, bucket or credential
        // is reported here, at the prompt, not as EIO later. An unreachable bucket with a
        // stored namespace mounts offline instead (offline=auto). A mount from a manifest lists
        // nothing: it is checked below, with the manifest's first object.
        var offlineBecause: StorageError? = nil
        var rootPage: ListPage? = nil
        if o.manifest == nil {
            do {
                rootPage = try store.checkAccess(prefix: o.source.rootListingPrefix)
            } catch {
                guard o.offline == .auto, error.code == .unreachable || error.code == .retryLimitExceeded,
                      NamespaceStore.hasStoredNamespace(cacheDirectory: cacheDir, source: namespaceKey) else {
                    return fail(error.message)
                }
                offlineBecause = error
            }
        }
        // Every thread the daemon runs comes from these pools, made here once; none starts
        // before its first job, after daemonizing.
        let pools = WorkerPools()
        let cache: BlockCache
        let namespace: NamespaceStore?
        do {
            cache = try BlockCache(directory: cacheDir, capacity: o.cacheSize ?? CacheLocation.defaultSize(directory: cacheDir),
                                   blockSize: o.blockSize, directWrites: o.cacheIO == .direct)
            namespace = o.manifest == nil ? try NamespaceStore(cacheDirectory: cacheDir, source: namespaceKey, writer: pools.namespace) : nil
        } catch {
            return fail(error.message)
        }
        var manifest: ManifestNamespace? = nil
        if let path = o.manifest {
            switch ManifestCommand.openForMount(absolute(path), o, cacheDirectory: cacheDir, store: store) {
            case .success(let (opened, unreachable)):
                manifest = opened
                offlineBecause = unreachable
            case .failure(let problem):
                return fail(problem.message)
            }
        }
        var metrics: MetricsServer? = nil
        if let address = o.metrics {
            do throws(MetricsServer.Refused) {
                metrics = try MetricsServer(address)
            } catch {
                return fail(error.message)
            }
            // A taken port does not keep the mount down (a restart racing another process for it).
            if let problem = metrics?.bindProblem { Log.warn(problem) }
        }
        let reader = BlockReader(store: store, cache: cache, endpoint: o.resolvedEndpoint,
                                 config: .init(blockSize: o.blockSize, readAhead: o.readAhead ?? o.memoryLimit,
                                               parallel: o.parallel ?? MountOptions.maxParallel,
                                               memoryLimit: o.memoryLimit, cacheWrites: o.cacheWrites,
                                               adaptive: o.parallel == nil, wholeObjectLimit: o.wholeFileLimit),
                                 pools: pools)
        let fs = Filesystem(store: store, reference: o.source, config: config, reader: reader, namespace: namespace, manifest: manifest)
        if let offlineBecause {
            fs.startOffline(offlineBecause)
            Log.warn("\(offlineBecause.message): mounting offline from what \(cacheDir) holds (offline=auto); uncached reads fail with EIO until the bucket answers")
        }
        // Last thing before daemonizing, once the mount is sure to go ahead (a failure is one line).
        if o.logFile == nil && !o.foreground && access("/dev/log", W_OK) != 0 {
            Log.warn("no syslog here (/dev/log is missing): the daemon's log lines will be lost; give -o log_file=PATH to keep them")
        }
        let settings = FuseSession.Settings(mountpoint: mountpoint, fsname: o.sourceText,
                                            foreground: o.foreground, debug: o.debug && o.logLevel >= .trace,
                                            fuseOptions: o.fuseOptions,
                                            mountFlags: [o.exec ? "exec" : "noexec", o.suid ? "suid" : "nosuid",
                                                         o.dev ? "dev" : "nodev"])
        do {
            return try FuseSession.run(fs, settings, pools: pools, ready: {
                MemoryReturn.startTrimming()
                Log.startBackground()
                // After the fork: keeping a listing writes the stored namespace, whose writer
                // must belong to the daemon, not to the launcher.
                if let rootPage { fs.keepFirstPage("", rootPage) }
                metrics?.start(render: { fs.prometheusText() })
                cache.recordOwner(mountpoint: mountpoint)
            })
        } catch {
            return fail(error.message)
        }
    }
}

extension StorefsMain {
    /// What a command reads SOURCE through.
    struct Connection {
        var store: ObjectStore
        var choice: CredentialChoice
    }

    struct Problem: Error {
        let message: String
    }

    /// The store of `o`'s SOURCE, endpoint and credentials (README, "Which credentials a mount
    /// uses"): the mount's and `storefs manifest`'s.
    static func connect(_ o: MountOptions, environment env: [String: String]) -> Result<Connection, Problem> {
        let trust: TrustStore?
        do {
            trust = try TrustStore.chosen(caFile: o.caFile.map(absolute), environment: env)
        } catch {
            return .failure(Problem(message: error.message))
        }
        if let trust { Log.debug("tls trust=\"\(trust.summary)\" http_version=\(o.httpVersion.rawValue)") }
        let http = HTTPClient(timeouts: .init(connect: o.connectTimeout, response: o.responseTimeout),
                              userAgent: "storefs/\(version)", httpVersion: o.httpVersion, trust: trust)
        let retry = RetryPolicy(budget: o.requestTimeout)
        AuthLog.authSink = { message in Log.debug(message) }
        do {
            let choice = try CredentialChoice.resolve(o, environment: env, http: http)
            Log.debug("credentials=\(choice.summary) protocol=\(o.storageProtocol.rawValue) endpoint=\(o.resolvedEndpoint)")
            let store: ObjectStore
            switch o.storageProtocol {
            case .gcs:
                store = try GCSJSONStore(bucket: o.source.bucket, endpoint: o.resolvedEndpoint, http: http,
                                         credentials: choice.credentials, retry: retry)
            case .firebase:
                store = try FirebaseV0Store(bucket: o.source.bucket, endpoint: o.resolvedEndpoint, http: http,
                                            credentials: choice.credentials, retry: retry)
            }
            return .success(Connection(store: store, choice: choice))
        } catch {
            return .failure(Problem(message: error.message))
        }
    }
}

/// Why a mount point given as a path cannot be mounted on, as one line.
struct MountpointRefusal: Error {
    let message: String
}

/// The absolute, checked mount point for `given`: an existing, empty (unless `nonempty`)
/// directory that is not a mount point already nor a dead FUSE mount.
private func checkedMountpoint(_ given: String, nonempty: Bool) -> Result<String, MountpointRefusal> {
    // fuse_daemonize() chdirs to "/": an absolute mountpoint is needed to unmount later.
    guard let resolved = realpath(given, nil) else {
        let err = errno
        if err == ENOTCONN {
            return .failure(MountpointRefusal(message: "mountpoint \(given) is a dead FUSE mount (its daemon was killed): run fusermount3 -u \(given), then mount again"))
        }
        if err == ENOENT {
            return .failure(MountpointRefusal(message: "mountpoint \(given) does not exist: create it with mkdir -p \(given)"))
        }
        return .failure(MountpointRefusal(message: "mountpoint \(given): \(String(cString: strerror(err)))"))
    }
    let mountpoint = String(cString: resolved)
    free(resolved)
    var st = stat()
    guard stat(mountpoint, &st) == 0 else {
        let err = errno
        if err == ENOTCONN {
            return .failure(MountpointRefusal(message: "mountpoint \(mountpoint) is a dead FUSE mount (its daemon was killed): run fusermount3 -u \(mountpoint), then mount again"))
        }
        return .failure(MountpointRefusal(message: "mountpoint \(mountpoint): \(String(cString: strerror(err)))"))
    }
    guard st.st_mode & S_IFMT == S_IFDIR else {
        return .failure(MountpointRefusal(message: "mountpoint \(mountpoint) is not a directory"))
    }
    if let live = mountedAt(mountpoint) {
        return .failure(MountpointRefusal(message: "mountpoint \(mountpoint) is already a mount point (\(live)): unmount it first (umount \(mountpoint))"))
    }
    if !nonempty, isNonEmptyDirectory(mountpoint) {
        return .failure(MountpointRefusal(message: "mountpoint \(mountpoint) is not empty: the mount would hide its contents; give -o nonempty to mount over it anyway"))
    }
    return .success(mountpoint)
}

/// Raises the soft limit on open files to the hard one: every open file of the mount holds a
/// cache descriptor, and other users of an `allow_other` mount choose how many files are open
/// (docs/security.md, "Local users on an allow_other mount").
private func raiseDescriptorLimit() {
    var limit = rlimit()
    let resource = __rlimit_resource_t(RLIMIT_NOFILE.rawValue)
    guard getrlimit(resource, &limit) == 0, limit.rlim_cur < limit.rlim_max else { return }
    let soft = limit.rlim_cur
    limit.rlim_cur = limit.rlim_max
    if setrlimit(resource, &limit) != 0 {
        Log.debug("cannot raise the open-file limit", ["soft": String(soft), "hard": String(limit.rlim_max)])
    }
}

/// `path` made absolute against the working directory (the daemon later runs in `/`).
func absolute(_ path: String) -> String {
    if path.hasPrefix("/") { return path }
    guard let cwd = getcwd(nil, 0) else { return path }
    defer { free(cwd) }
    return String(cString: cwd) + "/" + path
}

enum ProcessInfoEnvironment {
    static func current() -> [String: String] {
        var env: [String: String] = [:]
        var p = environ
        while let entry = p.pointee {
            let s = String(cString: entry)
            if let eq = s.firstIndex(of: "=") { env[String(s[..<eq])] = String(s[s.index(after: eq)...]) }
            p += 1
        }
        return env
    }
}

/// What is mounted at `path` ("fuse.storefs gs://b"), if `path` is a mount point.
func mountedAt(_ path: String) -> String? {
    MountTable.current()?.mount(at: path).map { "\($0.type) \($0.source)" }
}

/// Whether the directory has any entry besides `.` and `..`.
func isNonEmptyDirectory(_ path: String) -> Bool {
    guard let dir = opendir(path) else { return false }
    defer { closedir(dir) }
    while let e = readdir(dir) {
        let name = withUnsafeBytes(of: e.pointee.d_name) { String(decoding: $0.prefix(while: { $0 != 0 }), as: UTF8.self) }
        if name != "." && name != ".." { return true }
    }
    return false
}

