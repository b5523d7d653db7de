import Glibc

/// Opening a directory by a path that other local users may have prepared (docs/security.md,
/// "The cache directory" and "The log file"): the path is walked from `/` one component at a
/// time with `openat`, and every directory on the way must be owned by root or the mounting
/// user and may be writable by others only with the sticky bit (`/tmp`); a symbolic link on
/// the way is followed only when root or the mounting user owns it. Nothing that fails is
/// ever chmodded: it is refused, by name. `cache_dir=` and `log_file=` share these rules.
enum TrustedPath {
    struct Refused: Error {
        let message: String
    }

    /// What the last directory of the path must be.
    enum Last {
        /// Held to the rules of the ones above it (the directory a log file lives in).
        case ancestor
        /// Not a link, owned by the mounting user, writable by nobody else (`cache_dir`).
        case own
    }

    /// Walks `path` (absolute) and returns a descriptor of its last directory. `subject` starts
    /// each message (`cache_dir /x`); with `create`, missing components are made (mode 0700)
    /// and `hint` says what to do when that fails.
    static func openDirectory(_ path: String, subject: String, owner: uid_t, create: Bool, last lastRule: Last,
                              hint: String = "") throws(Refused) -> Int32 {
        let components = path.split(separator: "/").map(String.init)
        var fd = open("/", O_RDONLY | O_DIRECTORY | O_CLOEXEC)
        guard fd >= 0 else { throw Refused(message: "\(subject): cannot open /: \(errnoText())") }
        var walked = ""
        for (i, name) in components.enumerated() {
            if name == "." || name == ".." {
                close(fd)
                throw Refused(message: "\(subject) contains '\(name)': give the plain absolute path")
            }
            walked += "/" + name
            let last = i == components.count - 1
            let own = last && lastRule == .own
            var st = stat()
            if fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) != 0 {
                guard errno == ENOENT, create else {
                    let why = errnoText()
                    close(fd)
                    throw Refused(message: "\(subject): cannot examine \(walked): \(why)")
                }
                if mkdirat(fd, name, 0o700) != 0 && errno != EEXIST {
                    let why = errnoText()
                    close(fd)
                    throw Refused(message: "\(subject): cannot create \(walked): \(why)\(hint)")
                }
                guard fstatat(fd, name, &st, AT_SYMLINK_NOFOLLOW) == 0 else {
                    let why = errnoText()
                    close(fd)
                    throw Refused(message: "\(subject): cannot examine \(walked): \(why)")
                }
            }
            if st.st_mode & S_IFMT == S_IFLNK {
                // A link on the way is followed only when nobody else could have made it; a
                // directory that must be our own is never a link.
                guard !own else {
                    close(fd)
                    throw Refused(message: "\(subject) is a symbolic link: give the real directory it points to")
                }
                guard st.st_uid == 0 || st.st_uid == owner else {
                    close(fd)
                    throw Refused(message: "\(subject): \(walked) is a symbolic link owned by uid \(st.st_uid), not by root or uid \(owner)")
                }
            }
            let next = openat(fd, name, O_RDONLY | O_DIRECTORY | O_CLOEXEC | (own ? O_NOFOLLOW : 0))
            let openErrno = errno
            close(fd)
            guard next >= 0 else {
                if openErrno == ENOTDIR || openErrno == ELOOP {
                    throw Refused(message: "\(subject): \(walked) is not a directory")
                }
                throw Refused(message: "\(subject): cannot open \(walked): \(String(cString: strerror(openErrno)))")
            }
            fd = next
            guard fstat(fd, &st) == 0 else {
                close(fd)
                throw Refused(message: "\(subject): cannot examine \(walked): \(errnoText())")
            }
            let mode = st.st_mode & 0o7777
            if own {
                guard st.st_uid == owner else {
                    close(fd)
                    throw Refused(message: "\(subject) is owned by uid \(st.st_uid), not by the mounting user (uid \(owner)): use a directory of your own")
                }
                guard mode & 0o022 == 0 else {
                    close(fd)
                    throw Refused(message: "\(subject) is writable by other users (mode \(octal(mode))): run chmod go-w \(path), or use a private directory")
                }
            } else {
                guard st.st_uid == 0 || st.st_uid == owner else {
                    close(fd)
                    throw Refused(message: "\(subject): its parent \(walked) is owned by uid \(st.st_uid), not by root or uid \(owner)")
                }
                guard mode & 0o022 == 0 || mode & S_ISVTX != 0 else {
                    close(fd)
                    throw Refused(message: "\(subject): its parent \(walked) is writable by other users without the sticky bit (mode \(octal(mode)))")
                }
            }
        }
        return fd
    }
}

private func errnoText() -> String { String(cString: strerror(errno)) }

/// `mode` as four octal digits (`0755`).
func octal(_ mode: mode_t) -> String {
    let s = String(mode, radix: 8)
    return String(repeating: "0", count: max(0, 4 - s.count)) + s
}
