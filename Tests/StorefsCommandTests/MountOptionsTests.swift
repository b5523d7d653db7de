import Testing
import StorageClient
import StorefsCore
@testable import storefs

@Suite struct MountOptionsTests {
    func mount(_ args: [String], env: [String: String] = [:]) throws -> MountOptions {
        guard case .mount(let o) = try MountOptions.parse(arguments: args, environment: env) else {
            Issue.record("expected a mount command")
            throw MountOptions.ParseError(message: "not a mount")
        }
        return o
    }

    @Test func parsesTheContractOptions() throws {
        let o = try mount(["-f", "-o", "endpoint=http://127.0.0.1:1,anonymous,cache_dir=/c", "-o",
                           "stat_ttl=1.5,list_ttl=2,negative_ttl=0,uid=7,gid=8,file_mode=0440,dir_mode=750,allow_other,log_level=debug",
                           "gs://b/p", "/mnt"])
        #expect(o.foreground && o.anonymous && o.allowOther)
        #expect(o.source == StorageReference(bucket: "b", prefix: "p"))
        #expect(o.mountpoint == "/mnt" && o.endpoint == "http://127.0.0.1:1" && o.cacheDir == "/c")
        #expect(o.statTTL == 1.5 && o.listTTL == 2 && o.negativeTTL == 0)
        #expect(o.uid == 7 && o.gid == 8 && o.fileMode == 0o440 && o.dirMode == 0o750)
        #expect(o.logLevel == .debug && o.fuseOptions == ["allow_other"])
    }

    @Test func mountHelperArgumentOrderAndNoiseOptions() throws {
        // mount.fuse3 runs: storefs SOURCE MOUNTPOINT -o opts (options after the positionals).
        let o = try mount(["bkt", "/mnt", "-o",
                           "rw,ro,dev,suid,nodev,nosuid,_netdev,nofail,noauto,user,defaults,x-systemd.automount,x-systemd.idle-timeout=60,anonymous"])
        #expect(o.source.bucket == "bkt" && o.anonymous && o.fuseOptions.isEmpty)
    }

    @Test func emulatorHostSetsEndpointAndAnonymous() throws {
        let o = try mount(["b", "/m"], env: ["STORAGE_EMULATOR_HOST": "127.0.0.1:9023"])
        #expect(o.endpoint == "http://127.0.0.1:9023" && o.anonymous)
        let explicit = try mount(["-o", "endpoint=https://x.example", "b", "/m"], env: ["STORAGE_EMULATOR_HOST": "http://h:1"])
        #expect(explicit.endpoint == "https://x.example")
    }

    @Test(arguments: [
        (["-o", "bogus=1", "b", "/m"], "unknown option 'bogus=1'"),
        (["-o", "stat_ttl=abc", "b", "/m"], "stat_ttl=abc is not a number of seconds"),
        (["-o", "file_mode=999", "b", "/m"], "file_mode=999 is not an octal mode"),
        (["-o", "uid=-1", "b", "/m"], "uid=-1 is not a numeric id"),
        (["-o", "endpoint=ftp://x", "b", "/m"], "endpoint=ftp://x is not an http(s) URL"),
        (["-o", "log_level=loud", "b", "/m"], "log_level=loud is not one of"),
        (["-o", "anonymous=1", "b", "/m"], "option anonymous takes no value"),
        (["-o", "token_file=", "b", "/m"], "option token_file= needs a value"),
        (["-o", "anonymous,token_file=/t", "b", "/m"], "anonymous excludes"),
        (["-o", "token_file=/t,credentials=/c", "b", "/m"], "exclude each other"),
        (["-o", "api_key=k", "b", "/m"], "add protocol=firebase"),
        (["-o", "protocol=firebase,api_key=k,email=a@b", "b", "/m"], "go together"),
        (["-o", "protocol=firebase,email=a@b,password_file=/p", "b", "/m"], "needs the project's Web API key"),
        (["-o", "protocol=s3", "b", "/m"], "is not gcs or firebase"),
        (["-o", "url_xattr=some", "b", "/m"], "is not owner, all or off"),
        (["-o", "url_expiry=604801", "b", "/m"], "1 to 604800"),
        (["-o", "auth_endpoint=localhost:1", "b", "/m"], "is not an http(s) URL"),
        (["-o", "block_size=3000", "b", "/m"], "too small"),
        (["-o", "block_size=96K", "b", "/m"], "power of two"),
        (["-o", "cache_size=lots", "b", "/m"], "is not a size"),
        (["-o", "parallel=0", "b", "/m"], "from 1 to 64"),
        (["-o", "list_ahead=-1", "b", "/m"], "from 0 to 4096"),
        (["-o", "cache_writes=some", "b", "/m"], "is not all or keep_up"),
        (["-o", "cache_io=mmap", "b", "/m"], "is not direct or buffered"),
        (["-o", "file_mode=4755", "b", "/m"], "sets setuid, setgid or sticky bits"),
        (["-o", "dir_mode=2755", "b", "/m"], "sets setuid, setgid or sticky bits"),
        (["-o", "endpoint=http://127.0.0.1:x@evil.example/", "b", "/m"], "carries a user name or password"),
        (["-o", "auth_endpoint=http://u:p@127.0.0.1:9/", "b", "/m"], "carries a user name or password"),
        (["-o", "request_timeout=0", "b", "/m"], "from 0.1 to 86400"),
        (["-o", "whole_file=128M,memory_limit=1G", "b", "/m"], "is more than 64M"),
        (["-o", "whole_file=32M,memory_limit=64M", "b", "/m"], "more than a quarter of memory_limit"),
        (["-o", "response_timeout=soon", "b", "/m"], "from 0.1 to 86400"),
        (["b"], "missing MOUNTPOINT"),
        ([], "missing SOURCE and MOUNTPOINT"),
        (["a", "b", "c"], "too many arguments"),
        (["-x", "b", "/m"], "unknown flag '-x'"),
        (["-o"], "-o needs a value"),
        (["gs://", "/m"], "does not name a valid bucket"),
    ])
    func rejectsBadInputWithAMessageThatSaysWhat(args: [String], fragment: String) {
        do {
            _ = try MountOptions.parse(arguments: args, environment: [:])
            Issue.record("accepted \(args)")
        } catch {
            #expect(error.message.contains(fragment), "\(error.message)")
            #expect(!error.message.contains("\n"))
        }
    }

    @Test func firebaseProtocolAndItsEmulatorVariable() throws {
        let o = try mount(["-o", "protocol=firebase,api_key=k,email=a@b.c,password_file=/p,auth_endpoint=http://127.0.0.1:9/,url_xattr=all,url_expiry=60", "b", "/m"])
        #expect(o.storageProtocol == .firebase && o.apiKey == "k" && o.email == "a@b.c" && o.passwordFile == "/p")
        #expect(o.resolvedEndpoint == "https://firebasestorage.googleapis.com" && o.urlAccess == .all && o.urlExpiry == 60)
        let e = try mount(["b", "/m"], env: ["FIREBASE_STORAGE_EMULATOR_HOST": "127.0.0.1:9199"])
        #expect(e.storageProtocol == .firebase && e.resolvedEndpoint == "http://127.0.0.1:9199")
        let g = try mount(["b", "/m"], env: [:])
        #expect(g.storageProtocol == .gcs && g.resolvedEndpoint == "https://storage.googleapis.com" && !g.anonymous)
    }

    @Test(arguments: [("512", Int64(512)), ("64K", 65536), ("64KiB", 65536), ("1.5M", 1_572_864), ("10G", 10 << 30), ("2t", 2 << 40)])
    func sizes(text: String, bytes: Int64) {
        #expect(MountOptions.parseSize(text) == bytes)
    }

    @Test func cacheOptions() throws {
        let o = try mount(["-o", "cache_size=2G,block_size=1M,read_ahead=0,parallel=8,memory_limit=64M,list_ahead=0,cache_writes=keep_up,cache_io=buffered", "b", "/m"])
        #expect(o.cacheSize == 2 << 30 && o.blockSize == 1 << 20 && o.readAhead == 0 && o.parallel == 8 && o.memoryLimit == 64 << 20)
        let defaults = try mount(["b", "/m"])
        #expect(o.listAhead == 0 && defaults.listAhead == 128)
        #expect(o.cacheWrites == .keepUp && defaults.cacheWrites == .all)
        #expect(o.cacheIO == .buffered && defaults.cacheIO == .direct)
        #expect(defaults.wholeFileLimit == 4 << 20)
        #expect(try mount(["-o", "memory_limit=8M", "b", "/m"]).wholeFileLimit == 2 << 20)
        #expect(try mount(["-o", "whole_file=0", "b", "/m"]).wholeFileLimit == 0)
        #expect(try mount(["-o", "whole_file=2M", "b", "/m"]).wholeFileLimit == 2 << 20)
    }

    @Test func helpAndVersion() throws {
        #expect(try MountOptions.parse(arguments: ["--help"], environment: [:]) == .help)
        #expect(try MountOptions.parse(arguments: ["-V"], environment: [:]) == .version)
    }

    @Test func timeBoundsHaveDefaultsAndOptions() throws {
        let d = try mount(["b", "/m"])
        #expect(d.connectTimeout == 10 && d.responseTimeout == 10 && d.requestTimeout == 60)
        let o = try mount(["-o", "connect_timeout=2,response_timeout=1.5,request_timeout=30", "b", "/m"])
        #expect(o.connectTimeout == 2 && o.responseTimeout == 1.5 && o.requestTimeout == 30)
    }

    @Test func escapedCommaStaysInValue() throws {
        let o = try mount(["-o", "fsname=a\\,b,anonymous", "b", "/m"])
        #expect(o.fuseOptions == ["fsname=a,b"])
    }

    @Test func caFileAndHTTPVersionParse() throws {
        let o = try mount(["-o", "ca_file=/etc/ca.pem,http_version=2", "b", "/mnt"])
        #expect(o.caFile == "/etc/ca.pem" && o.httpVersion == .http2)
        let d = try mount(["b", "/mnt"])
        #expect(d.caFile == nil && d.httpVersion == .http1_1)
        #expect(throws: MountOptions.ParseError(message: "http_version=3 is not 1.1 or 2")) {
            _ = try MountOptions.parse(arguments: ["-o", "http_version=3", "b", "/mnt"], environment: [:])
        }
    }

    /// Verification is always on: no option a user could find turns it off.
    @Test(arguments: ["insecure", "ssl_verify=0", "tls_verify=off", "verify=false", "ssl_no_verify", "ca_file"])
    func nothingWeakensTLSVerification(item: String) {
        #expect(throws: MountOptions.ParseError.self) {
            _ = try MountOptions.parse(arguments: ["-o", item, "b", "/mnt"], environment: [:])
        }
    }
}
