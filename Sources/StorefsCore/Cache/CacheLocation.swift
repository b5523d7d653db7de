import Glibc

/// Where the block cache lives and how large it may grow when the options do not say.
public enum CacheLocation {
    /// `/var/cache/storefs` for root, else `$XDG_CACHE_HOME/storefs` or `~/.cache/storefs`
    /// (home from `HOME`, else the password database). nil when there is no home: never a
    /// guessable shared place such as `/tmp`, where another user could be there first.
    ///
    /// One cache per user, shared by every mount of that user (docs/cache.md): files are keyed
    /// by endpoint, bucket, object name and generation, so mounts of different sources keep
    /// apart within it, and mounts of one bucket (other mount points, other prefixes) share
    /// what they read. Versions before it kept a cache per source, in a subdirectory named by
    /// a hash of endpoint, bucket and prefix; `storefs cache status|clear` still find those.
    public static func defaultDirectory(environment: [String: String]) -> String? {
        if geteuid() == 0 { return "/var/cache/storefs" }
        if let xdg = environment["XDG_CACHE_HOME"], xdg.hasPrefix("/") { return xdg + "/storefs" }
        guard let home = environment["HOME"].flatMap({ $0.hasPrefix("/") ? $0 : nil }) ?? passwordHome() else { return nil }
        return home + "/.cache/storefs"
    }

    private static func passwordHome() -> String? {
        var pw = passwd()
        var result: UnsafeMutablePointer<passwd>? = nil
        var buffer = [CChar](repeating: 0, count: 16384)
        guard getpwuid_r(geteuid(), &pw, &buffer, buffer.count, &result) == 0, result != nil, let dir = pw.pw_dir else { return nil }
        let home = String(cString: dir)
        return home.hasPrefix("/") && home != "/" ? home : nil
    }

    /// 10 GiB, or half of the free space of the file system holding `directory` if that is
    /// less (at least 256 MiB), measured at mount.
    public static func defaultSize(directory: String) -> Int64 {
        let tenGiB: Int64 = 10 << 30
        var probe = directory
        var st = statvfs()
        while statvfs(probe, &st) != 0 {
            guard let slash = probe.lastIndex(of: "/"), probe != "/" else { return tenGiB }
            probe = slash == probe.startIndex ? "/" : String(probe[..<slash])
        }
        let free = Int64(st.f_bavail) * Int64(st.f_frsize)
        return max(256 << 20, min(tenGiB, free / 2))
    }
}
