import Foundation
import Glibc
import StorageClient
import StorefsCore

/// The parsed command line: `storefs [-f] [-d] [-o OPT[,OPT...]] SOURCE MOUNTPOINT`.
///
/// Option names are the contract (README, "Options"). mount(8) noise that mount.fuse3 passes
/// through is accepted and dropped; a few FUSE options are forwarded to libfuse; anything
/// else is an error that names the option. Over 500 lines because the usage text and every
/// option's check and one-line error sit beside the option's field, so one file is the
/// contract.
public struct MountOptions: Sendable, Equatable {
    public var source: StorageReference
    /// SOURCE exactly as written: the kernel's source (`fsname`), so mount(8) finds the fstab
    /// entry mounted and `mount -a` is idempotent.
    public var sourceText: String
    public var mountpoint: String
    /// Kernel mount flags (mount(8)'s exec/noexec, suid/nosuid, dev/nodev; the last one
    /// given wins). Defaults as FUSE's: executables run, no setuid, no device files.
    public var exec = true
    public var suid = false
    public var dev = false
    /// Mount over a non-empty directory (hiding what is in it).
    public var nonempty = false
    public var foreground = false
    public var debug = false
    public var storageProtocol = StorageProtocol.gcs
    /// nil: the protocol's production origin (or an emulator variable's).
    public var endpoint: String?
    public var anonymous = false
    public var tokenFile: String?
    public var credentialsFile: String?
    public var apiKey: String?
    public var email: String?
    public var passwordFile: String?
    public var authEndpoint: String?
    /// `ca_file=`: a PEM bundle trusted instead of the system store (`TrustStore`).
    public var caFile: String?
    /// `http_version=`: over https, HTTP/1.1 (default, measured: docs/experiments.md) or HTTP/2.
    public var httpVersion = HTTPVersion.http1_1
    public var urlAccess = DownloadURL.Access.owner
    public var urlExpiry = 3600
    public var cacheDir: String?
    /// nil: the default, decided at mount from the free space (see `defaultCacheSize`).
    public var cacheSize: Int64?
    /// 16 KiB, measured (bench/run, 1 GiB): random 4 KiB reads cost a 16 KiB GET and cache write
    /// (p50 ~355 µs cold vs ~400 at 64K, ~320 at 4K) and a 16 KiB verify when cached; 4K blocks
    /// made 8 parallel readers ~20% slower (per-block bookkeeping) and cost 4 MiB of index
    /// memory per cached GiB. Sequential reads fetch whole parts (2 MiB) at any block size.
    public var blockSize = 16 << 10
    /// The widest read-ahead window of one reader; nil: `memoryLimit` (the window follows
    /// the parts in flight, docs/architecture.md, "Adaptive transfers").
    public var readAhead: Int64?
    /// Read-ahead parts in flight: nil = found from the link (2 to `maxParallel`); a number
    /// fixes it.
    public var parallel: Int?
    public static let maxParallel = 48
    public var memoryLimit: Int64 = 256 << 20
    /// Files of at most this size, with a known size, are fetched whole by their first read
    /// (docs/architecture.md, "Small files"); 0: never; nil: `wholeFileLimit`'s default.
    public var wholeFile: Int64?
    /// `whole_file=`, or by default `BlockReader.defaultWholeObjectLimit`, lowered to a quarter
    /// of `memoryLimit` where that is less (a small `memory_limit=` alone still mounts).
    public var wholeFileLimit: Int64 { wholeFile ?? min(BlockReader.defaultWholeObjectLimit, memoryLimit / 4) }
    public var cacheWrites: CacheWrites = .all
    public var cacheIO: CacheIO = .direct
    /// Sub-directories listed ahead when a directory is opened (GCS protocol only).
    public var listAhead = 128
    /// docs/security.md, "Time bounds": connection set-up, first byte / stall, and one whole
    /// storage operation with its retries.
    public var connectTimeout: Double = 10
    public var responseTimeout: Double = 10
    public var requestTimeout: Double = 60
    public var statTTL: Double = 60
    public var listTTL: Double = 60
    public var negativeTTL: Double = 5
    /// Records of names kept beyond the kernel's references (docs/architecture.md, "Metadata memory").
    public var metadataCacheSize = 262_144
    /// Whether an unreachable bucket with a namespace stored in the cache mounts offline.
    public enum Offline: String, Sendable { case auto, never }
    public var offline = Offline.auto
    public var uid: UInt32?
    public var gid: UInt32?
    public var fileModeGiven = false
    /// Honour `goog-reserved-posix-mode/uid/gid` (README, "Compatibility").
    public var posixMetadata = true
    /// Show gcsfuse's symlink objects as symbolic links.
    public var symlinks = true
    public var fileMode: UInt32 = 0o644
    public var dirMode: UInt32 = 0o755
    public var allowOther = false
    public var logLevel: LogLevel = .info
    /// docs/operations.md, "Logs": where the daemon's lines go once daemonized (nil: syslog)
    /// and how they are written.
    public var logFile: String?
    public var logFormat = LogFormat.text
    /// `metrics=HOST:PORT` or `metrics=unix:PATH`: Prometheus text at /metrics; a TCP address
    /// is loopback only unless `metricsBindAny`.
    public var metrics: MetricsServer.Address?
    public var metricsBindAny = false
    /// Options forwarded to libfuse (`allow_other`, `default_permissions`, `fsname=`…).
    public var fuseOptions: [String] = []
    /// `manifest=PATH`: names, sizes and generations from a manifest, with no list request
    /// (docs/manifest.md); `manifest_refresh=` says whether directories still follow the bucket.
    public var manifest: String?
    public var manifestRefresh = ManifestNamespace.Refresh.never

    public enum Command: Sendable, Equatable {
        case help
        case version
        case mount(MountOptions)
        /// `storefs prefetch …`, `storefs cache …` and `storefs manifest …`: the arguments after the word.
        case prefetch([String])
        case cache([String])
        case manifest([String])
    }

    public struct ParseError: Error, Sendable, Equatable, CustomStringConvertible {
        public let message: String
        public var description: String { message }
    }

    /// mount(8) / mount.fuse3 options that mean nothing to a read-only FUSE daemon.
    static let ignored: Set<String> = [
        "rw", "ro", "auto", "noauto",
        "user", "nouser", "users", "_netdev", "nofail", "defaults", "async", "sync", "atime",
        "noatime", "relatime", "norelatime", "strictatime", "diratime", "nodiratime", "loud", "silent",
    ]
    static let forwardedFlags: Set<String> = ["allow_other", "default_permissions", "allow_root", "auto_unmount"]
    static let forwardedValues: Set<String> = ["fsname", "subtype", "max_read"]

    public static let usage = """
        usage: storefs [-f] [-d] [-o OPT[,OPT...]] SOURCE MOUNTPOINT
               storefs prefetch [-j N] PATH...        (warm the block cache through a mount)
               storefs cache status|clear [--force] [CACHE_DIR]
               storefs manifest [--format csv|jsonl] [--gzip] [-o OPT,...] SOURCE > FILE
               storefs --help | --version

        Mounts a Google Cloud Storage / Firebase Storage bucket as a read-only filesystem.
        SOURCE is BUCKET, gs://BUCKET/PREFIX or https://firebasestorage.googleapis.com/v0/b/BUCKET/o/PREFIX.

          -f                 stay in the foreground (log to stderr)
          -d                 debug logging (implies -f)
          -o endpoint=URL    API origin (default https://storage.googleapis.com; STORAGE_EMULATOR_HOST sets it)
          -o protocol=P      gcs (GCS JSON API, default) or firebase (Firebase Storage v0, Security Rules)
          -o anonymous       send no credentials
          -o token_file=FILE access token (gcs) or Firebase ID token (firebase), re-read when the file changes
          -o credentials=FILE service-account or authorized-user JSON (default: GOOGLE_APPLICATION_CREDENTIALS,
                             then gcloud's application-default file, then the metadata server)
          -o api_key=KEY     Firebase Web API key: sign in anonymously, or with email=ADDR,password_file=FILE
          -o auth_endpoint=URL origin of the token services (emulators, tests)
          -o ca_file=FILE    PEM bundle of the CA certificates https is verified against, instead of the
                             system store (default: CURL_CA_BUNDLE or SSL_CERT_FILE if set, else the system
                             store); verification of the certificate and host name is always on
          -o http_version=V  HTTP version over https: 1.1 (default) or 2 (offered by ALPN)
          -o url_xattr=W     who may read user.storefs.download_url: owner (default), all, off
          -o url_expiry=S    lifetime of signed download URLs in seconds (default 3600, at most 604800)
          -o cache_dir=DIR   block cache directory (default $XDG_CACHE_HOME/storefs, /var/cache/storefs for root)
          -o cache_size=SIZE hard cap of the block cache, e.g. 10G (default: 10G or half the free space, if less)
          -o block_size=SIZE cache block size, a power of two from 4K to 16M (default 16K)
          -o read_ahead=SIZE largest read-ahead window of a sequential reader (default: memory_limit; 0 = off)
          -o parallel=N      read-ahead downloads in flight at once, fixed (default: found from the link, 2 to 48)
          -o memory_limit=SIZE bytes all downloads in flight may hold (default 256M)
          -o whole_file=SIZE files up to SIZE are fetched whole by their first read, one request
                             (default 4M or memory_limit/4 if less; at most 64M and memory_limit/4; 0 = off)
          -o cache_writes=W  all (default: every byte is cached, reads wait for a slow cache disk) or
                             keep_up (read-ahead the disk cannot keep up with is served uncached)
          -o cache_io=W      direct (default: parts of large files are written past the page cache) or buffered
          -o list_ahead=N    sub-directories listed ahead when a directory is opened (default 128, 0 = off)
          -o connect_timeout=S  seconds to connect to the server (default 10)
          -o response_timeout=S seconds to wait for an answer to start, or through a stall (under 1 KiB/s) (default 10)
          -o request_timeout=S  seconds one storage request may take, retries included (default 60): an
                             uncached read or lookup the server cannot answer fails with EIO by then
          -o stat_ttl=S      seconds object attributes are trusted (default 60)
          -o list_ttl=S      seconds directory listings are trusted (default 60)
          -o negative_ttl=S  seconds a missing name is remembered (default 5)
          -o offline=auto    mount an unreachable bucket from the namespace stored in the cache (auto, default)
                             or fail at once (never)
          -o manifest=PATH   names, sizes and generations from a manifest (storefs manifest, or a Storage
                             Insights inventory report: a file, its _manifest.json, or a directory of shards),
                             with no list request; indexed once into cache_dir
          -o manifest_refresh=M  never (default: the manifest is the truth) or list (a directory opened is
                             listed, and follows the bucket from then on)
          -o metadata_cache_size=N  names remembered beyond what the kernel holds: listing entries
                             and looked-up paths, each at most N, ~100 bytes a name (default 262144)
          -o uid=N,gid=N     owner shown for every file (default: the mounting user)
          -o posix_metadata=on|off  modes and owners from gsutil -P / --preserve-posix metadata (default on)
          -o symlinks=on|off gcsfuse's symlink objects are symbolic links (default on)
          -o file_mode=OCTAL mode of files (default 0644); dir_mode=OCTAL for directories (default 0755);
                             permission bits only (no setuid, setgid or sticky bit)
          -o allow_other     let other users see the mount
          -o log_level=L     error, warn, info (default), debug (a line per FUSE operation and HTTP request), trace
          -o log_file=PATH   append log lines to PATH (reopened on SIGHUP) instead of syslog
          -o log_format=F    text (default: ts=… level=… msg=… key=value) or json (one object per line)
          -o metrics=ADDR:PORT  serve Prometheus metrics at http://ADDR:PORT/metrics (loopback only unless
                             metrics_bind_any is given; every local user can scrape it), or
             metrics=unix:PATH  on a unix socket of mode 0660 (the mounting user and its group)
          -o noexec,nosuid,nodev / exec,suid,dev  kernel mount flags (default exec,nosuid,nodev)
          -o nonempty        mount over a non-empty directory (hiding its contents)
        mount(8) options such as rw, ro, _netdev, nofail, noauto, user, defaults, x-systemd.* are ignored.
        A bucket named prefetch, cache or manifest is written gs://prefetch, gs://cache, gs://manifest. See storefs(8).
        """

    public static func parse(arguments: [String], environment: [String: String]) throws(ParseError) -> Command {
        switch arguments.first {
        case "prefetch": return .prefetch(Array(arguments.dropFirst()))
        case "cache": return .cache(Array(arguments.dropFirst()))
        case "manifest": return .manifest(Array(arguments.dropFirst()))
        default: break
        }
        return try parse(arguments: arguments, environment: environment, mountpoint: true)
    }

    /// The arguments of `storefs manifest` (after its own flags): the mount's `-o` options
    /// and SOURCE, no mountpoint. `.mount` carries them (with an empty mountpoint).
    public static func parseManifestCommand(arguments: [String], environment: [String: String]) throws(ParseError) -> Command {
        try parse(arguments: arguments, environment: environment, mountpoint: false)
    }

    private static func parse(arguments: [String], environment: [String: String], mountpoint needsMountpoint: Bool) throws(ParseError) -> Command {
        var positionals: [String] = []
        var optionItems: [String] = []
        var foreground = false
        var debug = false
        var i = 0
        while i < arguments.count {
            let a = arguments[i]
            switch a {
            case "-h", "--help": return .help
            case "-V", "--version": return .version
            case "-f": foreground = true
            case "-d", "--debug": debug = true; foreground = true
            case "-s": break  // single-threaded request from old helpers: storefs always runs multi-threaded
            case "-o":
                i += 1
                guard i < arguments.count else { throw ParseError(message: "-o needs a value: -o OPT[,OPT...]") }
                optionItems += split(arguments[i])
            default:
                if a.hasPrefix("-o") && a.count > 2 {
                    optionItems += split(String(a.dropFirst(2)))
                } else if a.hasPrefix("-") && a != "-" {
                    throw ParseError(message: "unknown flag '\(a)': see storefs --help")
                } else {
                    positionals.append(a)
                }
            }
            i += 1
        }
        if !needsMountpoint {
            let usage = "usage: storefs manifest [--format csv|jsonl] [--gzip] [-o OPT,...] SOURCE > FILE"
            guard positionals.count == 1 else {
                throw ParseError(message: positionals.isEmpty ? "missing SOURCE: \(usage)"
                                 : "too many arguments (\(positionals.joined(separator: " "))): \(usage)")
            }
            positionals.append("")
        }
        guard positionals.count == 2 else {
            throw ParseError(message: positionals.count < 2
                ? "missing \(positionals.isEmpty ? "SOURCE and MOUNTPOINT" : "MOUNTPOINT"): usage: storefs [-f] [-o OPT,...] SOURCE MOUNTPOINT"
                : "too many arguments (\(positionals.joined(separator: " "))): usage: storefs [-f] [-o OPT,...] SOURCE MOUNTPOINT")
        }
        let source: StorageReference
        do {
            source = try StorageReference.parse(positionals[0])
        } catch {
            throw ParseError(message: error.message)
        }
        var o = MountOptions(source: source, sourceText: positionals[0], mountpoint: positionals[1])
        o.foreground = foreground
        o.debug = debug
        if debug { o.logLevel = .debug }

        var explicitProtocol = false
        for item in optionItems where !item.isEmpty {
            let (key, value) = keyValue(item)
            if value == nil && ignored.contains(key) { continue }
            if key.hasPrefix("x-systemd.") || key.hasPrefix("x-") || key.hasPrefix("comment=") { continue }
            switch key {
            case "endpoint":
                o.endpoint = try url(key, value)
            case "anonymous": try flag(key, value); o.anonymous = true
            case "exec", "noexec": try flag(key, value); o.exec = key == "exec"
            case "suid", "nosuid": try flag(key, value); o.suid = key == "suid"
            case "dev", "nodev": try flag(key, value); o.dev = key == "dev"
            case "nonempty": try flag(key, value); o.nonempty = true
            case "token_file": o.tokenFile = try require(key, value)
            case "protocol":
                o.storageProtocol = try choice(key, value, "gcs or firebase") { StorageProtocol(rawValue: $0.lowercased()) }
                explicitProtocol = true
            case "credentials": o.credentialsFile = try require(key, value)
            case "api_key": o.apiKey = try require(key, value)
            case "email": o.email = try require(key, value)
            case "password_file": o.passwordFile = try require(key, value)
            case "auth_endpoint": o.authEndpoint = try url(key, value)
            case "ca_file": o.caFile = try require(key, value)
            case "http_version":
                o.httpVersion = try choice(key, value, "1.1 or 2") { ["1.1": .http1_1, "2": .http2, "2.0": .http2][$0] }
            case "url_xattr":
                o.urlAccess = try choice(key, value, "owner, all or off") { DownloadURL.Access(rawValue: $0.lowercased()) }
            case "url_expiry":
                o.urlExpiry = try integer(key, value, 1...URLSigner.maxExpiry, "1 to 604800 seconds (7 days)")
            case "cache_dir": o.cacheDir = try require(key, value)
            case "cache_size": o.cacheSize = try size(key, value, min: 1 << 20)
            case "block_size":
                let b = try size(key, value, min: 4096)
                guard b <= 16 << 20, b & (b - 1) == 0 else {
                    throw ParseError(message: "block_size=\(value!) must be a power of two from 4K to 16M")
                }
                o.blockSize = Int(b)
            case "read_ahead": o.readAhead = try size(key, value, min: 0)
            case "memory_limit": o.memoryLimit = try size(key, value, min: 4 << 20)
            case "whole_file":
                let w = try size(key, value, min: 0)
                o.wholeFile = w
                guard w <= 64 << 20 else { throw ParseError(message: "whole_file=\(value!) is more than 64M") }
            case "cache_writes":
                o.cacheWrites = try choice(key, value, "all or keep_up") { CacheWrites(rawValue: $0.lowercased()) }
            case "cache_io":
                o.cacheIO = try choice(key, value, "direct or buffered") { CacheIO(rawValue: $0.lowercased()) }
            case "list_ahead": o.listAhead = try integer(key, value, 0...4096, "a whole number from 0 to 4096")
            case "parallel": o.parallel = try integer(key, value, 1...64, "a whole number from 1 to 64")
            case "connect_timeout": o.connectTimeout = try positiveSeconds(key, value)
            case "response_timeout": o.responseTimeout = try positiveSeconds(key, value)
            case "request_timeout": o.requestTimeout = try positiveSeconds(key, value)
            case "stat_ttl": o.statTTL = try seconds(key, value)
            case "list_ttl": o.listTTL = try seconds(key, value)
            case "negative_ttl": o.negativeTTL = try seconds(key, value)
            case "offline":
                guard let v = value.flatMap(Offline.init(rawValue:)) else {
                    throw ParseError(message: "offline must be auto or never (got '\(value ?? "")')")
                }
                o.offline = v
            case "manifest": o.manifest = try require(key, value)
            case "manifest_refresh":
                o.manifestRefresh = try choice(key, value, "never or list") { ManifestNamespace.Refresh(rawValue: $0.lowercased()) }
            case "metadata_cache_size":
                o.metadataCacheSize = try integer(key, value, 1024...100_000_000, "a whole number of names from 1024 to 100000000")
            case "uid": o.uid = try id(key, value)
            case "gid": o.gid = try id(key, value)
            case "file_mode": o.fileMode = try mode(key, value); o.fileModeGiven = true
            case "posix_metadata":
                o.posixMetadata = try choice(key, value, "on or off") { ["on": true, "off": false][$0.lowercased()] }
            case "symlinks":
                o.symlinks = try choice(key, value, "on or off") { ["on": true, "off": false][$0.lowercased()] }
            case "dir_mode": o.dirMode = try mode(key, value)
            case "log_level":
                o.logLevel = try choice(key, value, "one of error, warn, info, debug, trace") { LogLevel(name: $0) }
            case "log_file": o.logFile = try require(key, value)
            case "log_format":
                o.logFormat = try choice(key, value, "text or json") { LogFormat(rawValue: $0.lowercased()) }
            case "metrics":
                if let v = value, v.hasPrefix("unix:") {
                    let path = String(v.dropFirst(5))
                    guard path.hasPrefix("/") else {
                        throw ParseError(message: "metrics=\(v): give the socket's absolute path, e.g. metrics=unix:/run/storefs/metrics.sock")
                    }
                    o.metrics = .unix(path: path)
                } else {
                    let (host, port) = try hostPort(key, value)
                    o.metrics = .tcp(host: host, port: port)
                }
            case "metrics_bind_any": try flag(key, value); o.metricsBindAny = true
            case _ where forwardedFlags.contains(key) && value == nil:
                if key == "allow_other" { o.allowOther = true }
                o.fuseOptions.append(key)
            case _ where forwardedValues.contains(key) && value != nil:
                o.fuseOptions.append(item)
            default:
                throw ParseError(message: "unknown option '\(item)': see storefs --help for the options storefs accepts")
            }
        }
        // Emulator variables (docs/protocol.md §3.3): the Firebase one selects the v0 protocol.
        if o.endpoint == nil, let fb = environment["FIREBASE_STORAGE_EMULATOR_HOST"], !fb.isEmpty,
           !explicitProtocol || o.storageProtocol == .firebase {
            o.storageProtocol = .firebase
            o.endpoint = fb.contains("://") ? fb : "http://" + fb
        } else if o.endpoint == nil, o.storageProtocol == .gcs, let gcs = environment["STORAGE_EMULATOR_HOST"], !gcs.isEmpty {
            o.endpoint = gcs.contains("://") ? gcs : "http://" + gcs
            if o.tokenFile == nil && o.credentialsFile == nil { o.anonymous = true }
        }
        let sources = [o.tokenFile != nil, o.credentialsFile != nil, o.apiKey != nil].filter { $0 }.count
        if o.anonymous && sources > 0 {
            throw ParseError(message: "anonymous excludes token_file=, credentials= and api_key=: pick one way to authenticate")
        }
        if sources > 1 {
            throw ParseError(message: "token_file=, credentials= and api_key= exclude each other: pick one")
        }
        if (o.email != nil) != (o.passwordFile != nil) {
            throw ParseError(message: "email= and password_file= go together (with api_key=)")
        }
        if o.email != nil && o.apiKey == nil {
            throw ParseError(message: "email= sign-in needs the project's Web API key: add api_key=KEY")
        }
        if case .tcp(let host, let port)? = o.metrics, !o.metricsBindAny, !isLoopbackHost(host) {
            throw ParseError(message: "metrics=\(host):\(port) would serve metrics beyond this machine: use 127.0.0.1, or add metrics_bind_any if that is meant")
        }
        if o.apiKey != nil && o.storageProtocol != .firebase {
            throw ParseError(message: "api_key= signs in a Firebase user, which only the Firebase protocol accepts: add protocol=firebase")
        }
        if let w = o.wholeFile, w > o.memoryLimit / 4 {
            throw ParseError(message: "whole_file=\(w) is more than a quarter of memory_limit=\(o.memoryLimit): lower whole_file or raise memory_limit")
        }
        return .mount(o)
    }

    private static func split(_ list: String) -> [String] {
        // Commas separate options; a backslash escapes a comma inside a value (fuse_opt convention).
        var items: [String] = []
        var current = ""
        var escaped = false
        for c in list {
            if escaped { current.append(c); escaped = false; continue }
            if c == "\\" { escaped = true; continue }
            if c == "," { items.append(current); current = ""; continue }
            current.append(c)
        }
        items.append(current)
        return items
    }

    private static func keyValue(_ item: String) -> (String, String?) {
        guard let eq = item.firstIndex(of: "=") else { return (item, nil) }
        return (String(item[..<eq]), String(item[item.index(after: eq)...]))
    }

    /// `PORT` (on 127.0.0.1) or `ADDRESS:PORT`.
    private static func hostPort(_ key: String, _ value: String?) throws(ParseError) -> (String, Int) {
        let v = try require(key, value)
        let host: String
        let portText: String
        if let colon = v.lastIndex(of: ":") {
            host = String(v[..<colon])
            portText = String(v[v.index(after: colon)...])
        } else {
            host = "127.0.0.1"
            portText = v
        }
        guard !host.isEmpty, let port = Int(portText), (1...65535).contains(port) else {
            throw ParseError(message: "\(key)=\(v) is not ADDRESS:PORT such as 127.0.0.1:9464")
        }
        return (host, port)
    }

    static func isLoopbackHost(_ host: String) -> Bool {
        host == "localhost" || host.hasPrefix("127.")
    }

    private static func require(_ key: String, _ value: String?) throws(ParseError) -> String {
        guard let value, !value.isEmpty else { throw ParseError(message: "option \(key)= needs a value") }
        return value
    }

    /// One of a fixed set of words; `names` lists them for the error.
    private static func choice<T>(_ key: String, _ value: String?, _ names: String,
                                  _ parse: (String) -> T?) throws(ParseError) -> T {
        let v = try require(key, value)
        guard let t = parse(v) else { throw ParseError(message: "\(key)=\(v) is not \(names)") }
        return t
    }

    /// A whole number in `range`; `what` says which for the error ("must be <what>").
    private static func integer(_ key: String, _ value: String?, _ range: ClosedRange<Int>, _ what: String) throws(ParseError) -> Int {
        let v = try require(key, value)
        guard let n = Int(v), range.contains(n) else { throw ParseError(message: "\(key)=\(v) must be \(what)") }
        return n
    }

    private static func url(_ key: String, _ value: String?) throws(ParseError) -> String {
        let v = try require(key, value)
        guard let origin = URLOrigin(v) else {
            throw ParseError(message: "\(key)=\(v) is not an http(s) URL such as https://storage.googleapis.com")
        }
        guard !origin.hasUserInfo else {
            // http://127.0.0.1:x@evil.example/ is evil.example: never take a URL that hides its host.
            throw ParseError(message: "\(key)= carries a user name or password (user@host): give the plain origin, credentials go in their own options")
        }
        return v
    }

    /// The API origin in effect.
    public var resolvedEndpoint: String {
        endpoint ?? (storageProtocol == .gcs ? GCSJSONStore.defaultEndpoint : FirebaseV0Store.defaultEndpoint)
    }

    private static func flag(_ key: String, _ value: String?) throws(ParseError) {
        if value != nil { throw ParseError(message: "option \(key) takes no value") }
    }

    /// A time limit: at least a tenth of a second, at most a day.
    private static func positiveSeconds(_ key: String, _ value: String?) throws(ParseError) -> Double {
        let v = try require(key, value)
        guard let d = Double(v), d.isFinite, d >= 0.1, d <= 86_400 else {
            throw ParseError(message: "\(key)=\(v) is not a number of seconds from 0.1 to 86400")
        }
        return d
    }

    private static func seconds(_ key: String, _ value: String?) throws(ParseError) -> Double {
        let v = try require(key, value)
        guard let d = Double(v), d >= 0, d.isFinite, d <= 31_536_000 else {
            throw ParseError(message: "\(key)=\(v) is not a number of seconds (0 to 31536000)")
        }
        return d
    }

    /// Sizes: a number of bytes with an optional K, M, G or T suffix (powers of 1024; `KiB`,
    /// `KB` and `k` are the same thing).
    public static func parseSize(_ text: String) -> Int64? {
        var digits = text.trimmingCharacters(in: .whitespaces)
        var unit: Int64 = 1
        let lower = digits.lowercased()
        for (suffixes, factor) in [(["tib", "tb", "t"], Int64(1) << 40), (["gib", "gb", "g"], 1 << 30),
                                   (["mib", "mb", "m"], 1 << 20), (["kib", "kb", "k"], 1 << 10), (["b"], 1)] {
            if let s = suffixes.first(where: { lower.hasSuffix($0) }) {
                digits = String(digits.dropLast(s.count))
                unit = factor
                break
            }
        }
        guard let n = Double(digits), n >= 0, n.isFinite, n * Double(unit) < 9.0e18 else { return nil }
        return Int64(n * Double(unit))
    }

    private static func size(_ key: String, _ value: String?, min: Int64) throws(ParseError) -> Int64 {
        let v = try require(key, value)
        guard let n = parseSize(v) else { throw ParseError(message: "\(key)=\(v) is not a size such as 512M or 10G") }
        guard n >= min else { throw ParseError(message: "\(key)=\(v) is too small (at least \(min) bytes)") }
        return n
    }

    private static func id(_ key: String, _ value: String?) throws(ParseError) -> UInt32 {
        let v = try require(key, value)
        guard let n = UInt32(v), n != UInt32.max else { throw ParseError(message: "\(key)=\(v) is not a numeric id") }
        return n
    }

    private static func mode(_ key: String, _ value: String?) throws(ParseError) -> UInt32 {
        let v = try require(key, value)
        guard let n = UInt32(v, radix: 8), n <= 0o7777 else {
            throw ParseError(message: "\(key)=\(v) is not an octal mode such as 0444")
        }
        guard n <= 0o777 else {
            throw ParseError(message: "\(key)=\(v) sets setuid, setgid or sticky bits, which storefs never shows: give permission bits only, such as 0555")
        }
        return n
    }
}
