import Foundation
import Glibc
import Testing
@testable import StorefsCore
import StorefsTestSupport

/// `log_file=` as another local user would attack it (docs/security.md, "The log file"). These
/// run as root (as CI does): "another user" is uid 65534, made the owner with chown.
@Suite struct LogFileTests {
    let base = temporaryDirectory()
    static let other: uid_t = 65534

    func refusal(_ path: String) -> String? {
        do {
            try LogFile(path: path).close()
            return nil
        } catch {
            return error.message
        }
    }

    func contents(_ path: String) -> String? {
        FileManager.default.contents(atPath: path).map { String(decoding: $0, as: UTF8.self) }
    }

    @Test func anAncestorAnotherUserOwnsIsRefusedByName() throws {
        let theirs = base + "/theirs"
        mkdir(theirs, 0o755)
        try #require(chown(theirs, Self.other, Self.other) == 0, "these tests need root")
        let why = try #require(refusal(theirs + "/storefs.log"))
        #expect(why.contains("its parent \(theirs) is owned by uid 65534, not by root or uid 0"), "\(why)")
        #expect(!FileManager.default.fileExists(atPath: theirs + "/storefs.log"))
    }

    @Test func anAncestorOthersMayWriteWithoutTheStickyBitIsRefused() throws {
        let open = base + "/open"
        mkdir(open, 0o777)
        chmod(open, 0o777)
        let why = try #require(refusal(open + "/storefs.log"))
        #expect(why.contains("its parent \(open) is writable by other users without the sticky bit"), "\(why)")
        // With the sticky bit (as /tmp has) it is fine: the file itself is checked.
        chmod(open, 0o1777)
        #expect(refusal(open + "/storefs.log") == nil)
    }

    @Test func aLinkOnTheWayAnotherUserOwnsIsRefused() throws {
        let chosen = base + "/chosen"
        mkdir(chosen, 0o755)
        symlink(chosen, base + "/theirlink")
        try #require(lchown(base + "/theirlink", Self.other, Self.other) == 0, "these tests need root")
        let why = try #require(refusal(base + "/theirlink/storefs.log"))
        #expect(why.contains("\(base)/theirlink is a symbolic link owned by uid 65534"), "\(why)")
        #expect(!FileManager.default.fileExists(atPath: chosen + "/storefs.log"))
    }

    /// SIGHUP after logrotate: the file is made again in the directory it was first opened
    /// in, even when a link on its path names another directory by then.
    @Test func reopeningStaysInTheDirectoryFirstOpened() throws {
        let first = base + "/first", other = base + "/other", link = base + "/current"
        mkdir(first, 0o755)
        mkdir(other, 0o755)
        let victim = other + "/storefs.log"
        _ = FileManager.default.createFile(atPath: victim, contents: Data("root's own\n".utf8), attributes: [.posixPermissions: 0o600])
        symlink(first, link)
        let log = try LogFile(path: link + "/storefs.log")
        log.write("one\n")
        rename(first + "/storefs.log", first + "/storefs.log.1")
        unlink(link)
        symlink(other, link)
        let fresh = try log.reopened()
        log.close()
        fresh.write("two\n")
        fresh.close()
        #expect(contents(victim) == "root's own\n")
        #expect(contents(first + "/storefs.log") == "two\n")
        #expect(contents(first + "/storefs.log.1") == "one\n")
    }
}
